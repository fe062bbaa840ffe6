//! The exposing side of a peer's operation: `BufferGrant` checks the name,
//! the access, the peer and every range against the exposure, leases the
//! ranges and registers each in the peer session's domain (on every rail)
//! with the one right the operation needs (with memory windows: a window
//! bound to the session's QP, into the exposure registered once);
//! `BufferDone` revokes the round's keys (registrations first), verifies
//! what landed (write) or takes the peer's word (read), grants the ranges
//! that did not match again, as files' blocks are, at most the session's
//! `max_retries` rounds, and at the end tells the owner. A grant whose peer
//! says nothing in a round for rcpd's timeout is revoked too. What each
//! answer means is [`GrantCore`]'s; this is its driver (the table of
//! grants, keys, hashing, the owner's event, the timer).

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::api::{ErrorBody, Event, OwnerEvent, ServiceReason};
use super::{Buffers, Exposure, Failure};
use crate::control::error::Reason;
use crate::control::protocol::buffer::{DoneStep, GrantCore, GrantNext, GrantPhase};
use crate::control::server::conns::ConnKey;
use crate::control::server::SessionState;
use crate::files::Check;
use crate::mem::memfd::{LeaseKind, LeasedRange};
use crate::proto;
use crate::provider::exposed::Exposed;
use crate::provider::Access;

/// Ranges one operation may name.
pub const MAX_RANGES: usize = 4096;
/// Bytes of a writer's message.
pub const MAX_MESSAGE: usize = 256;

/// One live grant.
struct GrantState {
    /// Each range's lease and, while the round grants it, its
    /// registrations (one per rail): its bytes reachable only revoked.
    ranges: Vec<Exposed<LeasedRange>>,
    /// Each range's digest: read, those sent with the grant; write, those
    /// of what landed, as each range is verified.
    digests: Vec<Vec<u8>>,
    /// Its rounds: the ranges moving, the round against the retry bound,
    /// the round's deadline.
    core: GrantCore,
    session: u64,
    name: String,
    write: bool,
    check: Check,
    message: String,
    peer: String,
    exp: Arc<Exposure>,
    /// The connection it was asked on: it goes when that ends.
    conn: Option<ConnKey>,
}

/// What a standing grant ([`super::standing`]) grants, to whom.
#[derive(Clone)]
pub struct StandingGrant {
    pub(super) session: u64,
    pub(super) exp: Arc<Exposure>,
    pub(super) write: bool,
    pub(super) name: String,
    /// The peer as the owner's events name it.
    pub(super) peer: String,
}

/// A standing grant as the table holds it: its registrations (one per
/// rail; dropped first when it is revoked), what the peer was told, and
/// what it grants.
pub struct Held {
    /// Kept for its drop (which revokes every key).
    pub(super) _keys: Exposed<crate::provider::exposed::Standing>,
    pub(super) range: proto::GrantedRange,
    /// Shared with each notice checked against it.
    pub(super) grant: Arc<StandingGrant>,
}

/// A grant in the table.
enum Entry {
    Live(Box<GrantState>),
    /// `BufferDone` holds the grant's state while it verifies (its keys
    /// revoked); the owner going meanwhile removes the slot, and the state
    /// is dropped when `BufferDone` finds it gone.
    Verifying {
        session: u64,
        owner: u64,
    },
    /// A standing grant ([`super::standing`]): the whole exposure, until
    /// the exposure is withdrawn, its owner goes or the session ends.
    Standing(Box<Held>),
}

impl Entry {
    fn owner(&self) -> u64 {
        match self {
            Entry::Live(g) => g.exp.owner,
            Entry::Verifying { owner, .. } => *owner,
            Entry::Standing(s) => s.grant.exp.owner,
        }
    }

    fn session(&self) -> u64 {
        match self {
            Entry::Live(g) => g.session,
            Entry::Verifying { session, .. } => *session,
            Entry::Standing(s) => s.grant.session,
        }
    }
}

/// In `live`, the standing grant of `session` on `exp` with `write`
/// access: its id and range.
fn find_standing(
    live: &HashMap<u64, Entry>,
    session: u64,
    exp: &Arc<Exposure>,
    write: bool,
) -> Option<(u64, proto::GrantedRange)> {
    live.iter().find_map(|(&id, g)| match g {
        Entry::Standing(s)
            if s.grant.session == session
                && s.grant.write == write
                && Arc::ptr_eq(&s.grant.exp, exp) =>
        {
            Some((id, s.range.clone()))
        }
        _ => None,
    })
}

