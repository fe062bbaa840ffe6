//! Notices on the data path (protocol 2.6): on a tcp session whose peer
//! said so in its standing grants (`StandingGrant.frames`), a batch of
//! notices goes as one MESSAGE frame of the tcp provider
//! ([`crate::provider::tcp::wire`]) on a connection of the session (opened
//! with the session's key, like its data connections), and its answer
//! comes back on it: no gRPC call, no HTTP/2 stream, no task on either
//! side between the socket and the check. It is ordered after the data,
//! as a SEND after WRITEs on an RC QP: sent after the ranges completed,
//! or, for a small write ([`Frames::write_notify`]), behind its WRITEs on
//! the same connection in the same send, so that a write until the
//! owner's event is one round trip between the rcpds with no thread of
//! the data path in it.

use std::io::IoSlice;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use super::standing::MAX_NOTICES;
use super::Failure;
use crate::control::client::DataTarget;
use crate::control::error::Reason;
use crate::mem::memfd::LeasedRange;
use crate::proto;
use crate::provider::tcp::wire::{
    Hello, Op, Request, Response, Status, MAX_MESSAGE, REQ_LEN, RESP_LEN,
};

/// Connections kept open between calls.
const IDLE: usize = 4;

/// Writes at most this big (all ranges together) go on a connection with
/// their notice ([`Frames::write_notify`]); larger ones go through the
/// data path's threads, which copy nothing.
pub const WRITE_MAX: u64 = 256 << 10;

/// Exchanges of queued writes under way at once (each on a connection of
/// its own): one being answered while the next is sent.
const LEADERS: usize = 2;

/// Payload bytes one exchange carries at most (at least one write).
const BATCH_BYTES: usize = 1 << 20;

/// Capacity of the send buffers kept for the next writes, at most: each
/// write's WRITEs are copied into one, and a fresh allocation per write
/// (64 KiB and more) cost malloc's bookkeeping and the kernel's page
/// faults every time.
const SPARE_BYTES: usize = LEADERS * BATCH_BYTES;

/// Send buffers kept, at most (a write takes the last one given back).
const SPARE_BUFS: usize = 64;

/// Send buffers kept for the next writes, and their capacity in all.
#[derive(Default)]
struct Spare {
    bufs: Vec<Vec<u8>>,
    bytes: usize,
}

/// A session's connections for notices and small writes.
pub struct Frames {
    target: DataTarget,
    /// A standing grant of the peer's said it takes notices so.
    taken: AtomicBool,
    /// Open between calls, each used by one call at a time.
    idle: Mutex<Vec<TcpStream>>,
    /// Small writes waiting for an exchange.
    q: Mutex<Queue>,
    tag: AtomicU64,
    /// A call that gets no answer this long fails (retryable).
    timeout: Duration,
    /// Send buffers of earlier writes, for the next ones ([`SPARE_BYTES`]).
    spare: Mutex<Spare>,
}

/// Why a write on a connection did not end with the notice's answer.
#[derive(Clone, Debug)]
pub enum WriteFailed {
    /// The peer refused its WRITE (a remote access error: its standing
    /// grant is revoked); the connection is dropped, nothing else.
    Refused(String),
    /// Another write of the same exchange was refused, so nothing of this
    /// one was told: move it again.
    Again,
    Failed(Failure),
}

/// Small writes waiting for an exchange, told together (one operation's,
/// or a prepared list's): their WRITE requests with their payloads
/// (encoded), their tags, their notices.
struct Pending {
    piece: Vec<u8>,
    tags: Vec<u64>,
    notices: Vec<proto::BufferNotice>,
    reply: oneshot::Sender<Result<Vec<proto::BufferNoticeResult>, WriteFailed>>,
}

#[derive(Default)]
struct Queue {
    /// Exchanges under way.
    leaders: usize,
    waiting: Vec<Pending>,
}

impl Frames {
    pub fn new(target: DataTarget, timeout: Duration) -> Frames {
        Frames {
            target,
            taken: AtomicBool::new(false),
            idle: Mutex::new(Vec::new()),
            q: Mutex::default(),
            tag: AtomicU64::new(0),
            timeout,
            spare: Mutex::default(),
        }
    }

