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

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::Failure;
use crate::control::client::DataTarget;
use crate::control::error::Reason;
use crate::mem::memfd::LeasedRange;
use crate::proto;
use crate::provider::tcp::wire::{
    Hello, Op, Request, Response, Status, MAX_MESSAGE, REQ_LEN, RESP_LEN,
};

/// Connections kept open between calls.
const IDLE: usize = 8;

/// Writes at most this big (all ranges together) go on a connection of
/// their own with their notice ([`Frames::write_notify`]); larger ones
/// go through the data path's threads, which copy nothing.
pub const WRITE_MAX: u64 = 256 << 10;

/// A session's connections for notices and small writes.
pub struct Frames {
    target: DataTarget,
    /// A standing grant of the peer's said it takes notices so.
    taken: AtomicBool,
    /// Open between calls, each used by one call at a time.
    idle: Mutex<Vec<TcpStream>>,
    /// Writes on connections at once (more go through the data path).
    writes: Arc<Semaphore>,
    tag: AtomicU64,
    /// A call that gets no answer this long fails (retryable).
    timeout: Duration,
}

/// Why a write on a connection did not end with the notice's answer.
pub enum WriteFailed {
    /// The peer refused a WRITE (a remote access error: its standing
    /// grant is revoked); this connection is dropped, nothing else.
    Refused(String),
    Failed(Failure),
}

impl Frames {
    pub fn new(target: DataTarget, timeout: Duration) -> Frames {
        Frames {
            target,
            taken: AtomicBool::new(false),
            idle: Mutex::new(Vec::new()),
            writes: Arc::new(Semaphore::new(IDLE)),
            tag: AtomicU64::new(0),
            timeout,
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

    /// Leave to write `bytes` on a connection with the notice: the peer
    /// takes frames, the write is small, and a connection is free for it.
    pub fn may_write(&self, bytes: u64) -> Option<OwnedSemaphorePermit> {
        if !self.taken.load(Ordering::Relaxed) || bytes > WRITE_MAX {
            return None;
        }
        self.writes.clone().try_acquire_owned().ok()
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
        match self.exchange(out, &[], tag, peer).await {
            Ok(r) => Ok(r),
            Err(WriteFailed::Failed(f)) => Err(f),
            Err(WriteFailed::Refused(m)) => Err(Failure::new(
                Reason::Protocol,
                format!("peer {peer} broke the protocol: a notice frame: {m}"),
            )),
        }
    }

    /// Write each `(bytes, addr, rkey)` and then `notice` on one
    /// connection, in one send: the peer's target executes the WRITEs
    /// and then hands the notice to its check (ordered after them, as a
    /// SEND after WRITEs on an RC QP); the notice's answer.
    pub async fn write_notify(
        &self,
        _permit: OwnedSemaphorePermit,
        ranges: &[(&LeasedRange, u64, u32)],
        notice: proto::BufferNotice,
        peer: &str,
    ) -> Result<proto::BufferNotifyResponse, WriteFailed> {
        let msg = proto::BufferNotifyRequest {
            session_id: 0,
            ops: vec![notice],
            node: String::new(),
        }
        .encode_to_vec();
        let bytes: usize = ranges
            .iter()
            .map(|(r, _, _)| r.lease().len() as usize)
            .sum();
        let mut out = Vec::with_capacity(bytes + (ranges.len() + 1) * REQ_LEN + msg.len());
        let mut tags = Vec::with_capacity(ranges.len());
        for &(r, addr, rkey) in ranges {
            let tag = self.tag.fetch_add(1, Ordering::Relaxed);
            let req = Request {
                op: Op::Write,
                tag,
                addr,
                rkey,
                len: r.lease().len() as u32,
            };
            out.extend_from_slice(&req.encode());
            r.with(|b| out.extend_from_slice(b));
            tags.push(tag);
        }
        let tag = self.tag.fetch_add(1, Ordering::Relaxed);
        message(&mut out, tag, &msg);
        self.exchange(out, &tags, tag, peer).await
    }

    /// Send `out` on a free connection, take the answers to the WRITEs
    /// `writes` and then to the message `tag`.
    async fn exchange(
        &self,
        out: Vec<u8>,
        writes: &[u64],
        tag: u64,
        peer: &str,
    ) -> Result<proto::BufferNotifyResponse, WriteFailed> {
        let broke = |e: std::io::Error| {
            WriteFailed::Failed(Failure::new(
                Reason::Retryable,
                format!(
                    "peer {peer}: the notices' connection to {}: {e}",
                    self.target.0
                ),
            ))
        };
        let conn = self.idle.lock().unwrap().pop();
        let mut s = match conn {
            Some(s) => s,
            None => self.connect().await.map_err(broke)?,
        };
        let answer = tokio::time::timeout(self.timeout, async {
            s.write_all(&out).await?;
            for &w in writes {
                answer(&mut s, w, false).await?;
            }
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
                return Err(WriteFailed::Refused(
                    "a WRITE refused (a remote access error)".into(),
                ))
            }
            Err(Exchange::Broke(m)) => {
                return Err(WriteFailed::Failed(Failure::new(
                    Reason::Protocol,
                    format!("peer {peer} broke the protocol: a notice frame: {m}"),
                )))
            }
        };
        // The connection is in step again: kept for the next call.
        {
            let mut idle = self.idle.lock().unwrap();
            if idle.len() < IDLE {
                idle.push(s);
            }
        }
        let f = proto::BufferNotifyFrame::decode(bytes.as_slice()).map_err(|e| {
            WriteFailed::Failed(Failure::new(
                Reason::Protocol,
                format!("peer {peer} broke the protocol: a notice frame's answer: {e}"),
            ))
        })?;
        match f.response {
            Some(r) if f.error.is_empty() => Ok(r),
            _ => Err(WriteFailed::Failed(Failure::new(
                Reason::try_from(f.reason).unwrap_or(Reason::Other),
                format!("peer {peer}: {}", f.error),
            ))),
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

/// A MESSAGE request carrying `payload`, appended to `out`.
fn message(out: &mut Vec<u8>, tag: u64, payload: &[u8]) {
    let req = Request {
        op: Op::Message,
        tag,
        addr: 0,
        rkey: 0,
        len: payload.len() as u32,
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
