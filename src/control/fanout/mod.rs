//! Fan-out (docs/fanout.md): one source's files to a chain of rcpds at
//! the cost of about one copy. The source pushes to node 0; each node
//! forwards the files to the next as their blocks are verified there
//! ([`follow`], a Copy of this rcpd reading what it receives); every node
//! commits only what it verified. [`Chain`] decides who sends to whom and
//! routes around a node that fails; [`run`] drives it.

/// Staging windows of a fan-out's sessions (source and forwarding
/// nodes). A node forwards a block once the window that brought it landed
/// whole and was verified, so each hop lags the one before by about a
/// window's time on the link; fewer windows in flight keep the chain
/// tighter (on the emulated cluster of docs/fanout.md, 4 nodes: 1.09 × one
/// copy with 2, 1.13 × with a plain copy's 8), one would stop and wait at
/// every window.
pub const WINDOWS: u32 = 2;

pub mod chain;
pub mod follow;
mod run;

pub use chain::{Chain, NodeState, Sender};
pub use run::{
    count_files, incomplete, new_id, results, run, summary, Fanout, Sending, SourceSend,
};