/// The grants one rcpd made, by id.
pub struct Grants {
    next: AtomicU64,
    /// The gRPC port's open connections (taken before `live`).
    open: Mutex<HashSet<ConnKey>>,
    live: Mutex<HashMap<u64, Entry>>,
    /// The cores' time 0.
    t0: Instant,
}

impl Default for Grants {
    fn default() -> Grants {
        Grants {
            next: AtomicU64::default(),
            open: Mutex::default(),
            live: Mutex::default(),
            t0: Instant::now(),
        }
    }
}

impl Grants {
    /// Nanoseconds since the table's birth: the cores' clock.
    fn now(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }

    /// Revoke every grant on connection `owner`'s exposures; how many.
    pub(crate) fn revoke_owner(&self, owner: u64) -> usize {
        self.revoke_where(|g| g.owner() == owner)
    }

    /// Connection `conn` of the gRPC port opened.
    pub(crate) fn conn_opened(&self, conn: ConnKey) {
        self.open.lock().unwrap().insert(conn);
    }

    /// Connection `conn` ended: revoke every grant per operation asked on
    /// it (its peer hears of none of them any more: their `BufferDone`
    /// would have come on it), their leases released now, not at their
    /// timeout; how many.
    pub(crate) fn conn_closed(&self, conn: ConnKey) -> usize {
        self.open.lock().unwrap().remove(&conn);
        self.revoke_where(|g| matches!(g, Entry::Live(g) if g.conn == Some(conn)))
    }

    /// File grant `g` as `id`, unless the connection it was asked on has
    /// ended meanwhile (then it is dropped: revoked); whether it was.
    fn insert_live(&self, id: u64, g: Box<GrantState>) -> bool {
        let open = self.open.lock().unwrap();
        if g.conn.is_some_and(|c| !open.contains(&c)) {
            drop(open);
            crate::control::in_place(|| drop(g));
            return false;
        }
        self.live.lock().unwrap().insert(id, Entry::Live(g));
        true
    }

    /// Revoke every grant made to session `session` (it closed: nothing
    /// it was granted stays reachable); how many.
    pub(crate) fn revoke_session(&self, session: u64) -> usize {
        self.revoke_where(|g| g.session() == session)
    }

    /// Revoke the standing grants of exposure `exp` (withdrawn or
    /// replaced; grants per operation keep their ranges to their end);
    /// how many.
    pub(crate) fn revoke_standing(&self, exp: &Arc<Exposure>) -> usize {
        self.revoke_where(|g| matches!(g, Entry::Standing(s) if Arc::ptr_eq(&s.grant.exp, exp)))
    }

    /// Revoke every grant on exposure `exp`, per operation and standing
    /// (its buffer is released: nothing more may land in it, as when its
    /// owner goes); how many.
    pub(crate) fn revoke_exposure(&self, exp: &Arc<Exposure>) -> usize {
        self.revoke_where(|g| match g {
            Entry::Live(g) => Arc::ptr_eq(&g.exp, exp),
            Entry::Standing(s) => Arc::ptr_eq(&s.grant.exp, exp),
            // Its keys are revoked already; it only checks what landed.
            Entry::Verifying { .. } => false,
        })
    }

    /// The standing grant of `session` on `exp` with `write` access, if
    /// there is one: its id and what the peer was told of it.
    pub(super) fn standing_of(
        &self,
        session: u64,
        exp: &Arc<Exposure>,
        write: bool,
    ) -> Option<(u64, proto::GrantedRange)> {
        find_standing(&self.live.lock().unwrap(), session, exp, write)
    }

    /// File standing grant `h`, unless one of its session, exposure and
    /// access came first (then that one's id and range, `h` revoked);
    /// whether `h` was filed.
    pub(super) fn insert_standing(&self, h: Held) -> (u64, proto::GrantedRange, bool) {
        let mut l = self.live.lock().unwrap();
        let g = &h.grant;
        if let Some((id, range)) = find_standing(&l, g.session, &g.exp, g.write) {
            drop(l);
            crate::control::in_place(|| drop(h));
            return (id, range, false);
        }
        let id = self.next.fetch_add(1, Relaxed) + 1;
        let range = h.range.clone();
        l.insert(id, Entry::Standing(Box::new(h)));
        (id, range, true)
    }

    /// What standing grant `id` of `session` grants, while it stands.
    pub(super) fn standing(&self, id: u64, session: u64) -> Option<Arc<StandingGrant>> {
        match self.live.lock().unwrap().get(&id) {
            Some(Entry::Standing(s)) if s.grant.session == session => Some(s.grant.clone()),
            _ => None,
        }
    }

