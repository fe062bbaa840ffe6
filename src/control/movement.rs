//! Data movement of one transfer: the single place the control plane hands
//! blocks to the data path.
//!
//! Interim runner with the same shape as `crate::datapath::run_transfer`
//! (same [`BlockIo`] contract): a plain loop on the calling thread that
//! posts, polls and acts on engine events. It does not reconnect: an error
//! batch fails the transfer (the caller may resume). Replaced by the
//! datapath runner once that lands.

use std::io;
use std::time::{Duration, Instant};

use crate::engine::{
    Event, LocalSeg, OpKind, Recovery, State, Transfer, WcStatus, Window, WorkCompletion,
};
use crate::provider::Channel;

/// What the runner asks of the side that owns the file and the memory (the
/// datapath's `BlockIo`).
pub trait BlockIo {
    fn fill(&mut self, file_offset: u64, local: LocalSeg) -> io::Result<()>;
    fn drain(&mut self, file_offset: u64, local: LocalSeg) -> io::Result<()>;
    fn block_done(&mut self, _block: u64, _file_offset: u64, _len: u32) {}
    fn window_done(&mut self, _window_id: u64) {}
    fn next_window(&mut self) -> Option<Window> {
        None
    }
}

/// What a run did.
#[derive(Clone, Debug, Default)]
pub struct Moved {
    pub bytes: u64,
    pub seconds: f64,
    pub posted: u64,
    pub reconnects: u64,
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    #[error("transfer failed: {0}")]
    Failed(String),
    #[error("block I/O at file offset {file_offset}: {source}")]
    Io { file_offset: u64, source: io::Error },
    #[error("stalled: no window to post into ({confirmed} of {total} bytes confirmed)")]
    NoWindow { confirmed: u64, total: u64 },
}

/// Run `transfer` to completion over `channel`.
pub fn run(
    channel: &dyn Channel,
    transfer: &mut Transfer,
    io: &mut dyn BlockIo,
) -> Result<Moved, MoveError> {
    let start = Instant::now();
    let mut wcs = vec![
        WorkCompletion {
            wr_id: 0,
            status: WcStatus::Success,
            byte_len: 0,
        };
        64
    ];
    let mut posted = 0u64;
    let mut read_op: Option<bool> = None;
    take_windows(transfer, io)?;
    loop {
        while let Some(ev) = transfer.poll_event() {
            match ev {
                Event::BlockDone {
                    block,
                    local,
                    file_offset,
                    len,
                } => {
                    if read_op == Some(true) {
                        let seg = LocalSeg { len, ..local };
                        io.drain(file_offset, seg).map_err(|source| MoveError::Io {
                            file_offset,
                            source,
                        })?;
                    }
                    io.block_done(block, file_offset, len);
                    transfer
                        .release_buffer(local)
                        .map_err(|e| MoveError::Failed(e.to_string()))?;
                }
                Event::WindowDone { window_id } => {
                    io.window_done(window_id);
                }
                Event::ErrorBatch { cause, action, .. } => {
                    if action == Recovery::Fail || action == Recovery::Reconnect {
                        return Err(MoveError::Failed(format!("{cause:?}")));
                    }
                }
                Event::Timeout { .. } | Event::ReadyToReconnect { .. } => {}
            }
        }
        if transfer.is_complete() {
            break;
        }
        if let State::Failed { reason, status, .. } = transfer.state() {
            return Err(MoveError::Failed(format!("{reason} ({status:?})")));
        }
        take_windows(transfer, io)?;
        let now = start.elapsed().as_nanos() as u64;
        while let Some(batch) = transfer.poll_transmit(now) {
            let is_read = batch.wrs.first().map(|w| w.kind == OpKind::Read);
            if read_op.is_none() {
                read_op = is_read;
            }
            if is_read == Some(false) {
                for (wr, span) in batch.wrs.iter().zip(&batch.blocks) {
                    io.fill(span.file_offset, wr.local)
                        .map_err(|source| MoveError::Io {
                            file_offset: span.file_offset,
                            source,
                        })?;
                }
            }
            posted += batch.wrs.len() as u64;
            if let Err(f) = channel.post(&batch.wrs) {
                let _ = transfer.post_failed(&batch, f.posted);
                return Err(MoveError::Failed(format!("post: {}", f.error)));
            }
        }
        let n = channel
            .poll(&mut wcs)
            .map_err(|e| MoveError::Failed(format!("poll: {e}")))?;
        transfer.on_completions(&wcs[..n]);
        if n == 0 {
            if transfer.outstanding() == 0 && transfer.state() == State::Running {
                if !take_windows(transfer, io)? && !transfer.is_complete() {
                    return Err(MoveError::NoWindow {
                        confirmed: transfer.bytes_confirmed(),
                        total: transfer.plan().len(),
                    });
                }
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        transfer.poll_timeout(start.elapsed().as_nanos() as u64);
    }
    Ok(Moved {
        bytes: transfer.bytes_confirmed(),
        seconds: start.elapsed().as_secs_f64(),
        posted,
        reconnects: 0,
    })
}

fn take_windows(transfer: &mut Transfer, io: &mut dyn BlockIo) -> Result<bool, MoveError> {
    let mut any = false;
    while let Some(w) = io.next_window() {
        transfer
            .add_window(w)
            .map_err(|e| MoveError::Failed(format!("window refused: {e}")))?;
        any = true;
    }
    Ok(any)
}
