//! Sessions to peer rcpds for buffer operations: rcpd is the client of
//! the peer rcpd, as for the Copy API. One session per (peer, check), kept
//! for every operation to that peer (Copy's pool policy: closed unused for
//! `--copy-session-idle`, at most `--copy-sessions` kept), on the daemon's
//! rails (`--device`, or every ACTIVE port), as files' sessions; its data
//! path is a [`LendingPath`] (the service's pages are the windows' local
//! bytes; the session maps no staging, `Client::bare_session`). A buffer is
//! registered in every rail's domain of the session once, on first use,
//! and forgotten when its service releases it; with several rails each
//! window's extents are spread over them, each rail posting under its own
//! registration's lkey and the peer's rkey for that rail (the grant's
//! `rail_rkeys`).
//!
//! The session's driver (`drive`) hands window ends to their operations
//! and watches for the tcp fallback ([`crate::control::fallback`], files'
//! rule): under `--transport auto` a verbs session whose rails all stayed
//! down past `tcp_fallback_after` with operations waiting, or whose data
//! path failed retryably, is given up; the operations that were waiting
//! run again from the start over a tcp session to the same peer, and later
//! operations to that peer use that tcp session while it lasts. A verbs
//! session that cannot be set up is replaced by a tcp one as well.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::sync::{oneshot, watch};

use super::{Buffers, Failure};
use crate::control::client::{Client, Session, SessionStats};
use crate::control::error::{ControlError, Reason};
use crate::control::fallback::{after_fallback, LinkWatch};
use crate::control::jobs::{open_first, Kept, Sessions};
use crate::control::link::resolve_transport;
use crate::control::protocol::rail_watch::LOOK_EVERY_NS;
use crate::datapath::lend::{LendingPath, Loan, RailRegs};
use crate::datapath::{DataPathError, DpEvent};
use crate::engine::WcStatus;
use crate::files::Check;
use crate::mem::memfd::{LeasedRange, ServiceBuffer};
use crate::provider::{Access, Domain, ProviderKind, Registration};

type Key = (String, &'static str);

/// Calls (`BufferGrant`, `BufferDone`) a session has in flight to its peer
/// at most; the rest wait their turn. Thousands of operations started at
/// once would otherwise each open an HTTP/2 stream on the one connection
/// to the peer, and h2 takes that many small DATA frames waiting to be
/// read for a flood: it sends GOAWAY (`too_many_data_frames`) and every
/// call on the connection fails. h2's guard allows at least 100 such
/// frames (a budget of 25 600 bytes, up to 256 counted per frame).
pub(super) const MAX_CALLS: usize = 64;

/// Sessions to peers, by (address, check name).
#[derive(Default)]
pub struct Peers {
    links: Mutex<HashMap<Key, Arc<PeerLink>>>,
    /// Peers whose verbs session gave up on RDMA, and why: their next
    /// sessions are over tcp until one of those ends.
    fell_back: Mutex<HashMap<Key, String>>,
    /// Held while a session under its key is opened (one per peer, not
    /// one per operation that found none; a peer that does not answer
    /// holds up only the operations to it).
    opening: Mutex<HashMap<Key, Arc<tokio::sync::Mutex<()>>>>,
}

impl Peers {
    /// The lock held while a session under `key` is opened; those no one
    /// holds or waits for are dropped from the table here.
    fn opening(&self, key: &Key) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self.opening.lock().unwrap();
        m.retain(|_, l| Arc::strong_count(l) > 1);
        m.entry(key.clone()).or_default().clone()
    }

    /// Forget buffer `uid`'s registrations (its service released it; the
    /// operations still running hold their own).
    pub(crate) fn forget_buffer(&self, uid: u64) {
        let links: Vec<Arc<PeerLink>> = self.links.lock().unwrap().values().cloned().collect();
        for l in links {
            let r = l.regs.lock().unwrap().remove(&uid);
            crate::control::in_place(|| drop(r));
        }
    }

    /// The live session under `key`, if any (taken under the table's
    /// lock, so an idle one is never retired while it is being taken).
    pub(super) fn live(&self, key: &Key) -> Option<Arc<PeerLink>> {
        self.links
            .lock()
            .unwrap()
            .get(key)
            .filter(|l| l.dead().is_none())
            .cloned()
    }

    /// Take `l` out of the table if nobody uses it (only the table and
    /// its driver hold it) and it has been unused for `idle`; whether it
    /// was.
    pub(super) fn take_idle(&self, l: &Arc<PeerLink>, idle: Duration) -> bool {
        let mut m = self.links.lock().unwrap();
        let idle_now = Arc::strong_count(l) <= 2 && l.last_used.lock().unwrap().elapsed() >= idle;
        if idle_now && m.get(&l.key).is_some_and(|x| Arc::ptr_eq(x, l)) {
            m.remove(&l.key);
            return true;
        }
        false
    }

    /// Close `l` to make room for another session (the pool's bound), if
    /// nobody uses it (only the table and its driver hold it: taken under
    /// the table's lock, as [`Peers::live`] takes one); whether it closed.
    fn close_for_room(&self, l: &Arc<PeerLink>) -> bool {
        let gone = {
            let mut m = self.links.lock().unwrap();
            // The table's, the driver's and the caller's.
            let unused = Arc::strong_count(l) <= 3;
            unused && m.get(&l.key).is_some_and(|x| Arc::ptr_eq(x, l)) && m.remove(&l.key).is_some()
        };
        if gone {
            tracing::info!(peer = %crate::escape::esc(&l.key.0), session = l.session_id, "buffer session closed: more sessions than --copy-sessions");
            l.retire("closed to make room for another peer's session".into());
        }
        gone
    }
}

