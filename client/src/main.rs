//! `rcp`: push and pull files to and from rcpd over RDMA (or TCP).

// clap makes the doc comments of the command definition its --help text,
// where `[HOST[:PORT]]` is usage syntax, not a link.
#![allow(rustdoc::broken_intra_doc_links)]

mod fanout;
mod signals;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use rcp::control::client::Observer;
use rcp::control::jobs::{self, Job, Paths, Plan};
use rcp::control::{exit, Client, ClientOptions, ClientTls, ControlError, FileResult, Transport};
use rcp::escape;
use rcp::json::{self, line};
use rcp::parse::RailList;
use rcp::proto::Direction;

const AFTER_HELP: &str = "\
Remote paths are HOST:PATH or [IPV6]:PATH, resolved beneath the server's --root.
The bearer token is read from --token-file or RCP_TOKEN (rcp has no users:
HOST:PATH, never user@HOST:PATH). Every flag can also be set as RCP_<FLAG>
(e.g. RCP_PORT, RCP_TRANSPORT, RCP_BLOCK_SIZE); a flag beats the environment.

Exit codes:
  0  success: everything copied and verified
  1  usage or syntax error
  2  other error
  3  directory not found
  4  file not found
  5  temporary error (network, server unavailable): retry, --resume continues
  6  fatal error (integrity mismatch, authentication, permission, refused request)
  7  transfer exceeded a limit (size, space at the destination)
  8  protocol violation: rcpd (or this rcp) sent a message outside the protocol
  9  --fanout: a node that answers does not hold every file
  130  interrupted by SIGINT: aborted cleanly, stderr says the --resume command
  143  terminated by SIGTERM: as 130";

