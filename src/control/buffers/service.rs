//! One service connection on the unix socket (the service protocol,
//! docs/buffers.md): its buffers, exposures, operations and events. When
//! the connection ends, for whatever reason, its operations are cancelled,
//! its exposures withdrawn, the grants on them revoked, and its buffers
//! unmapped as soon as the last operation on them has retired.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use serde_json::json;
use tokio::net::UnixStream;

use super::api::{
    self, ErrorBody, Event, Frame, HelloReply, ManyOps, OpRequest, OpStatus, Registered, Request,
    Started, StartedMany, Statuses, Wait, WaitAll,
};
use super::ops::{OpState, Ops, Unknown, KEPT_ENDED};
use super::outbox::Outbox;
use super::peer::{self, OpSpec};
use super::wire::{self, FrameReader, Reply};
use super::{Buffers, Exposure, Failure, Rights};
use crate::control::error::Reason;
use crate::files::Check;
use crate::mem::memfd::ServiceBuffer;

pub use super::api::VERSION;

/// Bytes of replies and events queued for a service, not yet sent to it,
/// beyond which rcpd reads no more of its requests until it has read some
/// (a service that sends requests and reads no replies holds rcpd's memory
/// to about this, plus one request's replies).
pub const MAX_QUEUED_OUT: usize = 4 << 20;

/// Operations one `write_many` or `read_many` may start.
pub const MAX_OPS_PER_REQUEST: usize = 4096;

/// How many bytes of a request's operations one task runs: operations
/// smaller than this share a task (see `Conn::start_many`).
const TASK_BYTES: u64 = 256 << 10;

/// A reply's fields.
fn reply(v: impl serde::Serialize) -> Result<Reply, Failure> {
    Ok(Reply::of(&v))
}

/// An operation started: where it ends, its cancel flag, what it moves.
type Running<'a> = (Ending<'a>, &'a AtomicBool, OpSpec);

/// Operation `h` of `conn`, not yet ended: when this goes without
/// [`Ending::end`] (its task panicked, or the runtime ends), the operation
/// ends cancelled, so that nothing waits for it forever.
struct Ending<'a> {
    conn: &'a Conn,
    h: u64,
}

impl Ending<'_> {
    /// The handle, and no end on drop (the caller records it).
    fn take(self) -> u64 {
        let h = self.h;
        std::mem::forget(self);
        h
    }
}

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        let ops = self.conn.ops.lock().unwrap();
        ops.cancel_one(self.h);
        drop(ops);
        let gone = Failure::new(Reason::Other, "its task ended before it did");
        self.conn.ended(vec![(self.h, Err(gone))]);
    }
}

struct Buf {
    buffer: ServiceBuffer,
    uid: u64,
}

/// One service connection's state.
struct Conn {
    id: u64,
    bufs: Arc<Buffers>,
    /// Frames for the service (replies and events), encoded by who sends
    /// them.
    out: Arc<Outbox>,
    buffers: Mutex<HashMap<u64, Buf>>,
    next_buf: AtomicU64,
    ops: Mutex<Ops>,
    /// `uid=U pid=P` of the peer (SO_PEERCRED).
    cred: String,
    hello: AtomicBool,
    /// hello's `done_events`.
    done_events: AtomicBool,
    name: Mutex<String>,
}

/// Buffer ids are unique across rcpd's connections (registrations in the
/// peer sessions are keyed by them).
static NEXT_UID: AtomicU64 = AtomicU64::new(1);

fn bad(m: impl Into<String>) -> Failure {
    Failure::new(Reason::Invalid, m)
}

