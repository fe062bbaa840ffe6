//! The initiating side of a buffer operation, on a session to the peer
//! rcpd ([`super::sessions`]). An operation: lease its local ranges,
//! `BufferGrant` on the peer, post a window per descriptor (split into
//! requests of the session's block size), wait for every window, compare
//! or send the digests in `BufferDone`; what each answer means is
//! [`OpCore`]'s. Ranges that did not match come back granted again: they
//! move again, at most the peer's retry bound (`max_retries` of its
//! handshake) rounds, before the operation fails. A failed data path fails
//! the operations on it and the session is made anew by the next one; an
//! operation waiting on a session that gave up on RDMA runs again, whole,
//! over tcp.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::{oneshot, watch};

use super::api::Desc;
use super::frames::WriteFailed;
use super::grant::{digests, within_limit};
use super::{Buffers, Failure};
use crate::control::error::{status_reason, Reason};
use crate::control::fallback::then_over_tcp;
use crate::control::protocol::buffer::{self, OpCore, OpNext, StandingCore, StandingNext};
use crate::datapath::lend::RailRegs;
use crate::engine::{Extent, OpKind, WindowJob};
use crate::files::Check;
use crate::mem::memfd::{LeaseKind, LeasedRange, ServiceBuffer};
use crate::proto;
use crate::provider::ProviderKind;

use super::sessions::{link, PeerLink};
/// One operation a service asked for.
pub struct OpSpec {
    pub buffer: ServiceBuffer,
    pub buffer_uid: u64,
    pub peer: String,
    pub name: String,
    pub write: bool,
    /// (local offset, remote offset, len).
    pub descs: Vec<Desc>,
    pub message: String,
    pub check: Check,
}

/// What an operation did.
#[derive(Clone, Debug)]
pub struct Moved {
    pub bytes: u64,
    /// The provider its bytes moved over (the last session's).
    pub kind: ProviderKind,
    /// It moved over tcp because the peer's RDMA gave up: why.
    pub fell_back: Option<String>,
}

/// How an attempt at an operation ended, when not with its bytes moved.
enum Attempt {
    Failed(Failure),
    /// Its session gave up on RDMA (why) while it waited: it runs again
    /// over tcp once the session's data path has closed (`closed`: a
    /// read's ranges come back then).
    GaveUp {
        why: String,
        closed: watch::Receiver<()>,
    },
    /// Its session failed for another operation's sake (the peer refused
    /// a request of that one: its exposure is gone), not its own: it runs
    /// again, whole, on a new session once this one's data path closed.
    Bystander {
        why: String,
        closed: watch::Receiver<()>,
    },
    /// The session's standing grant it moved under was revoked (its
    /// exposure withdrawn, replaced or its owner gone) before the peer
    /// checked it: it runs again, whole, asking for a grant anew (which
    /// says whether the name is exposed now).
    Revoked {
        why: String,
    },
}

impl From<Failure> for Attempt {
    fn from(e: Failure) -> Attempt {
        Attempt::Failed(e)
    }
}

/// Run `op`; what it moved. A range whose check fails is granted again by
/// the peer and moved again, at most the session's `max_retries` rounds,
/// before the operation fails (`integrity`). An operation waiting on a
/// session that gave up on RDMA runs again, whole, over tcp (buffer writes
/// and reads of the same ranges are idempotent; a new grant there).
pub async fn run(
    bufs: &Arc<Buffers>,
    op: &OpSpec,
    cancelled: &AtomicBool,
) -> Result<Moved, Failure> {
    run_from(bufs, op, cancelled, None).await
}

/// [`run`], going on from `resume` (the rounds a grouped write already
/// had: [`GroupEnd::Resume`]) while the session and its grant are the
/// same, so that the retry bound counts every round the operation had.
pub async fn run_from(
    bufs: &Arc<Buffers>,
    op: &OpSpec,
    cancelled: &AtomicBool,
    resume: Option<Resume>,
) -> Result<Moved, Failure> {
    if op.descs.is_empty() {
        return Err(Failure::new(Reason::Invalid, "no descriptors"));
    }
    // A write's remote ranges and a read's local ones are leased
    // exclusively: two of its own that overlap would conflict with each
    // other on every try.
    let exclusive = op.descs.iter().map(|d| {
        if op.write {
            (d.remote, d.len)
        } else {
            (d.local, d.len)
        }
    });
    let which = if op.write { "remote" } else { "local" };
    if let Some(m) = super::grant::overlap(exclusive, which) {
        return Err(Failure::new(Reason::Invalid, m));
    }
    // Before anything moves: under a standing grant the peer sees the
    // message only in the notice, after the WRITEs.
    within_limit("a message", &op.message)?;
    let (why, closed, tcp) = match attempt(bufs, op, cancelled, resume).await {
        Ok(m) => return Ok(m),
        Err(Attempt::Failed(e)) => return Err(e),
        Err(Attempt::GaveUp { why, closed }) => (why, Some(closed), true),
        Err(Attempt::Bystander { why, closed }) => (why, Some(closed), false),
        Err(Attempt::Revoked { why }) => (why, None, false),
    };
    let then = match (tcp, &closed) {
        (true, _) => "over the tcp provider",
        (false, Some(_)) => "on a new session",
        (false, None) => "with a grant asked anew",
    };
    tracing::info!(peer = %crate::escape::esc(&op.peer), name = %crate::escape::esc(&op.name), "buffer operation moves again {then}: {why}");
    // Bounded: a data path that cannot close keeps a read's ranges, and
    // the attempt over tcp then fails naming them busy.
    if let Some(mut closed) = closed {
        let timeout = bufs.client_options().timeout;
        let _ =
            tokio::time::timeout(timeout, async { while closed.changed().await.is_ok() {} }).await;
    }
    let after = |e: Failure| {
        let m = if tcp {
            then_over_tcp(&why, &e.message)
        } else {
            format!("{why}; then {then}: {}", e.message)
        };
        Failure::new(e.reason, m)
    };
    match attempt(bufs, op, cancelled, None).await {
        Ok(m) => Ok(m),
        Err(Attempt::Failed(e)) => Err(after(e)),
        Err(
            Attempt::GaveUp { why: again, .. }
            | Attempt::Bystander { why: again, .. }
            | Attempt::Revoked { why: again },
        ) => Err(after(Failure::new(Reason::Retryable, again))),
    }
}

