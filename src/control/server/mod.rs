//! The rcpd service: sessions, the Move stream driver, metadata requests.
//!
//! - [`Service`]: what all sessions share (the root, the window arena and
//!   provider, limits, counters) and its gRPC face [`RcpService`];
//! - `session`: the handshake, a QP per session (its windows reach it
//!   through memory windows bound to it, or a protection domain of its
//!   own: [`ServerLink::session_domain`]), reconnects;
//! - `stream`: the driver of one Move stream over
//!   [`ServerCore`](crate::control::protocol::ServerCore): it moves frames,
//!   runs the core's I/O actions on blocking threads and passes time in;
//! - `sessions`, `limits`: what keeps one client from taking what the
//!   others need: the session table (limits checked and a place taken in
//!   one step; sessions unused past `--session-grace` closed), each
//!   client's share of the transfer slots, the end of a stream that moves
//!   nothing;
//! - `io`: those actions: opening destinations and sources beneath the
//!   root, filling windows, making them reachable (a memory-window bind or
//!   a registration), revoking and verifying them, batched commits.
//!
//! The service knows nothing of the client library nor of services'
//! buffers: the `Copy` API is served through a [`Copier`], and grants of
//! buffers to peers' sessions through [`BufferGrants`], both plugged in by
//! `daemon`.

pub mod conns;
mod delta;
mod digests;
pub mod feeds;
mod io;
mod limits;
mod session;
mod sessions;
mod stream;

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tokio::sync::{mpsc, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::error::{ControlError, Result};
use super::fsutil;
use super::in_place;
use super::link::ServerLink;
use crate::files::{self, FileError, FileKind, PathError, Root, SourceFile};
use crate::proto::{self, ClientFrame, ServerFrame};
use crate::provider::ProviderKind;

/// Directories one `MakeDirs` call may make (rcp asks for this many at
/// most): a call is one worker's work for a bounded while.
pub const MAKE_DIRS_MAX: usize = 4096;

pub use limits::{default_transfers_per_client, ClientId};
pub use session::SessionState;
pub use sessions::{
    SessionLimits, DEFAULT_MAX_SESSIONS, DEFAULT_MAX_SESSIONS_PER_CLIENT, DEFAULT_SESSION_GRACE,
    SESSION_IDLE,
};

/// Server settings.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    pub root: PathBuf,
    /// Move streams served at once; more wait (back-pressure).
    pub max_transfers: usize,
    /// Of those, one client's; its others wait.
    pub max_transfers_per_client: usize,
    /// Sessions open at once, one client's, and the time a session may
    /// stay without a Move stream.
    pub sessions: SessionLimits,
    /// Windows one session may have granted at once.
    pub windows_per_session: u32,
    /// Files one session may have open at once.
    pub max_open_files: u32,
    /// A stream that waits and makes no progress this long ends; a stream
    /// whose client sends nothing (not even keepalives) this long too.
    pub timeout: Duration,
    /// The checks a client may ask for (`RCPD_VERIFY`).
    pub checks: Vec<crate::files::Check>,
}

/// The service API's `Copy`, served by whoever can be a client of another
/// rcpd (`control::copy`, plugged in by `control::daemon`).
pub trait Copier: Send + Sync {
    /// The copy's progress, or why it was refused before it started.
    fn copy(
        &self,
        svc: Arc<Service>,
        req: proto::CopyRequest,
    ) -> futures::future::BoxFuture<
        'static,
        std::result::Result<BoxStream<proto::CopyProgress>, Status>,
    >;
}