/// A buffer session as the pool of sessions to peers counts it.
struct Counted {
    bufs: std::sync::Weak<Buffers>,
    link: std::sync::Weak<PeerLink>,
}

impl Kept for Counted {
    fn open(&self) -> bool {
        self.link.upgrade().is_some_and(|l| l.dead().is_none())
    }

    fn unused_since(&self) -> Option<Instant> {
        // The table's and the driver's: no operation holds it.
        if self.link.strong_count() > 2 {
            return None;
        }
        let l = self.link.upgrade()?;
        let t = *l.last_used.lock().unwrap();
        Some(t)
    }

    fn close_for_room(&self) -> bool {
        match (self.bufs.upgrade(), self.link.upgrade()) {
            (Some(b), Some(l)) => b.peers.close_for_room(&l),
            _ => true,
        }
    }
}

pub(super) type Waiter = oneshot::Sender<Result<LeasedRange, String>>;

/// A session's lending path; `_closed` goes after it, telling those who
/// wait for the windows' ranges to come back ([`PeerLink::closed`]).
pub(super) struct Path {
    lp: LendingPath,
    _closed: watch::Sender<()>,
}

impl std::ops::Deref for Path {
    type Target = LendingPath;
    fn deref(&self) -> &LendingPath {
        &self.lp
    }
}

/// One session to a peer rcpd.
pub struct PeerLink {
    pub(super) key: Key,
    pub(super) client: Client,
    pub(super) session_id: u64,
    pub(super) block_size: u64,
    pub(super) check: Check,
    /// The peer's retry bound (its handshake's `max_retries`).
    pub(super) max_retries: u32,
    /// Each rail's domain, in the data path's order.
    pub(super) domains: Vec<Arc<dyn Domain>>,
    pub(super) kind: ProviderKind,
    /// Over tcp because the peer's RDMA gave up (or a verbs session could
    /// not be set up): why.
    pub(super) fell_back: Option<String>,
    /// The tcp fallback's watch, and its clock's start.
    pub(super) watch: Mutex<LinkWatch>,
    t0: Instant,
    pub(super) path: Arc<Path>,
    /// Changes (its sender drops) once the lending path has closed.
    pub(super) closed: watch::Receiver<()>,
    pub(super) regs: Mutex<HashMap<u64, Arc<RailRegs>>>,
    /// Standing grants the peer gave this session, for reads ([0]) and
    /// writes ([1]), by exposure name: operations into them need no grant
    /// each.
    pub(super) standing: Mutex<[HashMap<String, Arc<crate::proto::StandingGrant>>; 2]>,
    /// Their operations' notices, batched.
    pub(super) notices: Arc<super::notices::Notices>,
    pub(super) waiters: Mutex<HashMap<u64, Waiter>>,
    /// Turns for calls to the peer ([`MAX_CALLS`]).
    calls: tokio::sync::Semaphore,
    pub(super) next: AtomicU64,
    pub(super) dead: Mutex<Option<String>>,
    /// The window whose request the peer refused (remote access error:
    /// the grant it was posted under is revoked, its exposure gone), when
    /// that failed the data path: [`GrantedOp::post`] tells the operation
    /// that posted it from the others on the session.
    pub(super) refused: Mutex<Option<u64>>,
    /// Ends the driver (and with it the data path): [`PeerLink::retire`].
    pub(super) stop: tokio::sync::Notify,
    /// When an operation last took or let go of it (its idle expiry).
    pub(super) last_used: Mutex<Instant>,
    /// Declared last: closed (CloseSession) after the data path.
    pub(super) session: Mutex<Option<Session>>,
}

