//! rcpd's session table: a session is counted against the limits from the
//! moment its handshake is admitted ([`SessionTable::reserve`]), in the same
//! step as the check, so handshakes running at once (each setting up a QP
//! between check and insert) cannot pass `--max-sessions` or a client's
//! `--max-sessions-per-client`. A reservation becomes the session
//! ([`Reservation::commit`]) or, dropped, gives its place back.
//!
//! Sessions that are not used go: one that never opened a Move stream and
//! whose client sent no request for `--session-grace` (a client making the
//! directories of a large tree between its handshake and its first stream
//! keeps its sessions: [`SessionTable::touch`]), one whose last stream
//! ended [`SESSION_IDLE`] ago ([`SessionTable::sweep`]).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::limits::ClientId;
use crate::metrics::ClientLimit;

/// A session whose last Move stream ended this long ago (and with none
/// running) is closed: a client that vanished without CloseSession.
pub const SESSION_IDLE: Duration = Duration::from_secs(30 * 60);

/// `--max-sessions` when not given.
pub const DEFAULT_MAX_SESSIONS: usize = 4096;
/// `--max-sessions-per-client` when not given.
pub const DEFAULT_MAX_SESSIONS_PER_CLIENT: usize = 256;
/// `--session-grace` when not given.
pub const DEFAULT_SESSION_GRACE: Duration = Duration::from_secs(10);

/// The session limits (rcpd's flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionLimits {
    /// Sessions open (or being opened) at once (`--max-sessions`).
    pub max_sessions: usize,
    /// Of those, one client's (`--max-sessions-per-client`).
    pub per_client: usize,
    /// A session that opens no Move stream this long after its handshake
    /// is closed (`--session-grace`).
    pub grace: Duration,
}

/// What the table needs to know of a session.
pub trait Entry {
    fn client(&self) -> ClientId;
    fn usage(&self) -> Usage;
}

/// How a session is used.
#[derive(Clone, Copy, Debug)]
pub struct Usage {
    /// A Move stream runs on it (or waits for a transfer slot).
    pub active: bool,
    /// A Move stream has ever been opened on it.
    pub moved: bool,
    /// Its handshake, or the end of its last Move stream.
    pub last_used: Instant,
}

/// Why a handshake was not admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The table is full: `--max-sessions`.
    Full(usize),
    /// The client holds its share: `--max-sessions-per-client`.
    Client(usize),
}

impl Refused {
    pub fn limit(self) -> ClientLimit {
        match self {
            Refused::Full(_) => ClientLimit::Sessions,
            Refused::Client(_) => ClientLimit::SessionsPerClient,
        }
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Full(n) => write!(
                f,
                "rcpd has {n} sessions open, its limit (--max-sessions): try again later"
            ),
            Refused::Client(n) => write!(
                f,
                "this client has {n} sessions open, its limit (--max-sessions-per-client): \
                 close some (sessions that open no Move stream are closed after --session-grace)"
            ),
        }
    }
}

/// A session closed by [`SessionTable::sweep`].
pub struct Closed<S> {
    pub id: u64,
    pub session: Arc<S>,
    pub why: ClientLimit,
}

struct Inner<S> {
    open: HashMap<u64, Arc<S>>,
    reserved: HashSet<u64>,
    /// Clients with sessions open or reserved (no entry: none).
    clients: HashMap<ClientId, Client>,
}

#[derive(Clone, Copy)]
struct Client {
    sessions: usize,
    /// Its last request, if any since its first session.
    heard: Option<Instant>,
}

impl<S> Inner<S> {
    fn release(&mut self, client: ClientId) {
        if let Some(c) = self.clients.get_mut(&client) {
            c.sessions -= 1;
            if c.sessions == 0 {
                self.clients.remove(&client);
            }
        }
    }
}

/// The sessions, and the places handshakes under way hold.
pub struct SessionTable<S> {
    limits: SessionLimits,
    inner: Mutex<Inner<S>>,
}

