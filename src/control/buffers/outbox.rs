//! What rcpd sends a service on its unix socket (replies and events):
//! [`Outbox`]. A frame sent while nothing is queued and nobody writes goes
//! to the socket at once, from the sender's thread (a request's task, the
//! tcp target's connection thread that checked a peer's write): no
//! hand-off to another thread on the way to the service. Otherwise it is
//! queued, and the connection's writer task ([`Outbox::write_queued`])
//! sends what is queued, several frames in one send.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::UnixStream;
use tokio::sync::{mpsc, Notify};

use super::wire;

/// Bytes of queued frames one send to a service carries, at most (about).
const COALESCE_BYTES: usize = 256 << 10;

/// Frames for a service (replies and events), encoded by who sends them,
/// with the bytes of them queued and not yet sent.
pub struct Outbox {
    tx: mpsc::UnboundedSender<Vec<u8>>,
    queued: AtomicUsize,
    /// The writer sent some, or ended.
    drained: Notify,
    ended: AtomicBool,
    /// The service's socket, which a sender writes to itself when nothing
    /// is queued and nobody writes; `None`: every frame is queued.
    socket: Option<Arc<UnixStream>>,
    /// Somebody writes to the socket: the writer task, or a sender.
    pen: AtomicBool,
    /// What a sender's own write left unsent (the socket was full): the
    /// writer sends it before anything queued. Counted in `queued`.
    rest: Mutex<Vec<u8>>,
}

impl Outbox {
    /// An outbox whose frames all go through its writer, and what the
    /// writer takes them from.
    pub fn new() -> (Arc<Outbox>, mpsc::UnboundedReceiver<Vec<u8>>) {
        Outbox::build(None)
    }

    /// An outbox for `socket`, whose senders write to it themselves when
    /// it is idle; the writer ([`Outbox::write_queued`]) takes the rest.
    pub fn on(socket: Arc<UnixStream>) -> (Arc<Outbox>, mpsc::UnboundedReceiver<Vec<u8>>) {
        Outbox::build(Some(socket))
    }

    fn build(socket: Option<Arc<UnixStream>>) -> (Arc<Outbox>, mpsc::UnboundedReceiver<Vec<u8>>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let o = Outbox {
            tx,
            queued: AtomicUsize::new(0),
            drained: Notify::new(),
            ended: AtomicBool::new(false),
            socket,
            pen: AtomicBool::new(false),
            rest: Mutex::new(Vec::new()),
        };
        (Arc::new(o), rx)
    }

