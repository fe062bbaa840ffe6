//! The active side: a channel of several TCP connections with RC completion
//! semantics.
//!
//! Like a NIC's send queue, `post` only queues: each connection has a
//! sending thread (`rcp-tcp-tx{c}`) that copies the requests and their
//! WRITE payloads into its socket, and a reader (`rcp-tcp-cq{c}`) that takes
//! the target's answers. A post that waited for the socket would hold the
//! poster (the data path's thread that also takes completions) for as long
//! as the link needs to carry the chain: a window that landed would be
//! reported only once the next one had been written out (docs/fanout.md).

use std::collections::{BTreeMap, VecDeque};
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::domain::{Entry, TcpDomain};
use super::wire::{Hello, Op, Request, Response, Status, KEY_LEN, MAX_LEN, REQ_LEN, RESP_LEN};
use super::{write_gathered, SOCKET_BUF};
use crate::engine::{OpKind, WcStatus, WorkCompletion, WorkRequest};
use crate::provider::{
    Access, Channel, ChannelCaps, Endpoint, PostFailure, ProviderError, ProviderKind,
};

/// TCP connections per channel unless told otherwise.
pub const DEFAULT_CONNS: usize = 4;

/// A chain carrying at least this many payload bytes is split over the
/// connections; smaller chains go whole to one connection.
const SPLIT_BYTES: u64 = 256 << 10;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// One posted request as the channel tracks it until it is retired.
struct Posted {
    wr_id: u64,
    signaled: bool,
    /// The target acknowledged it (and its READ payload has landed).
    done: bool,
    byte_len: u32,
    /// `post` is still copying its WRITE payload out of local memory.
    sending: bool,
    /// A reader is copying its READ payload into local memory.
    landing: bool,
}

impl Posted {
    /// Local memory is being touched: no completion may hand the buffer
    /// back to the caller yet.
    fn busy(&self) -> bool {
        self.sending || self.landing
    }
}

struct State {
    next_seq: u64,
    /// Outstanding requests by post sequence number. The first entry is the
    /// oldest not yet acknowledged: everything before it has succeeded.
    slots: BTreeMap<u64, Posted>,
    /// The channel is in the error state (like an RC QP in ERR).
    broken: bool,
    /// Why the channel broke, when no request could carry it at the time:
    /// the next request flushed carries it instead of `Flushed`.
    cause: Option<WcStatus>,
    cq: VecDeque<WorkCompletion>,
    /// [`Channel::wake`] was called and no `wait` has returned since.
    woken: bool,
}

/// What a reader needs to know about a request, in wire order per connection.
struct Pending {
    seq: u64,
    /// READ destination: local registration, offset, length.
    dest: Option<(Arc<Entry>, usize, u32)>,
}

/// One request for a connection's sending thread: its header and, for a
/// WRITE, where its payload is (local registration, offset, length).
struct TxItem {
    seq: u64,
    header: [u8; REQ_LEN],
    payload: Option<(Arc<Entry>, usize, usize)>,
}

/// A connection's send queue: parts of chains in post order.
#[derive(Default)]
struct TxQueue {
    parts: VecDeque<Vec<TxItem>>,
    closing: bool,
}

#[derive(Default)]
struct Tx {
    queue: Mutex<TxQueue>,
    cv: Condvar,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    fifos: Vec<Mutex<VecDeque<Pending>>>,
    /// Clones of the connections, to cut them on error or drop.
    sockets: Vec<TcpStream>,
    closing: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn wc(wr_id: u64, status: WcStatus, byte_len: u32) -> WorkCompletion {
    WorkCompletion {
        wr_id,
        status,
        byte_len,
    }
}

impl Shared {
    /// Record a successful acknowledgement and report every signaled
    /// completion that no earlier outstanding request holds back.
    fn complete_ok(&self, st: &mut State, seq: u64, byte_len: u32) {
        if let Some(s) = st.slots.get_mut(&seq) {
            s.done = true;
            s.byte_len = byte_len;
        }
        let mut pushed = false;
        while let Some(first) = st.slots.first_entry() {
            if !first.get().done {
                break;
            }
            let s = first.remove();
            if s.signaled {
                st.cq.push_back(wc(s.wr_id, WcStatus::Success, s.byte_len));
                pushed = true;
            }
        }
        if pushed {
            self.cv.notify_all();
        }
    }