/// What became of one of the writes [`run_group`] was given.
pub enum GroupEnd {
    /// It ended.
    Ended(Result<Moved, Failure>),
    /// It did not go together: it runs on its own, whole ([`run`]).
    Alone,
    /// The peer found ranges of it bad and takes them again: it goes on
    /// on its own from the next round ([`run_from`]).
    Resume(Resume),
}

/// Where a grouped write the peer found damaged stands: its session's
/// link and standing grant, its protocol side (rounds had, ranges still
/// to move) and the digests its notices carry.
pub struct Resume {
    link: Arc<PeerLink>,
    standing: u64,
    core: StandingCore,
    digests: Vec<Vec<u8>>,
}

/// Several small writes to one peer's exposure (a request's, such as a
/// prepared list's), moved together where they can be: into the standing
/// grant the session already holds, on the session's connections with
/// their notices (tcp), as few queued entries as [`WRITE_MAX`] allows, so
/// that 64 writes of 4 KiB are one lease pass, one hashing pass, one entry
/// and one answer instead of 64 of each. The same notices, the same
/// checks by the peer, the same events for the owner as [`run`]'s, one
/// each. An operation that cannot go so (no standing grant held yet, not
/// tcp, too large, cancelled, a descriptor refused here) or whose grant
/// was revoked meanwhile is [`GroupEnd::Alone`]: it runs on its own,
/// whole (writes of the same ranges are idempotent; the owner was told
/// nothing). One with ranges the peer found bad and will take again is
/// [`GroupEnd::Resume`]: it goes on on its own from its next round, so
/// that its rounds in all stay within the peer's bound.
///
/// [`WRITE_MAX`]: super::frames::WRITE_MAX
pub async fn run_group(bufs: &Arc<Buffers>, ops: &[(&OpSpec, &AtomicBool)]) -> Vec<GroupEnd> {
    let mut ends: Vec<GroupEnd> = (0..ops.len()).map(|_| GroupEnd::Alone).collect();
    let Some(&(first, _)) = ops.first() else {
        return ends;
    };
    if !ops.iter().all(|(o, _)| together(first, o)) {
        return ends;
    }
    let Some(link) = bufs.peers.live(&(first.peer.clone(), first.check.name())) else {
        return ends;
    };
    let Some(frames) = link.notices.frames.clone().filter(|f| f.carries(0)) else {
        return ends;
    };
    let held = link.standing.lock().unwrap()[1]
        .get(first.name.as_str())
        .cloned();
    let Some(sg) = held else {
        return ends;
    };
    let _using = Using(&link);
    // Those that go together: each with its local ranges leased and
    // placed in the grant.
    let mut going: Vec<(usize, Vec<Moving>, u64)> = Vec::with_capacity(ops.len());
    for (k, &(op, cancelled)) in ops.iter().enumerate() {
        let bytes: u64 = op.descs.iter().map(|d| d.len).sum();
        let alone = cancelled.load(Relaxed)
            || op.descs.is_empty()
            || !frames.carries(bytes)
            || within_limit("a message", &op.message).is_err()
            || super::grant::overlap(op.descs.iter().map(|d| (d.remote, d.len)), "remote")
                .is_some();
        if alone {
            continue;
        }
        let (Ok(place), Ok(local)) = (placing(op, &sg), lease_local(op)) else {
            continue;
        };
        let moving = local
            .into_iter()
            .enumerate()
            .map(|(i, r)| (i as u32, r, place(i as u32)))
            .collect();
        going.push((k, moving, bytes));
    }
    let check = link.check;
    let digests = if check.is_none() {
        Vec::new()
    } else {
        let all: Vec<&LeasedRange> = going
            .iter()
            .flat_map(|(_, m, _)| m.iter().map(|(_, r, _)| r))
            .collect();
        super::grant::digests_by(check, &all, |r| *r)
    };
    let mut digests = digests.into_iter();
    // Entries of at most WRITE_MAX bytes each, told concurrently.
    let mut entries: Vec<Vec<(usize, &[Moving], proto::BufferNotice)>> = Vec::new();
    // Each one's side of the protocol and its notice's digests, kept for
    // its answer.
    let mut cores: Vec<Option<(StandingCore, Vec<Vec<u8>>)>> =
        (0..ops.len()).map(|_| None).collect();
    let mut bytes = u64::MAX;
    for &(k, ref moving, len) in &going {
        let op = ops[k].0;
        let ds: Vec<Vec<u8>> = if check.is_none() {
            Vec::new()
        } else {
            digests.by_ref().take(moving.len()).collect()
        };
        let core = StandingCore::new(op.descs.len() as u32, link.max_retries);
        let n = notice(op, sg.id, &ds, &core);
        cores[k] = Some((core, ds));
        if bytes.saturating_add(len) > super::frames::WRITE_MAX {
            entries.push(Vec::new());
            bytes = 0;
        }
        bytes += len;
        entries.last_mut().expect("an entry").push((k, moving, n));
    }
    let told = entries.into_iter().map(|entry| {
        let frames = &frames;
        async move {
            let ranges: Vec<_> = (entry.iter())
                .flat_map(|(_, m, _)| m.iter().map(|(_, r, at)| (r, at.addr, at.rkey)))
                .collect();
            let (ks, notices): (Vec<usize>, Vec<_>) =
                entry.into_iter().map(|(k, _, n)| (k, n)).unzip();
            let r = frames
                .write_notify_many(&ranges, notices, &first.peer)
                .await;
            (ks, r)
        }
    });
    for (ks, r) in futures::future::join_all(told).await {
        match r {
            Ok(results) => {
                if let Some(m) = &link.client.options().metrics {
                    for _ in &ks {
                        m.buffer_framed_write();
                    }
                }
                for (k, res) in ks.into_iter().zip(results) {
                    let (core, ds) = cores[k].take().expect("told, so made");
                    ends[k] = told_end(&link, sg.id, ops[k].0, core, ds, &res);
                }
            }
            // The grant is gone: each asks anew, on its own.
            Err(WriteFailed::Refused(_)) => forget(&link, first),
            Err(WriteFailed::Again) => {}
            Err(WriteFailed::Failed(e)) => {
                for k in ks {
                    ends[k] = GroupEnd::Ended(Err(e.clone()));
                }
            }
        }
    }
    ends
}

