//! Messages on a queue pair of their own: a request and its answer each go
//! as SENDs into receives posted ahead (two-sided verbs), with no control
//! plane call and no task between the completion queue and the handler.
//! Buffers' notices over verbs take this way (docs/buffers.md, "Notices
//! on the data path"): the caller's [`Messenger::call`] hands a request
//! to the messenger's thread, which posts it; the answering side's thread
//! takes it from its receive queue, runs the handler and posts the answer.
//!
//! The QP is the session's own (built in the session's protection domain,
//! on rail 0's port) and has no remote access: a peer reaches through it
//! only the receives posted here. Each side keeps [`DEPTH`] receives of
//! [`SLOT`] bytes posted and [`DEPTH`] send buffers, all in one
//! registered arena; a message longer than a slot goes as fragments
//! ([`Header`]), so no message is refused for its size up to
//! [`MAX_MESSAGE`]. A receive is posted again as soon as its fragment is
//! taken, and the QP retries a SEND the peer has no receive for (RNR) for
//! as long as it takes, so the receives are the flow control.
//!
//! Ownership of the memory (the `unsafe` of this module): a [`Block`] of
//! the arena is in exactly one place: the free send list, a posted
//! receive's slot or a posted SEND's slot (the device's until that work
//! request's completion, or the QP's destruction, which comes first in
//! `Worker`'s fields), or the thread's hands between the two.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::oneshot;

use super::{
    Access, CompletionQueue, ConnectParams, MemoryRegion, PreparedQp, ProtectionDomain, QpBuilder,
    QpEndpoint, QueuePair, VerbsError,
};
use crate::engine::{LocalSeg, WcStatus, WorkCompletion};
use crate::mem::{Arena, ArenaConfig, Block, BlockPool};

/// Bytes of one receive (and of one send buffer): a fragment's header and
/// up to `SLOT - HDR` bytes of its message.
pub const SLOT: usize = 64 << 10;

/// Receives kept posted, and send buffers, each side.
pub const DEPTH: usize = 16;

/// A message (request or answer) is at most this long.
pub const MAX_MESSAGE: usize = 16 << 20;

/// Bytes of a fragment's header.
pub const HDR: usize = 16;

/// Answers queued to go out at most: past it, the receives that took
/// requests are held, not posted again, until the answers drain (so a peer
/// that sends requests and takes no answers stalls its own requests, RNR,
/// instead of growing this side's queue).
const MAX_QUEUED: usize = 4 * DEPTH;

/// Partly received messages at most.
const MAX_PARTIAL: usize = 2 * DEPTH;

/// A receive's work request id (a SEND's is its slot alone).
const RECV: u64 = 1 << 63;

/// What a fragment is: which message (`tag`, the caller's, echoed in the
/// answer), whether it is an answer, the last of its message, and an
/// answer that refuses the request (the side takes no requests).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub tag: u64,
    pub answer: bool,
    pub last: bool,
    pub refused: bool,
}

impl Header {
    const ANSWER: u8 = 1;
    const LAST: u8 = 2;
    const REFUSED: u8 = 4;

    pub fn encode(&self) -> [u8; HDR] {
        let mut b = [0u8; HDR];
        b[..8].copy_from_slice(&self.tag.to_le_bytes());
        let bit = |on: bool, b: u8| if on { b } else { 0 };
        b[8] = bit(self.answer, Self::ANSWER)
            | bit(self.last, Self::LAST)
            | bit(self.refused, Self::REFUSED);
        b
    }

    /// The header of a fragment, or what is wrong with it.
    pub fn decode(b: &[u8]) -> Result<Header, String> {
        if b.len() < HDR {
            return Err(format!(
                "a fragment of {} bytes, shorter than its header",
                b.len()
            ));
        }
        let f = b[8];
        if f & !(Self::ANSWER | Self::LAST | Self::REFUSED) != 0
            || b[9..HDR].iter().any(|&x| x != 0)
        {
            return Err(format!(
                "a fragment header with unknown flags {:02x?}",
                &b[8..HDR]
            ));
        }
        Ok(Header {
            tag: u64::from_le_bytes(b[..8].try_into().unwrap()),
            answer: f & Self::ANSWER != 0,
            last: f & Self::LAST != 0,
            refused: f & Self::REFUSED != 0,
        })
    }
}

/// A message made whole: the header of its last fragment and its bytes.
pub type Whole<'a> = (Header, Cow<'a, [u8]>);