#[derive(Parser, Debug)]
#[command(name = "rcp", version, about = "Copy files between hosts over RDMA (rcpd on the other side)", after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// rcpd's gRPC port.
    #[arg(
        help_heading = "Connection and security",
        short = 'P',
        long,
        env = "RCP_PORT",
        default_value_t = 7471,
        global = true
    )]
    port: u16,
    /// auto (verbs when an RDMA port is ACTIVE, else tcp), verbs or tcp.
    #[arg(
        help_heading = "Transport and data path",
        long,
        env = "RCP_TRANSPORT",
        default_value = "auto",
        global = true
    )]
    transport: Transport,
    /// RDMA rails: devices, comma-separated, NAME[:PORT] where a device has
    /// several ports (default: every ACTIVE port of this network namespace
    /// on the NUMA node of the first).
    #[arg(
        help_heading = "Transport and data path",
        long,
        env = "RCP_DEVICE",
        global = true
    )]
    device: Option<RailList>,
    /// With --transport auto: when every RDMA rail has been down this many
    /// seconds with blocks waiting, continue the copy over the tcp provider,
    /// resuming what was verified (0: never). A verbs session that cannot be
    /// set up continues over tcp at once. rcpd of --transport auto serves
    /// both.
    #[arg(
        help_heading = "Transport and data path",
        long,
        env = "RCP_TCP_FALLBACK_AFTER",
        default_value_t = rcp::control::client::DEFAULT_TCP_FALLBACK_AFTER.as_secs(),
        global = true
    )]
    tcp_fallback_after: u64,
    /// Queue pairs per rail, for links one QP cannot fill (1..=16).
    #[arg(help_heading = "Transport and data path", long, env = "RCP_QPS_PER_RAIL", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16), global = true)]
    qps_per_rail: u32,
    /// GID index (default: first RoCE v2 IPv4-mapped GID).
    #[arg(
        help_heading = "Transport and data path",
        long,
        env = "RCP_GID_INDEX",
        global = true
    )]
    gid_index: Option<u32>,
    /// Block size: a power of two >= 4096, suffixes K/M allowed (max 4M).
    #[arg(help_heading = "Transport and data path", long, env = "RCP_BLOCK_SIZE", default_value = "1M", value_parser = parse_size, global = true)]
    block_size: u64,
    /// Work requests per doorbell (1..=64).
    #[arg(help_heading = "Transport and data path", long, env = "RCP_BATCH", default_value_t = rcp::datapath::DataPathConfig::default().batch, global = true)]
    batch: usize,
    /// Signal every n-th work request of a chain (default: 32; bench: the batch).
    #[arg(
        help_heading = "Transport and data path",
        long,
        env = "RCP_SIGNAL_EVERY",
        global = true
    )]
    signal_every: Option<usize>,
    /// Post writes up to this many bytes inline (0 disables; default 64, or
    /// the device's limit if lower; bench: 0).
    #[arg(
        help_heading = "Transport and data path",
        long,
        env = "RCP_INLINE",
        global = true
    )]
    inline: Option<u32>,
    /// Completion thread: poll, event, hybrid or hybrid:K (default: hybrid
    /// on verbs, event on tcp; bench: poll).
    #[arg(
        help_heading = "Transport and data path",
        long,
        visible_alias = "mode",
        env = "RCP_POLL_MODE",
        global = true
    )]
    poll_mode: Option<rcp::datapath::PollMode>,
    /// Completion thread's CPU: auto (a CPU of the device's NUMA node), none
    /// (unpinned) or a CPU number. Default for copies: auto when the
    /// device's NUMA node offers this process 4 or more CPUs, else none;
    /// bench: none. While a pinned completion thread polls, the posting
    /// thread keeps off its CPU.
    #[arg(
        help_heading = "Transport and data path",
        long,
        env = "RCP_CQ_CPU",
        global = true
    )]
    cq_cpu: Option<rcp::datapath::CqCpu>,
    /// The data QP's local ACK timeout exponent, 0..=31 (4.096 us * 2^N;
    /// default 14, ~67 ms).
    #[arg(help_heading = "Transport and data path", long, env = "RCP_QP_TIMEOUT", default_value_t = rcp::datapath::QpRetry::default().ack_timeout, value_parser = clap::value_parser!(u8).range(0..=31), global = true)]
    qp_timeout: u8,
    /// The data QP's retransmissions before a request fails and the data
    /// path reconnects, 0..=7 (default 7; Soft-RoCE retries 7 forever).
    #[arg(help_heading = "Transport and data path", long, env = "RCP_QP_RETRY_CNT", default_value_t = rcp::datapath::QpRetry::default().retry_cnt, value_parser = clap::value_parser!(u8).range(0..=7), global = true)]
    qp_retry_cnt: u8,
    /// Continue an interrupted copy from its manifest, moving only missing blocks.
    #[arg(help_heading = "Copying", long, env = "RCP_RESUME", global = true)]
    resume: bool,
    /// Files in flight at once (open on the session's stream).
    #[arg(help_heading = "Transport and data path", long, env = "RCP_TRANSFERS", default_value_t = rcp::control::client::DEFAULT_TRANSFERS, value_parser = clap::value_parser!(u32).range(1..=4096), global = true)]
    transfers: u32,
    /// Seconds without progress (or without a word from rcpd) before the
    /// copy gives up with exit code 5; --resume continues it.
    #[arg(help_heading = "Connection and security", long, env = "RCP_TIMEOUT", default_value_t = rcp::control::client::DEFAULT_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..), global = true)]
    timeout: u64,
    /// How every block is checked end to end, one check or several
    /// (comma-separated, preferred first; rcpd takes the first it allows,
    /// RCPD_VERIFY): blake3 (cryptographic, fast), sha256 (cryptographic,
    /// SHA-2), xxh3 (xxh3-128: fast, catches damage, not an attacker), none
    /// (the link's CRCs only). The default gets BLAKE3, or SHA-256 from an
    /// rcpd older than protocol 2.2 or one that does not allow BLAKE3.
    #[arg(
        help_heading = "Transport and data path",
        long,
        env = "RCP_VERIFY",
        value_delimiter = ',',
        default_values_t = rcp::files::DEFAULT_CHECKS,
        global = true
    )]
    verify: Vec<rcp::files::Check>,
    /// Also compute each file's flat SHA-256 (the sha256sum value) on the
    /// receiving side and print it in the summary.
    #[arg(help_heading = "Copying", long, env = "RCP_SHA256", global = true)]
    sha256: bool,
    /// Preserve mode and mtime.
    #[arg(
        help_heading = "Copying",
        short = 'p',
        long,
        env = "RCP_PRESERVE",
        global = true
    )]
    preserve: bool,
    /// No progress, no summary.
    #[arg(help_heading = "Output", short, long, env = "RCP_QUIET", global = true)]
    quiet: bool,
    /// Print one JSON object per line on stdout instead of the human
    /// output (push, pull, bench, doctor; schema in docs/json.md).
    #[arg(help_heading = "Output", long, env = "RCP_JSON", global = true)]
    json: bool,
    /// File holding rcpd's bearer token (surrounding whitespace trimmed);
    /// without it the token is read from RCP_TOKEN. Beats RCP_TOKEN.
    #[arg(
        help_heading = "Connection and security",
        long,
        env = "RCP_TOKEN_FILE",
        global = true
    )]
    token_file: Option<PathBuf>,
    /// Talk TLS to rcpd, trusting this PEM CA.
    #[arg(
        help_heading = "Connection and security",
        long,
        env = "RCP_TLS_CA",
        global = true
    )]
    tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for an rcpd that requires mutual TLS.
    #[arg(
        help_heading = "Connection and security",
        long,
        env = "RCP_TLS_CERT",
        global = true,
        requires = "tls_ca"
    )]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(
        help_heading = "Connection and security",
        long,
        env = "RCP_TLS_KEY",
        global = true,
        requires = "tls_cert"
    )]
    tls_key: Option<PathBuf>,
    /// Name rcpd's certificate must carry (default: the host given).
    #[arg(
        help_heading = "Connection and security",
        long,
        env = "RCP_TLS_DOMAIN",
        global = true,
        requires = "tls_ca"
    )]
    tls_domain: Option<String>,
    /// More logging (-v, -vv).
    #[arg(help_heading = "Output", short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// rcp bench [HOST[:PORT]]: perftest-like benchmark of the data path
    /// over verbs. Without HOST: loopback on the local device (two QPs, one
    /// process). --server: serve one client (perftest style). With
    /// --transport tcp (or auto on a host without RDMA devices): loopback
    /// through the TCP provider on 127.0.0.1. Uses the global --batch,
    /// --signal-every, --inline, --mode, --device, --gid-index. Prints one
    /// `bench op=... ` line per run.
    Bench {
        /// A `rcp bench --server` to run against (port 18515 unless given).
        host: Option<String>,
        /// Serve a bench client: register a region per QP, send endpoints,
        /// rkeys and addresses; exit after one client.
        #[arg(long, env = "RCP_BENCH_SERVER", conflicts_with_all = ["host", "compare"])]
        server: bool,
        /// Where the server listens.
        #[arg(long, env = "RCP_BENCH_LISTEN", default_value = "0.0.0.0:18515")]
        listen: String,
        /// Serve clients until killed instead of exiting after one.
        #[arg(long, env = "RCP_BENCH_KEEP_SERVING")]
        keep_serving: bool,
        /// The seed's table on the local device: single post + signal every
        /// vs batch 32 + signal last vs + inline; poll vs event p99.
        #[arg(long, env = "RCP_BENCH_COMPARE", conflicts_with = "host")]
        compare: bool,
        /// write or read.
        #[arg(long, env = "RCP_BENCH_OP", default_value = "write", value_parser = rcp::bench::parse_op)]
        op: rcp::engine::OpKind,
        /// Bytes per message (K/M suffixes), 1..=16M.
        #[arg(long, env = "RCP_BENCH_SIZE", default_value = "65536", value_parser = parse_bytes)]
        size: u64,
        /// Messages per QP (default 10000; --compare: 100000 for the 64 B runs).
        #[arg(long, env = "RCP_BENCH_ITERS")]
        iters: Option<u64>,
        /// Repeat rounds (of about 64 MiB, at most 10000 messages) until this
        /// many seconds have passed.
        #[arg(long, env = "RCP_BENCH_SECONDS", conflicts_with = "iters")]
        seconds: Option<f64>,
        /// QPs in parallel, one thread each (1..=8).
        #[arg(long, env = "RCP_BENCH_QPS", default_value_t = 1)]
        qps: usize,
        /// Most work requests outstanding per QP, 1..=128 (perftest's
        /// --tx-depth; default: the whole send queue, 128).
        #[arg(short = 't', long, env = "RCP_BENCH_TX_DEPTH")]
        tx_depth: Option<u32>,
    },
    /// rcp push [-r] [-n] [--bwlimit RATE] LOCAL... HOST:REMOTE
    Push {
        #[command(flatten)]
        copy: CopyArgs,
        /// Local sources, then HOST:REMOTE.
        #[arg(required = true, num_args = 2..)]
        args: Vec<String>,
    },
    /// rcp doctor [HOST]: what stands between this host and an RDMA copy
    /// (devices, ports, GIDs, MTU, memlock, huge pages) and whether the
    /// rcpd on HOST answers. Exit 0 when nothing failed, 6 otherwise.
    Doctor {
        /// An rcpd to check (HOST or [IPV6]; the port is -P).
        host: Option<String>,
    },
    /// rcp pull [-r] [-n] [--bwlimit RATE] HOST:REMOTE... LOCAL
    Pull {
        #[command(flatten)]
        copy: CopyArgs,
        /// HOST:REMOTE sources, then the local destination.
        #[arg(required = true, num_args = 2..)]
        args: Vec<String>,
    },
}

