//! rcp: bulk transfer over RDMA.
//!
//! Where to start:
//! - [`verbs`]: safe types over libibverbs ([`verbs::Context`], [`verbs::QueuePair`], ...).
//! - [`mem`]: the hugepage arena that is registered once and carved into blocks.
//! - [`engine`]: the data-movement state machines, plain data, no I/O:
//!   [`engine::Stream`] (a session's windows) and the per-file [`engine::Transfer`].
//! - [`datapath`]: [`datapath::DataPath`], the session-long runtime that drives a
//!   `Stream` over a channel (posting thread, pinned completion thread, reconnect).
//! - [`provider`]: the `Domain`/`Channel` interface the data path runs on (verbs or tcp).
//! - [`bench`]: `rcp bench`, the perftest-like benchmark of the data path (loopback, server, client).
//! - [`control`]: the gRPC control plane, rcpd's service, the client library and `rcp`'s logic.

pub mod bench;
pub mod control;
pub mod datapath;
pub mod doctor;
pub mod engine;
pub mod files;
pub mod mem;
pub mod metrics;
pub mod parse;
pub mod provider;
pub mod verbs;

pub mod proto {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("rcp.v1");

    /// The encoded file descriptor set (for server reflection).
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("rcp_descriptor");
}