    fn revoke_where(&self, which: impl Fn(&Entry) -> bool) -> usize {
        let gone: Vec<Entry> = {
            let mut l = self.live.lock().unwrap();
            let ids: Vec<u64> = l
                .iter()
                .filter(|(_, g)| which(g))
                .map(|(&id, _)| id)
                .collect();
            ids.iter().filter_map(|id| l.remove(id)).collect()
        };
        let n = gone.len();
        crate::control::in_place(|| drop(gone));
        n
    }

    /// Grant `id` of `session` if its core says it expired by `now`.
    fn expire(&self, id: u64, session: u64, now: u64) -> Option<Box<GrantState>> {
        let mut l = self.live.lock().unwrap();
        let expired = match l.get_mut(&id) {
            Some(Entry::Live(g)) if g.session == session => g.core.handle_timeout(now),
            _ => false,
        };
        if !expired {
            return None;
        }
        match l.remove(&id) {
            Some(Entry::Live(g)) => Some(g),
            _ => unreachable!("matched above"),
        }
    }

    /// When grant `id` of `session` expires, while it is live.
    fn deadline(&self, id: u64, session: u64) -> Option<u64> {
        match self.live.lock().unwrap().get(&id) {
            Some(Entry::Live(g)) if g.session == session => g.core.poll_timeout(),
            _ => None,
        }
    }

    /// Grant `id` of `session` for its `BufferDone`: its slot says it is
    /// being verified until [`Grants::resume`] or [`Grants::end`].
    fn begin_done(&self, id: u64, session: u64) -> Result<Box<GrantState>, Failure> {
        let mut l = self.live.lock().unwrap();
        match l.get(&id) {
            Some(s) if s.session() == session => {}
            _ => {
                return Err(Failure::new(
                    Reason::Retryable,
                    format!(
                        "grant {id} is not live on this session (revoked: its exposure was \
                         withdrawn or it timed out)"
                    ),
                ))
            }
        }
        if matches!(l[&id], Entry::Standing(_)) {
            return Err(Failure::new(
                Reason::Protocol,
                format!("grant {id} is a standing grant: its operations end with BufferNotify"),
            ));
        }
        let owner = l[&id].owner();
        match l.insert(id, Entry::Verifying { session, owner }) {
            Some(Entry::Live(g)) => Ok(g),
            Some(v) => {
                l.insert(id, v);
                Err(Failure::new(
                    Reason::Protocol,
                    format!("a BufferDone for grant {id} while its last one is verified"),
                ))
            }
            None => unreachable!("looked up above"),
        }
    }

    /// Put grant `id`'s state back (ranges granted again); `false` when it
    /// was revoked meanwhile (the state is dropped then).
    fn resume(&self, id: u64, g: Box<GrantState>) -> bool {
        let open = self.open.lock().unwrap();
        let gone = g.conn.is_some_and(|c| !open.contains(&c));
        let mut l = self.live.lock().unwrap();
        if gone {
            l.remove(&id);
        }
        drop(open);
        if matches!(l.get(&id), Some(Entry::Verifying { .. })) {
            l.insert(id, Entry::Live(g));
            return true;
        }
        drop(l);
        crate::control::in_place(|| drop(g));
        false
    }

    /// Grant `id`'s `BufferDone` ended it.
    fn end(&self, id: u64) {
        let mut l = self.live.lock().unwrap();
        if matches!(l.get(&id), Some(Entry::Verifying { .. })) {
            l.remove(&id);
        }
    }
}

/// Each range's digest under `check` (empty for none).
pub(crate) fn digests(check: Check, ranges: &[LeasedRange]) -> Vec<Vec<u8>> {
    digests_by(check, ranges, |r| r)
}

/// Bytes of ranges hashed where they are asked for: a window of small
/// pages costs less to hash than the hand-off of the task's thread and the
/// pool's wake-ups (64 pages of 4 KiB side by side are ~35 µs of BLAKE3; a
/// hand-off, tens, and a batch of them 7 % fewer operations a second:
/// docs/benchmarks.md).
const HASH_IN_TASK: u64 = 256 << 10;

/// Bytes of ranges hashed on the task's thread, handed off, not on the
/// pool: up to a few hundred µs of BLAKE3, where the pool's threads would
/// spend about as much again waking and spinning for the next batch (a
/// batch of framed 64 KiB writes: the rcpds' CPU per operation 8 % less,
/// operations 13 % faster; docs/benchmarks.md).
const HASH_ON_THREAD: u64 = 1 << 20;

