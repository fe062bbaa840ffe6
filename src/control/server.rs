//! The rcpd service: sessions, window grants, verification, commit.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::Stream;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::error::{ControlError, Result};
use super::fsutil::{self, Bitmap};
use super::link::{connect_params, ep_from_proto, ServerLink};
use super::{
    Stats, DEFAULT_BLOCK_SIZE, MAX_FILE_LEN, TCP_SESSION_KEY_MINOR, VERSION_MAJOR, VERSION_MINOR,
};
// The server's QPs only respond (the client issues every request): their
// retry count never matters.
use crate::datapath::legacy::span_mut_for_legacy_control;
use crate::datapath::QpRetry;
use crate::files::{
    self, Destination, DestinationOptions, DirHandle, FileError, FileKind, PathError, Preserve,
    Root, SourceFile, StreamingFileDigest, WriteBehind,
};
use crate::mem::{Block, PeerSpan};
use crate::proto::{self, client_msg, server_msg, ClientMsg, Direction, ServerMsg};
use crate::provider::tcp::SessionBinding;
use crate::provider::{Access, Domain, ProviderKind, Registration};
use crate::verbs::{QpEndpoint, VerbsChannel};

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    pub root: PathBuf,
    pub max_transfers: usize,
    pub windows_per_transfer: u32,
    /// Client settings used when this server acts as a client (Copy).
    pub copy_client: super::client::ClientOptions,
    /// How long a stream may sit without a message before it is dropped.
    pub idle_timeout: Duration,
}

struct Session {
    kind: ProviderKind,
    block_size: u64,
    /// The session's own protection domain: its transfers' windows are
    /// registered here, and only its QP / data connections reach it, so an
    /// rkey granted to this session is useless on any other.
    domain: Arc<dyn Domain>,
    /// TCP: the key binding the session's data connections to `domain`.
    _tcp_binding: Option<SessionBinding>,
    qp: Option<Mutex<VerbsChannel>>,
    /// The negotiated (initiator, responder) depths, reused on reconnect.
    rd: (u32, u32),
    epoch: AtomicU64,
    /// Transfers running on it, and when it was last used: sessions of
    /// clients that vanished without CloseSession are reaped when idle.
    active: AtomicU64,
    last_used: Mutex<std::time::Instant>,
}

/// A session unused this long (and with nothing running) is closed.
const SESSION_IDLE: Duration = Duration::from_secs(30 * 60);

/// Shared state of the service.
pub struct Service {
    cfg: ServiceConfig,
    link: Arc<ServerLink>,
    root: Root,
    sessions: Mutex<HashMap<u64, Arc<Session>>>,
    transfers: Arc<Semaphore>,
    slots: Arc<Semaphore>,
    next_id: AtomicU64,
    pub stats: Arc<Stats>,
    /// The exported metrics (`crate::metrics`): transfers, bytes, throughput.
    pub metrics: Arc<crate::metrics::Metrics>,
}

const MAX_SESSIONS: usize = 4096;

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).expect("getrandom");
    u64::from_ne_bytes(b) | 1
}

/// Check a block size: power of two, 4 KiB ..= `max`.
pub fn check_block_size(bs: u64, max: u64) -> Result<u64> {
    if bs == 0 {
        return Ok(DEFAULT_BLOCK_SIZE.min(max));
    }
    if !bs.is_power_of_two() || bs < 4096 || bs > max {
        return Err(ControlError::Invalid(format!(
            "block size {bs} must be a power of two between 4096 and {max}"
        )));
    }
    Ok(bs)
}

/// Blocks that move: every block not set in `skip`, in order.
pub fn moving_blocks(length: u64, bs: u64, skip: Option<&Bitmap>) -> Vec<u64> {
    let n = length.div_ceil(bs);
    (0..n)
        .filter(|&b| !skip.is_some_and(|s| s.get(b)))
        .collect()
}

/// The transfer's packed length: `moving` blocks of `bs`, the file's last
/// block possibly short.
pub fn packed_len(length: u64, bs: u64, moving: &[u64]) -> u64 {
    match moving.last() {
        None => 0,
        Some(&last) => {
            let last_len = (length - last * bs).min(bs);
            (moving.len() as u64 - 1) * bs + last_len
        }
    }
}

struct Win {
    reg: Option<Arc<dyn Registration>>,
    span: PeerSpan,
    _block: Block,
    _permit: OwnedSemaphorePermit,
    /// Packed offset and length.
    voff: u64,
    len: u64,
    /// 0 for the first grant; n after the n-th request to resend blocks.
    epoch: u32,
}

/// Requests to resend a window's mismatched blocks before the transfer fails.
const MAX_RESENDS: u32 = 3;

/// Fills a window before it is granted (pull); returns block digests.
type FillFn<'a> = dyn FnMut(&PeerSpan, u64, u64) -> Result<Vec<Vec<u8>>> + Send + 'a;

type Tx = mpsc::Sender<std::result::Result<ServerMsg, Status>>;

fn msg(m: server_msg::Msg) -> std::result::Result<ServerMsg, Status> {
    Ok(ServerMsg { msg: Some(m) })
}

fn in_place<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

impl Service {
    /// Grant window `id` again for blocks to move once more: the next
    /// epoch, a fresh registration (the old rkey is revoked when `w.reg` is
    /// replaced) and the digests the client checks (pull).
    fn regrant(
        &self,
        domain: &dyn crate::provider::Domain,
        id: u64,
        w: &mut Win,
        access: Access,
        block_sha256: Vec<Vec<u8>>,
    ) -> Result<proto::Grant> {
        w.epoch += 1;
        let reg = self.register(domain, &w.span, access)?;
        let g = proto::Grant {
            window_id: id,
            addr: reg.addr(),
            rkey: reg.rkey(),
            len: w.len,
            file_offset: w.voff,
            epoch: w.epoch,
            block_sha256,
        };
        w.reg = Some(reg);
        Ok(g)
    }

