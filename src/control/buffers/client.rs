//! The Rust client of the service protocol (docs/buffers.md), of the
//! Python package's shape: connect, create a buffer (a sealed memfd
//! mapped here and handed to rcpd), expose, write and read with handles,
//! events.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};

use super::api::{
    self, Desc, ErrorBody, HelloReply, OpRequest, OpStateName, OpStatus, Registered, Request,
    Started,
};
use super::wire::{self, FrameReader, MAGIC};
use super::Failure;
use crate::control::error::Reason;
use crate::mem::memfd::LocalBuffer;

/// Where services find rcpd's socket without `RCP_SOCKET`.
pub const DEFAULT_SOCKET: &str = "/run/rcp/rcpd.sock";

/// A buffer this service registered: its own mapping and rcpd's id.
#[derive(Debug)]
pub struct Buffer {
    pub id: u64,
    pub local: LocalBuffer,
}

/// What an operation says besides its ranges.
#[derive(Clone, Copy, Debug, Default)]
pub struct OpOptions<'a> {
    /// Delivered with the owner's event (at most 256 bytes).
    pub message: Option<&'a str>,
    /// `blake3`, `sha256`, `xxh3` or `none`; `None`: rcpd's default (the
    /// first of its `--verify`).
    pub check: Option<&'a str>,
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Value>>>>;

/// A connection to rcpd's socket; everything registered over it lives as
/// long as it does.
pub struct ServiceClient {
    stream: Arc<UnixStream>,
    pending: Pending,
    events: tokio::sync::Mutex<mpsc::UnboundedReceiver<Value>>,
    next: AtomicU64,
    send: tokio::sync::Mutex<()>,
    reader: tokio::task::JoinHandle<()>,
    /// rcpd's reply to `hello` (`session`, `node`, `check`).
    hello: HelloReply,
}

impl Drop for ServiceClient {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

fn closed() -> Failure {
    Failure::new(Reason::Retryable, "the connection to rcpd closed")
}

/// An `{reason, message}` object as an error.
pub fn error_of(v: &Value) -> Failure {
    match serde_json::from_value::<ErrorBody>(v.clone()) {
        Ok(e) => e.into(),
        Err(e) => Failure::new(
            Reason::Other,
            format!("an error rcpd sent is not one: {e}: {v}"),
        ),
    }
}

/// A reply as what it should be.
fn parse<R: serde::de::DeserializeOwned>(what: &str, v: Value) -> Result<R, Failure> {
    serde_json::from_value(v.clone()).map_err(|e| {
        Failure::new(
            Reason::Protocol,
            format!("rcpd's reply to {what} is not one: {e}: {v}"),
        )
    })
}

impl ServiceClient {
    /// Connect to `path` (else `RCP_SOCKET`, else [`DEFAULT_SOCKET`]) and
    /// say hello with `token` (else `RCP_TOKEN`).
    pub async fn connect(
        path: Option<&Path>,
        token: Option<&str>,
    ) -> Result<ServiceClient, Failure> {
        Self::connect_with(path, token, true).await
    }

    /// [`connect`](Self::connect), saying whether this connection hears a
    /// `done` event for each of its operations (`done_events`; without,
    /// their ends come from [`wait`](Self::wait) and
    /// [`wait_all`](Self::wait_all), and no unread event piles up).
    pub async fn connect_with(
        path: Option<&Path>,
        token: Option<&str>,
        done_events: bool,
    ) -> Result<ServiceClient, Failure> {
        let path = path
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os("RCP_SOCKET").map(Into::into))
            .unwrap_or_else(|| DEFAULT_SOCKET.into());
        let s = UnixStream::connect(&path).await.map_err(|e| {
            Failure::new(
                Reason::Retryable,
                format!("connecting to {}: {e}", path.display()),
            )
        })?;
        wire::send(&s, MAGIC, &[]).await.map_err(|_| closed())?;
        let stream = Arc::new(s);
        let pending: Pending = Arc::default();
        let (etx, erx) = mpsc::unbounded_channel();
        let (r, p) = (stream.clone(), pending.clone());
        let reader = tokio::spawn(async move {
            let mut fr = FrameReader::default();
            while let Ok(Some(v)) = fr.next(&r).await {
                if let Some(id) = v.get("re").and_then(Value::as_u64) {
                    if let Some(tx) = p.lock().unwrap().remove(&id) {
                        let _ = tx.send(v);
                    }
                } else if v.get("event").is_some() {
                    let _ = etx.send(v);
                }
            }
            p.lock().unwrap().clear();
        });
        let mut c = ServiceClient {
            stream,
            pending,
            events: tokio::sync::Mutex::new(erx),
            next: AtomicU64::new(0),
            send: tokio::sync::Mutex::new(()),
            reader,
            hello: HelloReply {
                session: 0,
                version: 0,
                node: String::new(),
                check: String::new(),
            },
        };
        let token = token
            .map(str::to_owned)
            .or_else(|| std::env::var("RCP_TOKEN").ok());
        let hello = Request::Hello(api::Hello {
            version: api::VERSION,
            token,
            name: format!("rust pid {}", std::process::id()),
            done_events,
        });
        c.hello = c.call("hello", &hello, &[]).await?;
        Ok(c)
    }

