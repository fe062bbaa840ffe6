//! NUMA placement: which node a device sits on, and binding memory to it.

/// The NUMA node of an RDMA device from sysfs; `None` when the platform does
/// not say (-1, missing file, software devices such as rxe).
pub fn device_numa_node(device: &str) -> Option<u32> {
    let s =
        std::fs::read_to_string(format!("/sys/class/infiniband/{device}/device/numa_node")).ok()?;
    parse_node(&s)
}

fn parse_node(s: &str) -> Option<u32> {
    match s.trim().parse::<i64>() {
        Ok(n) if n >= 0 => Some(n as u32),
        _ => None,
    }
}

/// The CPUs of a NUMA node (from `/sys/devices/system/node/nodeN/cpulist`).
pub fn node_cpus(node: u32) -> Vec<usize> {
    std::fs::read_to_string(format!("/sys/devices/system/node/node{node}/cpulist"))
        .map(|s| parse_cpulist(&s))
        .unwrap_or_default()
}

/// Parse a kernel cpulist such as `0-3,8,10-11`.
pub fn parse_cpulist(s: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                    out.extend(a..=b);
                }
            }
            None => {
                if let Ok(a) = part.trim().parse() {
                    out.push(a)
                }
            }
        }
    }
    out
}

/// Bind `[addr, addr+len)` to `node` with `mbind(MPOL_BIND)` before its pages
/// are touched, so they fault in on the device's node.
pub(crate) fn bind_to_node(addr: *mut u8, len: usize, node: u32) -> std::io::Result<()> {
    const MPOL_BIND: libc::c_long = 2;
    if node >= 64 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "NUMA node >= 64",
        ));
    }
    let mask: u64 = 1u64 << node;
    // SAFETY: mbind only changes the policy of a mapping we own ([addr, len)
    // comes from our own mmap); the nodemask is a valid u64 with maxnode=64.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            addr as libc::c_long,
            len as libc::c_long,
            MPOL_BIND,
            &mask as *const u64 as libc::c_long,
            64 as libc::c_long,
            0 as libc::c_long,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulist() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpulist(""), Vec::<usize>::new());
    }

    #[test]
    fn node() {
        assert_eq!(parse_node("-1\n"), None);
        assert_eq!(parse_node("1\n"), Some(1));
        assert_eq!(device_numa_node("no-such-device"), None);
    }
}
