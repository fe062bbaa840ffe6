//! What the reconnect path knows about the local port: with a monitor
//! (the verbs [`PortWatcher`](crate::verbs::PortWatcher), fed by the
//! device's async events) a reconnect waits for `PORT_ACTIVE` while the port
//! is down and retries the moment it comes back, instead of sleeping its
//! backoff blind.

use std::time::{Duration, Instant};

/// The state of the port a channel runs on.
pub trait PortMonitor: Send + Sync {
    /// Whether the port is usable now.
    fn is_active(&self) -> bool;
    /// Block until the port is usable or `timeout` passes; true if usable.
    fn wait_active(&self, timeout: Duration) -> bool;
    /// Async events seen so far (all kinds), for the report.
    fn events_seen(&self) -> u64;
    /// When the monitor last saw the port come up (`PORT_ACTIVE`), if it
    /// has; the report times link-up → first completed request from it.
    fn active_since(&self) -> Option<Instant> {
        None
    }
}

impl PortMonitor for crate::verbs::PortWatcher {
    fn is_active(&self) -> bool {
        crate::verbs::PortWatcher::is_active(self)
    }
    fn wait_active(&self, timeout: Duration) -> bool {
        crate::verbs::PortWatcher::wait_active(self, timeout)
    }
    fn events_seen(&self) -> u64 {
        crate::verbs::PortWatcher::events_seen(self)
    }
    fn active_since(&self) -> Option<Instant> {
        crate::verbs::PortWatcher::active_since(self)
    }
}
