//! The passive side: executes one-sided requests against a domain's
//! registrations, checking what a NIC checks.

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

use super::domain::{Entry, TcpDomain};
use super::wire::{Hello, Op, Request, Response, Status, KEY_LEN, MAX_MESSAGE, REQ_LEN};
use super::SOCKET_BUF;
use crate::provider::{Endpoint, ProviderError};

struct Shared {
    /// Serves connections that open without a [`Hello`] (none: such a
    /// connection reaches no registration).
    default: Option<Arc<TcpDomain>>,
    /// Session key -> the session's domain (see [`TcpTarget::bind_session`]).
    sessions: Mutex<HashMap<[u8; KEY_LEN], Weak<TcpDomain>>>,
    stop: AtomicBool,
    /// Live connections (clones used only to shut them down).
    conns: Mutex<HashMap<u64, TcpStream>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

/// Serves one-sided WRITE/READ requests on a TCP listener until dropped or
/// [`TcpTarget::shutdown`].
pub struct TcpTarget {
    shared: Arc<Shared>,
    addr: SocketAddr,
    acceptor: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for TcpTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTarget")
            .field("addr", &self.addr)
            .finish()
    }
}

impl TcpTarget {
    /// Listen on `addr` (port 0 for an ephemeral port) and serve requests
    /// against `domain`'s registrations in background threads. Connections
    /// that open with a session [`Hello`] are served against that session's
    /// domain instead (see [`TcpTarget::bind_session`]).
    pub fn bind(
        domain: Arc<TcpDomain>,
        addr: impl ToSocketAddrs,
    ) -> Result<TcpTarget, ProviderError> {
        Self::listen(Some(domain), addr)
    }

    /// Like [`TcpTarget::bind`] with no default domain: only connections
    /// bound to a session reach any registration (rcpd: one domain per
    /// session, so an rkey works only on the connections of the session it
    /// was granted to).
    pub fn bind_sessions(addr: impl ToSocketAddrs) -> Result<TcpTarget, ProviderError> {
        Self::listen(None, addr)
    }

