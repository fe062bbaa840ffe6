//! Running rcpd: the gRPC server with auth, health, reflection, message
//! limits, the plaintext health port, `/metrics`, graceful shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio_stream::wrappers::TcpListenerStream;
use tonic::service::interceptor::InterceptedService;
use tonic::service::Routes;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;

use super::auth::CheckBearer;
use super::buffers::rpc::GrantService;
use super::buffers::socket::Socket;
use super::buffers::{Buffers, BuffersConfig};
use super::client::ClientOptions;
use super::copy::CopyService;
use super::copy_peers::CopyPeers;
use super::error::{ControlError, Result};
use super::link::{resolve_transport, MemoryWindows, ServerLink, ServerLinkConfig, Transport};
use super::server::{RcpService, Service, ServiceConfig};
use super::{MAX_MESSAGE, WINDOW_SIZE};
use crate::proto::rcp_server::RcpServer;

/// rcpd's settings (flags / `RCPD_*`).
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    pub listen: SocketAddr,
    pub health_listen: Option<SocketAddr>,
    pub metrics_listen: Option<SocketAddr>,
    pub root: PathBuf,
    pub transport: Transport,
    /// Verbs: the rails rcpd serves on (`RCPD_DEVICE=a,b`; empty: the
    /// default rails).
    pub rails: Vec<crate::parse::RailName>,
    pub gid_index: Option<u32>,
    pub arena_mib: usize,
    pub hugepage_dir: Option<PathBuf>,
    /// Verbs: grant windows through memory windows (the arena registered
    /// once) or with a registration each.
    pub memory_windows: MemoryWindows,
    pub max_transfers: usize,
    /// Of those, one client's (`None`: half, rounded up).
    pub max_transfers_per_client: Option<usize>,
    /// Sessions open at once; one client's.
    pub max_sessions: usize,
    pub max_sessions_per_client: usize,
    /// A session that opens no Move stream this long after its handshake
    /// is closed.
    pub session_grace: Duration,
    pub token: Option<String>,
    pub cq_cpu: Option<usize>,
    pub batch: usize,
    pub signal_every: usize,
    pub shutdown_grace: Duration,
    /// A Move stream that waits and makes no progress this long is ended,
    /// and its slots, windows and registrations are freed.
    pub timeout: Duration,
    /// Files one session may have open at once.
    pub max_open_files: u32,
    /// Checks clients may ask for.
    pub checks: Vec<crate::files::Check>,
    /// TLS on the gRPC port (mTLS when it names a client CA).
    pub tls: Option<super::tls::ServerTls>,
    /// CA to trust when this rcpd copies to/from another (Copy API);
    /// default: the client CA.
    pub tls_peer_ca: Option<PathBuf>,
    /// Bytes per second each copy this rcpd makes (Copy API), and each
    /// session it opens to a peer for buffer operations, may post, on the
    /// data path it drives as that session's client (`None`: unlimited).
    /// rcpd's own sessions post nothing: their clients do, under their own
    /// `--bwlimit`.
    pub bwlimit: Option<u64>,
    /// A unix socket serving the gRPC API and the service protocol for
    /// buffers (docs/buffers.md), mode 0660.
    pub socket: Option<PathBuf>,
    /// Sessions the Copy API keeps warm to other rcpds, and how long.
    pub copy_pool: super::jobs::PoolConfig,
    /// The other rcpds this one may dial, with its token and TLS client
    /// certificate (Copy API, buffer operations); empty: only itself.
    pub copy_peers: Vec<super::copy_peers::PeerEntry>,
}

/// rcpd's defaults, in one place: rcpd's flags take theirs from here, and
/// a test or an embedding changes only what it needs.
impl Default for DaemonConfig {
    fn default() -> Self {
        let dp = crate::datapath::DataPathConfig::default();
        DaemonConfig {
            listen: SocketAddr::from(([0, 0, 0, 0], 7471)),
            health_listen: Some(SocketAddr::from(([0, 0, 0, 0], 7472))),
            metrics_listen: None,
            root: PathBuf::new(),
            transport: Transport::Auto,
            rails: Vec::new(),
            gid_index: None,
            arena_mib: 256,
            hugepage_dir: None,
            memory_windows: MemoryWindows::Auto,
            max_transfers: 16,
            max_transfers_per_client: None,
            max_sessions: super::server::DEFAULT_MAX_SESSIONS,
            max_sessions_per_client: super::server::DEFAULT_MAX_SESSIONS_PER_CLIENT,
            session_grace: super::server::DEFAULT_SESSION_GRACE,
            token: None,
            cq_cpu: None,
            batch: dp.batch,
            signal_every: dp.signal_every,
            shutdown_grace: Duration::from_secs(30),
            timeout: Duration::from_secs(60),
            max_open_files: super::DEFAULT_MAX_OPEN_FILES,
            checks: crate::files::Check::ALL.to_vec(),
            tls: None,
            tls_peer_ca: None,
            bwlimit: None,
            socket: None,
            copy_pool: super::jobs::PoolConfig::default(),
            copy_peers: Vec::new(),
        }
    }
}

