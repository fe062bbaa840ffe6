//! A raw protocol-2 client for tests that must say what rcp never would:
//! a handshake made by hand (tcp or verbs), a Move stream whose frames the
//! test writes itself, one-sided WRITEs and READs posted one at a time to
//! whatever address and rkey the test names.
//!
//! Nothing here checks what rcpd answers beyond what a frame reader needs:
//! the tests assert. A [`Move`] keeps what arrived in an [`Inbox`] and
//! hands it out by kind, so a test does not depend on how rcpd batches its
//! messages into frames.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rcp::control::link::ClientLink;
use rcp::control::{VERSION_MAJOR, VERSION_MINOR};
use rcp::engine::{LocalSeg, OpKind, RemoteSeg, WcStatus, WorkCompletion, WorkRequest};
use rcp::proto::{self, rcp_client::RcpClient, ClientFrame, ServerFrame};
use rcp::provider::{Channel, ProviderKind};
use sha2::{Digest as _, Sha256};
use tokio::sync::mpsc;
use tonic::transport::Channel as Grpc;

pub type Client = RcpClient<Grpc>;

/// How long a test waits for a frame or a completion before it fails.
pub const WAIT: Duration = Duration::from_secs(30);

/// Bytes of the staging window a [`Session`] posts from.
pub const STAGING: usize = 4 << 20;

/// A gRPC client of rcpd on [`host`](super::host)`:port`.
pub async fn grpc(port: u16) -> Client {
    RcpClient::connect(format!("http://{}:{port}", super::host()))
        .await
        .unwrap()
}

/// A protocol-2 handshake request for `kind` with `block_size`: what rcp
/// sends, without the verbs parameters.
pub fn hello(kind: ProviderKind, block_size: u64) -> proto::HandshakeRequest {
    proto::HandshakeRequest {
        version_major: VERSION_MAJOR,
        version_minor: VERSION_MINOR,
        providers: vec![provider(kind) as i32],
        block_size,
        client_name: "raw-test".into(),
        checks: vec![proto::Check::Sha256 as i32],
        window_count: 4,
        ..Default::default()
    }
}

pub fn provider(kind: ProviderKind) -> proto::Provider {
    match kind {
        ProviderKind::Verbs => proto::Provider::Verbs,
        ProviderKind::Tcp => proto::Provider::Tcp,
    }
}

/// SHA-256 of `b`, the block digest of the session's check.
pub fn sha256(b: &[u8]) -> Vec<u8> {
    Sha256::digest(b).to_vec()
}

/// The file digest of `data` in blocks of `bs` (what FileEnd and
/// Committed carry).
pub fn file_digest(data: &[u8], bs: u64) -> Vec<u8> {
    let blocks: Vec<Vec<u8>> = data.chunks(bs as usize).map(sha256).collect();
    rcp::control::protocol::file_digest(data.len() as u64, bs, blocks.iter().map(Vec::as_slice))
}

/// A session made by hand: the handshake's answer, a staging window
/// registered with the client's provider, and the session's data channel.
pub struct Session {
    pub hs: proto::HandshakeResponse,
    pub link: ClientLink,
    pub ch: Arc<dyn Channel>,
}

impl Session {
    /// Handshake for `kind` (verbs: the device [`Topology`](super::Topology)
    /// names for rcp) and connect the data channel.
    pub async fn open(c: &mut Client, kind: ProviderKind, block_size: u64) -> Session {
        let dev = super::Topology::from_env().rcp_device;
        let link = tokio::task::spawn_blocking(move || {
            let rails = dev
                .map(|d| rcp::parse::rails(&d).expect("a rail list"))
                .unwrap_or_default();
            ClientLink::open(kind, &rails, None, STAGING, 2, 0).unwrap()
        })
        .await
        .unwrap();
        let req = proto::HandshakeRequest {
            verbs: link.verbs_params(),
            ..hello(kind, block_size)
        };
        let hs = c.handshake(req).await.unwrap().into_inner();
        assert_eq!(hs.version_major, VERSION_MAJOR, "{hs:?}");
        assert_eq!(hs.provider, provider(kind) as i32, "{hs:?}");
        let (link, hs, ch) = tokio::task::spawn_blocking(move || {
            let ch = link
                .connect(&hs, &super::host(), Default::default())
                .unwrap();
            (link, hs, ch)
        })
        .await
        .unwrap();
        Session { hs, link, ch }
    }

