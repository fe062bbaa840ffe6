//! Fan-out (docs/fanout.md): one source's files to a chain of rcpds at
//! the cost of about one copy. The source pushes to node 0; each node
//! forwards the files to the next as their blocks are verified there
//! ([`follow`], a Copy of this rcpd reading what it receives); every node
//! commits only what it verified. [`Chain`] decides who sends to whom and
//! routes around a node that fails; [`run`] drives it.

/// Staging windows of a fan-out's sessions (source and forwarding
/// nodes). A node forwards a block once the window that brought it landed
/// whole and was verified; the windows in flight on a link fill side by
/// side and land together, so each hop lags the one before by about
/// (windows × window size) / link rate: with the default 8 windows of 4
/// MiB, 0.64 s a hop at 400 Mbit/s, with 2 windows 0.16 s
/// (docs/fanout.md).
pub const WINDOWS: u32 = 2;

pub mod chain;
pub mod follow;
mod run;

pub use chain::{Chain, NodeState, Sender};
pub use run::{
    count_files, incomplete, new_id, results, run, summary, Fanout, Sending, SourceSend,
};
