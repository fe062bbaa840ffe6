//! Prometheus metrics for `rcpd` (and anything else that runs transfers): the
//! one registry and the one `/metrics` server.
//!
//! Names carry the `rcp_` prefix, rcpd's own (integrity and auth failures) the
//! `rcpd_` prefix; both live in one registry and go out through one encoder.
//! Every event is counted once, where it happens: a transfer when it ends
//! ([`Metrics::transfer_ended`]), an auth refusal in the interceptor, a digest
//! mismatch where it is found. Data-path figures are never counted here: live
//! queue gauges (free SQ slots, the swqe_avail of the seed document; CQ fill)
//! and error completions and reconnects are read from each data path's
//! [`DataPathStats`] (which holds the engine's own counters) at scrape time,
//! taking only what grew since the last scrape; latencies and reconnect times
//! come from its [`Report`] once, when the data path closes. Each rail of a
//! data path has its own series (`rcp_rail_*`, the data path's labels plus
//! `rail`, its index), read from the rail's [`RailStats`] the same way.
//! [`serve`] answers `GET /metrics` over hyper/axum (what tonic already
//! brings).

use std::sync::{Arc, Mutex, OnceLock};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::datapath::{DataPathStats, RailStats, Report};
use crate::engine::stream::Counters;
use crate::proto::Direction;

mod http;
pub use http::{router, serve, CONTENT_TYPE};

type Labels = Vec<(String, String)>;

type HistFamily = Family<Labels, Histogram, fn() -> Histogram>;

/// 1 us .. ~67 s, x4.
fn latency_hist() -> Histogram {
    Histogram::new(exponential_buckets(1e-6, 4.0, 14))
}

/// 1 MB/s .. ~33 GB/s, x2.
fn throughput_hist() -> Histogram {
    Histogram::new(exponential_buckets(1e6, 2.0, 16))
}

struct Tracked {
    labels: Labels,
    depth: u64,
    cq_depth: u64,
    /// Held until only we hold it (the data path is gone), after one last
    /// pass that carries its final counts over.
    stats: Arc<DataPathStats>,
    last_errors: Vec<(&'static str, u64)>,
    last_reconnects: u64,
    /// Per rail: its [`RailCounts`] at the last scrape.
    last_rails: Vec<RailCounts>,
}

/// The counters of one rail exported as `rcp_rail_*_total`.
#[derive(Clone, Copy, Default)]
struct RailCounts([u64; RAIL_COUNTERS.len()]);

/// `(name, help, read)`: the per-rail counters, each read from the
/// engine's [`Counters`] of the rail (published in [`RailStats`]).
type RailCounter = (&'static str, &'static str, fn(&Counters) -> u64);

const RAIL_COUNTERS: [RailCounter; 6] = [
    (
        "rail_bytes",
        "Payload bytes a rail's completions confirmed",
        |c| c.bytes_confirmed,
    ),
    ("rail_error_cqes", "Error completions of a rail", |c| {
        c.errors.total()
    }),
    ("rail_failures", "Epochs of a rail that failed", |c| {
        c.failures
    }),
    (
        "rail_requeued_blocks",
        "Blocks moved off a failed rail to the others",
        |c| c.requeued,
    ),
    ("rail_reconnects", "Reconnects of a rail", |c| c.reconnects),
    (
        "rail_pauses",
        "Times a rail was paused (cool-down after repeated failures)",
        |c| c.pauses,
    ),
];

impl RailCounts {
    fn of(r: &RailStats) -> RailCounts {
        let c = r.counters();
        RailCounts(RAIL_COUNTERS.map(|(_, _, read)| read(&c)))
    }
}

/// Why rcpd cut a client off or held it back (`rcpd_client_limits_total`'s
/// `reason`): the limits that keep one client from taking what the others
/// need (docs/security.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ClientLimit {
    /// A handshake refused: rcpd's session table is full (`--max-sessions`).
    Sessions,
    /// A handshake refused: the client holds its share
    /// (`--max-sessions-per-client`).
    SessionsPerClient,
    /// A session closed: it opened no Move stream within `--session-grace`.
    SessionGrace,
    /// A session closed: unused for the idle time after its last Move.
    SessionIdle,
    /// A Move stream waited: rcpd runs all its transfer slots
    /// (`--max-transfers`).
    Transfers,
    /// A Move stream waited: its client runs its share of the transfer
    /// slots (`--max-transfers-per-client`).
    TransfersPerClient,
    /// A Move stream ended: nothing moved (no bytes, no file committed)
    /// for `--timeout`.
    NoProgress,
}