/// The digest under `check` of each item's range (`range_of`; empty for
/// none): in the task for a few small ones ([`HASH_IN_TASK`]), on the
/// task's thread handed off up to [`HASH_ON_THREAD`], else on the hashing
/// pool with the task's thread handed off.
pub(crate) fn digests_by<T: Sync>(
    check: Check,
    items: &[T],
    range_of: impl Fn(&T) -> &LeasedRange + Sync + Send,
) -> Vec<Vec<u8>> {
    if check.is_none() {
        return vec![Vec::new(); items.len()];
    }
    let one = |x: &T| range_of(x).with(|b| check.wire(&check.block(b)));
    // Small ranges together, side by side where the check can (BLAKE3's
    // lanes: files::blake3_lanes).
    let together = || {
        let slices: Vec<&[u8]> = items.iter().map(|x| range_of(x).bytes()).collect();
        let ds = check.blocks_here(&slices);
        ds.iter().map(|d| check.wire(d)).collect()
    };
    let bytes: u64 = items.iter().map(|x| range_of(x).lease().len()).sum();
    if bytes <= HASH_IN_TASK {
        return together();
    }
    if bytes <= HASH_ON_THREAD {
        return crate::control::in_place(together);
    }
    crate::control::in_place(|| crate::files::digest::on_pool(items, one))
}

/// What `BufferGrant` from the peer at `peer` asks, checked: whether it
/// writes, and the exposure it may reach.
pub fn admit(
    bufs: &Buffers,
    req: &proto::BufferGrantRequest,
    peer: Option<IpAddr>,
) -> Result<(bool, Arc<Exposure>), Failure> {
    let write = check_request(req)?;
    let exp = exposure_for(bufs, req, write, peer)?;
    Ok((write, exp))
}

/// `BufferGrant` from the peer at `peer` on its session `session_id`, a
/// grant of its own for the operation ([`admit`]ted: `write`, `exp`).
pub fn grant(
    bufs: &Arc<Buffers>,
    session: &SessionState,
    session_id: u64,
    req: proto::BufferGrantRequest,
    (peer, conn): (Option<IpAddr>, Option<ConnKey>),
    (write, exp): (bool, Arc<Exposure>),
) -> Result<proto::BufferGrantResponse, Failure> {
    let ranges = lease_ranges(&exp, &req, write)?;
    let check = session.params.check;
    let digests = if write {
        vec![Vec::new(); ranges.len()]
    } else {
        digests(check, &ranges)
    };
    let mut ranges: Vec<Exposed<LeasedRange>> = ranges.into_iter().map(Exposed::new).collect();
    let all: Vec<u32> = (0..ranges.len() as u32).collect();
    let out = register(&exp, session, &mut ranges, &all, write, &req.name)?;
    let id = bufs.grants.next.fetch_add(1, Relaxed) + 1;
    let core = GrantCore::new(
        ranges.len() as u32,
        write,
        !check.is_none(),
        session.params.max_retries,
        bufs.grant_timeout().as_nanos() as u64,
        bufs.grants.now(),
    );
    let what = if write { "write" } else { "read" };
    tracing::debug!(grant = id, name = %crate::escape::esc(&req.name), what, ranges = out.len(), "buffer grant");
    let resp = proto::BufferGrantResponse {
        grant: id,
        ranges: out,
        digests: if write { Vec::new() } else { digests.clone() },
        standing: None,
    };
    let filed = bufs.grants.insert_live(
        id,
        Box::new(GrantState {
            ranges,
            digests,
            core,
            session: session_id,
            name: req.name,
            write,
            check,
            message: req.message,
            peer: event_peer(&req.node, peer),
            exp,
            conn,
        }),
    );
    if !filed {
        return Err(Failure::new(
            Reason::Retryable,
            "the connection this grant was asked on has closed",
        ));
    }
    arm_timeout(bufs, id, session_id);
    Ok(resp)
}

/// The request's own bounds (access named, ranges, message); whether it
/// writes.
fn check_request(req: &proto::BufferGrantRequest) -> Result<bool, Failure> {
    let write = match proto::BufferAccess::try_from(req.access) {
        Ok(proto::BufferAccess::Write) => true,
        Ok(proto::BufferAccess::Read) => false,
        _ => return Err(Failure::new(Reason::Invalid, "no buffer access named")),
    };
    if req.ranges.is_empty() || req.ranges.len() > MAX_RANGES {
        return Err(Failure::new(
            Reason::Invalid,
            format!("{} ranges (1..={MAX_RANGES})", req.ranges.len()),
        ));
    }
    within_limit("a message", &req.message)?;
    // A write's ranges are leased exclusively here: two that overlap
    // would hold each other up for good.
    if write {
        let ranges = req.ranges.iter().map(|r| (r.offset, r.len));
        if let Some(m) = overlap(ranges, "remote") {
            return Err(Failure::new(Reason::Invalid, m));
        }
    }
    within_limit("a node address", &req.node)?;
    Ok(write)
}