/// Addresses actually bound (port 0 resolved).
#[derive(Clone, Debug)]
pub struct Bound {
    pub grpc: SocketAddr,
    pub health: Option<SocketAddr>,
    pub metrics: Option<SocketAddr>,
    pub socket: Option<PathBuf>,
}

/// Wait for SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// Build and serve until `shutdown` resolves; `on_bound` is told the bound
/// addresses once listening.
pub async fn run(
    cfg: DaemonConfig,
    shutdown: impl Future<Output = ()>,
    on_bound: impl FnOnce(&Bound, &str),
) -> Result<()> {
    let root = canonical_root(&cfg.root)?;
    let (link, why) = open_link(&cfg).await?;
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(ControlError::io(format!("binding {}", cfg.listen)))?;
    let grpc_addr = listener
        .local_addr()
        .map_err(ControlError::io("local address"))?;
    let (svc, buffers) = start_service(&cfg, root.clone(), link, grpc_addr)?;
    let metrics = svc.metrics.clone();
    let (reporter, health_svc) = tonic_health::server::health_reporter();
    reporter.set_serving::<RcpServer<RcpService>>().await;
    let health_routes = Routes::new(health_svc);
    let routes = api_routes(health_routes.clone(), &svc, cfg.token.clone())?;

    let health = serve_health(cfg.health_listen, health_routes).await?;
    let metrics_addr = serve_metrics(cfg.metrics_listen, &metrics).await?;
    // The unix socket: the same gRPC services, and the service protocol.
    let socket = match &cfg.socket {
        Some(p) => Some(
            super::buffers::socket::bind(p).map_err(ControlError::io(format!(
                "binding the unix socket {}",
                p.display()
            )))?,
        ),
        None => None,
    };
    let bound = Bound {
        grpc: grpc_addr,
        health,
        metrics: metrics_addr,
        socket: socket.as_ref().map(|s| s.path.clone()),
    };
    tracing::info!(grpc = %grpc_addr, ?health, metrics = ?metrics_addr, root = %root.display(), transport = %why, "rcpd serving");
    on_bound(&bound, &why);

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut builder = grpc_server(&cfg)?;
    let (unix_stop_tx, unix_stop_rx) = tokio::sync::oneshot::channel::<()>();
    let unix_tasks = match socket {
        Some(sock) => serve_unix(sock, &buffers, routes.clone(), unix_stop_rx),
        None => Vec::new(),
    };
    let server = tokio::spawn(
        builder
            .add_routes(routes)
            // No Nagle: a small frame waiting for an ACK delayed by 40 ms
            // turns every grant and ack into a 40 ms round trip.
            // Each connection known: a peer's grants go with it.
            .serve_with_incoming_shutdown(
                super::server::conns::tracked(
                    TcpIncoming::from(listener).with_nodelay(Some(true)),
                    buffers.clone(),
                ),
                async {
                    let _ = stop_rx.await;
                },
            ),
    );
    shutdown.await;
    let active = metrics.active_transfers();
    tracing::info!(active, grace = ?cfg.shutdown_grace, "shutting down: no new requests; running transfers may finish");
    reporter.set_not_serving::<RcpServer<RcpService>>().await;
    let _ = stop_tx.send(());
    let _ = unix_stop_tx.send(());
    drain(server, cfg.shutdown_grace, &metrics).await;
    for t in unix_tasks {
        t.abort();
    }
    if let Some(p) = &cfg.socket {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}

/// `root` resolved, and a directory.
fn canonical_root(root: &Path) -> Result<PathBuf> {
    let root = std::fs::canonicalize(root)
        .map_err(|e| ControlError::DirNotFound(format!("root {}: {e}", root.display())))?;
    if !root.is_dir() {
        return Err(ControlError::DirNotFound(format!(
            "root {} is not a directory",
            root.display()
        )));
    }
    Ok(root)
}

/// The data path rcpd serves on: the transport chosen (and why), its
/// arena and rails opened.
async fn open_link(cfg: &DaemonConfig) -> Result<(ServerLink, String)> {
    let (kind, why) = resolve_transport(cfg.transport, &cfg.rails);
    let lcfg = ServerLinkConfig {
        kind,
        rails: cfg.rails.clone(),
        gid_index: cfg.gid_index,
        arena_bytes: cfg.arena_mib.max(8) << 20,
        hugepage_dir: cfg.hugepage_dir.clone(),
        window_size: WINDOW_SIZE,
        tcp_listen: SocketAddr::new(cfg.listen.ip(), 0),
        memory_windows: cfg.memory_windows,
        tcp_fallback: cfg.transport == Transport::Auto,
    };
    let link = tokio::task::spawn_blocking(move || ServerLink::open(&lcfg))
        .await
        .map_err(|e| ControlError::Other(e.to_string()))??;
    Ok((link, why))
}

/// The service over `link`, with its Copy API and buffer operations set
/// up to dial the peers `--copy-peers` allows (`grpc_addr` being this
/// rcpd itself), and its session sweeper running; and the services'
/// buffers it grants from (the unix socket serves them).
fn start_service(
    cfg: &DaemonConfig,
    root: PathBuf,
    link: ServerLink,
    grpc_addr: SocketAddr,
) -> Result<(Arc<Service>, Arc<Buffers>)> {
    let peer_opts = peer_options(cfg);
    let peers = Arc::new(CopyPeers::new(cfg.copy_peers.clone()).with_own(grpc_addr));
    if peers.entries().is_empty() {
        tracing::info!("no --copy-peers: Copy and buffer operations reach only this rcpd");
    } else {
        tracing::info!(copy_peers = %peers.entries().iter().map(ToString::to_string).collect::<Vec<_>>().join(","), "peers this rcpd may dial");
    }
    // One pool of sessions to peers, for Copy and buffer operations.
    let pool = super::jobs::Pool::new(cfg.copy_pool);
    let copier = CopyService {
        opts: peer_opts.clone(),
        pool: pool.clone(),
        peers: peers.clone(),
    };
    let metrics = Arc::new(crate::metrics::Metrics::new());
    let buffers = Buffers::new(BuffersConfig {
        // Buffer sessions' data paths show in this rcpd's /metrics (each
        // rail's series), as copies' do.
        client: ClientOptions {
            metrics: Some(metrics.clone()),
            ..peer_opts
        },
        peers,
        default_check: cfg.checks.first().copied(),
        token: cfg.token.clone(),
        node: super::buffers::node_address(grpc_addr),
        pool,
    });
    let svc = Service::new(
        service_config(cfg, root),
        link,
        metrics,
        Some(Arc::new(copier)),
        Some(Arc::new(GrantService(buffers.clone()))),
    )?;
    svc.spawn_sweeper();
    Ok((svc, buffers))
}

fn service_config(cfg: &DaemonConfig, root: PathBuf) -> ServiceConfig {
    ServiceConfig {
        root,
        max_transfers: cfg.max_transfers,
        max_transfers_per_client: cfg
            .max_transfers_per_client
            .unwrap_or_else(|| super::server::default_transfers_per_client(cfg.max_transfers)),
        sessions: super::server::SessionLimits {
            max_sessions: cfg.max_sessions,
            per_client: cfg.max_sessions_per_client,
            grace: cfg.session_grace,
        },
        windows_per_session: 8,
        max_open_files: cfg.max_open_files,
        timeout: cfg.timeout,
        checks: cfg.checks.clone(),
    }
}

/// The client settings rcpd uses when it dials another rcpd (Copy API,
/// buffer operations).
fn peer_options(cfg: &DaemonConfig) -> ClientOptions {
    ClientOptions {
        token: cfg.token.clone(),
        transport: cfg.transport,
        rails: cfg.rails.clone(),
        gid_index: cfg.gid_index,
        batch: cfg.batch,
        signal_every: cfg.signal_every,
        cq_cpu: cfg.cq_cpu,
        timeout: cfg.timeout,
        bwlimit: cfg.bwlimit,
        tls: cfg
            .tls
            .as_ref()
            .and_then(|t| t.as_client(cfg.tls_peer_ca.clone())),
        ..ClientOptions::default()
    }
}

/// The gRPC API, as the TCP port and the unix socket serve it: `health`,
/// reflection, and the rcp service behind the bearer check.
fn api_routes(health: Routes, svc: &Arc<Service>, token: Option<String>) -> Result<Routes> {
    // Reflection in both versions: grpc.reflection.v1, and v1alpha for the
    // clients that still ask only that (older grpcurl, grpcui, Postman).
    let reflection_builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
    };
    let reflection = reflection_builder()
        .build_v1()
        .map_err(|e| ControlError::Other(format!("reflection v1: {e}")))?;
    let reflection_v1alpha = reflection_builder()
        .build_v1alpha()
        .map_err(|e| ControlError::Other(format!("reflection v1alpha: {e}")))?;
    let rcp = RcpServer::new(RcpService(svc.clone()))
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    let rcp = InterceptedService::new(rcp, CheckBearer::new(token, svc.metrics.clone()));
    Ok(health
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(rcp))
}