/// Grants of services' buffers to peers' sessions (`BufferGrant`,
/// `BufferDone`), served by `control::buffers`, plugged in by
/// `control::daemon`.
pub trait BufferGrants: Send + Sync {
    /// Grant the ranges `req` asks of a buffer exposed to `peer`, to the
    /// client's `session` (`session_id`), over connection `conn` (a grant
    /// per operation goes when it ends).
    fn grant(
        &self,
        session: &SessionState,
        session_id: u64,
        req: proto::BufferGrantRequest,
        peer: Option<std::net::IpAddr>,
        conn: Option<conns::ConnKey>,
    ) -> std::result::Result<proto::BufferGrantResponse, Status>;
    /// A grant's round is over: revoke it and check what landed; grant
    /// damaged ranges again while `session` is open.
    fn done(
        &self,
        session: Option<&SessionState>,
        session_id: u64,
        req: proto::BufferDoneRequest,
    ) -> std::result::Result<proto::BufferDoneResponse, Status>;
    /// Operations the client moved under standing grants: check each and
    /// tell its owner.
    fn notify(
        &self,
        session: Option<&SessionState>,
        session_id: u64,
        req: proto::BufferNotifyRequest,
    ) -> std::result::Result<proto::BufferNotifyResponse, Status>;
    /// The same on the data path: a MESSAGE frame's payload on one of the
    /// tcp session's connections (a `BufferNotifyRequest`), answered with
    /// a `BufferNotifyFrame`'s bytes; the owners' events are sent after
    /// the answer (the peer's operations need not wait for them).
    fn notify_frame(
        &self,
        session: Option<&SessionState>,
        session_id: u64,
        payload: &[u8],
    ) -> crate::provider::tcp::Answer;
    /// Session `id` closed (by its client or as unused): what was granted
    /// to it goes.
    fn session_closed(&self, id: u64);
}

/// Shared state of the service.
pub struct Service {
    cfg: ServiceConfig,
    link: Arc<ServerLink>,
    root: Root,
    sessions: sessions::SessionTable<SessionState>,
    transfers: Arc<Semaphore>,
    /// Each client's share of `transfers`.
    client_slots: limits::ClientSlots,
    /// Warnings of clients cut off, at most one a second per reason.
    throttle: limits::Throttle,
    slots: Arc<Semaphore>,
    copier: Option<Arc<dyn Copier>>,
    /// The one set of counters rcpd exports (`crate::metrics`): transfers,
    /// bytes, throughput, integrity and auth failures, the data paths of the
    /// copies it drives.
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Grants of services' buffers (`control::buffers`); `None`: this
    /// rcpd grants none.
    buffers: Option<Arc<dyn BufferGrants>>,
    /// The fan-outs this rcpd receives, for the Copies that forward them.
    pub fanouts: feeds::Feeds,
}

/// A server-streaming response.
pub type BoxStream<T> =
    Pin<Box<dyn Stream<Item = std::result::Result<T, Status>> + Send + 'static>>;

impl Service {
    pub fn new(
        cfg: ServiceConfig,
        link: ServerLink,
        metrics: Arc<crate::metrics::Metrics>,
        copier: Option<Arc<dyn Copier>>,
        buffers: Option<Arc<dyn BufferGrants>>,
    ) -> Result<Arc<Service>> {
        let slots = link.slots.capacity();
        let root = Root::open(&cfg.root)?;
        tracing::info!(root = %cfg.root.display(), resolver = ?root.resolver(), "serving root");
        Ok(Arc::new(Service {
            root,
            transfers: Arc::new(Semaphore::new(cfg.max_transfers.max(1))),
            client_slots: limits::ClientSlots::new(cfg.max_transfers_per_client),
            throttle: limits::Throttle::default(),
            slots: Arc::new(Semaphore::new(slots)),
            sessions: sessions::SessionTable::new(cfg.sessions),
            cfg,
            link: Arc::new(link),
            copier,
            metrics,
            buffers,
            fanouts: feeds::Feeds::default(),
        }))
    }

    pub fn kind(&self) -> ProviderKind {
        self.link.kind
    }

    pub fn root(&self) -> &Root {
        &self.root
    }

    pub fn config(&self) -> &ServiceConfig {
        &self.cfg
    }

    /// A request of a client: its sessions are in use (`--session-grace`).
    fn heard<T>(&self, req: &Request<T>) {
        self.sessions
            .touch(ClientId::of(req), std::time::Instant::now());
    }