/// What push and pull share.
#[derive(Args, Debug, Clone)]
struct CopyArgs {
    /// Copy directories recursively (symlinks are never followed; without
    /// -a each is skipped with a warning).
    #[arg(help_heading = "Copying", short, long, env = "RCP_RECURSIVE")]
    recursive: bool,
    /// Archive: -r -p, and symlinks recreated as symlinks with their
    /// target text (never followed); a link pointing outside the copied
    /// tree (absolute, or climbing out of it) is skipped with a warning, as
    /// rsync --safe-links.
    #[arg(help_heading = "Copying", short = 'a', long, env = "RCP_ARCHIVE")]
    archive: bool,
    /// With -r/-a: after the copy, remove what the destination directory
    /// holds that the source does not (each said on stderr, or a "delete"
    /// JSON line); excluded names are kept, as rsync's default.
    #[arg(help_heading = "Copying", long, env = "RCP_DELETE")]
    delete: bool,
    /// Leave out what matches PATTERN (rsync's rules: `*` within a name,
    /// `**` across `/`, `?`, a leading `/` anchors at the copied directory,
    /// a trailing `/` matches directories only; first matching
    /// --exclude/--include wins). Repeatable.
    #[arg(help_heading = "Copying", long, value_name = "PATTERN")]
    exclude: Vec<String>,
    /// Keep what matches PATTERN even if a later --exclude matches it
    /// (same rules, first match wins). Repeatable.
    #[arg(help_heading = "Copying", long, value_name = "PATTERN")]
    include: Vec<String>,
    /// Read --exclude patterns from FILE, one per line, in place among the
    /// other rules (rsync's: blank lines and lines starting with `;` or `#`
    /// ignored, `+ `/`- ` make a line an include/exclude, `!` clears the
    /// rules before it; `-` reads standard input). Repeatable.
    #[arg(help_heading = "Copying", long, value_name = "FILE")]
    exclude_from: Vec<PathBuf>,
    /// Read --include patterns from FILE (as --exclude-from). Repeatable.
    #[arg(help_heading = "Copying", long, value_name = "FILE")]
    include_from: Vec<PathBuf>,
    /// --exclude, --include and the rules files' lines in the order typed
    /// (filled from the command line's positions).
    #[arg(skip)]
    rules: Vec<(bool, String)>,
    /// Push to HOST:PATH and from there along these rcpds too
    /// (HOST[:PORT],...; -P's port when none): the same PATH on each. Each
    /// node forwards what it verified to the next as it arrives, so N
    /// nodes cost about one copy; a node that fails or stops answering is
    /// routed around (docs/fanout.md). Every file moves (no skipping).
    #[arg(
        help_heading = "Copying",
        long,
        value_delimiter = ',',
        value_name = "HOST[:PORT],..."
    )]
    fanout: Vec<String>,
    /// List what would be copied (a line per file with its size) and the
    /// totals; move no byte, create nothing on either side.
    #[arg(help_heading = "Copying", short = 'n', long, env = "RCP_DRY_RUN")]
    dry_run: bool,
    /// Bytes per second at most (K/M/G suffixes, powers of 1024, fractions
    /// allowed: 500K, 1.5M; 0: unlimited). Unlike rsync, a bare number is
    /// bytes, not KiB.
    #[arg(help_heading = "Transport and data path", long, env = "RCP_BWLIMIT", value_parser = parse_bytes)]
    bwlimit: Option<u64>,
    /// Print progress every INTERVAL (rclone's --stats: 1, 2.5s, 500ms,
    /// 1m; 0: never): a JSON line with --json, else a line on stderr.
    #[arg(help_heading = "Output", long, visible_alias = "progress-interval", env = "RCP_STATS", value_parser = parse_interval)]
    stats: Option<Duration>,
    /// Compare files of the same size by content (digests computed on
    /// both ends) instead of size and mtime; unchanged ones are skipped.
    #[arg(
        help_heading = "Skipping and delta (rsync's quick check by default)",
        short = 'c',
        long,
        env = "RCP_CHECKSUM",
        conflicts_with = "ignore_times"
    )]
    checksum: bool,
    /// Never skip a file for having the source's size and mtime at the
    /// destination (rsync's quick check, the default).
    #[arg(
        help_heading = "Skipping and delta (rsync's quick check by default)",
        short = 'I',
        long,
        env = "RCP_IGNORE_TIMES"
    )]
    ignore_times: bool,
    /// Skip files that have the source's size at the destination, whatever
    /// their mtime (rsync's --size-only; with -p they get the source's
    /// mtime without moving).
    #[arg(
        help_heading = "Skipping and delta (rsync's quick check by default)",
        long,
        env = "RCP_SIZE_ONLY",
        conflicts_with_all = ["checksum", "ignore_times"]
    )]
    size_only: bool,
    /// Skip files that are newer at the destination.
    #[arg(
        help_heading = "Skipping and delta (rsync's quick check by default)",
        short = 'u',
        long,
        env = "RCP_UPDATE"
    )]
    update: bool,
    /// Skip files that exist at the destination, whatever they hold.
    #[arg(
        help_heading = "Skipping and delta (rsync's quick check by default)",
        long,
        env = "RCP_IGNORE_EXISTING"
    )]
    ignore_existing: bool,
    /// Of a file that exists at the destination and differs, move only the
    /// blocks whose digests differ (both ends hash their copy); the rest is
    /// taken from the destination's copy. --resume does it too.
    #[arg(
        help_heading = "Skipping and delta (rsync's quick check by default)",
        long,
        env = "RCP_DELTA"
    )]
    delta: bool,
}

impl CopyArgs {
    /// Which files already at the destination stay (rsync's rules), and
    /// whether the others move as deltas (`--delta`, `--resume`).
    fn skip_rules(&self, resume: bool, preserve: bool) -> jobs::skip::Rules {
        use jobs::skip::Compare;
        jobs::skip::Rules {
            compare: if self.checksum {
                Compare::Content
            } else if self.size_only {
                Compare::Size
            } else if self.ignore_times {
                Compare::Always
            } else {
                Compare::Quick
            },
            update: self.update,
            ignore_existing: self.ignore_existing,
            // A dry run hashes nothing and makes no partial file.
            delta: (self.delta || resume) && !self.dry_run,
            modes: preserve,
        }
    }
}

impl Cli {
    /// The first rail's device (where the copy threads are placed).
    fn first_device(&self) -> Option<String> {
        self.device
            .as_ref()
            .and_then(|d| d.0.first())
            .map(|r| r.device.clone())
    }
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    rcp::parse::bytes(s).map_err(|e| e.to_string())
}

fn parse_interval(s: &str) -> Result<Duration, String> {
    rcp::parse::duration(s).map_err(|e| e.to_string())
}