/// Serve one connection whose magic was already read.
pub async fn serve(bufs: Arc<Buffers>, stream: UnixStream, mut reader: FrameReader) {
    let cred = match stream.peer_cred() {
        Ok(c) => format!(
            "uid={} pid={}",
            c.uid(),
            c.pid().map_or("?".into(), |p| p.to_string())
        ),
        Err(_) => "uid=? pid=?".into(),
    };
    let stream = Arc::new(stream);
    let (tx, rx) = Outbox::on(stream.clone());
    let outbox = tx.clone();
    let writer = tokio::spawn(tx.clone().write_queued(rx));
    let conn = Arc::new(Conn {
        id: bufs.new_conn(),
        bufs,
        out: tx,
        buffers: Mutex::new(HashMap::new()),
        next_buf: AtomicU64::new(0),
        ops: Mutex::new(Ops::new(KEPT_ENDED)),
        cred,
        hello: AtomicBool::new(false),
        done_events: AtomicBool::new(true),
        name: Mutex::new(String::new()),
    });
    tracing::info!(conn = conn.id, peer = %conn.cred, "service connected");
    loop {
        // Backpressure: a service that does not read its replies gets no
        // more requests read until it does.
        if conn.out.queued() > MAX_QUEUED_OUT {
            tracing::info!(conn = conn.id, name = %crate::escape::esc(&conn.name.lock().unwrap()), queued = conn.out.queued(), "service reads no replies: its requests wait until it does");
            conn.out.below(MAX_QUEUED_OUT).await;
        }
        let frame = match reader.next_frame(&stream).await {
            Ok(Some(b)) => parsed(conn.id, b),
            Ok(None) => break,
            Err(e) => Err(e),
        };
        let Frame { id, op, request } = match frame {
            Ok(f) => f,
            Err(e) => {
                broke(conn.id, &e);
                break;
            }
        };
        // Fds that came with the frame: `register`'s memfd; any other
        // frame's (and any beyond register's one) are closed here, so that
        // none is left for a later frame to take.
        let fd = {
            let mut fds = reader.frame_fds().into_iter();
            let fd = if op == "register" { fds.next() } else { None };
            let extra = fds.len();
            drop(fds);
            if extra > 0 {
                tracing::info!(conn = conn.id, op = %crate::escape::esc(&op), fds = extra, "service sent file descriptors with a frame that takes none: closed");
            }
            fd
        };
        // Requests that may wait run on their own; the rest answer in order.
        let c = conn.clone();
        let slow = Request::may_wait(&op);
        let task = async move {
            let r = c.handle(&op, request, fd).await;
            let fields = match r {
                Ok(f) => f,
                Err(e) => Reply::of(&json!({ "error": ErrorBody::from(&e) })),
            };
            c.out.send(wire::reply_frame(&id, &fields));
        };
        if slow {
            tokio::spawn(task);
        } else {
            task.await;
        }
    }
    conn.close().await;
    drop(conn);
    writer.abort();
    // Exposures' events may hold the outbox a while longer: the service
    // sees the end now, and nothing more is written.
    outbox.close();
}

/// Bytes of a malformed frame its warning shows (escaped, as every
/// string from outside: [`crate::escape::esc`]).
const MALFORMED_SHOWN: usize = 128;

/// Frame `b` of connection `conn` parsed. One that is not JSON is an error
/// naming its first bytes (the connection closes, [`broke`] logs it); one
/// outside the schema is answered `invalid` by [`Conn::handle`], and
/// logged here at warn with its first bytes.
fn parsed(conn: u64, b: &[u8]) -> std::io::Result<Frame> {
    let shown = || String::from_utf8_lossy(&b[..b.len().min(MALFORMED_SHOWN)]).into_owned();
    match Frame::parse(b) {
        Ok(f) => {
            if let Err(e) = &f.request {
                tracing::warn!(conn, len = b.len(), frame = %crate::escape::esc(shown()), error = %crate::escape::esc(e), "service sent a request outside the protocol: answered invalid");
            }
            Ok(f)
        }
        // Logged by [`broke`], the connection closed.
        Err(e) => Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "a frame of {} bytes that is not JSON ({e}): {}",
                b.len(),
                shown()
            ),
        )),
    }
}

/// Connection `conn` ends on `e`: at warn when the service broke the
/// protocol (a frame over the limit, too many fds ahead of their frames,
/// one that is not JSON: `e` names it, escaped here), else at info (it
/// went away mid-frame).
fn broke(conn: u64, e: &std::io::Error) {
    if e.kind() == std::io::ErrorKind::InvalidData {
        tracing::warn!(conn, error = %crate::escape::esc(e), "service connection broke");
    } else {
        tracing::info!(conn, error = %e, "service connection broke");
    }
}