    /// The peer gave a standing grant that says `frames`.
    pub fn taken(&self) {
        self.taken.store(true, Ordering::Relaxed);
    }

    /// `req` as a frame, if the peer takes them and it fits one.
    pub fn encode(&self, req: &proto::BufferNotifyRequest) -> Option<Vec<u8>> {
        if !self.taken.load(Ordering::Relaxed) {
            return None;
        }
        let payload = req.encode_to_vec();
        (payload.len() <= MAX_MESSAGE as usize).then_some(payload)
    }

    /// Whether a write of `bytes` goes on a connection with its notice:
    /// the peer takes frames and the write is small.
    pub fn carries(&self, bytes: u64) -> bool {
        self.taken.load(Ordering::Relaxed) && bytes <= WRITE_MAX
    }

    /// Send `payload` (from [`Frames::encode`]) and take the answer.
    pub async fn call(
        &self,
        payload: &[u8],
        peer: &str,
    ) -> Result<proto::BufferNotifyResponse, Failure> {
        let tag = self.tag.fetch_add(1, Ordering::Relaxed);
        let mut out = Vec::with_capacity(payload.len() + REQ_LEN);
        message(&mut out, tag, payload);
        match self.exchange(&[out], &[], tag, peer).await {
            Ok(r) => Ok(r),
            Err((_, WriteFailed::Failed(f))) => Err(f),
            Err((_, m)) => Err(Failure::new(
                Reason::Protocol,
                format!("peer {peer} broke the protocol: a notice frame: {m:?}"),
            )),
        }
    }

    /// Write each `(bytes, addr, rkey)` and then tell `notice`: the
    /// WRITEs and the notice go on a connection of the session, with
    /// those of the other writes queued meanwhile, in one send (the
    /// WRITEs first, then one MESSAGE with every notice: the peer's
    /// target executes the WRITEs and then hands the notices to its
    /// check, as a SEND after WRITEs on an RC QP); this notice's result.
    /// A lone write leaves at once, in this task; writes that come while
    /// `LEADERS` exchanges are under way queue and leave together.
    pub async fn write_notify(
        self: &Arc<Self>,
        ranges: &[(&LeasedRange, u64, u32)],
        notice: proto::BufferNotice,
        peer: &str,
    ) -> Result<proto::BufferNoticeResult, WriteFailed> {
        let mut r = self.write_notify_many(ranges, vec![notice], peer).await?;
        Ok(r.pop().expect("a result per notice"))
    }

    /// [`Frames::write_notify`] of several writes at once (`ranges`: all
    /// of theirs, in order; a notice each): one queued entry, one answer,
    /// a result per notice in their order. A refused WRITE fails them
    /// all (`Refused`: none of them was told).
    pub async fn write_notify_many(
        self: &Arc<Self>,
        ranges: &[(&LeasedRange, u64, u32)],
        notices: Vec<proto::BufferNotice>,
        peer: &str,
    ) -> Result<Vec<proto::BufferNoticeResult>, WriteFailed> {
        let bytes: usize = ranges
            .iter()
            .map(|(r, _, _)| r.lease().len() as usize)
            .sum();
        let mut piece = self.buffer(bytes + ranges.len() * REQ_LEN);
        let mut tags = Vec::with_capacity(ranges.len());
        for &(r, addr, rkey) in ranges {
            let tag = self.tag.fetch_add(1, Ordering::Relaxed);
            let req = Request {
                op: Op::Write,
                tag,
                addr,
                rkey,
                len: r.lease().len() as u32,
                // Only the MESSAGE's answer is waited on.
                prompt: false,
            };
            piece.extend_from_slice(&req.encode());
            r.with(|b| piece.extend_from_slice(b));
            tags.push(tag);
        }
        let (reply, rx) = oneshot::channel();
        let lead = {
            let mut q = self.q.lock().unwrap();
            q.waiting.push(Pending {
                piece,
                tags,
                notices,
                reply,
            });
            q.leaders < LEADERS && {
                q.leaders += 1;
                true
            }
        };
        // (`next_batch` gives the leader's place back when nothing waits.)
        if let Some(batch) = lead.then(|| self.next_batch()).flatten() {
            self.send_batch(batch, peer).await;
            // More came meanwhile: a task of their own sends them, so
            // this write's answer does not wait for theirs.
            if self.next_batch_waits() {
                let (me, peer) = (self.clone(), peer.to_string());
                tokio::spawn(async move {
                    while let Some(batch) = me.next_batch() {
                        me.send_batch(batch, &peer).await;
                    }
                });
            }
        }
        rx.await.unwrap_or_else(|_| {
            Err(WriteFailed::Failed(Failure::new(
                Reason::Retryable,
                "the session's writes were dropped",
            )))
        })
    }

