//! Falling back to tcp, the one rule every user of a data path follows: a
//! file stream ([`ClientCore::watch`](crate::control::protocol::ClientCore::watch)),
//! a copy's jobs (`control::jobs::policy`, which also decides after a
//! failed job) and a buffer session to a peer rcpd (`control::buffers::peer`,
//! through [`LinkWatch`]). Only `--transport auto` over verbs may
//! ([`may_fall_back`]); the watch of the rails itself is [`RailWatch`];
//! a session that cannot be set up falls back by [`tcp_fallback`]; what is
//! said is [`continuing`] and, for an error over tcp, [`after_fallback`].
//! State with time passed in, no I/O.

use std::time::Duration;

use crate::control::error::{ControlError, Reason};
use crate::control::link::Transport;
use crate::control::protocol::rail_watch::RailWatch;
use crate::control::protocol::Failure;
use crate::provider::ProviderKind;

/// Whether what runs over `kind` under `transport` may fall back to tcp:
/// only `--transport auto` over verbs (an explicit `--transport verbs`
/// never falls back; tcp has nowhere to go).
pub fn may_fall_back(transport: Transport, kind: ProviderKind) -> bool {
    transport == Transport::Auto && kind == ProviderKind::Verbs
}

/// The rails' watch for a data path over `kind` under `transport`, from
/// `now` on, giving up after `after` (`ClientOptions::tcp_fallback_after`):
/// `None` when it may not fall back or `after` is `None`. A file stream's
/// core and a buffer session to a peer rcpd watch with it.
pub fn rail_watch(
    transport: Transport,
    kind: ProviderKind,
    after: Option<std::time::Duration>,
    now: u64,
) -> Option<RailWatch> {
    let after = after.filter(|_| may_fall_back(transport, kind))?;
    Some(RailWatch::new(
        now,
        u64::try_from(after.as_nanos()).unwrap_or(u64::MAX),
    ))
}

/// Whether a job that tried `tried` and failed with `failed` goes on over
/// tcp, and why: only with `--transport auto` after verbs
/// ([`may_fall_back`]). `gave_up` is
/// the session's own word that its stream gave up on RDMA
/// ([`Session::fallback`](crate::control::Session::fallback)); without it `failed` is a session that could
/// not be set up.
pub fn tcp_fallback(
    transport: Transport,
    tried: ProviderKind,
    failed: &ControlError,
    gave_up: Option<&str>,
) -> Option<String> {
    if !may_fall_back(transport, tried) || failed.reason() == Reason::Interrupted {
        return None;
    }
    if let Some(why) = gave_up {
        return Some(why.to_string());
    }
    match failed.reason() {
        // tcp would meet the same refusal.
        Reason::Unauthenticated
        | Reason::Usage
        | Reason::Version
        | Reason::Exceeded
        | Reason::Interrupted => None,
        _ => Some(format!(
            "the verbs session could not be set up (transport auto): {failed}"
        )),
    }
}

/// The sentence said (the log, a copy's output, a buffer operation's
/// status) when work gives up on RDMA for `why`.
pub fn continuing(why: &str) -> String {
    format!("{why}; continuing over the tcp provider")
}

/// An error over tcp after falling back, with why it was over tcp; its
/// reason (and so the exit code) is tcp's.
pub fn after_fallback(why: &str, e: ControlError) -> ControlError {
    ControlError::Failed(Failure::new(e.reason(), then_over_tcp(why, &e)))
}

/// What an error over tcp after falling back for `why` says.
pub fn then_over_tcp(why: &str, e: &dyn std::fmt::Display) -> String {
    format!("{why}; then over the tcp provider: {e}")
}

/// A buffer session's data path, watched for the tcp fallback.
#[derive(Debug)]
pub struct LinkWatch {
    /// `None`: this session never falls back.
    watch: Option<RailWatch>,
    /// Operations waited when last told.
    waited: bool,
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
    use crate::provider::ProviderError;

    fn refused(reason: Reason) -> ControlError {
        ControlError::Failed(Failure::new(reason, "no"))
    }

    #[test]
    fn only_auto_after_verbs_falls_back() {
        let e = ControlError::Retryable("link down".into());
        let gave_up = Some("every RDMA rail has been down for 10 s");
        assert_eq!(
            tcp_fallback(Transport::Auto, ProviderKind::Verbs, &e, gave_up).as_deref(),
            gave_up
        );
        // Asked for verbs: the user gets verbs or its error.
        assert_eq!(
            tcp_fallback(Transport::Verbs, ProviderKind::Verbs, &e, gave_up),
            None
        );
        // Already over tcp: nowhere to go.
        assert_eq!(
            tcp_fallback(Transport::Auto, ProviderKind::Tcp, &e, gave_up),
            None
        );
    }

    #[test]
    fn only_auto_over_verbs_is_watched() {
        let after = Some(std::time::Duration::from_secs(10));
        let w = rail_watch(Transport::Auto, ProviderKind::Verbs, after, 7).expect("watched");
        assert_eq!(w.deadline(true), Some(7 + 10_000_000_000));
        assert!(rail_watch(Transport::Verbs, ProviderKind::Verbs, after, 0).is_none());
        assert!(rail_watch(Transport::Auto, ProviderKind::Tcp, after, 0).is_none());
        assert!(rail_watch(Transport::Tcp, ProviderKind::Tcp, after, 0).is_none());
        // --tcp-fallback-after 0: never.
        assert!(rail_watch(Transport::Auto, ProviderKind::Verbs, None, 0).is_none());
    }

    #[test]
    fn a_verbs_session_that_cannot_start_falls_back_unless_tcp_would_be_refused_too() {
        let dev = ControlError::Provider(ProviderError::Protocol("no ACTIVE port".into()));
        let why = tcp_fallback(Transport::Auto, ProviderKind::Verbs, &dev, None).unwrap();
        assert!(why.contains("could not be set up") && why.contains("no ACTIVE port"));
        // An rcpd that serves only tcp refuses the verbs provider: Invalid.
        assert!(tcp_fallback(
            Transport::Auto,
            ProviderKind::Verbs,
            &refused(Reason::Invalid),
            None
        )
        .is_some());
        for r in [
            Reason::Unauthenticated,
            Reason::Usage,
            Reason::Version,
            Reason::Exceeded,
        ] {
            assert_eq!(
                tcp_fallback(Transport::Auto, ProviderKind::Verbs, &refused(r), None),
                None,
                "{r:?}"
            );
        }
    }

    #[test]
    fn an_error_over_tcp_keeps_its_reason_and_says_why_it_was_tcp() {
        let e = after_fallback(
            "every rail down; continuing over the tcp provider",
            ControlError::FileNotFound("x".into()),
        );
        assert_eq!(e.reason(), Reason::FileNotFound);
        assert!(e.to_string().starts_with("every rail down"), "{e}");
    }

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