impl Drop for PeerLink {
    fn drop(&mut self) {
        let s = self.session.get_mut().unwrap().take();
        // The lending path closes when its last holder goes (the driver
        // task's clone went first); the session's CloseSession is best
        // effort.
        if let Some(s) = s {
            if let Ok(h) = tokio::runtime::Handle::try_current() {
                h.spawn(async move {
                    let _ = s.close().await;
                });
            }
        }
    }
}

impl PeerLink {
    /// Nanoseconds since the session opened (the watch's clock).
    pub(super) fn now(&self) -> u64 {
        u64::try_from(self.t0.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    pub(super) fn waiting(&self) -> bool {
        !self.waiters.lock().unwrap().is_empty()
    }

    /// The tcp fallback's watch, told the data path's counters now: why
    /// the session gives up on RDMA, when it does now.
    pub(super) fn look(&self) -> Option<String> {
        let (confirmed, failures) = self.path.stats().map_or((0, Vec::new()), |s| {
            let f = s.rails.iter().map(|r| r.counters().failures).collect();
            (s.counters().bytes_confirmed, f)
        });
        let waiting = self.waiting();
        self.watch
            .lock()
            .unwrap()
            .tick(self.now(), confirmed, &failures, waiting)
    }

    /// When the driver looks again without an event: the watch's deadline
    /// while operations wait, else a second on (an operation may start
    /// waiting meanwhile); never for a session that does not fall back.
    pub(super) fn next_look(&self) -> Option<tokio::time::Instant> {
        let waiting = self.waiting();
        let w = self.watch.lock().unwrap();
        if !w.watched() {
            return None;
        }
        let at = w
            .deadline(waiting)
            .unwrap_or_else(|| self.now() + LOOK_EVERY_NS);
        Some(tokio::time::Instant::from_std(
            self.t0 + Duration::from_nanos(at),
        ))
    }

    /// The session gives up on RDMA for `why` (said once, in the log): the
    /// peer's next sessions are over tcp, and the operations waiting fail
    /// here to run again there ([`run`]).
    pub(super) fn give_up(&self, bufs: &Buffers, why: String) {
        tracing::warn!(peer = %crate::escape::esc(&self.key.0), session = self.session_id, waiting = self.waiters.lock().unwrap().len(), "buffer session: {why}");
        bufs.peers
            .fell_back
            .lock()
            .unwrap()
            .insert(self.key.clone(), why.clone());
        self.fail(why);
    }

    /// Why this session gave up on RDMA, once it did.
    pub(super) fn gave_up(&self) -> Option<String> {
        self.watch.lock().unwrap().gave_up()
    }

    pub(super) fn fail(&self, why: String) {
        self.dead.lock().unwrap().get_or_insert(why.clone());
        let ws: Vec<Waiter> = self
            .waiters
            .lock()
            .unwrap()
            .drain()
            .map(|(_, w)| w)
            .collect();
        for w in ws {
            let _ = w.send(Err(why.clone()));
        }
    }

    /// Give the link up although its data path works (the peer no longer
    /// holds the session): its operations fail, the driver ends, the data
    /// path closes once the last of them let go, and the next operation
    /// opens a new session.
    pub(super) fn retire(&self, why: String) {
        self.fail(why);
        self.stop.notify_one();
    }

    /// A turn for one call to the peer, held until it returns: at most
    /// [`MAX_CALLS`] in flight on the session's connection.
    pub(super) async fn turn(&self) -> Option<tokio::sync::SemaphorePermit<'_>> {
        // Never closed: `None` is unreachable, and would only lift the
        // bound.
        self.calls.acquire().await.ok()
    }

    pub(super) fn dead(&self) -> Option<String> {
        self.dead.lock().unwrap().clone()
    }

    /// The buffer's registrations in this session's domains, one per rail
    /// (made once).
    pub(super) fn registration(
        &self,
        uid: u64,
        buf: &ServiceBuffer,
    ) -> Result<Arc<RailRegs>, Failure> {
        if let Some(r) = self.regs.lock().unwrap().get(&uid) {
            return Ok(r.clone());
        }
        let r = crate::control::in_place(|| {
            let regs = self
                .domains
                .iter()
                .enumerate()
                .map(|(k, d)| {
                    d.register_local(&buf.span(), Access::LOCAL_WRITE)
                        .map_err(|e| format!("registering the buffer on rail {k}: {e}"))
                })
                .collect::<Result<Vec<Arc<dyn Registration>>, String>>()?;
            self.path.rail_regs(regs).map_err(|e| e.to_string())
        })
        .map_err(|e| Failure::new(Reason::Other, e))?;
        self.regs.lock().unwrap().insert(uid, r.clone());
        Ok(r)
    }
}

/// The session to `peer` under `check`, opened on first use; whether it
/// was opened now.
pub(super) async fn link(
    bufs: &Arc<Buffers>,
    peer: &str,
    check: Check,
) -> Result<(Arc<PeerLink>, bool), Failure> {
    let key = (peer.to_string(), check.name());
    if let Some(l) = bufs.peers.live(&key) {
        return Ok((l, false));
    }
    // Boxed: opening a session's state is kilobytes, held by every
    // operation's task were it inline, though nearly all find one live.
    Box::pin(open_link(bufs, peer, check, key)).await
}

/// [`link`]'s slow path: no live session to `peer` for `check` (`key`).
async fn open_link(
    bufs: &Arc<Buffers>,
    peer: &str,
    check: Check,
    key: Key,
) -> Result<(Arc<PeerLink>, bool), Failure> {
    let opening = bufs.peers.opening(&key);
    let _one = opening.lock().await;
    if let Some(l) = bufs.peers.live(&key) {
        return Ok((l, false));
    }
    // rcpd's token and certificate go to listed peers only: refused here,
    // before any connection, naming the flag.
    let admitted = bufs.copy_peers().admit(peer).await.map_err(Failure::from)?;
    let mut o = bufs.client_options().clone();
    o.verify = vec![check];
    let client = Client::connect_admitted(&admitted, o)
        .await
        .map_err(|e| Failure::new(e.reason(), format!("peer {peer}: {e}")))?;
    let fell_back = bufs.peers.fell_back.lock().unwrap().get(&key).cloned();
    let (mut session, fell_back) = open_session(&client, peer, fell_back).await?;
    let session_windows = session.windows();
    let lp = session
        .take_data_path()
        .ok_or_else(|| Failure::new(Reason::Other, "the session has no data path"))?;
    let (closed_tx, closed) = watch::channel(());
    let frames = session
        .tcp_target()
        .map(|t| Arc::new(super::frames::Frames::new(t, client.options().timeout)));
    let notices = super::notices::Notices::new(
        client.clone(),
        frames,
        session.first_rail(),
        session.id(),
        peer.to_string(),
    );
    let o = client.options();
    let l = Arc::new(PeerLink {
        key: key.clone(),
        session_id: session.id(),
        block_size: session.block_size(),
        check: session.check(),
        max_retries: session.max_retries(),
        domains: session.rail_domains(),
        kind: session.kind,
        watch: Mutex::new(LinkWatch::new(
            o.transport,
            session.kind,
            o.tcp_fallback_after,
            0,
        )),
        t0: Instant::now(),
        fell_back,
        client,
        path: Arc::new(Path {
            lp,
            _closed: closed_tx,
        }),
        closed,
        regs: Mutex::new(HashMap::new()),
        standing: Mutex::default(),
        notices,
        waiters: Mutex::new(HashMap::new()),
        calls: tokio::sync::Semaphore::new(MAX_CALLS),
        next: AtomicU64::new(0),
        dead: Mutex::new(None),
        refused: Mutex::new(None),
        stop: tokio::sync::Notify::new(),
        last_used: Mutex::new(Instant::now()),
        session: Mutex::new(Some(session)),
    });
    tracing::info!(peer = %crate::escape::esc(peer), check = check.name(), session = l.session_id, transport = %l.kind, rails = l.path.rails(), windows = session_windows, fell_back = l.fell_back.as_deref().unwrap_or(""), "buffer session to a peer");
    bufs.pool().count_in(Box::new(Counted {
        bufs: Arc::downgrade(bufs),
        link: Arc::downgrade(&l),
    }));
    tokio::spawn(drive(bufs.clone(), l.clone()));
    bufs.peers.links.lock().unwrap().insert(key, l.clone());
    Ok((l, true))
}

/// Buffer sessions to one peer as the jobs policy sees them
/// ([`Sessions`]): bare ones (no staging), over the provider rcpd tries
/// first.
struct Bare<'a>(&'a Client);

