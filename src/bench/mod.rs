//! `rcp bench`: a perftest-like benchmark of the data path (engine +
//! runner) on the verbs provider.
//!
//! - loopback ([`run_loopback`]): two QPs on one device in one process, A
//!   posts into B's region (the old `examples/bench.rs`);
//! - two hosts ([`serve`] / [`run_client`]): the server registers a region
//!   per QP and sends its QP endpoint, address and rkey over a small
//!   line-based TCP handshake ([`wire`]); the client runs the data path
//!   against it;
//! - [`compare_runs`]: the seed document's table (single post + signal every
//!   vs batch 32 + signal last vs + inline; polling vs events p99).
//!
//! Every run prints one machine-parsable line ([`format_line`]):
//! `bench op=write size=64 batch=32 signal=32 inline=0 mode=poll qps=1 msgs=.. msg_per_s=.. ...`.
//! Each QP runs one session data path ([`crate::datapath::DataPath`]) for
//! the whole run: the peer's 32 MiB region is cut into 4 MiB windows (one
//! window per message above that), each window holds one extent per
//! message, every `block` bytes (`size` rounded up to a power of two, at
//! least 4 KiB: messages under 4 KiB are the first `size` bytes of 4 KiB
//! slots), and every window is in flight at once, submitted again as soon
//! as it is done. Latency is post → completion of each signaled request
//! (for a chain: its tail) as seen by the completion thread. CPU time is
//! the process's (getrusage: user + system, all threads) per message.

mod run;
mod tcp;
pub mod wire;

use std::fmt;

use crate::datapath::{CqCpu, PollMode, Report};
use crate::engine::OpKind;

pub use run::{run_client, run_compare, serve, ServerOptions};

/// The bench in one process: A posts into B's region on the same device
/// (over tcp, `o.tcp`: a channel into a target on 127.0.0.1).
pub fn run_loopback(o: &BenchOptions) -> Result<Measured, BenchError> {
    if o.tcp {
        tcp::run_loopback_tcp(o)
    } else {
        run::run_loopback_verbs(o)
    }
}

/// perftest's port, the default for `rcp bench --server` and the client.
pub const DEFAULT_PORT: u16 = 18515;
/// Largest message: half the 32 MiB region every QP targets.
pub const MAX_SIZE: u64 = (run::REGION / 2) as u64;
/// Most QPs per run (each has a 32 MiB region on both sides).
pub const MAX_QPS: usize = 8;
/// Largest inline size asked for.
pub const MAX_INLINE: u32 = 1024;
/// Bytes per round of a `--seconds` run when `--iters` is not given.
pub const ROUND_BYTES: u64 = 64 << 20;

/// Messages per round of a `--seconds` run: about [`ROUND_BYTES`], at
/// least 1, at most 10 000 (a run overshoots its seconds by at most one
/// round, so rounds must stay short for large messages).
pub fn round_iters(size: u64) -> u64 {
    (ROUND_BYTES / size.max(1)).clamp(1, 10_000)
}

/// The completion mode without `--mode`: a polling thread per QP on
/// verbs, as perftest's; events over tcp (a spinning thread would take a
/// core from the provider's own).
pub fn default_mode(tcp: bool) -> PollMode {
    if tcp {
        PollMode::Event
    } else {
        PollMode::Poll
    }
}

/// Send-queue depth of every bench QP (the default and largest tx depth).
pub const SQ_DEPTH: u32 = run::SQ;

/// What one bench run does.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchOptions {
    pub op: OpKind,
    /// Bytes per message, `1..=16 MiB`.
    pub size: u64,
    /// Work requests per doorbell, `1..=64`.
    pub batch: usize,
    /// Signal every n-th request of a chain, `1..=batch`.
    pub signal_every: usize,
    /// Inline writes up to this many bytes (0: never).
    pub inline: u32,
    pub mode: PollMode,
    /// Where each QP's completion thread runs (default: unpinned, as
    /// perftest's threads are); when pinned with poll or hybrid, the posting
    /// thread keeps off that CPU.
    pub cq_cpu: CqCpu,
    /// Messages per QP (per round with `seconds`).
    pub iters: u64,
    /// Repeat rounds of `iters` until this many seconds have passed.
    pub seconds: Option<f64>,
    /// QPs run in parallel, one thread each.
    pub qps: usize,
    /// Most requests outstanding per QP (perftest's `-t/--tx-depth`),
    /// `1..=`[`SQ_DEPTH`]; `None`: the whole send queue.
    pub tx_depth: Option<u32>,
    /// RDMA device (default: the first).
    pub device: Option<String>,
    /// GID index (default: the first RoCE v2 IPv4-mapped GID).
    pub gid_index: Option<u32>,
    /// Over the TCP provider (loopback on 127.0.0.1) instead of verbs: for
    /// hosts without RDMA.
    pub tcp: bool,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            op: OpKind::Write,
            size: 65536,
            batch: 32,
            signal_every: 32,
            inline: 0,
            mode: PollMode::Poll,
            cq_cpu: CqCpu::Unpinned,
            iters: 10_000,
            seconds: None,
            qps: 1,
            tx_depth: None,
            device: None,
            gid_index: None,
            tcp: false,
        }
    }
}

