//! The gRPC port's connections, each known while it is open: what a peer's
//! call made over one (a buffer grant per operation) is tied to it and let
//! go of when it ends (closed, reset, or given up by HTTP/2: a flood guard's
//! GOAWAY, a keepalive unanswered), not only at its own timeout.
//!
//! A connection is named by its (local, remote) addresses: unique among the
//! listener's open connections, and what a request on it carries
//! ([`conn_of`]), over TLS too. [`Tracked`] tells a [`ConnWatch`] when it
//! opens and, while its socket is still open (so no other connection can
//! have the same addresses yet), when it ends.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::{Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// A connection: its (local, remote) addresses.
pub type ConnKey = (SocketAddr, SocketAddr);

/// The connection request `req` came on (none over the unix socket).
pub fn conn_of<T>(req: &tonic::Request<T>) -> Option<ConnKey> {
    Some((req.local_addr()?, req.remote_addr()?))
}

/// Told when a connection of the gRPC port opens and when it ends.
pub trait ConnWatch: Send + Sync {
    fn opened(&self, conn: ConnKey);
    fn closed(&self, conn: ConnKey);
}

/// A connection of the gRPC port, its end told to the watch.
pub struct Tracked {
    io: TcpStream,
    key: Option<ConnKey>,
    watch: Arc<dyn ConnWatch>,
}

impl Tracked {
    pub fn new(io: TcpStream, watch: Arc<dyn ConnWatch>) -> Tracked {
        let key = io.local_addr().ok().zip(io.peer_addr().ok());
        if let Some(k) = key {
            watch.opened(k);
        }
        Tracked { io, key, watch }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        // Before the socket closes: its addresses are not yet free for
        // another connection.
        if let Some(k) = self.key {
            self.watch.closed(k);
        }
    }
}

/// The listener's connections, each [`Tracked`].
pub fn tracked<S>(incoming: S, watch: Arc<dyn ConnWatch>) -> impl Stream<Item = io::Result<Tracked>>
where
    S: Stream<Item = io::Result<TcpStream>>,
{
    incoming.map(move |r| r.map(|s| Tracked::new(s, watch.clone())))
}

impl Connected for Tracked {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        TcpConnectInfo {
            local_addr: self.key.map(|k| k.0),
            remote_addr: self.key.map(|k| k.1),
        }
    }
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
