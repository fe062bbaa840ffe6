//! The limits that keep one client from taking what rcpd's other clients
//! need (docs/security.md): who a client is ([`ClientId`]), its share of
//! the transfer slots ([`ClientSlots`]), and the end of a stream that moves
//! nothing ([`Watchdog`]). The session limits are the table's
//! (`sessions`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest as _, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::Service;
use crate::escape::esc;
use crate::metrics::ClientLimit;

/// `--max-transfers-per-client` when not given: half of `--max-transfers`,
/// rounded up, so one client leaves the other half to the rest.
pub fn default_transfers_per_client(max_transfers: usize) -> usize {
    max_transfers.div_ceil(2).max(1)
}

impl Service {
    /// `n` of `client`'s sessions or streams were cut off or held back by
    /// `why`: counted, and logged (at most once a second per reason, with
    /// how many were not logged since).
    pub(super) fn limited(
        &self,
        why: ClientLimit,
        n: u64,
        client: ClientId,
        name: &str,
        what: &str,
    ) {
        // Logged before counted: whoever sees the count in /metrics finds
        // the line (when one is due) already in the log.
        if let Some(suppressed) = self.throttle.allow(why, Instant::now()) {
            match why {
                ClientLimit::SessionIdle | ClientLimit::SessionGrace => tracing::info!(
                    %client, name = %esc(name), limit = why.as_str(), count = n, suppressed, "{what}"
                ),
                _ => tracing::warn!(
                    %client, name = %esc(name), limit = why.as_str(), count = n, suppressed, "{what}"
                ),
            }
        }
        self.metrics.client_limit(why, n);
    }

    /// Close the sessions left unused: those that opened no Move stream
    /// within `--session-grace`, those idle [`SESSION_IDLE`] after their last.
    ///
    /// [`SESSION_IDLE`]: super::SESSION_IDLE
    pub(super) fn sweep(&self) {
        let closed = self.sessions.sweep(Instant::now());
        let mut by: HashMap<(ClientId, ClientLimit), (u64, String)> = HashMap::new();
        for c in &closed {
            if let Some(b) = &self.buffers {
                b.session_closed(c.id);
            }
            tracing::debug!(
                session = format_args!("{:#x}", c.id),
                why = c.why.as_str(),
                "session closed"
            );
            by.entry((c.session.client, c.why))
                .or_insert_with(|| (0, c.session.client_name.clone()))
                .0 += 1;
        }
        for ((client, why), (n, name)) in by {
            let what = match why {
                ClientLimit::SessionGrace => format!(
                    "sessions closed: no Move stream within --session-grace ({:?})",
                    self.cfg.sessions.grace
                ),
                _ => format!(
                    "sessions closed: unused for {:?} after their last Move stream",
                    super::SESSION_IDLE
                ),
            };
            self.limited(why, n, client, &name, &what);
        }
        drop(closed);
    }
}

/// At most one log line a second for each [`ClientLimit`].
#[derive(Default)]
pub struct Throttle(Mutex<HashMap<ClientLimit, (Instant, u64)>>);

impl Throttle {
    /// Whether an event of `why` at `now` is logged: `Some(n)`, with the
    /// `n` events not logged since the last line.
    pub fn allow(&self, why: ClientLimit, now: Instant) -> Option<u64> {
        let mut m = self.0.lock().unwrap();
        match m.get_mut(&why) {
            Some((last, n)) if now.saturating_duration_since(*last) < Duration::from_secs(1) => {
                *n += 1;
                None
            }
            Some((last, n)) => {
                *last = now;
                Some(std::mem::take(n))
            }
            None => {
                m.insert(why, (now, 0));
                Some(0)
            }
        }
    }
}

/// Who a client is, for its shares: its address and, over mutual TLS, its
/// certificate. Every holder of rcpd's one token is the same token holder,
/// so the token does not tell clients apart; the address does, and the
/// certificate tells apart clients behind one address.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct ClientId {
    /// The peer's IP address (IPv4-mapped IPv6 as IPv4); `None` when the
    /// transport has none.
    pub addr: Option<IpAddr>,
    /// The first 8 bytes of the SHA-256 of its leaf certificate (DER).
    pub cert: Option<[u8; 8]>,
}

impl ClientId {
    pub fn new(addr: Option<IpAddr>, cert_der: Option<&[u8]>) -> ClientId {
        ClientId {
            addr: addr.map(|a| a.to_canonical()),
            cert: cert_der.map(|c| {
                let d = Sha256::digest(c);
                d[..8].try_into().expect("8 of 32 bytes")
            }),
        }
    }

    /// The client of a request served by tonic's server.
    pub fn of<T>(req: &tonic::Request<T>) -> ClientId {
        let certs = req.peer_certs();
        ClientId::new(
            req.remote_addr().map(|a| a.ip()),
            certs.as_ref().and_then(|c| c.first()).map(|c| c.as_ref()),
        )
    }
}

