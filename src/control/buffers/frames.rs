//! Notices on the data path (protocol 2.6): on a tcp session whose peer
//! said so in its standing grants (`StandingGrant.frames`), a batch of
//! notices goes as one MESSAGE frame of the tcp provider
//! ([`crate::provider::tcp::wire`]) on a connection of the session (opened
//! with the session's key, like its data connections), and its answer
//! comes back on it: no gRPC call, no HTTP/2 stream, no task on either
//! side between the socket and the check. Sent only after the notice's
//! ranges completed, so it is ordered after the data, as a SEND after
//! WRITEs on an RC QP.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::Failure;
use crate::control::client::DataTarget;
use crate::control::error::Reason;
use crate::proto;
use crate::provider::tcp::wire::{Hello, Op, Request, Response, Status, MAX_MESSAGE, RESP_LEN};

/// A session's connection for notices.
pub struct Frames {
    target: DataTarget,
    /// A standing grant of the peer's said it takes notices so.
    taken: AtomicBool,
    /// Open between calls (one call at a time: the session's notices
    /// have one in flight, [`super::notices::Notices`]).
    conn: Mutex<Option<TcpStream>>,
    tag: AtomicU64,
    /// A call that gets no answer this long fails (retryable).
    timeout: Duration,
}

impl Frames {
    pub fn new(target: DataTarget, timeout: Duration) -> Frames {
        Frames {
            target,
            taken: AtomicBool::new(false),
            conn: Mutex::new(None),
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

    /// Send `payload` (from [`Frames::encode`]) and take the answer.
    pub async fn call(
        &self,
        payload: &[u8],
        peer: &str,
    ) -> Result<proto::BufferNotifyResponse, Failure> {
        let broke = |e: std::io::Error| {
            Failure::new(
                Reason::Retryable,
                format!(
                    "peer {peer}: the notices' connection to {}: {e}",
                    self.target.0
                ),
            )
        };
        let conn = self.conn.lock().unwrap().take();
        let mut s = match conn {
            Some(s) => s,
            None => self.connect().await.map_err(broke)?,
        };
        let tag = self.tag.fetch_add(1, Ordering::Relaxed);
        let answer = tokio::time::timeout(self.timeout, exchange(&mut s, tag, payload))
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
            Err(Exchange::Broke(m)) => {
                return Err(Failure::new(
                    Reason::Protocol,
                    format!("peer {peer} broke the protocol: a notice frame: {m}"),
                ))
            }
        };
        // The connection is in step again: kept for the next call.
        *self.conn.lock().unwrap() = Some(s);
        let f = proto::BufferNotifyFrame::decode(bytes.as_slice()).map_err(|e| {
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

    async fn connect(&self) -> std::io::Result<TcpStream> {
        let mut s = TcpStream::connect(self.target.0).await?;
        s.set_nodelay(true)?;
        if let Some(key) = self.target.1 {
            s.write_all(&Hello { key }.encode()).await?;
        }
        Ok(s)
    }
}

enum Exchange {
    Io(std::io::Error),
    /// The peer's answer does not fit the request.
    Broke(String),
}

impl From<std::io::Error> for Exchange {
    fn from(e: std::io::Error) -> Self {
        Exchange::Io(e)
    }
}

/// One MESSAGE and its answer on `s`.
async fn exchange(s: &mut TcpStream, tag: u64, payload: &[u8]) -> Result<Vec<u8>, Exchange> {
    let req = Request {
        op: Op::Message,
        tag,
        addr: 0,
        rkey: 0,
        len: payload.len() as u32,
    };
    let mut out = Vec::with_capacity(payload.len() + 32);
    out.extend_from_slice(&req.encode());
    out.extend_from_slice(payload);
    s.write_all(&out).await?;
    let mut hdr = [0u8; RESP_LEN];
    s.read_exact(&mut hdr).await?;
    let resp = Response::decode(&hdr).map_err(|e| Exchange::Broke(e.to_string()))?;
    if resp.tag != tag {
        return Err(Exchange::Broke(format!(
            "the answer to {} for message {tag}",
            resp.tag
        )));
    }
    match resp.status {
        Status::Ok if resp.len <= MAX_MESSAGE => {}
        Status::Ok => return Err(Exchange::Broke(format!("an answer of {} bytes", resp.len))),
        Status::NoMessages => {
            return Err(Exchange::Broke(
                "its standing grant said it takes notices as frames; its session takes none".into(),
            ))
        }
        Status::RemoteAccess => return Err(Exchange::Broke("a remote access error".into())),
    }
    let mut answer = vec![0u8; resp.len as usize];
    s.read_exact(&mut answer).await?;
    Ok(answer)
}
