//! CPUs: which ones the calling thread may run on, pinning a thread to one,
//! keeping a thread off one while a completion thread spins there
//! ([`AvoidCpu`]), and the CPUs of a device's NUMA node the process may use.
//! Used by the completion loop, the posting thread and the configuration.

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;

/// Pin the calling thread to `cpu`.
pub fn pin_current_thread(cpu: usize) -> Result<(), nix::Error> {
    let mut set = CpuSet::new();
    set.set(cpu)?;
    sched_setaffinity(Pid::from_raw(0), &set)
}

/// The CPUs the calling thread may run on, in ascending order.
pub fn allowed_cpus() -> Vec<usize> {
    match sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..CpuSet::count())
            .filter(|&c| set.is_set(c).unwrap_or(false))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// While alive, keeps the calling thread off one CPU (the one a spinning
/// completion thread owns); on drop the thread's previous affinity comes
/// back. Threads spawned meanwhile inherit the narrower set.
#[derive(Debug)]
pub struct AvoidCpu {
    previous: Option<CpuSet>,
}

impl AvoidCpu {
    /// Take `cpu` out of the calling thread's affinity, unless it is not in
    /// it or is the only CPU left there (then nothing changes).
    pub fn new(cpu: usize) -> AvoidCpu {
        let unchanged = AvoidCpu { previous: None };
        let Ok(previous) = sched_getaffinity(Pid::from_raw(0)) else {
            return unchanged;
        };
        if !previous.is_set(cpu).unwrap_or(false) {
            return unchanged;
        }
        let mut narrower = previous;
        if narrower.unset(cpu).is_err() {
            return unchanged;
        }
        let others = (0..CpuSet::count()).any(|c| narrower.is_set(c).unwrap_or(false));
        if !others || sched_setaffinity(Pid::from_raw(0), &narrower).is_err() {
            return unchanged;
        }
        AvoidCpu {
            previous: Some(previous),
        }
    }

    /// Whether the affinity was narrowed.
    pub fn active(&self) -> bool {
        self.previous.is_some()
    }
}

impl Drop for AvoidCpu {
    fn drop(&mut self) {
        if let Some(prev) = &self.previous {
            if let Err(e) = sched_setaffinity(Pid::from_raw(0), prev) {
                tracing::warn!(error = %e, "cannot restore the posting thread's CPU affinity");
            }
        }
    }
}

/// CPUs the process may use on the device's NUMA node (all it may use when
/// the node is unknown or offers none of them).
pub fn node_cpus_allowed(numa_node: Option<u32>) -> Vec<usize> {
    let allowed = allowed_cpus();
    let on_node: Vec<usize> = numa_node
        .map(crate::mem::numa::node_cpus)
        .unwrap_or_default()
        .into_iter()
        .filter(|c| allowed.contains(c))
        .collect();
    if on_node.is_empty() {
        allowed
    } else {
        on_node
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn avoid_cpu_narrows_the_affinity_and_restores_it() {
        // On a thread of its own: the test harness's threads are shared.
        std::thread::spawn(|| {
            let before = allowed_cpus();
            assert!(!before.is_empty());
            let last = *before.last().unwrap();
            {
                let g = AvoidCpu::new(last);
                let during = allowed_cpus();
                if before.len() >= 2 {
                    assert!(g.active());
                    assert!(!during.contains(&last), "{during:?} still has CPU {last}");
                    assert_eq!(during.len(), before.len() - 1);
                } else {
                    // The only CPU: nothing to move to, nothing changes.
                    assert!(!g.active());
                    assert_eq!(during, before);
                }
            }
            assert_eq!(allowed_cpus(), before, "affinity restored on drop");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn avoid_cpu_leaves_a_cpu_outside_the_set_alone() {
        std::thread::spawn(|| {
            let before = allowed_cpus();
            let outside = (0..CpuSet::count()).find(|c| !before.contains(c)).unwrap();
            let g = AvoidCpu::new(outside);
            assert!(!g.active());
            assert_eq!(allowed_cpus(), before);
        })
        .join()
        .unwrap();
    }
}
