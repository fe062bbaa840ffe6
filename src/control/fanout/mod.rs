//! Fan-out (docs/fanout.md): one source's files to a chain of rcpds at
//! the cost of about one copy. The source pushes to node 0; each node
//! forwards the files to the next as their blocks are verified there
//! ([`follow`], a Copy of this rcpd reading what it receives); every node
//! commits only what it verified. [`Chain`] decides who sends to whom and
//! routes around a node that fails; [`run`] drives it.

pub mod chain;
pub mod follow;
mod run;

pub use chain::{Chain, NodeState, Sender};
pub use run::{
    count_files, incomplete, new_id, results, run, summary, Fanout, Sending, SourceSend,
};
