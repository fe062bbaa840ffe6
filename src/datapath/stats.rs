//! Live figures a metrics exporter reads ([`DataPathStats`]: the engine's
//! counters as last published, and the completion thread's own) and the
//! completion-latency recorder behind the report's p50/p99.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use crate::engine::stream::{Counters, RailState};

/// The latest copy of the engine's [`Counters`] (of the whole stream or of
/// one rail), stored by the posting thread and read by anyone.
#[derive(Debug, Default)]
struct Published(Mutex<Counters>);

impl Published {
    fn store(&self, c: &Counters) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = *c;
    }

    fn load(&self) -> Counters {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Live data-path figures, shared (`Arc`) with whoever exports them.
///
/// What was posted, signaled, completed, confirmed and failed is the
/// engine's [`Counters`]: the session data path ([`super::DataPath`])
/// stores them here after every round ([`publish`](Self::publish)) and
/// readers take a copy ([`counters`](Self::counters)); nothing counts them
/// again. Only the completion thread's own figures (polls, empty polls,
/// arms, waits, wakeups, the CQ fill gauge) and the runner's (reconnect
/// time, port waits) are counted here, where they happen. All monotonic
/// except the gauges `sq_free` and `cq_fill`.
#[derive(Debug, Default)]
pub struct DataPathStats {
    counters: Published,
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
    /// Nanoseconds from reconnect start to the first completion after it,
    /// summed over reconnects.
    pub reconnect_ns: AtomicU64,
    /// Times a reconnect waited for the port to come back (async events).
    pub port_waits: AtomicU64,
    /// One entry per rail (a one-rail data path has one too); the fields
    /// above are the totals.
    pub rails: Vec<RailStats>,
}

/// One rail's live figures: the engine's [`Counters`] of the rail,
/// published like the totals of [`DataPathStats`], and the rail's gauges.
#[derive(Debug, Default)]
pub struct RailStats {
    counters: Published,
    /// Times the rail's reconnect waited for its port.
    pub port_waits: AtomicU64,
    /// Gauge: free send-queue entries of the rail.
    pub sq_free: AtomicU64,
    /// Gauge: the rail's state, its [`RailState::index`].
    pub state: AtomicU64,
}

impl RailStats {
    /// The `state` gauge's label ([`RailState::LABELS`]).
    pub fn state_label(&self) -> &'static str {
        RailState::LABELS
            .get(self.state.load(Relaxed) as usize)
            .copied()
            .unwrap_or("unknown")
    }

    /// The engine's counters of the rail, as last published.
    pub fn counters(&self) -> Counters {
        self.counters.load()
    }

    /// Store the engine's counters of the rail, its free send-queue
    /// entries and its state.
    pub fn publish(&self, c: &Counters, sq_free: u64, state: RailState) {
        self.counters.store(c);
        self.sq_free.store(sq_free, Relaxed);
        self.state.store(state.index() as u64, Relaxed);
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

    /// The engine's counters (all rails), as last published.
    pub fn counters(&self) -> Counters {
        self.counters.load()
    }

    /// Store the engine's counters (the session data path's posting thread,
    /// after every round) and the free send-queue entries.
    pub fn publish(&self, c: &Counters, sq_free: u64) {
        self.counters.store(c);
        self.sq_free.store(sq_free, Relaxed);
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
}

#[cfg(test)]
mod publish_tests {
    use super::*;

    use crate::engine::WcStatus;

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
        assert_eq!(s.counters(), c, "stored, not added");
        assert_eq!(s.sq_free.load(Relaxed), 7);
        assert_eq!(s.counters().errors.get(WcStatus::Flushed), 1);
    }
}