    /// The queued writes one exchange takes (as many as fit), or `None`
    /// with nothing queued (and one leader fewer).
    fn next_batch(&self) -> Option<Vec<Pending>> {
        let mut q = self.q.lock().unwrap();
        if q.waiting.is_empty() {
            q.leaders -= 1;
            return None;
        }
        let (mut n, mut bytes, mut notices) = (0, 0, 0);
        for p in &q.waiting {
            let more = p.notices.len();
            if n > 0 && (bytes + p.piece.len() > BATCH_BYTES || notices + more > MAX_NOTICES) {
                break;
            }
            n += 1;
            bytes += p.piece.len();
            notices += more;
        }
        Some(q.waiting.drain(..n).collect())
    }

    /// Whether writes wait (the leader keeps its place to send them),
    /// else the leader's place is given up.
    fn next_batch_waits(&self) -> bool {
        let mut q = self.q.lock().unwrap();
        if q.waiting.is_empty() {
            q.leaders -= 1;
            false
        } else {
            true
        }
    }

    /// One exchange of `batch`; each write's result to its sender.
    async fn send_batch(&self, batch: Vec<Pending>, peer: &str) {
        // The pieces go out as they are (one vectored send, no copy).
        let mut out = Vec::with_capacity(batch.len() + 1);
        let mut ops = Vec::with_capacity(batch.len());
        let mut writes = Vec::with_capacity(batch.len());
        let mut replies = Vec::with_capacity(batch.len());
        for p in batch {
            out.push(p.piece);
            writes.push(p.tags);
            replies.push((p.notices.len(), p.reply));
            ops.extend(p.notices);
        }
        let ops_len = ops.len();
        let msg = proto::BufferNotifyRequest {
            session_id: 0,
            ops,
            node: String::new(),
        }
        .encode_to_vec();
        let tag = self.tag.fetch_add(1, Ordering::Relaxed);
        let mut m = Vec::with_capacity(msg.len() + REQ_LEN);
        message(&mut m, tag, &msg);
        out.push(m);
        let sent = ops_len;
        let answer = self.exchange(&out, &writes, tag, peer).await;
        self.give_back(out);
        let answer = answer.and_then(|r| {
            super::standing::results_of(r, sent, peer).map_err(|e| (None, WriteFailed::Failed(e)))
        });
        match answer {
            Ok(results) => {
                let mut results = results.into_iter();
                for (n, tx) in replies {
                    let _ = tx.send(Ok(results.by_ref().take(n).collect()));
                }
            }
            Err((Some(k), WriteFailed::Refused(m))) => {
                for (i, (_, tx)) in replies.into_iter().enumerate() {
                    let r = if i == k {
                        WriteFailed::Refused(m.clone())
                    } else {
                        WriteFailed::Again
                    };
                    let _ = tx.send(Err(r));
                }
            }
            Err((_, e)) => {
                for (_, tx) in replies {
                    let _ = tx.send(Err(e.clone()));
                }
            }
        }
    }

