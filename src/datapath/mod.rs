//! The data path runtime: drives the engine ([`crate::engine::Transfer`])
//! over a provider [`Channel`](crate::provider::Channel).
//!
//! - [`config`]: [`DataPathConfig`] (batch, signaling, inline, poll mode,
//!   CQ CPU, timeouts, reconnect backoff) with `RCP_*` overrides;
//! - [`completion`]: the completion thread's loop (poll / event / hybrid);
//! - [`runner`]: [`DataPath::run`] / [`run_transfer`]: posting loop, error
//!   batch, reconnect, [`Report`];
//! - [`io`]: [`BlockIo`], how the runner reaches file data and windows;
//! - [`port`]: [`PortMonitor`], port state the reconnect waits on;
//! - [`stats`]: [`DataPathStats`], live atomics for a metrics exporter.

pub mod completion;
pub mod config;
pub mod io;
pub mod port;
pub mod runner;
pub mod stats;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;

pub use completion::{allowed_cpus, completion_loop, pin_current_thread, AvoidCpu, POLL_BATCH};
pub use config::{Backoff, ConfigError, CqCpu, DataPathConfig, PollMode, QpRetry};
pub use io::{BlockIo, MemoryIo, NullIo, Staging};
pub use port::PortMonitor;
pub use runner::{run_transfer, DataPath, DataPathError, ReconnectError, Report};
pub use stats::{DataPathStats, Latencies};