impl Conn {
    async fn handle(
        self: &Arc<Self>,
        op: &str,
        request: Result<Request, serde_json::Error>,
        fd: Option<std::os::fd::OwnedFd>,
    ) -> Result<Reply, Failure> {
        if op != "hello" && !self.hello.load(Relaxed) {
            return Err(Failure::new(
                Reason::Unauthenticated,
                "say hello first (with rcpd's token when it has one)",
            ));
        }
        let req = request.map_err(|e| bad(format!("{op:?}: {e}")))?;
        match req {
            Request::Hello(h) => self.hello(h),
            Request::Register { size } => self.register(size, fd),
            Request::Release { buffer } => self.release(buffer).await,
            Request::Expose(x) => self.expose(x),
            Request::Unexpose { name } => {
                let mut ex = self.bufs.exposures.lock().unwrap();
                match ex.get(&name) {
                    Some(e) if e.owner == self.id => {
                        let gone = ex.remove(&name).expect("looked up above");
                        drop(ex);
                        let n = self.bufs.grants.revoke_standing(&gone);
                        tracing::info!(conn = self.id, name = %crate::escape::esc(&name), standing_revoked = n, "buffer withdrawn");
                        Ok(Reply::empty())
                    }
                    _ => Err(Failure::new(
                        Reason::FileNotFound,
                        format!("{name:?} is not exposed by this connection"),
                    )),
                }
            }
            Request::Write(o) => {
                let p = self.prepare(true, o)?;
                reply(Started {
                    handle: self.launch(p),
                })
            }
            Request::Read(o) => {
                let p = self.prepare(false, o)?;
                reply(Started {
                    handle: self.launch(p),
                })
            }
            Request::WriteMany(m) => self.run_many(true, m).await,
            Request::ReadMany(m) => self.run_many(false, m).await,
            Request::Wait(Wait { handle, timeout_ms }) => {
                let deadline = timeout_ms.map(|ms| Instant::now() + Duration::from_millis(ms));
                reply(self.wait(handle, deadline).await?)
            }
            Request::WaitAll(WaitAll {
                handles,
                timeout_ms,
            }) => {
                // Each handle exists before any is waited for.
                for &h in &handles {
                    self.op(h)?;
                }
                reply(Statuses {
                    statuses: self.statuses(&handles, timeout_ms).await?,
                })
            }
            Request::Status { handle } => reply(self.op(handle)?.status(handle)),
            Request::Cancel { handle } => {
                self.ops.lock().unwrap().cancel_one(handle);
                reply(self.wait(handle, None).await?)
            }
        }
    }

    fn hello(&self, h: api::Hello) -> Result<Reply, Failure> {
        if let Some(want) = self.bufs.token() {
            let got = h.token.as_deref().unwrap_or("");
            if !crate::control::auth::constant_time_eq(got.as_bytes(), want.as_bytes()) {
                return Err(Failure::new(
                    Reason::Unauthenticated,
                    "rcpd has a token: give it in hello (RCP_TOKEN)",
                ));
            }
        }
        if h.version != VERSION {
            return Err(Failure::new(
                Reason::Version,
                format!("service protocol {}; this rcpd speaks {VERSION}", h.version),
            ));
        }
        tracing::info!(conn = self.id, peer = %self.cred, name = %crate::escape::esc(&h.name), "service hello");
        *self.name.lock().unwrap() = h.name;
        self.done_events.store(h.done_events, Relaxed);
        self.hello.store(true, Relaxed);
        reply(HelloReply {
            session: self.id,
            version: VERSION,
            node: self.bufs.node().to_string(),
            check: self.default_check().name().to_string(),
        })
    }

    fn default_check(&self) -> Check {
        self.bufs.default_check()
    }

