//! Standing grants, the exposing side (docs/buffers.md): an exposure its
//! owner made with `grant: standing` is granted to a peer's session whole,
//! once, with the one right the peer asked for (a memory window bound to
//! that session's QP on each rail, or the tcp provider's registration in
//! the session's table), and kept until the exposure is withdrawn or
//! replaced, its owner goes or the session ends; then it is revoked before
//! anything else of the owner's touches it. The peer's operations into it
//! need no grant each: the peer moves their ranges and tells this rcpd in
//! a `BufferNotify` (a batch of operations per call), which checks each
//! operation's ranges against the peer's digests and sends the owner its
//! event, as at the end of a grant per operation. A range that did not
//! match is the peer's to move again (the grant still stands), at most the
//! session's `max_retries` rounds; then the owner is told it failed.

use std::sync::Arc;

use super::api::OwnerEvent;
use super::grant::{
    damage, digests_by, event_frame, inside, register, EventBatch, Held, StandingGrant,
    MAX_MESSAGE, MAX_RANGES,
};
use super::{Buffers, Exposure, Failure};
use crate::control::error::Reason;
use crate::control::server::SessionState;
use crate::files::Check;
use crate::mem::memfd::{LeaseKind, LeasedRange};
use crate::proto;
use crate::provider::exposed::{Exposed, Standing};

/// Notices one `BufferNotify` may carry.
pub const MAX_NOTICES: usize = 4096;

/// `BufferGrant` on an exposure that stands: the session's standing grant
/// of it with `write` or read access, made now if it has none.
pub(super) fn grant(
    bufs: &Arc<Buffers>,
    session: &SessionState,
    session_id: u64,
    name: &str,
    exp: Arc<Exposure>,
    write: bool,
    peer: String,
) -> Result<proto::BufferGrantResponse, Failure> {
    let (id, range) = match bufs.grants.standing_of(session_id, &exp, write) {
        Some(found) => found,
        None => {
            let peer_named = peer.clone();
            let whole = exp
                .buffer
                .span_of(exp.offset, exp.len)
                .expect("an exposure lies inside its buffer");
            let mut reg = [Exposed::new(Standing::new(whole))];
            let mut ranges = register(&exp, session, &mut reg, &[0], write, name)?;
            let [reg] = reg;
            let (id, range, new) = bufs.grants.insert_standing(Held {
                _keys: reg,
                range: ranges.remove(0),
                grant: Arc::new(StandingGrant {
                    session: session_id,
                    exp: exp.clone(),
                    write,
                    name: name.to_string(),
                    peer,
                }),
            });
            // Withdrawn meanwhile (its withdrawal revoked what it found,
            // which may not have been this one yet): revoked here.
            let current = bufs
                .exposures
                .lock()
                .unwrap()
                .get(name)
                .is_some_and(|e| Arc::ptr_eq(e, &exp));
            if !current {
                bufs.grants.revoke_standing(&exp);
                return Err(Failure::new(
                    Reason::FileNotFound,
                    format!("{name:?} was withdrawn while it was granted"),
                ));
            }
            if new {
                if let Some(m) = &bufs.client_options().metrics {
                    m.buffer_standing_grant();
                }
                tracing::info!(grant = id, name = %crate::escape::esc(name), peer = %crate::escape::esc(&peer_named), session = format_args!("{session_id:#x}"), write, "standing grant");
            }
            (id, range)
        }
    };
    Ok(proto::BufferGrantResponse {
        standing: Some(proto::StandingGrant {
            id,
            offset: exp.offset,
            len: exp.len,
            range: Some(range),
            // Notices may leave gRPC (`server::SessionMessages`): on a
            // tcp session's connections, on a verbs session's message QP
            // (`BufferMessages`).
            frames: true,
        }),
        ..Default::default()
    })
}

/// A notice that was refused: why.
fn refused(reason: Reason, message: String) -> proto::BufferNoticeResult {
    proto::BufferNoticeResult {
        error: message,
        reason: reason as i32,
        ..Default::default()
    }
}

/// Digests a notice of `ranges` ranges under `check` carries (`got` of
/// them): one per range; under none, none, or one empty digest per range
/// (what an rcpd before this one's writers sent).
fn digests_wanted(check: Check, ranges: usize, got: usize) -> usize {
    if check.is_none() && got != ranges {
        0
    } else {
        ranges
    }
}

/// A notice checked against its standing grant: the grant and each
/// range leased (shared: hashed here while nothing of rcpd's lands there).
struct Checked {
    grant: Arc<StandingGrant>,
    ranges: Vec<LeasedRange>,
}