fn parse_size(s: &str) -> Result<u64, String> {
    let v = rcp::parse::bytes(s).map_err(|e| e.to_string())?;
    if v == 0 {
        return Err("block size 0: give a power of two from 4096".into());
    }
    rcp::control::protocol::check_block_size(v, rcp::control::WINDOW_SIZE as u64)
}

/// Progress on a terminal, as rsync's `--info=progress2` and rclone's: one
/// bar for the whole job (many files are in flight at once, their blocks
/// sharing windows), sized from the plan so that it starts at zero, moved
/// by the blocks the data path confirms, with the files committed; IEC
/// units throughout.
struct Bars {
    total: ProgressBar,
    files: u64,
}

impl Bars {
    fn new(bytes: u64, files: u64) -> Bars {
        let total = ProgressBar::new(bytes);
        total.set_style(
            ProgressStyle::with_template(
                "{binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta} {wide_bar} {msg}",
            )
            .expect("template"),
        );
        total.set_message(format!("0/{files} files"));
        Bars { total, files }
    }

    fn show(&self, bytes: u64, done: u64) {
        self.total.set_position(bytes);
        self.total
            .set_message(format!("{done}/{} files", self.files));
    }
}

/// What the binary watches of a job: the bars (on a terminal), the
/// counts behind `--stats`, with `--json` a line per file, and the
/// sessions it runs over.
struct Watch {
    bars: Option<Bars>,
    /// `--json`: the file lines' direction.
    json: Option<Direction>,
    /// Say on stderr which provider each session runs over, and why (-v).
    announce: bool,
    /// `--transport auto`: a tcp session on a host that has RDMA devices
    /// (none of them usable) is worth a warning; on a host without any,
    /// tcp is the expected choice and nothing is said.
    auto: bool,
    /// The current session's provider and check (the file lines').
    session: std::sync::Mutex<(String, rcp::files::Check)>,
    /// Bytes of windows done (verified).
    bytes: AtomicU64,
    files_done: AtomicU64,
    /// The bytes of the files done (for an interrupt's report).
    committed: AtomicU64,
    /// The job's bytes, from the plan.
    bytes_total: u64,
    /// The current session's data-path counters and the bytes shown when
    /// it started: progress between windows, a chain of blocks at a time.
    live: std::sync::Mutex<Option<(Arc<rcp::datapath::DataPathStats>, u64)>>,
}

impl Watch {
    /// Bytes to show: what the data path confirmed (blocks), never less
    /// than the windows done, never more than the job.
    fn shown(&self) -> u64 {
        let done = self.bytes.load(Relaxed);
        let live = self
            .live
            .lock()
            .unwrap()
            .as_ref()
            .map_or(0, |(s, base)| base + s.counters().bytes_confirmed);
        done.max(live).min(self.bytes_total)
    }

    /// Redraw the bar, if any.
    fn draw(&self) {
        if let Some(b) = &self.bars {
            b.show(self.shown(), self.files_done.load(Relaxed));
        }
    }
}

impl jobs::Watcher for Watch {
    fn session(&self, s: &rcp::control::Session) {
        rcp::phase::mark("session up");
        if self.announce {
            eprintln!("rcp: transport {}", s.transport);
        } else if self.auto
            && s.kind == rcp::provider::ProviderKind::Tcp
            && !rcp::verbs::device_names().is_empty()
        {
            eprintln!("rcp: WARNING: transport {}", s.transport);
        }
        *self.session.lock().unwrap() = (s.kind.to_string(), s.check());
        let base = self.shown();
        *self.live.lock().unwrap() = s.data_path_stats().map(|st| {
            // Counted from here: a session's counters start where its
            // data path did (a fallback's are fresh).
            let before = st.counters().bytes_confirmed;
            (st, base.saturating_sub(before))
        });
    }
    fn fell_back(&self, why: &str) {
        eprintln!("rcp: WARNING: {why}");
    }
}

impl Observer for Watch {
    fn progress(&self, n: u64) {
        self.bytes.fetch_add(n, Relaxed);
        self.draw();
    }
    fn file_done(&self, r: &FileResult) {
        // Counted as committed (renamed into place), not as started.
        self.files_done.fetch_add(1, Relaxed);
        self.committed.fetch_add(r.length, Relaxed);
        self.draw();
        if let Some(dir) = self.json {
            let (transport, check) = self.session.lock().unwrap().clone();
            println!(
                "{}",
                line(
                    "file",
                    &json::FileLine::new(r, dir.label(), &transport, check)
                )
            );
        }
    }
}

/// The bar between events: a redraw every 100 ms from the data path's
/// counters, until the task is aborted.
fn bar_ticker(watch: Arc<Watch>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tick.tick().await;
            watch.draw();
        }
    })
}

/// `--stats`: a progress line at the start (0 bytes, printed before this
/// returns), then one every `every` until the task is aborted (the last,
/// at the end, is printed once the copy is done).
fn progress_ticker(
    watch: Arc<Watch>,
    plan: &Plan,
    every: Duration,
    as_json: bool,
) -> tokio::task::JoinHandle<()> {
    let (direction, files_total) = (plan.direction().label(), plan.files.len() as u64);
    // The line at 0, before anything moves.
    let first = progress_line(&watch, direction, files_total, 0, Duration::ZERO, 0.0);
    print_progress(&first, as_json);
    tokio::spawn(async move {
        let t0 = Instant::now();
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        // A stalled runtime prints one late line, not a burst of them.
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let (mut last_t, mut last_b) = (t0, 0u64);
        loop {
            tick.tick().await;
            let now = Instant::now();
            let bytes = watch.shown();
            let dt = now.duration_since(last_t).as_secs_f64().max(1e-9);
            let rate = bytes.saturating_sub(last_b) as f64 / dt;
            let p = progress_line(&watch, direction, files_total, bytes, now - t0, rate);
            (last_t, last_b) = (now, bytes);
            print_progress(&p, as_json);
        }
    })
}

/// A `progress` line's fields.
fn progress_line(
    watch: &Watch,
    direction: &'static str,
    files_total: u64,
    bytes: u64,
    elapsed: Duration,
    bytes_per_second: f64,
) -> json::ProgressLine {
    json::ProgressLine {
        direction,
        bytes,
        bytes_total: watch.bytes_total,
        files_done: watch.files_done.load(Relaxed),
        files_total,
        seconds: elapsed.as_secs_f64(),
        bytes_per_second,
    }
}