    fn register(&self, size: u64, fd: Option<std::os::fd::OwnedFd>) -> Result<Reply, Failure> {
        let fd = fd.ok_or_else(|| {
            bad("register carries the memfd as SCM_RIGHTS on its frame; none came")
        })?;
        let buffer = ServiceBuffer::from_memfd(fd, size).map_err(|e| bad(e.to_string()))?;
        let id = self.next_buf.fetch_add(1, Relaxed) + 1;
        let uid = NEXT_UID.fetch_add(1, Relaxed);
        tracing::info!(
            conn = self.id,
            peer = %self.cred,
            buffer = id,
            size,
            huge = buffer.huge(),
            "buffer registered"
        );
        self.buffers.lock().unwrap().insert(id, Buf { buffer, uid });
        reply(Registered { buffer: id })
    }

    fn buffer(&self, id: u64) -> Result<(u64, ServiceBuffer, u64), Failure> {
        let b = self.buffers.lock().unwrap();
        let b = b
            .get(&id)
            .ok_or_else(|| bad(format!("no buffer {id} on this connection")))?;
        Ok((id, b.buffer.clone(), b.uid))
    }

    /// Where operation `h` is now.
    fn op(&self, h: u64) -> Result<OpState, Failure> {
        let ops = self.ops.lock().unwrap();
        match ops.state(h) {
            Ok(s) => Ok(s.clone()),
            Err(Unknown::NoLongerKept) => Err(bad(format!(
                "operation {h} ended and is no longer kept (a connection keeps its last \
                 {KEPT_ENDED} ended operations)"
            ))),
            Err(Unknown::Never) => Err(bad(format!("no operation {h} on this connection"))),
        }
    }

    async fn release(&self, id: u64) -> Result<Reply, Failure> {
        let (id, buffer, uid) = self.buffer(id)?;
        // Its exposures withdrawn, and (unlike `unexpose`, which lets
        // operations under way end) every grant peers hold in them
        // revoked, per operation and standing, as when the owner goes: no
        // write lands in the buffer once it is released.
        let gone: Vec<(String, Arc<Exposure>)> = {
            let mut ex = self.bufs.exposures.lock().unwrap();
            let names: Vec<String> = ex
                .iter()
                .filter(|(_, e)| e.owner == self.id && e.buffer.addr() == buffer.addr())
                .map(|(n, _)| n.clone())
                .collect();
            names
                .into_iter()
                .filter_map(|n| ex.remove(&n).map(|e| (n, e)))
                .collect()
        };
        drop(buffer);
        for (name, e) in &gone {
            let n = self.bufs.grants.revoke_exposure(e);
            tracing::info!(conn = self.id, buffer = id, name = %crate::escape::esc(name), grants_revoked = n, "buffer withdrawn: released");
        }
        drop(gone);
        let ops = self.ops.lock().unwrap().cancel(|b| b == id);
        self.retired(ops).await;
        self.buffers.lock().unwrap().remove(&id);
        self.bufs.peers.forget_buffer(uid);
        Ok(Reply::empty())
    }

    fn expose(&self, x: api::Expose) -> Result<Reply, Failure> {
        let (_, buffer, _) = self.buffer(x.buffer)?;
        let name = x.name.as_str();
        if name.is_empty() || name.len() > 256 {
            return Err(bad("name: 1..=256 bytes"));
        }
        let offset = x.offset;
        // `length` as the Python package's `expose(length=)` names it.
        let len = match (x.len, x.length) {
            (Some(_), Some(_)) => return Err(bad("len and length: give one")),
            (Some(l), None) | (None, Some(l)) => l,
            (None, None) => buffer.len().saturating_sub(offset),
        };
        if len == 0 || offset.checked_add(len).is_none_or(|e| e > buffer.len()) {
            return Err(bad(format!(
                "[{offset}, +{len}) is not a non-empty range of the buffer's {} bytes",
                buffer.len()
            )));
        }
        let a = x.access.as_str();
        let access =
            Rights::parse(a).ok_or_else(|| bad(format!("access {a:?}: read, write or rw")))?;
        let mut peers = Vec::new();
        for s in &x.peers {
            let ip: IpAddr = s
                .parse()
                .map_err(|_| bad(format!("peers: {s:?} is not an IP address")))?;
            peers.push(super::grant::canonical(ip));
        }
        let standing = match x.grant.as_deref() {
            None | Some("per-op") => false,
            Some("standing") => true,
            Some(g) => return Err(bad(format!("grant {g:?}: per-op or standing"))),
        };
        let mut ex = self.bufs.exposures.lock().unwrap();
        if let Some(e) = ex.get(name) {
            if e.owner != self.id {
                return Err(Failure::new(
                    Reason::Permission,
                    format!("{name:?} is exposed by another service"),
                ));
            }
        }
        let replaced = ex.insert(
            name.to_string(),
            Arc::new(Exposure {
                owner: self.id,
                buffer,
                offset,
                len,
                access,
                peers,
                standing,
                events: self.out.clone(),
                bases: Default::default(),
            }),
        );
        drop(ex);
        // What peers held of the exposure it replaces goes with it.
        let revoked = replaced.map_or(0, |old| self.bufs.grants.revoke_standing(&old));
        tracing::info!(conn = self.id, name = %crate::escape::esc(name), offset, len, ?access, standing, standing_revoked = revoked, "buffer exposed");
        Ok(Reply::empty())
    }

