//! rcpd: the rcp daemon. Every flag is also an RCPD_* environment variable
//! (what the Kubernetes manifests set); a flag beats the environment.
//! `rcpd --print-env` (hidden) lists those variables, from this command
//! definition: scripts/validate-manifests.sh checks deploy/ against it.

// clap makes the doc comments of the command definition its --help text,
// where `[HOST[:PORT]]` is usage syntax, not a link.
#![allow(rustdoc::broken_intra_doc_links)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{CommandFactory, Parser};
use rcp::control::daemon::{self, DaemonConfig};
use rcp::control::link::MemoryWindows;
use rcp::control::{ServerTls, Transport};
use rcp::parse::RailList;

/// rcpd's defaults ([`DaemonConfig::default`]): the flags' defaults.
static DEFAULTS: std::sync::LazyLock<DaemonConfig> =
    std::sync::LazyLock::new(DaemonConfig::default);

/// `--health-listen`'s default as the flag says it (`none`: off).
static HEALTH_DEFAULT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    DEFAULTS
        .health_listen
        .map_or_else(|| "none".into(), |a| a.to_string())
});

#[derive(Parser, Debug)]
#[command(
    name = "rcpd",
    version,
    about = "rcp daemon: serves push/pull over RDMA (or TCP) beneath --root"
)]
struct Args {
    /// gRPC address (rcp's control plane; port 0 picks one).
    #[arg(long, env = "RCPD_LISTEN", default_value_t = DEFAULTS.listen)]
    listen: SocketAddr,
    /// Plaintext grpc.health.v1 only, no auth ("none" disables).
    #[arg(long, env = "RCPD_HEALTH_LISTEN", default_value = HEALTH_DEFAULT.as_str())]
    health_listen: String,
    /// Prometheus text on GET /metrics (unset: off).
    #[arg(long, env = "RCPD_METRICS_LISTEN")]
    metrics_listen: Option<String>,
    /// Every path is resolved beneath this directory.
    #[arg(long, env = "RCPD_ROOT", required_unless_present = "print_env")]
    root: Option<PathBuf>,
    /// auto (verbs when an RDMA port is ACTIVE, else tcp), verbs or tcp.
    #[arg(long, env = "RCPD_TRANSPORT", default_value = "auto")]
    transport: Transport,
    /// RDMA rails: devices, comma-separated, NAME[:PORT] where a device has
    /// several ports (default: every ACTIVE port of this network namespace
    /// on the NUMA node of the first).
    #[arg(long, env = "RCPD_DEVICE")]
    device: Option<RailList>,
    /// GID index (default: first RoCE v2 IPv4-mapped GID).
    #[arg(long, env = "RCPD_GID_INDEX")]
    gid_index: Option<u32>,
    /// Registered window arena in MiB (4 MiB windows).
    #[arg(long, env = "RCPD_ARENA_MIB", default_value_t = DEFAULTS.arena_mib)]
    arena_mib: usize,
    /// hugetlbfs mount to allocate the arena from.
    #[arg(long, env = "RCPD_HUGEPAGE_DIR")]
    hugepage_dir: Option<PathBuf>,
    /// Verbs: auto (register the arena once and grant each window through a
    /// type-2 memory window bound to the session's QP, where the device has
    /// them; else a registration per grant), on (memory windows or fail),
    /// off (a protection domain per session, a registration per grant).
    #[arg(long, env = "RCPD_MEMORY_WINDOWS", default_value = "auto")]
    memory_windows: MemoryWindows,
    /// Transfers served at once; more wait (back-pressure), they do not fail.
    #[arg(long, env = "RCPD_MAX_TRANSFERS", default_value_t = DEFAULTS.max_transfers)]
    max_transfers: usize,
    /// Of --max-transfers, what one client (its address and, over mutual
    /// TLS, its certificate) runs at once; its others wait (default: half
    /// of --max-transfers, rounded up; set it to --max-transfers to let
    /// one client use them all).
    #[arg(long, env = "RCPD_MAX_TRANSFERS_PER_CLIENT", value_parser = clap::value_parser!(u64).range(1..))]
    max_transfers_per_client: Option<u64>,
    /// Sessions open at once; a handshake beyond is refused.
    #[arg(long, env = "RCPD_MAX_SESSIONS", default_value_t = DEFAULTS.max_sessions as u64, value_parser = clap::value_parser!(u64).range(1..))]
    max_sessions: u64,
    /// Of --max-sessions, what one client may hold.
    #[arg(long, env = "RCPD_MAX_SESSIONS_PER_CLIENT", default_value_t = DEFAULTS.max_sessions_per_client as u64, value_parser = clap::value_parser!(u64).range(1..))]
    max_sessions_per_client: u64,
    /// Seconds a session may stay without a Move stream, while its client
    /// sends no other request either, before it is closed and its QP and
    /// place freed (a session whose streams ran is closed 30 minutes after
    /// its last).
    #[arg(long, env = "RCPD_SESSION_GRACE", default_value_t = DEFAULTS.session_grace.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    session_grace: u64,
    /// Files one session may have open at once.
    #[arg(long, env = "RCPD_MAX_OPEN_FILES", default_value_t = DEFAULTS.max_open_files, value_parser = clap::value_parser!(u32).range(1..=65536))]
    max_open_files: u32,
    /// Seconds a Move stream may go without progress (bytes moved or a file
    /// committed: keepalives are not progress) or without a word from its
    /// client before it is ended and its slots, windows and registrations
    /// are freed; what it wrote stays resumable.
    #[arg(long, env = "RCPD_TIMEOUT", default_value_t = DEFAULTS.timeout.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    timeout: u64,
    /// The block checks clients may ask for (rcp --verify), comma-separated:
    /// blake3, sha256, xxh3, none (the default: all four). Restrict it to
    /// blake3,sha256 to have every copy checked cryptographically; a client
    /// older than protocol 2.2 offers only sha256.
    #[arg(
        long,
        env = "RCPD_VERIFY",
        value_delimiter = ',',
        default_values_t = rcp::files::Check::ALL
    )]
    verify: Vec<rcp::files::Check>,
    /// Bearer token clients must send (prefer --token-file).
    #[arg(long, env = "RCPD_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// File holding the bearer token.
    #[arg(long, env = "RCPD_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// CPU for the completion thread of copies this rcpd makes (Copy API):
    /// auto, none or a CPU number, as rcp's --cq-cpu. Default: auto when
    /// the device's NUMA node offers rcpd 4 or more CPUs, else none.
    #[arg(long, env = "RCPD_CQ_CPU")]
    cq_cpu: Option<rcp::datapath::CqCpu>,
    /// Work requests per doorbell for copies this rcpd makes.
    #[arg(long, env = "RCPD_BATCH", default_value_t = DEFAULTS.batch)]
    batch: usize,
    /// Signal every n-th work request.
    #[arg(long, env = "RCPD_SIGNAL_EVERY", default_value_t = DEFAULTS.signal_every)]
    signal_every: usize,
    /// Bytes per second each copy this rcpd makes through the Copy API,
    /// and each session it opens to a peer for its services' buffer
    /// operations, may move (K/M/G suffixes, fractions allowed; 0:
    /// unlimited). rcpd's own sessions never post (their clients post
    /// every request, under rcp's --bwlimit), so this limits only what rcpd
    /// moves as a client, each session on its own.
    #[arg(long, env = "RCPD_BWLIMIT", value_parser = parse_rate)]
    bwlimit: Option<u64>,
    /// Seconds a session to another rcpd stays warm after a Copy (Copy
    /// API), for the next Copy to that peer with the same settings to reuse
    /// (0: close each session after its Copy).
    #[arg(long, env = "RCPD_COPY_SESSION_IDLE",
          default_value_t = DEFAULTS.copy_pool.idle.as_secs())]
    copy_session_idle: u64,
    /// Warm sessions to other rcpds kept at most, over all peers; the least
    /// recently used is closed first (0: none).
    #[arg(long, env = "RCPD_COPY_SESSIONS", default_value_t = DEFAULTS.copy_pool.max)]
    copy_sessions: usize,
    /// The other rcpds this one may dial as a client, for the Copy API and
    /// buffer operations, handing them its token and TLS client
    /// certificate; comma-separated host names and addresses, each with an
    /// optional :PORT (without one: any port), and networks ADDRESS/PREFIX
    /// (10.0.0.0/16, fd00::/64). A name matches when the Copy names it; an
    /// address or network, the addresses the remote is or resolves to,
    /// and only those are dialled. Anything else is refused (default: no
    /// peers; rcpd dials only itself).
    #[arg(long, env = "RCPD_COPY_PEERS", value_delimiter = ',')]
    copy_peers: Vec<rcp::control::copy_peers::PeerEntry>,
    /// Log filter (tracing EnvFilter syntax, e.g. info or rcp=debug).
    #[arg(long, env = "RCPD_LOG", default_value = "info")]
    log: String,
    /// PEM certificate (chain) for TLS on the gRPC port.
    #[arg(long, env = "RCPD_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "RCPD_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// Require client certificates signed by this PEM CA (mutual TLS).
    #[arg(long, env = "RCPD_TLS_CLIENT_CA")]
    tls_client_ca: Option<PathBuf>,
    /// CA to trust when this rcpd copies to or from another (Copy API);
    /// default: --tls-client-ca.
    #[arg(long, env = "RCPD_TLS_PEER_CA")]
    tls_peer_ca: Option<PathBuf>,
    /// Remove partial files (`.rcp-*.part` and their manifests, what an
    /// interrupted push leaves for `--resume`) beneath --root that neither
    /// the copy nor its manifest wrote for this long (`12h`, `1d`, `3600`:
    /// seconds unless suffixed s, m, h, d; 0: never). Swept at start, then
    /// every quarter of it (at least every second, at most hourly); never a
    /// partial a live transfer holds.
    #[arg(long, env = "RCPD_PARTIAL_TTL", default_value = "1d", value_parser = parse_ttl)]
    partial_ttl: Duration,
    /// Seconds running transfers get to finish after SIGTERM/SIGINT.
    #[arg(long, env = "RCPD_SHUTDOWN_GRACE", default_value_t = DEFAULTS.shutdown_grace.as_secs())]
    shutdown_grace: u64,
    /// Also serve on this unix socket (mode 0660): the gRPC API, and the
    /// service protocol through which local services hand rcpd their
    /// buffers (memfds) to move (docs/buffers.md).
    #[arg(long, env = "RCPD_SOCKET")]
    socket: Option<PathBuf>,
    /// Print every RCPD_* variable rcpd reads, one per line, and exit.
    #[arg(long, hide = true)]
    print_env: bool,
}

