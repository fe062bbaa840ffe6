//! The exposing side of a peer's operation: `BufferGrant` checks the name,
//! the access, the peer and every range against the exposure, leases the
//! ranges and registers each in the peer session's domain (on every rail)
//! with the one right the operation needs (with memory windows: a window
//! bound to the session's QP, into the exposure registered once); `BufferDone` revokes the grant
//! (registrations first), verifies what landed (write) and tells the owner.
//! A grant whose peer says nothing for rcpd's timeout is revoked too.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedSender;

use super::{Buffers, OpError};
use crate::control::error::Reason;
use crate::control::server::SessionState;
use crate::files::Check;
use crate::mem::memfd::{LeaseKind, LeasedRange};
use crate::proto;
use crate::provider::{Access, Registration};

/// Ranges one operation may name.
pub const MAX_RANGES: usize = 4096;
/// Bytes of a writer's message.
pub const MAX_MESSAGE: usize = 256;

/// One live grant. Fields drop in order: the registrations (revoking every
/// key) before the leases.
struct GrantState {
    regs: Vec<Arc<dyn Registration>>,
    ranges: Vec<LeasedRange>,
    session: u64,
    owner: u64,
    name: String,
    write: bool,
    check: Check,
    message: String,
    peer: String,
    events: UnboundedSender<Value>,
}

/// The grants one rcpd made, by id.
#[derive(Default)]
pub struct Grants {
    next: AtomicU64,
    live: Mutex<HashMap<u64, GrantState>>,
}

impl Grants {
    /// Revoke every grant on connection `owner`'s exposures; how many.
    pub(crate) fn revoke_owner(&self, owner: u64) -> usize {
        let gone: Vec<GrantState> = {
            let mut l = self.live.lock().unwrap();
            let ids: Vec<u64> = l
                .iter()
                .filter(|(_, g)| g.owner == owner)
                .map(|(&id, _)| id)
                .collect();
            ids.iter().filter_map(|id| l.remove(id)).collect()
        };
        let n = gone.len();
        crate::control::in_place(|| drop(gone));
        n
    }

    /// Live grants (tests, logs).
    pub fn live(&self) -> usize {
        self.live.lock().unwrap().len()
    }