    pub fn id(&self) -> u64 {
        self.hs.session_id
    }

    /// The session's TCP key (16 bytes).
    pub fn key(&self) -> [u8; 16] {
        self.hs
            .tcp_session_key
            .as_slice()
            .try_into()
            .expect("a 16-byte session key")
    }

    /// TCP: a fresh data connection of this client presenting `key` (the
    /// session's own, another's, one nobody was given) or none at all.
    pub fn tcp_channel(&self, key: Option<[u8; 16]>) -> Arc<dyn Channel> {
        assert_eq!(self.link.kind, ProviderKind::Tcp);
        let hs = proto::HandshakeResponse {
            tcp_session_key: key.map(|k| k.to_vec()).unwrap_or_default(),
            ..self.hs.clone()
        };
        self.link
            .connect(&hs, &super::host(), Default::default())
            .unwrap()
    }

    /// WRITE `data` to (addr, rkey) on the session's channel; the status.
    pub fn write(&self, addr: u64, rkey: u32, data: &[u8]) -> WcStatus {
        self.write_on(&*self.ch, addr, rkey, data)
    }

    /// READ `len` bytes from (addr, rkey) on the session's channel.
    pub fn read(&self, addr: u64, rkey: u32, len: usize) -> (WcStatus, Vec<u8>) {
        self.read_on(&*self.ch, addr, rkey, len)
    }

    /// A free window of the link's staging.
    fn staging_window(&self) -> rcp::mem::Block {
        let pool = self.link.slots.as_ref().expect("the link maps staging");
        pool.take().expect("a free staging window")
    }

    /// WRITE `data` to (addr, rkey) on `ch` (a channel of this client).
    pub fn write_on(&self, ch: &dyn Channel, addr: u64, rkey: u32, data: &[u8]) -> WcStatus {
        let mut slot = self.staging_window();
        slot.as_mut_slice()[..data.len()].copy_from_slice(data);
        let st = self.post(ch, OpKind::Write, slot.addr(), data.len(), addr, rkey);
        drop(slot);
        st
    }

    /// READ `len` bytes from (addr, rkey) on `ch`; what arrived.
    pub fn read_on(
        &self,
        ch: &dyn Channel,
        addr: u64,
        rkey: u32,
        len: usize,
    ) -> (WcStatus, Vec<u8>) {
        let mut slot = self.staging_window();
        slot.as_mut_slice()[..len].fill(0);
        let st = self.post(ch, OpKind::Read, slot.addr(), len, addr, rkey);
        (st, slot.as_slice()[..len].to_vec())
    }