    /// Register a window slice, counting refusals for lack of lockable
    /// memory in rcp_memlock_failures_total.
    fn register(
        &self,
        domain: &dyn crate::provider::Domain,
        span: &PeerSpan,
        access: Access,
    ) -> Result<Arc<dyn Registration>> {
        domain.register(span, access).map_err(|e| {
            if let crate::provider::ProviderError::Verbs(v) = &e {
                if v.hint == crate::verbs::Hint::Memlock {
                    self.metrics.memlock_failure();
                }
            }
            e.into()
        })
    }

    pub fn new(cfg: ServiceConfig, link: ServerLink) -> Result<Arc<Service>> {
        let slots = link.slots.capacity();
        let root = Root::open(&cfg.root)?;
        tracing::info!(root = %cfg.root.display(), resolver = ?root.resolver(), "serving root");
        Ok(Arc::new(Service {
            root,
            transfers: Arc::new(Semaphore::new(cfg.max_transfers.max(1))),
            slots: Arc::new(Semaphore::new(slots)),
            cfg,
            link: Arc::new(link),
            sessions: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            stats: Arc::new(Stats::default()),
            metrics: Arc::new(crate::metrics::Metrics::new()),
        }))
    }

    pub fn kind(&self) -> ProviderKind {
        self.link.kind
    }

    fn max_block(&self) -> u64 {
        self.link.window_size as u64
    }

    fn session(&self, id: u64) -> Result<Arc<Session>> {
        self.sessions
            .lock()
            .unwrap()
            .get(&id)
            .cloned()
            .ok_or_else(|| ControlError::Invalid(format!("unknown session {id:#x}")))
    }

    fn handshake(&self, req: proto::HandshakeRequest) -> Result<proto::HandshakeResponse> {
        if req.version_major != VERSION_MAJOR {
            return Err(ControlError::Status(Status::failed_precondition(format!(
                "protocol major version {} is not supported (this rcpd speaks {VERSION_MAJOR}.{VERSION_MINOR})",
                req.version_major
            ))));
        }
        let want = match self.link.kind {
            ProviderKind::Verbs => proto::Provider::Verbs,
            ProviderKind::Tcp => proto::Provider::Tcp,
        };
        if want == proto::Provider::Tcp && req.version_minor < TCP_SESSION_KEY_MINOR {
            return Err(ControlError::Status(Status::failed_precondition(format!(
                "protocol {}.{} is too old for this rcpd's tcp provider: its data connections \
                 need session keys (protocol {VERSION_MAJOR}.{TCP_SESSION_KEY_MINOR} or later); upgrade rcp",
                req.version_major, req.version_minor
            ))));
        }
        if !req.providers.contains(&(want as i32)) {
            return Err(ControlError::Status(Status::failed_precondition(format!(
                "this rcpd runs the {} provider; the client offered {:?} (try --transport {})",
                self.link.kind,
                req.providers
                    .iter()
                    .map(|p| proto::Provider::try_from(*p)
                        .map(|p| p.as_str_name())
                        .unwrap_or("?"))
                    .collect::<Vec<_>>(),
                self.link.kind
            ))));
        }
        let block_size = check_block_size(req.block_size, self.max_block())?;
        self.sessions.lock().unwrap().retain(|id, s| {
            let keep =
                s.active.load(Relaxed) > 0 || s.last_used.lock().unwrap().elapsed() < SESSION_IDLE;
            if !keep {
                tracing::info!(session = format_args!("{id:#x}"), "idle session reaped");
            }
            keep
        });
        if self.sessions.lock().unwrap().len() >= MAX_SESSIONS {
            return Err(ControlError::Exceeded(format!(
                "{MAX_SESSIONS} sessions open; close some"
            )));
        }
        let id = random_u64();
        let mut resp = proto::HandshakeResponse {
            version_major: VERSION_MAJOR,
            version_minor: VERSION_MINOR,
            session_id: id,
            provider: want as i32,
            block_size,
            window_size: self.link.window_size as u64,
            window_count: self.cfg.windows_per_transfer,
            ..Default::default()
        };
        let mut qp = None;
        let mut rd = (1, 1);
        let sd = self.link.session_domain()?;
        match self.link.kind {
            ProviderKind::Tcp => {
                let t = self.link.tcp_target.as_ref().expect("tcp target");
                resp.tcp_session_key = sd
                    .tcp
                    .as_ref()
                    .expect("a tcp session domain has a key")
                    .key()
                    .to_vec();
                let a = t.local_addr();
                resp.tcp_data_host = if a.ip().is_unspecified() {
                    String::new()
                } else {
                    a.ip().to_string()
                };
                resp.tcp_data_port = u32::from(a.port());
            }
            ProviderKind::Verbs => {
                let v = req.verbs.as_ref().ok_or_else(|| {
                    ControlError::Invalid("verbs chosen but the request has no verbs params".into())
                })?;
                let cep = ep_from_proto(v.endpoint.as_ref().ok_or_else(|| {
                    ControlError::Invalid("verbs params without an endpoint".into())
                })?)?;
                let dev = self.link.device.as_ref().expect("verbs device");
                let caps = dev.ctx.caps();
                let pd = sd.pd.as_ref().expect("a verbs session domain has a PD");
                let q = dev.queue_pair_in(
                    pd,
                    16,
                    0,
                    Access::REMOTE_WRITE | Access::REMOTE_READ,
                    false,
                )?;
                let params = dev.params(&q);
                let ch = VerbsChannel::new(q);
                let client_rd = v.max_qp_init_rd_atom.min(caps.max_qp_rd_atom).max(1);
                let server_rd = caps.max_qp_init_rd_atom.min(v.max_qp_rd_atom).max(1);
                rd = (server_rd, caps.max_qp_rd_atom);
                ch.handshake(&cep, &connect_params(rd.0, rd.1, QpRetry::default()))
                    .map_err(|e| ControlError::Provider(e.into()))?;
                resp.path_mtu = cep.mtu.min(ch.endpoint().mtu);
                resp.client_rd_atomic = client_rd;
                resp.server_rd_atomic = server_rd;
                resp.max_inline = v.max_inline;
                resp.verbs = Some(params);
                qp = Some(Mutex::new(ch));
            }
        }
        self.sessions.lock().unwrap().insert(
            id,
            Arc::new(Session {
                kind: self.link.kind,
                block_size,
                domain: sd.domain,
                _tcp_binding: sd.tcp,
                qp,
                rd,
                epoch: AtomicU64::new(0),
                active: AtomicU64::new(0),
                last_used: Mutex::new(std::time::Instant::now()),
            }),
        );
        tracing::info!(session = format_args!("{id:#x}"), client = %req.client_name, provider = %self.link.kind, block_size, "session opened");
        Ok(resp)
    }

