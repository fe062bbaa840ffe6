//! The control plane: the gRPC protocol (`proto/rcp/v1/rcp.proto`), the
//! rcpd service, the async client library and the CLI's copy logic.
//!
//! - [`server`]: [`server::Service`] (sessions, window grants from the
//!   arena, per-window verification, commit) and its gRPC face;
//! - [`client`]: [`Client`] / [`Session`]: handshake, push and pull of one
//!   file, stat, list, the service API's `Copy`;
//! - [`daemon`]: building and serving rcpd (auth, health, reflection,
//!   shutdown, metrics);
//! - [`cli`]: `rcp push/pull` (argument resolution, recursion, summaries);
//! - [`link`]: provider setup on both ends;
//! - [`movement`]: the one function that moves a transfer's blocks;
//! - [`fsutil`]: confinement, temp file + manifest, digests.

pub mod auth;
#[cfg(any())]
pub mod cli;
#[cfg(any())]
pub mod client;
#[cfg(any())]
pub mod copy;
#[cfg(any())]
pub mod daemon;
pub mod error;
pub mod fsutil;
pub mod link;
#[cfg(any())]
pub mod movement;
pub mod protocol;
#[cfg(any())]
pub mod server;
pub mod tls;

use std::sync::atomic::AtomicU64;

#[cfg(any())]
pub use client::{Client, ClientOptions, FileResult, Session};
pub use error::{exit, ControlError};
pub use link::Transport;
pub use tls::{ClientTls, ServerTls};

/// Protocol version spoken.
pub const VERSION_MAJOR: u32 = 1;
pub const VERSION_MINOR: u32 = 1;
/// The first minor version whose tcp data connections carry the session
/// key (1.1): a tcp session between an older and a newer end is refused at
/// the handshake, by name, instead of failing later with access errors.
pub const TCP_SESSION_KEY_MINOR: u32 = 1;
/// Default gRPC port of rcpd.
pub const DEFAULT_PORT: u16 = 7471;
/// Default block size.
pub const DEFAULT_BLOCK_SIZE: u64 = 1 << 20;
/// Largest file accepted (16 TiB).
pub const MAX_FILE_LEN: u64 = 16 << 40;
/// gRPC message size limit, both ways.
pub const MAX_MESSAGE: usize = 4 << 20;
/// Window size of rcpd's arena slots (also the largest block size).
pub const WINDOW_SIZE: usize = 4 << 20;

/// Live counters of a server (exported on `/metrics`).
#[derive(Debug, Default)]
pub struct Stats {
    pub active: AtomicU64,
    pub transfers_ok: AtomicU64,
    pub transfers_failed: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub integrity_failures: AtomicU64,
    pub auth_failures: AtomicU64,
}