/// A handshake's place in the table, held while it sets the session up.
#[must_use = "a reservation is given back when dropped"]
pub struct Reservation<'a, S: Entry> {
    table: &'a SessionTable<S>,
    id: u64,
    client: ClientId,
    committed: bool,
}

impl<S: Entry> Reservation<'_, S> {
    /// The new session's id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The session is set up: it takes the reserved place.
    pub fn commit(mut self, s: Arc<S>) {
        debug_assert_eq!(s.client(), self.client);
        let mut t = self.table.inner.lock().unwrap();
        t.reserved.remove(&self.id);
        t.open.insert(self.id, s);
        self.committed = true;
    }
}

impl<S: Entry> Drop for Reservation<'_, S> {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        let mut t = self.table.inner.lock().unwrap();
        t.reserved.remove(&self.id);
        t.release(self.client);
    }
}

fn random_id() -> u64 {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).expect("getrandom");
    u64::from_ne_bytes(b) | 1
}

impl<S: Entry> SessionTable<S> {
    pub fn new(limits: SessionLimits) -> Self {
        SessionTable {
            limits: SessionLimits {
                max_sessions: limits.max_sessions.max(1),
                per_client: limits.per_client.max(1),
                ..limits
            },
            inner: Mutex::new(Inner {
                open: HashMap::new(),
                reserved: HashSet::new(),
                clients: HashMap::new(),
            }),
        }
    }

