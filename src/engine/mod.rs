//! The data-movement engine: deterministic state, no I/O.
//!
//! Everything here is plain data and functions (the quinn-proto way): which
//! extents to post next, which requests a signaled completion retires, how
//! many send-queue credits are free, which `wr_id` maps to which extent,
//! what an error batch leaves unconfirmed and must be posted again after a
//! reconnect. No threads, no clocks (time is passed in as nanoseconds), no
//! `unsafe`. The data path (`crate::datapath::DataPath`) drives it over a
//! provider.
//!
//! # Where to start
//!
//! * [`Stream`] is the one engine, what the session-long data path drives:
//!   build it from a [`StreamConfig`], queue [`WindowJob`]s (a region of the
//!   peer's arena and a staging region of the same layout, with a list of
//!   [`Extent`]s), post the [`stream::Batch`]es from
//!   [`Stream::poll_transmit`] on the rail it names, feed each rail's
//!   completions to [`Stream::on_completions`], act on the events of
//!   [`Stream::poll_event`] (`WindowDone`, `ErrorBatch`, ...) and call
//!   [`Stream::rail_reconnected`] after an error batch asks for it. Its [`stream::Counters`] are the one count of what
//!   was posted and confirmed. Its module docs spell out the protocol; its
//!   other types (`Batch`, `Event`, `State`, `Counters`, ...) live at
//!   `engine::stream::`.
//! * Several queue pairs (*rails*, one per RDMA port): build the stream with
//!   [`Stream::with_rails`]; [`stream::rail`] is the rail model (chains go to
//!   the rail with the most free credits; a failed rail is fenced and its
//!   extents posted on the others at once; the `wr_id`/epoch scheme that
//!   keeps a fenced rail's late completions from confirming anything;
//!   pauses; the fencing contract with the caller).
//! * [`wr`] holds the words shared with providers: [`WorkRequest`],
//!   [`WorkCompletion`], [`WcStatus`].
//!
//! The other modules are the parts `Stream` is built from, each usable and
//! tested alone: [`batch`] (chain length, selective signaling), [`credits`]
//! (send-queue back-pressure), [`slots`] (`wr_id` → context, stale
//! detection, timeouts), [`inflight`] (the RC retirement rule).

#![warn(missing_docs)]

pub mod batch;
pub mod credits;
pub mod inflight;
pub mod slots;
pub mod stream;
// Shared with the providers; its field docs live on the types.
#[allow(missing_docs)]
pub mod wr;

pub use batch::{BatchPolicy, BatchPolicyError};
pub use stream::{Extent, Stream, StreamConfig, StreamError, WindowJob};
pub use wr::{
    ErrorCounts, LocalSeg, OpKind, RemoteSeg, WcStatus, WorkCompletion, WorkRequest, ERROR_STATUSES,
};