/// `what` (`s`) is at most [`MAX_MESSAGE`] bytes, or the operation is
/// invalid: one rule for the writer, before anything moves, and the
/// exposer.
pub(crate) fn within_limit(what: &str, s: &str) -> Result<(), Failure> {
    if s.len() > MAX_MESSAGE {
        return Err(Failure::new(
            Reason::Invalid,
            format!("{what} of {} bytes (at most {MAX_MESSAGE})", s.len()),
        ));
    }
    Ok(())
}

/// Two of an operation's own `ranges` (`(offset, len)`, `which`: local
/// or remote) that overlap, named; `None` when no two do. Where a range is
/// leased exclusively (a write's remote ones, a read's local ones) the
/// operation would conflict with itself, which no retry undoes.
pub(crate) fn overlap(ranges: impl Iterator<Item = (u64, u64)>, which: &str) -> Option<String> {
    let mut by_offset: Vec<(u64, u64, usize)> = ranges
        .enumerate()
        .map(|(i, (offset, len))| (offset, offset.saturating_add(len), i))
        .collect();
    by_offset.sort_unstable();
    by_offset.windows(2).find_map(|w| {
        let ((lo_a, hi_a, a), (lo_b, hi_b, b)) = (w[0], w[1]);
        (lo_b < hi_a).then(|| {
            format!(
                "the operation's own {which} ranges overlap: range {} [{lo_a}, {hi_a}) and \
                 range {} [{lo_b}, {hi_b})",
                a.min(b),
                a.max(b)
            )
        })
    })
}

/// The peer as the owner's event names it: the address the peer rcpd
/// says it is dialed at, else (an rcpd that predates it) the IP address
/// its request came from.
pub(super) fn event_peer(node: &str, ip: Option<IpAddr>) -> String {
    if !node.is_empty() {
        return node.to_string();
    }
    ip.map_or_else(String::new, |p| p.to_string())
}

/// The exposure the request names, if it grants `peer` the access.
fn exposure_for(
    bufs: &Buffers,
    req: &proto::BufferGrantRequest,
    write: bool,
    peer: Option<IpAddr>,
) -> Result<Arc<Exposure>, Failure> {
    let exp = bufs
        .exposures
        .lock()
        .unwrap()
        .get(&req.name)
        .cloned()
        .ok_or_else(|| {
            Failure::new(
                Reason::FileNotFound,
                format!("no buffer is exposed as {:?} on this rcpd", req.name),
            )
        })?;
    let what = if write { "write" } else { "read" };
    if (write && !exp.access.write) || (!write && !exp.access.read) {
        return Err(Failure::new(
            Reason::Permission,
            format!("{:?} is not exposed for {what}", req.name),
        ));
    }
    if !exp.peers.is_empty() && !peer.is_some_and(|p| exp.peers.contains(&canonical(p))) {
        return Err(Failure::new(
            Reason::Permission,
            format!(
                "{:?} is not exposed to peer {}",
                req.name,
                peer.map_or("(unknown)".into(), |p| p.to_string())
            ),
        ));
    }
    Ok(exp)
}

/// `[offset, offset + len)` (not empty) if it lies inside the exposed
/// `(start, size)` of `name`.
pub(crate) fn inside(
    (start, size): (u64, u64),
    offset: u64,
    len: u64,
    name: &str,
) -> Result<(), Failure> {
    let (lo, hi) = (start, start.saturating_add(size));
    let end = offset.checked_add(len);
    if len == 0 || offset < lo || end.is_none_or(|e| e > hi) {
        return Err(Failure::new(
            Reason::Invalid,
            format!(
                "range [{offset}, {}) is outside the exposed [{lo}, {hi}) of {name:?}",
                offset.saturating_add(len),
            ),
        ));
    }
    Ok(())
}