/// Messages being put back together from their fragments (no I/O: the
/// thread feeds it what its receives took).
#[derive(Default)]
pub struct Reassembly {
    partial: HashMap<(u64, bool), Vec<u8>>,
}

impl Reassembly {
    /// Take one fragment: the whole message when it was the last (borrowed
    /// from `frag` when it came whole), or what breaks the channel.
    pub fn take<'a>(&mut self, frag: &'a [u8]) -> Result<Option<Whole<'a>>, String> {
        let h = Header::decode(frag)?;
        let body = &frag[HDR..];
        let key = (h.tag, h.answer);
        let have = self.partial.get(&key).map_or(0, Vec::len);
        if have + body.len() > MAX_MESSAGE {
            return Err(format!("a message of more than {MAX_MESSAGE} bytes"));
        }
        if h.last {
            return Ok(Some(match self.partial.remove(&key) {
                Some(mut m) => {
                    m.extend_from_slice(body);
                    (h, Cow::Owned(m))
                }
                None => (h, Cow::Borrowed(body)),
            }));
        }
        if have == 0 && self.partial.len() >= MAX_PARTIAL {
            return Err(format!("more than {MAX_PARTIAL} messages begun at once"));
        }
        self.partial.entry(key).or_default().extend_from_slice(body);
        Ok(None)
    }
}

/// Why a call got no answer.
#[derive(Clone, Debug, thiserror::Error)]
pub enum MessageError {
    /// The channel broke (the link, the peer, or a peer outside the
    /// protocol): nothing more goes on it.
    #[error("the message channel broke: {0}")]
    Broken(String),
    /// The peer takes no requests on it.
    #[error("the peer takes no requests on this message channel")]
    Refused,
    #[error("a message of {0} bytes (at most {MAX_MESSAGE})")]
    TooBig(usize),
}

/// The answering side's handler: a request's bytes in, the answer's out
/// (run on the messenger's thread).
pub type Handler = Box<dyn Fn(&[u8]) -> Vec<u8> + Send + Sync>;

type Reply = oneshot::Sender<Result<Vec<u8>, MessageError>>;

/// A message QP built, in INIT, its receives and buffers registered,
/// waiting for the peer's endpoint.
pub struct PreparedMessages {
    qp: PreparedQp,
    mr: MemoryRegion,
    pool: BlockPool,
}

impl PreparedMessages {
    /// A message QP in `pd` on `port`, addressed by GID `gid_index` (the
    /// path of a QP of the same session: [`QueuePair::path`]).
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        port: u8,
        gid_index: u32,
    ) -> Result<PreparedMessages, VerbsError> {
        let qp = QpBuilder::new(pd, port, gid_index)
            .sq_depth(DEPTH as u32)
            .recv_depth(DEPTH as u32)
            .events(true)
            .build()?;
        let arena = Arena::new(&ArenaConfig::new(2 * DEPTH * SLOT))
            .map_err(|e| VerbsError::new("mmap", libc::ENOMEM, e.to_string()))?;
        // SAFETY: local write access only: no peer reaches this memory
        // (the QP has no remote access either); the blocks are handed to
        // the device only as posted receives and SENDs (module doc).
        let mr = unsafe { pd.register_arena(&arena, Access::LOCAL_WRITE) }?;
        let pool = arena
            .into_pool(SLOT)
            .map_err(|e| VerbsError::new("mmap", libc::EINVAL, e.to_string()))?;
        Ok(PreparedMessages { qp, mr, pool })
    }

    /// This side's endpoint for the peer.
    pub fn endpoint(&self) -> QpEndpoint {
        self.qp.endpoint()
    }

    /// Post the receives, connect to the peer's `remote` endpoint and start
    /// the thread (named `name`); `handler` answers the peer's requests
    /// (`None`: each is refused).
    pub fn connect(
        self,
        remote: &QpEndpoint,
        p: &ConnectParams,
        handler: Option<Handler>,
        name: &str,
    ) -> Result<Messenger, VerbsError> {
        let PreparedMessages { qp, mr, pool } = self;
        // Receives are posted in INIT already: the peer's first SEND finds
        // one, however soon it comes.
        let mut recv = Vec::with_capacity(DEPTH);
        let mut send = Vec::with_capacity(DEPTH);
        for _ in 0..DEPTH {
            recv.push(pool.take());
            send.push(pool.take());
        }
        let mut qp = qp.qp;
        for (i, b) in recv.iter().enumerate() {
            let b = b.as_ref().expect("the arena holds 2 * DEPTH slots");
            // SAFETY: the block stays in `recv[i]` untouched until this
            // receive's completion (the worker takes it out only then) or
            // the QP's destruction (the worker drops the QP first).
            unsafe { qp.post_recv(RECV | i as u64, seg(b, SLOT, mr.lkey())) }?;
        }
        qp.handshake(remote, p)?;
        let cq = qp.send_cq().clone();
        let shared = Arc::new(Shared {
            inbox: Mutex::default(),
            cq,
            stop: AtomicBool::new(false),
        });
        let free = (0..DEPTH).collect();
        let mut w = Worker {
            qp,
            recv,
            held: Vec::new(),
            send,
            free,
            lkey: mr.lkey(),
            out: VecDeque::new(),
            parts: Reassembly::default(),
            handler,
            shared: shared.clone(),
            _mr: mr,
            _pool: pool,
        };
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || w.run())
            .map_err(|e| {
                VerbsError::new(
                    "pthread_create",
                    e.raw_os_error().unwrap_or(0),
                    "the messages' thread",
                )
            })?;
        Ok(Messenger {
            shared,
            thread: Some(thread),
        })
    }
}