    /// Report `culprit` and, on the first error, put the channel in the
    /// error state: every other outstanding request is flushed (those whose
    /// local memory is being copied right now are flushed by whoever copies
    /// it, once done: see [`Posted::busy`]) and the connections are cut.
    fn fail(&self, st: &mut State, culprit: Option<WorkCompletion>) {
        if let Some(c) = culprit {
            st.cq.push_back(c);
        }
        if !st.broken {
            st.broken = true;
            if let Some(c) = culprit {
                tracing::warn!(
                    wr_id = c.wr_id,
                    status = c.status.label(),
                    "tcp channel: error, flushing"
                );
            }
            let flush: Vec<u64> = st
                .slots
                .iter()
                .filter(|(_, s)| !s.busy())
                .map(|(&k, _)| k)
                .collect();
            for k in flush {
                if let Some(s) = st.slots.remove(&k) {
                    let status = st.cause.take().unwrap_or(WcStatus::Flushed);
                    st.cq.push_back(wc(s.wr_id, status, 0));
                }
            }
            for s in &self.sockets {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        self.cv.notify_all();
    }

    /// In the error state, flush `seq` once nothing touches its memory.
    fn flush_if_idle(&self, st: &mut State, seq: u64) {
        if st.slots.get(&seq).is_some_and(|s| !s.busy()) {
            if let Some(s) = st.slots.remove(&seq) {
                let status = st.cause.take().unwrap_or(WcStatus::Flushed);
                st.cq.push_back(wc(s.wr_id, status, 0));
                self.cv.notify_all();
            }
        }
    }

    /// The sending thread is done with the local memory of `seqs`.
    fn sent(&self, seqs: impl Iterator<Item = u64>) {
        let mut st = lock(&self.state);
        for k in seqs {
            if let Some(s) = st.slots.get_mut(&k) {
                s.sending = false;
            }
            if st.broken {
                self.flush_if_idle(&mut st, k);
            }
        }
    }

    /// Connection `c` ended or spoke garbage: its oldest request in flight
    /// (if any) fails with `status`, the channel goes to the error state.
    fn conn_died(
        &self,
        c: usize,
        popped: Option<u64>,
        status: WcStatus,
        why: &dyn std::fmt::Display,
    ) {
        if self.closing.load(Ordering::SeqCst) {
            return;
        }
        let seq = popped.or_else(|| lock(&self.fifos[c]).front().map(|p| p.seq));
        let mut st = lock(&self.state);
        if st.broken {
            return;
        }
        tracing::warn!(conn = c, error = %why, "tcp channel: connection lost");
        // The request in flight on that connection carries the error; if it
        // has none (or its memory is still being copied), the next request
        // flushed does, oldest first, so the cause is never lost in flushes.
        let culprit = seq
            .filter(|k| st.slots.get(k).is_some_and(|s| !s.busy()))
            .and_then(|k| st.slots.remove(&k))
            .map(|s| wc(s.wr_id, status, 0));
        if culprit.is_none() {
            st.cause = Some(status);
        }
        self.fail(&mut st, culprit);
    }
}

/// A connected TCP channel: `conns` connections to one [`super::TcpTarget`].
pub struct TcpChannel {
    shared: Arc<Shared>,
    domain: Arc<TcpDomain>,
    /// Each connection's send queue, served by its sending thread.
    txs: Vec<Arc<Tx>>,
    /// Serializes posts (and holds the round-robin cursor) so sequence
    /// numbers and per-connection wire order agree.
    post_lock: Mutex<usize>,
    /// The connections' readers and sending threads.
    threads: Vec<JoinHandle<()>>,
    caps: ChannelCaps,
    peer: SocketAddr,
}

impl std::fmt::Debug for TcpChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpChannel")
            .field("peer", &self.peer)
            .field("conns", &self.txs.len())
            .field("caps", &self.caps)
            .finish()
    }
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> ProviderError {
    let context = context.into();
    move |source| ProviderError::Io { context, source }
}

impl TcpChannel {
    /// Open `conns` TCP connections to the target at `addr`. Local segments
    /// of posted requests are looked up by lkey in `domain`.
    pub fn connect(
        domain: Arc<TcpDomain>,
        addr: SocketAddr,
        conns: usize,
        sq_depth: u32,
    ) -> Result<TcpChannel, ProviderError> {
        Self::connect_session(domain, addr, conns, sq_depth, None)
    }