    /// Send `out` on a free connection, take the answers to the WRITEs
    /// `writes` (grouped by queued entry) and then to the message `tag`.
    /// A refused WRITE names its entry.
    async fn exchange(
        &self,
        out: &[Vec<u8>],
        writes: &[Vec<u64>],
        tag: u64,
        peer: &str,
    ) -> Result<proto::BufferNotifyResponse, (Option<usize>, WriteFailed)> {
        let broke = |e: std::io::Error| {
            (
                None,
                WriteFailed::Failed(Failure::new(
                    Reason::Retryable,
                    format!(
                        "peer {peer}: the notices' connection to {}: {e}",
                        self.target.0
                    ),
                )),
            )
        };
        let conn = self.idle.lock().unwrap().pop();
        let mut s = match conn {
            Some(s) => s,
            None => self.connect().await.map_err(broke)?,
        };
        let mut refused = None;
        let answer = tokio::time::timeout(self.timeout, async {
            write_all(&mut s, out).await?;
            for (k, tags) in writes.iter().enumerate() {
                refused = Some(k);
                for &w in tags {
                    answer(&mut s, w, false).await?;
                }
            }
            refused = None;
            answer(&mut s, tag, true).await
        })
        .await
        .unwrap_or_else(|_| {
            Err(Exchange::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer in {:?}", self.timeout),
            )))
        });
        let bytes = match answer {
            Ok(b) => b,
            Err(Exchange::Io(e)) => return Err(broke(e)),
            Err(Exchange::Refused) => {
                return Err((
                    refused,
                    WriteFailed::Refused("a WRITE refused (a remote access error)".into()),
                ))
            }
            Err(Exchange::Broke(m)) => {
                return Err((
                    None,
                    WriteFailed::Failed(Failure::new(
                        Reason::Protocol,
                        format!("peer {peer} broke the protocol: a notice frame: {m}"),
                    )),
                ))
            }
        };
        // The connection is in step again: kept for the next call.
        {
            let mut idle = self.idle.lock().unwrap();
            if idle.len() < IDLE {
                idle.push(s);
            }
        }
        frame_response(&bytes, peer).map_err(|e| (None, WriteFailed::Failed(e)))
    }

    /// An empty send buffer of at least `len` bytes: the last one given
    /// back if it is large enough (a session's writes are mostly of one
    /// size), else a new one (and the small one is let go).
    fn buffer(&self, len: usize) -> Vec<u8> {
        let mut spare = self.spare.lock().unwrap();
        if let Some(b) = spare.bufs.pop() {
            spare.bytes -= b.capacity();
            if b.capacity() >= len {
                return b;
            }
        }
        Vec::with_capacity(len)
    }

    /// Keep `bufs` (sent) for the next writes, up to [`SPARE_BUFS`] of
    /// them and [`SPARE_BYTES`] in all.
    fn give_back(&self, bufs: Vec<Vec<u8>>) {
        let mut spare = self.spare.lock().unwrap();
        for mut b in bufs {
            if spare.bufs.len() < SPARE_BUFS && spare.bytes + b.capacity() <= SPARE_BYTES {
                spare.bytes += b.capacity();
                b.clear();
                spare.bufs.push(b);
            }
        }
    }

    async fn connect(&self) -> std::io::Result<TcpStream> {
        let mut s = TcpStream::connect(self.target.0).await?;
        s.set_nodelay(true)?;
        if let Some(key) = self.target.1 {
            s.write_all(&Hello { key }.encode()).await?;
        }
        Ok(s)
    }
}

/// The answer to a notice call on the data path (a `BufferNotifyFrame`'s
/// bytes, on a tcp connection or a verbs message QP): the response, or
/// why the call was refused.
pub(super) fn frame_response(
    bytes: &[u8],
    peer: &str,
) -> Result<proto::BufferNotifyResponse, Failure> {
    let f = proto::BufferNotifyFrame::decode(bytes).map_err(|e| {
        Failure::new(
            Reason::Protocol,
            format!("peer {peer} broke the protocol: a notice frame's answer: {e}"),
        )
    })?;
    match f.response {
        Some(r) if f.error.is_empty() => Ok(r),
        _ => Err(Failure::new(
            Reason::try_from(f.reason).unwrap_or(Reason::Other),
            format!("peer {peer}: {}", f.error),
        )),
    }
}