    fn reconnect(&self, req: proto::ReconnectRequest) -> Result<proto::ReconnectResponse> {
        let s = self.session(req.session_id)?;
        let epoch = s.epoch.fetch_add(1, Relaxed) as u32 + 1;
        match &s.qp {
            None => Ok(proto::ReconnectResponse {
                endpoint: None,
                epoch,
            }),
            Some(q) => {
                let cep: QpEndpoint =
                    ep_from_proto(req.endpoint.as_ref().ok_or_else(|| {
                        ControlError::Invalid("reconnect without endpoint".into())
                    })?)?;
                let ch = q.lock().unwrap();
                let ep = ch.reset().map_err(|e| ControlError::Provider(e.into()))?;
                ch.handshake(&cep, &connect_params(s.rd.0, s.rd.1, QpRetry::default()))
                    .map_err(|e| ControlError::Provider(e.into()))?;
                Ok(proto::ReconnectResponse {
                    endpoint: Some(super::link::ep_to_proto(&ep)),
                    epoch,
                })
            }
        }
    }

    async fn take_window(&self, wait: bool) -> Option<(Block, OwnedSemaphorePermit)> {
        let permit = if wait {
            self.slots.clone().acquire_owned().await.ok()?
        } else {
            self.slots.clone().try_acquire_owned().ok()?
        };
        let b = self.link.slots.take()?;
        Some((b, permit))
    }

    /// Run one Transfer stream to its end.
    async fn run_transfer(self: Arc<Self>, mut rx: Streaming<ClientMsg>, tx: Tx) {
        let r = self.clone().transfer_inner(&mut rx, &tx).await;
        match r {
            Ok(()) => {
                self.stats.transfers_ok.fetch_add(1, Relaxed);
            }
            Err(e) => {
                self.stats.transfers_failed.fetch_add(1, Relaxed);
                tracing::warn!(error = %e, "transfer ended with an error");
                let _ = tx.send(Err(e.into())).await;
            }
        }
    }

    async fn next_msg(&self, rx: &mut Streaming<ClientMsg>) -> Result<client_msg::Msg> {
        match tokio::time::timeout(self.cfg.idle_timeout, rx.message()).await {
            Err(_) => Err(ControlError::Retryable(format!(
                "no message from the client for {:?}",
                self.cfg.idle_timeout
            ))),
            Ok(Err(s)) => Err(ControlError::Status(s)),
            Ok(Ok(None)) => Err(ControlError::Retryable(
                "the client closed the stream before the transfer ended".into(),
            )),
            Ok(Ok(Some(ClientMsg { msg: None }))) => {
                Err(ControlError::Invalid("empty ClientMsg".into()))
            }
            Ok(Ok(Some(ClientMsg { msg: Some(m) }))) => Ok(m),
        }
    }

