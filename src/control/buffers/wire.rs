//! The service protocol's framing (docs/buffers.md): after the magic
//! `RCPB`, frames of a 4-byte little-endian length and one JSON object;
//! file descriptors ride on a frame as SCM_RIGHTS. Reading goes through
//! `recvmsg` so descriptors are collected in arrival order whichever read
//! they came with.

use std::collections::VecDeque;
use std::io::{self, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use serde_json::Value;
use tokio::io::Interest;
use tokio::net::UnixStream;

/// The first bytes of a service-protocol connection.
pub const MAGIC: &[u8; 4] = b"RCPB";
/// The largest frame either side sends.
pub const MAX_FRAME: usize = 1 << 20;
/// File descriptors one read may bring.
const MAX_FDS: usize = 8;

/// The reading side of a connection: frames, and the fds that came with
/// them.
pub struct FrameReader {
    buf: Vec<u8>,
    pub fds: VecDeque<OwnedFd>,
}

impl Default for FrameReader {
    fn default() -> Self {
        FrameReader {
            buf: Vec::with_capacity(64 << 10),
            fds: VecDeque::new(),
        }
    }
}

impl FrameReader {
    /// Read into the buffer once, collecting fds; 0 at end of stream.
    async fn fill(&mut self, s: &UnixStream) -> io::Result<usize> {
        let mut chunk = vec![0u8; 64 << 10];
        let (n, fds) = s
            .async_io(Interest::READABLE, || {
                let mut space =
                    [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
                let mut anc = RecvAncillaryBuffer::new(&mut space);
                let mut iov = [IoSliceMut::new(&mut chunk)];
                let r =
                    rustix::net::recvmsg(s.as_fd(), &mut iov, &mut anc, RecvFlags::CMSG_CLOEXEC)
                        .map_err(io::Error::from)?;
                let mut fds = Vec::new();
                for m in anc.drain() {
                    if let RecvAncillaryMessage::ScmRights(it) = m {
                        fds.extend(it);
                    }
                }
                Ok((r.bytes, fds))
            })
            .await?;
        self.fds.extend(fds);
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(n)
    }

    /// Read exactly `n` raw bytes (the magic).
    pub async fn read_raw(&mut self, s: &UnixStream, n: usize) -> io::Result<Vec<u8>> {
        while self.buf.len() < n {
            if self.fill(s).await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(self.buf.drain(..n).collect())
    }

    /// The next frame; `None` at a clean end of stream.
    pub async fn next(&mut self, s: &UnixStream) -> io::Result<Option<Value>> {
        loop {
            if self.buf.len() >= 4 {
                let n = u32::from_le_bytes(self.buf[..4].try_into().unwrap()) as usize;
                if n > MAX_FRAME {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("frame of {n} bytes, more than {MAX_FRAME}"),
                    ));
                }
                if self.buf.len() >= 4 + n {
                    let v = serde_json::from_slice(&self.buf[4..4 + n]).map_err(|e| {
                        io::Error::new(io::ErrorKind::InvalidData, format!("frame: {e}"))
                    });
                    self.buf.drain(..4 + n);
                    return v.map(Some);
                }
            }
            if self.fill(s).await? == 0 {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(io::ErrorKind::UnexpectedEof.into())
                };
            }
        }
    }
}

/// One frame's bytes.
pub fn encode(v: &Value) -> Vec<u8> {
    let body = serde_json::to_vec(v).expect("a JSON value serializes");
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Write all of `bytes`, the first `sendmsg` carrying `fds` (SCM_RIGHTS).
pub async fn send(
    s: &UnixStream,
    bytes: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> io::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut off = 0;
    let mut first = !fds.is_empty();
    while off < bytes.len() {
        let n = s
            .async_io(Interest::WRITABLE, || {
                let iov = [std::io::IoSlice::new(&bytes[off..])];
                if first {
                    let mut space =
                        [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
                    let mut anc = SendAncillaryBuffer::new(&mut space);
                    if !anc.push(SendAncillaryMessage::ScmRights(fds)) {
                        return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many fds"));
                    }
                    rustix::net::sendmsg(s.as_fd(), &iov, &mut anc, SendFlags::NOSIGNAL)
                        .map_err(io::Error::from)
                } else {
                    rustix::net::send(s.as_fd(), &bytes[off..], SendFlags::NOSIGNAL)
                        .map_err(io::Error::from)
                }
            })
            .await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        first = false;
        off += n;
    }
    Ok(())
}
