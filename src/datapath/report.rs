//! What a data path did: [`Report`], for `rcp bench`'s line, logs and the
//! metrics exporter's histograms.

use super::stats::Latencies;
use crate::engine::stream::Counters;

/// What a data path did. [`super::DataPath`] takes the counts from the
/// engine when it closes.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// The engine's counters (all rails): what was posted, completed,
    /// confirmed and failed.
    pub counters: Counters,
    /// Wall time from `start` to `close`.
    pub seconds: f64,
    /// Per reconnect: seconds from the start of the error path to the first
    /// block confirmed after it.
    pub reconnect_seconds: Vec<f64>,
    /// Per reconnect that waited for the port: seconds from the port monitor
    /// seeing `PORT_ACTIVE` to the first block confirmed after it (the
    /// first completed request of the new connection).
    pub port_up_to_first_wr_seconds: Vec<f64>,
    /// Post-to-completion latency of signaled requests.
    pub latency: Latencies,
    /// Completion thread: polls, empty polls, arms, waits, wakeups.
    pub polls: u64,
    pub empty_polls: u64,
    pub arms: u64,
    pub waits: u64,
    pub wakeups: u64,
    /// Async device events seen during the run (with a port monitor).
    pub port_events: u64,
    /// Times the reconnect path waited for the port to come back.
    pub port_waits: u64,
    /// Requests still outstanding when `close` gave up
    /// waiting for them (`flush_timeout`); if not 0, the device may still
    /// touch their memory until the channel is reset or dropped.
    pub outstanding_at_close: u64,
    /// Per rail (a one-rail data path has one entry); the fields above are
    /// the totals. With several rails `reconnect_seconds` holds each rail's
    /// failure → rejoin times.
    pub rails: Vec<RailReport>,
}

/// What one rail of a data path did.
#[derive(Clone, Debug, Default)]
pub struct RailReport {
    /// The engine's counters of the rail.
    pub counters: Counters,
    /// Per failure: seconds from the rail's failure to its rejoining.
    pub reconnect_seconds: Vec<f64>,
    /// Per fence: seconds from the rail's failure to the last of its
    /// extents being posted on another rail.
    pub failover_seconds: Vec<f64>,
    /// Async device events its port monitor saw.
    pub port_events: u64,
    /// Times its reconnect waited for its port.
    pub port_waits: u64,
}

impl Report {
    /// Median post→completion latency in microseconds.
    pub fn p50_us(&self) -> f64 {
        self.latency.quantile(0.5).unwrap_or(0) as f64 / 1e3
    }
    /// 99th percentile post→completion latency in microseconds.
    pub fn p99_us(&self) -> f64 {
        self.latency.quantile(0.99).unwrap_or(0) as f64 / 1e3
    }
}
