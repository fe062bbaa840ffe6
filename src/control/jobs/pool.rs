//! Warm sessions for rcpd's Copy API: a service that calls Copy many times
//! to the same peer pays the set-up (gRPC connection, handshake, QPs or
//! tcp connections, registered staging, data-path threads) once.
//!
//! The pool keeps the sessions a Copy finished well, keyed by the peer and
//! the settings a request may change ([`Key`]), at most
//! [`PoolConfig::max`] of them (the least recently used goes first), each
//! for at most [`PoolConfig::idle`] unused; then it is closed, which frees
//! the peer's side too. A Copy takes a warm session of its key when there
//! is one (a session runs one stream at a time: concurrent Copies to one
//! peer each get their own) and otherwise opens one, to a peer rcpd's
//! `--copy-peers` admitted ([`Admitted`]) and to nowhere else. A warm session whose
//! stream fails before any file finished (the peer restarted, or dropped
//! it) is replaced by a fresh one once ([`Sessions::warm`]). rcpd's
//! /metrics counts `rcpd_copy_sessions_opened_total`,
//! `rcpd_copy_sessions_reused_total` and shows `rcpd_copy_sessions_warm`.
//!
//! The bound is rcpd's, over every session it keeps to peers: buffer
//! operations' sessions ([`crate::control::buffers`]) are counted in too
//! ([`Pool::count_in`], a [`Kept`] each), and making room closes the one
//! unused longest of either kind.

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use super::policy::Sessions;
use crate::control::client::{Client, ClientOptions, Session, SessionStats};
use crate::control::copy_peers::Admitted;
use crate::control::error::Result;
use crate::metrics::Metrics;
use crate::provider::ProviderKind;

/// Default of [`PoolConfig::idle`] (`rcpd --copy-session-idle`): well
/// below the 30 minutes after which rcpd reaps a session nobody uses.
pub const DEFAULT_POOL_IDLE: Duration = Duration::from_secs(30);
/// Default of [`PoolConfig::max`] (`rcpd --copy-sessions`).
pub const DEFAULT_POOL_MAX: usize = 8;

/// How many sessions the pool keeps warm, and how long.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// A warm session unused this long is closed (zero: none is kept).
    pub idle: Duration,
    /// Warm sessions kept at most, over all peers (0: none).
    pub max: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            idle: DEFAULT_POOL_IDLE,
            max: DEFAULT_POOL_MAX,
        }
    }
}

impl PoolConfig {
    fn keeps(&self) -> bool {
        self.max > 0 && !self.idle.is_zero()
    }
}

/// What a warm session must share with a Copy to serve it: the peer and
/// every client setting. The settings are compared as their `Debug` text
/// (never shown: it holds the token), so a setting a request can change,
/// now or later (token, transport, block size, checks, ...), is part of
/// the key without anyone having to remember to add it.
#[derive(Clone, PartialEq, Eq)]
pub struct Key {
    remote: String,
    settings: String,
}

impl Key {
    /// The key of a Copy to `remote` with `o`.
    pub fn of(remote: &str, o: &ClientOptions) -> Key {
        let o = ClientOptions {
            metrics: None,
            ..o.clone()
        };
        Key {
            remote: remote.to_string(),
            settings: format!("{o:?}"),
        }
    }
}

struct Warm {
    key: Key,
    client: Client,
    session: Session,
    since: Instant,
}

/// A session to a peer kept by another part of rcpd (a buffer session),
/// counted against the pool's bound.
pub trait Kept: Send + Sync {
    /// Whether it is still open (a closed one no longer counts).
    fn open(&self) -> bool;
    /// When it was last used, if nothing uses it now (it may then be
    /// closed to make room).
    fn unused_since(&self) -> Option<Instant>;
    /// Close it to make room, unless something took it meanwhile; whether
    /// it closed.
    fn close_for_room(&self) -> bool;
}