fn seg(b: &Block, len: usize, lkey: u32) -> LocalSeg {
    LocalSeg {
        addr: b.addr(),
        len: len as u32,
        lkey,
    }
}

#[derive(Default)]
struct Inbox {
    calls: VecDeque<(u64, Vec<u8>)>,
    waiting: HashMap<u64, Reply>,
    next_tag: u64,
    broken: Option<String>,
}

struct Shared {
    inbox: Mutex<Inbox>,
    /// The QP's CQ: its completion channel wakes the thread, and so does
    /// its waker ([`CompletionQueue::wake`]) for a new call or the stop.
    cq: Arc<CompletionQueue>,
    stop: AtomicBool,
}

/// A connected message QP and its thread; dropping it stops the thread
/// and destroys the QP (calls still waiting fail).
pub struct Messenger {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Messenger {
    /// Send `request`; the answer, or why none came. A call on a broken
    /// channel fails at once.
    pub fn call(&self, request: Vec<u8>) -> oneshot::Receiver<Result<Vec<u8>, MessageError>> {
        let (tx, rx) = oneshot::channel();
        if request.len() > MAX_MESSAGE {
            let _ = tx.send(Err(MessageError::TooBig(request.len())));
            return rx;
        }
        {
            let mut ib = self.shared.inbox.lock().unwrap();
            if let Some(b) = &ib.broken {
                let _ = tx.send(Err(MessageError::Broken(b.clone())));
                return rx;
            }
            let tag = ib.next_tag;
            ib.next_tag += 1;
            ib.waiting.insert(tag, tx);
            ib.calls.push_back((tag, request));
        }
        self.shared.cq.wake();
        rx
    }