impl Sessions for Bare<'_> {
    fn first(&self) -> (ProviderKind, String) {
        let o = self.0.options();
        resolve_transport(o.transport, &o.rails)
    }

    fn open(
        &self,
        kind: ProviderKind,
        why: String,
    ) -> BoxFuture<'_, Result<Session, ControlError>> {
        Box::pin(self.0.bare_session(kind, why))
    }

    fn finish(&self, s: Session, _ok: bool) -> BoxFuture<'_, Option<SessionStats>> {
        Box::pin(async move { s.close().await.ok() })
    }
}

/// A session by the jobs policy's sequence ([`open_first`]: the provider
/// rcpd tries first, or tcp when a verbs session cannot be set up and the
/// fallback may do), or over tcp straight away when the peer's RDMA gave
/// up before (`fell_back`, why). The session, and why it is over tcp when
/// it is for a fallback.
async fn open_session(
    client: &Client,
    peer: &str,
    fell_back: Option<String>,
) -> Result<(Session, Option<String>), Failure> {
    let failed = |e: ControlError| Failure::new(e.reason(), format!("peer {peer}: session: {e}"));
    let bare = Bare(client);
    if let Some(why) = fell_back {
        return match bare.open(ProviderKind::Tcp, format!("tcp: {why}")).await {
            Ok(s) => Ok((s, Some(why))),
            Err(e) => Err(failed(after_fallback(&why, e))),
        };
    }
    let said =
        |why: &str| tracing::warn!(peer = %crate::escape::esc(peer), "buffer session: {why}");
    open_first(&bare, client.options().transport, &said)
        .await
        .map_err(failed)
}