impl ClientLimit {
    pub const ALL: [ClientLimit; 7] = [
        ClientLimit::Sessions,
        ClientLimit::SessionsPerClient,
        ClientLimit::SessionGrace,
        ClientLimit::SessionIdle,
        ClientLimit::Transfers,
        ClientLimit::TransfersPerClient,
        ClientLimit::NoProgress,
    ];

    /// The `reason` label.
    pub fn as_str(self) -> &'static str {
        match self {
            ClientLimit::Sessions => "sessions",
            ClientLimit::SessionsPerClient => "sessions_per_client",
            ClientLimit::SessionGrace => "session_grace",
            ClientLimit::SessionIdle => "session_idle",
            ClientLimit::Transfers => "transfers",
            ClientLimit::TransfersPerClient => "transfers_per_client",
            ClientLimit::NoProgress => "no_progress",
        }
    }
}

/// How a transfer ended (`rcp_transfers_total`'s `outcome`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Error,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
        }
    }
}

/// The series a finished transfer of one direction and outcome counts in.
/// A family's lookup builds its labels and takes its lock; rcpd ends a
/// transfer per file, so each set is looked up once and kept (a series'
/// handles share its value).
struct EndedSeries {
    bytes: Counter,
    transfers: Counter,
    throughput: Histogram,
}

fn limit_labels(why: ClientLimit) -> Labels {
    vec![("reason".to_string(), why.as_str().to_string())]
}

