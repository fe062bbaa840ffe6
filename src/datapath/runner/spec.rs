//! One rail of a data path ([`RailSpec`]) and the callbacks it is given.

use std::sync::Arc;

use super::ReconnectError;
use crate::datapath::config::CqCpu;
use crate::datapath::port::PortMonitor;
use crate::provider::Channel;

/// The caller's reconnect callback of a one-rail data path: replace the
/// connection after an error batch (verbs: reset the QP, exchange
/// endpoints, handshake). Called on the rail's reconnect helper thread,
/// retried with backoff.
pub type ReconnectFn = Box<dyn FnMut() -> Result<(), ReconnectError> + Send>;

/// A rail's reconnect callback, given the rail's index: replace that rail's
/// connection (verbs: reset its QP, exchange endpoints with the peer's QP of
/// the same rail, handshake). Called on the rail's helper thread while the
/// other rails post, retried with backoff.
pub type RailReconnectFn = Box<dyn FnMut(usize) -> Result<(), ReconnectError> + Send>;

/// A rail's fence callback, given the rail's index: take the failed rail's
/// queue pair out of service at once (verbs: move it to the error state, so
/// its send queue is flushed, or reset it). `Ok` promises that the channel
/// touches no memory of any request posted on it before the call. Called on
/// the rail's helper thread when the rail is fenced, before its reconnect;
/// an error is logged, and the reconnect goes on.
pub type FenceFn =
    Box<dyn FnMut(usize) -> Result<(), Box<dyn std::error::Error + Send + Sync>> + Send>;

/// A key map of a rail: the window's `(lkey, rkey)` (those of rail 0) →
/// this rail's.
pub type KeyMapFn = Box<dyn Fn(u32, u32) -> (u32, u32) + Send>;

/// One rail of a data path: its channel and what the data path needs to
/// run and recover it.
pub struct RailSpec {
    /// The rail's connected channel.
    pub channel: Arc<dyn Channel>,
    /// Replaces the rail's connection.
    pub reconnect: RailReconnectFn,
    /// The rail's port; with several rails its going down fails the rail,
    /// and a reconnect waits for it to come back.
    pub monitor: Option<Arc<dyn PortMonitor>>,
    /// Takes the rail's queue pair out of service when the rail is fenced
    /// (see [`FenceFn`]); without it, the rail's zombie requests (and the
    /// windows they hold) wait for their flushes or the reconnect.
    pub fence: Option<FenceFn>,
    /// Where its completion thread runs: resolved with `numa_node` and the
    /// rail's index ([`CqCpu::for_thread`]); `None`: the configuration's
    /// `cq_cpu`.
    pub cq_cpu: Option<CqCpu>,
    /// The NUMA node of the rail's device (for `cq_cpu: Some(CqCpu::Auto)`).
    pub numa_node: Option<u32>,
    /// The window's `(lkey, rkey)` → this rail's, for rails whose
    /// registrations differ from rail 0's (another device); `None`: the
    /// same keys.
    pub keys: Option<KeyMapFn>,
}

impl RailSpec {
    /// A rail over `channel`, reconnected by `reconnect`, nothing else.
    pub fn new(channel: Arc<dyn Channel>, reconnect: RailReconnectFn) -> Self {
        RailSpec {
            channel,
            reconnect,
            monitor: None,
            fence: None,
            cq_cpu: None,
            numa_node: None,
            keys: None,
        }
    }

    /// With a port monitor.
    pub fn with_monitor(mut self, m: Arc<dyn PortMonitor>) -> Self {
        self.monitor = Some(m);
        self
    }

    /// With a fence callback.
    pub fn with_fence(mut self, f: FenceFn) -> Self {
        self.fence = Some(f);
        self
    }

    /// With a key map.
    pub fn with_keys(mut self, k: KeyMapFn) -> Self {
        self.keys = Some(k);
        self
    }
}

impl std::fmt::Debug for RailSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RailSpec")
            .field("caps", &self.channel.caps())
            .field("monitor", &self.monitor.is_some())
            .field("fence", &self.fence.is_some())
            .field("cq_cpu", &self.cq_cpu)
            .field("keys", &self.keys.is_some())
            .finish_non_exhaustive()
    }
}