/// Check `n` against the standing grants of session `session_id`.
fn check_notice(
    bufs: &Buffers,
    session_id: u64,
    check: Check,
    n: &proto::BufferNotice,
) -> Result<Checked, proto::BufferNoticeResult> {
    let grant = bufs
        .grants
        .standing(n.standing, session_id)
        .ok_or_else(|| {
            refused(
                Reason::FileNotFound,
                format!(
                    "no standing grant {} on this session (revoked: its exposure was withdrawn or \
                 its owner went)",
                    n.standing
                ),
            )
        })?;
    if n.ranges.is_empty() || n.ranges.len() > MAX_RANGES {
        return Err(refused(
            Reason::Invalid,
            format!("{} ranges (1..={MAX_RANGES})", n.ranges.len()),
        ));
    }
    let got = n.digests.len();
    if got != digests_wanted(check, n.ranges.len(), got) {
        let want = if check.is_none() {
            "none".to_string()
        } else {
            n.ranges.len().to_string()
        };
        return Err(refused(
            Reason::Protocol,
            format!(
                "{got} digests for {} ranges under check {}: {want} expected",
                n.ranges.len(),
                check.name()
            ),
        ));
    }
    if n.message.len() > MAX_MESSAGE {
        return Err(refused(
            Reason::Invalid,
            format!(
                "a message of {} bytes (at most {MAX_MESSAGE})",
                n.message.len()
            ),
        ));
    }
    let exp = &grant.exp;
    let mut ranges = Vec::with_capacity(n.ranges.len());
    for r in &n.ranges {
        inside((exp.offset, exp.len), r.offset, r.len, &grant.name)
            .map_err(|e| refused(e.reason, e.message))?;
        let l = exp
            .buffer
            .lease(r.offset, r.len, LeaseKind::Shared)
            .expect("inside the exposure, so inside the buffer")
            .map_err(|e| refused(Reason::Retryable, format!("{:?}: {e}", grant.name)))?;
        ranges.push(l);
    }
    Ok(Checked { grant, ranges })
}

/// `BufferNotify` on session `session_id` (`session`: its state; a closed
/// session's standing grants are revoked, so its notices find none);
/// `frame`: it came on the data path ([`super::frames`]). The answer, and
/// the owners' events of the operations it ended, for the caller to send
/// once the answer is on its way (the writer need not wait for them).
pub(super) fn notify(
    bufs: &Arc<Buffers>,
    session: Option<&SessionState>,
    session_id: u64,
    req: proto::BufferNotifyRequest,
    frame: bool,
) -> Result<(proto::BufferNotifyResponse, EventBatch), Failure> {
    if req.ops.len() > MAX_NOTICES {
        return Err(Failure::new(
            Reason::Invalid,
            format!("{} notices (at most {MAX_NOTICES})", req.ops.len()),
        ));
    }
    let Some(session) = session else {
        return Err(Failure::new(
            Reason::FileNotFound,
            "the session is closed: its standing grants were revoked",
        ));
    };
    if let Some(m) = &bufs.client_options().metrics {
        m.buffer_notify(req.ops.len(), frame);
    }
    let (check, max_retries) = (session.params.check, session.params.max_retries);
    let checked: Vec<Result<Checked, proto::BufferNoticeResult>> = req
        .ops
        .iter()
        .map(|n| check_notice(bufs, session_id, check, n))
        .collect();
    // Every range of every notice hashed at once.
    let all: Vec<&LeasedRange> = checked
        .iter()
        .flatten()
        .flat_map(|c| c.ranges.iter())
        .collect();
    let mut landed = digests_by(check, &all, |r| r).into_iter();
    let mut events = EventBatch::default();
    let results = checked
        .into_iter()
        .zip(&req.ops)
        .map(|(c, n)| match c {
            Err(refused) => refused,
            Ok(c) => {
                let mine: Vec<Vec<u8>> = landed.by_ref().take(c.ranges.len()).collect();
                let bad: Vec<u32> = (0..c.ranges.len() as u32)
                    .filter(|&i| {
                        !check.is_none()
                            && (mine[i as usize] != n.digests[i as usize]
                                || super::faults::damaged(&c.grant.name))
                    })
                    .collect();
                let ended = bad.is_empty() || n.round >= max_retries;
                if ended {
                    events.push(&c.grant.exp, owner_event(&c, n, check, &mine, &bad));
                }
                proto::BufferNoticeResult {
                    bad,
                    ended,
                    ..Default::default()
                }
            }
        })
        .collect();
    Ok((proto::BufferNotifyResponse { results }, events))
}

/// The owner's event for an operation under a standing grant that ended:
/// every range with its digest here, and which did not match.
fn owner_event(
    c: &Checked,
    n: &proto::BufferNotice,
    check: Check,
    mine: &[Vec<u8>],
    bad: &[u32],
) -> Vec<u8> {
    let g = &c.grant;
    let ranges = c
        .ranges
        .iter()
        .zip(mine)
        .map(|(l, d)| (l.lease().offset(), l.lease().len(), hex::encode(d)))
        .collect();
    let ev = OwnerEvent {
        name: g.name.clone(),
        peer: g.peer.clone(),
        ranges,
        message: n.message.clone(),
        check: check.name().to_string(),
        resent: n.resent,
        error: damage(bad, n.round),
    };
    event_frame(g.write, ev)
}

/// A notify call's results, one per notice of the `sent` it carried (any
/// other count breaks the protocol).
pub(super) fn results_of(
    resp: proto::BufferNotifyResponse,
    sent: usize,
    peer: &str,
) -> Result<Vec<proto::BufferNoticeResult>, Failure> {
    if resp.results.len() != sent {
        return Err(Failure::new(
            Reason::Protocol,
            format!(
                "peer {peer} broke the protocol: BufferNotify: {} results for {sent} notices",
                resp.results.len()
            ),
        ));
    }
    Ok(resp.results)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A notice carries one digest per range; under check none, none (or,
    /// from an older writer, one empty digest per range).
    #[test]
    fn a_notice_carries_a_digest_per_range_or_none_under_none() {
        assert_eq!(digests_wanted(Check::Blake3, 2, 0), 2);
        assert_eq!(digests_wanted(Check::Blake3, 2, 2), 2);
        assert_eq!(digests_wanted(Check::None, 2, 0), 0);
        assert_eq!(digests_wanted(Check::None, 2, 2), 2);
        assert_ne!(digests_wanted(Check::None, 2, 1), 1);
    }
}
