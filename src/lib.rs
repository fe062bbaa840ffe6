//! rcp: bulk transfer over RDMA.
//!
//! Where to start:
//! - [`verbs`]: safe types over libibverbs ([`verbs::Context`], [`verbs::QueuePair`], ...;
//!   [`verbs::messages::Messenger`]: requests and answers as SENDs on a QP of their own).
//! - [`mem`]: the hugepage arena that is registered once and carved into blocks.
//! - [`engine`]: the data-movement state machine, plain data, no I/O:
//!   [`engine::Stream`] moves a session's windows ([`engine::WindowJob`]: a staging
//!   region, the peer's region, the extents between them).
//! - [`datapath`]: [`datapath::DataPath`], the session-long runtime that drives a
//!   `Stream` over a channel (posting thread, pinned completion thread, reconnect):
//!   `unsafe` [`submit`](datapath::DataPath::submit) a window, wait for its
//!   [`datapath::DpEvent::WindowDone`], `close` for the [`datapath::Report`].
//!   Sessions lend it their windows' bytes through
//!   [`datapath::lend::LendingPath`] (a staging block or a service's leased
//!   range, [`datapath::lend::Loan`]), which discharges that contract once.
//! - [`provider`]: the `Domain`/`Channel` interface the data path runs on (verbs or tcp).
//! - [`bench`](mod@bench): `rcp bench`, the perftest-like benchmark of the data path (loopback, server, client).
//! - [`files`]: files beneath a root, atomic destinations sealed and published in
//!   batches, block digests and the derived file digest.
//! - [`control`]: the gRPC control plane: the Move protocol's I/O-free cores
//!   ([`control::protocol::ServerCore`], [`control::protocol::ClientCore`]), rcpd's
//!   [`control::server::Service`], the client library ([`control::Client`],
//!   [`control::Session`]: one data path per session, many files in flight), and
//!   `rcp`'s jobs ([`control::jobs`]).
//! - Buffers from services ([`control::buffers`], docs/buffers.md): a service's
//!   memfd ([`mem::memfd::ServiceBuffer`], leased by range) exposed by name
//!   ([`control::buffers::Exposure`]) and moved between two rcpds; the service
//!   protocol's messages ([`control::buffers::api::Request`],
//!   [`control::buffers::api::Event`]) and its Rust client
//!   ([`control::buffers::client::ServiceClient`]); the rounds of an operation
//!   as I/O-free cores ([`control::protocol::buffer::GrantCore`] on the exposing
//!   rcpd, [`control::protocol::buffer::OpCore`] on the initiating one), driven
//!   by `buffers::grant` and `buffers::peer`, whose windows go through the
//!   session's [`datapath::lend::LendingPath`]; tcp fallback by [`control::fallback`].
//! - [`metrics`], [`doctor`]: Prometheus counters, `rcp doctor`'s checks.
//! - [`parse`]: `HOST[:PORT]`, sizes, rates and durations, parsed once for every binary.
//! - [`json`]: the `--json` lines (schema in `docs/json.md`).
//! - [`escape`]: strings from outside (client names, paths, reasons) as they go into a log line.

pub mod bench;
mod blocking;
pub mod control;
pub mod datapath;
pub mod doctor;
pub mod engine;
pub mod escape;
#[cfg(feature = "fault-injection")]
pub mod faults;
pub mod files;
pub mod json;
pub mod mem;
pub mod metrics;
pub mod parse;
pub mod phase;
pub mod provider;
pub mod units;
pub mod verbs;

pub mod proto {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("rcp.v1");

    impl Direction {
        /// `push` or `pull` (`unspecified`): the direction as metrics
        /// labels, JSON lines and messages name it.
        pub fn label(self) -> &'static str {
            match self {
                Direction::Push => "push",
                Direction::Pull => "pull",
                Direction::Unspecified => "unspecified",
            }
        }
    }

    /// The encoded file descriptor set (for server reflection).
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("rcp_descriptor");
}