/// The pool (one per rcpd).
pub struct Pool {
    cfg: PoolConfig,
    /// rcpd's metrics (from the first lease's options).
    metrics: OnceLock<Arc<Metrics>>,
    /// Least recently used first.
    warm: Mutex<Vec<Warm>>,
    /// The other sessions the bound counts.
    others: Mutex<Vec<Box<dyn Kept>>>,
}

impl Pool {
    /// A pool; with `cfg` keeping sessions, a task on the current runtime
    /// closes the expired ones (it ends with the pool).
    pub fn new(cfg: PoolConfig) -> Arc<Pool> {
        let pool = Arc::new(Pool {
            cfg,
            metrics: OnceLock::new(),
            warm: Mutex::new(Vec::new()),
            others: Mutex::new(Vec::new()),
        });
        if cfg.keeps() {
            let weak = Arc::downgrade(&pool);
            let every = (cfg.idle / 4).max(Duration::from_millis(50));
            tokio::spawn(reaper(weak, every));
        }
        pool
    }

    pub fn config(&self) -> PoolConfig {
        self.cfg
    }

    /// Sessions warm now.
    pub fn warm(&self) -> usize {
        self.warm.lock().unwrap().len()
    }

    /// A lease for one Copy to `peer` with `opts`: the warm client and
    /// session of their [`Key`] if the pool has them, else a fresh
    /// connection to the addresses `peer` was admitted at (`opts`' metrics
    /// count the pool's sessions).
    pub async fn lease(
        self: &Arc<Pool>,
        peer: &Admitted,
        opts: ClientOptions,
    ) -> Result<WarmLease> {
        let key = Key::of(peer.remote(), &opts);
        if let Some(m) = &opts.metrics {
            let _ = self.metrics.set(m.clone());
        }
        let found = {
            let mut w = self.warm.lock().unwrap();
            // The most recently used of the key: the likeliest to be alive.
            let at = w.iter().rposition(|x| x.key == key);
            let found = at.map(|i| w.remove(i));
            self.gauge(w.len());
            found
        };
        let (client, session) = match found {
            Some(x) => (x.client, Some(x.session)),
            None => (Client::connect_admitted(peer, opts).await?, None),
        };
        Ok(WarmLease {
            pool: self.clone(),
            key,
            client,
            warm_id: session.as_ref().map(Session::id),
            warm: Mutex::new(session),
        })
    }

    fn gauge(&self, n: usize) {
        if let Some(m) = self.metrics.get() {
            m.copy_sessions_warm(n);
        }
    }

    /// Keep `s` warm, closing whatever that pushes past the bound.
    fn keep(&self, key: Key, client: Client, session: Session) {
        let evicted: Vec<Warm> = {
            let mut w = self.warm.lock().unwrap();
            w.push(Warm {
                key,
                client,
                session,
                since: Instant::now(),
            });
            let evicted = self.make_room(&mut w, 0);
            self.gauge(w.len());
            evicted
        };
        close_all(evicted);
    }

    /// Count `k` against the bound from now on (until it closes), making
    /// room for it first.
    pub fn count_in(&self, k: Box<dyn Kept>) {
        let evicted = {
            let mut w = self.warm.lock().unwrap();
            let evicted = self.make_room(&mut w, 1);
            self.gauge(w.len());
            evicted
        };
        close_all(evicted);
        self.others.lock().unwrap().push(k);
    }