/// Whether writes `a` and `b` may go together ([`run_group`]): to one
/// peer's exposure, under one check.
pub fn together(a: &OpSpec, b: &OpSpec) -> bool {
    a.write && b.write && a.peer == b.peer && a.name == b.name && a.check == b.check
}

/// The end of a grouped write the peer answered `res` (its first round)
/// under standing grant `standing`, or how it goes on on its own.
fn told_end(
    link: &Arc<PeerLink>,
    standing: u64,
    op: &OpSpec,
    mut core: StandingCore,
    digests: Vec<Vec<u8>>,
    res: &proto::BufferNoticeResult,
) -> GroupEnd {
    match core.answered(res) {
        Ok(StandingNext::Done) => GroupEnd::Ended(Ok(moved(link, op))),
        Ok(StandingNext::Damaged { bad, rounds }) => {
            GroupEnd::Ended(Err(damaged(op, &bad, rounds)))
        }
        Ok(StandingNext::Again(_)) => GroupEnd::Resume(Resume {
            link: link.clone(),
            standing,
            core,
            digests,
        }),
        Err(e) if e.reason == Reason::FileNotFound => {
            forget(link, op);
            GroupEnd::Alone
        }
        Err(e) => GroupEnd::Ended(Err(notice_refused(op, e))),
    }
}

/// [`run`] once, on the peer's session now (going on from `resume` if it
/// is this session's and grant's). What each answer of the peer means is
/// [`OpCore`]'s; this drives it (leases, windows, hashing, RPCs).
async fn attempt(
    bufs: &Arc<Buffers>,
    op: &OpSpec,
    cancelled: &AtomicBool,
    resume: Option<Resume>,
) -> Result<Moved, Attempt> {
    let local = lease_local(op)?;
    if cancelled.load(Relaxed) {
        return Err(Failure::new(Reason::Other, "cancelled").into());
    }
    let (link, reg, grant) = granted(bufs, op).await?;
    let _using = Using(&link);
    // The per-op path's state (its RPCs) in a box of its own: inline, it
    // made every operation's task 5.4 KB, under a standing grant too.
    match grant {
        Grant::PerOp(g) => Box::pin(per_op(&link, op, reg, g, local, cancelled)).await,
        Grant::Standing(sg) => {
            let resume = resume.filter(|r| Arc::ptr_eq(&r.link, &link) && r.standing == sg.id);
            standing(&link, op, reg, sg, local, cancelled, resume).await
        }
    }
}