/// The plaintext health port, if asked for: its bound address.
async fn serve_health(at: Option<SocketAddr>, health: Routes) -> Result<Option<SocketAddr>> {
    let Some(a) = at else { return Ok(None) };
    let l = tokio::net::TcpListener::bind(a)
        .await
        .map_err(ControlError::io(format!("binding health {a}")))?;
    let addr = l.local_addr().map_err(ControlError::io("local address"))?;
    tokio::spawn(
        Server::builder()
            .add_routes(health)
            .serve_with_incoming(TcpListenerStream::new(l)),
    );
    Ok(Some(addr))
}

/// `/metrics`, if asked for: its bound address.
async fn serve_metrics(
    at: Option<SocketAddr>,
    metrics: &Arc<crate::metrics::Metrics>,
) -> Result<Option<SocketAddr>> {
    let Some(a) = at else { return Ok(None) };
    let l = tokio::net::TcpListener::bind(a)
        .await
        .map_err(ControlError::io(format!("binding metrics {a}")))?;
    let addr = l.local_addr().map_err(ControlError::io("local address"))?;
    tokio::spawn(crate::metrics::serve(l, metrics.clone()));
    Ok(Some(addr))
}

/// The gRPC port's server: HTTP/2 keepalive, and TLS when configured.
fn grpc_server(cfg: &DaemonConfig) -> Result<Server> {
    // HTTP/2 pings notice a dead client host or a cut path; a stopped
    // client process is the Move stream's own timeout.
    let ping = (cfg.timeout / 3).max(Duration::from_secs(1));
    let mut builder = Server::builder()
        .http2_keepalive_interval(Some(ping))
        .http2_keepalive_timeout(Some(ping));
    if let Some(t) = &cfg.tls {
        builder = builder
            .tls_config(t.config()?)
            .map_err(|e| ControlError::Usage(format!("TLS configuration: {e}")))?;
    }
    Ok(builder)
}

