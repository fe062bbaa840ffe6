//! The async client library: connect to an rcpd, open a session, move files
//! over it, stat and list remote paths, ask an rcpd to copy (service API).
//!
//! - [`Client`]: one gRPC connection to an rcpd (TLS, token, keepalives);
//! - [`Session`]: a handshake's worth of state: the data path (QP or TCP
//!   connections, posting and completion threads, registered staging) set
//!   up once and reused by every file; [`Session::transfer`] runs one Move
//!   stream over it for any number of files;
//! - `stream`: the driver of that stream over
//!   [`ClientCore`](crate::control::protocol::ClientCore);
//! - `io`: what the core asks for: reading and hashing blocks into
//!   staging, checking and writing pulled blocks, local destinations,
//!   batched commits.
//!
//! ```no_run
//! # async fn f() -> Result<(), rcp::control::ControlError> {
//! use rcp::control::client::{Client, ClientOptions, FileJob};
//! let client = Client::connect("node-b:7471", ClientOptions::default()).await?;
//! let mut session = client.session().await?;
//! let job = FileJob::push("/data/x.bin".into(), "incoming/");
//! let done = session.transfer_all(vec![job]).await?;
//! println!("{} {}", done[0].path, hex::encode(&done[0].digest));
//! session.close().await?;
//! # Ok(()) }
//! ```

mod io;
mod session;
mod stream;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel as GrpcChannel, Endpoint};
use tonic::Streaming;

use super::auth::AddBearer;
use super::error::{ControlError, Result};
use super::link::Transport;
use super::{DEFAULT_BLOCK_SIZE, DEFAULT_MAX_OPEN_FILES, DEFAULT_PORT, MAX_MESSAGE};
use crate::proto;

pub use io::{FileJob, KnownSource, OpenWith, Source};
pub use session::{
    datapath_config, DataTarget, FileResult, Observer, Quiet, Session, SessionStats,
};

type Rpc = proto::rcp_client::RcpClient<InterceptedService<GrpcChannel, AddBearer>>;

/// Default files in flight on a session (open at once): enough to hide a
/// round trip per file behind the others, and to keep several windows of
/// small files moving (a 4 MiB window holds 256 of 16 KiB; with 64 in
/// flight each window went out a quarter full, and every hand-off between
/// threads was paid per 64 files). rcpd's default `--max-open-files`, so a
/// session gets all of it.
pub const DEFAULT_TRANSFERS: u32 = DEFAULT_MAX_OPEN_FILES;
/// Default staging windows (the server grants at most this many at once).
pub const DEFAULT_WINDOWS: u32 = 8;
/// Default progress timeout (also the data path's request timeout).
pub const DEFAULT_TIMEOUT: Duration = crate::datapath::config::DEFAULT_REQUEST_TIMEOUT;
/// Default of [`ClientOptions::tcp_fallback_after`] (`rcp
/// --tcp-fallback-after`, and rcpd's Copy API).
pub const DEFAULT_TCP_FALLBACK_AFTER: Duration = Duration::from_secs(10);

