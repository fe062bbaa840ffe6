//! RLIMIT_MEMLOCK: registration pins memory, which the limit bounds.

use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};

/// Why memory cannot be pinned.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "cannot register {need} bytes: RLIMIT_MEMLOCK is {limit} bytes and the process lacks CAP_IPC_LOCK; \
     raise it with `ulimit -l unlimited` (shell), LimitMEMLOCK=infinity (systemd, containerd), \
     `--ulimit memlock=-1` (docker/podman), or grant the IPC_LOCK capability (Kubernetes)"
)]
pub struct MemlockError {
    pub need: u64,
    pub limit: u64,
}

/// The soft limit in bytes (`None` = unlimited).
pub fn memlock_limit() -> Option<u64> {
    match getrlimit(Resource::RLIMIT_MEMLOCK) {
        Ok((soft, _)) if soft == RLIM_INFINITY => None,
        Ok((soft, _)) => Some(soft),
        Err(_) => None,
    }
}

/// Whether the process holds CAP_IPC_LOCK (which lifts the limit for
/// registration), read from /proc/self/status.
pub fn has_ipc_lock() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

/// Check that `need` more bytes can be pinned. Pure decision in [`check`].
pub fn ensure_lockable(need: u64) -> Result<(), MemlockError> {
    check(need, memlock_limit(), has_ipc_lock())
}

/// The decision: fine when unlimited, when the limit covers `need`, or with
/// CAP_IPC_LOCK.
pub fn check(need: u64, limit: Option<u64>, ipc_lock: bool) -> Result<(), MemlockError> {
    match limit {
        None => Ok(()),
        Some(_) if ipc_lock => Ok(()),
        Some(l) if l >= need => Ok(()),
        Some(l) => Err(MemlockError { need, limit: l }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decision() {
        assert!(check(1 << 30, None, false).is_ok());
        assert!(check(1 << 30, Some(8 << 20), true).is_ok());
        assert!(check(4 << 20, Some(8 << 20), false).is_ok());
        let e = check(64 << 20, Some(8 << 20), false).unwrap_err();
        assert_eq!(
            e,
            MemlockError {
                need: 64 << 20,
                limit: 8 << 20
            }
        );
        let s = e.to_string();
        assert!(
            s.contains("RLIMIT_MEMLOCK") && s.contains("ulimit -l") && s.contains("IPC_LOCK"),
            "{s}"
        );
    }
}
