//! The data path runtime: drives the engine over a provider
//! [`Channel`](crate::provider::Channel).
//!
//! # Where to start
//!
//! [`DataPath`] is the session-long data path: [`DataPath::start`] takes a
//! [`DataPathConfig`], an `Arc<dyn Channel>`, the reconnect callback and an
//! optional [`PortMonitor`]; [`DataPath::start_rails`] takes a [`RailSpec`]
//! per rail instead (one channel each: several RDMA ports striped, a lost
//! rail absorbed by the others; the runner's module docs say what the
//! caller must do, the engine's [`rail`](crate::engine::stream::rail) docs
//! give the model). Its threads live until [`DataPath::close`] (or drop):
//! - the posting thread owns an [`engine::Stream`](crate::engine::Stream),
//!   takes windows ([`WindowJob`](crate::engine::WindowJob)s) from
//!   [`DataPath::submit`] (an `unsafe fn`: the caller lends the window's
//!   staging memory to the device until its [`DpEvent::WindowDone`]) and
//!   completion batches from one input queue, posts one chain per doorbell
//!   on the chain's rail, runs the error path (one rail: flush, reconnect,
//!   repost only the unconfirmed; several: fence the failed rail, repost
//!   its blocks on the others at once) and publishes the engine's counters
//!   into [`DataPathStats`];
//! - a completion thread per rail, pinned per `cq_cpu` (or the rail's own
//!   choice), polls its channel in batches ([`completion_loop`]: poll,
//!   event or hybrid) and hands them to the posting thread, which keeps off
//!   their CPUs while they spin;
//! - a reconnect helper per rail, which fences, waits for the port and
//!   reconnects its rail with backoff while the posting thread goes on
//!   (a [`ReconnectError::Permanent`] from the callback ends that at once:
//!   the tcp provider's connections cannot be replaced);
//! - with several rails, a port watcher per rail that has a monitor: the
//!   port going down fails the rail at once.
//!
//! Events come out of [`DataPath::take_events`] as a tokio unbounded
//! channel of [`DpEvent`] (`WindowDone`, `Reconnected`, `Failed`; with
//! several rails `RailDown`, `RailFenced`, `RailPaused`, `RailUp`); `close`
//! returns the [`Report`] (`rcp bench`'s figures, with a [`RailReport`] per
//! rail).
//!
//! The data path does no file I/O and knows no file: the caller fills a
//! WRITE window's staging region before `submit` and reads a READ window's
//! after `WindowDone`.
//!
//! # Modules
//!
//! - [`config`]: [`DataPathConfig`] (batch, signaling, inline, poll mode,
//!   CQ CPU, timeouts, reconnect backoff, tx depth, rate limit, rail
//!   pauses) and the
//!   [`StreamConfig`](crate::engine::StreamConfig) it becomes on a channel;
//! - [`runner`]: [`DataPath`], [`RailSpec`], [`DpEvent`], [`DataPathError`];
//! - [`keys`]: [`RailKeys`], the keys of rails past the first (rail 0's
//!   keys → each rail's), which their key maps read;
//! - [`lend`]: [`LendingPath`](lend::LendingPath), the one lender: a data
//!   path whose windows' bytes (a session's staging blocks, ranges leased
//!   from services' buffers) it holds until their ends, on every rail;
//! - [`bucket`]: [`TokenBucket`], the rate limit the posting thread
//!   consults before each chain ([`RateLimit`]);
//! - [`completion`]: the completion thread's loop;
//! - [`cpus`]: CPU pinning, the CPUs allowed (on a NUMA node), [`AvoidCpu`];
//! - [`port`]: [`PortMonitor`], port state the reconnect waits on;
//! - [`stats`]: [`DataPathStats`] (with [`RailStats`] per rail), live
//!   atomics for a metrics exporter, and [`Latencies`];
//! - [`report`]: the [`Report`] a data path returns.

pub mod bucket;
pub mod completion;
pub mod config;
pub mod cpus;
pub mod keys;
pub mod lend;
pub mod port;
pub mod report;
pub mod runner;
pub mod stats;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod lend_tests;
#[cfg(test)]
mod rail_tests;
#[cfg(test)]
mod tests;

pub use bucket::{RateLimit, TokenBucket};
pub use completion::{completion_loop, POLL_BATCH};
pub use config::{Backoff, ConfigError, CqCpu, DataPathConfig, PollMode, QpRetry, RailPause};
pub use cpus::{allowed_cpus, pin_current_thread, AvoidCpu};
pub use keys::RailKeys;
pub use port::PortMonitor;
pub use report::{RailReport, Report};
pub use runner::{
    DataPath, DataPathError, DpEvent, FenceFn, RailReconnectFn, RailSpec, ReconnectError,
    ReconnectFn, POSTER_SPIN,
};
pub use stats::{DataPathStats, Latencies, RailStats};
