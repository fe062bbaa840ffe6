//! `rcp doctor`: what on this host stands between the user and an RDMA copy,
//! and how to fix it.

use std::fmt;

use crate::mem::{memlock, numa};
use crate::verbs::{self, choose_gid, gid_table, Context, LinkLayer, PortState};

/// How one check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

/// One finding.
#[derive(Clone, Debug)]
pub struct Finding {
    pub name: &'static str,
    pub level: Level,
    pub detail: String,
    /// What to do about it (empty when fine).
    pub fix: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tag = match self.level {
            Level::Ok => "ok  ",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        };
        write!(f, "[{tag}] {:<10} {}", self.name, self.detail)?;
        if !self.fix.is_empty() {
            write!(f, "\n       fix: {}", self.fix)?;
        }
        Ok(())
    }
}

/// What doctor looks at.
#[derive(Clone, Debug, Default)]
pub struct DoctorOptions {
    pub device: Option<String>,
    pub gid_index: Option<u32>,
    /// The arena the daemon or client will map, in bytes.
    pub arena_bytes: u64,
    /// RDMA was asked for (`--transport verbs`): no device is then a
    /// failure, not the note that copies go over tcp.
    pub rdma_required: bool,
}

/// All findings, in order.
#[derive(Clone, Debug, Default)]
pub struct Diagnosis {
    pub checks: Vec<Finding>,
}

impl Diagnosis {
    fn push(
        &mut self,
        name: &'static str,
        level: Level,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) {
        self.checks.push(Finding {
            name,
            level,
            detail: detail.into(),
            fix: fix.into(),
        });
    }

    /// Whether RDMA verbs can be used (no failed RDMA check).
    pub fn rdma_ready(&self) -> bool {
        !self
            .checks
            .iter()
            .any(|c| c.level == Level::Fail && c.name != "rcpd")
    }

    pub fn add(&mut self, c: Finding) {
        self.checks.push(c)
    }
}

/// Run the local checks.
pub fn diagnose(opts: &DoctorOptions) -> Diagnosis {
    let mut d = Diagnosis::default();
    modules(&mut d);
    let names = verbs::device_names();
    if names.is_empty() {
        let (level, then) = if opts.rdma_required {
            (Level::Fail, "and --transport verbs asks for one")
        } else {
            (Level::Warn, "copies go over tcp (the TCP provider)")
        };
        d.push(
            "devices",
            level,
            format!("no RDMA device found (ibv_get_device_list is empty): {then}"),
            "on RDMA hardware load the driver (mlx5_ib) and install ibverbs-providers; for soft-RoCE: \
             `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev <nic>`",
        );
    } else {
        d.push(
            "devices",
            Level::Ok,
            format!("RDMA devices: {}", names.join(", ")),
            "",
        );
        device(&mut d, opts);
        rails(&mut d, &names, opts.gid_index);
    }
    memlock_check(&mut d, opts.arena_bytes);
    if names.is_empty() && !opts.rdma_required {
        // Locked memory is for RDMA registrations; tcp copies do without.
        for c in d.checks.iter_mut().filter(|c| c.name == "memlock") {
            if c.level == Level::Fail {
                c.level = Level::Warn;
                c.detail
                    .push_str(" (only RDMA needs it; copies go over tcp)");
            }
        }
    }
    hugepages(&mut d, opts.arena_bytes);
    d
}

fn modules(d: &mut Diagnosis) {
    let loaded: Vec<&str> = [
        "ib_uverbs",
        "rdma_rxe",
        "mlx5_ib",
        "irdma",
        "bnxt_re",
        "efa",
    ]
    .into_iter()
    .filter(|m| std::path::Path::new(&format!("/sys/module/{m}")).exists())
    .collect();
    let providers = std::fs::read_dir("/usr/lib/x86_64-linux-gnu/libibverbs")
        .or_else(|_| std::fs::read_dir("/usr/lib64/libibverbs"))
        .map(|r| r.filter_map(|e| e.ok()).count())
        .unwrap_or(0);
    if loaded.is_empty() {
        d.push(
            "modules",
            Level::Warn,
            "no RDMA kernel module loaded (ib_uverbs, rdma_rxe, mlx5_ib, ...)",
            "modprobe the NIC's RDMA driver (mlx5_ib) or rdma_rxe for soft-RoCE",
        );
    } else {
        d.push(
            "modules",
            Level::Ok,
            format!("kernel modules: {}", loaded.join(", ")),
            "",
        );
    }
    if providers == 0 {
        d.push(
            "providers",
            Level::Fail,
            "no libibverbs userspace providers installed",
            "apt-get install ibverbs-providers rdma-core",
        );
    } else {
        d.push(
            "providers",
            Level::Ok,
            format!("{providers} libibverbs provider libraries installed"),
            "",
        );
    }
}

