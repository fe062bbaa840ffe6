//! The data-movement engine: deterministic state, no I/O.
//!
//! Everything here is plain data and functions (the quinn-proto way): which
//! extents (blocks) to post next, which requests a signaled completion retires, how many
//! send-queue credits are free, which `wr_id` maps to which block, what an
//! error batch leaves unconfirmed and must be posted again after a reconnect.
//! No threads, no clocks (time is passed in as nanoseconds), no `unsafe`. The
//! data path (`crate::datapath`) drives it over a provider.
//!
//! # Where to start
//!
//! * [`Stream`] is what the session-long data path drives: build it from a
//!   [`StreamConfig`], queue [`WindowJob`]s (a region of the peer's arena
//!   and a staging region of the same layout, with a list of [`Extent`]s),
//!   post the [`stream::Batch`]es from [`Stream::poll_transmit_into`], feed
//!   completions to [`Stream::on_completions`], act on [`stream::Event`]s
//!   (`WindowDone`, `ErrorBatch`, ...) and call [`Stream::reconnected`]
//!   after an error batch asks for it. Its [`stream::Counters`] are the one
//!   count of what was posted and confirmed. Its module docs spell out the
//!   protocol. The stream types that share a name with a `Transfer` type
//!   (`Batch`, `Event`, `State`, `Counters`, ...) live at `engine::stream::`.
//! * [`Transfer`] moves one file (a [`BlockPlan`] of uniform blocks) for the
//!   legacy runner (`datapath::legacy`); it goes when the control plane
//!   moves to [`Stream`]. Build it from a
//!   [`TransferConfig`] and the local staging buffers, feed it [`Window`]
//!   grants, post the [`Batch`]es from [`Transfer::poll_transmit`], feed
//!   completions to [`Transfer::on_completion`], act on [`Event`]s from
//!   [`Transfer::poll_event`], and call [`Transfer::reconnected`] after an
//!   error batch asks for it. Its module docs spell out the protocol.
//! * [`wr`] holds the words shared with providers: [`WorkRequest`],
//!   [`WorkCompletion`], [`WcStatus`].
//!
//! The other modules are the parts `Stream` and `Transfer` are built from, each usable and
//! tested alone: [`batch`] (chain length, selective signaling), [`credits`]
//! (send-queue back-pressure), [`slots`] (`wr_id` → context, stale
//! detection, timeouts), [`inflight`] (the RC retirement rule), [`blocks`]
//! (block plan and per-block state), [`window`] (remote windows and their
//! validation).

#![warn(missing_docs)]

pub mod batch;
pub mod blocks;
pub mod credits;
pub mod inflight;
pub mod slots;
pub mod stream;
pub mod transfer;
pub mod window;
// Shared with the providers; its field docs live on the types.
#[allow(missing_docs)]
pub mod wr;

pub use batch::{BatchPolicy, BatchPolicyError};
pub use blocks::{BlockPlan, BlockSizeError, BlockSpan, BlockState};
pub use stream::{Extent, Stream, StreamConfig, StreamError, WindowJob};
pub use transfer::{
    Batch, ConfigError, Counters, ErrorCause, Event, Recovery, State, Transfer, TransferConfig,
    TransferError,
};
pub use window::{Window, WindowError};
pub use wr::{
    ErrorCounts, LocalSeg, OpKind, RemoteSeg, WcStatus, WorkCompletion, WorkRequest, ERROR_STATUSES,
};