/// Client settings (the `rcp` flags, as one struct).
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Bearer token (`RCP_TOKEN`).
    pub token: Option<String>,
    pub transport: Transport,
    /// Verbs: the rails to use (`--device a,b`; empty: every ACTIVE port
    /// of this namespace on the arena's NUMA node).
    pub rails: Vec<crate::parse::RailName>,
    /// QPs on each rail (`--qps-per-rail`, 1..=16).
    pub qps_per_rail: u32,
    /// `--transport auto` over verbs: end a stream whose rails have all
    /// been down this long with blocks waiting (`Session::fallback` says
    /// why), so that the jobs policy ([`crate::control::jobs::run`])
    /// continues the copy over tcp; `None`: never.
    pub tcp_fallback_after: Option<Duration>,
    pub gid_index: Option<u32>,
    /// Block size, a power of two >= 4096.
    pub block_size: u64,
    /// Chain length per doorbell.
    pub batch: usize,
    /// Signal every n-th request of a chain.
    pub signal_every: usize,
    /// Inline writes up to this many bytes (None: provider default).
    pub inline: Option<u32>,
    /// Staging windows: the windows the server may grant at once.
    pub windows: u32,
    /// Files open at once on a session's stream.
    pub transfers: u32,
    /// The checks offered for blocks end to end (`--verify`), preferred
    /// first; rcpd picks the first it allows (`RCPD_VERIFY`). Default
    /// [`crate::files::DEFAULT_CHECKS`].
    pub verify: Vec<crate::files::Check>,
    /// Completion thread: poll, event or hybrid (default: hybrid on verbs,
    /// event on tcp).
    pub poll_mode: Option<crate::datapath::PollMode>,
    /// Pin the completion thread to this CPU.
    pub cq_cpu: Option<usize>,
    /// The data QP's ACK timeout and retry count.
    pub qp_retry: crate::datapath::QpRetry,
    pub connect_timeout: Duration,
    /// A stream that waits and makes no progress this long ends (exit 5);
    /// also the data path's request timeout and the gRPC keepalive base.
    pub timeout: Duration,
    /// Export the data path's queue gauges, error completions, reconnects
    /// and latency here (rcpd's own metrics when it copies for a service).
    pub metrics: Option<Arc<crate::metrics::Metrics>>,
    /// TLS to rcpd's gRPC port (with a client certificate for mTLS).
    pub tls: Option<super::tls::ClientTls>,
    /// Post at most this many bytes per second on the session's data path
    /// (`--bwlimit`; `None` or 0: unlimited).
    pub bwlimit: Option<u64>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        // The data path's settings default as the data path's own.
        let dp = crate::datapath::DataPathConfig::default();
        ClientOptions {
            token: None,
            transport: Transport::Auto,
            rails: Vec::new(),
            qps_per_rail: 1,
            tcp_fallback_after: Some(DEFAULT_TCP_FALLBACK_AFTER),
            gid_index: None,
            block_size: DEFAULT_BLOCK_SIZE,
            batch: dp.batch,
            signal_every: dp.signal_every,
            inline: None,
            windows: DEFAULT_WINDOWS,
            transfers: DEFAULT_TRANSFERS,
            verify: crate::files::DEFAULT_CHECKS.to_vec(),
            poll_mode: None,
            cq_cpu: None,
            qp_retry: crate::datapath::QpRetry::default(),
            connect_timeout: Duration::from_secs(10),
            timeout: DEFAULT_TIMEOUT,
            metrics: None,
            tls: None,
            bwlimit: None,
        }
    }
}

/// A connection to one rcpd.
#[derive(Clone)]
pub struct Client {
    rpc: Rpc,
    host: String,
    /// `host:port` as the user gave it (for messages).
    addr: String,
    opts: ClientOptions,
}

/// Where `host`:`port` resolves, once: a name that does not resolve is
/// [`ControlError::UnknownHost`] (not worth retrying), never a transport
/// error of the first request.
async fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>> {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let found = tokio::net::lookup_host((bare, port))
        .await
        .map_err(|source| ControlError::UnknownHost {
            host: bare.to_string(),
            source,
        })?;
    let addrs: Vec<SocketAddr> = found.collect();
    if addrs.is_empty() {
        return Err(ControlError::UnknownHost {
            host: bare.to_string(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no address"),
        });
    }
    Ok(addrs)
}

/// What answers at `addrs` when gRPC's first request failed at the
/// transport: the first bytes it sends back to HTTP/2's preface, read by
/// their type (a TLS record, an HTTP/1 status line, an HTTP/2 frame) and
/// never by an error message's text.
async fn sniff(addrs: &[SocketAddr], wait: Duration) -> Answer {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let talk = async {
        let mut s = tokio::net::TcpStream::connect(addrs).await.ok()?;
        // The client preface and an empty SETTINGS frame.
        let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
        s.write_all(&hello).await.ok()?;
        let mut buf = [0u8; 16];
        let mut n = 0;
        while n < 5 {
            match s.read(&mut buf[n..]).await {
                Ok(0) | Err(_) => break,
                Ok(k) => n += k,
            }
        }
        Some(buf[..n].to_vec())
    };
    match tokio::time::timeout(wait, talk).await {
        Err(_) => Answer::Silent,
        Ok(None) => Answer::Closed,
        Ok(Some(b)) => Answer::of(&b),
    }
}

/// What [`sniff`] heard.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    /// A TLS record (an alert or a handshake): a TLS server.
    Tls,
    /// `HTTP/1.x ...` (or an error page): a web server.
    Http,
    /// An HTTP/2 frame: an HTTP/2 server that is not a gRPC one we know.
    Http2,
    /// Some other protocol.
    Other,
    /// The connection closed without a byte.
    Closed,
    /// Nothing within the wait.
    Silent,
}

