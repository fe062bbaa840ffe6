//! Live counters a metrics exporter reads ([`DataPathStats`], atomics) and
//! the completion-latency recorder behind the report's p50/p99.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::engine::stream::{Counters, RailCounters, RailState};
#[cfg(test)]
use crate::engine::WcStatus;
use crate::engine::ERROR_STATUSES;

/// Data-path counters, shared (`Arc`) with whoever exports them. All
/// monotonic except the gauges `sq_free` and `cq_fill`.
///
/// The session data path ([`super::DataPath`]) does not count into these:
/// its posting thread stores the engine's [`Counters`] here after every
/// round ([`publish`](Self::publish)), the engine being the one count of
/// what was posted, signaled, completed and confirmed. Only the completion
/// thread's own figures (polls, empty polls, arms, waits, wakeups, the CQ
/// fill gauge) and the runner's (reconnect time, port waits) are counted
/// where they happen.
#[derive(Debug, Default)]
pub struct DataPathStats {
    /// Work requests posted.
    pub posted: AtomicU64,
    /// `post` calls (doorbells).
    pub doorbells: AtomicU64,
    /// Signaled requests posted.
    pub signaled: AtomicU64,
    /// Inline requests posted.
    pub inline: AtomicU64,
    /// Bytes in requests posted.
    pub bytes_posted: AtomicU64,
    /// Completions received (all statuses, stale ones included).
    pub completed: AtomicU64,
    /// Blocks (extents) confirmed.
    pub blocks_done: AtomicU64,
    /// Bytes in blocks (extents) confirmed.
    pub bytes_confirmed: AtomicU64,
    /// Windows done.
    pub windows_done: AtomicU64,
    /// Completions that named no live request.
    pub stale: AtomicU64,
    /// Requests that timed out.
    pub timeouts: AtomicU64,
    /// Epochs that failed (error batches).
    pub error_batches: AtomicU64,
    /// Extents posted again after a reconnect.
    pub reposted: AtomicU64,
    /// Gauge: free send-queue entries (swqe_avail) after the last post or
    /// completion.
    pub sq_free: AtomicU64,
    /// Gauge: completions returned by the last non-empty poll, a CQ fill
    /// estimate (a full poll batch means the CQ may hold more).
    pub cq_fill: AtomicU64,
    /// `poll` calls of the completion thread.
    pub polls: AtomicU64,
    /// Polls that returned nothing.
    pub empty_polls: AtomicU64,
    /// CQ arms (event and hybrid modes).
    pub arms: AtomicU64,
    /// Waits for an event.
    pub waits: AtomicU64,
    /// Waits that ended with an event.
    pub wakeups: AtomicU64,
    /// Reconnects done.
    pub reconnects: AtomicU64,
    /// Nanoseconds from reconnect start to the first completion after it,
    /// summed over reconnects.
    pub reconnect_ns: AtomicU64,
    /// `post` calls that failed.
    pub post_failures: AtomicU64,
    /// Times a reconnect waited for the port to come back (async events).
    pub port_waits: AtomicU64,
    errors: [AtomicU64; ERROR_STATUSES.len()],
    /// One entry per rail (a one-rail data path has one too); the fields
    /// above are the totals.
    pub rails: Vec<RailStats>,
}