    /// Close the unused longest, of warm sessions (`w`, locked by the
    /// caller) and the others, until `more` fit under the bound; the warm
    /// ones taken out, for the caller to close. In use, the others are
    /// left: the bound is then exceeded until they are done.
    fn make_room(&self, w: &mut Vec<Warm>, more: usize) -> Vec<Warm> {
        let mut out = Vec::new();
        let mut o = self.others.lock().unwrap();
        // A buffer operation needs its session even when none is kept.
        let bound = self.cfg.max.max(more);
        loop {
            o.retain(|k| k.open());
            if w.len() + o.len() + more <= bound {
                return out;
            }
            // `w` is least recently used first.
            let warm = w.first().map(|x| x.since);
            let other = o
                .iter()
                .enumerate()
                .filter_map(|(i, k)| Some((k.unused_since()?, i)))
                .min();
            // The other session to close, when it is the one unused longest.
            let older = match (warm, other) {
                (None, None) => return out,
                (Some(a), Some((b, i))) if b < a => Some(i),
                (None, Some((_, i))) => Some(i),
                _ => None,
            };
            match older {
                None => out.push(w.remove(0)),
                // Taken meanwhile: the bound waits for its end.
                Some(i) if !o[i].close_for_room() => return out,
                Some(_) => {}
            }
        }
    }

    /// Close the sessions unused for the idle time.
    fn expire(&self) {
        let expired: Vec<Warm> = {
            let mut w = self.warm.lock().unwrap();
            let (old, keep): (Vec<Warm>, Vec<Warm>) = std::mem::take(&mut *w)
                .into_iter()
                .partition(|x| x.since.elapsed() >= self.cfg.idle);
            *w = keep;
            if !old.is_empty() {
                self.gauge(w.len());
                if let Some(m) = self.metrics.get() {
                    m.copy_sessions_expired(old.len());
                }
            }
            old
        };
        close_all(expired);
    }
}

fn close_all(ws: Vec<Warm>) {
    for x in ws {
        tracing::debug!(remote = %x.key.remote, session = x.session.id(), "warm session closed");
        tokio::spawn(async move {
            let _ = x.session.close().await;
        });
    }
}

async fn reaper(pool: Weak<Pool>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match pool.upgrade() {
            Some(p) => p.expire(),
            None => return,
        }
    }
}

/// One Copy's sessions: the warm one first, fresh ones after; those that
/// end well go back to the pool.
pub struct WarmLease {
    pool: Arc<Pool>,
    key: Key,
    client: Client,
    warm: Mutex<Option<Session>>,
    warm_id: Option<u64>,
}

impl WarmLease {
    /// The connection to the peer (plans, directories).
    pub fn client(&self) -> &Client {
        &self.client
    }
}

impl Sessions for WarmLease {
    fn first(&self) -> (ProviderKind, String) {
        match &*self.warm.lock().unwrap() {
            Some(s) => (s.kind, s.transport.clone()),
            None => self.client.first(),
        }
    }

    fn open(&self, kind: ProviderKind, why: String) -> BoxFuture<'_, Result<Session>> {
        let warm = {
            let mut w = self.warm.lock().unwrap();
            match w.take() {
                Some(s) if s.kind == kind => Some(s),
                Some(s) => {
                    close_all(vec![Warm {
                        key: self.key.clone(),
                        client: self.client.clone(),
                        session: s,
                        since: Instant::now(),
                    }]);
                    None
                }
                None => None,
            }
        };
        Box::pin(async move {
            if let Some(s) = warm {
                if let Some(m) = self.pool.metrics.get() {
                    m.copy_session_reused();
                }
                return Ok(s);
            }
            let s = self.client.session_with(kind, why).await?;
            if let Some(m) = self.pool.metrics.get() {
                m.copy_session_opened();
            }
            Ok(s)
        })
    }

    fn finish(&self, s: Session, ok: bool) -> BoxFuture<'_, Option<SessionStats>> {
        Box::pin(async move {
            if ok && self.pool.cfg.keeps() {
                self.pool.keep(self.key.clone(), self.client.clone(), s);
                None
            } else {
                s.close().await.ok()
            }
        })
    }

    fn warm(&self, s: &Session) -> bool {
        self.warm_id == Some(s.id())
    }
}

impl Drop for WarmLease {
    fn drop(&mut self) {
        // A warm session the Copy never used (it failed before) goes back.
        if let Some(s) = self.warm.get_mut().unwrap().take() {
            if self.pool.cfg.keeps() {
                self.pool.keep(self.key.clone(), self.client.clone(), s);
            }
        }
    }
}