    /// An operation checked (its buffer, its check) and ready to start,
    /// with its buffer's number on this connection.
    fn prepare(&self, write: bool, o: OpRequest) -> Result<(u64, OpSpec), Failure> {
        let (bid, buffer, uid) = self.buffer(o.buffer)?;
        let check = match o.check.as_deref() {
            Some(c) => Check::from_name(c).ok_or_else(|| bad(Check::unknown(c)))?,
            None => self.default_check(),
        };
        let spec = OpSpec {
            buffer,
            buffer_uid: uid,
            peer: o.peer,
            name: o.name,
            write,
            descs: o.descs,
            message: o.message,
            check,
        };
        Ok((bid, spec))
    }

    /// `write_many` / `read_many`: [`Self::start_many`], and with `wait`
    /// their statuses once each has ended (or the request's bound).
    async fn run_many(self: &Arc<Self>, write: bool, many: ManyOps) -> Result<Reply, Failure> {
        let (wait, timeout_ms) = (many.wait, many.timeout_ms);
        if timeout_ms.is_some() && !wait {
            return Err(bad("timeout_ms goes with wait"));
        }
        let handles = self.start_many(write, many)?;
        let statuses = match wait {
            true => Some(self.statuses(&handles, timeout_ms).await?),
            false => None,
        };
        reply(StartedMany { handles, statuses })
    }

    /// The statuses of operations `hs`, each once it has ended or when
    /// `timeout_ms` (one bound for all) has passed.
    async fn statuses(
        &self,
        hs: &[u64],
        timeout_ms: Option<u64>,
    ) -> Result<Vec<OpStatus>, Failure> {
        let deadline = timeout_ms.map(|ms| Instant::now() + Duration::from_millis(ms));
        let mut statuses = Vec::with_capacity(hs.len());
        for &h in hs {
            statuses.push(self.wait(h, deadline).await?);
        }
        Ok(statuses)
    }

    /// Every operation of `many` checked, then each started; their handles
    /// in order.
    fn start_many(self: &Arc<Self>, write: bool, many: ManyOps) -> Result<Vec<u64>, Failure> {
        let ops = many.into_ops(MAX_OPS_PER_REQUEST).map_err(bad)?;
        let mut ready = Vec::with_capacity(ops.len());
        for (i, o) in ops.into_iter().enumerate() {
            let p = self
                .prepare(write, o)
                .map_err(|f| Failure::new(f.reason, format!("operation {i}: {}", f.message)))?;
            ready.push(p);
        }
        // Small operations share a task, up to TASK_BYTES of them each
        // (polled only when woken): a spawn per operation was a task's
        // allocation, registration and scheduling per 4 KiB write. Larger
        // ones keep a task each, so that their hashing spreads over the
        // runtime's threads. A task's writes first try to go together
        // (`peer::run_group`).
        let mut handles = Vec::with_capacity(ready.len());
        let mut group = Vec::new();
        let mut bytes = 0;
        for p in ready {
            bytes += p.1.descs.iter().map(|d| d.len).sum::<u64>();
            group.push(p);
            if bytes >= TASK_BYTES {
                handles.extend(self.spawn_group(std::mem::take(&mut group)));
                bytes = 0;
            }
        }
        if !group.is_empty() {
            handles.extend(self.spawn_group(group));
        }
        Ok(handles)
    }