impl Answer {
    fn of(b: &[u8]) -> Answer {
        match b {
            [] => Answer::Closed,
            [0x14..=0x17, 0x03, ..] => Answer::Tls,
            // A status line, or an error page without one (HTTP/0.9 style).
            [b'H', b'T', b'T', b'P', b'/', ..] | [b'<', ..] => Answer::Http,
            [_, _, _, 0x04, ..] => Answer::Http2,
            _ => Answer::Other,
        }
    }
}

/// One grpc.health.v1 check on the gRPC port (no token needed): with TLS 1.3
/// a server that refuses the client's certificate only says so by closing
/// the connection after the handshake, and a plaintext client meets a TLS
/// server as an HTTP/2 framing error. Both are named here instead of
/// surfacing as a cancelled first request.
async fn probe(
    ch: &GrpcChannel,
    uri: &str,
    tls: Option<&super::tls::ClientTls>,
    (addr, addrs): (&str, &[SocketAddr]),
    wait: Duration,
) -> Result<()> {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let mut health = HealthClient::new(ch.clone());
    let check = health.check(HealthCheckRequest {
        service: String::new(),
    });
    let not_rcpd = |why: &str| ControlError::NotRcpd {
        addr: addr.to_string(),
        why: why.to_string(),
    };
    // Silence is not an answer: a peer that took the connection and says
    // nothing within the wait is named as such, not as "not rcpd".
    let no_answer = || ControlError::NoAnswer {
        addr: addr.to_string(),
        secs: wait.as_secs(),
    };
    // The whole probe (the sniff below too) within the wait.
    let deadline = tokio::time::Instant::now() + wait;
    let Ok(r) = tokio::time::timeout_at(deadline, check).await else {
        return Err(no_answer());
    };
    let Err(st) = r else { return Ok(()) };
    let why = source_chain(&st);
    // The first request on a fresh connection failing at the transport
    // (closed, reset, broken pipe, HTTP/2 framing) means the peer refused
    // how we talk to it.
    let refused = matches!(
        st.code(),
        tonic::Code::Cancelled
            | tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Internal
    );
    if !refused {
        // Unimplemented: an rcpd without the health service; anything else
        // shows up again on the first real request.
        return Ok(());
    }
    if tls.is_none() {
        // Plaintext: what answers tells a TLS rcpd from something else.
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match sniff(addrs, left.min(Duration::from_secs(2))).await {
            Answer::Http => return Err(not_rcpd("an HTTP/1 server")),
            Answer::Http2 => {
                return Err(not_rcpd("an HTTP/2 server without gRPC's health service"))
            }
            Answer::Other => return Err(not_rcpd("it does not speak HTTP/2")),
            Answer::Silent => return Err(no_answer()),
            Answer::Tls | Answer::Closed => {}
        }
    }
    Err(match tls {
        Some(t) => ControlError::Fatal(format!(
            "rcpd at {uri} closed the TLS connection after the handshake: it requires a client \
             certificate signed by its --tls-client-ca ({}): {why}",
            match &t.cert {
                Some(c) => format!("{} was refused", c.display()),
                None => "give --tls-cert and --tls-key".to_string(),
            }
        )),
        None => ControlError::Retryable(format!(
            "rcpd at {uri} dropped the first request: if it requires TLS, give --tls-ca \
             (and --tls-cert/--tls-key for mutual TLS): {why}"
        )),
    })
}

/// UNIMPLEMENTED without rcpd's error details: the server has no such
/// method (not an rcpd, or one older than the method); rcpd's own refusals
/// carry details.
fn no_such_method(st: &tonic::Status) -> bool {
    use tonic_types::StatusExt;
    st.code() == tonic::Code::Unimplemented && st.get_details_error_info().is_none()
}

/// An error and its sources, `: `-joined (tonic's transport errors keep the
/// reason, e.g. a certificate problem, in the source chain).
fn source_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}

/// A connector that dials only `addrs` (the first that answers), whatever
/// the URI names; TCP_NODELAY as the default connector sets it.
fn pinned_connector(
    addrs: Vec<SocketAddr>,
) -> impl tower::Service<
    tonic::codegen::http::Uri,
    Response = hyper_util::rt::TokioIo<tokio::net::TcpStream>,
    Error = std::io::Error,
    Future = impl Send,