    /// Post one signaled request from staging at `local` and wait for its
    /// completion. The caller holds the staging window and leaves it alone
    /// until this returns.
    fn post(
        &self,
        ch: &dyn Channel,
        kind: OpKind,
        local: u64,
        len: usize,
        addr: u64,
        rkey: u32,
    ) -> WcStatus {
        assert!(len <= STAGING);
        let wr = WorkRequest {
            wr_id: 7,
            kind,
            local: LocalSeg {
                addr: local,
                len: len as u32,
                lkey: self.link.lkey(),
            },
            remote: RemoteSeg { addr, rkey },
            signaled: true,
            inline: false,
        };
        // SAFETY: `local..local + len` lies in a staging window of this
        // client's link, registered under `lkey` with the channel's provider;
        // the caller holds that window and does not touch it until the
        // completion below is polled, which retires the request.
        unsafe { ch.post(&[wr]) }.unwrap();
        let mut wc = [WorkCompletion {
            wr_id: 0,
            status: WcStatus::Success,
            byte_len: 0,
        }; 4];
        let t = Instant::now();
        while t.elapsed() < WAIT {
            if ch.poll(&mut wc).unwrap() > 0 {
                return wc[0].status;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        panic!("no completion for a {kind:?} of {len} bytes to {addr:#x}");
    }
}

/// What arrived on a Move stream and was not taken yet, by kind.
#[derive(Debug, Default)]
pub struct Inbox {
    pub opened: VecDeque<proto::Opened>,
    pub grants: VecDeque<proto::Grant>,
    pub acks: VecDeque<proto::Ack>,
    pub ends: VecDeque<proto::FileEnd>,
    pub committed: VecDeque<proto::Committed>,
    pub failed: VecDeque<proto::FileFailed>,
}

impl Inbox {
    fn add(&mut self, f: ServerFrame) {
        self.opened.extend(f.opened);
        self.grants.extend(f.grants);
        self.acks.extend(f.acks);
        self.ends.extend(f.ends);
        self.committed.extend(f.committed);
        self.failed.extend(f.failed);
    }

    pub fn is_empty(&self) -> bool {
        self.opened.is_empty()
            && self.grants.is_empty()
            && self.acks.is_empty()
            && self.ends.is_empty()
            && self.committed.is_empty()
            && self.failed.is_empty()
    }
}

/// One Move stream: frames out as the test writes them, frames in
/// collected in `inbox`.
pub struct Move {
    /// Put on every frame sent (rcpd reads it from the first).
    pub session_id: u64,
    tx: Option<mpsc::UnboundedSender<ClientFrame>>,
    rx: tonic::Streaming<ServerFrame>,
    pub inbox: Inbox,
    /// Keepalives (empty frames) read so far.
    pub keepalives: u32,
}

impl Move {
    /// Open a Move stream and send `first` (its session id as given: the
    /// test may name one that does not exist).
    pub async fn start(c: &mut Client, first: ClientFrame) -> Move {
        let (tx, rx) = mpsc::unbounded_channel();
        let session_id = first.session_id;
        tx.send(first).unwrap();
        let rx = c
            .r#move(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Move {
            session_id,
            tx: Some(tx),
            rx,
            inbox: Inbox::default(),
            keepalives: 0,
        }
    }

    /// Open a Move stream on `session` with these files.
    pub async fn open(c: &mut Client, session: u64, open: Vec<proto::OpenFile>) -> Move {
        Move::start(
            c,
            ClientFrame {
                session_id: session,
                open,
                ..Default::default()
            },
        )
        .await
    }

    /// Send a frame (with the stream's session id).
    pub fn send(&self, f: ClientFrame) {
        let f = ClientFrame {
            session_id: self.session_id,
            ..f
        };
        self.tx.as_ref().expect("not closed").send(f).unwrap();
    }

    /// [`send`](Self::send), for a frame rcpd may no longer read (the
    /// stream ended before it): whether it went out.
    pub fn try_send(&self, f: ClientFrame) -> bool {
        let f = ClientFrame {
            session_id: self.session_id,
            ..f
        };
        self.tx.as_ref().is_some_and(|tx| tx.send(f).is_ok())
    }

    pub fn send_open(&self, open: Vec<proto::OpenFile>) {
        self.send(ClientFrame {
            open,
            ..Default::default()
        });
    }

    pub fn send_done(&self, done: proto::WindowDone) {
        self.send(ClientFrame {
            done: vec![done],
            ..Default::default()
        });
    }

    pub fn send_end(&self, file: u32, digest: Vec<u8>) {
        self.send(ClientFrame {
            end: vec![proto::FileEnd { file, digest }],
            ..Default::default()
        });
    }

    /// Close the client's side of the stream.
    pub fn close(&mut self) {
        self.tx = None;
    }

    /// The next frame: `Ok(None)` when the stream ended cleanly.
    async fn frame(&mut self) -> Result<Option<ServerFrame>, tonic::Status> {
        match tokio::time::timeout(WAIT, self.rx.message()).await {
            Ok(r) => r,
            Err(_) => panic!("no frame from rcpd in {WAIT:?}; so far: {:?}", self.inbox),
        }
    }

    /// The next frame that carries something (keepalives skipped), past
    /// the inbox, or the status the stream ended with; a clean end panics.
    pub async fn frame_or_status(&mut self) -> Result<ServerFrame, tonic::Status> {
        loop {
            match self.frame().await? {
                Some(f) if is_keepalive(&f) => {
                    self.keepalives += 1;
                    continue;
                }
                Some(f) => return Ok(f),
                None => panic!("the stream ended cleanly; so far: {:?}", self.inbox),
            }
        }
    }

    /// Read frames until `take` finds what the test waits for in the inbox.
    pub async fn wait<T>(
        &mut self,
        what: &str,
        mut take: impl FnMut(&mut Inbox) -> Option<T>,
    ) -> T {
        loop {
            if let Some(t) = take(&mut self.inbox) {
                return t;
            }
            match self.frame().await {
                Ok(Some(f)) => self.inbox.add(f),
                Ok(None) => panic!(
                    "the stream ended while waiting for {what}: {:?}",
                    self.inbox
                ),
                Err(s) => panic!(
                    "the stream failed while waiting for {what}: {s:?}; {:?}",
                    self.inbox
                ),
            }
        }
    }

    pub async fn opened(&mut self) -> proto::Opened {
        self.wait("Opened", |i| i.opened.pop_front()).await
    }

    pub async fn grant(&mut self) -> proto::Grant {
        self.wait("a Grant", |i| i.grants.pop_front()).await
    }

    pub async fn ack(&mut self) -> proto::Ack {
        self.wait("an Ack", |i| i.acks.pop_front()).await
    }

    pub async fn end(&mut self) -> proto::FileEnd {
        self.wait("FileEnd", |i| i.ends.pop_front()).await
    }

    pub async fn committed(&mut self) -> proto::Committed {
        self.wait("Committed", |i| i.committed.pop_front()).await
    }

    /// Read to the end of the stream, which must be an error status; what
    /// arrived on the way stays in the inbox.
    pub async fn status(&mut self) -> tonic::Status {
        loop {
            match self.frame().await {
                Ok(Some(f)) => self.inbox.add(f),
                Ok(None) => panic!("the stream ended without an error: {:?}", self.inbox),
                Err(s) => return s,
            }
        }
    }

    /// Read to the end of the stream, which must end cleanly.
    pub async fn finish(&mut self) {
        loop {
            match self.frame().await {
                Ok(Some(f)) => self.inbox.add(f),
                Ok(None) => return,
                Err(s) => panic!("the stream failed: {s:?}; {:?}", self.inbox),
            }
        }
    }
}

/// A frame with nothing in it but its number and progress counter.
pub fn is_keepalive(f: &ServerFrame) -> bool {
    ServerFrame {
        progress: 0,
        seq: 0,
        ..f.clone()
    } == ServerFrame::default()
}

/// An OpenFile for a push of `length` bytes to `path`.
pub fn push(file: u32, path: &str, length: u64) -> proto::OpenFile {
    proto::OpenFile {
        file,
        direction: proto::Direction::Push as i32,
        path: path.into(),
        length,
        ..Default::default()
    }
}

/// An OpenFile for a pull of `path`.
pub fn pull(file: u32, path: &str) -> proto::OpenFile {
    proto::OpenFile {
        file,
        direction: proto::Direction::Pull as i32,
        path: path.into(),
        ..Default::default()
    }
}

/// A WindowDone answering `g` with these block digests (push).
pub fn pushed(g: &proto::Grant, digests: Vec<Vec<u8>>) -> proto::WindowDone {
    proto::WindowDone {
        window: g.window,
        round: g.round,
        digests,
        bad: Vec::new(),
    }
}

/// A WindowDone answering `g` with the extents that did not match (pull).
pub fn pulled(g: &proto::Grant, bad: Vec<u32>) -> proto::WindowDone {
    proto::WindowDone {
        window: g.window,
        round: g.round,
        digests: Vec::new(),
        bad,
    }
}

/// The machine-readable reason rcpd put in the status's details (an
/// ErrorInfo of domain "rcp"); panics if it put none, so a reason guessed
/// from the status code alone does not pass for one.
pub fn reason(s: &tonic::Status) -> rcp::control::error::Reason {
    use tonic_types::StatusExt as _;
    let info = s
        .get_details_error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo in the status: {s:?}"));
    assert_eq!(info.domain, rcp::control::error::ERROR_DOMAIN, "{s:?}");
    rcp::control::error::status_reason(s)
}