    /// Start a prepared operation in a task of its own; its handle.
    fn launch(self: &Arc<Self>, (buffer, spec): (u64, OpSpec)) -> u64 {
        let (h, flags) = self.ops.lock().unwrap().start(&[buffer]);
        let c = self.clone();
        tokio::spawn(async move {
            let ending = Ending { conn: &c, h };
            let r = peer::run(&c.bufs, &spec, &flags[0]).await;
            drop(spec);
            c.ended(vec![(ending.take(), r)]);
        });
        h
    }

    /// Start prepared operations in one task, each polled when woken
    /// until every one has ended: first together where they can go so
    /// (`peer::run_group`: those to one peer's exposure), the others each
    /// on its own. Their handles.
    fn spawn_group(self: &Arc<Self>, ready: Vec<(u64, OpSpec)>) -> Vec<u64> {
        let buffers: Vec<u64> = ready.iter().map(|(b, _)| *b).collect();
        let (first, flags) = self.ops.lock().unwrap().start(&buffers);
        let handles = (first..first + ready.len() as u64).collect();
        let c = self.clone();
        tokio::spawn(async move {
            let mut parts: Vec<Vec<Running>> = Vec::new();
            for (k, (_, spec)) in ready.into_iter().enumerate() {
                let ending = Ending {
                    conn: &c,
                    h: first + k as u64,
                };
                let op = (ending, &flags[k], spec);
                match parts.iter_mut().find(|p| peer::together(&p[0].2, &op.2)) {
                    Some(p) => p.push(op),
                    None => parts.push(vec![op]),
                }
            }
            let runs: FuturesUnordered<_> = parts.into_iter().map(|p| c.run_together(p)).collect();
            runs.collect::<()>().await;
        });
        handles
    }

    /// Run started operations `part` (that may go together) to their
    /// ends: together first, then those that could not each on its own.
    async fn run_together(&self, part: Vec<Running<'_>>) {
        let together: Vec<(&OpSpec, &AtomicBool)> =
            part.iter().map(|(_, flag, s)| (s, *flag)).collect();
        let ends = peer::run_group(&self.bufs, &together).await;
        drop(together);
        let alone = FuturesUnordered::new();
        let mut ended = Vec::with_capacity(part.len());
        for ((ending, flag, spec), end) in part.into_iter().zip(ends) {
            let resume = match end {
                peer::GroupEnd::Ended(r) => {
                    ended.push((ending.take(), r));
                    continue;
                }
                peer::GroupEnd::Alone => None,
                peer::GroupEnd::Resume(r) => Some(r),
            };
            alone.push(async move {
                let r = peer::run_from(&self.bufs, &spec, flag, resume).await;
                drop(spec);
                self.ended(vec![(ending.take(), r)]);
            });
        }
        self.ended(ended);
        alone.collect::<()>().await;
    }

    /// Operations ended, each `(h, r)` with `r`: their states, their
    /// events, their waiters woken (one pass over the table for all).
    fn ended(&self, ends: Vec<(u64, Result<peer::Moved, Failure>)>) {
        if ends.is_empty() {
            return;
        }
        let events = self.done_events.load(Relaxed);
        let mut frames = Vec::new();
        let mut wake = Vec::new();
        {
            let mut ops = self.ops.lock().unwrap();
            for (h, r) in ends {
                let Some((st, waiters)) = ops.end(h, r) else {
                    continue;
                };
                if let OpState::Failed(e) = &st {
                    tracing::info!(conn = self.id, handle = h, error = %crate::escape::esc(&e), "buffer operation failed");
                }
                if events {
                    frames.push(wire::encode(&Event::Done(st.status(h))));
                }
                wake.extend(waiters);
            }
        }
        // One send for all (a batch's `done` events): one write, one
        // wake-up of the service's reader.
        if !frames.is_empty() {
            self.out.send(frames.concat());
        }
        for w in wake {
            w.notify_waiters();
        }
    }

    /// Operation `h`'s status once it ended, or running at `deadline`.
    async fn wait(&self, h: u64, deadline: Option<Instant>) -> Result<OpStatus, Failure> {
        self.until_over(h, deadline).await;
        Ok(self.op(h)?.status(h))
    }