/// Bad bench options, or a failed run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// An option out of range (a usage error).
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Verbs(#[from] crate::verbs::VerbsError),
    #[error(transparent)]
    DataPath(#[from] crate::datapath::DataPathError),
    #[error("memory: {0}")]
    Mem(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    /// The peer said something unexpected.
    #[error("bench handshake: {0}")]
    Protocol(String),
}

impl BenchError {
    /// Whether this is the user's input (exit code 1) rather than a failure.
    pub fn is_usage(&self) -> bool {
        matches!(self, BenchError::Invalid(_))
    }
}

/// `write` or `read`.
pub fn parse_op(s: &str) -> Result<OpKind, String> {
    match s.trim() {
        "write" => Ok(OpKind::Write),
        "read" => Ok(OpKind::Read),
        o => Err(format!("unknown op {o:?}: expected write or read")),
    }
}

/// The op's name in the bench line.
pub fn op_name(op: OpKind) -> &'static str {
    match op {
        OpKind::Write => "write",
        OpKind::Read => "read",
    }
}

impl BenchOptions {
    /// Refuse what cannot run, naming the option and its range.
    pub fn validate(&self) -> Result<(), BenchError> {
        let bad = |m: String| Err(BenchError::Invalid(m));
        if self.size == 0 || self.size > MAX_SIZE {
            return bad(format!("--size {}: must be in 1..={MAX_SIZE}", self.size));
        }
        if !(1..=64).contains(&self.batch) {
            return bad(format!("--batch {}: must be in 1..=64", self.batch));
        }
        if !(1..=self.batch).contains(&self.signal_every) {
            return bad(format!(
                "--signal-every {}: must be in 1..={} (the batch)",
                self.signal_every, self.batch
            ));
        }
        if self.inline > MAX_INLINE {
            return bad(format!(
                "--inline {}: must be in 0..={MAX_INLINE}",
                self.inline
            ));
        }
        if self.iters == 0 {
            return bad("--iters 0: must be at least 1".into());
        }
        if let Some(s) = self.seconds {
            if !(s.is_finite() && s > 0.0) {
                return bad(format!("--seconds {s}: must be a positive number"));
            }
        }
        if !(1..=MAX_QPS).contains(&self.qps) {
            return bad(format!("--qps {}: must be in 1..={MAX_QPS}", self.qps));
        }
        if let Some(t) = self.tx_depth {
            if !(1..=SQ_DEPTH).contains(&t) {
                return bad(format!(
                    "--tx-depth {t}: must be in 1..={SQ_DEPTH} (the send-queue depth)"
                ));
            }
        }
        Ok(())
    }

    /// `verbs` or `tcp`.
    pub fn transport(&self) -> &'static str {
        if self.tcp {
            "tcp"
        } else {
            "verbs"
        }
    }

    /// Requests outstanding per QP at most.
    pub fn tx_depth(&self) -> u32 {
        self.tx_depth.unwrap_or(SQ_DEPTH)
    }

    /// The engine block a message lives in (the size rounded up to a power
    /// of two, at least 4 KiB).
    pub fn block(&self) -> u64 {
        self.size.next_power_of_two().max(4096)
    }
}

/// The figures of a run: the merged data-path report and the process CPU
/// time it took.
#[derive(Clone, Debug, Default)]
pub struct Measured {
    pub report: Report,
    pub cpu_ns: u64,
}