impl std::fmt::Display for ClientId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.addr {
            Some(a) => write!(f, "{a}")?,
            None => f.write_str("unknown-address")?,
        }
        if let Some(c) = self.cert {
            write!(f, " cert-sha256:{}", hex::encode(c))?;
        }
        Ok(())
    }
}

/// Each client's share of the transfer slots (`--max-transfers-per-client`),
/// taken before one of rcpd's (`--max-transfers`): a client that runs its
/// share waits for one of its own streams to end, whatever the others do.
pub struct ClientSlots {
    per_client: usize,
    clients: Arc<Mutex<HashMap<ClientId, Arc<Semaphore>>>>,
}

/// A stream's place in its client's share; given back when dropped.
pub struct ClientPermit {
    permit: Option<OwnedSemaphorePermit>,
    client: ClientId,
    clients: Arc<Mutex<HashMap<ClientId, Arc<Semaphore>>>>,
}

impl ClientSlots {
    pub fn new(per_client: usize) -> Self {
        ClientSlots {
            per_client: per_client.max(1),
            clients: Arc::default(),
        }
    }

    pub fn per_client(&self) -> usize {
        self.per_client
    }

    /// `client`'s share now, if it has a place free; otherwise `Err` with
    /// what [`ClientSlots::acquire`] waits on.
    pub fn try_acquire(&self, client: ClientId) -> Result<ClientPermit, Arc<Semaphore>> {
        let sem = self
            .clients
            .lock()
            .unwrap()
            .entry(client)
            .or_insert_with(|| Arc::new(Semaphore::new(self.per_client)))
            .clone();
        match sem.clone().try_acquire_owned() {
            Ok(p) => Ok(self.permit(client, p)),
            Err(_) => Err(sem),
        }
    }

    /// Wait on `sem` (from [`ClientSlots::try_acquire`]) for a place.
    pub async fn acquire(&self, client: ClientId, sem: Arc<Semaphore>) -> ClientPermit {
        let p = sem.acquire_owned().await.expect("never closed");
        self.permit(client, p)
    }

    fn permit(&self, client: ClientId, p: OwnedSemaphorePermit) -> ClientPermit {
        ClientPermit {
            permit: Some(p),
            client,
            clients: self.clients.clone(),
        }
    }

    /// Clients with a share in use or waited for (what the map holds).
    #[cfg(test)]
    pub fn clients(&self) -> usize {
        self.clients.lock().unwrap().len()
    }
}

impl Drop for ClientPermit {
    fn drop(&mut self) {
        drop(self.permit.take());
        // A client with nothing running and nobody waiting leaves the map
        // (only the map holds its semaphore then).
        let mut m = self.clients.lock().unwrap();
        if m.get(&self.client)
            .is_some_and(|s| Arc::strong_count(s) == 1)
        {
            m.remove(&self.client);
        }
    }
}

/// Ends a stream that moves nothing: no bytes verified or read into a
/// window, no file committed or finished, for `timeout` of the time rcpd
/// itself had nothing to do for it. Keepalives, opens, hashes are not
/// progress; time rcpd spends on the stream's own work (a window waiting
/// for a free slot of the arena, a batch being synced) does not count.
/// No I/O and no clock: the driver passes time in (ns since the stream's
/// start), as it does to the protocol core.
#[derive(Debug)]
pub struct Watchdog {
    timeout: u64,
    /// Idle time counted since the last movement, up to `idle_from`.
    idle: u64,
    /// Since when rcpd has nothing to do for the stream (`None`: it has).
    idle_from: Option<u64>,
    jobs: usize,
}

impl Watchdog {
    /// Starting at `now`, idle; `timeout_ns` 0: never.
    pub fn new(timeout_ns: u64, now: u64) -> Self {
        Watchdog {
            timeout: timeout_ns,
            idle: 0,
            idle_from: Some(now),
            jobs: 0,
        }
    }

    /// Bytes moved or a file was finished.
    pub fn moved(&mut self, now: u64) {
        self.idle = 0;
        if self.idle_from.is_some() {
            self.idle_from = Some(now);
        }
    }

    /// rcpd started work for the stream.
    pub fn job_started(&mut self, now: u64) {
        if let Some(t) = self.idle_from.take() {
            self.idle += now.saturating_sub(t);
        }
        self.jobs += 1;
    }

    /// A piece of that work is done.
    pub fn job_done(&mut self, now: u64) {
        self.jobs = self.jobs.saturating_sub(1);
        if self.jobs == 0 && self.idle_from.is_none() {
            self.idle_from = Some(now);
        }
    }

    /// When the stream is to end if nothing happens before (`None`: rcpd
    /// has work out for it, or no timeout).
    pub fn deadline(&self) -> Option<u64> {
        let t = self.idle_from?;
        (self.timeout > 0).then(|| t + self.timeout.saturating_sub(self.idle))
    }