    /// One `MakeDir` (or one of `MakeDirs`, `dirs` kept across them), on
    /// the calling thread.
    fn make_dir(
        &self,
        req: proto::MakeDirRequest,
        dirs: Option<&mut files::TreeDirs<'_>>,
    ) -> std::result::Result<(), ControlError> {
        let proto::MakeDirRequest {
            path,
            mode,
            exact,
            mtime_ns,
            replace_link,
            file,
        } = req;
        let rel = fsutil::root_rel(&path);
        let root = &self.root;
        let made = if exact && file {
            root.set_file_attrs(&rel, mode, fsutil::ts_from_ns(mtime_ns))
        } else if exact {
            root.set_dir_attrs(&rel, mode, fsutil::ts_from_ns(mtime_ns))
        } else if replace_link {
            match dirs {
                Some(dirs) => dirs.make(&rel, mode),
                None => root.create_tree_dir(&rel, mode).map(drop),
            }
        } else {
            root.create_dir_all_mode(&rel, mode).map(drop)
        };
        made.map_err(|e| match e {
            FileError::Path(PathError::NotADirectory { .. }) => {
                ControlError::Invalid(format!("{path}: a non-directory is in the way"))
            }
            FileError::Path(PathError::NotRegularFile { .. }) => {
                ControlError::Invalid(format!("{path}: not a regular file"))
            }
            e => e.into(),
        })
    }

    /// Close the sessions left unused (`--session-grace`, [`SESSION_IDLE`])
    /// every half grace, until the service is dropped; `sweep` runs at each
    /// handshake too.
    pub fn spawn_sweeper(self: &Arc<Self>) {
        let every = (self.cfg.sessions.grace / 2)
            .clamp(Duration::from_millis(100), Duration::from_secs(10));
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(s) = weak.upgrade() else { return };
                // Dropping a session tears its QP down: off the runtime.
                let _ = tokio::task::spawn_blocking(move || s.sweep()).await;
            }
        });
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
        ..proto::Entry::default()
    }
}

/// The gRPC face of [`Service`].
#[derive(Clone)]
pub struct RcpService(pub Arc<Service>);

#[tonic::async_trait]
impl proto::rcp_server::Rcp for RcpService {
    async fn handshake(
        &self,
        req: Request<proto::HandshakeRequest>,
    ) -> std::result::Result<Response<proto::HandshakeResponse>, Status> {
        let s = self.0.clone();
        let client = ClientId::of(&req);
        let r = in_place(|| s.handshake(client, req.into_inner()))?;
        Ok(Response::new(r))
    }

    type MoveStream = BoxStream<ServerFrame>;