/// A progress line: JSON with `--json`, else a line on stderr in IEC units.
fn print_progress(p: &json::ProgressLine, as_json: bool) {
    if as_json {
        println!("{}", line("progress", p));
    } else {
        eprintln!(
            "rcp: {} {}/{} ({:.1}%), {}/{} files, {}, {:.1} s",
            p.direction,
            rcp::units::bytes(p.bytes),
            rcp::units::bytes(p.bytes_total),
            p.bytes as f64 * 100.0 / p.bytes_total.max(1) as f64,
            p.files_done,
            p.files_total,
            rcp::units::rate(p.bytes_per_second),
            p.seconds
        );
    }
}

/// `--dry-run`: what the plan would copy, and the totals.
fn print_plan(plan: &Plan, as_json: bool, quiet: bool, seconds: f64) {
    let dir = plan.direction().label();
    for f in &plan.files {
        if as_json {
            let l = json::PlanLine {
                direction: dir,
                source: f.source.clone(),
                path: f.dest.clone(),
                bytes: f.bytes,
            };
            println!("{}", line("plan", &l));
        } else if !quiet {
            let (from, to) = (escape::name(&f.source), escape::name(&f.dest));
            println!("would {dir} {from} -> {to} ({} bytes)", f.bytes);
        }
    }
    for l in &plan.tree.links {
        print_link(l, true, as_json, !quiet);
    }
    for d in &plan.tree.deletes {
        print_deletion(d, true, as_json, !quiet);
    }
    let (files, bytes, dirs) = (plan.files.len() as u64, plan.bytes(), plan.dirs() as u64);
    let tree = plan.tree.counts();
    if as_json {
        let l = json::SummaryLine {
            direction: dir,
            dry_run: true,
            files,
            dirs,
            bytes,
            moved: 0,
            skipped: plan.skipped.len() as u64,
            seconds,
            gbps: 0.0,
            transport: None,
            check: None,
            digest_format: None,
            digest: None,
            sha256: None,
            reconnects: None,
            fallback: None,
            tree,
        };
        println!("{}", line("summary", &l));
    } else if !quiet {
        println!(
            "dry run: {files} file{}, {bytes} bytes, {dirs} director{} to make, {} unchanged{}; \
             nothing copied",
            if files == 1 { "" } else { "s" },
            if dirs == 1 { "y" } else { "ies" },
            plan.skipped.len(),
            tree_summary(&tree)
                .map(|t| format!(" (would be: {t})"))
                .unwrap_or_default(),
        );
    }
}

async fn run(c: Cli) -> Result<(), ControlError> {
    let opts = client_options(&c)?;
    let (copy, args, push) = match &c.cmd {
        Cmd::Push { copy, args } => (copy, args, true),
        Cmd::Pull { copy, args } => (copy, args, false),
        Cmd::Bench { .. } => unreachable!("bench runs without the runtime"),
        Cmd::Doctor { host } => return doctor(&c, host.as_deref(), opts).await,
    };
    opts.check_bwlimit()?;
    let paths = if push {
        Paths::push(args, c.port)
    } else {
        Paths::pull(args, c.port)
    }?;
    signals::catch();
    copy_files(&c, copy, &paths, opts).await
}

/// The bearer token: `--token-file`'s, else `RCP_TOKEN`'s.
fn token(c: &Cli) -> Result<Option<String>, ControlError> {
    let Some(f) = &c.token_file else {
        return Ok(std::env::var("RCP_TOKEN").ok().filter(|t| !t.is_empty()));
    };
    let t = std::fs::read_to_string(f)
        .map_err(|e| ControlError::Usage(format!("--token-file {}: {e}", f.display())))?;
    match t.trim() {
        "" => Err(ControlError::Usage(format!(
            "--token-file {}: the file is empty",
            f.display()
        ))),
        t => Ok(Some(t.to_string())),
    }
}

/// What the user typed becomes the client's settings (once).
fn client_options(c: &Cli) -> Result<ClientOptions, ControlError> {
    Ok(ClientOptions {
        token: token(c)?,
        transport: c.transport,
        rails: c.device.clone().map(|d| d.0).unwrap_or_default(),
        qps_per_rail: c.qps_per_rail,
        tcp_fallback_after: (c.tcp_fallback_after > 0)
            .then(|| Duration::from_secs(c.tcp_fallback_after)),
        gid_index: c.gid_index,
        block_size: c.block_size,
        batch: c.batch,
        signal_every: c
            .signal_every
            .unwrap_or(ClientOptions::default().signal_every),
        inline: c.inline,
        poll_mode: c.poll_mode,
        cq_cpu: rcp::control::place_copy_threads(c.first_device().as_deref(), c.cq_cpu),
        qp_retry: rcp::datapath::QpRetry {
            ack_timeout: c.qp_timeout,
            retry_cnt: c.qp_retry_cnt,
        },
        transfers: c.transfers,
        verify: c.verify.clone(),
        timeout: Duration::from_secs(c.timeout),
        tls: c.tls_ca.clone().map(|ca| ClientTls {
            ca,
            cert: c.tls_cert.clone(),
            key: c.tls_key.clone(),
            domain: c.tls_domain.clone(),
        }),
        bwlimit: match &c.cmd {
            Cmd::Push { copy, .. } | Cmd::Pull { copy, .. } => copy.bwlimit.filter(|&r| r > 0),
            _ => None,
        },
        ..ClientOptions::default()
    })
}