    /// [`TcpChannel::connect`], every connection opening with a [`Hello`]
    /// carrying `key` when given: the target then serves it against that
    /// session's registrations only (see `TcpTarget::bind_session`).
    pub fn connect_session(
        domain: Arc<TcpDomain>,
        addr: SocketAddr,
        conns: usize,
        sq_depth: u32,
        key: Option<[u8; KEY_LEN]>,
    ) -> Result<TcpChannel, ProviderError> {
        if conns == 0 || sq_depth == 0 {
            return Err(ProviderError::Protocol(format!(
                "a TCP channel needs at least one connection and a send-queue depth > 0 \
                 (got {conns} connections, depth {sq_depth})"
            )));
        }
        let mut streams = Vec::with_capacity(conns);
        for i in 0..conns {
            let s = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).map_err(io_err(format!(
                "connecting TCP channel {i}/{conns} to {addr}"
            )))?;
            s.set_nodelay(true).map_err(io_err("setting TCP_NODELAY"))?;
            if let Some(key) = key {
                (&s).write_all(&Hello { key }.encode())
                    .map_err(io_err(format!("greeting the target on connection {i}")))?;
            }
            streams.push(s);
        }
        let mut sockets = Vec::with_capacity(conns);
        let mut readers_in = Vec::with_capacity(conns);
        for s in &streams {
            sockets.push(s.try_clone().map_err(io_err("cloning a socket"))?);
            readers_in.push(s.try_clone().map_err(io_err("cloning a socket"))?);
        }
        let txs: Vec<Arc<Tx>> = (0..conns).map(|_| Arc::default()).collect();
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                next_seq: 0,
                slots: BTreeMap::new(),
                broken: false,
                cause: None,
                cq: VecDeque::new(),
                woken: false,
            }),
            cv: Condvar::new(),
            fifos: (0..conns).map(|_| Mutex::new(VecDeque::new())).collect(),
            sockets,
            closing: AtomicBool::new(false),
        });
        let mut threads = Vec::with_capacity(2 * conns);
        let ends = readers_in.into_iter().zip(streams).enumerate();
        for (c, (r, w)) in ends {
            let (sh, sh2, tx) = (shared.clone(), shared.clone(), txs[c].clone());
            let h = std::thread::Builder::new()
                .name(format!("rcp-tcp-cq{c}"))
                .spawn(move || reader_loop(&sh, c, r))
                .and_then(|h| {
                    threads.push(h);
                    std::thread::Builder::new()
                        .name(format!("rcp-tcp-tx{c}"))
                        .spawn(move || sender_loop(&sh2, &tx, c, w))
                });
            match h {
                Ok(h) => threads.push(h),
                Err(e) => {
                    stop(&shared, &txs, threads);
                    return Err(io_err("spawning a TCP channel thread")(e));
                }
            }
        }
        Ok(TcpChannel {
            shared,
            domain,
            txs,
            post_lock: Mutex::new(0),
            threads,
            caps: ChannelCaps {
                sq_depth,
                // Every write is copied into the socket from its
                // registration; without an lkey there is no safe way to
                // reach the bytes: no inline.
                max_inline: 0,
                max_sge: 1,
            },
            peer: addr,
        })
    }

    /// [`TcpChannel::connect`] to an [`Endpoint::Tcp`].
    pub fn connect_endpoint(
        domain: Arc<TcpDomain>,
        ep: &Endpoint,
        conns: usize,
        sq_depth: u32,
    ) -> Result<TcpChannel, ProviderError> {
        match ep {
            Endpoint::Tcp(addr) => TcpChannel::connect(domain, *addr, conns, sq_depth),
            other => Err(ProviderError::Protocol(format!(
                "the TCP provider cannot connect to {other:?}"
            ))),
        }
    }

    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    pub fn connections(&self) -> usize {
        self.txs.len()
    }

    /// Requests posted and not yet retired.
    pub fn outstanding(&self) -> usize {
        lock(&self.shared.state).slots.len()
    }

    /// The channel is in the error state (every post is flushed).
    pub fn is_broken(&self) -> bool {
        lock(&self.shared.state).broken
    }

    /// Find the local segment: lkey known, range inside, LOCAL_WRITE for a
    /// READ destination.
    fn resolve(&self, wr: &WorkRequest) -> Result<(Arc<Entry>, usize), WcStatus> {
        if wr.local.len > MAX_LEN {
            return Err(WcStatus::LocalLength);
        }
        let e = self
            .domain
            .by_lkey(wr.local.lkey)
            .ok_or(WcStatus::LocalProtection)?;
        if wr.kind == OpKind::Read && !e.access.contains(Access::LOCAL_WRITE) {
            return Err(WcStatus::LocalProtection);
        }
        let off = e
            .offset_of(wr.local.addr, u64::from(wr.local.len))
            .ok_or(WcStatus::LocalProtection)?;
        Ok((e, off))
    }

    /// Queue `part` (with its sequence numbers) for connection `c`'s
    /// sending thread, which writes it as one buffered send.
    fn send(&self, c: usize, part: &[(u64, &WorkRequest, Arc<Entry>, usize)]) {
        {
            let mut fifo = lock(&self.shared.fifos[c]);
            for (seq, wr, e, off) in part {
                fifo.push_back(Pending {
                    seq: *seq,
                    dest: (wr.kind == OpKind::Read).then(|| (e.clone(), *off, wr.local.len)),
                });
            }
        }
        let items = part
            .iter()
            .map(|(seq, wr, e, off)| TxItem {
                seq: *seq,
                header: Request {
                    op: match wr.kind {
                        OpKind::Write => Op::Write,
                        OpKind::Read => Op::Read,
                    },
                    tag: *seq,
                    addr: wr.remote.addr,
                    rkey: wr.remote.rkey,
                    len: wr.local.len,
                    // A completion will be reported for it.
                    prompt: wr.signaled,
                }
                .encode(),
                payload: (wr.kind == OpKind::Write)
                    .then(|| (e.clone(), *off, wr.local.len as usize)),
            })
            .collect();
        let tx = &self.txs[c];
        lock(&tx.queue).parts.push_back(items);
        tx.cv.notify_one();
    }
}