    fn listen(
        default: Option<Arc<TcpDomain>>,
        addr: impl ToSocketAddrs,
    ) -> Result<TcpTarget, ProviderError> {
        let listener = TcpListener::bind(addr).map_err(|source| ProviderError::Io {
            context: "binding the TCP target".into(),
            source,
        })?;
        let addr = listener.local_addr().map_err(|source| ProviderError::Io {
            context: "local address of the TCP target".into(),
            source,
        })?;
        let shared = Arc::new(Shared {
            default,
            sessions: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            workers: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        let acceptor = std::thread::Builder::new()
            .name("rcp-tcp-accept".into())
            .spawn(move || accept_loop(s, listener))
            .map_err(|source| ProviderError::Io {
                context: "spawning the TCP target's accept thread".into(),
                source,
            })?;
        tracing::debug!(%addr, "tcp target listening");
        Ok(TcpTarget {
            shared,
            addr,
            acceptor: Some(acceptor),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// What a peer connects to (for the control plane).
    pub fn endpoint(&self) -> Endpoint {
        Endpoint::Tcp(self.addr)
    }

    /// A fresh random key for `domain`: connections that send it in their
    /// [`Hello`] are served against `domain` (and nothing else) until the
    /// binding is dropped; the target keeps only a weak reference, so the
    /// domain's registrations die with their owner.
    pub fn bind_session(&self, domain: &Arc<TcpDomain>) -> Result<SessionBinding, ProviderError> {
        let mut sessions = self
            .shared
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let key = loop {
            let mut k = [0u8; KEY_LEN];
            getrandom::getrandom(&mut k).map_err(|e| ProviderError::Io {
                context: "drawing a session key".into(),
                source: io::Error::other(e.to_string()),
            })?;
            if !sessions.contains_key(&k) {
                break k;
            }
        };
        sessions.insert(key, Arc::downgrade(domain));
        Ok(SessionBinding {
            key,
            shared: Arc::downgrade(&self.shared),
        })
    }

    /// Connections being served right now.
    pub fn connections(&self) -> usize {
        self.shared.conns.lock().map(|c| c.len()).unwrap_or(0)
    }

    /// Stop accepting, cut every connection and wait for the threads.
    pub fn shutdown(&mut self) {
        let Some(acceptor) = self.acceptor.take() else {
            return;
        };
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept with a connection of our own.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let _ = TcpStream::connect(wake);
        let _ = acceptor.join();
        for (_, c) in self
            .shared
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
        {
            let _ = c.shutdown(Shutdown::Both);
        }
        let workers = std::mem::take(
            &mut *self
                .shared
                .workers
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        for w in workers {
            let _ = w.join();
        }
        tracing::debug!(addr = %self.addr, "tcp target stopped");
    }
}

/// A session key registered with a [`TcpTarget`]; dropping it unbinds the
/// key (connections opened later with it reach nothing).
pub struct SessionBinding {
    key: [u8; KEY_LEN],
    shared: Weak<Shared>,
}

impl SessionBinding {
    /// What the session's client sends in its [`Hello`].
    pub fn key(&self) -> [u8; KEY_LEN] {
        self.key
    }
}

impl std::fmt::Debug for SessionBinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionBinding(..)")
    }
}

impl Drop for SessionBinding {
    fn drop(&mut self) {
        if let Some(s) = self.shared.upgrade() {
            s.sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&self.key);
        }
    }
}

impl Drop for TcpTarget {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let mut next_id = 0u64;
    loop {
        let accepted = listener.accept();
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "tcp target: accept failed");
                // Transient (EMFILE, ECONNABORTED): don't spin.
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        };
        let id = next_id;
        next_id += 1;
        let _ = stream.set_nodelay(true);
        match stream.try_clone() {
            Ok(c) => {
                shared
                    .conns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id, c);
            }
            Err(e) => {
                tracing::warn!(%peer, error = %e, "tcp target: cannot clone the socket; dropping it");
                continue;
            }
        }
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("rcp-tcp-target".into())
            .spawn(move || {
                match serve(&s, stream) {
                    Ok(()) => tracing::debug!(%peer, "tcp target: connection closed"),
                    Err(e) => tracing::error!(%peer, error = %e, "tcp target: connection dropped"),
                }
                s.conns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&id);
            });
        let mut workers = shared.workers.lock().unwrap_or_else(|e| e.into_inner());
        workers.retain(|w| !w.is_finished());
        match spawned {
            Ok(h) => workers.push(h),
            Err(e) => {
                tracing::error!(%peer, error = %e, "tcp target: cannot spawn a connection thread");
                if let Some(c) = shared
                    .conns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&id)
                {
                    let _ = c.shutdown(Shutdown::Both);
                }
            }
        }
    }
}