/// Lease each range of the request inside the exposure (exclusively for
/// bytes that land, shared for bytes read).
fn lease_ranges(
    exp: &Exposure,
    req: &proto::BufferGrantRequest,
    write: bool,
) -> Result<Vec<LeasedRange>, Failure> {
    let kind = if write {
        LeaseKind::Exclusive
    } else {
        LeaseKind::Shared
    };
    let mut ranges = Vec::with_capacity(req.ranges.len());
    for r in &req.ranges {
        inside((exp.offset, exp.len), r.offset, r.len, &req.name)?;
        let l = exp
            .buffer
            .lease(r.offset, r.len, kind)
            .expect("inside the exposure, so inside the buffer")
            .map_err(|e| Failure::new(Reason::Retryable, format!("{:?}: {e}", req.name)))?;
        ranges.push(l);
    }
    Ok(ranges)
}

/// Grant `which` of `ranges` in the session's domain (and each rail's)
/// with the one right the operation needs; what the peer is told of each.
pub(super) fn register<M: crate::provider::exposed::Exposable>(
    exp: &Exposure,
    session: &SessionState,
    ranges: &mut [Exposed<M>],
    which: &[u32],
    write: bool,
    name: &str,
) -> Result<Vec<proto::GrantedRange>, Failure> {
    let access = if write {
        Access::REMOTE_WRITE | Access::LOCAL_WRITE
    } else {
        Access::REMOTE_READ
    };
    let domains: Vec<&dyn crate::provider::Domain> = std::iter::once(&*session.domain)
        .chain(session.rail_domains().map(|d| &**d))
        .collect();
    let whole = exp
        .buffer
        .span_of(exp.offset, exp.len)
        .expect("an exposure lies inside its buffer");
    let mut out = Vec::new();
    for &i in which {
        let r = &mut ranges[i as usize];
        let len = r.revoke().bytes();
        // A range leased exclusively for a peer's WRITE, shared for its
        // READ (`lease_ranges`); the service's own writes are beyond
        // rcpd's reach and fail the check (src/mem/memfd.rs).
        let regs = r
            .grant(
                domains.iter().copied(),
                len,
                access,
                Some((&exp.bases, &whole)),
            )
            .map_err(|e| {
                Failure::new(
                    Reason::Other,
                    format!("registering range {i} ({len} bytes) of {name:?}: {e}"),
                )
            })?;
        let keys: Vec<u32> = regs.iter().map(|r| r.rkey()).collect();
        out.push(proto::GrantedRange {
            addr: regs[0].addr(),
            rkey: keys[0],
            rail_rkeys: if keys.len() > 1 { keys } else { Vec::new() },
        });
    }
    Ok(out)
}

/// Revoke grant `id` once its core says it expired: sleep to the round's
/// deadline ([`GrantCore::poll_timeout`]) and ask; a grant that moved on
/// to another round meanwhile has a later deadline, slept to in turn.
fn arm_timeout(bufs: &Arc<Buffers>, id: u64, session_id: u64) {
    let b = bufs.clone();
    tokio::spawn(async move {
        while let Some(at) = b.grants.deadline(id, session_id) {
            let wait = at.saturating_sub(b.grants.now());
            tokio::time::sleep(std::time::Duration::from_nanos(wait)).await;
            if let Some(g) = b.grants.expire(id, session_id, b.grants.now()) {
                tracing::warn!(grant = id, name = %crate::escape::esc(&g.name), "buffer grant revoked: its peer said nothing for the timeout");
                crate::control::in_place(|| drop(g));
                return;
            }
        }
    });
}