/// [`attempt`] under a grant of the operation's own: post, finish the
/// round with the peer, again for the ranges it found bad.
async fn per_op(
    link: &Arc<PeerLink>,
    op: &OpSpec,
    reg: Arc<RailRegs>,
    grant: proto::BufferGrantResponse,
    local: Vec<LeasedRange>,
    cancelled: &AtomicBool,
) -> Result<Moved, Attempt> {
    let sent = if op.write {
        digests(link.check, &local)
    } else {
        Vec::new()
    };
    let mut core = OpCore::new(
        op.descs.len() as u32,
        op.write,
        link.path.rails() as u32,
        link.max_retries,
    );
    let checked = core.granted(&grant);
    let g = GrantedOp {
        link,
        op,
        reg,
        id: grant.grant,
        want: grant.digests,
        sent,
        posted: Mutex::new(Vec::new()),
    };
    if let Err(e) = checked {
        g.fail(e.message.clone()).await;
        return Err(g.broke(e).into());
    }
    let mut moving: Vec<Moving> = local
        .into_iter()
        .zip(grant.ranges)
        .enumerate()
        .map(|(i, (r, at))| (i as u32, r, at))
        .collect();
    loop {
        let mut landed = match g.post(moving).await {
            Ok(l) => l,
            Err(why) => {
                g.fail(why.clone()).await;
                return Err(g.post_failed(why));
            }
        };
        if cancelled.load(Relaxed) {
            g.fail("cancelled".into()).await;
            return Err(Failure::new(Reason::Other, "cancelled").into());
        }
        let (mine, resp) = g.finish_round(&mut landed, core.round()).await?;
        moving = match core.round_done(&mine, resp) {
            Ok(OpNext::Done) => return Ok(moved(link, op)),
            Ok(OpNext::Damaged { bad, rounds }) => return Err(damaged(op, &bad, rounds).into()),
            Ok(OpNext::Again(again)) => g.again(landed, again, core.round()),
            Err(e) => {
                g.fail(e.message.clone()).await;
                return Err(g.broke(e).into());
            }
        };
    }
}

/// An operation's use of a session: when it ends, the session's idle time
/// starts again.
struct Using<'a>(&'a PeerLink);

impl Drop for Using<'_> {
    fn drop(&mut self) {
        *self.0.last_used.lock().unwrap() = Instant::now();
    }
}

/// A range moving in a round: its index among the operation's, its local
/// lease, where the peer granted it.
type Moving = (u32, LeasedRange, proto::GrantedRange);

/// Lease the operation's local ranges: shared for a write (the device
/// reads them), exclusive for a read (bytes land).
fn lease_local(op: &OpSpec) -> Result<Vec<LeasedRange>, Failure> {
    let kind = if op.write {
        LeaseKind::Shared
    } else {
        LeaseKind::Exclusive
    };
    let mut local = Vec::with_capacity(op.descs.len());
    for &Desc {
        local: lo,
        remote: ro,
        len,
    } in &op.descs
    {
        let r = op
            .buffer
            .lease(lo, len, kind)
            .ok_or_else(|| {
                Failure::new(
                    Reason::Invalid,
                    format!(
                        "descriptor ({lo}, {ro}, {len}): local range [{lo}, {}) is empty or outside \
                         the buffer's {} bytes",
                        lo.saturating_add(len),
                        op.buffer.len()
                    ),
                )
            })?
            // Busy is for a moment (until the operation holding it ends):
            // the caller may try again.
            .map_err(|e| Failure::new(Reason::Retryable, e.to_string()))?;
        local.push(r);
    }
    Ok(local)
}

/// What an operation moves under.
enum Grant {
    /// A grant of its own.
    PerOp(proto::BufferGrantResponse),
    /// The session's standing grant of the exposure.
    Standing(Arc<proto::StandingGrant>),
}

/// The session an operation runs on, the buffer's registration in it and
/// the peer's grant.
type Granting = (Arc<PeerLink>, Arc<RailRegs>, Grant);

/// The session to the operation's peer, the buffer's registration in it
/// and the peer's grant. A kept session the peer no longer holds (it
/// closed it, idle; its answer is `retryable`) is given up and the grant
/// asked for once more on a new one.
async fn granted(bufs: &Arc<Buffers>, op: &OpSpec) -> Result<Granting, Failure> {
    loop {
        let (link, new) = link(bufs, &op.peer, op.check).await?;
        let reg = link.registration(op.buffer_uid, &op.buffer)?;
        let held = link.standing.lock().unwrap()[op.write as usize]
            .get(op.name.as_str())
            .cloned();
        if let Some(sg) = held {
            return Ok((link, reg, Grant::Standing(sg)));
        }
        let node = bufs.node().to_string();
        // Boxed: a gRPC call's state is kilobytes, and operations under a
        // standing grant never make one.
        match Box::pin(request_grant(&link, op, &node)).await {
            Err(Refused::SessionGone(e)) if !new => {
                tracing::info!(peer = %crate::escape::esc(&op.peer), session = link.session_id, error = %crate::escape::esc(&e), "buffer session given up: a new one");
                link.retire(format!("the peer gave up the session: {e}"));
            }
            Err(Refused::SessionGone(e) | Refused::Other(e)) => return Err(e),
            Ok(proto::BufferGrantResponse {
                standing: Some(sg), ..
            }) => {
                if sg.frames {
                    link.notices.taken();
                }
                let sg = Arc::new(sg);
                link.standing.lock().unwrap()[op.write as usize]
                    .insert(op.name.clone(), sg.clone());
                return Ok((link, reg, Grant::Standing(sg)));
            }
            Ok(g) => return Ok((link, reg, Grant::PerOp(g))),
        }
    }
}

