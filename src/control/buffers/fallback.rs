//! The tcp fallback of a buffer session to a peer rcpd (docs/buffers.md,
//! "When RDMA gives up: tcp"): the files' rule and defaults, for the
//! session's data path. State with time passed in, no I/O: the session's
//! driver (`peer`) tells it the data path's counters and whether
//! operations wait, and gives the session up when it says so; the
//! operations that were waiting then run again over a tcp session.
//!
//! - The rule is the rails' watch of file streams
//!   ([`RailWatch`](crate::control::protocol::rails::RailWatch)): every
//!   rail failed since the last confirmed byte, that byte older than
//!   `ClientOptions::tcp_fallback_after` (10 s by default), operations
//!   waiting; or the data path failing retryably.
//! - Who may fall back is the files' rule
//!   ([`rail_watch`](crate::control::fallback::rail_watch)): `--transport auto`
//!   over verbs; an explicit `--transport verbs` never does, nor tcp.

use std::time::Duration;

use crate::control::fallback::rail_watch;
use crate::control::link::Transport;
use crate::control::protocol::rails::RailWatch;
use crate::control::protocol::Failure;
use crate::provider::ProviderKind;

/// A buffer session's data path, watched for the tcp fallback.
#[derive(Debug)]
pub struct LinkWatch {
    /// `None`: this session never falls back.
    watch: Option<RailWatch>,
    /// Operations waited when last told.
    waited: bool,
}

/// The sentence said (rcpd's log, the operations' status) when a session
/// gives up on RDMA for `why`.
pub fn continuing(why: &str) -> String {
    format!("{why}; continuing over the tcp provider")
}

impl LinkWatch {
    /// A session over `kind`, opened under `transport` at `now`, giving up
    /// after `after` (`ClientOptions::tcp_fallback_after`).
    pub fn new(
        transport: Transport,
        kind: ProviderKind,
        after: Option<Duration>,
        now: u64,
    ) -> LinkWatch {
        LinkWatch {
            watch: rail_watch(transport, kind, after, now),
            waited: false,
        }
    }

    /// The data path's counters at `now` (bytes confirmed, each rail's
    /// failures) and whether operations wait on it: why the session gives
    /// up on RDMA, the one time it does. A session kept idle between
    /// operations starts the count again when operations start waiting.
    pub fn tick(
        &mut self,
        now: u64,
        confirmed: u64,
        rail_failures: &[u64],
        waiting: bool,
    ) -> Option<String> {
        let w = self.watch.as_mut()?;
        if waiting && !self.waited {
            w.restart(now, rail_failures);
        }
        self.waited = waiting;
        w.data_path(now, confirmed, rail_failures, waiting)
            .then(|| continuing(w.gave_up().unwrap_or_default()))
    }

    /// The data path failed with `f`: why the session gives up on RDMA,
    /// when that is a fallback (transport auto, `f` retryable).
    pub fn failed(&mut self, f: &Failure) -> Option<String> {
        let w = self.watch.as_mut()?;
        w.failed(f)
            .then(|| continuing(w.gave_up().unwrap_or_default()))
    }

    /// Why the session gave up on RDMA, once it did.
    pub fn gave_up(&self) -> Option<String> {
        self.watch
            .as_ref()
            .and_then(RailWatch::gave_up)
            .map(continuing)
    }

    /// When the driver must tell the counters again while operations wait
    /// (`waiting`), though no event comes: `None` for a session that never
    /// falls back.
    pub fn deadline(&self, waiting: bool) -> Option<u64> {
        self.watch.as_ref()?.deadline(waiting)
    }