    async fn r#move(
        &self,
        req: Request<Streaming<ClientFrame>>,
    ) -> std::result::Result<Response<Self::MoveStream>, Status> {
        let (tx, rx) = mpsc::channel(64);
        let s = self.0.clone();
        let client = ClientId::of(&req);
        tokio::spawn(stream::run(s, client, req.into_inner(), tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn reconnect(
        &self,
        req: Request<proto::ReconnectRequest>,
    ) -> std::result::Result<Response<proto::ReconnectResponse>, Status> {
        let client = ClientId::of(&req);
        Ok(Response::new(in_place(|| {
            self.0.reconnect(client, req.into_inner())
        })?))
    }

    async fn close_session(
        &self,
        req: Request<proto::CloseSessionRequest>,
    ) -> std::result::Result<Response<proto::CloseSessionResponse>, Status> {
        let client = ClientId::of(&req);
        let id = req.into_inner().session_id;
        // Only the client that opened it closes it.
        match self.0.sessions.remove(id, client) {
            Some(s) => {
                if let Some(b) = &self.0.buffers {
                    b.session_closed(id);
                }
                in_place(|| drop(s));
                Ok(Response::new(proto::CloseSessionResponse {}))
            }
            None => Err(session::unknown_session(id).into()),
        }
    }

    async fn stat(
        &self,
        req: Request<proto::StatRequest>,
    ) -> std::result::Result<Response<proto::StatResponse>, Status> {
        self.0.heard(&req);
        let r = req.into_inner();
        let rel = fsutil::root_rel(&r.path);
        let root = &self.0.root;
        match in_place(|| root.lstat(&rel)) {
            Ok(m) => {
                let mut e = entry(String::new(), m.kind, m.len, m.mode, m.mtime);
                if m.kind == FileKind::Symlink {
                    // What `-a` recreates of a top-level link (empty when
                    // not UTF-8: the client then leaves it out, said).
                    let t = in_place(|| root.read_link(&rel)).map_err(ControlError::from)?;
                    e.link_target = t.to_str().unwrap_or_default().to_string();
                }
                if r.fingerprint && m.kind == FileKind::File {
                    let src =
                        in_place(|| SourceFile::open_in(root, &rel)).map_err(ControlError::from)?;
                    e.fingerprint = src
                        .source_id()
                        .map_err(ControlError::from)?
                        .fingerprint
                        .to_vec();
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
        self.0.heard(&req);
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
                    let mut x = entry(
                        e.rel_path.to_string_lossy().into_owned(),
                        kind,
                        e.len,
                        e.mode,
                        e.mtime,
                    );
                    if let Some(t) = e.symlink_target {
                        x.link_target = t.to_string_lossy().into_owned();
                    }
                    out.push(x);
                }
                // What the walk left out, said to the client (which warns
                // and counts it): never dropped silently.
                for s in t.skipped {
                    let bad = s.rel_path.to_str().is_none();
                    let mut x = entry(
                        s.rel_path.to_string_lossy().into_owned(),
                        if bad { FileKind::Other } else { s.kind },
                        0,
                        0,
                        files::Timestamp::default(),
                    );
                    x.left_out = match bad {
                        true => {
                            format!("{} ({})", files::NOT_UTF8, files::shown_bytes(&s.rel_path))
                        }
                        false => s.reason.to_string(),
                    };
                    out.push(x);
                }
            } else {
                for e in root.list(&rel)? {
                    // A name that is not UTF-8 goes as its lossy form, left
                    // out (as the walk says it), never as a directory to
                    // list: that form names nothing here.
                    let bad = e.name.to_str().is_none();
                    let mut x = entry(
                        e.name.to_string_lossy().into_owned(),
                        if bad { FileKind::Other } else { e.meta.kind },
                        e.meta.len,
                        e.meta.mode,
                        e.meta.mtime,
                    );
                    if bad {
                        x.left_out = files::NOT_UTF8.to_string();
                    }
                    out.push(x);
                }
            }
            Ok(out)
        })?;
        if entries.len() > 1_000_000 {
            return Err(ControlError::Exceeded("more than 1000000 entries".into()).into());
        }
        Ok(Response::new(proto::ListResponse { entries }))
    }

    async fn make_dir(
        &self,
        req: Request<proto::MakeDirRequest>,
    ) -> std::result::Result<Response<proto::MakeDirResponse>, Status> {
        self.0.heard(&req);
        in_place(|| self.0.make_dir(req.into_inner(), None))?;
        Ok(Response::new(proto::MakeDirResponse {}))
    }

    async fn make_dirs(
        &self,
        req: Request<proto::MakeDirsRequest>,
    ) -> std::result::Result<Response<proto::MakeDirResponse>, Status> {
        self.0.heard(&req);
        #[cfg(feature = "fault-injection")]
        if crate::faults::fire(crate::faults::NO_MAKE_DIRS) {
            tracing::warn!("test fault: MakeDirs answered as by an rcpd before 2.11");
            return Err(Status::unimplemented("MakeDirs"));
        }
        let dirs = req.into_inner().dirs;
        if dirs.len() > MAKE_DIRS_MAX {
            return Err(ControlError::Invalid(format!(
                "{} directories in one MakeDirs call; at most {MAKE_DIRS_MAX}",
                dirs.len()
            ))
            .into());
        }
        let root = &self.0.root;
        in_place(|| {
            let mut made = root.tree_dirs();
            dirs.into_iter()
                .try_for_each(|d| self.0.make_dir(d, Some(&mut made)))
        })?;
        Ok(Response::new(proto::MakeDirResponse {}))
    }

    async fn make_link(
        &self,
        req: Request<proto::MakeLinkRequest>,
    ) -> std::result::Result<Response<proto::MakeLinkResponse>, Status> {
        self.0.heard(&req);
        let r = req.into_inner();
        let rel = fsutil::root_rel(&r.path);
        let root = &self.0.root;
        in_place(|| root.symlink(&rel, &r.target)).map_err(|e| match e {
            FileError::Path(PathError::SymlinkOutside { .. }) => ControlError::Invalid(format!(
                "{}: symlink target {:?} leads outside",
                r.path, r.target
            )),
            e => e.into(),
        })?;
        Ok(Response::new(proto::MakeLinkResponse {}))
    }

    async fn remove(
        &self,
        req: Request<proto::RemoveRequest>,
    ) -> std::result::Result<Response<proto::RemoveResponse>, Status> {
        self.0.heard(&req);
        let path = req.into_inner().path;
        let rel = fsutil::root_rel(&path);
        let root = &self.0.root;
        in_place(|| root.remove(&rel)).map_err(ControlError::from)?;
        tracing::info!(path = %crate::escape::esc(&path), "removed (--delete)");
        Ok(Response::new(proto::RemoveResponse {}))
    }

    type CopyStream = BoxStream<proto::CopyProgress>;

    async fn copy(
        &self,
        req: Request<proto::CopyRequest>,
    ) -> std::result::Result<Response<Self::CopyStream>, Status> {
        let Some(c) = self.0.copier.clone() else {
            return Err(Status::unimplemented(
                "this rcpd does not copy to other rcpds",
            ));
        };
        Ok(Response::new(
            c.copy(self.0.clone(), req.into_inner()).await?,
        ))
    }

    async fn buffer_grant(
        &self,
        req: Request<proto::BufferGrantRequest>,
    ) -> std::result::Result<Response<proto::BufferGrantResponse>, Status> {
        let Some(b) = self.0.buffers.clone() else {
            return Err(Status::unimplemented("this rcpd does not grant buffers"));
        };
        let peer = req.remote_addr().map(|a| a.ip());
        let conn = conns::conn_of(&req);
        let client = ClientId::of(&req);
        let req = req.into_inner();
        let id = req.session_id;
        // A session the peer still holds but this rcpd closed (idle): the
        // peer opens a new one on `retryable`.
        let session = self
            .0
            .session(id, client)
            .map_err(|e| super::error::session_gone(e.to_string()))?;
        *session.last_used.lock().unwrap() = std::time::Instant::now();
        // A session kept for buffer operations is at work: the idle time
        // closes it, not the grace for sessions that never start.
        session
            .moved
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let r = b.grant(&session, id, req, peer, conn)?;
        Ok(Response::new(r))
    }

    async fn buffer_done(
        &self,
        req: Request<proto::BufferDoneRequest>,
    ) -> std::result::Result<Response<proto::BufferDoneResponse>, Status> {
        let id = req.get_ref().session_id;
        // The session (while open) grants damaged ranges again.
        let (b, session) = self.0.buffer_call(&req, id)?;
        let r = b.done(session.as_deref(), id, req.into_inner())?;
        Ok(Response::new(r))
    }

    async fn buffer_notify(
        &self,
        req: Request<proto::BufferNotifyRequest>,
    ) -> std::result::Result<Response<proto::BufferNotifyResponse>, Status> {
        let id = req.get_ref().session_id;
        let (b, session) = self.0.buffer_call(&req, id)?;
        let r = b.notify(session.as_deref(), id, req.into_inner())?;
        Ok(Response::new(r))
    }

    async fn buffer_messages(
        &self,
        req: Request<proto::BufferMessagesRequest>,
    ) -> std::result::Result<Response<proto::BufferMessagesResponse>, Status> {
        let client = ClientId::of(&req);
        let r = in_place(|| self.0.buffer_messages(client, req.into_inner()))?;
        Ok(Response::new(r))
    }

    async fn digests(
        &self,
        req: Request<proto::DigestsRequest>,
    ) -> std::result::Result<Response<proto::DigestsResponse>, Status> {
        self.0.heard(&req);
        let s = self.0.clone();
        let r = tokio::task::spawn_blocking(move || digests::answer(&s.root, &req.into_inner()))
            .await
            .map_err(|e| ControlError::Other(format!("hashing: {e}")))??;
        Ok(Response::new(r))
    }
}
