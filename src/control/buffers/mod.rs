//! Buffers from services (docs/buffers.md): memory a local service hands
//! to rcpd over its unix socket (a sealed memfd), exposed under a name and
//! moved by one-sided RDMA (or the tcp provider) between two rcpds, with no
//! staging copy.
//!
//! - [`api`]: the service protocol's messages as types (requests, replies,
//!   events, reason names), one schema for rcpd, the Rust client and the
//!   Python package;
//! - [`socket`]: the unix socket: gRPC and the service protocol on one
//!   path, told apart by a connection's first bytes;
//! - [`wire`]: the service protocol's frames (JSON, fds as SCM_RIGHTS);
//! - [`service`]: one service connection: its buffers, exposures,
//!   operations and events;
//! - [`outbox`]: what is sent to a service, written by its sender when
//!   the socket is idle, else queued for the connection's writer;
//! - [`rpc`]: rcpd's `BufferGrant`, `BufferDone` and `BufferNotify`,
//!   served by [`grant`] or [`standing`];
//! - [`grant`]: the exposing side of an operation (`BufferGrant`,
//!   `BufferDone`): a grant per operation, revoked at its end;
//! - [`standing`]: the exposing side of standing grants (`grant:
//!   standing`): an exposure granted whole to a peer's session once, its
//!   operations told in batches (`BufferNotify`);
//! - [`notices`]: the initiating side's notices of operations under
//!   standing grants, batched per session;
//! - [`sessions`]: sessions to peer rcpds (one per peer and check, kept by
//!   Copy's pool policy), their drivers and the tcp fallback;
//! - [`peer`]: the initiating side of an operation: windows posted
//!   from the service's pages ([`crate::datapath::lend`]);
//! - [`client`]: the Rust client of the service protocol;
//! - [`faults`]: test-only damage of checked ranges (the `fault-injection`
//!   feature).
//!
//! [`Buffers`] is what one rcpd shares between them.

pub mod api;
pub mod client;
pub mod faults;
pub mod frames;
pub mod grant;
pub mod messages;
pub mod notices;
pub mod ops;
pub mod outbox;
pub mod peer;
pub mod rpc;
pub mod service;
pub mod sessions;
pub mod socket;
pub mod standing;
pub mod wire;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use super::client::ClientOptions;
use super::copy_peers::CopyPeers;

use crate::mem::memfd::ServiceBuffer;

/// What a peer may do to an exposed range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rights {
    pub read: bool,
    pub write: bool,
}

impl Rights {
    pub fn parse(s: &str) -> Option<Rights> {
        match s {
            "read" | "r" => Some(Rights {
                read: true,
                write: false,
            }),
            "write" | "w" => Some(Rights {
                read: false,
                write: true,
            }),
            "rw" | "readwrite" | "read,write" => Some(Rights {
                read: true,
                write: true,
            }),
            _ => None,
        }
    }
}

/// A buffer range a service named for the network.
pub struct Exposure {
    /// The service connection that owns it.
    pub owner: u64,
    pub buffer: ServiceBuffer,
    pub offset: u64,
    pub len: u64,
    pub access: Rights,
    /// Empty: any peer rcpd.
    pub peers: Vec<IpAddr>,
    /// Peers get a standing grant (the whole exposure, kept for their
    /// session until the exposure goes) instead of one per operation.
    pub standing: bool,
    /// The owner's events, as frames ready to send.
    pub events: Arc<outbox::Outbox>,
    /// What grants inside the exposure are made into where the memory is
    /// registered once (memory windows: the exposed range in the device's
    /// PD, on the first grant); withdrawn with the exposure.
    pub bases: crate::provider::Bases,
}

/// An error for a service or a peer: a reason and a sentence (the files'
/// [`Failure`]; a service sees it as an [`api::ErrorBody`]).
pub use crate::control::protocol::Failure;

/// What the daemon gives the buffers at birth.
#[derive(Clone)]
pub struct BuffersConfig {
    /// How this rcpd connects to peers (token, TLS, transport, metrics,
    /// ...); its `timeout` is also how long a grant waits for its peer.
    pub client: ClientOptions,
    /// The peers it may connect to (`--copy-peers`; its credentials go to
    /// no other).
    pub peers: Arc<CopyPeers>,
    /// The check a service's operation uses when it names none (the first
    /// of `--verify`; none given: the default check).
    pub default_check: Option<crate::files::Check>,
    /// rcpd's bearer token: a service says it in `hello`.
    pub token: Option<String>,
    /// The address peers dial this rcpd at (`hello`'s `node`; see
    /// [`node_address`]).
    pub node: String,
    /// The pool of sessions to peers rcpd keeps, shared with the Copy API:
    /// its bound counts buffer sessions and Copy's warm ones together
    /// (`--copy-sessions`), and a buffer session unused for its `idle`
    /// (`--copy-session-idle`) is closed. A session over tcp after a
    /// fallback ends so too, and the next operation tries verbs again.
    pub pool: Arc<crate::control::jobs::Pool>,
}