/// `rcp doctor [HOST]`: a line per check; an error when one failed.
async fn doctor(c: &Cli, host: Option<&str>, opts: ClientOptions) -> Result<(), ControlError> {
    let addr = match host {
        Some(h) => {
            let (host, port) =
                rcp::parse::host_port(h, c.port).map_err(|e| ControlError::Usage(e.to_string()))?;
            Some(format!("{host}:{port}"))
        }
        None => None,
    };
    let (d, rcpd) = jobs::doctor(addr, opts).await;
    let count = |l| d.checks.iter().filter(|c| c.level == l).count() as u64;
    let failures = count(rcp::doctor::Level::Fail);
    for check in &d.checks {
        if c.json {
            println!("{}", line("check", &json::CheckLine::new(check)));
        } else {
            println!("{check}");
        }
    }
    if c.json {
        let l = json::DoctorLine {
            ok: failures == 0,
            checks: d.checks.len() as u64,
            warnings: count(rcp::doctor::Level::Warn),
            failures,
        };
        println!("{}", line("doctor", &l));
    }
    // 6 when RDMA is broken or was asked for and is not there; else the
    // rcpd check's own code (5: it does not answer, retry; 6: refused).
    if !d.rdma_ready() {
        return Err(ControlError::Fatal(
            "doctor found problems (FAIL above)".into(),
        ));
    }
    match rcpd {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The copy flags become the job (once): -a is -r -p plus links.
fn job_of(c: &Cli, copy: &CopyArgs) -> Result<Job, ControlError> {
    let recursive = copy.recursive || copy.archive;
    if copy.delete && !recursive {
        return Err(ControlError::Usage(
            "--delete needs -r or -a (it acts on directories)".into(),
        ));
    }
    let mut filter = jobs::filter::Filter::default();
    for (include, p) in &copy.rules {
        filter
            .push(*include, p)
            .map_err(|e| ControlError::Usage(e.to_string()))?;
    }
    let mut skip = copy.skip_rules(c.resume, c.preserve || copy.archive);
    let mut fanout = String::new();
    if !copy.fanout.is_empty() {
        if copy.delete || copy.delta || copy.archive {
            return Err(ControlError::Usage(
                "--fanout takes no --delete, --delta or -a (each node gets every file as sent)"
                    .into(),
            ));
        }
        skip = jobs::skip::Rules {
            compare: jobs::skip::Compare::Always,
            ..jobs::skip::Rules::default()
        };
        fanout = rcp::control::fanout::new_id();
    }
    Ok(Job {
        recursive,
        preserve: c.preserve || copy.archive,
        resume: c.resume,
        sha256: c.sha256,
        skip,
        links: copy.archive,
        delete: copy.delete,
        filter,
        fanout,
    })
}

/// --exclude/--include of a push or pull and the rules of
/// --exclude-from/--include-from files, in the order typed; a file that
/// cannot be read, or is not UTF-8, is named in the error.
fn ordered_rules(m: &ArgMatches) -> Result<Vec<(bool, String)>, String> {
    enum Given {
        Pattern(String),
        File(PathBuf),
    }
    let mut given = Vec::new();
    for (id, include) in [("exclude", false), ("include", true)] {
        if let (Some(ix), Some(vs)) = (m.indices_of(id), m.get_many::<String>(id)) {
            given.extend(
                ix.zip(vs)
                    .map(|(i, v)| (i, include, Given::Pattern(v.clone()))),
            );
        }
    }
    for (id, include) in [("exclude_from", false), ("include_from", true)] {
        if let (Some(ix), Some(vs)) = (m.indices_of(id), m.get_many::<PathBuf>(id)) {
            given.extend(
                ix.zip(vs)
                    .map(|(i, v)| (i, include, Given::File(v.clone()))),
            );
        }
    }
    given.sort_by_key(|g| g.0);
    let mut out = Vec::new();
    for (_, include, g) in given {
        let file = match g {
            Given::Pattern(p) => {
                out.push((include, p));
                continue;
            }
            Given::File(f) => f,
        };
        let flag = if include {
            "--include-from"
        } else {
            "--exclude-from"
        };
        let bytes = if file.as_os_str() == "-" {
            let mut b = Vec::new();
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut b).map(|_| b)
        } else {
            std::fs::read(&file)
        }
        .map_err(|e| format!("{flag} {}: {e}", file.display()))?;
        let text = String::from_utf8(bytes)
            .map_err(|_| format!("{flag} {}: not UTF-8 text", file.display()))?;
        for r in jobs::filter::rules_file(&text, include) {
            match r {
                jobs::filter::FileRule::Rule { include, pattern } => out.push((include, pattern)),
                jobs::filter::FileRule::Clear => out.clear(),
            }
        }
    }
    Ok(out)
}

/// The command line, with the filter rules' order kept.
fn parse_cli() -> Result<Cli, clap::Error> {
    let m = Cli::command().try_get_matches()?;
    let mut c = Cli::from_arg_matches(&m)?;
    if let (Cmd::Push { copy, .. } | Cmd::Pull { copy, .. }, Some((_, sm))) =
        (&mut c.cmd, m.subcommand())
    {
        copy.rules = ordered_rules(sm)
            .map_err(|e| Cli::command().error(clap::error::ErrorKind::ValueValidation, e))?;
    }
    Ok(c)
}

/// What the tree part of a plan leaves out, said (never silently): a
/// warning on stderr per entry, or a "left_out" JSON line.
fn print_left_out(plan: &Plan, as_json: bool, quiet: bool) {
    for n in &plan.tree.left_out {
        if as_json {
            let l = json::LeftOutLine {
                path: n.path.clone(),
                reason: n.reason.clone(),
            };
            println!("{}", line("left_out", &l));
        } else if !quiet {
            // rsync's words for what it does not copy.
            match n.reason.strip_prefix("non-regular file") {
                Some(why) => eprintln!("rcp: skipping non-regular file {:?}{why}", n.path),
                None => eprintln!("rcp: skipping {:?}: {}", n.path, n.reason),
            }
        }
    }
}

/// A symlink (`-a`), made or (dry run) planned: a JSON line, or when
/// `say` (a dry run's listing; -v for a real run) a line.
fn print_link(l: &jobs::tree::LinkPlan, dry_run: bool, as_json: bool, say: bool) {
    if as_json {
        let j = json::LinkLine {
            path: l.dest.clone(),
            target: l.target.clone(),
            dry_run,
        };
        println!("{}", line("link", &j));
    } else if dry_run && say {
        println!(
            "would link {} -> {}",
            escape::name(&l.dest),
            escape::name(&l.target)
        );
    } else if say {
        eprintln!(
            "link {} -> {}",
            escape::name(&l.dest),
            escape::name(&l.target)
        );
    }
}

/// A deletion (`--delete`), done or (dry run) planned: a JSON line, or
/// when `say` (a dry run's listing; -v for a real run, as rsync) a line.
fn print_deletion(d: &jobs::tree::Deletion, dry_run: bool, as_json: bool, say: bool) {
    if as_json {
        let l = json::DeleteLine {
            path: d.path.clone(),
            dir: d.dir,
            dry_run,
        };
        println!("{}", line("delete", &l));
    } else if dry_run && say {
        println!("would delete {}", escape::name(&d.path));
    } else if say {
        eprintln!("deleting {}", escape::name(&d.path));
    }
}

/// The tree's counts after the human summary, when there are any.
fn tree_summary(t: &jobs::tree::TreeCounts) -> Option<String> {
    let parts: Vec<String> = [
        (t.links, "symlink made", "symlinks made"),
        (t.left_out, "entry left out", "entries left out"),
        (t.excluded, "entry excluded", "entries excluded"),
        (t.deleted, "entry deleted", "entries deleted"),
    ]
    .iter()
    .filter(|(n, ..)| *n > 0)
    .map(|(n, one, many)| format!("{n} {}", if *n == 1 { one } else { many }))
    .collect();
    (!parts.is_empty()).then(|| parts.join(", "))
}

/// A lone directory source that becomes the destination (which is not a
/// directory yet), and the destination: the command that continues the
/// copy once interrupted names the source's contents (`SRC/`, rsync's
/// rule), which land in the destination again now that it exists, not
/// in a copy of the source nested inside it. (A destination ending in
/// `/` is a directory either way: the source lands inside it, made or
/// not, on every run.)
fn contents_source(c: &Cli, plan: &Plan) -> Option<(String, String)> {
    let (Cmd::Push { args, .. } | Cmd::Pull { args, .. }) = &c.cmd else {
        return None;
    };
    let [src, dst] = args.as_slice() else {
        return None;
    };
    let became =
        plan.remote_dirs.iter().any(|d| !d.in_tree) || plan.local_dirs.iter().any(|d| !d.in_tree);
    (became && !src.ends_with('/') && !dst.ends_with('/')).then(|| (src.clone(), dst.clone()))
}

/// `rcp push` / `rcp pull`: plan, then (unless a dry run) copy with
/// progress, and print the summary.
async fn copy_files(
    c: &Cli,
    copy: &CopyArgs,
    paths: &Paths,
    opts: ClientOptions,
) -> Result<(), ControlError> {
    let job = job_of(c, copy)?;
    rcp::phase::mark("runtime up, arguments parsed");
    let fan_opts = opts.clone();
    let client = Client::connect(paths.addr(), opts).await?;
    rcp::phase::mark("connected to rcpd");
    let t0 = Instant::now();
    let mut plan = tokio::select! {
        p = paths.plan(&client, &job) => p?,
        sig = rcp::control::interrupt::wait() => return Err(ControlError::Failed(sig.failure())),
    };
    rcp::phase::mark("planned");
    print_left_out(&plan, c.json, c.quiet);
    if copy.dry_run {
        // No session: nothing is set up on rcpd, nothing moves.
        print_plan(&plan, c.json, c.quiet, t0.elapsed().as_secs_f64());
        return Ok(());
    }
    let tree_plan = std::mem::take(&mut plan.tree);
    let contents = contents_source(c, &plan);
    let (bytes_total, files_total) = (plan.bytes(), plan.files.len() as u64);
    let watch = Arc::new(Watch {
        bars: (!c.quiet && std::io::stderr().is_terminal())
            .then(|| Bars::new(bytes_total, files_total)),
        json: c.json.then(|| plan.direction()),
        announce: c.verbose > 0,
        auto: c.transport == Transport::Auto,
        session: Default::default(),
        bytes: AtomicU64::new(0),
        files_done: AtomicU64::new(0),
        committed: AtomicU64::new(0),
        bytes_total,
        live: Default::default(),
    });
    let bar = watch.bars.as_ref().map(|_| bar_ticker(watch.clone()));
    let stats = copy.stats.filter(|d| !d.is_zero() && (c.json || !c.quiet));
    let ticker = stats.map(|every| progress_ticker(watch.clone(), &plan, every, c.json));
    let (direction, dirs) = (plan.direction(), plan.dirs() as u64);
    let t0 = Instant::now();
    // The jobs policy: over verbs, and with --transport auto on over tcp
    // when verbs cannot start or every rail stays down; staging sized to
    // what the copy can fill.
    let (outcome, nodes) = match copy.fanout.is_empty() {
        true => (jobs::run(&client, plan, &*watch).await, None),
        false => {
            let (o, n) =
                fanout::push(c, &copy.fanout, paths, &job, fan_opts, plan, watch.clone()).await?;
            (o, Some(n))
        }
    };
    for t in [bar, ticker].into_iter().flatten() {
        t.abort();
    }
    if let Some(b) = &watch.bars {
        // The bar's last state is what was done: all of it on success.
        match &outcome {
            Ok(o) => b.show(
                o.totals.bytes.max(watch.shown()),
                watch.files_done.load(Relaxed),
            ),
            Err(_) => watch.draw(),
        }
        b.total.abandon();
    }
    if let (Some(_), Ok(o)) = (stats, &outcome) {
        // The last progress line: every file, every byte.
        let secs = t0.elapsed();
        let rate = o.totals.moved as f64 / secs.as_secs_f64().max(1e-9);
        let p = progress_line(
            &watch,
            direction.label(),
            files_total,
            o.totals.bytes,
            secs,
            rate,
        );
        print_progress(&p, c.json);
    }
    rcp::phase::mark("files done, session closed");
    if let (Err(_), Some(sig)) = (&outcome, rcp::control::interrupt::raised()) {
        let done = signals::Done {
            files: watch.files_done.load(Relaxed),
            files_total,
            bytes: watch.committed.load(Relaxed),
            bytes_total,
            moved: watch.shown(),
            contents,
        };
        signals::report(sig, &done);
    }
    if let Some(n) = &nodes {
        fanout::print_nodes(n, c.json, c.quiet);
    }
    let outcome = outcome?;
    if let Some(e) = nodes.as_deref().and_then(rcp::control::fanout::incomplete) {
        return Err(e);
    }
    // Links and --delete only after every file made it.
    let say = !c.quiet && c.verbose > 0;
    let linked = |l: &jobs::tree::LinkPlan| print_link(l, false, c.json, say);
    let deleted = |d: &jobs::tree::Deletion| print_deletion(d, false, c.json, say);
    let push = direction == Direction::Push;
    let tree = jobs::tree::finish(&client, push, &tree_plan, &linked, &deleted).await?;
    print_outcome(c, direction, dirs, outcome, tree);
    Ok(())
}

/// The summary of a copy: a JSON line, or the human line (and with -v a
/// line per rail).
fn print_outcome(
    c: &Cli,
    direction: Direction,
    dirs: u64,
    outcome: jobs::Outcome,
    tree: jobs::tree::TreeCounts,
) {
    let jobs::Outcome {
        totals,
        kind,
        check,
        fell_back,
        stats,
        session,
    } = outcome;
    let transport = kind.to_string();
    if c.json {
        let one = totals.files == 1;
        let l = json::SummaryLine {
            direction: direction.label(),
            dry_run: false,
            files: totals.files,
            dirs,
            bytes: totals.bytes,
            moved: totals.moved,
            skipped: totals.skipped,
            seconds: totals.seconds,
            gbps: totals.gbps(),
            transport: session.then_some(transport),
            check: Some(check.name()),
            digest_format: Some(check.digest_format()),
            digest: totals.digest.as_deref().filter(|_| one).map(hex::encode),
            sha256: totals.sha256.as_deref().filter(|_| one).map(hex::encode),
            reconnects: stats.map(|s| s.report.counters.reconnects),
            fallback: fell_back,
            tree,
        };
        println!("{}", line("summary", &l));
    } else if !c.quiet {
        let mut s = if session {
            let over = match &fell_back {
                // Why: the WARNING line when it happened.
                Some(_) => format!("{transport} (FELL BACK from verbs)"),
                None => transport,
            };
            totals.summary_checked(&over, check)
        } else {
            totals.summary_unchanged()
        };
        if let Some(t) = tree_summary(&tree) {
            s.push_str(&format!("; {t}"));
        }
        println!("{s}");
        if c.verbose > 0 {
            for l in stats
                .iter()
                .flat_map(|s| jobs::rail_lines(&s.report, &s.rails))
            {
                println!("{l}");
            }
        }
    }
}

/// Whether the bench runs over tcp: when asked, or with auto for a
/// loopback run on a host without RDMA devices (and none named); a run
/// that needs a peer's device (`--server`, HOST, `--compare`) over tcp is
/// a usage error (its exit code).
fn bench_over_tcp(c: &Cli, loopback: bool) -> Result<bool, i32> {
    let tcp = match c.transport {
        Transport::Tcp => true,
        Transport::Verbs => false,
        Transport::Auto => loopback && c.device.is_none() && rcp::verbs::device_names().is_empty(),
    };
    if tcp && !loopback {
        let m = "over tcp rcp bench runs loopback only (no --server, HOST or --compare): \
                 give --transport verbs for those";
        eprintln!("rcp bench: {m}");
        if c.json {
            print_error(exit::USAGE, "USAGE", m);
        }
        return Err(exit::USAGE);
    }
    Ok(tcp)
}

/// `rcp bench`: synchronous (the data path has its own threads).
fn bench(c: &Cli) -> i32 {
    use rcp::bench::{self, BenchOptions, ServerOptions};
    let Cmd::Bench {
        host,
        server,
        listen,
        keep_serving,
        compare,
        op,
        size,
        iters,
        seconds,
        qps,
        tx_depth,
    } = &c.cmd
    else {
        unreachable!()
    };
    // The bench measures one device.
    let device = match c.device.as_ref().map(|d| d.0.as_slice()) {
        None => None,
        Some([r]) if r.port.is_none() => Some(r.device.clone()),
        Some(r) => {
            let m = format!(
                "--device {}: rcp bench measures one device (NAME, no port)",
                rcp::parse::RailList(r.to_vec())
            );
            eprintln!("rcp bench: {m}");
            if c.json {
                print_error(exit::USAGE, "USAGE", &m);
            }
            return exit::USAGE;
        }
    };
    let tcp = match bench_over_tcp(c, !*server && !*compare && host.is_none()) {
        Ok(t) => t,
        Err(code) => return code,
    };
    let o = BenchOptions {
        tcp,
        op: *op,
        size: *size,
        batch: c.batch,
        signal_every: c.signal_every.unwrap_or(c.batch),
        inline: c.inline.unwrap_or(0),
        mode: c.poll_mode.unwrap_or(bench::default_mode(tcp)),
        cq_cpu: c.cq_cpu.unwrap_or_default(),
        // With --seconds: rounds of about 64 MiB, so a run ends close to
        // its seconds even with large messages.
        iters: iters.unwrap_or(if seconds.is_some() {
            bench::round_iters(*size)
        } else {
            10_000
        }),
        seconds: *seconds,
        qps: *qps,
        tx_depth: *tx_depth,
        device: device.clone(),
        gid_index: c.gid_index,
    };
    let report = |o: &BenchOptions, m: &bench::Measured, what: Option<&str>| {
        if c.json {
            println!("{}", bench::json_line(o, m, what));
        } else {
            let line = bench::format_line(o, m);
            match what {
                Some(w) => println!("{line}  # {w}"),
                None => println!("{line}"),
            }
        }
        if !c.quiet {
            eprintln!("rcp bench: {}", bench::format_human(o, m));
        }
    };
    let r = if *server {
        let so = ServerOptions {
            listen: listen.clone(),
            device: device.clone(),
            gid_index: c.gid_index,
            keep_serving: *keep_serving,
        };
        bench::serve(&so, &mut |a| {
            use std::io::Write;
            if c.json {
                let l = json::ListeningLine {
                    addr: a.to_string(),
                };
                println!("{}", line("listening", &l));
            } else {
                println!("bench server listening on {a}");
            }
            let _ = std::io::stdout().flush();
        })
    } else if *compare {
        bench::run_compare(&o, iters.unwrap_or(100_000), &mut |what, o, m| {
            report(o, m, Some(what))
        })
    } else if let Some(h) = host {
        bench::server_addr(h)
            .and_then(|addr| bench::run_client(&addr, &o))
            .map(|m| report(&o, &m, None))
    } else {
        bench::run_loopback(&o).map(|m| report(&o, &m, None))
    };
    match r {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("rcp bench: {e}");
            let (code, reason) = if e.is_usage() {
                (exit::USAGE, "USAGE")
            } else {
                (exit::OTHER, "OTHER")
            };
            if c.json {
                print_error(code, reason, &e.to_string());
            }
            code
        }
    }
}