    /// Send `frame` (one or more whole frames) to the service: at once if
    /// nothing is queued and nobody writes, else queued for the writer
    /// (dropped once the connection ended). In order with what this
    /// caller sent before.
    pub fn send(&self, frame: Vec<u8>) {
        let Some(frame) = self.send_now(frame) else {
            return;
        };
        let n = frame.len();
        self.queued.fetch_add(n, Ordering::AcqRel);
        if self.tx.send(frame).is_err() {
            self.queued.fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// `frame` written to the idle socket by this thread (`None`; what the
    /// socket did not take is left for the writer, first), or given back
    /// to be queued.
    fn send_now(&self, frame: Vec<u8>) -> Option<Vec<u8>> {
        let Some(socket) = &self.socket else {
            return Some(frame);
        };
        if self.queued() > 0 || self.ended.load(Ordering::Acquire) || !self.take_pen() {
            return Some(frame);
        }
        // Nothing queued before the pen was taken: nothing can be sent
        // before this frame any more.
        if self.queued() > 0 {
            self.put_pen();
            return Some(frame);
        }
        // An error (the service went away) is the writer's to find.
        let sent = wire::try_send(socket, &frame).unwrap_or(0);
        if sent < frame.len() {
            let rest = frame[sent..].to_vec();
            self.queued.fetch_add(rest.len(), Ordering::AcqRel);
            *self.rest.lock().unwrap() = rest;
            self.put_pen();
            // Wake the writer for it (an empty frame, nothing of its own).
            let _ = self.tx.send(Vec::new());
            return None;
        }
        self.put_pen();
        None
    }

    fn take_pen(&self) -> bool {
        self.pen
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    fn put_pen(&self) {
        self.pen.store(false, Ordering::Release);
    }

    /// The connection's writer: sends what is queued (several frames in
    /// one send, a sender's unsent rest first) until the connection ends
    /// or a send fails.
    pub async fn write_queued(self: Arc<Self>, mut rx: mpsc::UnboundedReceiver<Vec<u8>>) {
        let socket = self.socket.clone().expect("a writer writes to a socket");
        // Replies and events queued together go out in one send (a batch's
        // replies and `done` events: one syscall, one wake-up of the
        // service's reader, not one each).
        while let Some(mut out) = rx.recv().await {
            while out.len() < COALESCE_BYTES {
                match rx.try_recv() {
                    Ok(f) => out.extend_from_slice(&f),
                    Err(_) => break,
                }
            }
            // A sender holds the pen only for one non-blocking send.
            while !self.take_pen() {
                tokio::task::yield_now().await;
            }
            let rest = std::mem::take(&mut *self.rest.lock().unwrap());
            if !rest.is_empty() {
                out.splice(0..0, rest);
            }
            let n = out.len();
            let r = match n {
                0 => Ok(()),
                _ => wire::send(&socket, &out, &[]).await,
            };
            self.sent(n);
            self.put_pen();
            if r.is_err() {
                break;
            }
        }
        self.end();
    }

    /// The writer sent `n` bytes of queued frames.
    pub(super) fn sent(&self, n: usize) {
        self.queued.fetch_sub(n, Ordering::AcqRel);
        self.drained.notify_waiters();
    }

    /// The writer ended: nothing waits for it any more.
    pub(super) fn end(&self) {
        self.ended.store(true, Ordering::Release);
        self.drained.notify_waiters();
    }

    /// The connection ended: nothing more is sent, and the service sees
    /// the end of its socket even while something still holds the outbox.
    pub(super) fn close(&self) {
        self.end();
        if let Some(s) = &self.socket {
            // (A socket already shut down by the peer: nothing to do.)
            let _ = rustix::net::shutdown(s, rustix::net::Shutdown::Both);
        }
    }

    /// Bytes queued and not yet sent.
    pub(super) fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    /// Once at most `limit` bytes are queued (or the writer ended).
    pub(super) async fn below(&self, limit: usize) {
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.queued() <= limit || self.ended.load(Ordering::Acquire) {
                return;
            }
            drained.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// A connection's reading waits while more than the bound of its
    /// replies is queued, until the writer sent some (or ended).
    #[tokio::test]
    async fn requests_wait_while_replies_are_queued_beyond_the_bound() {
        let (o, mut rx) = Outbox::new();
        o.send(vec![0; 10]);
        o.send(vec![0; 10]);
        assert_eq!(o.queued(), 20);
        let mut below = Box::pin(o.below(10));
        assert!(futures::poll!(below.as_mut()).is_pending());
        let f = rx.recv().await.unwrap();
        o.sent(f.len());
        assert!(futures::poll!(below.as_mut()).is_ready());
        let mut below = Box::pin(o.below(0));
        assert!(futures::poll!(below.as_mut()).is_pending());
        o.end();
        assert!(futures::poll!(below.as_mut()).is_ready());
    }

    /// A frame sent to an idle socket reaches the service with no writer
    /// running; one sent while the socket is full comes after what the
    /// socket did not take, whole, once the writer runs.
    #[tokio::test]
    async fn an_idle_socket_is_written_at_once_and_a_full_one_keeps_the_order() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let ours = Arc::new(ours);
        let (o, rx) = Outbox::on(ours.clone());
        o.send(b"first".to_vec());
        assert_eq!(o.queued(), 0, "written, not queued");
        let mut got = [0u8; 5];
        theirs.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"first");
        // More than the socket takes: the rest waits for the writer, and a
        // frame sent after it waits behind it.
        let big: Vec<u8> = (0..8 << 20).map(|i| (i % 251) as u8).collect();
        o.send(big.clone());
        assert!(o.queued() > 0, "the socket took only part of it");
        o.send(b"last".to_vec());
        let writer = tokio::spawn(o.clone().write_queued(rx));
        let mut all = vec![0u8; big.len() + 4];
        theirs.read_exact(&mut all).await.unwrap();
        assert!(all[..big.len()] == big[..], "the big frame whole, first");
        assert_eq!(&all[big.len()..], b"last");
        assert_eq!(o.queued(), 0);
        drop(o);
        writer.abort();
    }

    /// Once closed, the service sees the end of its socket though the
    /// outbox (and the socket) are still held, and nothing more reaches it.
    #[tokio::test]
    async fn a_closed_outbox_ends_the_socket_and_sends_nothing() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let (o, _rx) = Outbox::on(Arc::new(ours));
        o.close();
        o.send(b"late".to_vec());
        let mut got = Vec::new();
        // (A hang guard only: the end is there at once.)
        let read = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            theirs.read_to_end(&mut got),
        );
        assert_eq!(read.await.expect("the end of the socket").unwrap(), 0);
        assert!(got.is_empty(), "{got:?}");
    }
}