    fn take(&self, id: u64, session: u64) -> Option<GrantState> {
        let mut l = self.live.lock().unwrap();
        match l.get(&id) {
            Some(g) if g.session == session => l.remove(&id),
            _ => None,
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Each range's digest under `check` (empty for none).
pub(crate) fn digests(check: Check, ranges: &[LeasedRange]) -> Vec<Vec<u8>> {
    if check.is_none() {
        return vec![Vec::new(); ranges.len()];
    }
    crate::control::in_place(|| {
        ranges
            .iter()
            .map(|r| r.with(|b| check.wire(&check.block(b))))
            .collect()
    })
}

/// `BufferGrant` from the peer at `peer` on its session `session_id`.
pub fn grant(
    bufs: &Arc<Buffers>,
    session: &SessionState,
    session_id: u64,
    req: proto::BufferGrantRequest,
    peer: Option<IpAddr>,
) -> Result<proto::BufferGrantResponse, OpError> {
    let write = match proto::BufferAccess::try_from(req.access) {
        Ok(proto::BufferAccess::Write) => true,
        Ok(proto::BufferAccess::Read) => false,
        _ => return Err(OpError::new(Reason::Invalid, "no buffer access named")),
    };
    if req.ranges.is_empty() || req.ranges.len() > MAX_RANGES {
        return Err(OpError::new(
            Reason::Invalid,
            format!("{} ranges (1..={MAX_RANGES})", req.ranges.len()),
        ));
    }
    if req.message.len() > MAX_MESSAGE {
        return Err(OpError::new(
            Reason::Invalid,
            format!(
                "a message of {} bytes (at most {MAX_MESSAGE})",
                req.message.len()
            ),
        ));
    }
    let exp = bufs
        .exposures
        .lock()
        .unwrap()
        .get(&req.name)
        .cloned()
        .ok_or_else(|| {
            OpError::new(
                Reason::FileNotFound,
                format!("no buffer is exposed as {:?} on this rcpd", req.name),
            )
        })?;
    let what = if write { "write" } else { "read" };
    if (write && !exp.access.write) || (!write && !exp.access.read) {
        return Err(OpError::new(
            Reason::Permission,
            format!("{:?} is not exposed for {what}", req.name),
        ));
    }
    if !exp.peers.is_empty() && !peer.is_some_and(|p| exp.peers.contains(&canonical(p))) {
        return Err(OpError::new(
            Reason::Permission,
            format!(
                "{:?} is not exposed to peer {}",
                req.name,
                peer.map_or("(unknown)".into(), |p| p.to_string())
            ),
        ));
    }
    let (lo, hi) = (exp.offset, exp.offset + exp.len);
    let kind = if write {
        LeaseKind::Exclusive
    } else {
        LeaseKind::Shared
    };
    let mut ranges = Vec::with_capacity(req.ranges.len());
    for r in &req.ranges {
        let end = r.offset.checked_add(r.len);
        if r.len == 0 || r.offset < lo || end.is_none_or(|e| e > hi) {
            return Err(OpError::new(
                Reason::Invalid,
                format!(
                    "range [{}, {}) is outside the exposed [{lo}, {hi}) of {:?}",
                    r.offset,
                    r.offset.saturating_add(r.len),
                    req.name
                ),
            ));
        }
        let l = exp
            .buffer
            .lease(r.offset, r.len, kind)
            .expect("inside the exposure, so inside the buffer")
            .map_err(|e| OpError::new(Reason::Invalid, format!("{:?}: {e}", req.name)))?;
        ranges.push(l);
    }
    let access = if write {
        Access::REMOTE_WRITE | Access::LOCAL_WRITE
    } else {
        Access::REMOTE_READ
    };
    let domains: Vec<&Arc<dyn crate::provider::Domain>> = std::iter::once(&session.domain)
        .chain(session.rail_domains())
        .collect();
    let whole = exp
        .buffer
        .span_of(exp.offset, exp.len)
        .expect("an exposure lies inside its buffer");
    let mut regs = Vec::with_capacity(ranges.len() * domains.len());
    let mut out = Vec::with_capacity(ranges.len());
    for r in &ranges {
        let mut keys = Vec::new();
        let mut addr = 0;
        for d in &domains {
            let reg = d
                .register_in(&exp.bases, &whole, r.span(), access)
                .map_err(|e| {
                    OpError::new(
                        Reason::Other,
                        format!(
                            "registering [{}, +{}) of {:?}: {e}",
                            r.lease().offset(),
                            r.lease().len(),
                            req.name
                        ),
                    )
                })?;
            addr = reg.addr();
            keys.push(reg.rkey());
            regs.push(reg);
        }
        out.push(proto::GrantedRange {
            addr,
            rkey: keys[0],
            rail_rkeys: if keys.len() > 1 { keys } else { Vec::new() },
        });
    }
    let check = session.check;
    let digests = if write {
        Vec::new()
    } else {
        digests(check, &ranges)
    };
    let id = bufs.grants.next.fetch_add(1, Relaxed) + 1;
    bufs.grants.live.lock().unwrap().insert(
        id,
        GrantState {
            regs,
            ranges,
            session: session_id,
            owner: exp.owner,
            name: req.name.clone(),
            write,
            check,
            message: req.message,
            peer: peer.map_or_else(String::new, |p| p.to_string()),
            events: exp.events.clone(),
        },
    );
    // A grant whose peer never finishes is revoked after the timeout.
    let (b, t) = (bufs.clone(), bufs.grant_timeout());
    tokio::spawn(async move {
        tokio::time::sleep(t).await;
        if let Some(g) = b.grants.take(id, session_id) {
            tracing::warn!(grant = id, name = %crate::escape::esc(&g.name), "buffer grant revoked: its peer said nothing for the timeout");
            crate::control::in_place(|| drop(g));
        }
    });
    tracing::debug!(grant = id, name = %crate::escape::esc(&req.name), what, ranges = out.len(), "buffer grant");
    Ok(proto::BufferGrantResponse {
        grant: id,
        ranges: out,
        digests,
    })
}

/// IPv4-mapped IPv6 as IPv4, so that a peer list of IPv4 addresses matches.
pub(crate) fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// `BufferDone` on session `session_id`.
pub fn done(
    bufs: &Buffers,
    session_id: u64,
    req: proto::BufferDoneRequest,
) -> Result<proto::BufferDoneResponse, OpError> {
    let Some(mut g) = bufs.grants.take(req.grant, session_id) else {
        return Err(OpError::new(
            Reason::Retryable,
            format!(
                "grant {} is not live on this session (revoked: its exposure was withdrawn or \
                 it timed out)",
                req.grant
            ),
        ));
    };
    // Revoke first: nothing reaches the ranges from here on.
    crate::control::in_place(|| g.regs.clear());
    let ranges = std::mem::take(&mut g.ranges);
    if !req.failed.is_empty() {
        tracing::info!(grant = req.grant, name = %crate::escape::esc(&g.name), why = %crate::escape::esc(&req.failed), "buffer operation failed on the peer");
        return Ok(proto::BufferDoneResponse { bad: Vec::new() });
    }
    let mut bad = Vec::new();
    let ds = digests(g.check, &ranges);
    if g.write {
        if !g.check.is_none() {
            if req.digests.len() != ranges.len() {
                return Err(OpError::new(
                    Reason::Invalid,
                    format!("{} digests for {} ranges", req.digests.len(), ranges.len()),
                ));
            }
            for (i, (a, b)) in ds.iter().zip(&req.digests).enumerate() {
                if a != b {
                    bad.push(i as u32);
                }
            }
        }
    } else {
        bad = req.bad.clone();
    }
    let list: Vec<Value> = ranges
        .iter()
        .zip(&ds)
        .map(|(r, d)| json!([r.lease().offset(), r.lease().len(), hex(d)]))
        .collect();
    let mut ev = json!({
        "event": if g.write { "written" } else { "read" },
        "name": g.name,
        "peer": g.peer,
        "ranges": list,
        "message": g.message,
        "check": g.check.name(),
    });
    if !bad.is_empty() {
        ev["error"] = OpError::new(
            Reason::Integrity,
            format!("ranges {bad:?} did not match their digests"),
        )
        .to_json();
    }
    let _ = g.events.send(ev);
    drop(ranges);
    Ok(proto::BufferDoneResponse { bad })
}
