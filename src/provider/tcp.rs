//! The TCP provider: one-sided RDMA WRITE/READ emulated over TCP for hosts
//! without an RDMA device (the fallback UCX and Mooncake take).
//!
//! - [`TcpDomain`]: the registration table. Keys are random non-zero u32s;
//!   dropping a registration revokes its keys.
//! - [`TcpTarget`]: the passive side. It serves every connection in its own
//!   thread and executes requests only after the checks a NIC makes (rkey
//!   known, range inside the registration, REMOTE_WRITE / REMOTE_READ
//!   granted). A violation is answered with a remote access error and puts
//!   that connection in the error state; a malformed stream closes only that
//!   connection.
//!   A [`Messages`] taker of a session's domain gets the MESSAGE frames of
//!   its connections (two-sided, answered in order): rcpd's notices of
//!   operations under standing grants travel so.
//! - [`TcpChannel`]: the active side. `post` writes a chain as one buffered
//!   send per connection (pipelined), spread over several TCP connections;
//!   a reader thread per connection turns responses into completions with RC
//!   semantics (selective signaling, in-order retirement, flush on error).
//!
//! WRITE payloads go from registered memory into the socket, gathered with
//! their headers into `writev`s ([`crate::mem::PeerSpan::slice`]; no copy
//! of ours), and large payloads land from the socket straight in registered
//! memory (`with_mut`). Small ones (a READ's answer under the buffer's
//! size, a WRITE under 32 KiB at the target) pass through the connection's
//! buffer: one system call carries many of them, at the price of one more
//! copy each. The wire format is in [`wire`].
//!
//! Differences from an RC QP worth knowing:
//! - requests of one channel travel on several connections, so two
//!   in-flight WRITEs to the *same* remote bytes may land in either order
//!   (completions are still reported in post order);
//! - every WRITE payload has been copied into the socket when `post`
//!   returns, but `max_inline` is 0: the payload is always read through the
//!   lkey's registration;
//! - link loss is noticed when the peer closes or resets the connection; a
//!   peer that vanishes silently is left to the engine's request timeouts.

mod channel;
mod domain;
mod target;
pub mod wire;

pub use channel::{TcpChannel, DEFAULT_CONNS};
pub use domain::{Answer, Messages, TcpDomain, TcpRegistration};
pub use target::{SessionBinding, TcpTarget};

/// Socket-side buffer of each reader and writer (headers and small payloads
/// are batched through it; large payloads bypass it).
const SOCKET_BUF: usize = 256 << 10;

/// At most this many slices per `writev` (Linux's `IOV_MAX`).
const MAX_IOV: usize = 1024;

/// Write every byte of `slices` in order with `writev`, as many slices per
/// call as the kernel takes: headers and payloads go from where they are
/// into the socket, with no copy into a buffer of ours first.
fn write_gathered(
    w: &mut impl std::io::Write,
    mut slices: &mut [std::io::IoSlice<'_>],
) -> std::io::Result<()> {
    while !slices.is_empty() {
        let upto = slices.len().min(MAX_IOV);
        match w.write_vectored(&slices[..upto]) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => std::io::IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