/// Send every buffer of `bufs`, in order, in as few calls as the socket
/// takes (at most `IOV_MAX` buffers a call).
async fn write_all(s: &mut TcpStream, bufs: &[Vec<u8>]) -> std::io::Result<()> {
    const IOV_MAX: usize = 1024;
    let mut slices: Vec<IoSlice> = bufs.iter().map(|b| IoSlice::new(b)).collect();
    let mut left = &mut slices[..];
    while !left.is_empty() {
        let n = s.write_vectored(&left[..left.len().min(IOV_MAX)]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut left, n);
    }
    Ok(())
}

/// A MESSAGE request carrying `payload`, appended to `out`.
fn message(out: &mut Vec<u8>, tag: u64, payload: &[u8]) {
    let req = Request {
        op: Op::Message,
        tag,
        addr: 0,
        rkey: 0,
        len: payload.len() as u32,
        prompt: true,
    };
    out.extend_from_slice(&req.encode());
    out.extend_from_slice(payload);
}

enum Exchange {
    Io(std::io::Error),
    /// A WRITE was refused: the target answers nothing more on the
    /// connection.
    Refused,
    /// The peer's answer does not fit the request.
    Broke(String),
}

impl From<std::io::Error> for Exchange {
    fn from(e: std::io::Error) -> Self {
        Exchange::Io(e)
    }
}