    /// Check the limits and take a place for `client`'s new session, in one
    /// step.
    pub fn reserve(&self, client: ClientId) -> Result<Reservation<'_, S>, Refused> {
        let mut t = self.inner.lock().unwrap();
        let total = t.open.len() + t.reserved.len();
        if total >= self.limits.max_sessions {
            return Err(Refused::Full(total));
        }
        let mine = t.clients.get(&client).map_or(0, |c| c.sessions);
        if mine >= self.limits.per_client {
            return Err(Refused::Client(mine));
        }
        let id = loop {
            let id = random_id();
            if !t.open.contains_key(&id) && !t.reserved.contains(&id) {
                break id;
            }
        };
        t.reserved.insert(id);
        t.clients
            .entry(client)
            .or_insert(Client {
                sessions: 0,
                heard: None,
            })
            .sessions += 1;
        Ok(Reservation {
            table: self,
            id,
            client,
            committed: false,
        })
    }

    pub fn get(&self, id: u64) -> Option<Arc<S>> {
        self.inner.lock().unwrap().open.get(&id).cloned()
    }

    /// Close session `id` of `client` (CloseSession): the caller drops it.
    /// Another client's session stays open (`None`, as for no session).
    pub fn remove(&self, id: u64, client: ClientId) -> Option<Arc<S>> {
        let mut t = self.inner.lock().unwrap();
        if t.open.get(&id)?.client() != client {
            return None;
        }
        let s = t.open.remove(&id)?;
        t.release(s.client());
        Some(s)
    }

    /// Sessions open now (reservations not counted).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap().open.len()
    }

    /// `client` made a request (Stat, List, MakeDir) at `now`: its sessions
    /// are in use.
    pub fn touch(&self, client: ClientId, now: Instant) {
        if let Some(c) = self.inner.lock().unwrap().clients.get_mut(&client) {
            c.heard = Some(now);
        }
    }

    /// Close every session unused past its time at `now`: the caller drops
    /// them (off the lock: a QP's teardown is not quick).
    pub fn sweep(&self, now: Instant) -> Vec<Closed<S>> {
        let mut t = self.inner.lock().unwrap();
        let gone: Vec<(u64, ClientLimit)> = t
            .open
            .iter()
            .filter_map(|(&id, s)| {
                let heard = t.clients.get(&s.client()).and_then(|c| c.heard);
                Some((id, self.expired(s.usage(), heard, now)?))
            })
            .collect();
        gone.into_iter()
            .map(|(id, why)| {
                let session = t.open.remove(&id).expect("listed above");
                t.release(session.client());
                Closed { id, session, why }
            })
            .collect()
    }

    /// Why a session used as `u`, of a client last `heard` then, is closed
    /// at `now`, if it is.
    fn expired(&self, u: Usage, heard: Option<Instant>, now: Instant) -> Option<ClientLimit> {
        let idle = now.saturating_duration_since(u.last_used);
        let quiet =
            now.saturating_duration_since(heard.map_or(u.last_used, |h| h.max(u.last_used)));
        if u.active {
            None
        } else if !u.moved && quiet >= self.limits.grace {
            Some(ClientLimit::SessionGrace)
        } else if idle >= SESSION_IDLE {
            Some(ClientLimit::SessionIdle)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    use std::sync::Barrier;

    struct S {
        client: ClientId,
        active: AtomicBool,
        moved: AtomicBool,
        last_used: Instant,
    }

    impl Entry for S {
        fn client(&self) -> ClientId {
            self.client
        }
        fn usage(&self) -> Usage {
            Usage {
                active: self.active.load(Relaxed),
                moved: self.moved.load(Relaxed),
                last_used: self.last_used,
            }
        }
    }

    fn client(n: u8) -> ClientId {
        ClientId::new(Some(IpAddr::V4(Ipv4Addr::new(10, 0, 0, n))), None)
    }

    fn session(c: ClientId, at: Instant) -> Arc<S> {
        Arc::new(S {
            client: c,
            active: AtomicBool::new(false),
            moved: AtomicBool::new(false),
            last_used: at,
        })
    }

    fn limits(max: usize, per: usize) -> SessionLimits {
        SessionLimits {
            max_sessions: max,
            per_client: per,
            grace: Duration::from_secs(10),
        }
    }

    /// Handshakes far beyond the limit, all at once, each holding its place
    /// while it "sets up": exactly the limit are admitted.
    #[test]
    fn concurrent_reservations_never_pass_the_limit() {
        const LIMIT: usize = 16;
        const THREADS: usize = 64;
        let t: Arc<SessionTable<S>> = Arc::new(SessionTable::new(limits(LIMIT, THREADS)));
        let start = Arc::new(Barrier::new(THREADS));
        let held = Arc::new(Barrier::new(THREADS));
        let now = Instant::now();
        let admitted: usize = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..THREADS)
                .map(|i| {
                    let (t, start, held) = (t.clone(), start.clone(), held.clone());
                    sc.spawn(move || {
                        let c = client(i as u8 % 4);
                        start.wait();
                        let r = t.reserve(c);
                        // Every thread has tried before any commits.
                        held.wait();
                        match r {
                            Ok(r) => {
                                r.commit(session(c, now));
                                1
                            }
                            Err(e) => {
                                assert!(matches!(e, Refused::Full(_)), "{e:?}");
                                0
                            }
                        }
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(admitted, LIMIT);
        assert_eq!(t.len(), LIMIT);
        assert!(matches!(t.reserve(client(9)), Err(Refused::Full(LIMIT))));
    }

    /// One client cannot take every place; the others still get theirs.
    #[test]
    fn one_client_has_its_share_only() {
        let t: SessionTable<S> = SessionTable::new(limits(10, 3));
        let now = Instant::now();
        for _ in 0..3 {
            t.reserve(client(1))
                .unwrap()
                .commit(session(client(1), now));
        }
        let e = t.reserve(client(1)).map(|_| ()).unwrap_err();
        assert_eq!(e, Refused::Client(3));
        assert!(e.to_string().contains("--max-sessions-per-client"), "{e}");
        // Another address, or the same address with another certificate,
        // is another client.
        let other_cert = ClientId::new(client(1).addr, Some(b"cert"));
        for c in [client(2), other_cert] {
            t.reserve(c).unwrap().commit(session(c, now));
        }
        // A closed session gives its place back.
        let id = t.reserve(client(3)).unwrap();
        let id = {
            let n = id.id();
            id.commit(session(client(3), now));
            n
        };
        assert!(t.remove(id, client(4)).is_none(), "another client's");
        assert!(t.remove(id, client(3)).is_some());
        assert!(t.remove(id, client(3)).is_none());
        assert_eq!(t.len(), 5);
    }

    /// A reservation dropped without a session (its setup failed) gives its
    /// place back, to the table and to its client.
    #[test]
    fn a_failed_setup_gives_its_place_back() {
        let t: SessionTable<S> = SessionTable::new(limits(2, 1));
        let r = t.reserve(client(1)).unwrap();
        assert_eq!(
            t.reserve(client(1)).map(|_| ()).unwrap_err(),
            Refused::Client(1)
        );
        let r2 = t.reserve(client(2)).unwrap();
        assert!(matches!(t.reserve(client(3)), Err(Refused::Full(2))));
        drop(r);
        drop(r2);
        let now = Instant::now();
        t.reserve(client(1))
            .unwrap()
            .commit(session(client(1), now));
        t.reserve(client(2))
            .unwrap()
            .commit(session(client(2), now));
        assert_eq!(t.len(), 2);
    }

    /// Sessions that never opened a Move go after the grace; those that did,
    /// after the idle time; those with a stream running, never.
    #[test]
    fn unused_sessions_are_swept() {
        let t: SessionTable<S> = SessionTable::new(limits(10, 10));
        let t0 = Instant::now();
        let add = |moved: bool, active: bool| {
            let s = session(client(1), t0);
            s.moved.store(moved, Relaxed);
            s.active.store(active, Relaxed);
            let r = t.reserve(client(1)).unwrap();
            let id = r.id();
            r.commit(s);
            id
        };
        let fresh = add(false, false);
        let used = add(true, false);
        let running = add(true, true);
        let queued = add(false, true);
        assert!(t.sweep(t0 + Duration::from_secs(9)).is_empty());
        let c = t.sweep(t0 + Duration::from_secs(10));
        assert_eq!(c.len(), 1);
        assert_eq!((c[0].id, c[0].why), (fresh, ClientLimit::SessionGrace));
        assert!(t
            .sweep(t0 + SESSION_IDLE - Duration::from_secs(1))
            .is_empty());
        let c = t.sweep(t0 + SESSION_IDLE);
        assert_eq!(c.len(), 1);
        assert_eq!((c[0].id, c[0].why), (used, ClientLimit::SessionIdle));
        assert!(t.sweep(t0 + SESSION_IDLE * 100).is_empty());
        assert!(t.get(running).is_some() && t.get(queued).is_some());
        // What was swept no longer counts against its client.
        let t: SessionTable<S> = SessionTable::new(limits(10, 1));
        t.reserve(client(1)).unwrap().commit(session(client(1), t0));
        assert!(t.reserve(client(1)).is_err());
        assert_eq!(t.sweep(t0 + Duration::from_secs(10)).len(), 1);
        assert!(t.reserve(client(1)).is_ok());
    }

    /// A client that keeps making requests (the directories of a tree, say)
    /// keeps its sessions past the grace; another client's do not.
    #[test]
    fn a_client_at_work_keeps_its_sessions() {
        let t: SessionTable<S> = SessionTable::new(limits(10, 10));
        let t0 = Instant::now();
        let s = |n: u64| t0 + Duration::from_secs(n);
        t.reserve(client(1)).unwrap().commit(session(client(1), t0));
        t.reserve(client(2)).unwrap().commit(session(client(2), t0));
        // Requests from a client without sessions change nothing.
        t.touch(client(3), s(8));
        t.touch(client(1), s(8));
        let c = t.sweep(s(10));
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].session.client, client(2));
        assert!(t.sweep(s(17)).is_empty());
        assert_eq!(t.sweep(s(18)).len(), 1);
    }
}
