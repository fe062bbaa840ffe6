//! The async client library: connect to an rcpd, open a session, push and
//! pull files, stat and list remote paths, ask an rcpd to copy (service API).
//!
//! ```no_run
//! # async fn f() -> Result<(), rcp::control::ControlError> {
//! use rcp::control::{Client, ClientOptions};
//! let client = Client::connect("node-b:7471", ClientOptions::default()).await?;
//! let mut session = client.session().await?;
//! let r = session
//!     .push_file("/data/x.bin".as_ref(), "incoming/", Default::default(), None)
//!     .await?;
//! println!("{} {}", r.path, hex::encode(r.sha256));
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc as smpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel as GrpcChannel, Endpoint};
use tonic::Streaming;

use super::auth::AddBearer;
use super::error::{ControlError, Result};
use super::fsutil::{self, Bitmap};
use super::link::{
    connect_params, ep_from_proto, ep_to_proto, resolve_transport, ClientLink, Transport,
};
use super::movement::{self, BlockIo, Moved};
use super::server::{moving_blocks, packed_len};
use super::{
    DEFAULT_BLOCK_SIZE, DEFAULT_PORT, MAX_MESSAGE, TCP_SESSION_KEY_MINOR, VERSION_MAJOR,
    VERSION_MINOR,
};
use crate::datapath::legacy::{span_mut_for_legacy_control, DataPath, ReconnectError};
use crate::engine::{LocalSeg, OpKind, Transfer, Window};
use crate::files::{
    self, Destination, DestinationOptions, DirHandle, Preserve, SourceFile, StreamingFileDigest,
    WriteBehind,
};
use crate::mem::PeerSpan;
use crate::proto::{self, client_msg, server_msg, ClientMsg, ServerMsg};
use crate::provider::{Channel, ProviderKind};
use crate::verbs::PortWatcher;

type Rpc = proto::rcp_client::RcpClient<InterceptedService<GrpcChannel, AddBearer>>;

/// Client settings (the `rcp` flags).
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Bearer token (`RCP_TOKEN`).
    pub token: Option<String>,
    pub transport: Transport,
    pub device: Option<String>,
    pub gid_index: Option<u32>,
    /// Block size, a power of two >= 4096.
    pub block_size: u64,
    /// Chain length per doorbell.
    pub batch: usize,
    /// Signal every n-th request of a chain.
    pub signal_every: usize,
    /// Inline writes up to this many bytes (None: provider default).
    pub inline: Option<u32>,
    /// Staging buffers (blocks in flight).
    pub buffers: usize,
    /// Completion thread: poll, event or hybrid (default: hybrid on verbs,
    /// event on tcp).
    pub poll_mode: Option<crate::datapath::PollMode>,
    /// Pin the completion thread to this CPU.
    pub cq_cpu: Option<usize>,
    /// The data QP's ACK timeout and retry count.
    pub qp_retry: crate::datapath::QpRetry,
    pub connect_timeout: Duration,
    /// Export the data path's queue gauges, error completions, reconnects
    /// and latency here (rcpd's own metrics when it copies for a service).
    pub metrics: Option<Arc<crate::metrics::Metrics>>,
    /// TLS to rcpd's gRPC port (with a client certificate for mTLS).
    pub tls: Option<super::tls::ClientTls>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            token: None,
            transport: Transport::Auto,
            device: None,
            gid_index: None,
            block_size: DEFAULT_BLOCK_SIZE,
            batch: 32,
            signal_every: 32,
            inline: None,
            buffers: 0,
            poll_mode: None,
            cq_cpu: None,
            qp_retry: crate::datapath::QpRetry::default(),
            connect_timeout: Duration::from_secs(10),
            metrics: None,
            tls: None,
        }
    }
}

/// Per-file options.
#[derive(Clone, Debug, Default)]
pub struct FileOptions {
    /// Keep mode and mtime.
    pub preserve: bool,
    /// Continue from the manifest of an interrupted transfer.
    pub resume: bool,
    /// Push: create missing remote parent directories.
    pub create_parents: bool,
}

/// Called with the bytes of each block as it is confirmed.
pub type Progress = Arc<dyn Fn(u64) + Send + Sync>;

/// The outcome of one file.
#[derive(Clone, Debug)]
pub struct FileResult {
    /// Final path (remote path relative to the server root for a push, local
    /// path for a pull).
    pub path: String,
    pub length: u64,
    /// Bytes moved over the data path by this run (less than `length` after
    /// a resume).
    pub moved: u64,
    pub sha256: [u8; 32],
    pub seconds: f64,
    pub resumed: bool,
}

/// A connection to one rcpd.
#[derive(Clone)]
pub struct Client {
    rpc: Rpc,
    host: String,
    opts: ClientOptions,
}

/// A transfer that moves only `blocks` (virtual block indices) of window
/// `g` (whose first block is `first`), packed one after another in the
/// staging buffers: the resend of damaged pushed blocks and the re-read of
/// damaged pulled ones.
#[allow(clippy::too_many_arguments)]
fn repair_transfer(
    op: OpKind,
    g: &proto::Grant,
    blocks: &[u64],
    first: u64,
    bs: u64,
    vlen: u64,
    dp: &DataPath,
    channel: &dyn Channel,
    buffers: &[LocalSeg],
) -> Result<(Transfer, std::collections::VecDeque<Window>)> {
    let blen = |vb: u64| (vlen - vb * bs).min(bs);
    let rvlen: u64 = blocks.iter().map(|&b| blen(b)).sum();
    let windows = blocks
        .iter()
        .enumerate()
        .map(|(k, &vb)| Window {
            id: k as u64 + 1,
            remote_addr: g.addr + (vb - first) * bs,
            rkey: g.rkey,
            len: blen(vb),
            file_offset: k as u64 * bs,
            epoch: g.epoch,
        })
        .collect();
    let cfg = dp
        .config()
        .transfer_config(op, rvlen, bs, &channel.caps())
        .map_err(|e| ControlError::Usage(e.to_string()))?;
    let t = Transfer::new(cfg, buffers.to_vec())
        .map_err(|e| ControlError::Other(format!("transfer setup: {e}")))?;
    Ok((t, windows))
}