/// IPv4-mapped IPv6 as IPv4, so that a peer list of IPv4 addresses matches.
pub(crate) fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// `BufferDone` on session `session_id` (`session`: its state, while it
/// is open): revoke the round's keys, verify, and either grant the damaged
/// ranges again (within the retry bound) or end the grant and tell the
/// owner.
pub fn done(
    bufs: &Arc<Buffers>,
    session: Option<&SessionState>,
    session_id: u64,
    req: proto::BufferDoneRequest,
) -> Result<proto::BufferDoneResponse, Failure> {
    let id = req.grant;
    let mut g = bufs.grants.begin_done(id, session_id)?;
    let step = match g.core.done(&req) {
        Ok(step) => step,
        Err(e) if g.core.phase() == GrantPhase::Live => {
            // Another round's (late or repeated): the grant goes on as it
            // was, its timer too (one that woke while the grant was out of
            // the table has let go of it).
            if bufs.grants.resume(id, g) {
                arm_timeout(bufs, id, session_id);
            }
            return Err(e);
        }
        Err(e) => {
            bufs.grants.end(id);
            crate::control::in_place(|| drop(g));
            return Err(e);
        }
    };
    // Revoke first: nothing reaches the ranges from here on.
    crate::control::in_place(|| {
        for r in &mut g.ranges {
            r.revoke();
        }
    });
    let ended = |g: Box<GrantState>| {
        bufs.grants.end(id);
        crate::control::in_place(|| drop(g));
    };
    let bad = match step {
        DoneStep::Failed => {
            tracing::info!(grant = id, name = %crate::escape::esc(&g.name), why = %crate::escape::esc(&req.failed), "buffer operation failed on the peer");
            ended(g);
            return Ok(proto::BufferDoneResponse::default());
        }
        DoneStep::Checked(bad) => bad,
        DoneStep::Hash(moving) => verify(&mut g, &moving, &req.digests),
    };
    let again = match g.core.verified(bufs.grants.now(), bad, session.is_some()) {
        GrantNext::Regrant(bad) => bad,
        GrantNext::End { bad } => {
            tell_owner(&mut g, &bad);
            ended(g);
            return Ok(proto::BufferDoneResponse {
                bad,
                again: Vec::new(),
            });
        }
    };
    let s = session.expect("a regrant only on an open session");
    let granted = match regrant(&mut g, s, &again) {
        Ok(granted) => granted,
        Err(e) => {
            g.core.regrant_failed();
            ended(g);
            return Err(e);
        }
    };
    tracing::debug!(grant = id, round = g.core.round(), ranges = ?again, "buffer ranges damaged: granted again");
    if !bufs.grants.resume(id, g) {
        return Err(Failure::new(
            Reason::Retryable,
            format!("grant {id} was revoked while it was verified (its exposure was withdrawn)"),
        ));
    }
    arm_timeout(bufs, id, session_id);
    Ok(proto::BufferDoneResponse {
        bad: again,
        again: granted,
    })
}

/// A write's ranges of this round (`moving`) that did not match the
/// peer's `digests`: hash what landed (keys revoked), keeping each
/// range's digest for the owner.
fn verify(g: &mut GrantState, moving: &[u32], digests: &[Vec<u8>]) -> Vec<u32> {
    let check = g.check;
    let mut bad = Vec::new();
    crate::control::in_place(|| {
        for &i in moving {
            let r = g.ranges[i as usize].revoke();
            // SAFETY: the round's registrations are revoked and the range
            // is leased exclusively (a write's grant): no device reaches
            // it.
            unsafe { super::faults::inject(&g.name, r) };
        }
        // The round's ranges on the hashing pool, against the peer's.
        let ranges = &g.ranges;
        let landed = check.landed_with(
            moving,
            |&i| {
                let r = ranges[i as usize].get().expect("revoked above");
                r.with(|b| check.block(b))
            },
            |k| digests.get(moving[k] as usize).map(Vec::as_slice),
        );
        for ((&i, d), ok) in moving.iter().zip(&landed.digests).zip(&landed.ok) {
            if !ok {
                bad.push(i);
            }
            g.digests[i as usize] = check.wire(d);
        }
    });
    bad
}

/// Grant the ranges `bad` again (the next round): new keys in the
/// session's domains, the leases kept.
fn regrant(
    g: &mut GrantState,
    session: &SessionState,
    bad: &[u32],
) -> Result<Vec<proto::GrantedRange>, Failure> {
    register(&g.exp, session, &mut g.ranges, bad, g.write, &g.name)
}

/// The owner's event for the ended grant: every range with its digest,
/// the ranges granted again, and which did not match in the end.
fn tell_owner(g: &mut GrantState, bad: &[u32]) {
    let ranges = g
        .ranges
        .iter_mut()
        .map(|r| r.revoke().lease())
        .zip(&g.digests)
        .map(|(l, d)| (l.offset(), l.len(), hex::encode(d)))
        .collect();
    let ev = OwnerEvent {
        name: g.name.clone(),
        peer: g.peer.clone(),
        ranges,
        message: g.message.clone(),
        check: g.check.name().to_string(),
        resent: g.core.resent(),
        error: damage(bad, g.core.round()),
    };
    send_event(&g.exp, g.write, ev);
}

/// The error of an operation whose ranges `bad` did not match after
/// `rounds` rounds of resends (none: it moved intact).
pub(super) fn damage(bad: &[u32], rounds: u32) -> Option<ErrorBody> {
    (!bad.is_empty()).then(|| ErrorBody {
        reason: ServiceReason::Integrity,
        message: format!(
            "ranges {bad:?} did not match their digests{}",
            if rounds > 0 {
                format!(" after {rounds} resends")
            } else {
                String::new()
            }
        ),
    })
}