/// A peer's error as the operation's.
fn peer_error(peer: &str, s: &tonic::Status) -> Failure {
    Failure::new(status_reason(s), format!("peer {peer}: {}", s.message()))
}

/// Why a peer gave no grant: it no longer holds the session (a new one
/// may get it), or anything else.
enum Refused {
    SessionGone(Failure),
    Other(Failure),
}

impl From<Failure> for Refused {
    fn from(e: Failure) -> Refused {
        Refused::Other(e)
    }
}

/// `BufferGrant` for the operation's remote ranges.
async fn request_grant(
    link: &PeerLink,
    op: &OpSpec,
    node: &str,
) -> Result<proto::BufferGrantResponse, Refused> {
    let _turn = link.turn().await;
    let grant = link
        .client
        .buffer_grant(proto::BufferGrantRequest {
            session_id: link.session_id,
            name: op.name.clone(),
            access: if op.write {
                proto::BufferAccess::Write
            } else {
                proto::BufferAccess::Read
            } as i32,
            ranges: remote_ranges(op),
            message: op.message.clone(),
            node: node.to_string(),
            standing_ok: true,
        })
        .await
        .map_err(|s| {
            let e = peer_error(&op.peer, &s);
            if s.metadata()
                .contains_key(crate::control::error::SESSION_GONE)
            {
                Refused::SessionGone(e)
            } else {
                Refused::Other(e)
            }
        })?;
    Ok(grant)
}

/// [`attempt`] under the session's standing grant `sg` of the exposure:
/// post every range where the grant places it, then one notice; the
/// ranges the peer found bad move again (the grant stands), as many rounds
/// as its bound allows, counting those it had before `resume` (then only
/// the ranges still to move go). What each answer means is
/// [`StandingCore`]'s.
async fn standing(
    link: &Arc<PeerLink>,
    op: &OpSpec,
    reg: Arc<RailRegs>,
    sg: Arc<proto::StandingGrant>,
    local: Vec<LeasedRange>,
    cancelled: &AtomicBool,
    resume: Option<Resume>,
) -> Result<Moved, Attempt> {
    let place = placing(op, &sg)?;
    let check = link.check;
    let (mut core, mut digests, local) = match resume {
        Some(r) => {
            let local = (local.into_iter().enumerate())
                .filter(|(i, _)| r.core.moving().contains(&(*i as u32)))
                .collect();
            (r.core, r.digests, local)
        }
        // Under check none a notice carries no digests (the exposer
        // expects none: `standing::check_notice`).
        None => {
            let digests = if check.is_none() {
                Vec::new()
            } else if op.write {
                digests(check, &local)
            } else {
                vec![Vec::new(); local.len()]
            };
            let core = StandingCore::new(op.descs.len() as u32, link.max_retries);
            (
                core,
                digests,
                local.into_iter().enumerate().collect::<Vec<_>>(),
            )
        }
    };
    let g = GrantedOp {
        link,
        op,
        reg,
        id: sg.id,
        want: Vec::new(),
        sent: Vec::new(),
        posted: Mutex::new(Vec::new()),
    };
    let forget = || forget(link, op);
    let mut moving: Vec<Moving> = local
        .into_iter()
        .map(|(i, r)| (i as u32, r, place(i as u32)))
        .collect();
    loop {
        let bytes = || moving.iter().map(|(_, r, _)| r.lease().len()).sum();
        let framed = (link.notices.frames.as_ref()).filter(|f| op.write && f.carries(bytes()));
        let (landed, result) = match framed {
            // Small: the WRITEs and the notice in one exchange (with
            // those of other small writes meanwhile).
            Some(f) => {
                let n = notice(op, sg.id, &digests, &core);
                match write_framed(link, op, f, &moving, n).await? {
                    Some(result) => (moving.into_iter().map(|(i, r, _)| (i, r)).collect(), result),
                    // Nothing of it was told: the same round again.
                    None => continue,
                }
            }
            None => {
                let landed = g.post(moving).await.map_err(|why| {
                    forget();
                    match g.post_failed(why) {
                        // The peer refused this operation's request: the
                        // grant is gone, which says nothing yet of the
                        // name now.
                        Attempt::Failed(e) if e.reason == Reason::FileNotFound => {
                            Attempt::Bystander {
                                why: revoked(op, &e.message),
                                closed: link.closed.clone(),
                            }
                        }
                        a => a,
                    }
                })?;
                if cancelled.load(Relaxed) {
                    return Err(Failure::new(Reason::Other, "cancelled").into());
                }
                if !op.write && !check.is_none() {
                    // What landed, hashed; the peer compares.
                    let ds = super::grant::digests_by(check, &landed, |(_, r)| r);
                    for ((i, _), d) in landed.iter().zip(ds) {
                        digests[*i as usize] = d;
                    }
                }
                let n = notice(op, sg.id, &digests, &core);
                let result: proto::BufferNoticeResult = link.notices.notify(n).await?;
                (landed, result)
            }
        };
        moving = match core.answered(&result) {
            Ok(StandingNext::Done) => return Ok(moved(link, op)),
            Ok(StandingNext::Damaged { bad, rounds }) => {
                return Err(damaged(op, &bad, rounds).into())
            }
            Ok(StandingNext::Again(bad)) => landed
                .into_iter()
                .filter(|(i, _)| bad.contains(i))
                .map(|(i, r)| (i, r, place(i)))
                .collect(),
            Err(e) if e.reason == Reason::FileNotFound => {
                forget();
                return Err(Attempt::Revoked {
                    why: revoked(op, &e.message),
                });
            }
            Err(e) => return Err(notice_refused(op, e).into()),
        };
    }
}