/// One grpc.health.v1 check on the gRPC port (no token needed): with TLS 1.3
/// a server that refuses the client's certificate only says so by closing
/// the connection after the handshake, and a plaintext client meets a TLS
/// server as an HTTP/2 framing error. Both are named here instead of
/// surfacing as a cancelled first request.
async fn probe(ch: &GrpcChannel, uri: &str, tls: Option<&super::tls::ClientTls>) -> Result<()> {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let r = HealthClient::new(ch.clone())
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await;
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

/// `host:port`, `[v6]:port` or `host` (default port) into a URI and the
/// bare host.
pub fn endpoint_uri(addr: &str) -> Result<(String, String)> {
    let (host, port) = if let Some(rest) = addr.strip_prefix('[') {
        let (h, after) = rest
            .split_once(']')
            .ok_or_else(|| ControlError::Usage(format!("{addr:?}: unclosed [")))?;
        let port = match after.strip_prefix(':') {
            Some(p) => p
                .parse::<u16>()
                .map_err(|_| ControlError::Usage(format!("{addr:?}: bad port")))?,
            None if after.is_empty() => DEFAULT_PORT,
            None => return Err(ControlError::Usage(format!("{addr:?}: junk after ]"))),
        };
        (format!("[{h}]"), port)
    } else {
        match addr.rsplit_once(':') {
            Some((h, p)) => (
                h.to_string(),
                p.parse::<u16>()
                    .map_err(|_| ControlError::Usage(format!("{addr:?}: bad port")))?,
            ),
            None => (addr.to_string(), DEFAULT_PORT),
        }
    };
    if host.is_empty() || host == "[]" {
        return Err(ControlError::Usage(format!("{addr:?}: empty host")));
    }
    Ok((format!("http://{host}:{port}"), host))
}

impl Client {
    /// Connect to `addr` (`host:port`, `[v6]:port`).
    pub async fn connect(addr: &str, opts: ClientOptions) -> Result<Client> {
        let (mut uri, host) = endpoint_uri(addr)?;
        if opts.tls.is_some() {
            uri = uri.replacen("http://", "https://", 1);
        }
        let mut ep = Endpoint::from_shared(uri.clone())
            .map_err(|e| ControlError::Usage(format!("{addr}: {e}")))?
            .connect_timeout(opts.connect_timeout)
            .tcp_nodelay(true);
        if let Some(t) = &opts.tls {
            ep = ep
                .tls_config(t.config(&host)?)
                .map_err(|e| ControlError::Usage(format!("TLS configuration: {e}")))?;
        }
        let ch = ep.connect().await.map_err(|e| {
            let why = source_chain(&e);
            // A handshake the server refused is not worth retrying.
            if opts.tls.is_some() && why.contains("certificate") {
                ControlError::Fatal(format!("TLS to rcpd at {uri}: {why}"))
            } else {
                ControlError::Retryable(format!("connecting to rcpd at {uri}: {why}"))
            }
        })?;
        probe(&ch, &uri, opts.tls.as_ref()).await?;
        let auth = AddBearer::new(opts.token.as_deref()).map_err(ControlError::Usage)?;
        let rpc = proto::rcp_client::RcpClient::with_interceptor(ch, auth)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        Ok(Client { rpc, host, opts })
    }

    pub fn options(&self) -> &ClientOptions {
        &self.opts
    }

    /// Metadata of a remote path (`None` if it does not exist).
    pub async fn stat(&self, path: &str) -> Result<Option<proto::Entry>> {
        let r = self
            .rpc
            .clone()
            .stat(proto::StatRequest {
                path: path.into(),
                fingerprint: false,
            })
            .await?
            .into_inner();
        Ok(if r.exists { r.entry } else { None })
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

    /// `mkdir -p` of a remote directory.
    pub async fn make_dir(&self, path: &str) -> Result<()> {
        self.rpc
            .clone()
            .make_dir(proto::MakeDirRequest { path: path.into() })
            .await?;
        Ok(())
    }

    /// Service API: ask this rcpd to copy to or from another rcpd; progress
    /// messages until the end.
    pub async fn copy(&self, req: proto::CopyRequest) -> Result<Streaming<proto::CopyProgress>> {
        Ok(self.rpc.clone().copy(req).await?.into_inner())
    }

    /// Open a session: provider, handshake, data channel.
    pub async fn session(&self) -> Result<Session> {
        let (kind, why) = resolve_transport(self.opts.transport, self.opts.device.as_deref());
        self.session_with(kind, why).await
    }

    /// [`Client::session`] with the provider already chosen.
    pub async fn session_with(&self, kind: ProviderKind, why: String) -> Result<Session> {
        let bs = self.opts.block_size;
        if !bs.is_power_of_two() || bs < 4096 {
            return Err(ControlError::Usage(format!(
                "block size {bs} must be a power of two >= 4096"
            )));
        }
        let nbuf = if self.opts.buffers > 0 {
            self.opts.buffers
        } else {
            ((32u64 << 20) / bs).clamp(4, 64) as usize
        };
        let (dev, gid, inline) = (
            self.opts.device.clone(),
            self.opts.gid_index,
            // Ask the QP for inline room; the data path clamps per WR.
            self.opts.inline.unwrap_or(64),
        );
        let link = tokio::task::spawn_blocking(move || {
            ClientLink::open(kind, dev.as_deref(), gid, bs as usize, nbuf, inline)
        })
        .await
        .map_err(|e| ControlError::Other(e.to_string()))??;
        let req = proto::HandshakeRequest {
            version_major: VERSION_MAJOR,
            version_minor: VERSION_MINOR,
            providers: vec![match kind {
                ProviderKind::Verbs => proto::Provider::Verbs as i32,
                ProviderKind::Tcp => proto::Provider::Tcp as i32,
            }],
            verbs: link.verbs_params(),
            block_size: bs,
            client_name: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_default(),
        };
        let resp = self.rpc.clone().handshake(req).await?.into_inner();
        if kind == ProviderKind::Tcp && resp.version_minor < TCP_SESSION_KEY_MINOR {
            return Err(ControlError::Fatal(format!(
                "rcpd speaks protocol {}.{}, too old for this rcp's tcp provider (session keys \
                 need {VERSION_MAJOR}.{TCP_SESSION_KEY_MINOR}); upgrade rcpd or use --transport verbs",
                resp.version_major, resp.version_minor
            )));
        }
        if resp.block_size != bs {
            return Err(ControlError::Invalid(format!(
                "server granted block size {} instead of {bs}",
                resp.block_size
            )));
        }
        let mut cfg = movement::datapath_config(
            kind,
            self.opts.batch,
            self.opts.signal_every,
            self.opts.inline,
            self.opts.poll_mode,
            self.opts.cq_cpu,
        );
        cfg.qp_retry = self.opts.qp_retry;
        let dp = DataPath::new(cfg).map_err(|e| ControlError::Usage(e.to_string()))?;
        let link = Arc::new(link);
        let host = self.host.clone();
        let (l2, r2, retry) = (link.clone(), resp.clone(), self.opts.qp_retry);
        let channel = tokio::task::spawn_blocking(move || l2.connect(&r2, &host, retry))
            .await
            .map_err(|e| ControlError::Other(e.to_string()))??;
        // Watch the port's async events so a reconnect after a link cut
        // starts as soon as the port is ACTIVE again. Best effort: without
        // it the reconnect backs off blind.
        let dp = match link
            .device
            .as_ref()
            .map(|d| PortWatcher::spawn(&d.ctx, d.port))
        {
            Some(Ok(w)) => dp.with_port_monitor(Arc::new(w)),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "cannot watch async events; reconnects back off blind");
                dp
            }
            None => dp,
        };
        let dp = Arc::new(dp);
        if let Some(m) = &self.opts.metrics {
            let (device, qp) = match (&link.device, link.verbs_params()) {
                (Some(d), Some(p)) => (d.ctx.name().to_string(), p.endpoint.map_or(0, |e| e.qpn)),
                _ => ("tcp".to_string(), resp.session_id as u32),
            };
            let sq = channel.caps().sq_depth;
            m.track(&device, qp, sq, sq, dp.stats());
        }
        Ok(Session {
            dp,
            metrics: self.opts.metrics.clone(),
            rd_atomic: resp.client_rd_atomic,
            window: resp.window_size.max(1),
            rpc: self.rpc.clone(),
            link,
            channel,
            id: resp.session_id,
            bs,
            transport: why,
            kind,
        })
    }
}