/// One rail's live counters, published like the totals of
/// [`DataPathStats`] from the engine's [`RailCounters`].
#[derive(Debug, Default)]
pub struct RailStats {
    /// Work requests posted on the rail.
    pub posted: AtomicU64,
    /// Bytes in requests posted on the rail.
    pub bytes_posted: AtomicU64,
    /// Completions from the rail (stale ones included).
    pub completed: AtomicU64,
    /// Blocks (extents) the rail's completions confirmed.
    pub blocks_done: AtomicU64,
    /// Bytes in them: what the rail carried.
    pub bytes_confirmed: AtomicU64,
    /// Non-success completions (error CQEs) of the rail.
    pub error_cqes: AtomicU64,
    /// Stale completions (old epoch, fenced request).
    pub stale: AtomicU64,
    /// Epochs of the rail that failed.
    pub failures: AtomicU64,
    /// Times the rail was fenced (its extents moved to the others).
    pub fences: AtomicU64,
    /// Extents moved off the rail by fences.
    pub requeued: AtomicU64,
    /// Times the rail was paused (cool-down after repeated failures).
    pub pauses: AtomicU64,
    /// Reconnects of the rail.
    pub reconnects: AtomicU64,
    /// Reconnects of the rail given up (then paused).
    pub reconnect_failures: AtomicU64,
    /// Requests of the rail that timed out.
    pub timeouts: AtomicU64,
    /// Times the rail's reconnect waited for its port.
    pub port_waits: AtomicU64,
    /// Gauge: free send-queue entries of the rail.
    pub sq_free: AtomicU64,
    /// Gauge: the rail's state, [`RailStats::STATES`] index.
    pub state: AtomicU64,
}

impl RailStats {
    /// The values of the `state` gauge, by index.
    pub const STATES: [&'static str; 5] =
        ["running", "flushing", "needs_reconnect", "paused", "down"];

    /// The `state` gauge's label.
    pub fn state_label(&self) -> &'static str {
        Self::STATES
            .get(self.state.load(Relaxed) as usize)
            .copied()
            .unwrap_or("unknown")
    }

    /// Store the engine's counters of the rail, its free send-queue
    /// entries and its state.
    pub fn publish(&self, c: &RailCounters, sq_free: u64, state: RailState) {
        let set = |a: &AtomicU64, v: u64| a.store(v, Relaxed);
        set(&self.posted, c.posted);
        set(&self.bytes_posted, c.bytes_posted);
        set(&self.completed, c.completions);
        set(&self.blocks_done, c.extents_confirmed);
        set(&self.bytes_confirmed, c.bytes_confirmed);
        set(&self.error_cqes, c.errors.total());
        set(&self.stale, c.stale);
        set(&self.failures, c.failures);
        set(&self.fences, c.fences);
        set(&self.requeued, c.requeued);
        set(&self.pauses, c.pauses);
        set(&self.reconnects, c.reconnects);
        set(&self.reconnect_failures, c.reconnect_failures);
        set(&self.timeouts, c.timeouts);
        set(&self.sq_free, sq_free);
        let i = Self::STATES
            .iter()
            .position(|&l| l == state.label())
            .unwrap_or(0);
        set(&self.state, i as u64);
    }
}

impl DataPathStats {
    /// Zeroed counters with an entry per rail.
    pub fn with_rails(n: usize) -> Self {
        DataPathStats {
            rails: (0..n).map(|_| RailStats::default()).collect(),
            ..DataPathStats::default()
        }
    }

    /// Count an error completion by hand (tests of the exporter; the data
    /// path publishes the engine's counts instead).
    #[cfg(test)]
    pub(crate) fn count_error(&self, s: WcStatus) {
        if let Some(i) = s.error_index() {
            self.errors[i].fetch_add(1, Relaxed);
        }
    }

    /// Error completions by [`WcStatus::label`](crate::engine::WcStatus::label), non-zero ones only.
    pub fn errors(&self) -> Vec<(&'static str, u64)> {
        ERROR_STATUSES
            .iter()
            .zip(&self.errors)
            .map(|(s, n)| (s.label(), n.load(Relaxed)))
            .filter(|&(_, n)| n > 0)
            .collect()
    }

    /// Store the engine's counters (the session data path's posting thread,
    /// after every round) and the free send-queue entries.
    pub fn publish(&self, c: &Counters, sq_free: u64) {
        let set = |a: &AtomicU64, v: u64| a.store(v, Relaxed);
        set(&self.posted, c.posted);
        set(&self.doorbells, c.doorbells);
        set(&self.signaled, c.signaled);
        set(&self.inline, c.inline);
        set(&self.bytes_posted, c.bytes_posted);
        set(&self.completed, c.completions);
        set(&self.blocks_done, c.extents_confirmed);
        set(&self.bytes_confirmed, c.bytes_confirmed);
        set(&self.windows_done, c.windows_done);
        set(&self.stale, c.stale);
        set(&self.timeouts, c.timeouts);
        set(&self.error_batches, c.error_batches);
        set(&self.reposted, c.reposted);
        set(&self.reconnects, c.reconnects);
        set(&self.post_failures, c.post_failures);
        for (a, &n) in self.errors.iter().zip(&c.errors.0) {
            set(a, n);
        }
        set(&self.sq_free, sq_free);
    }
}

