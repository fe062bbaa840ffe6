//! Data movement of one transfer: the single place the control plane hands
//! blocks to the data path ([`crate::datapath`]'s runner: batched posting,
//! the completion thread, error-batch flush and reconnect with backoff).

use std::time::Duration;

pub use crate::datapath::legacy::BlockIo;
use crate::datapath::legacy::{DataPath, DataPathError, ReconnectError};
use crate::datapath::{DataPathConfig, PollMode};
use crate::engine::Transfer;
use crate::provider::{Channel, ProviderKind};

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct Moved {
    pub bytes: u64,
    pub seconds: f64,
    pub posted: u64,
    pub reconnects: u64,
    /// The data path's full report (latency samples, reconnect times, ...).
    pub report: crate::datapath::Report,
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    #[error("{0}")]
    Failed(String),
    #[error("block I/O at file offset {file_offset}: {source}")]
    Io {
        file_offset: u64,
        source: std::io::Error,
    },
}

/// The data-path settings a client uses on `kind`.
pub fn datapath_config(
    kind: ProviderKind,
    batch: usize,
    signal_every: usize,
    inline: Option<u32>,
    poll_mode: Option<PollMode>,
    cq_cpu: Option<usize>,
) -> DataPathConfig {
    let batch = batch.clamp(1, 64);
    DataPathConfig {
        batch,
        signal_every: signal_every.clamp(1, batch),
        max_inline: inline,
        // Busy polling costs a core per transfer; the default sleeps when
        // idle (the TCP provider's completions are condvar-driven anyway).
        poll_mode: poll_mode.unwrap_or(match kind {
            ProviderKind::Verbs => PollMode::Hybrid { empty_polls: 1024 },
            ProviderKind::Tcp => PollMode::Event,
        }),
        cq_cpu,
        // A request is timed from before its block is read and hashed;
        // RC transport retries surface a dead peer long before this.
        request_timeout: Duration::from_secs(300),
        ..DataPathConfig::default()
    }
}

/// Run `transfer` to completion over `channel`.
pub fn run(
    dp: &DataPath,
    channel: &dyn Channel,
    transfer: &mut Transfer,
    io: &mut dyn BlockIo,
    reconnect: &mut dyn FnMut() -> Result<(), ReconnectError>,
) -> Result<Moved, MoveError> {
    match dp.run(channel, transfer, io, reconnect) {
        Ok(r) => Ok(Moved {
            bytes: r.bytes,
            seconds: r.seconds,
            posted: r.posted,
            reconnects: r.reconnects,
            report: r,
        }),
        Err(DataPathError::Io {
            file_offset,
            source,
        }) => Err(MoveError::Io {
            file_offset,
            source,
        }),
        Err(e) => Err(MoveError::Failed(e.to_string())),
    }
}
