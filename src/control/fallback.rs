//! Who may fall back to tcp, the rule every user of a data path follows: a
//! file stream ([`ClientCore::watch`](crate::control::protocol::ClientCore::watch)),
//! the jobs policy (`control::jobs::policy`, which also decides after a
//! failed job) and a buffer session to a peer rcpd
//! (`control::buffers::fallback`). Only `--transport auto` over verbs may;
//! the watch of the rails itself is [`RailWatch`].

use crate::control::link::Transport;
use crate::control::protocol::rails::RailWatch;
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