/// The RCPD_* variables of the command definition, in flag order.
fn env_names() -> Vec<String> {
    Args::command()
        .get_arguments()
        .filter_map(|a| a.get_env())
        .map(|e| e.to_string_lossy().into_owned())
        .collect()
}

fn parse_rate(s: &str) -> Result<u64, String> {
    rcp::parse::bytes(s).map_err(|e| e.to_string())
}

fn parse_ttl(s: &str) -> Result<Duration, String> {
    rcp::parse::duration(s).map_err(|e| e.to_string())
}

fn addr_opt(s: Option<&str>, what: &str) -> anyhow::Result<Option<SocketAddr>> {
    match s.map(str::trim) {
        None | Some("") | Some("none") | Some("off") => Ok(None),
        Some(a) => {
            Ok(Some(a.parse().with_context(|| {
                format!("{what} {a:?} is not ADDR:PORT")
            })?))
        }
    }
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    if a.print_env {
        for name in env_names() {
            println!("{name}");
        }
        return Ok(());
    }
    let root = a.root.context("--root is required")?;
    // Colours only on a terminal: a log file or `kubectl logs` gets plain
    // text (and no escape sequence rcpd did not escape itself).
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&a.log)
                .with_context(|| format!("bad --log filter {:?}", a.log))?,
        )
        .init();
    // The hashing pool (rcpd verifies and fills windows) and the
    // completion thread of the copies it makes, placed as rcp's are.
    let cq_cpu = rcp::control::place_copy_threads(
        a.device
            .as_ref()
            .and_then(|d| d.0.first())
            .map(|r| r.device.as_str()),
        a.cq_cpu,
    );
    let nofile = rcp::control::raise_open_file_limit();
    let want = a.max_transfers as u64 * u64::from(a.max_open_files) + 256;
    if want > nofile {
        tracing::warn!(
            nofile,
            max_transfers = a.max_transfers,
            max_open_files = a.max_open_files,
            "the open-file limit is below --max-transfers x --max-open-files: busy sessions may fail to open files"
        );
    }
    let token = match (&a.token, &a.token_file) {
        (Some(_), Some(_)) => bail!("give --token or --token-file, not both"),
        (Some(t), None) => Some(t.trim().to_string()),
        (None, Some(f)) => Some(
            std::fs::read_to_string(f)
                .with_context(|| format!("reading the token file {}", f.display()))?
                .trim()
                .to_string(),
        ),
        (None, None) => None,
    };
    if token.as_deref() == Some("") {
        bail!("the token is empty");
    }
    if token.is_none() {
        tracing::warn!("no token configured: every client is accepted");
    }
    let cfg = DaemonConfig {
        listen: a.listen,
        health_listen: addr_opt(Some(&a.health_listen), "--health-listen")?,
        metrics_listen: addr_opt(a.metrics_listen.as_deref(), "--metrics-listen")?,
        root,
        transport: a.transport,
        rails: a.device.map(|d| d.0).unwrap_or_default(),
        gid_index: a.gid_index,
        arena_mib: a.arena_mib,
        hugepage_dir: a.hugepage_dir,
        memory_windows: a.memory_windows,
        max_transfers: a.max_transfers,
        max_transfers_per_client: a.max_transfers_per_client.map(|n| n as usize),
        max_sessions: a.max_sessions as usize,
        max_sessions_per_client: a.max_sessions_per_client as usize,
        session_grace: Duration::from_secs(a.session_grace),
        max_open_files: a.max_open_files,
        timeout: Duration::from_secs(a.timeout),
        checks: a.verify,
        token,
        cq_cpu,
        batch: a.batch,
        signal_every: a.signal_every,
        shutdown_grace: Duration::from_secs(a.shutdown_grace),
        tls: ServerTls::from_flags(a.tls_cert, a.tls_key, a.tls_client_ca)
            .map_err(|e| anyhow::anyhow!(e))?,
        tls_peer_ca: a.tls_peer_ca,
        bwlimit: a.bwlimit.filter(|&r| r > 0),
        socket: a.socket,
        copy_pool: rcp::control::jobs::PoolConfig {
            idle: Duration::from_secs(a.copy_session_idle),
            max: a.copy_sessions,
        },
        copy_peers: a.copy_peers,
    };
    // A rate too low for the timeout would fail every copy: say so now.
    rcp::control::ClientOptions {
        bwlimit: cfg.bwlimit,
        timeout: cfg.timeout,
        ..Default::default()
    }
    .check_bwlimit()
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    if !a.partial_ttl.is_zero() {
        rcp::files::partials::spawn_sweeper(cfg.root.clone(), a.partial_ttl)
            .context("starting the partial-file sweeper")?;
    }
    let rt = tokio::runtime::Runtime::new().context("starting the runtime")?;
    rt.block_on(daemon::run(cfg, daemon::shutdown_signal(), |b, why| {
        let mut line = format!("rcpd listening on {} transport {why}", b.grpc);
        if let Some(h) = b.health {
            line.push_str(&format!(" health {h}"));
        }
        if let Some(m) = b.metrics {
            line.push_str(&format!(" metrics http://{m}/metrics"));
        }
        if let Some(s) = &b.socket {
            line.push_str(&format!(" socket {}", s.display()));
        }
        println!("{line}");
    }))
    .map_err(|e| anyhow::anyhow!(e))?;
    Ok(())
}
