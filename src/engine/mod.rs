//! The transfer engine: deterministic state, no I/O.
//!
//! Everything here is plain data and functions (the quinn-proto way): which
//! blocks to post next, which requests a signaled completion retires, how many
//! send-queue credits are free, which `wr_id` maps to which block, what an
//! error batch leaves unconfirmed and must be posted again after a reconnect.
//! The data path (`crate::datapath`) drives it over a provider.

pub mod batch;
pub mod blocks;
pub mod credits;
pub mod inflight;
pub mod slots;
pub mod window;
pub mod wr;

pub use wr::{LocalSeg, OpKind, RemoteSeg, WcStatus, WorkCompletion, WorkRequest};