/// The unix socket: its accept loop, which hands gRPC connections to
/// `routes` and serves the service protocol itself, until `stop`; the
/// socket file is removed when the gRPC side ends.
fn serve_unix(
    sock: Socket,
    buffers: &Arc<Buffers>,
    routes: Routes,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let Socket { listener, path } = sock;
    let accept = tokio::spawn(super::buffers::socket::accept_loop(
        listener,
        tx,
        buffers.clone(),
    ));
    let grpc = tokio::spawn(async move {
        let _ = Server::builder()
            .add_routes(routes)
            .serve_with_incoming_shutdown(tokio_stream::wrappers::ReceiverStream::new(rx), async {
                let _ = stop.await;
            })
            .await;
        let _ = std::fs::remove_file(&path);
    });
    vec![accept, grpc]
}

/// Wait up to `grace` for the gRPC server to end (its running transfers
/// to finish), saying how it ended.
async fn drain(
    server: tokio::task::JoinHandle<std::result::Result<(), tonic::transport::Error>>,
    grace: Duration,
    metrics: &crate::metrics::Metrics,
) {
    match tokio::time::timeout(grace, server).await {
        Ok(Ok(Ok(()))) => tracing::info!("stopped cleanly"),
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "server error at shutdown"),
        Ok(Err(e)) => tracing::warn!(error = %e, "server task failed"),
        Err(_) => tracing::warn!(
            active = metrics.active_transfers(),
            "shutdown deadline passed; cutting the remaining transfers (their temp files stay for --resume)"
        ),
    }
}
