//! The control plane: the gRPC protocol (`proto/rcp/v1/rcp.proto`,
//! protocol 2), the rcpd service, the async client library and the jobs
//! `rcp` runs.
//!
//! Layers, each importing only those below it:
//! - [`protocol`]: the Move protocol's cores, no I/O
//!   ([`protocol::ServerCore`], [`protocol::ClientCore`]);
//! - [`server`]: [`server::Service`] (sessions, the Move stream driver,
//!   metadata requests) and its gRPC face;
//! - [`client`]: [`Client`] / [`Session`]: handshake, one data path per
//!   session, [`Session::transfer`] of many files, stat, list, `Copy`;
//! - [`jobs`]: `rcp push/pull` (argument resolution, trees, totals);
//! - [`copy`]: the service API's `Copy` over [`jobs`], plugged into the
//!   server as its [`server::Copier`];
//! - [`buffers`]: services' buffers (the unix socket's service protocol,
//!   operations to peer rcpds), whose grants to peers' sessions are
//!   plugged into the server as its [`server::BufferGrants`];
//! - [`daemon`]: building and serving rcpd (auth, health, reflection,
//!   keepalives, shutdown, metrics);
//! - beside them: [`link`] (provider setup on both ends), [`rails`] (the
//!   rule pairing a session's rails with the peer's), [`fallback`] (who
//!   may fall back to tcp: the rails' watch a data path is given), [`error`] (typed
//!   errors, reasons, exit codes), [`auth`], [`tls`], [`fsutil`],
//!   [`copy_peers`] (the rcpds this one may dial with its credentials).

pub mod auth;
pub mod buffers;
pub mod client;
pub mod copy;
pub mod copy_peers;
pub mod daemon;
pub mod error;
pub mod fallback;
pub mod fanout;
pub mod fsutil;
pub mod interrupt;
pub mod jobs;
pub mod link;
pub mod protocol;
pub mod rails;
pub mod server;
pub mod tls;

/// Control's callers name it `control::in_place`; it lives in the crate's
/// `blocking` module, below the data path, which calls it too.
pub(crate) use crate::blocking::in_place;
pub use client::{Client, ClientOptions, FileResult, Session};
pub use error::{exit, ControlError};
pub use link::Transport;
pub use tls::{ClientTls, ServerTls};

/// Raise this process's open-file limit to its hard limit: a session keeps
/// a file descriptor per file in flight, rcpd one per file of every
/// session. Returns the soft limit now in force.
pub fn raise_open_file_limit() -> u64 {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => hard,
            Err(e) => {
                tracing::warn!(error = %e, soft, hard, "cannot raise the open-file limit");
                soft
            }
        },
        Ok((soft, _)) => soft,
        Err(_) => 1024,
    }
}

/// Where a process's copy threads go, from the NUMA node of `device` (or of
/// the first device): the block-hashing pool sized to the node's CPUs, and
/// the CPU of a data path's completion thread, from `cq_cpu` when given or
/// else the default for copies (a dedicated core when the node has the
/// CPUs for one). Both are logged. Call once, before the first copy.
pub fn place_copy_threads(
    device: Option<&str>,
    cq_cpu: Option<crate::datapath::CqCpu>,
) -> Option<usize> {
    let device = device
        .map(str::to_owned)
        .or_else(|| crate::verbs::device_names().into_iter().next());
    let node = device
        .as_deref()
        .and_then(crate::mem::numa::device_numa_node);
    let cpus = crate::datapath::cpus::node_cpus_allowed(node).len();
    if crate::files::set_pool_threads(cpus).is_ok() {
        tracing::info!(
            threads = cpus,
            ?node,
            "block hashing pool sized to the device's NUMA node"
        );
    }
    let (cq, why) = match cq_cpu {
        Some(x) => (x, format!("completion thread: --cq-cpu {x}")),
        None => crate::datapath::CqCpu::default_for_copies(node),
    };
    let cpu = cq.for_thread(node, 0);
    tracing::info!(cpu, "{why}");
    cpu
}

/// Protocol version spoken. 2.1: rails. 2.2: `REASON_PROTOCOL` for
/// messages outside the protocol, the retry bound in the handshake's
/// answer, numbered frames. 2.3: `Digests` (skip by content, `--delta`),
/// `OpenFile.keep_blocks`, and the tree calls of `-a`/`--delete`
/// (`MakeLink`, `Remove`), `REASON_INTERRUPTED` and
/// `BufferDoneRequest.round`; an older peer answers them UNIMPLEMENTED or
/// ignores the new fields. 2.4: fan-out (`OpenFile.fanout`,
/// `CopyRequest.follow`/`fanout`/`bwlimit`, `CopyProgress.nodes`,
/// `REASON_FANOUT_INCOMPLETE`). 2.5: standing grants
/// (`BufferGrantRequest.standing_ok`, `BufferGrantResponse.standing`,
/// `BufferNotify`). 2.9: `MakeDirRequest.replace_link` (a symlink where a
/// copied tree has a directory is replaced, not followed), `Stat` of a
/// path ending in `/` follows a final symlink and says a link's target;
/// an older rcpd ignores the field and reports the link. 2.11: `MakeDirs`
/// (a tree's directories in one call; an older rcpd answers UNIMPLEMENTED
/// and they are made one call each). 2.12: `OpenFile.absent` (a pushed
/// tree's file whose name the quick check found free is opened without
/// looking again; an older rcpd ignores it).
pub const VERSION_MAJOR: u32 = 2;
pub const VERSION_MINOR: u32 = 12;
/// Default gRPC port of rcpd.
pub const DEFAULT_PORT: u16 = 7471;
/// Default block size: the one of [`crate::files`].
pub use crate::files::DEFAULT_BLOCK_SIZE;
/// Files one session may have open at once: rcpd's `--max-open-files` when
/// not given, and rcp's `--transfers`, which asks for as many. A file holds
/// its place from its open until its commit, so this is also how deep a
/// tree of small files is pipelined: 1024 files of 16 KiB fill 4 of the 8
/// windows (256 filled one, and a copy went window by window; measured in
/// docs/benchmarks.md). rcpd's descriptors for it: `--max-transfers` (16)
/// x 1024 + 256, under the usual hard limit (rcpd raises its soft limit to
/// the hard one, and warns where they do not fit).
pub const DEFAULT_MAX_OPEN_FILES: u32 = 1024;
/// gRPC message size limit, both ways.
pub const MAX_MESSAGE: usize = 4 << 20;
/// Window size of rcpd's arena slots (also the largest block size).
pub const WINDOW_SIZE: usize = 4 << 20;
