//! The service protocol's framing (docs/buffers.md): after the magic
//! `RCPB`, frames of a 4-byte little-endian length and one JSON object;
//! file descriptors ride on a frame as SCM_RIGHTS. Reading goes through
//! `recvmsg` so descriptors are collected in arrival order whichever read
//! they came with, each marked with the frame it came with: the kernel
//! ends a read with the bytes of the send that carried them (a sender puts
//! a frame's fds on its first bytes), so they belong to the frame the
//! read's last byte is in.

use std::collections::VecDeque;
use std::io::{self, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use serde::Serialize;
use serde_json::Value;
use tokio::io::Interest;
use tokio::net::UnixStream;

/// The first bytes of a service-protocol connection.
pub const MAGIC: &[u8; 4] = b"RCPB";
/// The largest frame either side sends.
pub const MAX_FRAME: usize = 1 << 20;
/// File descriptors one read may bring.
const MAX_FDS: usize = 8;
/// File descriptors a connection may have queued ahead of the frames they
/// came with (a frame takes its own when it is read whole): beyond them,
/// reading fails and the connection is closed.
pub const MAX_QUEUED_FDS: usize = 64;

/// The reading side of a connection: frames, and the fds that came with
/// them.
pub struct FrameReader {
    /// Room for reads (zeroed once, reused); `buf[start..end]` are the
    /// bytes read and not consumed yet.
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Bytes read from the stream, ever.
    received: u64,
    /// Where in the stream the last frame returned ends.
    frame_end: u64,
    /// Each fd not taken yet, with where in the stream the read that
    /// brought it ended (in the frame it came with).
    fds: VecDeque<(u64, OwnedFd)>,
}

/// Bytes one read asks for at least.
const READ_CHUNK: usize = 64 << 10;

impl Default for FrameReader {
    fn default() -> Self {
        FrameReader {
            buf: vec![0; READ_CHUNK],
            start: 0,
            end: 0,
            received: 0,
            frame_end: 0,
            fds: VecDeque::new(),
        }
    }
}

impl FrameReader {
    /// Bytes read and not consumed yet.
    fn unread(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Mark `n` more bytes consumed.
    fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Read into the buffer once, collecting fds; 0 at end of stream. The
    /// bytes land straight in the buffer's free room (a frame's bytes are
    /// copied once, by the kernel); the unread bytes are moved to its front
    /// only when the room behind them runs short, and the buffer grows
    /// only for a frame larger than it.
    async fn fill(&mut self, s: &UnixStream) -> io::Result<usize> {
        if self.buf.len() - self.end < READ_CHUNK {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            if self.buf.len() - self.end < READ_CHUNK {
                self.buf.resize(self.end + READ_CHUNK, 0);
            }
        }
        let room = &mut self.buf[self.end..];
        let (n, fds) = s
            .async_io(Interest::READABLE, || {
                let mut space =
                    [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
                let mut anc = RecvAncillaryBuffer::new(&mut space);
                let mut iov = [IoSliceMut::new(room)];
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
        self.end += n;
        self.received += n as u64;
        let at = self.received;
        let queued = self.fds.len() + fds.len();
        self.fds.extend(fds.into_iter().map(|fd| (at, fd)));
        if queued > MAX_QUEUED_FDS {
            // Dropped (closed) with the reader.
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{queued} file descriptors sent ahead of their frames (at most \
                     {MAX_QUEUED_FDS} queued)"
                ),
            ));
        }
        Ok(n)
    }

    /// The fds that came with the last frame returned ([`Self::next_frame`]),
    /// in the order they came; the caller keeps or closes them.
    pub fn frame_fds(&mut self) -> Vec<OwnedFd> {
        let mut out = Vec::new();
        while self
            .fds
            .front()
            .is_some_and(|(at, _)| *at <= self.frame_end)
        {
            out.push(self.fds.pop_front().expect("looked at above").1);
        }
        out
    }

    /// Read exactly `n` raw bytes (the magic).
    pub async fn read_raw(&mut self, s: &UnixStream, n: usize) -> io::Result<Vec<u8>> {
        while self.unread().len() < n {
            if self.fill(s).await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        let out = self.unread()[..n].to_vec();
        self.consume(n);
        Ok(out)
    }

    /// The next frame as JSON; `None` at a clean end of stream.
    pub async fn next(&mut self, s: &UnixStream) -> io::Result<Option<Value>> {
        let Some(b) = self.next_frame(s).await? else {
            return Ok(None);
        };
        serde_json::from_slice(b)
            .map(Some)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("frame: {e}")))
    }

    /// The next frame's bytes, where they were read (until the next
    /// read); `None` at a clean end of stream.
    pub async fn next_frame(&mut self, s: &UnixStream) -> io::Result<Option<&[u8]>> {
        loop {
            let b = self.unread();
            if b.len() >= 4 {
                let n = u32::from_le_bytes(b[..4].try_into().unwrap()) as usize;
                if n > MAX_FRAME {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("frame of {n} bytes, more than {MAX_FRAME}"),
                    ));
                }
                if b.len() >= 4 + n {
                    let at = self.start + 4;
                    self.frame_end = self.received - (self.end - at - n) as u64;
                    self.consume(4 + n);
                    // Consuming moves no byte: they stay until the next fill.
                    return Ok(Some(&self.buf[at..at + n]));
                }
            }
            if self.fill(s).await? == 0 {
                return if self.unread().is_empty() {
                    Ok(None)
                } else {
                    Err(io::ErrorKind::UnexpectedEof.into())
                };
            }
        }
    }
}

