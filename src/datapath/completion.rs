//! The completion thread: one per channel (CQ), optionally pinned, polling
//! in batches of 64 and handing each non-empty batch to the posting thread.
//!
//! Modes ([`PollMode`]):
//! - `Poll`: poll in a loop (a `spin_loop` hint between empty polls);
//! - `Event`: after an empty poll, arm the CQ, poll once more (a completion
//!   that arrived between the poll and the arm would raise no event), then
//!   wait for the event;
//! - `Hybrid { empty_polls: K }`: poll; after K empty polls in a row, do what
//!   `Event` does; on wake drain and go back to polling.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;

use super::config::PollMode;
use super::stats::DataPathStats;
use crate::engine::{WcStatus, WorkCompletion};
use crate::provider::{Channel, ProviderError};

/// Completions taken per `poll` call.
pub const POLL_BATCH: usize = 64;

/// How long one `wait` blocks before the loop checks its stop flag: a
/// safety net, as whoever sets the flag wakes the channel
/// ([`Channel::wake`](crate::provider::Channel::wake)).
pub const WAIT_SLICE: Duration = Duration::from_millis(200);

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

/// Poll `channel` until `stop` is set or `deliver` returns false (the
/// receiver is gone), handing every non-empty batch to `deliver` with the
/// time it was polled. Counts polls, empty polls, arms, waits and wakeups in
/// `stats` (and sets the `cq_fill` gauge); completions themselves are the
/// engine's to count. A provider error ends the loop with that error.
pub fn completion_loop(
    channel: &dyn Channel,
    mode: PollMode,
    stop: &AtomicBool,
    stats: &DataPathStats,
    deliver: &mut dyn FnMut(&[WorkCompletion], Instant) -> bool,
) -> Result<(), ProviderError> {
    let mut wcs = [WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        byte_len: 0,
    }; POLL_BATCH];
    let mut empty_run: u32 = 0;
    // Poll once; Some(false) means the receiver is gone.
    let mut poll = |wcs: &mut [WorkCompletion; POLL_BATCH]| -> Result<Option<bool>, ProviderError> {
        let n = channel.poll(wcs)?;
        stats.polls.fetch_add(1, Relaxed);
        if n == 0 {
            stats.empty_polls.fetch_add(1, Relaxed);
            return Ok(None);
        }
        stats.cq_fill.store(n as u64, Relaxed);
        Ok(Some(deliver(&wcs[..n], Instant::now())))
    };
    while !stop.load(Relaxed) {
        match poll(&mut wcs)? {
            Some(true) => {
                empty_run = 0;
                continue;
            }
            Some(false) => return Ok(()),
            None => {}
        }
        empty_run = empty_run.saturating_add(1);
        let sleep = match mode {
            PollMode::Poll => false,
            PollMode::Event => true,
            PollMode::Hybrid { empty_polls } => empty_run >= empty_polls,
        };
        if !sleep {
            std::hint::spin_loop();
            continue;
        }
        channel.arm()?;
        stats.arms.fetch_add(1, Relaxed);
        // Close the race: a completion between the last poll and the arm
        // raised no event.
        match poll(&mut wcs)? {
            Some(true) => {
                empty_run = 0;
                continue;
            }
            Some(false) => return Ok(()),
            None => {}
        }
        stats.waits.fetch_add(1, Relaxed);
        if channel.wait(WAIT_SLICE)? {
            stats.wakeups.fetch_add(1, Relaxed);
        }
        empty_run = 0;
    }
    Ok(())
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