/// The failure of an operation under a standing grant whose notice the
/// peer refused (`e`) or answered against the protocol: its ranges had
/// moved by then (a write's bytes may be in the peer's buffer, its owner
/// not told), which the message says, as nothing is undone.
fn notice_refused(op: &OpSpec, e: Failure) -> Failure {
    let moved = if op.write {
        format!(
            "the operation's bytes were written into {:?} (they may be in the peer's buffer) \
             but its notice failed, so the exposure's owner was not told",
            op.name
        )
    } else {
        format!(
            "the operation's ranges were read from {:?} (they may be in this buffer) but its \
             notice failed",
            op.name
        )
    };
    Failure::new(
        e.reason,
        format!("peer {}: {moved}: {}", op.peer, e.message),
    )
}

/// A small write's round moved with its notice on one of the session's
/// connections ([`Frames::write_notify`]): the notice's result, or `None`
/// when nothing of it was told (another write of its exchange was
/// refused): the same round again.
///
/// [`Frames::write_notify`]: super::frames::Frames::write_notify
async fn write_framed(
    link: &PeerLink,
    op: &OpSpec,
    f: &Arc<super::frames::Frames>,
    moving: &[Moving],
    n: proto::BufferNotice,
) -> Result<Option<proto::BufferNoticeResult>, Attempt> {
    let ranges: Vec<_> = moving
        .iter()
        .map(|(_, r, at)| (r, at.addr, at.rkey))
        .collect();
    match f.write_notify(&ranges, n, &op.peer).await {
        Ok(r) => {
            if let Some(m) = &link.client.options().metrics {
                m.buffer_framed_write();
            }
            Ok(Some(r))
        }
        Err(WriteFailed::Refused(m)) => {
            forget(link, op);
            Err(Attempt::Revoked {
                why: revoked(op, &m),
            })
        }
        Err(WriteFailed::Again) => Ok(None),
        Err(WriteFailed::Failed(e)) => Err(e.into()),
    }
}

/// The session's standing grant of the operation's exposure is gone with
/// the exposure: the next operation asks anew.
fn forget(link: &PeerLink, op: &OpSpec) {
    link.standing.lock().unwrap()[op.write as usize].remove(op.name.as_str());
}

/// Why an operation under a standing grant runs again: the grant was
/// revoked (`detail`).
fn revoked(op: &OpSpec, detail: &str) -> String {
    format!(
        "peer {}: the standing grant of {:?} was revoked (its exposure withdrawn, replaced or \
         its owner gone): {detail}",
        op.peer, op.name
    )
}

/// Where standing grant `sg` places each of the operation's ranges (by
/// index); refused when one lies outside the exposure (the peer's device
/// would refuse its request, and so fail the session for every operation
/// on it).
fn placing<'a>(
    op: &'a OpSpec,
    sg: &proto::StandingGrant,
) -> Result<impl Fn(u32) -> proto::GrantedRange + 'a, Failure> {
    let at = sg.range.clone().ok_or_else(|| {
        Failure::new(
            Reason::Protocol,
            format!(
                "peer {} broke the protocol: a standing grant with no range",
                op.peer
            ),
        )
    })?;
    for d in &op.descs {
        super::grant::inside((sg.offset, sg.len), d.remote, d.len, &op.name)
            .map_err(|e| Failure::new(e.reason, format!("peer {}: {}", op.peer, e.message)))?;
    }
    let base = sg.offset;
    Ok(move |i: u32| proto::GrantedRange {
        addr: at.addr + (op.descs[i as usize].remote - base),
        ..at.clone()
    })
}

/// The notice of the operation's round now under standing grant `id`.
fn notice(op: &OpSpec, id: u64, digests: &[Vec<u8>], core: &StandingCore) -> proto::BufferNotice {
    proto::BufferNotice {
        standing: id,
        ranges: remote_ranges(op),
        digests: digests.to_vec(),
        message: op.message.clone(),
        round: core.round(),
        resent: core.resent(),
    }
}

/// The operation's ranges in the peer's buffer.
fn remote_ranges(op: &OpSpec) -> Vec<proto::BufferRange> {
    op.descs
        .iter()
        .map(|d| proto::BufferRange {
            offset: d.remote,
            len: d.len,
        })
        .collect()
}

/// What an operation on `link` that moved every range did.
fn moved(link: &PeerLink, op: &OpSpec) -> Moved {
    Moved {
        bytes: op.descs.iter().map(|d| d.len).sum(),
        kind: link.kind,
        fell_back: link.fell_back.clone(),
    }
}