/// Stop a channel's threads: the readers see their sockets shut, the
/// sending threads their queues closing (what is still queued is never
/// sent: its memory is released as sent, the channel being closed).
fn stop(shared: &Shared, txs: &[Arc<Tx>], threads: Vec<JoinHandle<()>>) {
    shared.closing.store(true, Ordering::SeqCst);
    for s in &shared.sockets {
        let _ = s.shutdown(Shutdown::Both);
    }
    for tx in txs {
        lock(&tx.queue).closing = true;
        tx.cv.notify_all();
    }
    for h in threads {
        let _ = h.join();
    }
}

/// Connection `c`'s sending thread: the parts queued meanwhile, headers and
/// WRITE payloads gathered into `writev`s (no copy of ours, one call per
/// [`super::MAX_IOV`] slices however many chains queued), in post order.
/// Their memory is released ([`Shared::sent`]) once their bytes are out of
/// it; on a write error the first of them is the culprit and the
/// connection is cut.
fn sender_loop(sh: &Shared, tx: &Tx, c: usize, mut stream: TcpStream) {
    loop {
        let (parts, closing) = {
            let mut q = lock(&tx.queue);
            while q.parts.is_empty() && !q.closing {
                q = tx.cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            (std::mem::take(&mut q.parts), q.closing)
        };
        let seqs = || parts.iter().flatten().map(|i| i.seq);
        if closing {
            sh.sent(seqs());
            return;
        }
        let res = (|| -> io::Result<()> {
            // Straight from registered memory into the socket: the
            // requests are not retired (nor their memory handed back)
            // before `sent` below.
            let mut iov = Vec::with_capacity(2 * parts.iter().map(Vec::len).sum::<usize>());
            for i in parts.iter().flatten() {
                iov.push(IoSlice::new(&i.header));
                if let Some((e, off, len)) = &i.payload {
                    let bytes = e
                        .span
                        .slice(*off, *len)
                        .ok_or_else(|| io::Error::other("local range changed"))?;
                    iov.push(IoSlice::new(bytes));
                }
            }
            write_gathered(&mut stream, &mut iov)
        })();
        if res.is_err() {
            // The connection is finished.
            let _ = stream.shutdown(Shutdown::Both);
        }
        sh.sent(seqs());
        if let Err(e) = res {
            sh.conn_died(c, seqs().next(), WcStatus::Fatal, &e);
        }
    }
}

impl Channel for TcpChannel {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Tcp
    }

    fn caps(&self) -> ChannelCaps {
        self.caps
    }

    /// # Safety
    ///
    /// As [`Channel::post`]: the local segment of every request is
    /// registered in this channel's domain and left to the channel until the
    /// request is retired. WRITE payloads are copied out of it by the
    /// connection's sending thread, which releases the request
    /// (`Posted::busy`) only after; READ payloads are copied into it by a
    /// reader thread, before
    /// the completion that retires the request is reported (a request whose
    /// payload is still landing is never flushed early: `Posted::busy`).
    unsafe fn post(&self, wrs: &[WorkRequest]) -> Result<(), PostFailure> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut rr = lock(&self.post_lock);
        // Resolve local segments; stop at the first bad one.
        let mut ok = Vec::with_capacity(wrs.len());
        let mut bad = None;
        for wr in wrs {
            match self.resolve(wr) {
                Ok((e, off)) => ok.push((wr, e, off)),
                Err(status) => {
                    bad = Some(status);
                    break;
                }
            }
        }
        let first_seq = {
            let mut st = lock(&self.shared.state);
            if st.broken {
                for wr in wrs {
                    let status = st.cause.take().unwrap_or(WcStatus::Flushed);
                    st.cq.push_back(wc(wr.wr_id, status, 0));
                }
                self.shared.cv.notify_all();
                return Ok(());
            }
            let depth = self.caps.sq_depth as usize;
            if st.slots.len() + wrs.len() > depth {
                return Err(PostFailure {
                    posted: 0,
                    error: ProviderError::Protocol(format!(
                        "send queue full: {} outstanding + {} posted > depth {depth}",
                        st.slots.len(),
                        wrs.len()
                    )),
                });
            }
            let first = st.next_seq;
            st.next_seq += ok.len() as u64;
            for (i, (wr, _, _)) in ok.iter().enumerate() {
                st.slots.insert(
                    first + i as u64,
                    Posted {
                        wr_id: wr.wr_id,
                        signaled: wr.signaled,
                        done: false,
                        byte_len: 0,
                        sending: true,
                        landing: false,
                    },
                );
            }
            first
        };
        let items: Vec<_> = ok
            .into_iter()
            .enumerate()
            .map(|(i, (wr, e, off))| (first_seq + i as u64, wr, e, off))
            .collect();
        if !items.is_empty() {
            let n = items.len();
            let conns = self.txs.len();
            let bytes: u64 = items
                .iter()
                .map(|(_, wr, _, _)| u64::from(wr.local.len))
                .sum();
            let parts = if bytes >= SPLIT_BYTES {
                conns.min(n)
            } else {
                1
            };
            let mut start = 0;
            for p in 0..parts {
                let end = start + (n - start) / (parts - p);
                let c = (*rr + p) % conns;
                self.send(c, &items[start..end]);
                start = end;
            }
            *rr = (*rr + parts) % conns;
        }
        if let Some(status) = bad {
            // Like a local protection error on a QP: the bad request fails,
            // the channel goes to the error state, the rest is flushed.
            let i = items.len();
            let mut st = lock(&self.shared.state);
            self.shared.fail(&mut st, Some(wc(wrs[i].wr_id, status, 0)));
            for wr in &wrs[i + 1..] {
                st.cq.push_back(wc(wr.wr_id, WcStatus::Flushed, 0));
            }
        }
        Ok(())
    }

    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, ProviderError> {
        let mut st = lock(&self.shared.state);
        let n = out.len().min(st.cq.len());
        for (o, c) in out.iter_mut().zip(st.cq.drain(..n)) {
            *o = c;
        }
        Ok(n)
    }

    fn arm(&self) -> Result<(), ProviderError> {
        Ok(())
    }

    fn wait(&self, timeout: Duration) -> Result<bool, ProviderError> {
        let st = lock(&self.shared.state);
        let (mut st, _) = self
            .shared
            .cv
            .wait_timeout_while(st, timeout, |st| st.cq.is_empty() && !st.woken)
            .unwrap_or_else(|e| e.into_inner());
        st.woken = false;
        Ok(!st.cq.is_empty())
    }

    fn wake(&self) {
        lock(&self.shared.state).woken = true;
        self.shared.cv.notify_all();
    }
}