    /// Once every one of operations `hs` has ended.
    async fn retired(&self, hs: Vec<u64>) {
        for h in hs {
            self.until_over(h, None).await;
        }
    }

    /// Once operation `h` is not running (ended, or no such operation),
    /// or at `deadline`.
    async fn until_over(&self, h: u64, deadline: Option<Instant>) {
        let Some(waiters) = self.ops.lock().unwrap().waiters(h) else {
            return;
        };
        let woken = waiters.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        // (It may have ended between the two looks.)
        if self.ops.lock().unwrap().over(h) {
            return;
        }
        match deadline {
            Some(d) => {
                let _ = tokio::time::timeout_at(d.into(), woken).await;
            }
            None => woken.await,
        }
    }

    /// The connection ended: cancel its operations, withdraw its
    /// exposures and revoke their grants; the buffers go when the last
    /// operation on them has retired.
    async fn close(&self) {
        let ops = self.ops.lock().unwrap().cancel(|_| true);
        self.bufs.owner_gone(self.id);
        self.retired(ops).await;
        let bufs: Vec<Buf> = self
            .buffers
            .lock()
            .unwrap()
            .drain()
            .map(|(_, b)| b)
            .collect();
        for b in &bufs {
            self.bufs.peers.forget_buffer(b.uid);
        }
        crate::control::in_place(|| drop(bufs));
        tracing::info!(conn = self.id, peer = %self.cred, "service disconnected: its buffers are released");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::buffers::api::OpStateName;

    /// A connection of an rcpd that knows no peers, and what it sends.
    fn conn() -> (Arc<Conn>, tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>) {
        let bufs = Buffers::new(super::super::BuffersConfig {
            client: crate::control::client::ClientOptions::default(),
            peers: Arc::new(crate::control::copy_peers::CopyPeers::new(Vec::new())),
            default_check: None,
            token: None,
            node: "127.0.0.1:1".into(),
            pool: crate::control::jobs::Pool::new(Default::default()),
        });
        let (out, rx) = Outbox::new();
        let conn = Arc::new(Conn {
            id: bufs.new_conn(),
            bufs,
            out,
            buffers: Mutex::new(HashMap::new()),
            next_buf: AtomicU64::new(0),
            ops: Mutex::new(Ops::new(KEPT_ENDED)),
            cred: "uid=0 pid=0".into(),
            hello: AtomicBool::new(true),
            done_events: AtomicBool::new(true),
            name: Mutex::new(String::new()),
        });
        (conn, rx)
    }

    /// An operation whose task goes without ending it (a panic) ends
    /// cancelled: its waiter wakes, the service hears its `done` event;
    /// one whose end was taken stays as its task left it.
    #[tokio::test]
    async fn an_operation_whose_task_panics_ends_cancelled() {
        let (c, mut rx) = conn();
        let (h, _flags) = c.ops.lock().unwrap().start(&[1, 1]);
        let waiting = tokio::spawn({
            let c = c.clone();
            async move { c.wait(h, None).await }
        });
        tokio::task::yield_now().await;
        let task = tokio::spawn({
            let c = c.clone();
            async move {
                let _ending = Ending { conn: &c, h };
                let kept = Ending { conn: &c, h: h + 1 };
                assert_eq!(kept.take(), h + 1);
                panic!("a test's operation task panics");
            }
        });
        assert!(task.await.unwrap_err().is_panic());
        // (A hang guard only: the waiter wakes at once.)
        let woke = tokio::time::timeout(std::time::Duration::from_secs(60), waiting).await;
        let st = woke.expect("the waiter woke").unwrap().unwrap();
        assert_eq!((st.handle, st.state), (h, OpStateName::Cancelled));
        let ev = String::from_utf8_lossy(&rx.recv().await.unwrap()).into_owned();
        assert!(ev.contains("\"cancelled\""), "{ev}");
        let other = c.op(h + 1).unwrap().status(h + 1);
        assert_eq!(other.state, OpStateName::Running, "its end was taken");
        assert!(rx.try_recv().is_err(), "one event");
    }
}