/// An operation whose ranges `bad` still did not match after `rounds`.
fn damaged(op: &OpSpec, bad: &[u32], rounds: u32) -> Failure {
    Failure::new(
        Reason::Integrity,
        format!(
            "peer {}: {}",
            op.peer,
            buffer::damaged_message(op.write, bad, rounds)
        ),
    )
}

/// An operation the peer granted.
struct GrantedOp<'a> {
    link: &'a PeerLink,
    op: &'a OpSpec,
    reg: Arc<RailRegs>,
    /// The grant's id.
    id: u64,
    /// Read: each range's digest, as the peer sent them.
    want: Vec<Vec<u8>>,
    /// Write: each range's digest of what is sent.
    sent: Vec<Vec<u8>>,
    /// The windows it posted, in every round.
    posted: Mutex<Vec<u64>>,
}

impl GrantedOp<'_> {
    /// `BufferDone` for the round.
    async fn done(
        &self,
        round: Option<u32>,
        failed: String,
        digests: Vec<Vec<u8>>,
        bad: Vec<u32>,
    ) -> Result<proto::BufferDoneResponse, Failure> {
        let _turn = self.link.turn().await;
        self.link
            .client
            .buffer_done(proto::BufferDoneRequest {
                session_id: self.link.session_id,
                grant: self.id,
                digests,
                failed,
                bad,
                round,
            })
            .await
            .map_err(|s| peer_error(&self.op.peer, &s))
    }

    /// Tell the peer the operation failed (best effort: the grant is
    /// revoked either way, at the latest after the peer's timeout).
    async fn fail(&self, why: String) {
        let _ = self.done(None, why, Vec::new(), Vec::new()).await;
    }

    /// Post a window per range (split into requests of the session's block
    /// size) and wait for every one; the ranges back, or why the data path
    /// failed.
    async fn post(&self, moving: Vec<Moving>) -> Result<Vec<(u32, LeasedRange)>, String> {
        let link = self.link;
        let chunk = link
            .block_size
            .clamp(4096, crate::control::WINDOW_SIZE as u64);
        let mut waits = Vec::with_capacity(moving.len());
        let mut failure = None;
        for (i, r, at) in moving {
            let len = self.op.descs[i as usize].len;
            let id = link.next.fetch_add(1, Relaxed) + 1;
            let extents = (0..len.div_ceil(chunk))
                .map(|k| Extent {
                    offset: k * chunk,
                    len: (len - k * chunk).min(chunk) as u32,
                })
                .collect();
            let job = WindowJob {
                id,
                op: if self.op.write {
                    OpKind::Write
                } else {
                    OpKind::Read
                },
                local_addr: r.span().addr(),
                lkey: self.reg.lkey(),
                remote_addr: at.addr,
                rkey: at.rkey,
                extents,
            };
            let (tx, rx) = oneshot::channel();
            self.posted.lock().unwrap().push(id);
            link.waiters.lock().unwrap().insert(id, tx);
            if let Some(why) = link.dead() {
                link.waiters.lock().unwrap().remove(&id);
                failure = Some(why);
                break;
            }
            if let Err(e) = link.path.submit(job, r, self.reg.clone(), &at.rail_rkeys) {
                link.waiters.lock().unwrap().remove(&id);
                failure = Some(e.to_string());
                break;
            }
            waits.push((i, rx));
        }
        let mut landed = Vec::with_capacity(waits.len());
        for (i, w) in waits {
            match w.await {
                Ok(Ok(r)) => landed.push((i, r)),
                Ok(Err(why)) => {
                    failure.get_or_insert(why);
                }
                Err(_) => {
                    failure.get_or_insert_with(|| "the data path dropped the window".into());
                }
            }
        }
        match failure {
            Some(why) => Err(why),
            None => Ok(landed),
        }
    }

    /// Why the data path under the operation failed (`why`), as the
    /// operation's end: the session gave up on RDMA (it runs again over
    /// tcp); the peer refused one of its requests (its grant was revoked:
    /// the exposure is gone, `not_found`); the peer refused another
    /// operation's request (it runs again on a new session); else
    /// `retryable`.
    fn post_failed(&self, why: String) -> Attempt {
        let (link, op) = (self.link, self.op);
        let closed = link.closed.clone();
        if let Some(why) = link.gave_up() {
            return Attempt::GaveUp { why, closed };
        }
        match *link.refused.lock().unwrap() {
            Some(w) if self.posted.lock().unwrap().contains(&w) => Attempt::Failed(Failure::new(
                Reason::FileNotFound,
                format!(
                    "peer {}: the exposure {:?} is gone: the peer refused the operation's \
                         request, its grant revoked mid-operation (the owner released or \
                         withdrew it, or went away): {why}",
                    op.peer, op.name
                ),
            )),
            Some(_) => Attempt::Bystander {
                why: format!(
                    "peer {}: another operation's exposure on the session is gone: {why}",
                    op.peer
                ),
                closed,
            },
            None => Attempt::Failed(Failure::new(
                Reason::Retryable,
                format!("peer {}: {why}", op.peer),
            )),
        }
    }

    /// The round's `BufferDone`: for a write the digests of what was sent
    /// (the peer compares); for a read, compare what landed here and say
    /// which ranges did not match. Those (`mine`) and the peer's answer.
    async fn finish_round(
        &self,
        landed: &mut [(u32, LeasedRange)],
        round: u32,
    ) -> Result<(Vec<u32>, proto::BufferDoneResponse), Failure> {
        if self.op.write {
            let resp = self
                .done(Some(round), String::new(), self.sent.clone(), Vec::new())
                .await?;
            return Ok((Vec::new(), resp));
        }
        let check = self.link.check;
        let mut bad = Vec::new();
        if !check.is_none() {
            crate::control::in_place(|| {
                for (_, r) in landed.iter_mut() {
                    // SAFETY: the data path reported the window done and
                    // the range is leased exclusively (a read's): no
                    // device reaches it.
                    unsafe { super::faults::inject(&self.op.name, r) };
                }
                // The ranges on the hashing pool, as the owner's were.
                let checked = check.landed_with(
                    landed,
                    |(_, r)| r.with(|b| check.block(b)),
                    |k| self.want.get(landed[k].0 as usize).map(Vec::as_slice),
                );
                bad = checked
                    .bad()
                    .iter()
                    .map(|&k| landed[k as usize].0)
                    .collect();
            });
        }
        let resp = self
            .done(Some(round), String::new(), Vec::new(), bad.clone())
            .await?;
        Ok((bad, resp))
    }

    /// The next round (`round`): the ranges the peer granted again, each
    /// with its local lease (every range of a round lands before its
    /// answer, and the core took only ranges that were moving).
    fn again(
        &self,
        landed: Vec<(u32, LeasedRange)>,
        again: Vec<(u32, proto::GrantedRange)>,
        round: u32,
    ) -> Vec<Moving> {
        let mut landed: HashMap<u32, LeasedRange> = landed.into_iter().collect();
        let moving: Vec<Moving> = again
            .into_iter()
            .map(|(i, at)| {
                let r = landed
                    .remove(&i)
                    .expect("a range moving in the round landed");
                (i, r, at)
            })
            .collect();
        tracing::debug!(peer = %crate::escape::esc(&self.op.peer), grant = self.id, round, ranges = moving.len(), "buffer ranges damaged: moving them again");
        moving
    }

    /// The peer broke the protocol (the core's `e`): the operation's end.
    fn broke(&self, e: crate::control::protocol::Failure) -> Failure {
        Failure::new(e.reason, format!("peer {} {}", self.op.peer, e.message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::arena::{Arena, ArenaConfig};

    fn op(buffer: &ServiceBuffer, write: bool, descs: Vec<(u64, u64, u64)>) -> OpSpec {
        let descs = descs
            .into_iter()
            .map(|(local, remote, len)| Desc { local, remote, len })
            .collect();
        OpSpec {
            buffer: buffer.clone(),
            buffer_uid: 1,
            peer: "127.0.0.1:7471".into(),
            name: "x".into(),
            write,
            descs,
            message: String::new(),
            check: Check::Blake3,
        }
    }

    /// A local range another operation holds is busy for a moment: the
    /// caller is told `retryable` (try again), not `invalid`; a range
    /// outside the buffer stays `invalid`. Shared leases (two writes from
    /// the same bytes) do not conflict.
    #[test]
    fn a_busy_local_range_is_retryable_and_a_wrong_one_invalid() {
        let b = ServiceBuffer::from_arena(Arena::new(&ArenaConfig::new(1 << 20)).unwrap());
        let read = lease_local(&op(&b, false, vec![(0, 0, 8192)])).unwrap();
        let e = lease_local(&op(&b, true, vec![(4096, 0, 4096)])).unwrap_err();
        assert_eq!(e.reason, Reason::Retryable, "{e}");
        drop(read);
        let w1 = lease_local(&op(&b, true, vec![(0, 0, 8192)])).unwrap();
        let _w2 = lease_local(&op(&b, true, vec![(4096, 0, 4096)])).unwrap();
        drop(w1);
        let e = lease_local(&op(&b, true, vec![(2 << 20, 0, 4096)])).unwrap_err();
        assert_eq!(e.reason, Reason::Invalid, "{e}");
    }

    /// A notice refused after the operation's ranges moved fails it with
    /// the peer's reason, and says that the bytes moved (a write's may be
    /// in the peer's buffer, its owner not told): not as if nothing had.
    #[test]
    fn a_refused_notice_says_the_ranges_had_moved() {
        let b = ServiceBuffer::from_arena(Arena::new(&ArenaConfig::new(1 << 20)).unwrap());
        let refused = Failure::new(Reason::Protocol, "2 digests for 1 ranges");
        let e = notice_refused(&op(&b, true, vec![(0, 0, 4096)]), refused.clone());
        assert_eq!(e.reason, Reason::Protocol, "{e}");
        assert!(e.message.contains("bytes were written into \"x\""), "{e}");
        assert!(e.message.contains("owner was not told"), "{e}");
        assert!(e.message.ends_with("2 digests for 1 ranges"), "{e}");
        let e = notice_refused(&op(&b, false, vec![(0, 0, 4096)]), refused);
        assert!(e.message.contains("were read from \"x\""), "{e}");
    }
}