/// A session's driver: window ends to their operations; the tcp
/// fallback's watch told the data path's counters on every event and on
/// its timer. A failed path (or one given up for tcp) fails the
/// operations waiting and the link is dropped.
async fn drive(bufs: Arc<Buffers>, d: Arc<PeerLink>) {
    let path = d.path.clone();
    let idle = bufs.pool().config().idle;
    // How often an unused session looks whether its idle time is up.
    let idle_look = (idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
    loop {
        if let Some(why) = d.look() {
            d.give_up(&bufs, why);
            break;
        }
        if bufs.peers.take_idle(&d, idle) {
            tracing::info!(peer = %crate::escape::esc(&d.key.0), session = d.session_id, transport = %d.kind, "buffer session closed: unused for --copy-session-idle");
            break;
        }
        let at = d.next_look();
        let next = tokio::select! {
            e = path.next_event() => Some(e),
            _ = d.stop.notified() => Some(None),
            _ = tokio::time::sleep_until(at.unwrap_or_else(tokio::time::Instant::now)), if at.is_some() => None,
            _ = tokio::time::sleep(idle_look) => None,
        };
        let Some(next) = next else { continue };
        let Some((ev, loan)) = next else { break };
        match ev {
            DpEvent::WindowDone { id } => {
                let w = d.waiters.lock().unwrap().remove(&id);
                if let (Some(w), Some(r)) = (w, loan.and_then(Loan::into_range)) {
                    let _ = w.send(Ok(r));
                }
            }
            DpEvent::Failed(e) => {
                let msg = format!("the data path to {} failed: {e}", d.key.0);
                if let DataPathError::Failed {
                    status: Some(WcStatus::RemoteAccess),
                    window: Some(w),
                    ..
                } = &e
                {
                    *d.refused.lock().unwrap() = Some(*w);
                }
                let f = ControlError::DataPath(e).failure();
                let why = d.watch.lock().unwrap().failed(&f);
                match why {
                    Some(why) => d.give_up(&bufs, why),
                    None => d.fail(msg),
                }
                break;
            }
            _ => {}
        }
    }
    d.fail(format!("the session to {} ended", d.key.0));
    let mut m = bufs.peers.links.lock().unwrap();
    if m.get(&d.key).is_some_and(|x| Arc::ptr_eq(x, &d)) {
        m.remove(&d.key);
    }
    drop(m);
    if d.fell_back.is_some() {
        // The tcp session ended: the next one tries verbs again.
        bufs.peers.fell_back.lock().unwrap().remove(&d.key);
    }
}