fn device(d: &mut Diagnosis, opts: &DoctorOptions) {
    let ctx = match Context::open(opts.device.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            d.push(
                "device",
                Level::Fail,
                e.to_string(),
                "check --device against `ibv_devices`",
            );
            return;
        }
    };
    let caps = ctx.caps();
    d.push(
        "device",
        Level::Ok,
        format!(
            "{}: max_qp_wr {} max_cqe {} max_sge {} rd_atom {}/{} max_mr {} MiB",
            ctx.name(),
            caps.max_qp_wr,
            caps.max_cqe,
            caps.max_sge,
            caps.max_qp_rd_atom,
            caps.max_qp_init_rd_atom,
            caps.max_mr_size >> 20
        ),
        "",
    );
    let port = match ctx.active_port() {
        Ok(p) => p,
        Err(e) => {
            d.push(
                "port",
                Level::Fail,
                e.to_string(),
                "bring the netdev up (`ip link set <nic> up`) and check cabling / `rdma link`",
            );
            return;
        }
    };
    let ll = match port.link_layer {
        LinkLayer::Ethernet => "Ethernet (RoCE)",
        LinkLayer::Infiniband => "InfiniBand",
        LinkLayer::Unknown(_) => "unknown",
    };
    d.push(
        "port",
        if port.state == PortState::Active {
            Level::Ok
        } else {
            Level::Fail
        },
        format!("port {} {:?}, link layer {ll}", port.port, port.state),
        "",
    );
    let mtu_level = if port.active_mtu < 1024 {
        Level::Warn
    } else {
        Level::Ok
    };
    d.push(
        "mtu",
        mtu_level,
        format!(
            "active MTU {} bytes (the path MTU is the min of both ends)",
            port.active_mtu
        ),
        if mtu_level == Level::Warn {
            "raise the netdev MTU (RoCE MTU = largest IB MTU below the netdev MTU minus headers)"
        } else {
            ""
        },
    );
    match gid_table(&ctx, port.port, port.gid_tbl_len).map_err(|e| e.to_string()).and_then(|t| choose_gid(&t, opts.gid_index)) {
        Ok(c) => d.push("gid", Level::Ok, format!("index {} {} ({})", c.entry.index, c.entry.gid, c.reason), ""),
        Err(e) => d.push("gid", Level::Fail, e, "give the netdev an IPv4 address (RoCE v2 GIDs follow addresses) or pass --gid-index; `show_gids` lists them"),
    }
    match ctx.numa_node() {
        Some(n) => {
            let cpus = numa::node_cpus(n);
            d.push(
                "numa",
                Level::Ok,
                format!(
                    "device on NUMA node {n} (CPUs {cpus:?}): arena and completion thread go there"
                ),
                "",
            )
        }
        None => d.push(
            "numa",
            Level::Ok,
            "device reports no NUMA node (single node or software device)",
            "",
        ),
    }
}

/// Every ACTIVE port of every device, a `rail` line each (device:port, the
/// GID a QP would be addressed by, its netdev, NUMA node, MTU), then a
/// `rails` line counting them: what a session over several rails could
/// use, and the GIDs `crate::control::rails::pair` would match by subnet
/// with the peer's.
fn rails(d: &mut Diagnosis, names: &[String], gid_index: Option<u32>) {
    let mut found = Vec::new();
    for name in names {
        let ctx = match Context::open(Some(name)) {
            Ok(c) => c,
            Err(e) => {
                d.push("rail", Level::Warn, e.to_string(), "");
                continue;
            }
        };
        for p in 1..=ctx.caps().phys_port_cnt.max(1) {
            let Ok(port) = ctx.port(p) else { continue };
            if port.state != PortState::Active {
                continue;
            }
            let numa = ctx
                .numa_node()
                .map_or_else(|| "-".to_string(), |n| n.to_string());
            let rail = format!("{name}:{p}");
            match gid_table(&ctx, p, port.gid_tbl_len)
                .map_err(|e| e.to_string())
                .and_then(|t| choose_gid(&t, gid_index))
            {
                Ok(c) => d.push(
                    "rail",
                    Level::Ok,
                    format!(
                        "{rail} GID {} (index {}, netdev {}), NUMA node {numa}, MTU {}",
                        c.entry.gid,
                        c.entry.index,
                        c.entry.netdev.as_deref().unwrap_or("-"),
                        port.active_mtu
                    ),
                    "",
                ),
                Err(e) => d.push(
                    "rail",
                    Level::Warn,
                    format!("{rail}: {e}"),
                    "give the netdev an IPv4 address or pass --gid-index",
                ),
            }
            found.push(rail);
        }
    }
    if found.is_empty() {
        d.push(
            "rails",
            Level::Warn,
            "no ACTIVE port on any device",
            "bring a netdev up (`ip link set <nic> up`), check `rdma link`",
        );
    } else {
        d.push(
            "rails",
            Level::Ok,
            format!("{} ACTIVE port(s): {}", found.len(), found.join(", ")),
            "",
        );
    }
}