/// A session: one data channel, files moved one after another.
pub struct Session {
    dp: Arc<DataPath>,
    metrics: Option<Arc<crate::metrics::Metrics>>,
    /// Window size granted by the server.
    window: u64,
    rd_atomic: u32,
    rpc: Rpc,
    link: Arc<ClientLink>,
    channel: Arc<dyn Channel>,
    id: u64,
    bs: u64,
    /// Which provider and why (for the user).
    pub transport: String,
    pub kind: ProviderKind,
}

/// Where the async side and the data-moving thread meet.
struct Shared {
    staging: PeerSpan,
    bs: u64,
    moving: Arc<Vec<u64>>,
    grants: smpsc::Receiver<proto::Grant>,
    live: usize,
    total_blocks: u64,
    confirmed: u64,
    windows: HashMap<u64, (u64, u64)>,
    out: mpsc::UnboundedSender<ClientMsg>,
    progress: Option<Progress>,
}

const GRANT_WAIT: Duration = Duration::from_secs(300);

impl Shared {
    fn slice_off(&self, local: &LocalSeg) -> std::io::Result<usize> {
        local
            .addr
            .checked_sub(self.staging.addr())
            .map(|o| o as usize)
            .ok_or_else(|| std::io::Error::other("local segment outside staging"))
    }

    fn next_grant(&mut self) -> Option<(Window, Vec<Vec<u8>>)> {
        // Nothing live and blocks left: the next grant is on its way (the
        // server sends it after our WindowDone); wait for it.
        let g = if self.live == 0 && self.confirmed < self.total_blocks {
            self.grants.recv_timeout(GRANT_WAIT).ok()?
        } else {
            self.grants.try_recv().ok()?
        };
        self.windows.insert(g.window_id, (g.file_offset, g.len));
        self.live += 1;
        Some((
            Window {
                id: g.window_id,
                remote_addr: g.addr,
                rkey: g.rkey,
                len: g.len,
                file_offset: g.file_offset,
                epoch: g.epoch,
            },
            g.block_sha256,
        ))
    }

    fn block_done(&mut self, len: u32) {
        self.confirmed += 1;
        if let Some(p) = &self.progress {
            p(u64::from(len));
        }
    }
}

struct PushIo {
    sh: Shared,
    src: Arc<SourceFile>,
    digests: HashMap<u64, [u8; 32]>,
    hasher: Option<StreamingFileDigest>,
    /// Windows reported done: packed offset, length and block digests (kept
    /// in case the server asks for blocks again).
    sent: HashMap<u64, (u64, u64, Vec<Vec<u8>>)>,
    /// Packed length of the transfer.
    vlen: u64,
}

/// What the stream side tells the data thread after the main run.
enum Order {
    /// WRITE these blocks (transfer indices) of a window again, under the
    /// fresh grant.
    Resend {
        grant: proto::Grant,
        blocks: Vec<u64>,
    },
    /// Every window is acknowledged: nothing more to send.
    AllAcked,
}

/// Moves the blocks a server asked for again: one mini transfer over the
/// same data path, one single-block window per block.
struct RepairIo<'a> {
    staging: &'a PeerSpan,
    src: &'a SourceFile,
    bs: u64,
    /// File byte offset of each repair block.
    reals: Vec<u64>,
    windows: std::collections::VecDeque<Window>,
}

impl BlockIo for RepairIo<'_> {
    fn fill(&mut self, voff: u64, local: LocalSeg) -> std::io::Result<()> {
        let real = self.reals[(voff / self.bs) as usize];
        let o = local
            .addr
            .checked_sub(self.staging.addr())
            .ok_or_else(|| std::io::Error::other("local segment outside staging"))?;
        let src = self.src;
        span_mut_for_legacy_control(self.staging, o as usize, local.len as usize, |buf| {
            fsutil::read_exact(src, real, buf)
        })
        .ok_or_else(|| std::io::Error::other("local segment outside staging"))?
    }
    fn drain(&mut self, _: u64, _: LocalSeg) -> std::io::Result<()> {
        Ok(())
    }
    fn next_window(&mut self) -> Option<Window> {
        self.windows.pop_front()
    }
}

impl PushIo {
    /// WRITE `blocks` of the window `g` again and report the window done
    /// with its epoch.
    fn resend(
        &mut self,
        dp: &DataPath,
        channel: &dyn Channel,
        buffers: &[LocalSeg],
        g: &proto::Grant,
        mut blocks: Vec<u64>,
        reconnect: &mut dyn FnMut() -> std::result::Result<(), ReconnectError>,
    ) -> Result<()> {
        let bs = self.sh.bs;
        let (voff, len, digests) = self.sent.get(&g.window_id).cloned().ok_or_else(|| {
            ControlError::Invalid(format!("resend of unknown window {}", g.window_id))
        })?;
        let first = voff / bs;
        let end = (voff + len).div_ceil(bs);
        blocks.sort_unstable();
        blocks.dedup();
        if blocks.is_empty() || blocks.iter().any(|b| *b < first || *b >= end) {
            return Err(ControlError::Invalid(format!(
                "resend of blocks {blocks:?} outside window {}",
                g.window_id
            )));
        }
        let (mut t, windows) = repair_transfer(
            OpKind::Write,
            g,
            &blocks,
            first,
            bs,
            self.vlen,
            dp,
            channel,
            buffers,
        )?;
        let mut rio = RepairIo {
            staging: &self.sh.staging,
            src: &self.src,
            bs,
            reals: blocks
                .iter()
                .map(|&vb| self.sh.moving[vb as usize] * bs)
                .collect(),
            windows,
        };
        movement::run(dp, channel, &mut t, &mut rio, reconnect).map_err(move_err)?;
        tracing::warn!(
            window = g.window_id,
            ?blocks,
            epoch = g.epoch,
            "blocks sent again"
        );
        let _ = self.sh.out.send(ClientMsg {
            msg: Some(client_msg::Msg::WindowDone(proto::WindowDone {
                window_id: g.window_id,
                epoch: g.epoch,
                block_sha256: digests,
                ..Default::default()
            })),
        });
        Ok(())
    }
}