> + Send
       + Clone
       + 'static {
    let addrs: Arc<[SocketAddr]> = addrs.into();
    tower::service_fn(move |_: tonic::codegen::http::Uri| {
        let addrs = addrs.clone();
        async move {
            let s = tokio::net::TcpStream::connect(&addrs[..]).await?;
            s.set_nodelay(true)?;
            Ok(hyper_util::rt::TokioIo::new(s))
        }
    })
}

/// `host:port`, `[v6]:port` or `host` (default port) into a URI and the
/// bare host.
pub fn endpoint_uri(addr: &str) -> Result<(String, String)> {
    let (host, port) = crate::parse::host_port(addr, DEFAULT_PORT)
        .map_err(|e| ControlError::Usage(e.to_string()))?;
    Ok((format!("http://{host}:{port}"), host))
}

impl Client {
    /// Connect to `addr` (`host:port`, `[v6]:port`).
    pub async fn connect(addr: &str, opts: ClientOptions) -> Result<Client> {
        Self::connect_to(addr, None, opts).await
    }

    /// Connect to a peer [`CopyPeers`](super::copy_peers::CopyPeers)
    /// admitted: to the addresses it checked and no other (a reconnect
    /// too), named as the caller gave it (TLS checks that name).
    pub async fn connect_admitted(
        peer: &super::copy_peers::Admitted,
        opts: ClientOptions,
    ) -> Result<Client> {
        Self::connect_to(peer.remote(), Some(peer.addrs().to_vec()), opts).await
    }