/// What one rcpd shares between its service connections, the grants it
/// made to peers and the sessions it opened to them.
pub struct Buffers {
    next_conn: AtomicU64,
    /// Exposures by name.
    pub(crate) exposures: Mutex<HashMap<String, Arc<Exposure>>>,
    /// Grants made to peers' sessions, by grant id.
    pub(crate) grants: grant::Grants,
    /// Sessions to peer rcpds, by (address, check).
    pub(crate) peers: sessions::Peers,
    cfg: BuffersConfig,
}

/// The address peers dial an rcpd at whose gRPC listener is bound to
/// `grpc`: that address; when it is the unspecified address (`0.0.0.0`,
/// `[::]`), the host's name (`/proc/sys/kernel/hostname`, as
/// gethostname(2)) with the port, since any of the host's addresses
/// reaches it and the name is what a peer resolves.
pub fn node_address(grpc: std::net::SocketAddr) -> String {
    if !grpc.ip().is_unspecified() {
        return grpc.to_string();
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    if host.is_empty() {
        return grpc.to_string();
    }
    format!("{host}:{}", grpc.port())
}

impl Buffers {
    pub fn new(cfg: BuffersConfig) -> Arc<Buffers> {
        Arc::new(Buffers {
            next_conn: AtomicU64::default(),
            exposures: Mutex::default(),
            grants: grant::Grants::default(),
            peers: sessions::Peers::default(),
            cfg,
        })
    }

    pub(crate) fn client_options(&self) -> &ClientOptions {
        &self.cfg.client
    }

    pub(crate) fn copy_peers(&self) -> &CopyPeers {
        &self.cfg.peers
    }

    /// How long a grant waits for its peer: rcpd's timeout.
    pub(crate) fn grant_timeout(&self) -> std::time::Duration {
        self.cfg.client.timeout
    }

    pub(crate) fn pool(&self) -> &Arc<crate::control::jobs::Pool> {
        &self.cfg.pool
    }

    pub(crate) fn token(&self) -> Option<&str> {
        self.cfg.token.as_deref()
    }

    pub(crate) fn node(&self) -> &str {
        &self.cfg.node
    }

    pub(crate) fn default_check(&self) -> crate::files::Check {
        self.cfg.default_check.unwrap_or_default()
    }

    pub(crate) fn new_conn(&self) -> u64 {
        self.next_conn.fetch_add(1, Relaxed) + 1
    }

    /// Session `id` closed (CloseSession, or reaped): revoke what it was
    /// granted, so no key it held reaches the memory any more.
    pub(crate) fn session_closed(&self, id: u64) {
        let revoked = self.grants.revoke_session(id);
        if revoked > 0 {
            tracing::info!(
                session = format_args!("{id:#x}"),
                grants_revoked = revoked,
                "session closed: its buffer grants revoked"
            );
        }
    }

    /// Everything of connection `conn` goes: its exposures are withdrawn
    /// and every grant made on them is revoked (registrations dropped
    /// first, then the leases).
    pub(crate) fn owner_gone(&self, conn: u64) {
        let names: Vec<String> = {
            let mut ex = self.exposures.lock().unwrap();
            let names: Vec<String> = ex
                .iter()
                .filter(|(_, e)| e.owner == conn)
                .map(|(n, _)| n.clone())
                .collect();
            for n in &names {
                ex.remove(n);
            }
            names
        };
        let revoked = self.grants.revoke_owner(conn);
        if !names.is_empty() || revoked > 0 {
            tracing::info!(conn, exposures = ?names.iter().map(crate::escape::esc).collect::<Vec<_>>(), grants_revoked = revoked, "service gone: exposures withdrawn");
        }
    }
}

/// The gRPC port's connections: a grant per operation goes with the one
/// it was asked on.
impl crate::control::server::conns::ConnWatch for Buffers {
    fn opened(&self, conn: crate::control::server::conns::ConnKey) {
        self.grants.conn_opened(conn);
    }

    fn closed(&self, conn: crate::control::server::conns::ConnKey) {
        let revoked = self.grants.conn_closed(conn);
        if revoked > 0 {
            tracing::warn!(peer = %conn.1, grants_revoked = revoked, "a peer's connection ended: the buffer grants asked on it are revoked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::node_address;

    #[test]
    fn node_is_the_bound_address_or_the_hosts_name_with_the_port() {
        assert_eq!(
            node_address("127.0.0.1:7471".parse().unwrap()),
            "127.0.0.1:7471"
        );
        assert_eq!(node_address("[::1]:7471".parse().unwrap()), "[::1]:7471");
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        let want = format!("{}:7471", host.trim());
        assert_eq!(node_address("0.0.0.0:7471".parse().unwrap()), want);
        assert_eq!(node_address("[::]:7471".parse().unwrap()), want);
    }
}