impl Measured {
    fn secs(&self) -> f64 {
        self.report.seconds.max(1e-9)
    }
    pub fn gbps(&self) -> f64 {
        self.report.counters.bytes_confirmed as f64 * 8.0 / self.secs() / 1e9
    }
    pub fn msg_per_s(&self) -> f64 {
        self.report.counters.extents_confirmed as f64 / self.secs()
    }
    pub fn cpu_ns_per_msg(&self) -> f64 {
        self.cpu_ns as f64 / self.report.counters.extents_confirmed.max(1) as f64
    }
}

struct Mode(PollMode);
impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            PollMode::Hybrid { .. } => f.write_str("hybrid"),
            m => m.fmt(f),
        }
    }
}

/// The machine-parsable line (`scripts/vm/bench.sh`, `docs/benchmarks.md`).
pub fn format_line(o: &BenchOptions, m: &Measured) -> String {
    let r = &m.report;
    let secs = m.secs();
    format!(
        "bench op={} size={} batch={} signal={} inline={} mode={} qps={} msgs={} seconds={:.3} \
         gbps={:.3} mb_per_s={:.1} msg_per_s={:.0} p50_us={:.1} p99_us={:.1} doorbells={} \
         signaled={} inline_posted={} completions={} cpu_ns_per_msg={:.0} polls={} empty_polls={} arms={} wakeups={} \
         tx_depth={} cq_cpu={} transport={}",
        op_name(o.op),
        o.size,
        o.batch,
        o.signal_every,
        o.inline,
        Mode(o.mode),
        o.qps,
        r.counters.extents_confirmed,
        secs,
        m.gbps(),
        r.counters.bytes_confirmed as f64 / secs / 1e6,
        m.msg_per_s(),
        r.p50_us(),
        r.p99_us(),
        r.counters.doorbells,
        r.counters.signaled,
        r.counters.inline,
        r.counters.completions,
        m.cpu_ns_per_msg(),
        r.polls,
        r.empty_polls,
        r.arms,
        r.wakeups,
        o.tx_depth(),
        o.cq_cpu,
        o.transport(),
    )
}

/// The run as a `--json` line: the fields of [`format_line`], unrounded
/// (`label`: the `--compare` row).
pub fn json_line(o: &BenchOptions, m: &Measured, label: Option<&str>) -> String {
    let r = &m.report;
    let secs = m.secs();
    crate::json::line(
        "bench",
        &crate::json::BenchLine {
            label: label.map(str::to_string),
            op: op_name(o.op),
            size: o.size,
            batch: o.batch,
            signal: o.signal_every,
            inline: o.inline,
            mode: Mode(o.mode).to_string(),
            qps: o.qps,
            msgs: r.counters.extents_confirmed,
            seconds: secs,
            gbps: m.gbps(),
            mb_per_s: r.counters.bytes_confirmed as f64 / secs / 1e6,
            msg_per_s: m.msg_per_s(),
            p50_us: r.p50_us(),
            p99_us: r.p99_us(),
            doorbells: r.counters.doorbells,
            signaled: r.counters.signaled,
            inline_posted: r.counters.inline,
            completions: r.counters.completions,
            cpu_ns_per_msg: m.cpu_ns_per_msg(),
            polls: r.polls,
            empty_polls: r.empty_polls,
            arms: r.arms,
            wakeups: r.wakeups,
            tx_depth: o.tx_depth(),
            cq_cpu: o.cq_cpu.to_string(),
            transport: o.transport(),
        },
    )
}

/// A one-line summary for people (stderr).
pub fn format_human(o: &BenchOptions, m: &Measured) -> String {
    format!(
        "{} {} B x {} on {} QP(s): {:.3} Gb/s, {:.0} msg/s, completion p50 {:.1} us p99 {:.1} us, {:.0} ns CPU/msg",
        op_name(o.op),
        o.size,
        m.report.counters.extents_confirmed,
        o.qps,
        m.gbps(),
        m.msg_per_s(),
        m.report.p50_us(),
        m.report.p99_us(),
        m.cpu_ns_per_msg()
    )
}

/// The server to connect to: `HOST`, `HOST:PORT`, `[V6]`, `[V6]:PORT` or a
/// bare IPv6 address; the port defaults to [`DEFAULT_PORT`].
pub fn server_addr(s: &str) -> Result<String, BenchError> {
    let (host, port) = crate::parse::host_port(s, DEFAULT_PORT)
        .map_err(|e| BenchError::Invalid(format!("{s:?} is not HOST[:PORT] ({})", e.why)))?;
    Ok(format!("{host}:{port}"))
}