/// The answer to request `tag` on `s`: a WRITE's (nothing) or a
/// MESSAGE's (its payload).
async fn answer(s: &mut TcpStream, tag: u64, message: bool) -> Result<Vec<u8>, Exchange> {
    let mut hdr = [0u8; RESP_LEN];
    s.read_exact(&mut hdr).await?;
    let resp = Response::decode(&hdr).map_err(|e| Exchange::Broke(e.to_string()))?;
    if resp.tag != tag {
        return Err(Exchange::Broke(format!(
            "the answer to {} for request {tag}",
            resp.tag
        )));
    }
    match resp.status {
        Status::Ok if !message && resp.len == 0 => return Ok(Vec::new()),
        Status::Ok if message && resp.len <= MAX_MESSAGE => {}
        Status::Ok => return Err(Exchange::Broke(format!("an answer of {} bytes", resp.len))),
        Status::NoMessages => {
            return Err(Exchange::Broke(
                "its standing grant said it takes notices as frames; its session takes none".into(),
            ))
        }
        Status::RemoteAccess => return Err(Exchange::Refused),
    }
    let mut answer = vec![0u8; resp.len as usize];
    s.read_exact(&mut answer).await?;
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::mem::memfd::{LeaseKind, ServiceBuffer};
    use crate::mem::{Arena, ArenaConfig};
    use crate::provider::tcp::{Answer, Messages, TcpDomain, TcpTarget};
    use crate::provider::{Access, Registration};

    /// Answers every notice `ended` and keeps how many each call carried;
    /// holds each call while its gate is shut.
    #[derive(Default)]
    struct Told {
        calls: Mutex<Vec<usize>>,
        shut: Mutex<bool>,
        opened: std::sync::Condvar,
    }

    impl Told {
        /// Open the gate once `f` has `n` writes queued.
        fn open_when_queued(self: &Arc<Self>, f: &Arc<Frames>, n: usize) {
            *self.shut.lock().unwrap() = true;
            let (me, f) = (self.clone(), f.clone());
            std::thread::spawn(move || {
                while f.q.lock().unwrap().waiting.len() < n {
                    std::thread::yield_now();
                }
                *me.shut.lock().unwrap() = false;
                me.opened.notify_all();
            });
        }
    }

    impl Messages for Told {
        fn message(&self, payload: &[u8]) -> Answer {
            let req = proto::BufferNotifyRequest::decode(payload).unwrap();
            let shut = self.shut.lock().unwrap();
            drop(self.opened.wait_while(shut, |s| *s).unwrap());
            self.calls.lock().unwrap().push(req.ops.len());
            let results = req
                .ops
                .iter()
                .map(|_| proto::BufferNoticeResult {
                    ended: true,
                    ..Default::default()
                })
                .collect();
            Answer::of(
                proto::BufferNotifyFrame {
                    response: Some(proto::BufferNotifyResponse { results }),
                    ..Default::default()
                }
                .encode_to_vec(),
            )
        }
    }

    const LEN: u64 = 4096;

    /// Eight writes started together: the first two leave at once, each
    /// in its own exchange; the six that came meanwhile (the peer holds
    /// the first two's notices until they queued) leave together in one
    /// (one send, one MESSAGE with six notices), and their bytes land.
    /// Then the same with the fifth write's key refused: it is told
    /// `Refused`, the others of its exchange `Again` (none was told), and
    /// the next write goes on a new connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writes_that_queue_leave_together_and_a_refused_one_fails_alone() {
        let target = TcpTarget::bind_sessions("127.0.0.1:0").unwrap();
        let domain = TcpDomain::new();
        let binding = target.bind_session(&domain).unwrap();
        let told = Arc::new(Told::default());
        domain.take_messages(told.clone());
        let dst = ServiceBuffer::from_arena(Arena::new(&ArenaConfig::new(1 << 20)).unwrap());
        // SAFETY: nothing of the test touches dst while the registration
        // lives but the peer's WRITEs; it is read after they completed.
        let reg = unsafe { domain.register_span(&dst.span(), Access::REMOTE_WRITE) }.unwrap();
        let src = ServiceBuffer::from_arena(Arena::new(&ArenaConfig::new(1 << 20)).unwrap());
        let data: Vec<u8> = (0..8 * LEN).map(|i| (i % 251) as u8).collect();
        // SAFETY: no lease or registration of src exists yet.
        unsafe {
            src.span()
                .with_mut(0, data.len(), |b| b.copy_from_slice(&data))
        }
        .unwrap();
        let f = Arc::new(Frames::new(
            (target.local_addr(), Some(binding.key())),
            Duration::from_secs(60),
        ));
        f.taken();
        let leases: Vec<_> = (0..8)
            .map(|i| src.lease(i * LEN, LEN, LeaseKind::Shared).unwrap().unwrap())
            .collect();
        let run = |bad: Option<usize>| {
            let f = f.clone();
            let leases = &leases;
            let (addr, rkey) = (dst.addr(), reg.rkey());
            // Shut until six writes queue behind the first two.
            told.open_when_queued(&f, 6);
            futures::future::join_all((0..8).map(move |i| {
                let f = f.clone();
                async move {
                    let key = if Some(i) == bad { rkey ^ 1 } else { rkey };
                    let r = [(&leases[i], addr + i as u64 * LEN, key)];
                    f.write_notify(&r, proto::BufferNotice::default(), "peer")
                        .await
                }
            }))
        };
        let all = run(None).await;
        assert!(
            all.iter().all(|r| r.as_ref().is_ok_and(|r| r.ended)),
            "{all:?}"
        );
        let mut calls = told.calls.lock().unwrap().clone();
        calls.sort();
        assert_eq!(calls, vec![1, 1, 6]);
        assert!(dst.span().with(0, data.len(), |b| b == data).unwrap());

        // The drain of the first round gives its place back after its
        // answers went out: waited for, so the second round starts alike.
        while f.q.lock().unwrap().leaders > 0 {
            tokio::task::yield_now().await;
        }
        told.calls.lock().unwrap().clear();
        let all = run(Some(4)).await;
        for (i, r) in all.iter().enumerate() {
            match (i, r) {
                (0 | 1, Ok(r)) => assert!(r.ended),
                (4, Err(WriteFailed::Refused(_))) => {}
                (2 | 3 | 5..=7, Err(WriteFailed::Again)) => {}
                _ => panic!("write {i}: {r:?} (told {:?})", told.calls.lock().unwrap()),
            }
        }
        assert_eq!(*told.calls.lock().unwrap(), vec![1, 1]);
        let r = [(&leases[0], dst.addr(), reg.rkey())];
        let again = f
            .write_notify(&r, proto::BufferNotice::default(), "peer")
            .await;
        assert!(again.is_ok_and(|r| r.ended));
        assert_eq!(told.calls.lock().unwrap().len(), 3);
    }
}