/// One frame's bytes: `v` serialized once, straight after its length
/// (a typed event or reply needs no `Value` built first).
pub fn encode<T: Serialize + ?Sized>(v: &T) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    out.extend_from_slice(&[0; 4]);
    serde_json::to_writer(&mut out, v).expect("a message serializes");
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    out
}

/// A reply's fields: one JSON object, serialized once by the request's
/// handler (no `Value` built first); [`reply_frame`] puts `re` in front.
#[derive(Debug)]
pub struct Reply(Vec<u8>);

impl Reply {
    /// The fields of `v`, which must serialize as a JSON object.
    pub fn of<T: Serialize + ?Sized>(v: &T) -> Reply {
        let b = serde_json::to_vec(v).expect("a reply serializes");
        assert!(
            b.first() == Some(&b'{') && b.last() == Some(&b'}'),
            "a reply is a JSON object"
        );
        Reply(b)
    }

    /// No fields.
    pub fn empty() -> Reply {
        Reply(b"{}".to_vec())
    }
}

/// The frame answering request `id` with `r`'s fields: `{"re": id, ...}`.
pub fn reply_frame(id: &Value, r: &Reply) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + r.0.len());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(b"{\"re\":");
    serde_json::to_writer(&mut out, id).expect("an id serializes");
    let fields = &r.0[1..];
    if fields != b"}" {
        out.push(b',');
    }
    out.extend_from_slice(fields);
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_le_bytes());
    out
}

/// As much of `bytes` as `s` takes now, without waiting (0 when it is
/// full): from any thread, in the runtime or not.
pub fn try_send(s: &UnixStream, bytes: &[u8]) -> io::Result<usize> {
    use rustix::net::SendFlags;
    match s.try_io(Interest::WRITABLE, || {
        rustix::net::send(s.as_fd(), bytes, SendFlags::NOSIGNAL).map_err(io::Error::from)
    }) {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
        r => r,
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// A reply's frame is its fields with `re` first, whatever the id's
    /// type, with no fields too.
    #[test]
    fn a_reply_frame_is_its_fields_and_re() {
        let body = |f: &[u8]| -> Value {
            let n = u32::from_le_bytes(f[..4].try_into().unwrap()) as usize;
            assert_eq!(n, f.len() - 4);
            serde_json::from_slice(&f[4..]).unwrap()
        };
        let r = Reply::of(&serde_json::json!({"handles": [1, 2], "x": "a}"}));
        assert_eq!(
            body(&reply_frame(&Value::from(7), &r)),
            serde_json::json!({"re": 7, "handles": [1, 2], "x": "a}"})
        );
        assert_eq!(
            body(&reply_frame(&Value::from("q"), &Reply::empty())),
            serde_json::json!({"re": "q"})
        );
    }

    #[test]
    #[should_panic(expected = "a reply is a JSON object")]
    fn a_reply_is_an_object() {
        Reply::of(&[1, 2]);
    }

    /// Frames however the stream cuts them: many in one read, one larger
    /// than a read's room across many, then a clean end.
    #[tokio::test]
    async fn frames_across_reads_and_larger_than_the_room() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let big = "x".repeat(3 * READ_CHUNK + 17);
        let mut want = Vec::new();
        for i in 0..1000 {
            want.push(serde_json::json!({ "id": i, "op": "wait" }));
        }
        want.push(serde_json::json!({ "id": 1000, "message": big }));
        for i in 1001..1100 {
            want.push(serde_json::json!({ "id": i }));
        }
        let bytes: Vec<u8> = want.iter().flat_map(encode).collect();
        let writer = tokio::spawn(async move {
            // Uneven pieces: frames and their length prefixes split anywhere.
            for piece in bytes.chunks(4093) {
                b.write_all(piece).await.unwrap();
            }
        });
        let mut r = FrameReader::default();
        let mut got = Vec::new();
        while let Some(v) = r.next(&a).await.unwrap() {
            got.push(v);
        }
        writer.await.unwrap();
        assert_eq!(got, want);
    }

    /// A stream that ends inside a frame is an error, not a clean end.
    #[tokio::test]
    async fn a_cut_frame_is_an_error() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let f = encode(&serde_json::json!({ "id": 1 }));
        b.write_all(&f[..f.len() - 1]).await.unwrap();
        drop(b);
        let mut r = FrameReader::default();
        let e = r.next(&a).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
