//! `--transport auto`: when a session's RDMA data path is given up for the
//! tcp provider. One rule for every user of a data path: a file stream's
//! core ([`super::ClientCore::watch_rails`]) and a buffer session to a peer
//! rcpd (`control::buffers::peer`). State and time passed in, no I/O;
//! whether the user may fall back at all (`--transport auto` over verbs)
//! is `control::fallback`'s.

use super::{Failure, Reason};

/// How often a watch of the rails looks again once its limit passed with a
/// rail still good.
pub const LOOK_EVERY_NS: u64 = 1_000_000_000;

/// The rails' watch of one data path: it gives up on RDMA (once, saying
/// why) when every rail has failed since the last confirmed byte, that
/// byte is more than the limit old, and work waits on the data path. That
/// covers links that are down (ports down, rails fenced and waiting) and
/// paths that drop RDMA traffic (rails failing again as soon as they
/// reconnect), and not a data path with nothing to move. And when the data
/// path itself fails retryably ([`RailWatch::failed`]).
#[derive(Debug)]
pub struct RailWatch {
    /// Give up after this long.
    after: u64,
    /// When the data path's confirmed bytes last grew (or the watch
    /// began), and each rail's failures then.
    since: u64,
    before: Vec<u64>,
    /// The confirmed bytes, as last told.
    confirmed: u64,
    /// The limit passed and a rail was still good: look again then.
    next_look: u64,
    /// Why it gave up, once it did.
    gave_up: Option<String>,
}

/// Whether every rail's failure count (`now`) grew past `before` (taken
/// at the last confirmed byte; a rail missing there had none).
pub fn every_rail_failed(before: &[u64], now: &[u64]) -> bool {
    !now.is_empty()
        && now
            .iter()
            .enumerate()
            .all(|(k, &f)| f > before.get(k).copied().unwrap_or(0))
}

impl RailWatch {
    /// A watch from `now` on that gives up after `after_ns`.
    pub fn new(now: u64, after_ns: u64) -> RailWatch {
        RailWatch {
            after: after_ns,
            since: now,
            before: Vec::new(),
            confirmed: 0,
            next_look: 0,
            gave_up: None,
        }
    }

    /// The data path's counters at `now`: bytes confirmed so far (bytes
    /// landing are progress before their window's answer is), each rail's
    /// failures so far, and whether work waits on the data path. True when
    /// the watch gives up now ([`gave_up`](Self::gave_up) says why).
    pub fn data_path(
        &mut self,
        now: u64,
        confirmed: u64,
        rail_failures: &[u64],
        waiting: bool,
    ) -> bool {
        if confirmed > self.confirmed {
            self.confirmed = confirmed;
            self.since = now;
            self.before = rail_failures.to_vec();
        }
        if self.gave_up.is_some() || !waiting || now < self.since + self.after {
            return false;
        }
        if !every_rail_failed(&self.before, rail_failures) {
            self.next_look = now + LOOK_EVERY_NS;
            return false;
        }
        self.gave_up = Some(format!(
            "every RDMA rail has been down for {:.0} s (transport auto)",
            (now - self.since) as f64 / 1e9
        ));
        true
    }

    /// Count from `now` on, as if bytes had been confirmed then with
    /// `rail_failures` (work that starts waiting on a data path idle since
    /// its last byte: rails that failed and came back while nothing
    /// waited are not held against it).
    pub fn restart(&mut self, now: u64, rail_failures: &[u64]) {
        self.since = now;
        self.before = rail_failures.to_vec();
        self.next_look = 0;
    }

    /// The data path failed with `f`: true when that gives up on RDMA now
    /// (a retryable failure: a link that may come back over tcp).
    pub fn failed(&mut self, f: &Failure) -> bool {
        if f.reason != Reason::Retryable || self.gave_up.is_some() {
            return false;
        }
        self.gave_up = Some(format!(
            "the RDMA data path gave up ({}) (transport auto)",
            f.message
        ));
        true
    }

    /// Why the watch gave up on RDMA, once it did.
    pub fn gave_up(&self) -> Option<&str> {
        self.gave_up.as_deref()
    }

    /// When the watch next decides, while work waits (`waiting`): the
    /// driver's timer, so that a stall with no events is decided too.
    pub fn deadline(&self, waiting: bool) -> Option<u64> {
        (self.gave_up.is_none() && waiting).then(|| (self.since + self.after).max(self.next_look))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn gives_up_once_every_rail_failed_past_the_limit_with_work_waiting() {
        let after = 5 * S;
        let mut w = RailWatch::new(0, after);
        assert_eq!(w.deadline(true), Some(after));
        assert_eq!(w.deadline(false), None, "nothing waits: no timer");
        assert!(!w.data_path(after - 1, 0, &[1, 1], true));
        assert!(!w.data_path(after, 0, &[1, 1], false), "nothing waits");
        assert!(w.data_path(after, 0, &[1, 1], true));
        assert_eq!(
            w.gave_up(),
            Some("every RDMA rail has been down for 5 s (transport auto)")
        );
        // Once.
        assert!(!w.data_path(after + S, 0, &[2, 2], true));
        assert!(!w.failed(&Failure::new(Reason::Retryable, "x")));
        assert_eq!(w.deadline(true), None);
        // A rail still good: a look a second later.
        let mut w = RailWatch::new(0, after);
        assert!(!w.data_path(after, 0, &[1, 0], true));
        assert_eq!(w.deadline(true), Some(after + S));
        assert!(w.data_path(after + S, 0, &[2, 1], true));
        // Bytes confirmed restart the clock and the count.
        let mut w = RailWatch::new(0, after);
        assert!(!w.data_path(3 * S, 100, &[1, 1], true));
        assert!(!w.data_path(3 * S + after - 1, 100, &[2, 2], true));
        assert!(!w.data_path(3 * S + after, 100, &[1, 2], true));
        assert!(w.data_path(3 * S + after, 100, &[2, 2], true));
    }

    #[test]
    fn only_a_retryable_failure_gives_up() {
        let mut w = RailWatch::new(0, S);
        assert!(!w.failed(&Failure::new(Reason::Permission, "remote access error")));
        assert!(w.gave_up().is_none());
        assert!(w.failed(&Failure::new(Reason::Retryable, "the link went away")));
        assert_eq!(
            w.gave_up(),
            Some("the RDMA data path gave up (the link went away) (transport auto)")
        );
    }
}