impl BlockIo for PushIo {
    fn fill(&mut self, voff: u64, local: LocalSeg) -> std::io::Result<()> {
        let vb = voff / self.sh.bs;
        let real = self.sh.moving[vb as usize] * self.sh.bs;
        let o = self.sh.slice_off(&local)?;
        let (src, hasher) = (&self.src, &mut self.hasher);
        let d = span_mut_for_legacy_control(
            &self.sh.staging,
            o,
            local.len as usize,
            |buf| -> std::io::Result<[u8; 32]> {
                // Straight into registered memory (O_DIRECT when aligned).
                fsutil::read_exact(src, real, buf)?;
                if let Some(h) = hasher.as_mut() {
                    fsutil::feed(h, real, buf);
                }
                Ok(files::block_digest(buf))
            },
        )
        .ok_or_else(|| std::io::Error::other("local segment outside staging"))??;
        self.digests.insert(vb, d);
        Ok(())
    }
    fn fill_chain(&mut self, blocks: &[(u64, LocalSeg)]) -> Result<(), (u64, std::io::Error)> {
        // Read every block straight into registered memory, then hash them
        // in parallel while another thread feeds the whole-file digest.
        let bs = self.sh.bs;
        let outside = |voff| (voff, std::io::Error::other("local segment outside staging"));
        let mut ranges = Vec::with_capacity(blocks.len());
        let mut reals = Vec::with_capacity(blocks.len());
        for &(voff, local) in blocks {
            let real = self.sh.moving[(voff / bs) as usize] * bs;
            let o = self.sh.slice_off(&local).map_err(|e| (voff, e))?;
            let src = &self.src;
            span_mut_for_legacy_control(&self.sh.staging, o, local.len as usize, |buf| {
                fsutil::read_exact(src, real, buf)
            })
            .ok_or_else(|| outside(voff))?
            .map_err(|e| (voff, e))?;
            ranges.push((o, local.len as usize));
            reals.push(real);
        }
        let hasher = &mut self.hasher;
        let digests = self
            .sh
            .staging
            .with_many(&ranges, |bufs| {
                files::digests_alongside(bufs, || {
                    if let Some(h) = hasher.as_mut() {
                        for (&real, b) in reals.iter().zip(bufs) {
                            fsutil::feed(h, real, b);
                        }
                    }
                })
                .0
            })
            .ok_or_else(|| outside(blocks[0].0))?;
        for (&(voff, _), d) in blocks.iter().zip(digests) {
            self.digests.insert(voff / bs, d);
        }
        Ok(())
    }
    fn drain(&mut self, _: u64, _: LocalSeg) -> std::io::Result<()> {
        Ok(())
    }
    fn block_done(&mut self, _block: u64, _off: u64, len: u32) {
        self.sh.block_done(len);
    }
    fn window_done(&mut self, id: u64) {
        self.sh.live -= 1;
        let Some((voff, len)) = self.sh.windows.remove(&id) else {
            return;
        };
        let bs = self.sh.bs;
        let digests: Vec<Vec<u8>> = (voff / bs..(voff + len).div_ceil(bs))
            .map(|b| {
                self.digests
                    .remove(&b)
                    .map(|d| d.to_vec())
                    .unwrap_or_default()
            })
            .collect();
        self.sent.insert(id, (voff, len, digests.clone()));
        let _ = self.sh.out.send(ClientMsg {
            msg: Some(client_msg::Msg::WindowDone(proto::WindowDone {
                window_id: id,
                epoch: 0,
                block_sha256: digests,
                ..Default::default()
            })),
        });
    }
    fn next_window(&mut self) -> Option<Window> {
        self.sh.next_grant().map(|(w, _)| w)
    }
}

/// Times a pulled block is read again after a digest mismatch before the
/// copy fails (the server enforces the same bound).
const MAX_REREADS: u32 = 3;

/// Test-only fault injection, off unless this variable is set: the first N
/// pulled blocks checked (first reads and re-reads alike) get one byte
/// flipped in local memory before their digest is checked, as if damaged
/// on the way.
const FAULT_ENV: &str = "RCP_TEST_CORRUPT_PULLED_BLOCKS";

