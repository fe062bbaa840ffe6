//! Typed errors for verbs calls: each names the call, the errno and what to check.

use std::fmt;

/// What the operator should look at when a verbs call fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hint {
    /// Registration failed for lack of lockable memory.
    Memlock,
    /// The GID index does not exist or does not reach the peer.
    Gid,
    /// The port is not ACTIVE.
    PortDown,
    /// An attribute mask or value the device refused.
    BadAttr,
    /// The device or its provider is gone or missing.
    Device,
    /// A queue is full or a resource limit was hit.
    Resources,
    None,
}

impl fmt::Display for Hint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Hint::Memlock => {
                "check the locked-memory limit: `ulimit -l` (raise with `ulimit -l unlimited`, \
                 LimitMEMLOCK=infinity in systemd/containerd, or the IPC_LOCK capability)"
            }
            Hint::Gid => {
                "check the GID index: `ibv_devinfo -v` / `rdma link` show the table; pick a RoCE v2 \
                 GID whose address reaches the peer (--gid-index)"
            }
            Hint::PortDown => "the port is not ACTIVE: check `rdma link` and the netdev link state",
            Hint::BadAttr => "the device refused an attribute or mask (check MTU, rd_atomic and caps)",
            Hint::Device => {
                "check that the device exists (`ibv_devices`) and its provider is installed \
                 (ibverbs-providers; rdma_rxe loaded for soft-RoCE)"
            }
            Hint::Resources => "a device limit was reached (queue depth, CQEs, MRs): see `ibv_devinfo -v`",
            Hint::None => "",
        })
    }
}

/// A failed verbs call.
#[derive(Debug, thiserror::Error)]
// The OS error once: its text already ends with "(os error N)".
#[error("{call} failed: {}{}{}", std::io::Error::from_raw_os_error(*.errno), ctx_sep(.context), hint_sep(.hint))]
pub struct VerbsError {
    /// The libibverbs function that failed.
    pub call: &'static str,
    pub errno: i32,
    /// What we were doing (device name, QP number, sizes).
    pub context: String,
    pub hint: Hint,
}

fn ctx_sep(c: &str) -> String {
    if c.is_empty() {
        String::new()
    } else {
        format!(" while {c}")
    }
}

fn hint_sep(h: &Hint) -> String {
    match h {
        Hint::None => String::new(),
        h => format!("; {h}"),
    }
}

impl VerbsError {
    /// Build from the current `errno` (for calls that return NULL or -1).
    pub fn last(call: &'static str, context: impl Into<String>) -> Self {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        Self::new(call, errno, context)
    }

    /// Build from a returned error code (calls that return the errno, like
    /// `ibv_modify_qp` and `ibv_post_send`).
    pub fn new(call: &'static str, errno: i32, context: impl Into<String>) -> Self {
        let errno = errno.abs();
        let hint = guess_hint(call, errno);
        VerbsError {
            call,
            errno,
            context: context.into(),
            hint,
        }
    }

    pub fn with_hint(mut self, hint: Hint) -> Self {
        self.hint = hint;
        self
    }
}

fn guess_hint(call: &str, errno: i32) -> Hint {
    match (call, errno) {
        ("ibv_reg_mr", libc::ENOMEM) | ("ibv_reg_mr", libc::EPERM) => Hint::Memlock,
        ("ibv_modify_qp(RTR)", libc::EINVAL) | ("ibv_modify_qp(RTR)", libc::ETIMEDOUT) => Hint::Gid,
        ("ibv_query_gid", _) => Hint::Gid,
        (c, libc::EINVAL) if c.starts_with("ibv_modify_qp") => Hint::BadAttr,
        ("ibv_open_device", _) | ("ibv_get_device_list", _) => Hint::Device,
        (_, libc::ENOMEM) => Hint::Resources,
        _ => Hint::None,
    }
}

/// Wait until `fd` is readable or `timeout` passes (poll(2)); `Ok(false)` on
/// timeout or EINTR. `call`/`context` name the wait in an error.
pub(crate) fn wait_readable(
    fd: std::os::raw::c_int,
    timeout: std::time::Duration,
    call: &'static str,
    context: &str,
) -> Result<bool, VerbsError> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd, borrowed for the call's duration.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(VerbsError::new(
            call,
            e.raw_os_error().unwrap_or(0),
            context.to_string(),
        ));
    }
    Ok(rc > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_call_errno_and_hint() {
        let e = VerbsError::new("ibv_reg_mr", -libc::ENOMEM, "registering 64 MiB arena");
        let s = e.to_string();
        assert!(s.starts_with("ibv_reg_mr failed"), "{s}");
        // The errno once, in the OS error's own words.
        assert!(s.contains("(os error 12)"), "{s}");
        assert_eq!(s.matches("12").count(), 1, "{s}");
        assert!(s.contains("registering 64 MiB arena"), "{s}");
        assert!(s.contains("ulimit -l"), "{s}");
        let e = VerbsError::new("ibv_modify_qp(RTR)", libc::EINVAL, "");
        assert_eq!(e.hint, Hint::Gid);
        assert!(e.to_string().contains("--gid-index"));
    }
}
