//! What the data path tells its owner ([`DpEvent`]) and why it could not
//! start, refused a window or stopped ([`DataPathError`]).

use std::time::Duration;

use crate::datapath::config::ConfigError;
use crate::engine::stream::{ErrorCause, WindowError};
use crate::engine::WcStatus;
use crate::provider::ProviderError;

#[cfg(doc)]
use super::DataPath;

/// Why the caller's reconnect callback could not bring its connection
/// back, and whether trying again may: a permanent error ends the
/// reconnect at once (the runner gives up on the first), a retryable one
/// is retried with backoff up to the attempts of the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ReconnectError {
    /// Another attempt would fail the same way (the tcp provider, whose
    /// connections cannot be replaced; a session the peer forgot).
    #[error("{0} (cannot succeed: not retried)")]
    Permanent(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Another attempt may succeed (the peer not reachable yet, a reset
    /// that failed).
    #[error("{0}")]
    Retryable(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl ReconnectError {
    pub fn permanent(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> ReconnectError {
        ReconnectError::Permanent(e.into())
    }

    pub fn retryable(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> ReconnectError {
        ReconnectError::Retryable(e.into())
    }

    pub fn is_permanent(&self) -> bool {
        matches!(self, ReconnectError::Permanent(_))
    }
}

/// Why the data path could not start, refused a window, or stopped.
#[derive(Debug, thiserror::Error)]
pub enum DataPathError {
    #[error("data path configuration: {0}")]
    Config(#[from] ConfigError),
    #[error("data path failed: {reason} (status {}, window {}, extent {})",
        .status.map_or("none", |s| s.label()),
        .window.map_or("none".to_string(), |w| w.to_string()),
        .extent.map_or("none".to_string(), |e| e.to_string()))]
    Failed {
        status: Option<WcStatus>,
        window: Option<u64>,
        extent: Option<u32>,
        reason: &'static str,
    },
    #[error("reconnect failed after {attempts} attempt(s): {source}")]
    Reconnect {
        attempts: u32,
        source: ReconnectError,
    },
    #[error("completion thread: {0}")]
    Completion(#[source] ProviderError),
    #[error("the completion thread panicked")]
    CompletionPanicked,
    #[error("window {id} refused: {source}")]
    Window { id: u64, source: WindowError },
    #[error("the data path has stopped (failed or closed)")]
    Stopped,
    #[error("starting a data-path thread: {0}")]
    Spawn(#[source] std::io::Error),
}

impl DataPathError {
    /// Whether a new session may succeed where this one failed (the
    /// connection went away) as opposed to a failure a retry would repeat
    /// (a remote access error, a bad window).
    pub fn is_retryable(&self) -> bool {
        match self {
            DataPathError::Failed { status, .. } => status.is_none_or(|s| s.is_retryable()),
            DataPathError::Reconnect { .. }
            | DataPathError::Completion(_)
            | DataPathError::Stopped => true,
            _ => false,
        }
    }
}

/// What the data path tells its owner, in order.
#[derive(Debug)]
pub enum DpEvent {
    /// Every extent of the window is confirmed and no device can touch its
    /// staging any more: its staging region is the caller's again (read it
    /// after a READ), its id free.
    WindowDone { id: u64 },
    /// One rail: the connection was replaced after an error batch;
    /// `seconds` from the error to the new epoch.
    Reconnected { epoch: u32, seconds: f64 },
    /// Several rails: rail `rail` failed in `epoch` and posts no more; its
    /// helper reconnects it in the background.
    RailDown {
        rail: usize,
        epoch: u32,
        cause: ErrorCause,
    },
    /// Several rails: the failed rail's outstanding extents are being posted
    /// on the other rails; `windows` had requests on it. The caller fences
    /// their remote regions before reusing them (module docs).
    RailFenced { rail: usize, windows: Vec<u64> },
    /// Several rails: the rail failed again soon after its last failure (or
    /// could not be reconnected); it rejoins no sooner than `for_` from now.
    RailPaused { rail: usize, for_: Duration },
    /// Several rails: the rail was reconnected and carries chains again.
    RailUp { rail: usize },
    /// Terminal: the data path posts no more, and every window not done is
    /// lost (redo it on a new session). Memory of those windows is the
    /// caller's again once [`DataPath::close`] has returned and the
    /// channels have been reset or dropped (see [`DataPath::submit`]).
    Failed(DataPathError),
}