/// The seed's table on the local device: 64 B writes single post + signal
/// every vs batch 32 + signal last vs + inline; polling vs events vs hybrid
/// p99; then 1 MiB WRITE and READ bandwidth. `small`: messages of the 64 B
/// runs (the latency runs do a quarter). The latency runs keep one request
/// outstanding (tx depth 1, as ib_write_lat does): with the whole send
/// queue in flight their p99 would be queueing, not how soon a completion
/// is noticed.
pub fn compare_runs(base: &BenchOptions, small: u64) -> Vec<(&'static str, BenchOptions)> {
    let b = BenchOptions {
        op: OpKind::Write,
        size: 64,
        qps: 1,
        seconds: None,
        iters: small.max(1),
        ..base.clone()
    };
    let lat = |mode| BenchOptions {
        batch: 1,
        signal_every: 1,
        inline: 64,
        iters: (small / 4).max(1),
        mode,
        tx_depth: Some(1),
        ..b.clone()
    };
    let bw = |op| BenchOptions {
        op,
        size: 1 << 20,
        batch: 32,
        signal_every: 32,
        inline: 0,
        iters: 200,
        ..b.clone()
    };
    vec![
        (
            "single post, signal every",
            BenchOptions {
                batch: 1,
                signal_every: 1,
                inline: 0,
                ..b.clone()
            },
        ),
        (
            "batch 32, signal last",
            BenchOptions {
                batch: 32,
                signal_every: 32,
                inline: 0,
                ..b.clone()
            },
        ),
        (
            "batch 32, signal last, inline 64",
            BenchOptions {
                batch: 32,
                signal_every: 32,
                inline: 64,
                ..b.clone()
            },
        ),
        ("latency: poll", lat(PollMode::Poll)),
        ("latency: event", lat(PollMode::Event)),
        (
            "latency: hybrid",
            lat(PollMode::Hybrid {
                empty_polls: crate::datapath::config::DEFAULT_EMPTY_POLLS,
            }),
        ),
        ("bandwidth: 1 MiB write", bw(OpKind::Write)),
        ("bandwidth: 1 MiB read", bw(OpKind::Read)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(o: BenchOptions) -> String {
        o.validate().unwrap_err().to_string()
    }

    #[test]
    fn defaults_are_valid() {
        BenchOptions::default().validate().unwrap();
        for (_, o) in compare_runs(&BenchOptions::default(), 100_000) {
            o.validate().unwrap();
        }
    }

    #[test]
    fn seconds_rounds_stay_short_for_large_messages() {
        assert_eq!(round_iters(1 << 20), 64);
        assert_eq!(round_iters(MAX_SIZE), 4);
        assert_eq!(round_iters(64), 10_000);
        assert_eq!(round_iters(0), 10_000);
    }

    #[test]
    fn compare_latency_rows_keep_one_request_outstanding() {
        let base = BenchOptions {
            tx_depth: Some(16),
            ..BenchOptions::default()
        };
        let runs = compare_runs(&base, 1000);
        let lat: Vec<_> = runs
            .iter()
            .filter(|(w, _)| w.starts_with("latency"))
            .collect();
        assert_eq!(lat.len(), 3);
        for (w, o) in lat {
            assert_eq!((o.tx_depth, o.batch, o.size), (Some(1), 1, 64), "{w}");
        }
        // The other rows keep what was asked for.
        let bw = runs
            .iter()
            .find(|(w, _)| w.contains("1 MiB write"))
            .unwrap();
        assert_eq!(bw.1.tx_depth, Some(16));
        assert_eq!(BenchOptions::default().tx_depth(), SQ_DEPTH);
    }

    #[test]
    fn bad_options_are_refused_by_name() {
        let d = BenchOptions::default;
        assert!(msg(BenchOptions { size: 0, ..d() }).contains("--size 0"));
        assert!(msg(BenchOptions {
            size: MAX_SIZE + 1,
            ..d()
        })
        .contains("--size"));
        assert!(msg(BenchOptions { batch: 0, ..d() }).contains("--batch 0"));
        let e = msg(BenchOptions {
            batch: 65,
            signal_every: 1,
            ..d()
        });
        assert!(e.contains("--batch 65") && e.contains("1..=64"), "{e}");
        let e = msg(BenchOptions {
            batch: 8,
            signal_every: 16,
            ..d()
        });
        assert!(e.contains("--signal-every 16"), "{e}");
        assert!(msg(BenchOptions {
            signal_every: 0,
            ..d()
        })
        .contains("--signal-every 0"));
        assert!(msg(BenchOptions { iters: 0, ..d() }).contains("--iters"));
        assert!(msg(BenchOptions {
            seconds: Some(0.0),
            ..d()
        })
        .contains("--seconds"));
        assert!(msg(BenchOptions { qps: 0, ..d() }).contains("--qps 0"));
        assert!(msg(BenchOptions { qps: 99, ..d() }).contains("--qps 99"));
        assert!(msg(BenchOptions {
            inline: 4096,
            ..d()
        })
        .contains("--inline"));
        let e = msg(BenchOptions {
            tx_depth: Some(0),
            ..d()
        });
        assert!(e.contains("--tx-depth 0") && e.contains("1..=128"), "{e}");
        assert!(msg(BenchOptions {
            tx_depth: Some(SQ_DEPTH + 1),
            ..d()
        })
        .contains("--tx-depth 129"));
        BenchOptions {
            tx_depth: Some(SQ_DEPTH),
            ..d()
        }
        .validate()
        .unwrap();
        assert!(BenchOptions { batch: 0, ..d() }
            .validate()
            .unwrap_err()
            .is_usage());
    }

    #[test]
    fn ops_parse() {
        assert_eq!(parse_op("write"), Ok(OpKind::Write));
        assert_eq!(parse_op("read"), Ok(OpKind::Read));
        let e = parse_op("send").unwrap_err();
        assert!(e.contains("unknown op") && e.contains("send"), "{e}");
    }

    #[test]
    fn blocks_round_up_to_4k() {
        let b = |size| {
            BenchOptions {
                size,
                ..BenchOptions::default()
            }
            .block()
        };
        assert_eq!(b(64), 4096);
        assert_eq!(b(5000), 8192);
        assert_eq!(b(1 << 20), 1 << 20);
        assert_eq!(b(MAX_SIZE), MAX_SIZE);
    }

    #[test]
    fn server_addresses() {
        assert_eq!(server_addr("node").unwrap(), "node:18515");
        assert_eq!(server_addr("node:9").unwrap(), "node:9");
        assert_eq!(server_addr("10.0.0.1").unwrap(), "10.0.0.1:18515");
        assert_eq!(server_addr("10.0.0.1:7").unwrap(), "10.0.0.1:7");
        assert_eq!(server_addr("fe80::1").unwrap(), "[fe80::1]:18515");
        assert_eq!(server_addr("[fe80::1]").unwrap(), "[fe80::1]:18515");
        assert_eq!(server_addr("[fe80::1]:5").unwrap(), "[fe80::1]:5");
        assert!(server_addr("").is_err());
        assert!(server_addr("node:x").is_err());
        assert!(server_addr("[::1]:x").is_err());
    }

    #[test]
    fn the_line_parses() {
        let o = BenchOptions {
            size: 64,
            mode: PollMode::Hybrid { empty_polls: 7 },
            ..BenchOptions::default()
        };
        let mut m = Measured {
            cpu_ns: 2_000,
            ..Measured::default()
        };
        m.report.counters.extents_confirmed = 10;
        m.report.counters.bytes_confirmed = 640;
        m.report.seconds = 0.5;
        let line = format_line(&o, &m);
        assert!(
            line.starts_with(
                "bench op=write size=64 batch=32 signal=32 inline=0 mode=hybrid qps=1 msgs=10 "
            ),
            "{line}"
        );
        let kv: std::collections::HashMap<_, _> = line
            .split_whitespace()
            .skip(1)
            .map(|w| w.split_once('=').unwrap())
            .collect();
        assert_eq!(kv["msg_per_s"], "20");
        assert_eq!(kv["cpu_ns_per_msg"], "200");
        assert_eq!(kv["seconds"], "0.500");
        assert_eq!(kv["tx_depth"], "128");
        assert!(format_human(&o, &m).contains("20 msg/s"));
        // --json: the same keys as the line, as JSON.
        let v: serde_json::Value = serde_json::from_str(&json_line(&o, &m, None)).unwrap();
        assert_eq!(
            (v["type"].as_str(), v["version"].as_u64()),
            (Some("bench"), Some(1))
        );
        for k in kv.keys() {
            assert!(!v[*k].is_null(), "{k} missing from the JSON line");
        }
        assert_eq!(v["msg_per_s"], 20.0);
        assert_eq!(v["mode"], "hybrid");
        assert_eq!(v["cq_cpu"], "none");
        assert!(v["label"].is_null());
    }
}