    /// Why the channel broke, once it did.
    pub fn broken(&self) -> Option<String> {
        self.shared.inbox.lock().unwrap().broken.clone()
    }
}

impl Drop for Messenger {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.cq.wake();
        if let Some(t) = self.thread.take() {
            // Dropped by its own thread (the handler let go of the last
            // holder): it ends when this returns, nothing to wait for.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// A message on its way out, `at` bytes of it posted.
struct Outgoing {
    head: Header,
    bytes: Vec<u8>,
    at: usize,
}

/// The thread's state. Field order is drop order: the QP goes first, so
/// the device lets go of every posted block before the blocks, their
/// registration and their arena go.
struct Worker {
    qp: QueuePair,
    /// Slot `i`: the block of receive `RECV | i` while it is posted, or
    /// held ([`MAX_QUEUED`]).
    recv: Vec<Option<Block>>,
    /// Receive slots taken and not posted again (answers back up).
    held: Vec<usize>,
    /// Slot `i`: the block of SEND `i` while it is posted, or free.
    send: Vec<Option<Block>>,
    /// Send slots not posted.
    free: Vec<usize>,
    lkey: u32,
    out: VecDeque<Outgoing>,
    parts: Reassembly,
    handler: Option<Handler>,
    shared: Arc<Shared>,
    _mr: MemoryRegion,
    _pool: BlockPool,
}

impl Worker {
    fn run(&mut self) {
        let why = loop {
            match self.round() {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => break e,
            }
            if self.shared.stop.load(Ordering::Acquire) {
                break "the channel was closed".to_string();
            }
            // Nothing to do: arm the CQ, look once more (a completion may
            // have come before it was armed), then sleep.
            if let Err(e) = self.shared.cq.req_notify() {
                break e.to_string();
            }
            match self.round() {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => break e,
            }
            if let Err(e) = self.shared.cq.wait_event(Duration::from_secs(1)) {
                break e.to_string();
            }
        };
        let stopping = self.shared.stop.load(Ordering::Acquire);
        if !stopping {
            tracing::debug!(why = %why, "message channel broke");
        }
        let waiting = {
            let mut ib = self.shared.inbox.lock().unwrap();
            ib.broken = Some(why.clone());
            ib.calls.clear();
            std::mem::take(&mut ib.waiting)
        };
        for (_, tx) in waiting {
            let _ = tx.send(Err(MessageError::Broken(why.clone())));
        }
    }

    /// Take new calls, completions, post what waits: whether anything
    /// happened.
    fn round(&mut self) -> Result<bool, String> {
        let mut did = false;
        {
            let mut ib = self.shared.inbox.lock().unwrap();
            for (tag, bytes) in ib.calls.drain(..) {
                did = true;
                self.out.push_back(Outgoing {
                    head: Header {
                        tag,
                        answer: false,
                        last: false,
                        refused: false,
                    },
                    bytes,
                    at: 0,
                });
            }
        }
        let mut wcs = [WorkCompletion {
            wr_id: 0,
            status: WcStatus::Success,
            byte_len: 0,
        }; 32];
        let n = self.shared.cq.poll(&mut wcs).map_err(|e| e.to_string())?;
        for wc in &wcs[..n] {
            did = true;
            self.completed(wc)?;
        }
        let posted = self.post()?;
        Ok(self.release_held()? || posted || did)
    }

    fn completed(&mut self, wc: &WorkCompletion) -> Result<(), String> {
        let slot = (wc.wr_id & !RECV) as usize;
        if wc.wr_id & RECV == 0 {
            // A SEND done: its buffer is free again.
            if wc.status != WcStatus::Success {
                return Err(format!("a SEND completed with {:?}", wc.status));
            }
            self.free.push(slot);
            return Ok(());
        }
        if wc.status != WcStatus::Success {
            return Err(format!("a receive completed with {:?}", wc.status));
        }
        let block = self.recv[slot].take().expect("a posted receive's block");
        let len = (wc.byte_len as usize).min(SLOT);
        let whole = self.parts.take(&block.as_slice()[..len])?;
        if let Some((h, m)) = whole {
            if h.answer {
                let r = if h.refused {
                    Err(MessageError::Refused)
                } else {
                    Ok(m.into_owned())
                };
                // A call that went away (its caller timed out) takes none.
                if let Some(tx) = self.shared.inbox.lock().unwrap().waiting.remove(&h.tag) {
                    let _ = tx.send(r);
                }
            } else {
                let (bytes, refused) = match &self.handler {
                    Some(f) => (f(&m), false),
                    None => (Vec::new(), true),
                };
                self.out.push_back(Outgoing {
                    head: Header {
                        tag: h.tag,
                        answer: true,
                        last: false,
                        refused,
                    },
                    bytes,
                    at: 0,
                });
            }
        }
        self.recv[slot] = Some(block);
        if self.answers_queued() >= MAX_QUEUED {
            self.held.push(slot);
            return Ok(());
        }
        self.repost(slot)
    }

    fn answers_queued(&self) -> usize {
        self.out.iter().filter(|o| o.head.answer).count()
    }

    /// Post receive `slot` again (its block is in `recv[slot]`, taken).
    fn repost(&mut self, slot: usize) -> Result<(), String> {
        let block = self.recv[slot].as_ref().expect("a taken receive's block");
        // SAFETY: the block stays in `recv[slot]`, untouched until this
        // receive's completion (`completed` takes it out only then) or the
        // QP's destruction (as at `connect`).
        unsafe {
            self.qp
                .post_recv(RECV | slot as u64, seg(block, SLOT, self.lkey))
        }
        .map_err(|e| e.to_string())
    }

    /// Post the held receives again once the answers have drained.
    fn release_held(&mut self) -> Result<bool, String> {
        let mut did = false;
        while !self.held.is_empty() && self.answers_queued() < MAX_QUEUED {
            let slot = self.held.pop().expect("not empty");
            self.repost(slot)?;
            did = true;
        }
        Ok(did)
    }

    /// Post fragments of the waiting messages while send buffers are free:
    /// whether any went.
    fn post(&mut self) -> Result<bool, String> {
        let mut did = false;
        while let (Some(o), Some(&slot)) = (self.out.front_mut(), self.free.last()) {
            let mut block = self.send[slot].take().expect("a free send slot's block");
            let n = (o.bytes.len() - o.at).min(SLOT - HDR);
            let last = o.at + n == o.bytes.len();
            let head = Header { last, ..o.head };
            let b = block.as_mut_slice();
            b[..HDR].copy_from_slice(&head.encode());
            b[HDR..HDR + n].copy_from_slice(&o.bytes[o.at..o.at + n]);
            // SAFETY: the block goes into `send[slot]`, not written until
            // this SEND's completion gives the slot back (`completed`) or
            // the QP's destruction.
            let posted = unsafe {
                self.qp
                    .post_message(slot as u64, seg(&block, HDR + n, self.lkey))
            };
            self.send[slot] = Some(block);
            posted.map_err(|e| e.to_string())?;
            self.free.pop();
            o.at += n;
            did = true;
            if last {
                self.out.pop_front();
            }
        }
        Ok(did)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frag(h: Header, body: &[u8]) -> Vec<u8> {
        let mut v = h.encode().to_vec();
        v.extend_from_slice(body);
        v
    }

    const REQ: Header = Header {
        tag: 7,
        answer: false,
        last: false,
        refused: false,
    };

    #[test]
    fn a_header_comes_back_as_it_went_and_unknown_flags_are_refused() {
        for f in 0..8u8 {
            let h = Header {
                tag: 0x0102_0304_0506_0708,
                answer: f & 1 != 0,
                last: f & 2 != 0,
                refused: f & 4 != 0,
            };
            assert_eq!(Header::decode(&h.encode()), Ok(h));
        }
        let mut b = REQ.encode();
        b[8] = 8;
        assert!(Header::decode(&b).unwrap_err().contains("unknown flags"));
        let mut b = REQ.encode();
        b[15] = 1;
        assert!(Header::decode(&b).is_err());
        assert!(Header::decode(&b[..HDR - 1])
            .unwrap_err()
            .contains("shorter"));
    }

    /// A lone fragment is its message (not copied); fragments of two
    /// messages interleaved come back each whole, in order; a request and
    /// an answer with one tag are two messages.
    #[test]
    fn fragments_make_their_messages_whole() {
        let mut r = Reassembly::default();
        let lone = frag(Header { last: true, ..REQ }, b"hello");
        match r.take(&lone).unwrap() {
            Some((h, Cow::Borrowed(m))) => {
                assert_eq!(m, b"hello");
                assert!(h.last && !h.answer);
            }
            other => panic!("{other:?}"),
        }
        let ans = Header {
            answer: true,
            ..REQ
        };
        assert!(r.take(&frag(REQ, b"ab")).unwrap().is_none());
        assert!(r.take(&frag(ans, b"12")).unwrap().is_none());
        assert!(r.take(&frag(REQ, b"cd")).unwrap().is_none());
        let f = frag(Header { last: true, ..ans }, b"3");
        let (h, m) = r.take(&f).unwrap().unwrap();
        assert!(h.answer);
        assert_eq!(&*m, b"123");
        let f = frag(Header { last: true, ..REQ }, b"e");
        let (h, m) = r.take(&f).unwrap().unwrap();
        assert!(!h.answer);
        assert_eq!(&*m, b"abcde");
        assert!(r.partial.is_empty());
    }

    #[test]
    fn a_message_too_long_or_too_many_begun_break_the_channel() {
        let mut r = Reassembly::default();
        let big = vec![0u8; SLOT - HDR];
        let mut err = None;
        for _ in 0..=MAX_MESSAGE / big.len() {
            if let Err(e) = r.take(&frag(REQ, &big)) {
                err = Some(e);
                break;
            }
        }
        assert!(err.unwrap().contains("more than"));
        let mut r = Reassembly::default();
        for tag in 0..MAX_PARTIAL as u64 {
            assert!(r
                .take(&frag(Header { tag, ..REQ }, b"x"))
                .unwrap()
                .is_none());
        }
        let e = r.take(&frag(Header { tag: 999, ..REQ }, b"x")).unwrap_err();
        assert!(e.contains("begun at once"), "{e}");
        // One already begun goes on.
        assert!(r
            .take(&frag(Header { tag: 3, ..REQ }, b"y"))
            .unwrap()
            .is_none());
    }
}