fn pull_faults() -> u32 {
    std::env::var(FAULT_ENV)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The test fault of [`FAULT_ENV`]: damage the block at `o` if any fault
/// is left.
fn inject_fault(
    staging: &PeerSpan,
    o: usize,
    len: usize,
    real_block: u64,
    faults: &mut u32,
) -> std::io::Result<()> {
    if *faults > 0 && len > 0 {
        *faults -= 1;
        span_mut_for_legacy_control(staging, o, len, |b| b[0] ^= 0x5a)
            .ok_or_else(|| std::io::Error::other("local segment outside staging"))?;
        tracing::warn!(block = real_block, "test fault: damaged a pulled block");
    }
    Ok(())
}

/// Check a pulled block in `staging` against `want` (its digest `got` when
/// already computed); write it if it matches. `Ok(false)`: it does not
/// match (nothing written).
#[allow(clippy::too_many_arguments)]
fn check_pulled(
    staging: &PeerSpan,
    o: usize,
    len: usize,
    want: &[u8],
    got: Option<[u8; 32]>,
    dest: &mut PulledWriter,
    real_block: u64,
    faults: &mut u32,
) -> std::io::Result<bool> {
    let outside = || std::io::Error::other("local segment outside staging");
    if got.is_none() {
        inject_fault(staging, o, len, real_block, faults)?;
    }
    staging
        .with(o, len, |buf| -> std::io::Result<bool> {
            let got = got.unwrap_or_else(|| files::block_digest(buf));
            if got[..] != want[..] {
                return Ok(false);
            }
            dest.write(real_block, buf, got)?;
            Ok(true)
        })
        .ok_or_else(outside)?
}

/// Pulled, verified blocks written behind: copied out of the staging
/// buffers (the data path reuses them once a chain is drained) into
/// recycled buffers, then written and fed to the whole-file digest on a
/// writer thread while the next chain is read and checked.
struct PulledWriter {
    wb: WriteBehind,
    free: Arc<Mutex<Vec<Vec<u8>>>>,
}

/// Bytes of pulled blocks queued for the writer at most.
const WRITE_BEHIND_BYTES: u64 = 16 << 20;

impl PulledWriter {
    fn new(dest: Destination) -> std::io::Result<Self> {
        let depth = (WRITE_BEHIND_BYTES / dest.block_size().max(1)).max(2) as usize;
        Ok(PulledWriter {
            wb: WriteBehind::spawn(dest, depth)?,
            free: Arc::default(),
        })
    }
    fn write(&mut self, real_block: u64, data: &[u8], got: [u8; 32]) -> std::io::Result<()> {
        let mut buf = self.free.lock().unwrap().pop().unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(data);
        let free = self.free.clone();
        self.wb
            .submit(Box::new(move |d: &mut Destination| {
                let r = d.write_block(real_block, &buf, got);
                free.lock().unwrap().push(buf);
                r
            }))
            .map_err(|e| std::io::Error::other(e.to_string()))
    }
    /// Wait for every queued block; the destination, ready to commit.
    fn finish(self) -> Result<Destination> {
        Ok(self.wb.finish()?)
    }
}

struct PullIo {
    sh: Shared,
    dest: PulledWriter,
    expected: HashMap<u64, Vec<u8>>,
    /// Packed length of the transfer.
    vlen: u64,
    /// Damaged blocks (transfer indices) per window, not yet reported.
    bad: HashMap<u64, Vec<u64>>,
    /// Blocks asked for again, per window, until the new grant comes.
    rereading: HashMap<u64, Vec<u64>>,
    /// Blocks read again so far (each attempt counts).
    pub rereads: u64,
    faults: u32,
}

impl BlockIo for PullIo {
    fn fill(&mut self, _: u64, _: LocalSeg) -> std::io::Result<()> {
        Ok(())
    }
    fn drain(&mut self, voff: u64, local: LocalSeg) -> std::io::Result<()> {
        self.settle(voff, local, None)
    }
    fn drain_chain(&mut self, blocks: &[(u64, LocalSeg)]) -> Result<(), (u64, std::io::Error)> {
        // Damage first (test faults), then every block's digest in
        // parallel, then check and write them in order.
        let mut ranges = Vec::with_capacity(blocks.len());
        for &(voff, local) in blocks {
            let real_block = self.sh.moving[(voff / self.sh.bs) as usize];
            let o = self.sh.slice_off(&local).map_err(|e| (voff, e))?;
            let n = local.len as usize;
            inject_fault(&self.sh.staging, o, n, real_block, &mut self.faults)
                .map_err(|e| (voff, e))?;
            ranges.push((o, n));
        }
        let digests = self
            .sh
            .staging
            .with_many(&ranges, files::digest_blocks_parallel)
            .ok_or_else(|| {
                (
                    blocks[0].0,
                    std::io::Error::other("local segment outside staging"),
                )
            })?;
        for (&(voff, local), d) in blocks.iter().zip(digests) {
            self.settle(voff, local, Some(d)).map_err(|e| (voff, e))?;
        }
        Ok(())
    }
    fn block_done(&mut self, _block: u64, _off: u64, len: u32) {
        self.sh.block_done(len);
    }
    fn window_done(&mut self, id: u64) {
        self.pull_window_done(id);
    }
    fn next_window(&mut self) -> Option<Window> {
        self.pull_next_window()
    }
}

impl PullIo {
    /// Check a pulled block (its digest `got` if already computed) and write
    /// it, or note it for a re-read under its window.
    fn settle(&mut self, voff: u64, local: LocalSeg, got: Option<[u8; 32]>) -> std::io::Result<()> {
        let vb = voff / self.sh.bs;
        let real_block = self.sh.moving[vb as usize];
        let want = self.expected.remove(&vb).unwrap_or_default();
        let o = self.sh.slice_off(&local)?;
        let ok = check_pulled(
            &self.sh.staging,
            o,
            local.len as usize,
            &want,
            got,
            &mut self.dest,
            real_block,
            &mut self.faults,
        )?;
        if !ok {
            let window = self
                .sh
                .windows
                .iter()
                .find(|(_, &(off, len))| voff >= off && voff < off + len)
                .map(|(&id, _)| id)
                .ok_or_else(|| std::io::Error::other(format!("block {vb} outside any window")))?;
            tracing::warn!(
                block = real_block,
                window,
                "pulled block does not match the server's digest: reading it again"
            );
            self.bad.entry(window).or_default().push(vb);
        }
        Ok(())
    }
    fn pull_window_done(&mut self, id: u64) {
        self.sh.live -= 1;
        self.sh.windows.remove(&id);
        let mut reread = self.bad.remove(&id).unwrap_or_default();
        reread.sort_unstable();
        reread.dedup();
        if !reread.is_empty() {
            self.rereading.insert(id, reread.clone());
        }
        let _ = self.sh.out.send(ClientMsg {
            msg: Some(client_msg::Msg::WindowDone(proto::WindowDone {
                window_id: id,
                epoch: 0,
                block_sha256: Vec::new(),
                reread_blocks: reread,
            })),
        });
    }
    fn pull_next_window(&mut self) -> Option<Window> {
        let (w, ds) = self.sh.next_grant()?;
        let first = w.file_offset / self.sh.bs;
        for (i, d) in ds.into_iter().enumerate() {
            self.expected.insert(first + i as u64, d);
        }
        Some(w)
    }
}

/// Reads damaged blocks again under a window's new grant: one mini
/// transfer over the same data path, one single-block window per block.
struct RereadIo<'a> {
    staging: &'a PeerSpan,
    dest: &'a mut PulledWriter,
    bs: u64,
    /// Per re-read block: transfer index, file block, expected digest.
    blocks: Vec<(u64, u64, Vec<u8>)>,
    still_bad: Vec<u64>,
    faults: &'a mut u32,
    windows: std::collections::VecDeque<Window>,
}

impl BlockIo for RereadIo<'_> {
    fn fill(&mut self, _: u64, _: LocalSeg) -> std::io::Result<()> {
        Ok(())
    }
    fn drain(&mut self, voff: u64, local: LocalSeg) -> std::io::Result<()> {
        let (vb, real, want) = &self.blocks[(voff / self.bs) as usize];
        let o = local
            .addr
            .checked_sub(self.staging.addr())
            .ok_or_else(|| std::io::Error::other("local segment outside staging"))?;
        let ok = check_pulled(
            self.staging,
            o as usize,
            local.len as usize,
            want,
            None,
            self.dest,
            *real,
            self.faults,
        )?;
        if !ok {
            self.still_bad.push(*vb);
        }
        Ok(())
    }
    fn next_window(&mut self) -> Option<Window> {
        self.windows.pop_front()
    }
}

impl PullIo {
    /// READ the blocks asked for again under the window's new grant `g`,
    /// then report the window done (or ask again, up to [`MAX_REREADS`]).
    fn reread(
        &mut self,
        dp: &DataPath,
        channel: &dyn Channel,
        buffers: &[LocalSeg],
        g: &proto::Grant,
        reconnect: &mut dyn FnMut() -> std::result::Result<(), ReconnectError>,
    ) -> Result<()> {
        let bs = self.sh.bs;
        let blocks = self.rereading.remove(&g.window_id).ok_or_else(|| {
            ControlError::Invalid(format!(
                "grant of window {} epoch {} that was not asked for",
                g.window_id, g.epoch
            ))
        })?;
        let first = g.file_offset / bs;
        if g.block_sha256.len() != blocks.len()
            || blocks
                .iter()
                .any(|&b| b < first || b >= (g.file_offset + g.len).div_ceil(bs))
        {
            return Err(ControlError::Invalid(format!(
                "window {} granted again with {} digests for blocks {blocks:?}",
                g.window_id,
                g.block_sha256.len()
            )));
        }
        let (mut t, windows) = repair_transfer(
            OpKind::Read,
            g,
            &blocks,
            first,
            bs,
            self.vlen,
            dp,
            channel,
            buffers,
        )?;
        self.rereads += blocks.len() as u64;
        let mut rio = RereadIo {
            staging: &self.sh.staging,
            dest: &mut self.dest,
            bs,
            blocks: blocks
                .iter()
                .zip(&g.block_sha256)
                .map(|(&vb, d)| (vb, self.sh.moving[vb as usize], d.clone()))
                .collect(),
            still_bad: Vec::new(),
            faults: &mut self.faults,
            windows,
        };
        movement::run(dp, channel, &mut t, &mut rio, reconnect).map_err(move_err)?;
        let still_bad = rio.still_bad;
        tracing::warn!(
            window = g.window_id,
            ?blocks,
            epoch = g.epoch,
            damaged_again = still_bad.len(),
            "blocks read again"
        );
        if !still_bad.is_empty() {
            if g.epoch >= MAX_REREADS {
                return Err(ControlError::Integrity(format!(
                    "block(s) {:?} still do not match the server's digest after {MAX_REREADS} re-reads",
                    still_bad
                        .iter()
                        .map(|&vb| self.sh.moving[vb as usize])
                        .collect::<Vec<_>>()
                )));
            }
            self.rereading.insert(g.window_id, still_bad.clone());
        }
        let _ = self.sh.out.send(ClientMsg {
            msg: Some(client_msg::Msg::WindowDone(proto::WindowDone {
                window_id: g.window_id,
                epoch: g.epoch,
                block_sha256: Vec::new(),
                reread_blocks: still_bad,
            })),
        });
        Ok(())
    }
}