/// `--json`'s error line (the human message goes to stderr as well).
fn print_error(code: i32, reason: &str, message: &str) {
    let l = json::ErrorLine {
        code,
        reason: reason.to_string(),
        message: message.trim_end().to_string(),
    };
    println!("{}", line("error", &l));
}

/// Whether `--json` was asked for, before (or without) a successful parse:
/// a usage error is then a JSON line too.
fn json_asked() -> bool {
    let arg = std::env::args_os().any(|a| a == "--json");
    let env = std::env::var("RCP_JSON").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on" | "y"
        )
    });
    arg || env
}

fn main() {
    rcp::phase::start();
    let c = match parse_cli() {
        Ok(c) => c,
        Err(e) => {
            let code = match e.kind() {
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
                    exit::OK
                }
                _ => exit::USAGE,
            };
            let _ = e.print();
            if code != exit::OK && json_asked() {
                print_error(code, "USAGE", &e.render().to_string());
            }
            std::process::exit(code);
        }
    };
    let level = match (c.quiet, c.verbose) {
        (true, _) => "error",
        (_, 0) => "warn",
        (_, 1) => "info",
        _ => "debug",
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal, never into files and pipes.
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new(format!("{level},rcp::mem::arena=error"))
            }),
        )
        .init();
    if let Cmd::Bench { .. } = &c.cmd {
        std::process::exit(bench(&c));
    }
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("rcp: cannot start the runtime: {e}");
            std::process::exit(exit::OTHER);
        }
    };
    rcp::control::raise_open_file_limit();
    let as_json = c.json;
    match rt.block_on(run(c)) {
        Ok(()) => {
            rcp::phase::mark("exit");
            std::process::exit(exit::OK)
        }
        Err(e) => {
            eprintln!("rcp: {e}");
            // An interrupt's code says which signal (130, 143).
            let code = match (e.reason(), rcp::control::interrupt::raised()) {
                (rcp::proto::Reason::Interrupted, Some(sig)) => sig.exit_code(),
                _ => e.exit_code(),
            };
            if as_json {
                let reason = e.reason();
                print_error(
                    code,
                    reason.as_str_name().trim_start_matches("REASON_"),
                    &e.to_string(),
                );
            }
            std::process::exit(code);
        }
    }
}