    /// Whether the stream ends at `now`.
    pub fn expired(&self, now: u64) -> bool {
        self.deadline().is_some_and(|d| now >= d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn client_ids() {
        let v4 = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 7));
        let mapped = IpAddr::V6(Ipv4Addr::new(192, 0, 2, 7).to_ipv6_mapped());
        assert_eq!(
            ClientId::new(Some(v4), None),
            ClientId::new(Some(mapped), None)
        );
        assert_eq!(ClientId::new(Some(mapped), None).to_string(), "192.0.2.7");
        let a = ClientId::new(Some(v4), Some(b"cert a"));
        let b = ClientId::new(Some(v4), Some(b"cert b"));
        assert_ne!(a, b);
        assert_ne!(a, ClientId::new(Some(v4), None));
        assert!(a.to_string().starts_with("192.0.2.7 cert-sha256:"), "{a}");
        assert_eq!(a.to_string().len(), "192.0.2.7 cert-sha256:".len() + 16);
        let v6 = IpAddr::V6(Ipv6Addr::LOCALHOST);
        assert_eq!(ClientId::new(Some(v6), None).to_string(), "::1");
        assert_eq!(ClientId::new(None, None).to_string(), "unknown-address");
    }

    /// A client runs its share and then waits; another client does not;
    /// a client with nothing left leaves the map.
    #[tokio::test]
    async fn each_client_has_its_share() {
        let s = ClientSlots::new(2);
        let a = ClientId::new(Some(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))), None);
        let b = ClientId::new(Some(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2))), None);
        let a1 = s.try_acquire(a).ok().unwrap();
        let a2 = s.try_acquire(a).ok().unwrap();
        let sem = s.try_acquire(a).err().expect("a holds its share");
        let b1 = s.try_acquire(b).ok().unwrap(); // b has its own
        let waiting = {
            let sem = sem.clone();
            let s = &s;
            async move { s.acquire(a, sem).await }
        };
        tokio::pin!(waiting);
        assert!(futures::poll!(&mut waiting).is_pending());
        drop(a1);
        let a3 = waiting.await;
        drop(sem);
        assert_eq!(s.clients(), 2);
        drop(b1);
        assert_eq!(s.clients(), 1);
        drop((a2, a3));
        assert_eq!(s.clients(), 0);
    }

    #[test]
    fn throttled_lines_say_what_they_left_out() {
        let t = Throttle::default();
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        assert_eq!(t.allow(ClientLimit::NoProgress, ms(0)), Some(0));
        assert_eq!(t.allow(ClientLimit::NoProgress, ms(10)), None);
        assert_eq!(t.allow(ClientLimit::NoProgress, ms(999)), None);
        // Another reason has its own second.
        assert_eq!(t.allow(ClientLimit::Sessions, ms(500)), Some(0));
        assert_eq!(t.allow(ClientLimit::NoProgress, ms(1000)), Some(2));
        assert_eq!(t.allow(ClientLimit::NoProgress, ms(1001)), None);
        assert_eq!(t.allow(ClientLimit::NoProgress, ms(5000)), Some(1));
        assert_eq!(default_transfers_per_client(16), 8);
        assert_eq!(default_transfers_per_client(5), 3);
        assert_eq!(default_transfers_per_client(1), 1);
    }

    const S: u64 = 1_000_000_000;

    #[test]
    fn a_stream_that_moves_nothing_ends() {
        let mut w = Watchdog::new(10 * S, 0);
        assert_eq!(w.deadline(), Some(10 * S));
        assert!(!w.expired(10 * S - 1));
        assert!(w.expired(10 * S));
        // Moving restarts the count.
        w.moved(4 * S);
        assert_eq!(w.deadline(), Some(14 * S));
        assert!(Watchdog::new(0, 0).deadline().is_none());
    }

    /// Time rcpd spends on the stream's work does not count; idle time
    /// before and after it adds up.
    #[test]
    fn rcpd_s_own_work_does_not_count() {
        let mut w = Watchdog::new(10 * S, 0);
        w.job_started(3 * S);
        w.job_started(4 * S);
        assert_eq!(w.deadline(), None);
        assert!(!w.expired(1000 * S));
        w.job_done(50 * S);
        assert_eq!(w.deadline(), None);
        w.job_done(60 * S);
        // 3 s idle before, 7 s left after.
        assert_eq!(w.deadline(), Some(67 * S));
        // Jobs that answer quickly (an open, a hash) do not restart it.
        w.job_started(61 * S);
        w.job_done(61 * S);
        assert_eq!(w.deadline(), Some(67 * S));
        // Bytes that move while a job is out restart it once idle again.
        w.job_started(62 * S);
        w.moved(63 * S);
        w.job_done(64 * S);
        assert_eq!(w.deadline(), Some(74 * S));
    }
}