    /// Whether this session may fall back at all.
    pub fn watched(&self) -> bool {
        self.watch.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::protocol::Reason;

    const S: u64 = 1_000_000_000;
    const TEN: Option<Duration> = Some(Duration::from_secs(10));

    fn auto() -> LinkWatch {
        LinkWatch::new(Transport::Auto, ProviderKind::Verbs, TEN, 0)
    }

    #[test]
    fn every_rail_down_past_the_limit_with_operations_waiting_gives_up_saying_why() {
        let mut w = auto();
        assert!(w.watched());
        assert_eq!(w.tick(0, 0, &[0, 0], true), None, "an operation waits");
        assert_eq!(w.deadline(true), Some(10 * S), "the driver looks then");
        assert_eq!(w.tick(10 * S - 1, 0, &[1, 1], true), None, "not yet");
        let why = w.tick(10 * S, 0, &[1, 1], true).expect("gave up");
        assert_eq!(
            why,
            "every RDMA rail has been down for 10 s (transport auto); continuing over the \
             tcp provider"
        );
        assert_eq!(w.gave_up().as_deref(), Some(why.as_str()));
        // Said once.
        assert_eq!(w.tick(30 * S, 0, &[4, 4], true), None);
        assert_eq!(w.failed(&Failure::new(Reason::Retryable, "x")), None);
    }

    #[test]
    fn a_session_kept_idle_counts_from_when_operations_wait() {
        let mut w = auto();
        // Rails failed while nothing waited, and came back.
        assert_eq!(w.tick(50 * S, 0, &[3, 3], false), None);
        // An operation starts waiting: neither the old failures nor the
        // idle time count.
        assert_eq!(w.tick(60 * S, 0, &[3, 3], true), None);
        assert_eq!(w.deadline(true), Some(70 * S));
        assert_eq!(
            w.tick(70 * S, 0, &[3, 4], true),
            None,
            "rail 0 did not fail since"
        );
        let why = w.tick(71 * S, 0, &[4, 4], true).expect("both failed since");
        assert!(why.contains("down for 11 s"), "{why}");
    }

    #[test]
    fn a_rail_still_good_or_bytes_confirmed_keep_rdma() {
        let mut w = auto();
        assert_eq!(w.tick(0, 0, &[0, 0], true), None);
        assert_eq!(w.tick(10 * S, 0, &[2, 0], true), None, "rail 1 is good");
        assert_eq!(w.deadline(true), Some(11 * S), "a look a second later");
        // Bytes confirmed at 5 s: the clock and the count start again.
        let mut w = auto();
        assert_eq!(w.tick(0, 0, &[0, 0], true), None);
        assert_eq!(w.tick(5 * S, 4096, &[1, 1], true), None);
        assert_eq!(w.tick(14 * S, 4096, &[2, 2], true), None, "9 s since");
        assert_eq!(
            w.tick(15 * S, 4096, &[1, 2], true),
            None,
            "rail 0 did not fail since"
        );
        assert!(w.tick(15 * S, 4096, &[2, 2], true).is_some());
    }

    #[test]
    fn a_retryable_data_path_failure_gives_up_and_a_refusal_does_not() {
        let mut w = auto();
        assert_eq!(
            w.failed(&Failure::new(Reason::Permission, "remote access error")),
            None,
            "tcp would be refused too"
        );
        let why = w
            .failed(&Failure::new(Reason::Retryable, "request timed out"))
            .expect("gave up");
        assert!(
            why.starts_with("the RDMA data path gave up (request timed out) (transport auto)"),
            "{why}"
        );
    }

    #[test]
    fn explicit_verbs_and_tcp_never_fall_back() {
        for (t, k) in [
            (Transport::Verbs, ProviderKind::Verbs),
            (Transport::Auto, ProviderKind::Tcp),
            (Transport::Tcp, ProviderKind::Tcp),
        ] {
            let mut w = LinkWatch::new(t, k, TEN, 0);
            assert!(!w.watched(), "{t:?} {k:?}");
            assert_eq!(w.tick(100 * S, 0, &[9, 9], true), None, "{t:?} {k:?}");
            assert_eq!(w.failed(&Failure::new(Reason::Retryable, "x")), None);
            assert_eq!(w.deadline(true), None);
        }
        // --tcp-fallback-after 0 (None): never.
        let mut w = LinkWatch::new(Transport::Auto, ProviderKind::Verbs, None, 0);
        assert_eq!(w.tick(100 * S, 0, &[9, 9], true), None);
    }
}