/// Why a connection was dropped.
#[derive(Debug, thiserror::Error)]
enum ServeError {
    #[error("malformed request: {0}")]
    Wire(#[from] super::wire::WireError),
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Check a request against the registration table like a NIC: the rkey
/// exists in the connection's domain, the range lies inside, the right is
/// granted.
fn authorize(domain: &Weak<TcpDomain>, req: &Request) -> Option<(Arc<Entry>, usize)> {
    let entry = domain.upgrade()?.by_rkey(req.rkey)?;
    let right = match req.op {
        Op::Write => entry.access.remote_write(),
        Op::Read => entry.access.remote_read(),
        Op::Message => false,
    };
    if !right {
        return None;
    }
    let off = entry.offset_of(req.addr, u64::from(req.len))?;
    Some((entry, off))
}

/// Read exactly `buf.len()` bytes; `Ok(false)` on a clean EOF before the first.
fn read_header(r: &mut impl Read, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Below this many bytes still to come, a payload is read through the
/// connection's buffer (one read may bring the requests after it too).
const DIRECT_READ: usize = 32 << 10;

/// Fill `buf` with the payload that follows: what the connection's buffer
/// holds first, the rest straight from the socket when it is large (not
/// through the buffer, which would copy it a second time).
fn read_payload(reader: &mut BufReader<TcpStream>, buf: &mut [u8]) -> io::Result<()> {
    let have = reader.buffer();
    let n = have.len().min(buf.len());
    buf[..n].copy_from_slice(&have[..n]);
    reader.consume(n);
    let rest = &mut buf[n..];
    if rest.len() >= DIRECT_READ {
        reader.get_mut().read_exact(rest)
    } else {
        reader.read_exact(rest)
    }
}

/// `buf` holds the next request whole (its header and any payload it
/// carries): it runs without reading the socket.
fn next_is_buffered(buf: &[u8]) -> bool {
    let Some(hdr) = buf.first_chunk::<REQ_LEN>() else {
        return false;
    };
    match Request::decode(hdr) {
        Ok(r) if r.op == Op::Read => true,
        Ok(r) => buf.len() - REQ_LEN >= r.len as usize,
        Err(_) => false,
    }
}

fn discard(r: &mut impl Read, n: u32) -> io::Result<()> {
    let copied = io::copy(&mut r.take(u64::from(n)), &mut io::sink())?;
    if copied < u64::from(n) {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

fn out_of_range() -> io::Error {
    io::Error::other("registration range changed under a request")
}

/// Work of answers in the writer's buffer, run once they are sent: after
/// the next flush, or when the connection ends (sent or not, as the
/// answers' takers would have run it before answering).
#[derive(Default)]
struct AfterSent(Vec<Box<dyn FnOnce() + Send>>);

impl AfterSent {
    fn run(&mut self) {
        for f in self.0.drain(..) {
            f();
        }
    }
}

impl Drop for AfterSent {
    fn drop(&mut self) {
        self.run();
    }
}

/// A MESSAGE: its payload to whoever takes the session's messages, their
/// answer back (status 2 when no one does; the connection goes on); what
/// the taker left for after the answer goes to `after`.
fn message(
    domain: &Weak<TcpDomain>,
    req: &Request,
    reader: &mut impl Read,
    writer: &mut impl Write,
    after: &mut AfterSent,
) -> Result<(), ServeError> {
    if req.len > MAX_MESSAGE {
        return Err(super::wire::WireError::TooLong(req.len).into());
    }
    let mut payload = vec![0u8; req.len as usize];
    reader.read_exact(&mut payload)?;
    let Some(taker) = domain.upgrade().and_then(|d| d.messages()) else {
        let resp = Response {
            status: Status::NoMessages,
            tag: req.tag,
            len: 0,
        };
        writer.write_all(&resp.encode())?;
        return Ok(());
    };
    let answer = taker.message(&payload);
    after.0.extend(answer.then);
    let answer = answer.bytes;
    let len = u32::try_from(answer.len())
        .ok()
        .filter(|&l| l <= MAX_MESSAGE)
        .ok_or_else(|| io::Error::other(format!("an answer of {} bytes", answer.len())))?;
    let resp = Response {
        status: Status::Ok,
        tag: req.tag,
        len,
    };
    writer.write_all(&resp.encode())?;
    writer.write_all(&answer)?;
    Ok(())
}

/// Execute an authorized WRITE or READ at `off` of `entry`, answering it
/// into `writer`.
fn execute(
    entry: &Entry,
    off: usize,
    req: &Request,
    reader: &mut BufReader<TcpStream>,
    writer: &mut BufWriter<TcpStream>,
) -> io::Result<()> {
    let n = req.len as usize;
    match req.op {
        Op::Write => {
            // Straight from the socket into registered memory.
            // SAFETY: this is the emulated NIC writing memory its owner
            // registered with REMOTE_WRITE (checked in `authorize`):
            // registering a span for remote access lends it to the peers
            // holding the rkey until the registration is dropped, exactly as
            // with a real device, and the owner's protocol leaves a granted
            // window alone. Only this connection's thread executes this
            // request.
            unsafe { entry.span.with_mut(off, n, |buf| read_payload(reader, buf)) }
                .unwrap_or_else(|| Err(out_of_range()))?;
            let resp = Response {
                status: Status::Ok,
                tag: req.tag,
                len: 0,
            };
            writer.write_all(&resp.encode())
        }
        Op::Message => unreachable!("messages are served before authorize"),
        Op::Read => {
            let resp = Response {
                status: Status::Ok,
                tag: req.tag,
                len: req.len,
            };
            writer.write_all(&resp.encode())?;
            // Straight from registered memory into the socket.
            entry
                .span
                .with(off, n, |buf| writer.write_all(buf))
                .unwrap_or_else(|| Err(out_of_range()))
        }
    }
}

fn serve(shared: &Shared, stream: TcpStream) -> Result<(), ServeError> {
    // Before the writer: dropped after it, whose drop sends what it holds.
    let mut after = AfterSent::default();
    let mut reader = BufReader::with_capacity(SOCKET_BUF, stream.try_clone()?);
    let mut writer = BufWriter::with_capacity(SOCKET_BUF, stream);
    // After an access error the connection is in the error state (an RC QP's
    // ERR): later requests are consumed but neither executed nor answered;
    // the initiator flushes them itself.
    let mut errored = false;
    let mut hdr = [0u8; REQ_LEN];
    // The connection's domain (a QP's protection domain): the session named
    // by its first header, else the default. Unknown session: nothing.
    let mut domain = shared
        .default
        .as_ref()
        .map(Arc::downgrade)
        .unwrap_or_default();
    let mut first = true;
    // An answer the initiator waits on is in the writer's buffer.
    let mut prompt = false;
    loop {
        if !read_header(&mut reader, &mut hdr)? {
            writer.flush()?;
            return Ok(());
        }
        if first {
            first = false;
            if let Some(hello) = Hello::decode(&hdr) {
                let key = hello?.key;
                domain = shared
                    .sessions
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&key)
                    .cloned()
                    .unwrap_or_default();
                if domain.strong_count() == 0 {
                    tracing::warn!("tcp target: a connection named an unknown session");
                }
                continue;
            }
        }
        let req = Request::decode(&hdr)?;
        // A MESSAGE's answer is always waited on (a peer before the flag).
        prompt |= req.prompt || req.op == Op::Message;
        if errored {
            if req.op != Op::Read {
                discard(&mut reader, req.len)?;
            }
            continue;
        }
        if req.op == Op::Message {
            message(&domain, &req, &mut reader, &mut writer, &mut after)?;
        } else {
            match authorize(&domain, &req) {
                None => {
                    tracing::warn!(
                        op = ?req.op, addr = format_args!("{:#x}", req.addr), rkey = format_args!("{:#x}", req.rkey),
                        len = req.len, "tcp target: remote access error"
                    );
                    if req.op == Op::Write {
                        discard(&mut reader, req.len)?;
                    }
                    let resp = Response {
                        status: Status::RemoteAccess,
                        tag: req.tag,
                        len: 0,
                    };
                    writer.write_all(&resp.encode())?;
                    writer.flush()?;
                    errored = true;
                    continue;
                }
                Some((entry, off)) => execute(&entry, off, &req, &mut reader, &mut writer)?,
            }
        }
        // Answer at a pause, and before the next request could wait on
        // the socket when an answer is waited on: a stream of WRITEs keeps
        // part of the next one buffered, so with pauses only a window that
        // landed would be told only with the windows after it.
        let buffered = reader.buffer();
        if buffered.is_empty() || (prompt && !next_is_buffered(buffered)) {
            writer.flush()?;
            prompt = false;
            after.run();
        }
    }
}