    /// Connect to `addr`, through `pinned` if given, else where its name
    /// resolves.
    async fn connect_to(
        addr: &str,
        pinned: Option<Vec<SocketAddr>>,
        opts: ClientOptions,
    ) -> Result<Client> {
        let (mut uri, host) = endpoint_uri(addr)?;
        let pinned = match pinned {
            Some(a) => a,
            None => {
                let (_, port) = crate::parse::host_port(addr, DEFAULT_PORT)
                    .map_err(|e| ControlError::Usage(e.to_string()))?;
                resolve(&host, port).await?
            }
        };
        if opts.tls.is_some() {
            uri = uri.replacen("http://", "https://", 1);
        }
        // HTTP/2 pings notice a dead host or a cut path even while the
        // stream is quiet; a stalled peer process is the Move stream's own
        // timeout.
        let ping = (opts.timeout / 3).max(Duration::from_secs(1));
        let mut ep = Endpoint::from_shared(uri.clone())
            .map_err(|e| ControlError::Usage(format!("{addr}: {e}")))?
            .connect_timeout(opts.connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(ping)
            .keep_alive_timeout(ping)
            .keep_alive_while_idle(true);
        if let Some(t) = &opts.tls {
            ep = ep
                .tls_config(t.config(&host)?)
                .map_err(|e| ControlError::Usage(format!("TLS configuration: {e}")))?;
        }
        let ch = ep
            .connect_with_connector(pinned_connector(pinned.clone()))
            .await;
        let ch = ch.map_err(|e| {
            let why = source_chain(&e);
            // A handshake the server refused is not worth retrying.
            if opts.tls.is_some() && why.contains("certificate") {
                ControlError::Fatal(format!("TLS to rcpd at {uri}: {why}"))
            } else {
                ControlError::Retryable(format!("connecting to rcpd at {uri}: {why}"))
            }
        })?;
        probe(&ch, &uri, opts.tls.as_ref(), (addr, &pinned), opts.timeout).await?;
        let auth = AddBearer::new(opts.token.as_deref()).map_err(ControlError::Usage)?;
        let rpc = proto::rcp_client::RcpClient::with_interceptor(ch, auth)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        Ok(Client {
            rpc,
            host,
            addr: addr.to_string(),
            opts,
        })
    }

    pub fn options(&self) -> &ClientOptions {
        &self.opts
    }

    /// This client, with no more staging windows than a job of `bytes`
    /// (each file's length rounded up to 4 KiB, as files are laid out in
    /// windows: [`crate::control::jobs::Plan::window_bytes`]) can fill at
    /// once: a copy of a small file maps one window of staging, not
    /// [`DEFAULT_WINDOWS`], and on verbs pre-faults and registers only that
    /// (the pages a registration pins are still all faulted in before it).
    /// Same connection.
    pub fn sized_for(&self, bytes: u64) -> Client {
        let need = bytes.div_ceil(super::WINDOW_SIZE as u64).max(1);
        let mut opts = self.opts.clone();
        opts.windows = opts.windows.min(u32::try_from(need).unwrap_or(u32::MAX));
        Client {
            rpc: self.rpc.clone(),
            host: self.host.clone(),
            addr: self.addr.clone(),
            opts,
        }
    }

    /// The host as the user named it (no port).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// rcpd's digests of `paths` (beneath its root) under `check`, cut at
    /// `block_size`, each block's too when `blocks`: one `Digests` call, in
    /// the order of `paths` ([`crate::control::jobs::skip`]).
    pub async fn digests(
        &self,
        paths: Vec<String>,
        check: crate::files::Check,
        block_size: u64,
        blocks: bool,
    ) -> Result<Vec<proto::FileDigests>> {
        Ok(self
            .rpc
            .clone()
            .digests(proto::DigestsRequest {
                paths,
                check: super::protocol::check_to_wire(check) as i32,
                block_size,
                blocks,
            })
            .await?
            .into_inner()
            .files)
    }

    /// Metadata of a remote path (`None` if it does not exist).
    pub async fn stat(&self, path: &str) -> Result<Option<proto::Entry>> {
        self.stat_with(path, false).await
    }

    /// [`stat`](Self::stat), with the file's fingerprint when asked.
    pub async fn stat_with(&self, path: &str, fingerprint: bool) -> Result<Option<proto::Entry>> {
        let r = self
            .rpc
            .clone()
            .stat(proto::StatRequest {
                path: path.into(),
                fingerprint,
            })
            .await
            .map_err(|st| self.not_rcpd(st))?
            .into_inner();
        Ok(if r.exists { r.entry } else { None })
    }

    /// A status of the first rcp request: UNIMPLEMENTED without rcpd's
    /// error details means no `rcp.v1.Rcp` service answers there (rcpd's
    /// own health port, another gRPC server).
    fn not_rcpd(&self, st: tonic::Status) -> ControlError {
        if no_such_method(&st) {
            return ControlError::NotRcpd {
                addr: self.addr.clone(),
                why: "no rcp.v1.Rcp service there; rcpd's health port?".into(),
            };
        }
        st.into()
    }

    /// Entries beneath a remote directory.
    pub async fn list(&self, path: &str, recursive: bool) -> Result<Vec<proto::Entry>> {
        Ok(self
            .rpc
            .clone()
            .list(proto::ListRequest {
                path: path.into(),
                recursive,
            })
            .await?
            .into_inner()
            .entries)
    }

    /// `mkdir -p` of a remote directory; the last one, when made, with a
    /// copied directory's permission bits `mode` (0: rcpd's default; see
    /// `MakeDirRequest.mode`). `replace_link`: a directory of a copied
    /// tree, where a symlink is replaced, not followed
    /// (`MakeDirRequest.replace_link`).
    pub async fn make_dir(&self, path: &str, mode: u32, replace_link: bool) -> Result<()> {
        self.rpc
            .clone()
            .make_dir(proto::MakeDirRequest {
                path: path.into(),
                mode,
                replace_link,
                ..Default::default()
            })
            .await?;
        Ok(())
    }

    /// Remote directories made in one call, in the order given (parents
    /// first), each as [`Client::make_dir`] makes it. `Ok(false)`: this
    /// rcpd predates `MakeDirs` (2.11) and made none; make them one call
    /// each.
    pub async fn make_dirs(&self, dirs: &[(&str, u32, bool)]) -> Result<bool> {
        let dirs = dirs
            .iter()
            .map(|&(path, mode, replace_link)| proto::MakeDirRequest {
                path: path.into(),
                mode,
                replace_link,
                ..Default::default()
            })
            .collect();
        match self
            .rpc
            .clone()
            .make_dirs(proto::MakeDirsRequest { dirs })
            .await
        {
            Ok(_) => Ok(true),
            Err(st) if no_such_method(&st) => Ok(false),
            Err(st) => Err(st.into()),
        }
    }

    /// `-p` after a copy: remote directory `path` gets exactly `mode` and
    /// mtime `mtime_ns`.
    pub async fn set_dir(&self, path: &str, mode: u32, mtime_ns: i64) -> Result<()> {
        self.set_attrs(path, mode, mtime_ns, false).await
    }

    /// `-p` with `-c` or `--size-only`: set remote regular file `path`
    /// (left as it was) to exactly `mode` and `mtime_ns` (protocol 2.10:
    /// an older rcpd refuses it as not a directory, `Invalid`).
    pub async fn set_file(&self, path: &str, mode: u32, mtime_ns: i64) -> Result<()> {
        self.set_attrs(path, mode, mtime_ns, true).await
    }

    /// `MakeDir` with `exact`: a directory's attributes, or (`file`) a
    /// regular file's.
    async fn set_attrs(&self, path: &str, mode: u32, mtime_ns: i64, file: bool) -> Result<()> {
        self.rpc
            .clone()
            .make_dir(proto::MakeDirRequest {
                path: path.into(),
                mode,
                exact: true,
                mtime_ns,
                replace_link: false,
                file,
            })
            .await?;
        Ok(())
    }

    /// Create (or atomically replace) remote symlink `path` -> `target`.
    pub async fn make_link(&self, path: &str, target: &str) -> Result<()> {
        self.rpc
            .clone()
            .make_link(proto::MakeLinkRequest {
                path: path.into(),
                target: target.into(),
            })
            .await?;
        Ok(())
    }

    /// Remove one remote entry (a file, a symlink or an empty directory).
    pub async fn remove(&self, path: &str) -> Result<()> {
        self.rpc
            .clone()
            .remove(proto::RemoveRequest { path: path.into() })
            .await?;
        Ok(())
    }

    /// Service API: ask this rcpd to copy to or from another rcpd; progress
    /// messages until the end.
    pub async fn copy(&self, req: proto::CopyRequest) -> Result<Streaming<proto::CopyProgress>> {
        Ok(self.rpc.clone().copy(req).await?.into_inner())
    }

    /// Buffers: ask for a grant on an exposed buffer (docs/buffers.md).
    pub async fn buffer_grant(
        &self,
        req: proto::BufferGrantRequest,
    ) -> std::result::Result<proto::BufferGrantResponse, tonic::Status> {
        Ok(self.rpc.clone().buffer_grant(req).await?.into_inner())
    }

    /// Buffers: end a grant.
    pub async fn buffer_done(
        &self,
        req: proto::BufferDoneRequest,
    ) -> std::result::Result<proto::BufferDoneResponse, tonic::Status> {
        Ok(self.rpc.clone().buffer_done(req).await?.into_inner())
    }

    /// Buffers: tell operations moved under standing grants.
    pub async fn buffer_notify(
        &self,
        req: proto::BufferNotifyRequest,
    ) -> std::result::Result<proto::BufferNotifyResponse, tonic::Status> {
        Ok(self.rpc.clone().buffer_notify(req).await?.into_inner())
    }

    /// `BufferMessages` (2.7): rcpd's message QP for session
    /// `session_id`'s notices, connected to ours at `ours`.
    pub async fn buffer_messages(
        &self,
        session_id: u64,
        ours: &crate::verbs::QpEndpoint,
    ) -> std::result::Result<crate::verbs::QpEndpoint, tonic::Status> {
        let req = proto::BufferMessagesRequest {
            session_id,
            endpoint: Some(crate::control::link::ep_to_proto(ours)),
        };
        let resp = self.rpc.clone().buffer_messages(req).await?.into_inner();
        let ep = resp
            .endpoint
            .ok_or_else(|| tonic::Status::internal("BufferMessages: rcpd sent no endpoint"))?;
        crate::control::link::ep_from_proto(&ep)
            .map_err(|e| tonic::Status::internal(format!("BufferMessages: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            endpoint_uri("node:7471").unwrap(),
            ("http://node:7471".into(), "node".into())
        );
        assert_eq!(
            endpoint_uri("[fe80::1]:9").unwrap(),
            ("http://[fe80::1]:9".into(), "[fe80::1]".into())
        );
        assert_eq!(endpoint_uri("node").unwrap().0, "http://node:7471");
        assert_eq!(endpoint_uri("[::1]").unwrap().0, "http://[::1]:7471");
        assert!(endpoint_uri("node:x").is_err());
        assert!(endpoint_uri("[::1").is_err());
        assert!(endpoint_uri(":1").is_err());
        // A bare IPv6 address is a host, never host:port.
        assert_eq!(endpoint_uri("fe80::1").unwrap().0, "http://[fe80::1]:7471");
    }
}