/// Send `exp`'s owner the event of a peer's write (or read) `ev`.
pub(super) fn send_event(exp: &Exposure, write: bool, ev: OwnerEvent) {
    exp.events.send(event_frame(write, ev));
}

/// The frame of a peer's write (or read) `ev` for its owner.
pub(super) fn event_frame(write: bool, ev: OwnerEvent) -> Vec<u8> {
    let ev = if write {
        Event::Written(ev)
    } else {
        Event::Read(ev)
    };
    super::wire::encode(&ev)
}

/// Owners' events gathered while a batch is handled, sent when it is:
/// consecutive events for one owner go as one message to its
/// connection's writer (one wake-up of it, one send), in their order.
#[derive(Default)]
pub(super) struct EventBatch {
    out: Vec<(Arc<Exposure>, Vec<u8>)>,
}

impl EventBatch {
    pub(super) fn push(&mut self, exp: &Arc<Exposure>, frame: Vec<u8>) {
        match self.out.last_mut() {
            Some((e, bytes)) if Arc::ptr_eq(e, exp) => bytes.extend_from_slice(&frame),
            _ => self.out.push((exp.clone(), frame)),
        }
    }

    /// Sending these, as an answer's work after it is sent (none when
    /// there are none).
    pub(super) fn after_answer(self) -> Option<Box<dyn FnOnce() + Send>> {
        (!self.out.is_empty()).then(|| Box::new(move || self.send()) as Box<dyn FnOnce() + Send>)
    }

    pub(super) fn send(self) {
        for (exp, bytes) in self.out {
            exp.events.send(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::memfd::ServiceBuffer;
    use crate::mem::{Arena, ArenaConfig};

    fn exposure(events: Arc<super::super::outbox::Outbox>) -> Arc<Exposure> {
        Arc::new(Exposure {
            owner: 1,
            buffer: ServiceBuffer::from_arena(Arena::new(&ArenaConfig::new(1 << 20)).unwrap()),
            offset: 0,
            len: 4096,
            access: super::super::Rights {
                read: true,
                write: true,
            },
            peers: Vec::new(),
            standing: true,
            events,
            bases: Default::default(),
        })
    }

    /// Two ranges of one operation that overlap are named; touching ones
    /// do not overlap. A write's grant with two is refused `invalid` (its
    /// exclusive leases would hold each other up), a read's is not.
    #[test]
    fn an_operations_own_overlapping_ranges_are_invalid() {
        assert_eq!(
            overlap([(0, 4096), (4096, 4096)].into_iter(), "remote"),
            None
        );
        let m = overlap([(8192, 4096), (0, 4096), (4000, 100)].into_iter(), "local").unwrap();
        assert!(
            m.contains("own local ranges overlap: range 1 [0, 4096) and range 2"),
            "{m}"
        );
        let req = |access: proto::BufferAccess| proto::BufferGrantRequest {
            access: access as i32,
            ranges: vec![
                proto::BufferRange {
                    offset: 0,
                    len: 8192,
                },
                proto::BufferRange {
                    offset: 4096,
                    len: 4096,
                },
            ],
            ..Default::default()
        };
        let e = check_request(&req(proto::BufferAccess::Write)).unwrap_err();
        assert_eq!(e.reason, Reason::Invalid, "{e}");
        assert!(e.message.contains("overlap"), "{e}");
        assert!(!check_request(&req(proto::BufferAccess::Read)).unwrap());
    }

    /// A batch's events reach each owner whole and in order, consecutive
    /// ones for one owner in one message.
    #[test]
    fn a_batch_of_events_goes_to_each_owner_in_order() {
        let (ta, mut ra) = super::super::outbox::Outbox::new();
        let (tb, mut rb) = super::super::outbox::Outbox::new();
        let (a, b) = (exposure(ta), exposure(tb));
        let mut batch = EventBatch::default();
        for (exp, f) in [(&a, b"a1"), (&a, b"a2"), (&b, b"b1"), (&a, b"a3")] {
            batch.push(exp, f.to_vec());
        }
        assert!(ra.try_recv().is_err(), "nothing before the batch is sent");
        batch.send();
        assert_eq!(ra.try_recv().unwrap(), b"a1a2");
        assert_eq!(ra.try_recv().unwrap(), b"a3");
        assert!(ra.try_recv().is_err());
        assert_eq!(rb.try_recv().unwrap(), b"b1");
        assert!(rb.try_recv().is_err());
    }
}