fn move_err(e: movement::MoveError) -> ControlError {
    match e {
        movement::MoveError::Io { source, .. }
            if source.kind() == std::io::ErrorKind::InvalidData =>
        {
            ControlError::Integrity(source.to_string())
        }
        movement::MoveError::Io {
            file_offset,
            source,
        } => ControlError::Io {
            context: format!("block I/O at offset {file_offset}"),
            source,
        },
        e => ControlError::DataPath(e.to_string()),
    }
}

fn first_reply(m: Option<ServerMsg>) -> Result<proto::Opened> {
    match m {
        Some(ServerMsg {
            msg: Some(server_msg::Msg::Opened(o)),
        }) => Ok(o),
        Some(other) => Err(ControlError::Invalid(format!(
            "expected Opened, got {other:?}"
        ))),
        None => Err(ControlError::Retryable(
            "the server closed the stream".into(),
        )),
    }
}

impl Session {
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn block_size(&self) -> u64 {
        self.bs
    }

    /// The data path's reconnect callback: verbs resets the QP, exchanges
    /// fresh endpoints with `Reconnect` and connects again; a TCP channel
    /// cannot be replaced under a running transfer (the caller resumes).
    fn reconnector(&self) -> impl FnMut() -> std::result::Result<(), ReconnectError> + Send {
        let vc = self.link.verbs_channel.clone();
        let rpc = self.rpc.clone();
        let (id, rd) = (self.id, self.rd_atomic);
        let retry = self.dp.config().qp_retry;
        let handle = tokio::runtime::Handle::current();
        let mut epoch = 0u32;
        move || {
            let Some(vc) = &vc else {
                return Err("the TCP data connection broke; rerun with --resume".into());
            };
            let ep = vc.reset()?;
            epoch += 1;
            let resp = handle.block_on(rpc.clone().reconnect(proto::ReconnectRequest {
                session_id: id,
                endpoint: Some(ep_to_proto(&ep)),
                epoch,
            }))?;
            let sep = resp
                .into_inner()
                .endpoint
                .ok_or("the server sent no endpoint")?;
            vc.handshake(&ep_from_proto(&sep)?, &connect_params(rd, rd, retry))?;
            tracing::info!(epoch, "reconnected");
            Ok(())
        }
    }

    fn transfer(&self, op: OpKind, vlen: u64) -> Result<Transfer> {
        let cfg = self
            .dp
            .config()
            .transfer_config(op, vlen, self.bs, &self.channel.caps())
            .map_err(|e| ControlError::Usage(e.to_string()))?;
        Transfer::new(cfg, self.link.buffers.clone())
            .map_err(|e| ControlError::Other(format!("transfer setup: {e}")))
    }

    fn shared(
        &self,
        moving: Arc<Vec<u64>>,
        grants: smpsc::Receiver<proto::Grant>,
        out: mpsc::UnboundedSender<ClientMsg>,
        progress: Option<Progress>,
    ) -> Shared {
        Shared {
            staging: self.link.staging.clone(),
            bs: self.bs,
            total_blocks: moving.len() as u64,
            moving,
            grants,
            live: 0,
            confirmed: 0,
            windows: HashMap::new(),
            out,
            progress,
        }
    }

    /// Push one local file to `remote` (a path beneath the server root; an
    /// existing directory means "inside it").
    pub async fn push_file(
        &mut self,
        local: &Path,
        remote: &str,
        fo: FileOptions,
        progress: Option<Progress>,
    ) -> Result<FileResult> {
        let start = Instant::now();
        if std::fs::metadata(local).is_ok_and(|m| m.is_dir()) {
            return Err(ControlError::Usage(format!(
                "{} is a directory (use -r)",
                local.display()
            )));
        }
        let l = local.to_path_buf();
        let src = Arc::new(
            tokio::task::spawn_blocking(move || SourceFile::open(&l))
                .await
                .map_err(|e| ControlError::Other(e.to_string()))??,
        );
        let length = src.len();
        let name = local
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let (out, out_rx) = mpsc::unbounded_channel();
        let open = proto::Open {
            session_id: self.id,
            direction: proto::Direction::Push as i32,
            path: remote.to_string(),
            name,
            length,
            block_size: self.bs,
            mode: src.mode(),
            mtime_ns: fsutil::ns_from_ts(src.mtime()),
            preserve: fo.preserve,
            resume: fo.resume,
            create_parents: fo.create_parents,
            source_fingerprint: src.source_id().fingerprint.to_vec(),
            ..Default::default()
        };
        out.send(ClientMsg {
            msg: Some(client_msg::Msg::Open(open)),
        })
        .map_err(|_| ControlError::Other("stream closed".into()))?;
        let mut inbound = self
            .rpc
            .transfer(UnboundedReceiverStream::new(out_rx))
            .await?
            .into_inner();
        let opened = first_reply(inbound.message().await?)?;
        let skip = if opened.skip_blocks.is_empty() {
            None
        } else {
            Some(
                Bitmap::from_bytes(opened.skip_blocks.clone(), length.div_ceil(self.bs))
                    .ok_or_else(|| ControlError::Invalid("bad skip bitmap".into()))?,
            )
        };
        let moving = Arc::new(moving_blocks(length, self.bs, skip.as_ref()));
        let vlen = packed_len(length, self.bs, &moving);
        let (gtx, grx) = smpsc::channel();
        let mut io = PushIo {
            sh: self.shared(moving, grx, out.clone(), progress),
            src: src.clone(),
            digests: HashMap::new(),
            hasher: (!opened.resumed).then(|| StreamingFileDigest::new(Some(length), 64 << 20)),
            sent: HashMap::new(),
            vlen,
        };
        let total_windows = vlen.div_ceil(self.window);
        let (otx, orx) = smpsc::channel::<Order>();
        let buffers = self.link.buffers.clone();
        let mut transfer = self.transfer(OpKind::Write, vlen)?;
        let channel = self.channel.clone();
        let (dp, mut reconnect) = (self.dp.clone(), self.reconnector());
        let metrics = self.metrics.clone();
        let runner = tokio::task::spawn_blocking(move || {
            let moved = movement::run(&dp, &*channel, &mut transfer, &mut io, &mut reconnect)
                .map_err(move_err)?;
            if let Some(m) = &metrics {
                m.datapath_report("push", &moved.report);
            }
            // Blocks the server found damaged go again until every window
            // is acknowledged.
            while let Ok(Order::Resend { grant, blocks }) = orx.recv() {
                io.resend(&dp, &*channel, &buffers, &grant, blocks, &mut reconnect)?;
            }
            io.src.check_unchanged()?;
            let digest = match io.hasher.take() {
                Some(h) => h.finish().map_err(files::FileError::from)?,
                None => fsutil::whole_file_digest(&io.src)?,
            };
            Ok((moved, digest))
        });
        let (moved, digest, committed) = drive(
            &mut inbound,
            gtx,
            runner,
            &out,
            Some(|d: &[u8; 32]| d.to_vec()),
            Some((otx, total_windows)),
        )
        .await?;
        let committed = committed.expect("push ends with Committed");
        if committed.sha256[..] != digest[..] {
            return Err(ControlError::Integrity(format!(
                "server digest {} differs from ours {}",
                hex::encode(&committed.sha256),
                hex::encode(digest)
            )));
        }
        Ok(FileResult {
            path: committed.path,
            length,
            moved: moved.bytes,
            sha256: digest,
            seconds: start.elapsed().as_secs_f64(),
            resumed: opened.resumed,
        })
    }