/// Every metric rcp exports.
pub struct Metrics {
    registry: Registry,
    sq_free: Family<Labels, Gauge>,
    sq_depth: Family<Labels, Gauge>,
    cq_fill: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    cq_overrun: Counter,
    error_cqes: Family<Labels, Counter>,
    reconnects: Counter,
    reconnect_seconds: Histogram,
    bytes: Family<Labels, Counter>,
    transfers: Family<Labels, Counter>,
    wr_latency: HistFamily,
    throughput: HistFamily,
    memlock_failures: Counter,
    /// The process's verbs registrations and window binds
    /// ([`crate::verbs::counts`]), brought up to date at each scrape.
    verbs_registrations: Counter,
    verbs_window_binds: Counter,
    verbs_binds_deferred: Counter,
    active_transfers: Gauge,
    integrity_failures: Counter,
    auth_failures: Counter,
    client_limits: Family<Labels, Counter>,
    /// The Copy API's sessions to other rcpds: opened, served warm from
    /// the pool, and warm now.
    copy_sessions_opened: Counter,
    copy_sessions_reused: Counter,
    copy_sessions_expired: Counter,
    copy_sessions_warm: Gauge,
    /// Buffers under standing grants: grants made, `BufferNotify` calls
    /// served and the operations they told.
    buffer_standing_grants: Counter,
    buffer_notify_calls: Counter,
    buffer_notify_frames: Counter,
    buffer_framed_writes: Counter,
    buffer_notices: Counter,
    /// `rcp_rail_*_total`, in the order of [`RAIL_COUNTERS`].
    rail_counters: Vec<Family<Labels, Counter>>,
    /// `rcp_rail_up`: 1 while the rail carries chains, 0 otherwise.
    rail_up: Family<Labels, Gauge>,
    tracked: Mutex<Vec<Tracked>>,
    /// [`EndedSeries`] of push and pull, by [`Outcome`], once used.
    ended: [[OnceLock<EndedSeries>; 2]; 2],
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut root = Registry::default();
        let m = Metrics {
            registry: Registry::default(),
            sq_free: Family::default(),
            sq_depth: Family::default(),
            cq_fill: Family::default(),
            cq_overrun: Counter::default(),
            error_cqes: Family::default(),
            reconnects: Counter::default(),
            reconnect_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            bytes: Family::default(),
            transfers: Family::default(),
            wr_latency: Family::new_with_constructor(latency_hist as fn() -> Histogram),
            throughput: Family::new_with_constructor(throughput_hist as fn() -> Histogram),
            memlock_failures: Counter::default(),
            verbs_registrations: Counter::default(),
            verbs_window_binds: Counter::default(),
            verbs_binds_deferred: Counter::default(),
            active_transfers: Gauge::default(),
            integrity_failures: Counter::default(),
            auth_failures: Counter::default(),
            client_limits: Family::default(),
            copy_sessions_opened: Counter::default(),
            copy_sessions_reused: Counter::default(),
            copy_sessions_expired: Counter::default(),
            copy_sessions_warm: Gauge::default(),
            buffer_standing_grants: Counter::default(),
            buffer_notify_calls: Counter::default(),
            buffer_notify_frames: Counter::default(),
            buffer_framed_writes: Counter::default(),
            buffer_notices: Counter::default(),
            rail_counters: RAIL_COUNTERS.iter().map(|_| Family::default()).collect(),
            rail_up: Family::default(),
            tracked: Mutex::new(Vec::new()),
            ended: Default::default(),
        };
        m.register_rcp(root.sub_registry_with_prefix("rcp"));
        m.register_rcpd(root.sub_registry_with_prefix("rcpd"));
        Metrics {
            registry: root,
            ..m
        }
    }

    /// The data path's and the transfers' metrics, `rcp_*`.
    fn register_rcp(&self, r: &mut Registry) {
        let m = self;
        r.register(
            "sq_free_slots",
            "Free send-queue slots (swqe_avail) per device and QP",
            m.sq_free.clone(),
        );
        r.register(
            "sq_depth",
            "Send-queue depth per device and QP",
            m.sq_depth.clone(),
        );
        r.register(
            "cq_fill_ratio",
            "Completions taken by the last poll over CQ depth",
            m.cq_fill.clone(),
        );
        r.register(
            "cq_overrun",
            "CQ overruns seen (async event or overrun status)",
            m.cq_overrun.clone(),
        );
        r.register(
            "error_cqes",
            "Error completions by ibv_wc_status",
            m.error_cqes.clone(),
        );
        r.register(
            "reconnects",
            "QP reconnects after an error batch",
            m.reconnects.clone(),
        );
        r.register(
            "reconnect_seconds",
            "From error batch to first completed WR after reconnect",
            m.reconnect_seconds.clone(),
        );
        r.register(
            "bytes",
            "Payload bytes moved, by direction",
            m.bytes.clone(),
        );
        r.register(
            "transfers",
            "Transfers ended, by direction and outcome",
            m.transfers.clone(),
        );
        r.register(
            "wr_latency_seconds",
            "Post-to-completion latency of signaled WRs",
            m.wr_latency.clone(),
        );
        r.register(
            "transfer_throughput_bytes_per_second",
            "Throughput of each finished transfer",
            m.throughput.clone(),
        );
        r.register(
            "memlock_failures",
            "Registrations refused for lack of lockable memory",
            m.memlock_failures.clone(),
        );
        r.register(
            "verbs_registrations",
            "Memory registrations (ibv_reg_mr) this process made; flat during a copy \
             when grants bind memory windows",
            m.verbs_registrations.clone(),
        );
        r.register(
            "verbs_window_binds",
            "Memory windows this process bound, one per grant where the device has them",
            m.verbs_window_binds.clone(),
        );
        r.register(
            "verbs_window_binds_deferred",
            "Grants whose memory window was bound later, when its QP reconnected \
             (granted while a rail was cut)",
            m.verbs_binds_deferred.clone(),
        );
        r.register(
            "active_transfers",
            "Transfers in progress",
            m.active_transfers.clone(),
        );
        for ((name, help, _), f) in RAIL_COUNTERS.iter().zip(&m.rail_counters) {
            r.register(*name, *help, f.clone());
        }
        r.register(
            "rail_up",
            "Whether a rail carries chains (1) or is down, flushing, reconnecting or paused (0)",
            m.rail_up.clone(),
        );
    }

    /// rcpd's own, `rcpd_*`.
    fn register_rcpd(&self, d: &mut Registry) {
        let m = self;
        d.register(
            "integrity_failures",
            "Block or whole-file digest mismatches found by rcpd",
            m.integrity_failures.clone(),
        );
        d.register(
            "auth_failures",
            "Requests refused for a missing or wrong token",
            m.auth_failures.clone(),
        );
        d.register(
            "client_limits",
            "Clients cut off or held back by a limit that protects the others, by reason",
            m.client_limits.clone(),
        );
        // Every reason shows, at zero until it happens.
        for r in ClientLimit::ALL {
            let _ = m.client_limits.get_or_create(&limit_labels(r));
        }
        d.register(
            "copy_sessions_opened",
            "Sessions the Copy API opened to other rcpds (set-up paid)",
            m.copy_sessions_opened.clone(),
        );
        d.register(
            "copy_sessions_reused",
            "Copy API calls served by a warm session from the pool (set-up saved)",
            m.copy_sessions_reused.clone(),
        );
        d.register(
            "copy_sessions_expired",
            "Warm sessions the Copy API closed after --copy-session-idle unused",
            m.copy_sessions_expired.clone(),
        );
        d.register(
            "copy_sessions_warm",
            "Idle sessions the Copy API keeps warm to other rcpds",
            m.copy_sessions_warm.clone(),
        );
        d.register(
            "buffer_standing_grants",
            "Standing grants made to peers' sessions (an exposure granted whole, once)",
            m.buffer_standing_grants.clone(),
        );
        d.register(
            "buffer_notify_calls",
            "BufferNotify calls served (each tells a batch of operations under standing grants)",
            m.buffer_notify_calls.clone(),
        );
        d.register(
            "buffer_notify_frames",
            "Of the BufferNotify calls, those that came on the data path (a tcp session's \
             MESSAGE frame, a verbs session's message QP) rather than over gRPC",
            m.buffer_notify_frames.clone(),
        );
        d.register(
            "buffer_framed_writes",
            "Small writes under standing grants this rcpd moved with their notice in one \
             exchange on a connection of a tcp session (no data-path thread)",
            m.buffer_framed_writes.clone(),
        );
        d.register(
            "buffer_notices",
            "Operations under standing grants told by BufferNotify",
            m.buffer_notices.clone(),
        );
    }

    /// Follow a data path's live counters under `device`/`qp` labels until
    /// its stats are dropped.
    pub fn track(
        &self,
        device: &str,
        qp: u32,
        sq_depth: u32,
        cq_depth: u32,
        stats: &Arc<DataPathStats>,
    ) {
        let labels = vec![
            ("device".to_string(), device.to_string()),
            ("qp".to_string(), qp.to_string()),
        ];
        self.sq_depth.get_or_create(&labels).set(sq_depth as i64);
        self.tracked.lock().unwrap().push(Tracked {
            labels,
            depth: sq_depth as u64,
            cq_depth: cq_depth.max(1) as u64,
            stats: stats.clone(),
            last_errors: Vec::new(),
            last_reconnects: 0,
            last_rails: vec![RailCounts::default(); stats.rails.len()],
        });
    }

    /// A transfer started / ended.
    pub fn transfer_started(&self) {
        self.active_transfers.inc();
    }

    /// Record a finished transfer: its direction, outcome
    /// `ok`/`error`/..., and the data path's report if there was one.
    pub fn transfer_ended(
        &self,
        direction: Direction,
        outcome: Outcome,
        bytes: u64,
        seconds: f64,
        report: Option<&Report>,
    ) {
        self.active_transfers.dec();
        self.with_ended(direction, outcome, |series| {
            series.bytes.inc_by(bytes);
            series.transfers.inc();
            if seconds > 0.0 && bytes > 0 {
                series.throughput.observe(bytes as f64 / seconds);
            }
        });
        if let Some(r) = report {
            self.datapath_report(Some(direction), r);
        }
    }

    /// `f` of the series of a transfer of `direction` that ended with
    /// `outcome`: kept for push and pull, looked up each time for another
    /// direction.
    fn with_ended(&self, direction: Direction, outcome: Outcome, f: impl FnOnce(&EndedSeries)) {
        let lookup = || {
            let d = vec![("direction".to_string(), direction.label().to_string())];
            let mut l = d.clone();
            l.push(("outcome".to_string(), outcome.as_str().to_string()));
            EndedSeries {
                bytes: self.bytes.get_or_create(&d).clone(),
                transfers: self.transfers.get_or_create(&l).clone(),
                throughput: self.throughput.get_or_create(&d).clone(),
            }
        };
        let dir = match direction {
            Direction::Push => 0,
            Direction::Pull => 1,
            Direction::Unspecified => return f(&lookup()),
        };
        f(self.ended[dir][outcome as usize].get_or_init(lookup))
    }

    /// Transfers in progress now.
    pub fn active_transfers(&self) -> i64 {
        self.active_transfers.get()
    }

    /// `n` blocks (or a whole file) did not match their digests.
    pub fn integrity_failures(&self, n: u64) {
        self.integrity_failures.inc_by(n);
    }

    /// A request was refused for a missing or wrong token.
    pub fn auth_failure(&self) {
        self.auth_failures.inc();
    }

    /// `n` clients were cut off or held back by `why`.
    pub fn client_limit(&self, why: ClientLimit, n: u64) {
        self.client_limits
            .get_or_create(&limit_labels(why))
            .inc_by(n);
    }

    /// A registration was refused for lack of lockable memory.
    pub fn memlock_failure(&self) {
        self.memlock_failures.inc();
    }

    /// The Copy API opened a session to another rcpd.
    pub fn copy_session_opened(&self) {
        self.copy_sessions_opened.inc();
    }

    /// The Copy API served a call over a warm session.
    pub fn copy_session_reused(&self) {
        self.copy_sessions_reused.inc();
    }

    /// A standing grant was made to a peer's session.
    pub fn buffer_standing_grant(&self) {
        self.buffer_standing_grants.inc();
    }

    /// A `BufferNotify` of `notices` operations was served (`frame`: it
    /// came on the data path).
    pub fn buffer_notify(&self, notices: usize, frame: bool) {
        self.buffer_notify_calls.inc();
        if frame {
            self.buffer_notify_frames.inc();
        }
        self.buffer_notices.inc_by(notices as u64);
    }

    /// A write moved with its notice on a connection of a tcp session.
    pub fn buffer_framed_write(&self) {
        self.buffer_framed_writes.inc();
    }

    /// The Copy API closed `n` warm sessions left unused for the idle time.
    pub fn copy_sessions_expired(&self, n: usize) {
        self.copy_sessions_expired.inc_by(n as u64);
    }

    /// The Copy API keeps `n` sessions warm now.
    pub fn copy_sessions_warm(&self, n: usize) {
        self.copy_sessions_warm.set(n as i64);
    }

    /// A CQ overrun was seen.
    pub fn cq_overrun(&self) {
        self.cq_overrun.inc();
    }

    fn refresh(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let mut t = self.tracked.lock().unwrap();
        // Under the lock: two scrapes at once do not both add the growth.
        let v = crate::verbs::counts();
        for (c, now) in [
            (&self.verbs_registrations, v.registrations),
            (&self.verbs_window_binds, v.window_binds),
            (&self.verbs_binds_deferred, v.binds_deferred),
        ] {
            c.inc_by(now.saturating_sub(c.get()));
        }
        t.retain_mut(|e| {
            let s = &e.stats;
            // Counters first, so what a data path did just before it ended
            // is still counted.
            let c = s.counters();
            let errs: Vec<_> = c.errors.iter().collect();
            for (label, n) in &errs {
                let before = e
                    .last_errors
                    .iter()
                    .find(|(l, _)| l == label)
                    .map_or(0, |x| x.1);
                if *n > before {
                    self.error_cqes
                        .get_or_create(&vec![("status".to_string(), label.to_string())])
                        .inc_by(n - before);
                }
            }
            e.last_errors = errs;
            let rc = c.reconnects;
            if rc > e.last_reconnects {
                self.reconnects.inc_by(rc - e.last_reconnects);
                e.last_reconnects = rc;
            }
            let gone = Arc::strong_count(&e.stats) == 1;
            for (k, (rail, last)) in s.rails.iter().zip(&mut e.last_rails).enumerate() {
                let mut l = e.labels.clone();
                l.push(("rail".to_string(), k.to_string()));
                let now = RailCounts::of(rail);
                for (i, f) in self.rail_counters.iter().enumerate() {
                    // Created at zero on the first scrape, so every rail
                    // shows each of its series.
                    let c = f.get_or_create(&l);
                    if now.0[i] > last.0[i] {
                        c.inc_by(now.0[i] - last.0[i]);
                    }
                }
                *last = now;
                if gone {
                    self.rail_up.remove(&l);
                } else {
                    let up =
                        rail.state_label() == crate::engine::stream::RailState::Running.label();
                    self.rail_up.get_or_create(&l).set(i64::from(up));
                }
            }
            if gone {
                // The data path is gone: its queue gauges go with it.
                self.sq_free.remove(&e.labels);
                self.sq_depth.remove(&e.labels);
                self.cq_fill.remove(&e.labels);
                return false;
            }
            self.sq_free
                .get_or_create(&e.labels)
                .set(s.sq_free.load(Relaxed).min(e.depth) as i64);
            self.cq_fill
                .get_or_create(&e.labels)
                .set(s.cq_fill.load(Relaxed) as f64 / e.cq_depth as f64);
            true
        });
    }

    /// Record what a data path run measured: post-to-completion latency of
    /// its signaled requests and the time each reconnect took; `direction`
    /// `None` (a session that moved no file) is labelled `none`.
    pub fn datapath_report(&self, direction: Option<Direction>, r: &Report) {
        let label = direction.map_or("none", Direction::label);
        let d = vec![("direction".to_string(), label.to_string())];
        let h = self.wr_latency.get_or_create(&d);
        for &ns in r.latency.samples() {
            h.observe(ns as f64 / 1e9);
        }
        for &s in &r.reconnect_seconds {
            self.reconnect_seconds.observe(s);
        }
    }

    /// The text exposition (what `/metrics` returns).
    pub fn render(&self) -> String {
        self.refresh();
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("encoding into a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::WcStatus;
    use std::sync::atomic::Ordering::Relaxed;

    /// Each transfer counts in its series every time, through the kept
    /// handles as through a lookup: direction and outcome kept apart, bytes
    /// summed, the throughput observed.
    #[test]
    fn each_ended_transfer_counts_in_its_series() {
        let m = Metrics::new();
        for _ in 0..3 {
            m.transfer_started();
        }
        m.transfer_ended(Direction::Push, Outcome::Ok, 100, 1.0, None);
        m.transfer_ended(Direction::Push, Outcome::Ok, 50, 1.0, None);
        m.transfer_ended(Direction::Push, Outcome::Error, 0, 1.0, None);
        m.transfer_started();
        m.transfer_ended(Direction::Unspecified, Outcome::Ok, 7, 1.0, None);
        let t = m.render();
        for series in [
            r#"rcp_transfers_total{direction="push",outcome="ok"} 2"#,
            r#"rcp_transfers_total{direction="push",outcome="error"} 1"#,
            r#"rcp_transfers_total{direction="unspecified",outcome="ok"} 1"#,
            r#"rcp_bytes_total{direction="push"} 150"#,
            r#"rcp_bytes_total{direction="unspecified"} 7"#,
            r#"rcp_active_transfers 0"#,
        ] {
            assert!(t.contains(series), "{series} in {t}");
        }
        assert!(!t.contains(r#"direction="pull""#), "{t}");
        let count = t
            .lines()
            .find(|l| {
                l.starts_with(r#"rcp_transfer_throughput_bytes_per_second_count{direction="push"}"#)
            })
            .unwrap_or_else(|| panic!("push throughput count in {t}"));
        assert!(count.ends_with(" 2"), "{count}");
    }

    /// Every reason shows from the start, at zero; each event counts once.
    #[test]
    fn client_limits_by_reason() {
        let m = Metrics::new();
        let t = m.render();
        for r in ClientLimit::ALL {
            let series = format!("rcpd_client_limits_total{{reason=\"{}\"}} 0", r.as_str());
            assert!(t.contains(&series), "{series} in {t}");
        }
        m.client_limit(ClientLimit::SessionGrace, 3);
        m.client_limit(ClientLimit::NoProgress, 1);
        let t = m.render();
        assert!(
            t.contains("rcpd_client_limits_total{reason=\"session_grace\"} 3"),
            "{t}"
        );
        assert!(
            t.contains("rcpd_client_limits_total{reason=\"no_progress\"} 1"),
            "{t}"
        );
        assert!(
            t.contains("rcpd_client_limits_total{reason=\"sessions\"} 0"),
            "{t}"
        );
    }

    #[test]
    fn renders_live_gauges_errors_and_transfers() {
        let m = Metrics::new();
        let s = Arc::new(DataPathStats::default());
        m.track("rxe0", 17, 256, 512, &s);
        s.cq_fill.store(64, Relaxed);
        let mut c = Counters::default();
        c.errors.count(WcStatus::Flushed);
        c.errors.count(WcStatus::Flushed);
        s.publish(&c, 200);
        m.transfer_started();
        m.transfer_ended(Direction::Push, Outcome::Ok, 1 << 20, 0.5, None);
        let t = m.render();
        assert!(
            t.contains(r#"rcp_sq_free_slots{device="rxe0",qp="17"} 200"#),
            "{t}"
        );
        assert!(
            t.contains(r#"rcp_sq_depth{device="rxe0",qp="17"} 256"#),
            "{t}"
        );
        assert!(
            t.contains(r#"rcp_cq_fill_ratio{device="rxe0",qp="17"} 0.125"#),
            "{t}"
        );
        assert!(
            t.contains(r#"rcp_error_cqes_total{status="wr_flush_err"} 2"#),
            "{t}"
        );
        assert!(
            t.contains(r#"rcp_bytes_total{direction="push"} 1048576"#),
            "{t}"
        );
        assert!(
            t.contains(r#"rcp_transfers_total{direction="push",outcome="ok"} 1"#),
            "{t}"
        );
        assert!(
            t.contains("rcp_transfer_throughput_bytes_per_second_count{direction=\"push\"} 1"),
            "{t}"
        );
        // Errors are counted once, not again at the next scrape.
        let t = m.render();
        assert!(
            t.contains(r#"rcp_error_cqes_total{status="wr_flush_err"} 2"#),
            "{t}"
        );
        // What a data path did just before it ended is still counted, and
        // its queue gauges go with it.
        c.errors.count(WcStatus::RemoteAccess);
        c.reconnects += 2;
        s.publish(&c, 200);
        drop(s);
        let t = m.render();
        assert!(!t.contains("rcp_sq_free_slots{"), "{t}");
        assert!(
            t.contains(r#"rcp_error_cqes_total{status="rem_access_err"} 1"#),
            "{t}"
        );
        assert!(t.contains("rcp_reconnects_total 2"), "{t}");
        let t = m.render();
        assert!(t.contains("rcp_reconnects_total 2"), "{t}");
    }

    #[test]
    fn each_rail_has_its_series_counted_once() {
        let m = Metrics::new();
        let s = Arc::new(DataPathStats::with_rails(2));
        m.track("rxea0", 9, 128, 128, &s);
        use crate::engine::stream::RailState;
        let mut c0 = Counters {
            bytes_confirmed: 4096,
            ..Counters::default()
        };
        let mut c1 = Counters {
            bytes_confirmed: 1 << 20,
            failures: 1,
            requeued: 12,
            ..Counters::default()
        };
        s.rails[0].publish(&c0, 128, RailState::Running);
        let paused = RailState::Paused { until: 1 };
        s.rails[1].publish(&c1, 128, paused);
        assert_eq!(s.rails[1].state_label(), "paused");
        let t = m.render();
        for line in [
            r#"rcp_rail_bytes_total{device="rxea0",qp="9",rail="0"} 4096"#,
            r#"rcp_rail_bytes_total{device="rxea0",qp="9",rail="1"} 1048576"#,
            r#"rcp_rail_failures_total{device="rxea0",qp="9",rail="0"} 0"#,
            r#"rcp_rail_failures_total{device="rxea0",qp="9",rail="1"} 1"#,
            r#"rcp_rail_requeued_blocks_total{device="rxea0",qp="9",rail="1"} 12"#,
            r#"rcp_rail_reconnects_total{device="rxea0",qp="9",rail="1"} 0"#,
            r#"rcp_rail_up{device="rxea0",qp="9",rail="0"} 1"#,
            r#"rcp_rail_up{device="rxea0",qp="9",rail="1"} 0"#,
        ] {
            assert!(t.lines().any(|l| l == line), "{line}:\n{t}");
        }
        // The engine's counts are totals: what grew since the last scrape
        // is added, nothing twice.
        c1.bytes_confirmed = 3 << 20;
        s.rails[1].publish(&c1, 128, RailState::Running);
        let t = m.render();
        for line in [
            r#"rcp_rail_bytes_total{device="rxea0",qp="9",rail="0"} 4096"#,
            r#"rcp_rail_bytes_total{device="rxea0",qp="9",rail="1"} 3145728"#,
            r#"rcp_rail_failures_total{device="rxea0",qp="9",rail="1"} 1"#,
            r#"rcp_rail_up{device="rxea0",qp="9",rail="1"} 1"#,
        ] {
            assert!(t.lines().any(|l| l == line), "{line}:\n{t}");
        }
        // The data path ends: its last counts are kept, its gauges go.
        c0.reconnects = 2;
        s.rails[0].publish(&c0, 128, RailState::Running);
        drop(s);
        let t = m.render();
        assert!(
            t.lines()
                .any(|l| l == r#"rcp_rail_reconnects_total{device="rxea0",qp="9",rail="0"} 2"#),
            "{t}"
        );
        assert!(!t.contains("rcp_rail_up{"), "{t}");
    }

    /// One event, one count: a transfer, an integrity failure, an auth
    /// refusal each show once however often the registry is rendered, and
    /// a data path's published counts are taken once.
    #[test]
    fn each_event_counted_once() {
        let m = Metrics::new();
        let t = m.render();
        for zero in [
            "rcp_active_transfers 0",
            "rcpd_integrity_failures_total 0",
            "rcpd_auth_failures_total 0",
        ] {
            assert!(t.lines().any(|l| l == zero), "{zero}: {t}");
        }
        m.transfer_started();
        assert_eq!(m.active_transfers(), 1);
        m.transfer_ended(Direction::Pull, Outcome::Ok, 4096, 0.1, None);
        m.integrity_failures(3);
        m.auth_failure();
        let s = Arc::new(DataPathStats::default());
        m.track("tcp", 1, 64, 64, &s);
        let mut c = Counters::default();
        c.errors.count(WcStatus::RetryExceeded);
        c.reconnects = 1;
        s.publish(&c, 64);
        s.publish(&c, 64);
        for _ in 0..3 {
            let t = m.render();
            for want in [
                r#"rcp_transfers_total{direction="pull",outcome="ok"} 1"#,
                r#"rcp_bytes_total{direction="pull"} 4096"#,
                "rcp_active_transfers 0",
                "rcpd_integrity_failures_total 3",
                "rcpd_auth_failures_total 1",
                r#"rcp_error_cqes_total{status="retry_exc_err"} 1"#,
                "rcp_reconnects_total 1",
            ] {
                assert!(t.lines().any(|l| l == want), "{want}: {t}");
            }
            // One encoder: one terminator, at the end.
            assert_eq!(t.matches("# EOF").count(), 1, "{t}");
            assert!(t.ends_with("# EOF\n"), "{t}");
        }
    }

    /// Every metric name the deployment's rules may use, and every one the
    /// README and docs/deploy.md name (with the labels they give), is
    /// exported.
    #[test]
    fn documented_names_are_exported() {
        let m = Metrics::new();
        // A data path has one rail at least (DataPath::start: one).
        let s = Arc::new(DataPathStats::with_rails(1));
        m.track("rxe0", 1, 8, 8, &s);
        let mut c = Counters::default();
        c.errors.count(WcStatus::Flushed);
        s.publish(&c, 8);
        m.transfer_started();
        m.transfer_ended(Direction::Push, Outcome::Ok, 1, 1.0, None);
        m.cq_overrun();
        m.memlock_failure();
        let t = m.render();
        let names: Vec<&str> = t
            .lines()
            .filter(|l| l.starts_with("# TYPE "))
            .filter_map(|l| l.split_whitespace().nth(2))
            .collect();
        let exported = |n: &str| {
            let base = ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| n.strip_suffix(s))
                .unwrap_or(n);
            names.contains(&n) || names.contains(&base)
        };
        let listed = include_str!("../../deploy/monitoring/rcp-metrics.txt");
        for n in listed.lines().map(str::trim).filter(|l| !l.is_empty()) {
            assert!(
                exported(n),
                "{n} (deploy/monitoring/rcp-metrics.txt): {names:?}"
            );
        }
        // The label names of a sample line of `name`, "le" left out.
        let labels_of = |name: &str| -> Vec<Vec<String>> {
            t.lines()
                .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{'))
                .map(|l| {
                    let inner = &l[..l.find('}').unwrap()];
                    let mut v: Vec<String> = inner
                        .split(',')
                        .filter_map(|kv| Some(kv.split_once('=')?.0.to_string()))
                        .filter(|k| k != "le")
                        .collect();
                    v.sort();
                    v
                })
                .collect()
        };
        for doc in [
            include_str!("../../README.md"),
            include_str!("../../docs/deploy.md"),
        ] {
            let mut rest = doc;
            while let Some(i) = rest.find("rcp") {
                let w: String = rest[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let after = &rest[i + w.len()..];
                rest = after;
                if !(w.starts_with("rcp_") || w.starts_with("rcpd_")) || w.ends_with('_') {
                    continue;
                }
                assert!(exported(&w), "{w} (documented): {names:?}");
                if let Some(l) = after.strip_prefix('{') {
                    let mut want: Vec<String> = l[..l.find('}').unwrap()]
                        .split(',')
                        .map(|kv| kv.split('=').next().unwrap_or(kv).trim().to_string())
                        .collect();
                    want.sort();
                    let got = labels_of(&w);
                    assert!(
                        got.contains(&want),
                        "{w}{{{want:?}}} documented; exported {got:?}"
                    );
                }
            }
        }
    }

    async fn request(addr: std::net::SocketAddr, raw: &[u8]) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(raw).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_metrics_over_http() {
        let m = Arc::new(Metrics::new());
        m.memlock_failure();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let task = tokio::spawn(serve(l, m));
        let get = |path: &'static str| async move {
            request(
                addr,
                format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
            )
            .await
        };
        let ok = get("/metrics").await;
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        assert!(
            ok.to_ascii_lowercase()
                .contains(&format!("content-type: {CONTENT_TYPE}")),
            "{ok}"
        );
        assert!(ok.contains("rcp_memlock_failures_total 1"), "{ok}");
        assert!(ok.contains("rcpd_auth_failures_total 0"), "{ok}");
        assert!(ok.ends_with("# EOF\n"), "{ok}");
        assert!(get("/other").await.starts_with("HTTP/1.1 404"));
        assert!(get("/").await.starts_with("HTTP/1.1 404"));
        // The HTTP/1.0 scrape of tests/common/metrics.rs: answered, then closed.
        let old = request(addr, b"GET /metrics HTTP/1.0\r\n\r\n").await;
        assert!(old.starts_with("HTTP/1.0 200"), "{old}");
        let post = request(
            addr,
            b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        // Garbage is refused and does not take the server down.
        let bad = request(addr, b"\x00\x01garbage\r\n\r\n").await;
        assert!(bad.is_empty() || bad.starts_with("HTTP/1.1 400"), "{bad}");
        // Two requests on one kept-alive connection.
        let two = request(
            addr,
            b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert_eq!(two.matches("HTTP/1.1 200").count(), 2, "{two}");
        assert!(get("/metrics").await.starts_with("HTTP/1.1 200"));
        task.abort();
    }
}