    /// The address peers dial this rcpd at (`hello`'s `node`): what a
    /// service on another node names as `peer` to reach buffers here.
    pub fn node(&self) -> &str {
        &self.hello.node
    }

    /// rcpd's whole reply to `hello`.
    pub fn hello(&self) -> &HelloReply {
        &self.hello
    }

    /// One request of the protocol and its reply, as `R`.
    pub async fn call<R: serde::de::DeserializeOwned>(
        &self,
        what: &str,
        req: &Request,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<R, Failure> {
        let fields = serde_json::to_value(req).expect("requests serialize");
        parse(what, self.request_raw(fields, fds).await?)
    }

    /// One request as JSON, of any shape (what a service outside this
    /// crate may send, and tests of rcpd's answers to malformed ones), and
    /// its reply (an error reply as `Err`).
    pub async fn request(
        &self,
        op: &str,
        mut fields: Value,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<Value, Failure> {
        fields["op"] = json!(op);
        self.request_raw(fields, fds).await
    }

    async fn request_raw(
        &self,
        mut fields: Value,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<Value, Failure> {
        let id = self.next.fetch_add(1, Relaxed) + 1;
        fields["id"] = json!(id);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(id, tx);
        {
            let _g = self.send.lock().await;
            wire::send(&self.stream, &wire::encode(&fields), fds)
                .await
                .map_err(|_| closed())?;
        }
        let v = rx.await.map_err(|_| closed())?;
        match v.get("error") {
            Some(e) => Err(error_of(e)),
            None => Ok(v),
        }
    }

    /// A new buffer of `size` bytes, registered with rcpd.
    pub async fn create_buffer(&self, size: u64) -> Result<Buffer, Failure> {
        let local = LocalBuffer::create(size)
            .map_err(|e| Failure::new(Reason::Other, format!("memfd: {e}")))?;
        let r: Registered = self
            .call("register", &Request::Register { size }, &[local.fd()])
            .await?;
        Ok(Buffer {
            id: r.buffer,
            local,
        })
    }

    /// Expose `[offset, offset + len)` of `buf` as `name`: access `read`,
    /// `write` or `rw`; `peers`: IP addresses (empty: any).
    pub async fn expose(
        &self,
        buf: &Buffer,
        name: &str,
        offset: u64,
        len: u64,
        access: &str,
        peers: &[&str],
    ) -> Result<(), Failure> {
        self.expose_as(buf, name, (offset, len), access, peers, false)
            .await
    }

    /// [`expose`](Self::expose) with standing grants: each peer's session
    /// is granted the whole range once, and its operations into it move
    /// without a grant each (docs/buffers.md).
    pub async fn expose_standing(
        &self,
        buf: &Buffer,
        name: &str,
        offset: u64,
        len: u64,
        access: &str,
        peers: &[&str],
    ) -> Result<(), Failure> {
        self.expose_as(buf, name, (offset, len), access, peers, true)
            .await
    }

    /// Withdraw exposure `name` (its standing grants are revoked now).
    pub async fn unexpose(&self, name: &str) -> Result<(), Failure> {
        let req = Request::Unexpose {
            name: name.to_string(),
        };
        self.call::<Value>("unexpose", &req, &[]).await.map(drop)
    }

    async fn expose_as(
        &self,
        buf: &Buffer,
        name: &str,
        (offset, len): (u64, u64),
        access: &str,
        peers: &[&str],
        standing: bool,
    ) -> Result<(), Failure> {
        let req = Request::Expose(api::Expose {
            buffer: buf.id,
            name: name.to_string(),
            offset,
            len: Some(len),
            length: None,
            access: access.to_string(),
            peers: peers.iter().map(|p| p.to_string()).collect(),
            grant: standing.then(|| "standing".to_string()),
        });
        self.call::<Value>("expose", &req, &[]).await.map(drop)
    }

    async fn op(
        &self,
        write: bool,
        buf: &Buffer,
        peer: &str,
        name: &str,
        descs: &[(u64, u64, u64)],
        opts: OpOptions<'_>,
    ) -> Result<u64, Failure> {
        let o = OpRequest {
            buffer: buf.id,
            peer: peer.to_string(),
            name: name.to_string(),
            descs: descs
                .iter()
                .map(|&(local, remote, len)| Desc { local, remote, len })
                .collect(),
            message: opts.message.unwrap_or("").to_string(),
            check: opts.check.map(str::to_string),
        };
        let (what, req) = if write {
            ("write", Request::Write(o))
        } else {
            ("read", Request::Read(o))
        };
        let r: Started = self.call(what, &req, &[]).await?;
        Ok(r.handle)
    }

    /// Write `descs` (local offset, remote offset, len) of `buf` into
    /// `peer`'s `name`; a handle.
    pub async fn write(
        &self,
        buf: &Buffer,
        peer: &str,
        name: &str,
        descs: &[(u64, u64, u64)],
        message: Option<&str>,
    ) -> Result<u64, Failure> {
        let opts = OpOptions {
            message,
            check: None,
        };
        self.write_with(buf, peer, name, descs, opts).await
    }

    /// [`ServiceClient::write`] with a message and a check of its own.
    pub async fn write_with(
        &self,
        buf: &Buffer,
        peer: &str,
        name: &str,
        descs: &[(u64, u64, u64)],
        opts: OpOptions<'_>,
    ) -> Result<u64, Failure> {
        self.op(true, buf, peer, name, descs, opts).await
    }

    /// Read `descs` of `peer`'s `name` into `buf`; a handle.
    pub async fn read(
        &self,
        buf: &Buffer,
        peer: &str,
        name: &str,
        descs: &[(u64, u64, u64)],
    ) -> Result<u64, Failure> {
        self.read_with(buf, peer, name, descs, OpOptions::default())
            .await
    }

    /// [`ServiceClient::read`] with a message and a check of its own.
    pub async fn read_with(
        &self,
        buf: &Buffer,
        peer: &str,
        name: &str,
        descs: &[(u64, u64, u64)],
        opts: OpOptions<'_>,
    ) -> Result<u64, Failure> {
        self.op(false, buf, peer, name, descs, opts).await
    }

    /// Wait for operation `h`: the bytes moved, or its failure.
    pub async fn wait(&self, h: u64) -> Result<u64, Failure> {
        let req = Request::Wait(api::Wait {
            handle: h,
            timeout_ms: None,
        });
        let s: OpStatus = self.call("wait", &req, &[]).await?;
        match (s.state, s.failure) {
            (OpStateName::Done, _) => Ok(s.bytes.unwrap_or(0)),
            (OpStateName::Failed, Some(f)) => Err(f.into()),
            (state, _) => Err(Failure::new(
                Reason::Other,
                format!("operation {h}: {state:?}"),
            )),
        }
    }

    /// `write_many` (`write`) or `read_many`: each of `ops` checked by rcpd
    /// before any starts, in one request; their handles in order.
    pub async fn start_many(&self, write: bool, ops: Vec<OpRequest>) -> Result<Vec<u64>, Failure> {
        let many = api::ManyOps {
            ops,
            ..Default::default()
        };
        Ok(self.many(write, many).await?.handles)
    }

    /// `write_many` (`write`) or `read_many` of one prepared list: each of
    /// `op`'s descriptors an operation of its own (its buffer, peer,
    /// exposure, message and check for all); their handles in order.
    pub async fn start_each(&self, write: bool, op: OpRequest) -> Result<Vec<u64>, Failure> {
        let many = api::ManyOps {
            each: Some(op),
            ..Default::default()
        };
        Ok(self.many(write, many).await?.handles)
    }

    /// [`Self::start_many`] and [`Self::wait_all`] of them in one request:
    /// their final states in order.
    pub async fn run_many(
        &self,
        write: bool,
        ops: Vec<OpRequest>,
    ) -> Result<Vec<OpStatus>, Failure> {
        let many = api::ManyOps {
            ops,
            wait: true,
            ..Default::default()
        };
        ran(self.many(write, many).await?)
    }

    /// [`Self::start_each`] and [`Self::wait_all`] of them in one request:
    /// their final states in order.
    pub async fn run_each(&self, write: bool, op: OpRequest) -> Result<Vec<OpStatus>, Failure> {
        let many = api::ManyOps {
            each: Some(op),
            wait: true,
            ..Default::default()
        };
        ran(self.many(write, many).await?)
    }

    async fn many(&self, write: bool, many: api::ManyOps) -> Result<api::StartedMany, Failure> {
        let (what, req) = if write {
            ("write_many", Request::WriteMany(many))
        } else {
            ("read_many", Request::ReadMany(many))
        };
        self.call(what, &req, &[]).await
    }

    /// Wait for each of `handles`, in one request; their final states in
    /// order (each `done`, `failed` with its failure, or `cancelled`).
    pub async fn wait_all(&self, handles: Vec<u64>) -> Result<Vec<OpStatus>, Failure> {
        let req = Request::WaitAll(api::WaitAll {
            handles,
            timeout_ms: None,
        });
        let r: api::Statuses = self.call("wait_all", &req, &[]).await?;
        Ok(r.statuses)
    }

    /// Operation `h`'s state as rcpd reports it (`state`, `bytes`,
    /// `transport`, `fell_back`, `failure`: docs/buffers.md).
    pub async fn status(&self, h: u64) -> Result<OpStatus, Failure> {
        self.call("status", &Request::Status { handle: h }, &[])
            .await
    }

    /// The next event (`written`, `read`, `done`); `None` once closed.
    pub async fn next_event(&self) -> Option<Value> {
        self.events.lock().await.recv().await
    }
}

/// The statuses of a `write_many` / `read_many` with `wait`.
fn ran(r: api::StartedMany) -> Result<Vec<OpStatus>, Failure> {
    r.statuses.ok_or_else(|| {
        Failure::new(
            Reason::Version,
            "rcpd answered write_many/read_many without statuses: it does not know wait (older)",
        )
    })
}
