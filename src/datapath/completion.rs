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

use super::config::PollMode;
use super::stats::DataPathStats;
use crate::engine::{WcStatus, WorkCompletion};
use crate::provider::{Channel, ProviderError};

/// Completions taken per `poll` call.
pub const POLL_BATCH: usize = 64;

/// How long one `wait` blocks before the loop checks its stop flag: a
/// safety net, as whoever sets the flag wakes the channel
/// ([`Channel::wake`]).
pub const WAIT_SLICE: Duration = Duration::from_millis(200);

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
