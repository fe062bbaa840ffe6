//! The data path runtime: drives the engine over a provider
//! [`Channel`](crate::provider::Channel).
//!
//! # Where to start
//!
//! [`DataPath`] is the session-long data path: [`DataPath::start`] takes a
//! [`DataPathConfig`], an `Arc<dyn Channel>`, the reconnect callback and an
//! optional [`PortMonitor`], and starts two threads that live until
//! [`DataPath::close`] (or drop):
//! - the posting thread owns an [`engine::Stream`](crate::engine::Stream),
//!   takes windows ([`WindowJob`](crate::engine::WindowJob)s) from
//!   [`DataPath::submit`] (an `unsafe fn`: the caller lends the window's
//!   staging memory to the device until its [`DpEvent::WindowDone`]) and
//!   completion batches from one input queue,
//!   posts one chain per doorbell, runs the error path (flush, wait for the
//!   port, reconnect with backoff, repost only the unconfirmed) and
//!   publishes the engine's counters into [`DataPathStats`];
//! - the completion thread, pinned per `cq_cpu`, polls the channel in
//!   batches ([`completion_loop`]: poll, event or hybrid) and hands them to
//!   the posting thread, which keeps off its CPU while it spins.
//!
//! Events come out of [`DataPath::take_events`] as a tokio unbounded
//! channel of [`DpEvent`] (`WindowDone`, `Reconnected`, `Failed`); `close`
//! returns the [`Report`] (`rcp bench`'s figures).
//!
//! The data path does no file I/O and knows no file: the caller fills a
//! WRITE window's staging region before `submit` and reads a READ window's
//! after `WindowDone`.
//!
//! # Modules
//!
//! - [`config`]: [`DataPathConfig`] (batch, signaling, inline, poll mode,
//!   CQ CPU, timeouts, reconnect backoff, tx depth, rate limit) and the
//!   [`StreamConfig`](crate::engine::StreamConfig) it becomes on a channel;
//! - [`runner`]: [`DataPath`], [`DpEvent`], [`DataPathError`];
//! - [`bucket`]: [`TokenBucket`], the rate limit the posting thread
//!   consults before each chain ([`RateLimit`]);
//! - [`completion`]: the completion thread's loop, CPU pinning, [`AvoidCpu`];
//! - [`port`]: [`PortMonitor`], port state the reconnect waits on;
//! - [`stats`]: [`DataPathStats`], live atomics for a metrics exporter, and
//!   [`Latencies`];
//! - [`report`]: the [`Report`] a data path returns.

pub mod bucket;
pub mod completion;
pub mod config;
pub mod port;
pub mod report;
pub mod runner;
pub mod stats;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod rail_tests;
#[cfg(test)]
mod tests;

pub use bucket::{RateLimit, TokenBucket};
pub use completion::{allowed_cpus, completion_loop, pin_current_thread, AvoidCpu, POLL_BATCH};
pub use config::{Backoff, ConfigError, CqCpu, DataPathConfig, PollMode, QpRetry, RailPause};
pub use port::PortMonitor;
pub use report::{RailReport, Report};
pub use runner::{
    DataPath, DataPathError, DpEvent, FenceFn, RailReconnectFn, RailSpec, ReconnectError,
    ReconnectFn, POSTER_SPIN,
};
pub use stats::{DataPathStats, Latencies, RailStats};