    async fn transfer_inner(self: Arc<Self>, rx: &mut Streaming<ClientMsg>, tx: &Tx) -> Result<()> {
        let open = match self.next_msg(rx).await? {
            client_msg::Msg::Open(o) => o,
            _ => {
                return Err(ControlError::Invalid(
                    "the first message of a Transfer must be Open".into(),
                ))
            }
        };
        let session = self.session(open.session_id)?;
        let bs = check_block_size(open.block_size, self.max_block())?;
        if bs != session.block_size {
            tracing::debug!(
                bs,
                session = session.block_size,
                "block size differs from the session's"
            );
        }
        let _permit = self
            .transfers
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ControlError::Retryable("server shutting down".into()))?;
        self.stats.active.fetch_add(1, Relaxed);
        session.active.fetch_add(1, Relaxed);
        self.metrics.transfer_started();
        let started = std::time::Instant::now();
        let (dir, r) = match Direction::try_from(open.direction) {
            Ok(Direction::Push) => (
                "push",
                self.clone().push(&*session.domain, open, bs, rx, tx).await,
            ),
            Ok(Direction::Pull) => (
                "pull",
                self.clone().pull(&*session.domain, open, bs, rx, tx).await,
            ),
            _ => (
                "unknown",
                Err(ControlError::Invalid(format!(
                    "direction {} is neither push nor pull",
                    open.direction
                ))),
            ),
        };
        let (outcome, bytes) = match &r {
            Ok(b) => ("ok", *b),
            Err(_) => ("error", 0),
        };
        self.metrics
            .transfer_ended(dir, outcome, bytes, started.elapsed().as_secs_f64(), None);
        let r = r.map(|_| ());
        self.stats.active.fetch_sub(1, Relaxed);
        session.active.fetch_sub(1, Relaxed);
        *session.last_used.lock().unwrap() = std::time::Instant::now();
        r
    }

    /// Grant windows while slots allow, up to the per-transfer limit.
    #[allow(clippy::too_many_arguments)]
    async fn grant_more(
        &self,
        domain: &dyn Domain,
        wins: &mut HashMap<u64, Win>,
        next_voff: &mut u64,
        vlen: u64,
        access: Access,
        tx: &Tx,
        fill: &mut FillFn<'_>,
    ) -> Result<()> {
        // Windows held for a resend do not count: the client finishes its
        // first pass (which may need more windows) before resending.
        let first_pass = |wins: &HashMap<u64, Win>| wins.values().filter(|w| w.epoch == 0).count();
        while *next_voff < vlen && first_pass(wins) < self.cfg.windows_per_transfer as usize {
            let Some((block, permit)) = self.take_window(first_pass(wins) == 0).await else {
                if first_pass(wins) == 0 {
                    return Err(ControlError::Retryable("no window memory".into()));
                }
                break;
            };
            let len = (vlen - *next_voff).min(self.link.window_size as u64);
            let span = PeerSpan::new(block.arena(), block.addr(), len as usize)
                .expect("a window lies inside its slot");
            let digests = fill(&span, *next_voff, len)?;
            let reg = self.register(domain, &span, access)?;
            let id = self.next_id.fetch_add(1, Relaxed);
            let g = proto::Grant {
                window_id: id,
                addr: reg.addr(),
                rkey: reg.rkey(),
                len,
                file_offset: *next_voff,
                epoch: 0,
                block_sha256: digests,
            };
            wins.insert(
                id,
                Win {
                    reg: Some(reg),
                    span,
                    _block: block,
                    _permit: permit,
                    voff: *next_voff,
                    len,
                    epoch: 0,
                },
            );
            *next_voff += len;
            tx.send(msg(server_msg::Msg::Grant(g)))
                .await
                .map_err(|_| ControlError::Retryable("client went away".into()))?;
        }
        Ok(())
    }

    /// Where a push lands: the directory and the final name, scp-style (an
    /// existing directory means "inside it").
    fn push_target(&self, open: &proto::Open) -> Result<(DirHandle, String, String)> {
        let rel = fsutil::root_rel(&open.path);
        let rp = files::normalize(&rel)?;
        let inside = |dir: &str| -> Result<(DirHandle, String, String)> {
            let d = self.root.open_dir(dir)?;
            let name = open.name.clone();
            let shown = if dir == "." {
                name.clone()
            } else {
                format!("{dir}/{name}")
            };
            Ok((d, name, shown))
        };
        match self.root.stat(&rel) {
            Ok(m) if m.kind == FileKind::Dir => inside(&rel),
            Ok(m) if m.kind != FileKind::File => Err(ControlError::Invalid(format!(
                "{} exists and is not a regular file",
                open.path
            ))),
            Ok(_) | Err(FileError::Path(PathError::NotFound { .. })) => {
                let name = rp
                    .file_name()
                    .ok_or_else(|| ControlError::Invalid("cannot write over the root".into()))?
                    .to_string();
                let parent = fsutil::rel_str(&rp.parent());
                let dir = if open.create_parents {
                    self.root.create_dir_all(&parent)?
                } else {
                    self.root.open_dir(&parent).map_err(|e| match e {
                        FileError::Path(PathError::NotFound { .. })
                        | FileError::Path(PathError::NotADirectory { .. }) => {
                            ControlError::DirNotFound(format!("{parent} (parent of {})", open.path))
                        }
                        e => e.into(),
                    })?
                };
                Ok((dir, name, fsutil::rel_str(&rp)))
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn push(
        self: Arc<Self>,
        domain: &dyn Domain,
        open: proto::Open,
        bs: u64,
        rx: &mut Streaming<ClientMsg>,
        tx: &Tx,
    ) -> Result<u64> {
        if open.length > MAX_FILE_LEN {
            return Err(ControlError::Exceeded(format!(
                "length {} is over the limit {MAX_FILE_LEN}",
                open.length
            )));
        }
        let (dir, name, relpath) = in_place(|| self.push_target(&open))?;
        check_space(dir.display(), open.length)?;
        let source = fsutil::source_id(open.length, open.mtime_ns, &open.source_fingerprint);
        let opts = DestinationOptions {
            block_size: bs,
            preserve: open.preserve.then(|| Preserve {
                mode: open.mode & 0o7777,
                mtime: fsutil::ts_from_ns(open.mtime_ns),
            }),
            // Always resumable: an interrupted push can be continued with
            // --resume (the temp file and manifest stay hidden until then).
            resume: Some(source),
            ..DestinationOptions::default()
        };
        let dest = in_place(|| -> Result<Destination> {
            if open.resume {
                if let Some(d) = Destination::resume(&dir, &name, &source, opts.clone())? {
                    return Ok(d);
                }
            }
            Ok(Destination::create(&dir, &name, open.length, opts)?)
        })?;
        let missing = dest.missing_blocks();
        let total_blocks = open.length.div_ceil(bs);
        let resumed = (missing.len() as u64) < total_blocks;
        let skip = resumed.then(|| Bitmap::all_but(total_blocks, &missing));
        let moving = moving_blocks(open.length, bs, skip.as_ref());
        let vlen = packed_len(open.length, bs, &moving);
        let transfer_id = self.next_id.fetch_add(1, Relaxed);
        tracing::info!(transfer = transfer_id, path = %relpath, length = open.length, resumed, moving = vlen, "push");
        tx.send(msg(server_msg::Msg::Opened(proto::Opened {
            transfer_id,
            length: open.length,
            block_size: bs,
            mode: open.mode,
            mtime_ns: open.mtime_ns,
            path: relpath.clone(),
            skip_blocks: skip.map(|s| s.bits).unwrap_or_default(),
            resumed,
            source_fingerprint: Vec::new(),
        })))
        .await
        .map_err(|_| ControlError::Retryable("client went away".into()))?;

        let mut writer = WriteBehind::spawn(dest, 2)
            .map_err(|e| ControlError::Other(format!("cannot start the writer thread: {e}")))?;
        let mut wins: HashMap<u64, Win> = HashMap::new();
        let mut next_voff = 0u64;
        let mut verified = 0u64;
        let mut no_fill = |_: &PeerSpan, _: u64, _: u64| Ok(Vec::new());
        self.grant_more(
            domain,
            &mut wins,
            &mut next_voff,
            vlen,
            Access::REMOTE_WRITE,
            tx,
            &mut no_fill,
        )
        .await?;
        loop {
            match self.next_msg(rx).await? {
                client_msg::Msg::WindowDone(d) => {
                    let mut w = wins.remove(&d.window_id).ok_or_else(|| {
                        ControlError::Invalid(format!(
                            "window {} is not granted to this transfer",
                            d.window_id
                        ))
                    })?;
                    if d.epoch != w.epoch {
                        return Err(ControlError::Invalid(format!(
                            "window {} epoch {} is not current ({})",
                            d.window_id, d.epoch, w.epoch
                        )));
                    }
                    let nblocks = w.len.div_ceil(bs);
                    if d.block_sha256.len() as u64 != nblocks
                        || d.block_sha256.iter().any(|h| h.len() != 32)
                    {
                        return Err(ControlError::Invalid(format!(
                            "window {} needs {nblocks} 32-byte block digests, got {}",
                            d.window_id,
                            d.block_sha256.len()
                        )));
                    }
                    // Revoke remote access before reading what landed.
                    drop(w.reg.take());
                    // Grant the next window before checking this one, so
                    // the client writes while we hash and write.
                    self.grant_more(
                        domain,
                        &mut wins,
                        &mut next_voff,
                        vlen,
                        Access::REMOTE_WRITE,
                        tx,
                        &mut no_fill,
                    )
                    .await?;
                    let first_vblock = w.voff / bs;
                    // Every block's digest in parallel; the pwrite and the
                    // whole-file digest happen behind, on the writer thread,
                    // while this loop takes the next window.
                    let ranges: Vec<(usize, usize)> = (0..nblocks)
                        .map(|i| ((i * bs) as usize, (w.len - i * bs).min(bs) as usize))
                        .collect();
                    let gots =
                        in_place(|| w.span.with_many(&ranges, files::digest_blocks_parallel))
                            .expect("window bounds");
                    let blocks: Vec<(u64, u64, usize, [u8; 32])> = (0..nblocks)
                        .zip(&gots)
                        .map(|(i, got)| {
                            let real = moving[(first_vblock + i) as usize];
                            (i, real, ranges[i as usize].1, *got)
                        })
                        .collect();
                    let bad: Vec<u64> = blocks
                        .iter()
                        .filter(|(i, ..)| gots[*i as usize][..] != d.block_sha256[*i as usize][..])
                        .map(|(i, ..)| first_vblock + i)
                        .collect();
                    if !bad.is_empty() {
                        // The good blocks are copied out and written behind;
                        // the window stays for the resend.
                        let good: Vec<(u64, Vec<u8>, [u8; 32])> = blocks
                            .iter()
                            .filter(|(i, ..)| !bad.contains(&(first_vblock + i)))
                            .map(|&(i, real, n, got)| {
                                let v = w.span.with((i * bs) as usize, n, <[u8]>::to_vec);
                                (real, v.expect("window bounds"), got)
                            })
                            .collect();
                        in_place(|| {
                            writer.submit(Box::new(move |dest: &mut Destination| {
                                for (real, data, got) in good {
                                    dest.write_block(real, &data, got)?;
                                }
                                Ok(())
                            }))
                        })?;
                        self.stats.integrity_failures.fetch_add(1, Relaxed);
                        if w.epoch >= MAX_RESENDS {
                            return Err(ControlError::Integrity(format!(
                                "block(s) {bad:?} of window {} still do not match their digests after {MAX_RESENDS} resends",
                                d.window_id
                            )));
                        }
                        // Ask for those blocks again: the same window under
                        // a fresh rkey and the next epoch (the good blocks
                        // are already written; writing them again is a no-op).
                        tracing::warn!(window = d.window_id, blocks = ?bad, "block digest mismatch: asking the client to resend");
                        let g = self.regrant(
                            domain,
                            d.window_id,
                            &mut w,
                            Access::REMOTE_WRITE,
                            Vec::new(),
                        )?;
                        wins.insert(d.window_id, w);
                        for m in [
                            server_msg::Msg::Ack(proto::Ack {
                                window_id: d.window_id,
                                resend_blocks: bad,
                            }),
                            server_msg::Msg::Grant(g),
                        ] {
                            tx.send(msg(m))
                                .await
                                .map_err(|_| ControlError::Retryable("client went away".into()))?;
                        }
                        continue;
                    }
                    let len = w.len;
                    let span = w.span.clone();
                    let (acks, window_id) = (tx.clone(), d.window_id);
                    in_place(|| {
                        writer.submit(Box::new(move |dest: &mut Destination| {
                            for (i, real, n, got) in blocks {
                                span.with((i * bs) as usize, n, |data| {
                                    dest.write_block(real, data, got)
                                })
                                .expect("window bounds")?;
                            }
                            // The window's memory goes back to the pool only
                            // now that it is written.
                            drop(w);
                            // Acked once written, as it was inline: the
                            // client commits after the last ack, and a
                            // client killed before it leaves a manifest
                            // that knows every acked block (for --resume).
                            let _ = acks.blocking_send(msg(server_msg::Msg::Ack(proto::Ack {
                                window_id,
                                resend_blocks: Vec::new(),
                            })));
                            Ok(())
                        }))
                    })?;
                    verified += len;
                    self.stats.bytes_in.fetch_add(len, Relaxed);
                }
                client_msg::Msg::Commit(c) => {
                    if verified != vlen || !wins.is_empty() {
                        return Err(ControlError::Invalid(format!(
                            "commit after {verified} of {vlen} bytes"
                        )));
                    }
                    let expected: [u8; 32] = c.sha256.as_slice().try_into().map_err(|_| {
                        ControlError::Invalid("the commit digest is not 32 bytes".into())
                    })?;
                    let dest = in_place(|| writer.finish())?;
                    let digest = match in_place(|| dest.commit(expected)) {
                        Ok(d) => d,
                        Err(e) => {
                            self.stats.integrity_failures.fetch_add(1, Relaxed);
                            return Err(e.into());
                        }
                    };
                    tracing::info!(transfer = transfer_id, path = %relpath, sha256 = %hex::encode(digest), "push committed");
                    let _ = tx
                        .send(msg(server_msg::Msg::Committed(proto::Committed {
                            sha256: digest.to_vec(),
                            path: relpath,
                            length: open.length,
                        })))
                        .await;
                    return Ok(verified);
                }
                client_msg::Msg::Abort(a) => {
                    return Err(ControlError::Retryable(format!(
                        "client aborted: {}",
                        a.reason
                    )))
                }
                client_msg::Msg::Open(_) => {
                    return Err(ControlError::Invalid("Open sent twice".into()))
                }
            }
        }
    }

    async fn pull(
        self: Arc<Self>,
        domain: &dyn Domain,
        open: proto::Open,
        bs: u64,
        rx: &mut Streaming<ClientMsg>,
        tx: &Tx,
    ) -> Result<u64> {
        let rel = fsutil::root_rel(&open.path);
        let src = in_place(|| SourceFile::open_in(&self.root, &rel))?;
        let length = src.len();
        let mtime = fsutil::ns_from_ts(src.mtime());
        let id = src.source_id();
        let mut skip = None;
        if open.resume
            && open.have_length == length
            && open.have_mtime_ns == mtime
            && fsutil::fingerprint(&open.have_fingerprint) == id.fingerprint
        {
            skip = Bitmap::from_bytes(open.have_blocks.clone(), length.div_ceil(bs))
                .filter(|b| b.count() > 0);
        }
        let resumed = skip.is_some();
        let moving = moving_blocks(length, bs, skip.as_ref());
        let vlen = packed_len(length, bs, &moving);
        let transfer_id = self.next_id.fetch_add(1, Relaxed);
        let relpath = rel.clone();
        tracing::info!(transfer = transfer_id, path = %relpath, length, resumed, moving = vlen, "pull");
        tx.send(msg(server_msg::Msg::Opened(proto::Opened {
            transfer_id,
            length,
            block_size: bs,
            mode: src.mode(),
            mtime_ns: mtime,
            path: relpath.clone(),
            skip_blocks: skip.map(|s| s.bits).unwrap_or_default(),
            resumed,
            source_fingerprint: id.fingerprint.to_vec(),
        })))
        .await
        .map_err(|_| ControlError::Retryable("client went away".into()))?;

        let hasher = Mutex::new((!resumed).then(|| StreamingFileDigest::new(Some(length), 0)));
        let mut wins: HashMap<u64, Win> = HashMap::new();
        let mut next_voff = 0u64;
        let mut released = 0u64;
        let mut fill = |span: &PeerSpan, voff: u64, len: u64| -> Result<Vec<Vec<u8>>> {
            let mut h = hasher.lock().unwrap();
            in_place(|| fill_window(&src, span, voff, len, bs, &moving, &mut h))
        };
        self.grant_more(
            domain,
            &mut wins,
            &mut next_voff,
            vlen,
            Access::REMOTE_READ,
            tx,
            &mut fill,
        )
        .await?;
        if vlen == 0 {
            let h = hasher.lock().unwrap().take();
            self.finish_pull(h, &src, tx, &relpath, length).await?;
        }
        loop {
            match self.next_msg(rx).await? {
                client_msg::Msg::WindowDone(d) => {
                    let mut w = wins.remove(&d.window_id).ok_or_else(|| {
                        ControlError::Invalid(format!(
                            "window {} is not granted to this transfer",
                            d.window_id
                        ))
                    })?;
                    if d.epoch != w.epoch {
                        return Err(ControlError::Invalid(format!(
                            "window {} epoch {} is not current ({})",
                            d.window_id, d.epoch, w.epoch
                        )));
                    }
                    if !d.reread_blocks.is_empty() {
                        // Blocks that arrived damaged: read them from the
                        // file again and grant the window once more.
                        self.stats.integrity_failures.fetch_add(1, Relaxed);
                        if w.epoch >= MAX_RESENDS {
                            return Err(ControlError::Integrity(format!(
                                "block(s) {:?} of window {} still do not match their digests after {MAX_RESENDS} re-reads",
                                d.reread_blocks, d.window_id
                            )));
                        }
                        let mut blocks = d.reread_blocks.clone();
                        blocks.sort_unstable();
                        blocks.dedup();
                        let first = w.voff / bs;
                        let end = (w.voff + w.len).div_ceil(bs);
                        if blocks.iter().any(|b| *b < first || *b >= end) {
                            return Err(ControlError::Invalid(format!(
                                "re-read of blocks {blocks:?} outside window {}",
                                d.window_id
                            )));
                        }
                        tracing::warn!(
                            window = d.window_id,
                            ?blocks,
                            "pulled block digest mismatch: reading the blocks again"
                        );
                        // Revoke the old rkey before touching the memory.
                        drop(w.reg.take());
                        let digests = in_place(|| {
                            refill_blocks(&src, &w.span, w.voff, w.len, bs, &moving, &blocks)
                        })?;
                        let g = self.regrant(
                            domain,
                            d.window_id,
                            &mut w,
                            Access::REMOTE_READ,
                            digests,
                        )?;
                        wins.insert(d.window_id, w);
                        tx.send(msg(server_msg::Msg::Grant(g)))
                            .await
                            .map_err(|_| ControlError::Retryable("client went away".into()))?;
                        continue;
                    }
                    released += w.len;
                    self.stats.bytes_out.fetch_add(w.len, Relaxed);
                    drop(w);
                    self.grant_more(
                        domain,
                        &mut wins,
                        &mut next_voff,
                        vlen,
                        Access::REMOTE_READ,
                        tx,
                        &mut fill,
                    )
                    .await?;
                    if released == vlen && wins.is_empty() {
                        let h = hasher.lock().unwrap().take();
                        self.finish_pull(h, &src, tx, &relpath, length).await?;
                    }
                }
                client_msg::Msg::Commit(c) => {
                    if released != vlen {
                        return Err(ControlError::Invalid(format!(
                            "commit after {released} of {vlen} bytes"
                        )));
                    }
                    tracing::info!(transfer = transfer_id, path = %relpath, sha256 = %hex::encode(&c.sha256), "pull done");
                    return Ok(released);
                }
                client_msg::Msg::Abort(a) => {
                    return Err(ControlError::Retryable(format!(
                        "client aborted: {}",
                        a.reason
                    )))
                }
                client_msg::Msg::Open(_) => {
                    return Err(ControlError::Invalid("Open sent twice".into()))
                }
            }
        }
    }

    async fn finish_pull(
        &self,
        hasher: Option<StreamingFileDigest>,
        src: &SourceFile,
        tx: &Tx,
        relpath: &str,
        length: u64,
    ) -> Result<()> {
        let digest = in_place(|| -> Result<[u8; 32]> {
            src.check_unchanged()?;
            match hasher {
                Some(h) => Ok(h.finish().map_err(FileError::from)?),
                None => fsutil::whole_file_digest(src),
            }
        })?;
        tx.send(msg(server_msg::Msg::Committed(proto::Committed {
            sha256: digest.to_vec(),
            path: relpath.to_string(),
            length,
        })))
        .await
        .map_err(|_| ControlError::Retryable("client went away".into()))
    }
}

fn entry(
    path: String,
    kind: FileKind,
    len: u64,
    mode: u32,
    mtime: files::Timestamp,
) -> proto::Entry {
    let t = match kind {
        FileKind::File => proto::FileType::File,
        FileKind::Dir => proto::FileType::Dir,
        FileKind::Symlink => proto::FileType::Symlink,
        FileKind::Other => proto::FileType::Other,
    };
    proto::Entry {
        path,
        r#type: t as i32,
        length: len,
        mode,
        mtime_ns: fsutil::ns_from_ts(mtime),
        fingerprint: Vec::new(),
    }
}

fn fill_window(
    src: &SourceFile,
    span: &PeerSpan,
    voff: u64,
    len: u64,
    bs: u64,
    moving: &[u64],
    hasher: &mut Option<StreamingFileDigest>,
) -> Result<Vec<Vec<u8>>> {
    let mut ranges = Vec::new();
    let mut reals = Vec::new();
    let mut off = 0u64;
    while off < len {
        let n = (len - off).min(bs) as usize;
        let real = moving[((voff + off) / bs) as usize] * bs;
        span_mut_for_legacy_control(span, off as usize, n, |buf| {
            // Straight into registered memory (O_DIRECT when aligned).
            fsutil::read_exact(src, real, buf)
        })
        .expect("window bounds")
        .map_err(ControlError::io("reading the source file"))?;
        ranges.push((off as usize, n));
        reals.push(real);
        off += n as u64;
    }
    // Block digests in parallel while another thread feeds the whole-file
    // digest in order.
    let digests = span
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
        .expect("window bounds");
    Ok(digests.iter().map(|d| d.to_vec()).collect())
}

/// Read `blocks` (transfer indices inside the window at packed offset
/// `voff`) from the file into the window again; their digests, in order.
fn refill_blocks(
    src: &SourceFile,
    span: &PeerSpan,
    voff: u64,
    len: u64,
    bs: u64,
    moving: &[u64],
    blocks: &[u64],
) -> Result<Vec<Vec<u8>>> {
    let first = voff / bs;
    let mut digests = Vec::with_capacity(blocks.len());
    for &vb in blocks {
        let off = (vb - first) * bs;
        let n = (len - off).min(bs) as usize;
        let real = moving[vb as usize];
        let d = span_mut_for_legacy_control(span, off as usize, n, |buf| -> Result<[u8; 32]> {
            fsutil::read_exact(src, real * bs, buf)
                .map_err(ControlError::io("reading the source file"))?;
            Ok(files::block_digest(buf))
        })
        .expect("window bounds")?;
        digests.push(d.to_vec());
    }
    Ok(digests)
}

fn check_space(dir: &Path, need: u64) -> Result<()> {
    if let Ok(s) = nix::sys::statvfs::statvfs(dir) {
        let avail = s.blocks_available() * s.fragment_size();
        if need > avail {
            return Err(ControlError::Exceeded(format!(
                "{need} bytes do not fit: {avail} bytes free at the destination"
            )));
        }
    }
    Ok(())
}

/// The gRPC face of [`Service`].
#[derive(Clone)]
pub struct RcpService(pub Arc<Service>);

type BoxStream<T> = Pin<Box<dyn Stream<Item = std::result::Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl proto::rcp_server::Rcp for RcpService {
    async fn handshake(
        &self,
        req: Request<proto::HandshakeRequest>,
    ) -> std::result::Result<Response<proto::HandshakeResponse>, Status> {
        let s = self.0.clone();
        let r = in_place(|| s.handshake(req.into_inner()))?;
        Ok(Response::new(r))
    }

    type TransferStream = BoxStream<ServerMsg>;

    async fn transfer(
        &self,
        req: Request<Streaming<ClientMsg>>,
    ) -> std::result::Result<Response<Self::TransferStream>, Status> {
        let (tx, rx) = mpsc::channel(64);
        let s = self.0.clone();
        tokio::spawn(s.run_transfer(req.into_inner(), tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn reconnect(
        &self,
        req: Request<proto::ReconnectRequest>,
    ) -> std::result::Result<Response<proto::ReconnectResponse>, Status> {
        Ok(Response::new(in_place(|| {
            self.0.reconnect(req.into_inner())
        })?))
    }

    async fn close_session(
        &self,
        req: Request<proto::CloseSessionRequest>,
    ) -> std::result::Result<Response<proto::CloseSessionResponse>, Status> {
        let id = req.into_inner().session_id;
        let s = self.0.sessions.lock().unwrap().remove(&id);
        match s {
            Some(s) => {
                let _ = s.kind;
                in_place(|| drop(s));
                Ok(Response::new(proto::CloseSessionResponse {}))
            }
            None => Err(Status::invalid_argument(format!("unknown session {id:#x}"))),
        }
    }

    async fn stat(
        &self,
        req: Request<proto::StatRequest>,
    ) -> std::result::Result<Response<proto::StatResponse>, Status> {
        let r = req.into_inner();
        let rel = fsutil::root_rel(&r.path);
        let root = &self.0.root;
        match in_place(|| root.lstat(&rel)) {
            Ok(m) => {
                let mut e = entry(String::new(), m.kind, m.len, m.mode, m.mtime);
                if r.fingerprint && m.kind == FileKind::File {
                    let src =
                        in_place(|| SourceFile::open_in(root, &rel)).map_err(ControlError::from)?;
                    e.fingerprint = src.source_id().fingerprint.to_vec();
                }
                Ok(Response::new(proto::StatResponse {
                    exists: true,
                    entry: Some(e),
                }))
            }
            Err(FileError::Path(PathError::NotFound { .. })) => {
                Ok(Response::new(proto::StatResponse {
                    exists: false,
                    entry: None,
                }))
            }
            Err(e) => Err(ControlError::from(e).into()),
        }
    }

    async fn list(
        &self,
        req: Request<proto::ListRequest>,
    ) -> std::result::Result<Response<proto::ListResponse>, Status> {
        let r = req.into_inner();
        let rel = fsutil::root_rel(&r.path);
        let root = &self.0.root;
        let entries = in_place(|| -> Result<Vec<proto::Entry>> {
            let m = root.stat(&rel).map_err(|e| match e {
                FileError::Path(PathError::NotFound { .. }) => {
                    ControlError::DirNotFound(r.path.clone())
                }
                e => e.into(),
            })?;
            if m.kind != FileKind::Dir {
                return Err(ControlError::DirNotFound(format!(
                    "{} is not a directory",
                    r.path
                )));
            }
            let mut out = Vec::new();
            if r.recursive {
                let t = root.walk(&rel)?;
                for e in t.entries {
                    let kind = match e.kind {
                        files::EntryKind::File => FileKind::File,
                        files::EntryKind::Dir => FileKind::Dir,
                        files::EntryKind::Symlink => FileKind::Symlink,
                    };
                    out.push(entry(
                        e.rel_path.to_string_lossy().into_owned(),
                        kind,
                        e.len,
                        e.mode,
                        e.mtime,
                    ));
                }
            } else {
                for e in root.list(&rel)? {
                    out.push(entry(
                        e.name.to_string_lossy().into_owned(),
                        e.meta.kind,
                        e.meta.len,
                        e.meta.mode,
                        e.meta.mtime,
                    ));
                }
            }
            Ok(out)
        })?;
        if entries.len() > 1_000_000 {
            return Err(Status::resource_exhausted("more than 1000000 entries"));
        }
        Ok(Response::new(proto::ListResponse { entries }))
    }

    async fn make_dir(
        &self,
        req: Request<proto::MakeDirRequest>,
    ) -> std::result::Result<Response<proto::MakeDirResponse>, Status> {
        let path = req.into_inner().path;
        let rel = fsutil::root_rel(&path);
        let root = &self.0.root;
        in_place(|| root.create_dir_all(&rel)).map_err(|e| match e {
            FileError::Path(PathError::NotADirectory { .. }) => {
                ControlError::Invalid(format!("{path}: a non-directory is in the way"))
            }
            e => e.into(),
        })?;
        Ok(Response::new(proto::MakeDirResponse {}))
    }

    type CopyStream = BoxStream<proto::CopyProgress>;

    async fn copy(
        &self,
        req: Request<proto::CopyRequest>,
    ) -> std::result::Result<Response<Self::CopyStream>, Status> {
        let stream = super::copy::start(self.0.clone(), self.0.cfg.clone(), req.into_inner())?;
        Ok(Response::new(stream))
    }
}

impl Service {
    pub fn root(&self) -> &Root {
        &self.root
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_plans() {
        let bs = 4096;
        // 3 blocks, the last short; none skipped.
        let m = moving_blocks(2 * bs + 10, bs, None);
        assert_eq!(m, vec![0, 1, 2]);
        assert_eq!(packed_len(2 * bs + 10, bs, &m), 2 * bs + 10);
        // Skip the middle one: the short last block stays last.
        let skip = Bitmap::all_but(3, &[0, 2]);
        let m = moving_blocks(2 * bs + 10, bs, Some(&skip));
        assert_eq!(m, vec![0, 2]);
        assert_eq!(packed_len(2 * bs + 10, bs, &m), bs + 10);
        // Skip the last: all moving blocks are full.
        let skip = Bitmap::all_but(3, &[0, 1]);
        let m = moving_blocks(2 * bs + 10, bs, Some(&skip));
        assert_eq!(packed_len(2 * bs + 10, bs, &m), 2 * bs);
        assert_eq!(packed_len(0, bs, &moving_blocks(0, bs, None)), 0);
    }

    #[test]
    fn bitmaps() {
        let b = Bitmap::all_but(10, &[3, 9]);
        assert_eq!(b.count(), 8);
        assert!(!b.get(3) && !b.get(9) && b.get(0) && b.get(8) && !b.get(10));
        assert_eq!(b.bits.len(), 2);
        assert_eq!(b.bits[1], 0b01);
        assert!(Bitmap::from_bytes(vec![0; 3], 10).is_none());
    }

    #[test]
    fn block_sizes() {
        assert_eq!(check_block_size(0, 4 << 20).unwrap(), DEFAULT_BLOCK_SIZE);
        assert!(check_block_size(4096, 4 << 20).is_ok());
        assert!(check_block_size(5000, 4 << 20).is_err());
        assert!(check_block_size(2048, 4 << 20).is_err());
        assert!(check_block_size(8 << 20, 4 << 20).is_err());
    }
}