fn memlock_check(d: &mut Diagnosis, need: u64) {
    let limit = memlock::memlock_limit();
    let cap = memlock::has_ipc_lock();
    let shown = limit.map_or("unlimited".to_string(), |l| format!("{} KiB", l >> 10));
    match memlock::check(need, limit, cap) {
        Ok(()) => d.push(
            "memlock",
            Level::Ok,
            format!(
                "RLIMIT_MEMLOCK {shown}{}",
                if cap { ", CAP_IPC_LOCK held" } else { "" }
            ),
            "",
        ),
        Err(e) => d.push(
            "memlock",
            Level::Fail,
            format!("RLIMIT_MEMLOCK {shown} < {} KiB needed", need >> 10),
            e.to_string(),
        ),
    }
}

fn parse_meminfo(s: &str, key: &str) -> Option<u64> {
    s.lines()
        .find_map(|l| l.strip_prefix(key)?.split_whitespace().next()?.parse().ok())
}

fn hugepages(d: &mut Diagnosis, need: u64) {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let free = parse_meminfo(&info, "HugePages_Free:").unwrap_or(0);
    let size_kb = parse_meminfo(&info, "Hugepagesize:").unwrap_or(2048);
    let bytes = free * size_kb * 1024;
    let pages = need.div_ceil(2 << 20);
    if bytes >= need && free > 0 {
        d.push(
            "hugepages",
            Level::Ok,
            format!(
                "{free} free huge pages of {size_kb} KiB ({} MiB)",
                bytes >> 20
            ),
            "",
        );
    } else {
        d.push(
            "hugepages",
            Level::Warn,
            format!("{free} free huge pages ({} MiB) for a {} MiB arena: normal pages will be used", bytes >> 20, need >> 20),
            format!("echo {pages} > /proc/sys/vm/nr_hugepages (or the hugepages-2Mi resource in Kubernetes)"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_parsing() {
        let s = "MemTotal: 1 kB\nHugePages_Free:      12\nHugepagesize:       2048 kB\n";
        assert_eq!(parse_meminfo(s, "HugePages_Free:"), Some(12));
        assert_eq!(parse_meminfo(s, "Hugepagesize:"), Some(2048));
        assert_eq!(parse_meminfo(s, "Nope:"), None);
    }

    #[test]
    fn without_a_device_says_so_with_the_fix() {
        let d = diagnose(&DoctorOptions {
            arena_bytes: 64 << 20,
            ..Default::default()
        });
        let dev = d.checks.iter().find(|c| c.name == "devices").unwrap();
        if !verbs::device_names().is_empty() {
            // A host with RDMA: the device check must say so.
            assert_eq!(dev.level, Level::Ok, "{dev}");
            return;
        }
        // Copies go over tcp: a note, not a failure...
        assert_eq!(dev.level, Level::Warn, "{dev}");
        assert!(dev.detail.contains("copies go over tcp"), "{dev}");
        assert!(dev.fix.contains("rdma_rxe"), "{dev}");
        assert!(d.rdma_ready());
        // ...unless RDMA was asked for.
        let d = diagnose(&DoctorOptions {
            arena_bytes: 64 << 20,
            rdma_required: true,
            ..Default::default()
        });
        let dev = d.checks.iter().find(|c| c.name == "devices").unwrap();
        assert_eq!(dev.level, Level::Fail, "{dev}");
        assert!(!d.rdma_ready());
    }
}