    /// Pull `remote` (a file beneath the server root) to `local` (the final
    /// local path: callers resolve "into a directory").
    pub async fn pull_file(
        &mut self,
        remote: &str,
        local: &Path,
        fo: FileOptions,
        progress: Option<Progress>,
    ) -> Result<FileResult> {
        let start = Instant::now();
        let parent = local
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        if !parent.is_dir() {
            if fo.create_parents {
                std::fs::create_dir_all(&parent)
                    .map_err(ControlError::io(format!("creating {}", parent.display())))?;
            } else {
                return Err(ControlError::DirNotFound(parent.display().to_string()));
            }
        }
        let name = local
            .file_name()
            .ok_or_else(|| ControlError::Usage(format!("{} has no file name", local.display())))?
            .to_os_string();
        let dir = DirHandle::open(&parent)?;
        let bs = self.bs;
        let opts = |preserve: Option<Preserve>| DestinationOptions {
            block_size: bs,
            preserve,
            ..DestinationOptions::default()
        };
        // With --resume: the remote file's identity, and what we hold of it.
        let mut resumed_dest = None;
        let mut have = (Vec::new(), 0u64, 0i64, Vec::new());
        if fo.resume {
            let st = self
                .rpc
                .stat(proto::StatRequest {
                    path: remote.to_string(),
                    fingerprint: true,
                })
                .await?
                .into_inner();
            if let Some(e) = st
                .entry
                .filter(|e| e.r#type == proto::FileType::File as i32)
            {
                let sid = fsutil::source_id(e.length, e.mtime_ns, &e.fingerprint);
                let pres = fo.preserve.then(|| Preserve {
                    mode: e.mode,
                    mtime: fsutil::ts_from_ns(e.mtime_ns),
                });
                let (d2, n2, o2) = (dir.try_clone()?, name.clone(), opts(pres));
                let d =
                    tokio::task::spawn_blocking(move || Destination::resume(&d2, &n2, &sid, o2))
                        .await
                        .map_err(|e| ControlError::Other(e.to_string()))??;
                if let Some(d) = d {
                    let bits = Bitmap::all_but(d.block_count(), &d.missing_blocks());
                    have = (bits.bits, e.length, e.mtime_ns, e.fingerprint.clone());
                    resumed_dest = Some(d);
                }
            }
        }
        let (out, out_rx) = mpsc::unbounded_channel();
        let open = proto::Open {
            session_id: self.id,
            direction: proto::Direction::Pull as i32,
            path: remote.to_string(),
            block_size: self.bs,
            resume: resumed_dest.is_some(),
            have_blocks: have.0,
            have_length: have.1,
            have_mtime_ns: have.2,
            have_fingerprint: have.3,
            ..Default::default()
        };
        out.send(ClientMsg {
            msg: Some(client_msg::Msg::Open(open)),
        })
        .map_err(|_| ControlError::Other("stream closed".into()))?;
        let mut inbound = self
            .rpc
            .transfer(UnboundedReceiverStream::new(out_rx))
            .await?
            .into_inner();
        let opened = first_reply(inbound.message().await?)?;
        let length = opened.length;
        let blocks = length.div_ceil(self.bs);
        let dest = match (resumed_dest, opened.resumed) {
            (Some(d), true) => d,
            (d, _) => {
                drop(d);
                let sid = fsutil::source_id(length, opened.mtime_ns, &opened.source_fingerprint);
                let pres = fo.preserve.then(|| Preserve {
                    mode: opened.mode,
                    mtime: fsutil::ts_from_ns(opened.mtime_ns),
                });
                let o = DestinationOptions {
                    resume: Some(sid),
                    ..opts(pres)
                };
                Destination::create(&dir, &name, length, o)?
            }
        };
        let skip = if opened.resumed {
            Some(
                Bitmap::from_bytes(opened.skip_blocks.clone(), blocks)
                    .ok_or_else(|| ControlError::Invalid("bad skip bitmap".into()))?,
            )
        } else {
            None
        };
        let moving = Arc::new(moving_blocks(length, self.bs, skip.as_ref()));
        let vlen = packed_len(length, self.bs, &moving);
        let (gtx, grx) = smpsc::channel();
        let mut io = PullIo {
            sh: self.shared(moving, grx, out.clone(), progress),
            dest: PulledWriter::new(dest)
                .map_err(|e| ControlError::Other(format!("cannot start the writer thread: {e}")))?,
            expected: HashMap::new(),
            vlen,
            bad: HashMap::new(),
            rereading: HashMap::new(),
            rereads: 0,
            faults: pull_faults(),
        };
        let (otx, orx) = smpsc::channel::<Order>();
        let buffers = self.link.buffers.clone();
        let mut transfer = self.transfer(OpKind::Read, vlen)?;
        let channel = self.channel.clone();
        let (dp, mut reconnect) = (self.dp.clone(), self.reconnector());
        let metrics = self.metrics.clone();
        let runner = tokio::task::spawn_blocking(move || {
            let moved = movement::run(&dp, &*channel, &mut transfer, &mut io, &mut reconnect)
                .map_err(move_err)?;
            if let Some(m) = &metrics {
                m.datapath_report("pull", &moved.report);
            }
            // Blocks that arrived damaged are read again, under the new
            // grant of their window, until the server has every window back.
            while let Ok(Order::Resend { grant, .. }) = orx.recv() {
                io.reread(&dp, &*channel, &buffers, &grant, &mut reconnect)?;
            }
            if io.rereads > 0 {
                tracing::warn!(
                    blocks = io.rereads,
                    "pulled blocks read again after a digest mismatch"
                );
            }
            Ok((moved, io.dest.finish()?))
        });
        let (moved, dest, committed) = drive(
            &mut inbound,
            gtx,
            runner,
            &out,
            None::<fn(&Destination) -> Vec<u8>>,
            Some((otx, u64::MAX)),
        )
        .await?;
        let committed = committed.expect("pull ends with Committed");
        let expected: [u8; 32] = committed
            .sha256
            .as_slice()
            .try_into()
            .map_err(|_| ControlError::Invalid("the server digest is not 32 bytes".into()))?;
        // Verifies the whole-file digest, applies -p, fsyncs, renames.
        let digest = tokio::task::spawn_blocking(move || dest.commit(expected))
            .await
            .map_err(|e| ControlError::Other(e.to_string()))??;
        let _ = out.send(ClientMsg {
            msg: Some(client_msg::Msg::Commit(proto::Commit {
                sha256: digest.to_vec(),
            })),
        });
        drop(out);
        // Let the server see the commit and end its side.
        let _ = tokio::time::timeout(Duration::from_secs(5), inbound.message()).await;
        Ok(FileResult {
            path: local.display().to_string(),
            length,
            moved: moved.bytes,
            sha256: digest,
            seconds: start.elapsed().as_secs_f64(),
            resumed: opened.resumed,
        })
    }

    /// Release the server's resources for this session.
    pub async fn close(mut self) -> Result<()> {
        self.rpc
            .close_session(proto::CloseSessionRequest {
                session_id: self.id,
            })
            .await?;
        Ok(())
    }
}

type Runner<T> = tokio::task::JoinHandle<Result<(Moved, T)>>;

/// Run the stream side of a transfer while the data moves on `runner`.
/// `commit_with`: push sends Commit with this digest once every window is
/// acknowledged.
async fn drive<T>(
    inbound: &mut Streaming<ServerMsg>,
    grants: smpsc::Sender<proto::Grant>,
    runner: Runner<T>,
    out: &mpsc::UnboundedSender<ClientMsg>,
    commit_with: Option<impl Fn(&T) -> Vec<u8>>,
    orders: Option<(smpsc::Sender<Order>, u64)>,
) -> Result<(Moved, T, Option<proto::Committed>)> {
    let mut resend: HashMap<u64, Vec<u64>> = HashMap::new();
    if let Some((o, 0)) = &orders {
        let _ = o.send(Order::AllAcked);
    }
    tokio::pin!(runner);
    let mut done: Option<(Moved, T)> = None;
    let mut committed: Option<proto::Committed> = None;
    let (mut granted, mut acked) = (0u64, 0u64);
    let mut commit_sent = false;
    let abort = |reason: String| {
        let _ = out.send(ClientMsg {
            msg: Some(client_msg::Msg::Abort(proto::Abort { reason })),
        });
    };
    loop {
        if let (Some(f), false) = (&commit_with, commit_sent) {
            if let Some((_, d)) = &done {
                if granted == acked {
                    let _ = out.send(ClientMsg {
                        msg: Some(client_msg::Msg::Commit(proto::Commit { sha256: f(d) })),
                    });
                    commit_sent = true;
                }
            }
        }
        if let (Some(_), Some(_)) = (&done, &committed) {
            let (m, d) = done.take().expect("checked");
            return Ok((m, d, committed));
        }
        tokio::select! {
            r = &mut runner, if done.is_none() => {
                match r.map_err(|e| ControlError::Other(format!("data path thread: {e}")))? {
                    Ok(v) => done = Some(v),
                    Err(e) => { abort(e.to_string()); return Err(e); }
                }
            }
            m = inbound.message() => {
                let m = match m {
                    Ok(m) => m,
                    Err(s) => { runner.abort(); return Err(ControlError::Status(s)); }
                };
                match m.and_then(|m| m.msg) {
                    Some(server_msg::Msg::Grant(g)) if g.epoch > 0 => {
                        // A window granted again: push, for blocks the
                        // server asked for; pull, for blocks we asked for
                        // (the data thread knows which).
                        let blocks = match commit_with {
                            Some(_) => resend.remove(&g.window_id),
                            None => Some(Vec::new()),
                        };
                        let (Some((o, _)), Some(blocks)) = (&orders, blocks)
                        else {
                            let e = ControlError::Invalid(format!(
                                "unexpected grant of window {} epoch {}",
                                g.window_id, g.epoch
                            ));
                            abort(e.to_string());
                            return Err(e);
                        };
                        let _ = o.send(Order::Resend { grant: g, blocks });
                    }
                    Some(server_msg::Msg::Grant(g)) => {
                        granted += 1;
                        let _ = grants.send(g);
                    }
                    Some(server_msg::Msg::Ack(a)) => {
                        if !a.resend_blocks.is_empty() {
                            if orders.is_none() {
                                let e = ControlError::Integrity(format!(
                                    "server asks to resend blocks {:?} of window {}",
                                    a.resend_blocks, a.window_id
                                ));
                                abort(e.to_string());
                                return Err(e);
                            }
                            resend.insert(a.window_id, a.resend_blocks);
                            continue;
                        }
                        acked += 1;
                        if let Some((o, total)) = &orders {
                            if acked == *total {
                                let _ = o.send(Order::AllAcked);
                            }
                        }
                    }
                    Some(server_msg::Msg::Committed(c)) => {
                        committed = Some(c);
                        // Pull: the server has every window back.
                        if let (None, Some((o, _))) = (&commit_with, &orders) {
                            let _ = o.send(Order::AllAcked);
                        }
                    }
                    Some(server_msg::Msg::Opened(_)) => {
                        return Err(ControlError::Invalid("Opened sent twice".into()));
                    }
                    None => {
                        if done.is_some() && committed.is_some() { continue; }
                        return Err(ControlError::Retryable(
                            "the server ended the transfer stream early".into(),
                        ));
                    }
                }
            }
        }
    }
}

/// Resolve the final local path of a pull: inside `local` if it is a
/// directory.
pub fn local_target(local: &Path, remote: &str) -> PathBuf {
    if local.is_dir() {
        let base = Path::new(remote.trim_end_matches('/'))
            .file_name()
            .map(|n| n.to_os_string())
            .unwrap_or_default();
        local.join(base)
    } else {
        local.to_path_buf()
    }
}

#[cfg(test)]
mod tests {
    use super::endpoint_uri;

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
        assert!(endpoint_uri("node:x").is_err());
        assert!(endpoint_uri("[::1").is_err());
        assert!(endpoint_uri(":1").is_err());
    }
}
