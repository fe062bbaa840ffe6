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

use super::wire::{self, FrameReader, MAGIC};
use super::OpError;
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
    hello: Value,
}

impl Drop for ServiceClient {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

fn closed() -> OpError {
    OpError::new(Reason::Retryable, "the connection to rcpd closed")
}

fn reason_of(name: &str) -> Reason {
    match name {
        "invalid" => Reason::Invalid,
        "not_found" => Reason::FileNotFound,
        "integrity" => Reason::Integrity,
        "unauthenticated" => Reason::Unauthenticated,
        "permission" => Reason::Permission,
        "exceeded" => Reason::Exceeded,
        "retryable" => Reason::Retryable,
        _ => Reason::Other,
    }
}

/// An `{reason, message}` object as an error.
pub fn error_of(v: &Value) -> OpError {
    OpError::new(
        reason_of(v.get("reason").and_then(Value::as_str).unwrap_or("")),
        v.get("message").and_then(Value::as_str).unwrap_or(""),
    )
}

impl ServiceClient {
    /// Connect to `path` (else `RCP_SOCKET`, else [`DEFAULT_SOCKET`]) and
    /// say hello with `token` (else `RCP_TOKEN`).
    pub async fn connect(
        path: Option<&Path>,
        token: Option<&str>,
    ) -> Result<ServiceClient, OpError> {
        let path = path
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os("RCP_SOCKET").map(Into::into))
            .unwrap_or_else(|| DEFAULT_SOCKET.into());
        let s = UnixStream::connect(&path).await.map_err(|e| {
            OpError::new(
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
            hello: Value::Null,
        };
        let token = token
            .map(str::to_owned)
            .or_else(|| std::env::var("RCP_TOKEN").ok());
        let mut hello = json!({"version": super::service::VERSION, "name": format!("rust pid {}", std::process::id())});
        if let Some(t) = token {
            hello["token"] = json!(t);
        }
        c.hello = c.request("hello", hello, &[]).await?;
        Ok(c)
    }

    /// The address peers dial this rcpd at (`hello`'s `node`): what a
    /// service on another node names as `peer` to reach buffers here.
    pub fn node(&self) -> &str {
        self.hello["node"].as_str().unwrap_or("")
    }

    /// rcpd's whole reply to `hello`.
    pub fn hello(&self) -> &Value {
        &self.hello
    }

    /// One request and its reply (an error reply as `Err`).
    pub async fn request(
        &self,
        op: &str,
        mut fields: Value,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<Value, OpError> {
        let id = self.next.fetch_add(1, Relaxed) + 1;
        fields["id"] = json!(id);
        fields["op"] = json!(op);
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
    pub async fn create_buffer(&self, size: u64) -> Result<Buffer, OpError> {
        let local = LocalBuffer::create(size)
            .map_err(|e| OpError::new(Reason::Other, format!("memfd: {e}")))?;
        let r = self
            .request("register", json!({"size": size}), &[local.fd()])
            .await?;
        let id = r["buffer"]
            .as_u64()
            .ok_or_else(|| OpError::new(Reason::Invalid, "register: no buffer id"))?;
        Ok(Buffer { id, local })
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
    ) -> Result<(), OpError> {
        let mut f =
            json!({"buffer": buf.id, "name": name, "offset": offset, "len": len, "access": access});
        if !peers.is_empty() {
            f["peers"] = json!(peers);
        }
        self.request("expose", f, &[]).await.map(drop)
    }

    async fn op(
        &self,
        op: &str,
        buf: &Buffer,
        peer: &str,
        name: &str,
        descs: &[(u64, u64, u64)],
        opts: OpOptions<'_>,
    ) -> Result<u64, OpError> {
        let d: Vec<[u64; 3]> = descs.iter().map(|&(a, b, c)| [a, b, c]).collect();
        let mut f = json!({"buffer": buf.id, "peer": peer, "name": name, "descs": d});
        if let Some(m) = opts.message {
            f["message"] = json!(m);
        }
        if let Some(c) = opts.check {
            f["check"] = json!(c);
        }
        let r = self.request(op, f, &[]).await?;
        r["handle"]
            .as_u64()
            .ok_or_else(|| OpError::new(Reason::Invalid, "no handle"))
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
    ) -> Result<u64, OpError> {
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
    ) -> Result<u64, OpError> {
        self.op("write", buf, peer, name, descs, opts).await
    }

    /// Read `descs` of `peer`'s `name` into `buf`; a handle.
    pub async fn read(
        &self,
        buf: &Buffer,
        peer: &str,
        name: &str,
        descs: &[(u64, u64, u64)],
    ) -> Result<u64, OpError> {
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
    ) -> Result<u64, OpError> {
        self.op("read", buf, peer, name, descs, opts).await
    }

    /// Wait for operation `h`: the bytes moved, or its failure.
    pub async fn wait(&self, h: u64) -> Result<u64, OpError> {
        let s = self.request("wait", json!({"handle": h}), &[]).await?;
        match s["state"].as_str() {
            Some("done") => Ok(s["bytes"].as_u64().unwrap_or(0)),
            Some("failed") => Err(error_of(&s["failure"])),
            other => Err(OpError::new(
                Reason::Other,
                format!("operation {h}: {other:?}"),
            )),
        }
    }

    /// Operation `h`'s state as rcpd reports it (`state`, `bytes`,
    /// `transport`, `fell_back`, `failure`: docs/buffers.md).
    pub async fn status(&self, h: u64) -> Result<Value, OpError> {
        self.request("status", json!({"handle": h}), &[]).await
    }

    /// The next event (`written`, `read`, `done`); `None` once closed.
    pub async fn next_event(&self) -> Option<Value> {
        self.events.lock().await.recv().await
    }
}