impl Drop for TcpChannel {
    fn drop(&mut self) {
        stop(&self.shared, &self.txs, std::mem::take(&mut self.threads));
    }
}

/// Read one response header; `Ok(None)` on EOF before its first byte.
fn read_response(r: &mut impl Read) -> io::Result<Option<[u8; RESP_LEN]>> {
    let mut b = [0u8; RESP_LEN];
    let mut got = 0;
    while got < RESP_LEN {
        match r.read(&mut b[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Some(b))
}

fn reader_loop(sh: &Shared, c: usize, stream: TcpStream) {
    let mut r = BufReader::with_capacity(SOCKET_BUF, stream);
    loop {
        let resp = match read_response(&mut r) {
            Ok(Some(b)) => match Response::decode(&b) {
                Ok(resp) => resp,
                Err(e) => return sh.conn_died(c, None, WcStatus::Fatal, &e),
            },
            Ok(None) => {
                return sh.conn_died(
                    c,
                    None,
                    WcStatus::RetryExceeded,
                    &"connection closed by the target",
                )
            }
            Err(e) => return sh.conn_died(c, None, WcStatus::RetryExceeded, &e),
        };
        let Some(p) = lock(&sh.fifos[c]).pop_front() else {
            return sh.conn_died(
                c,
                None,
                WcStatus::Fatal,
                &"a response with nothing in flight",
            );
        };
        if p.seq != resp.tag {
            let why = format!(
                "response for request {} while {} is in flight",
                resp.tag, p.seq
            );
            return sh.conn_died(c, Some(p.seq), WcStatus::Fatal, &why);
        }
        match (resp.status, p.dest) {
            (Status::NoMessages, _) => {
                let why = format!("request {}: answered as a message it was not", resp.tag);
                return sh.conn_died(c, Some(p.seq), WcStatus::Fatal, &why);
            }
            (Status::RemoteAccess, _) => {
                let mut st = lock(&sh.state);
                if st.broken {
                    // Another connection failed the channel first. Like a
                    // QP already in the error state, this WR is flushed, not
                    // counted as a second access error.
                    sh.flush_if_idle(&mut st, p.seq);
                    return;
                }
                let culprit = st
                    .slots
                    .remove(&p.seq)
                    .map(|s| wc(s.wr_id, WcStatus::RemoteAccess, 0));
                sh.fail(&mut st, culprit);
                // The target answers nothing more on this connection.
                return;
            }
            (Status::Ok, None) => {
                if resp.len != 0 {
                    let why = format!("a WRITE acknowledged with {} payload bytes", resp.len);
                    return sh.conn_died(c, Some(p.seq), WcStatus::Fatal, &why);
                }
                let mut st = lock(&sh.state);
                if st.broken {
                    return;
                }
                sh.complete_ok(&mut st, p.seq, 0);
            }
            (Status::Ok, Some((entry, off, len))) => {
                if resp.len != len {
                    let why = format!("a READ of {len} bytes answered with {}", resp.len);
                    return sh.conn_died(c, Some(p.seq), WcStatus::Fatal, &why);
                }
                {
                    let mut st = lock(&sh.state);
                    if st.broken {
                        return;
                    }
                    match st.slots.get_mut(&p.seq) {
                        Some(s) => s.landing = true,
                        None => return,
                    }
                }
                // Straight from the socket into registered memory.
                // SAFETY: these bytes are the local segment of request
                // `p.seq`, which the poster lent to this channel until its
                // completion (Channel::post's contract); that completion is
                // not reported while the slot is `landing`, and only this
                // reader lands payloads for this request.
                let res = unsafe { entry.span.with_mut(off, len as usize, |b| r.read_exact(b)) }
                    .unwrap_or_else(|| Err(io::Error::other("local range changed")));
                let mut st = lock(&sh.state);
                if let Some(s) = st.slots.get_mut(&p.seq) {
                    s.landing = false;
                }
                if st.broken {
                    sh.flush_if_idle(&mut st, p.seq);
                    return;
                }
                match res {
                    Ok(()) => sh.complete_ok(&mut st, p.seq, len),
                    Err(e) => {
                        drop(st);
                        return sh.conn_died(c, Some(p.seq), WcStatus::RetryExceeded, &e);
                    }
                }
            }
        }
    }
}