/// Post-to-completion latencies of signaled requests, in nanoseconds.
/// Keeps every sample up to a cap, then every k-th (k doubling), so long
/// runs stay bounded and still cover the whole run.
#[derive(Clone, Debug)]
pub struct Latencies {
    samples: Vec<u64>,
    cap: usize,
    stride: u64,
    seen: u64,
}

impl Default for Latencies {
    fn default() -> Self {
        Latencies::with_cap(1 << 18)
    }
}

impl Latencies {
    /// A recorder keeping at most about `cap` samples.
    pub fn with_cap(cap: usize) -> Self {
        Latencies {
            samples: Vec::new(),
            cap: cap.max(2),
            stride: 1,
            seen: 0,
        }
    }

    /// Record one latency.
    pub fn record(&mut self, ns: u64) {
        self.seen += 1;
        if self.seen % self.stride != 0 {
            return;
        }
        if self.samples.len() >= self.cap {
            // Keep every other sample, sample half as often from now on.
            let mut i = 0;
            self.samples.retain(|_| {
                i += 1;
                i % 2 == 0
            });
            self.stride *= 2;
        }
        self.samples.push(ns);
    }

    /// The kept samples, in nanoseconds (for histograms).
    pub fn samples(&self) -> &[u64] {
        &self.samples
    }

    /// Samples recorded (seen, not kept).
    pub fn count(&self) -> u64 {
        self.seen
    }

    /// The `q`-quantile (0..=1) in nanoseconds, `None` without samples.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        if self.samples.is_empty() {
            return None;
        }
        let mut s = self.samples.clone();
        s.sort_unstable();
        let i = ((s.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
        Some(s[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_and_bounded_memory() {
        let mut l = Latencies::with_cap(1000);
        for i in 1..=100_000u64 {
            l.record(i);
        }
        assert_eq!(l.count(), 100_000);
        assert!(l.samples.len() <= 1000);
        let p50 = l.quantile(0.5).unwrap();
        let p99 = l.quantile(0.99).unwrap();
        assert!((45_000..55_000).contains(&p50), "{p50}");
        assert!((97_000..=100_000).contains(&p99), "{p99}");
        assert_eq!(Latencies::default().quantile(0.5), None);
    }

    #[test]
    fn errors_by_status() {
        let s = DataPathStats::default();
        s.count_error(WcStatus::Flushed);
        s.count_error(WcStatus::Flushed);
        s.count_error(WcStatus::Other(99));
        s.count_error(WcStatus::Success);
        assert_eq!(s.errors(), vec![("wr_flush_err", 2), ("other", 1)]);
    }
}

#[cfg(test)]
mod publish_tests {
    use super::*;

    #[test]
    fn publish_stores_the_engine_counters() {
        let s = DataPathStats::default();
        let mut c = Counters {
            posted: 10,
            doorbells: 2,
            signaled: 2,
            inline: 1,
            completions: 3,
            extents_confirmed: 9,
            windows_done: 1,
            ..Counters::default()
        };
        c.errors.count(WcStatus::Flushed);
        s.publish(&c, 7);
        s.publish(&c, 7);
        assert_eq!(s.posted.load(Relaxed), 10, "stored, not added");
        assert_eq!(s.blocks_done.load(Relaxed), 9);
        assert_eq!(s.completed.load(Relaxed), 3);
        assert_eq!(s.sq_free.load(Relaxed), 7);
        assert_eq!(s.errors(), vec![("wr_flush_err", 1)]);
    }
}
