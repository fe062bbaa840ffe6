//! Sessions on the server: the handshake (versions, provider, link
//! parameters, a QP and a domain of its own: memory windows bound to its
//! QP, or a protection domain of its own) and reconnects.

use std::sync::atomic::{
    AtomicBool, AtomicU64,
    Ordering::{AcqRel, Acquire, Relaxed},
};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::limits::ClientId;
use super::sessions::{Entry, Usage};
use super::Service;
use crate::control::error::{status, ControlError, Result};
use crate::control::link::{connect_params, ep_from_proto, ep_to_proto, Device, SessionDomain};
use crate::control::protocol::{negotiate, Agreed, Params, Terms};
use crate::control::rails::{pair, RailAddr, RailPair};
// The server's QPs only respond (the client issues every request): their
// retry count never matters.
use crate::datapath::QpRetry;
use crate::proto;
use crate::provider::tcp::SessionBinding;
use crate::provider::verbs::VerbsChannel;
use crate::provider::{Domain, ProviderKind};
use crate::verbs::QpEndpoint;

/// One client's session as rcpd keeps it: its own domain (its windows are
/// reachable only by its own data path) and, over verbs, its QP.
pub struct SessionState {
    pub kind: ProviderKind,
    /// What the handshake agreed (`protocol::negotiate`): block size,
    /// windows, files open at once, the check, our timeout and the
    /// keepalive period, the retry bound.
    pub params: Params,
    /// The session's own domain: its windows are granted through it, and
    /// only its QP / data connections reach them (memory windows bound to
    /// its QP, or registrations in its own protection domain), so an rkey
    /// granted to this session is useless on any other.
    pub domain: Arc<dyn Domain>,
    /// TCP: the key binding the session's data connections to `domain`.
    _tcp_binding: Option<SessionBinding>,
    /// Verbs: the session's QP (memory windows are bound on it, under its
    /// lock, so never while a reconnect resets it).
    qp: Option<Arc<VerbsChannel>>,
    /// Verbs: the QP its notices come on (`BufferMessages`), once the
    /// client opened it.
    messages: Mutex<Option<crate::verbs::messages::Messenger>>,
    /// Verbs, a session over several rails: rails 1.. (rail 0 is `domain`
    /// and `qp`), each a QP on its device through which every grant is
    /// reachable too (a memory window bound on it, or, on a device without
    /// them, a registration in the QP's own protection domain).
    rails: Vec<SessionRail>,
    /// The negotiated (initiator, responder) depths, reused on reconnect.
    rd: (u32, u32),
    epoch: AtomicU64,
    /// Move streams running on it (one at most: [`SessionState::begin_move`]),
    /// and when it was last used: sessions of clients that vanished without
    /// CloseSession are reaped when idle.
    pub active: AtomicU64,
    pub last_used: Mutex<Instant>,
    /// A Move stream was opened on it, or a buffer grant made (before,
    /// `--session-grace` applies; after, the idle time).
    pub moved: AtomicBool,
    /// Who opened it, and the name it gave (cut at what a log line shows).
    pub client: ClientId,
    pub client_name: String,
}

impl Entry for SessionState {
    fn client(&self) -> ClientId {
        self.client
    }

    fn usage(&self) -> Usage {
        Usage {
            active: self.active.load(Relaxed) > 0,
            moved: self.moved.load(Relaxed),
            last_used: *self.last_used.lock().unwrap(),
        }
    }
}

/// A session's one Move stream, while it runs: taken by
/// [`SessionState::begin_move`], given back when dropped.
pub struct MoveSlot(Arc<SessionState>);

impl Drop for MoveSlot {
    fn drop(&mut self) {
        // Used until now: the reaper never sees it idle with a stale time.
        *self.0.last_used.lock().unwrap() = Instant::now();
        self.0.active.fetch_sub(1, AcqRel);
    }
}

/// One more rail of a session: its QP and the domain its grants are
/// registered in.
pub struct SessionRail {
    domain: Arc<dyn Domain>,
    qp: Arc<VerbsChannel>,
}

impl SessionState {
    /// The session's Move stream, unless one runs already: a session runs
    /// one at a time (each stream's limits, windows and open files, are
    /// the session's).
    pub fn begin_move(self: &Arc<Self>) -> Option<MoveSlot> {
        self.active
            .compare_exchange(0, 1, AcqRel, Acquire)
            .ok()
            .map(|_| MoveSlot(self.clone()))
    }

    /// The domains of rails 1.. (each grant is made reachable through all
    /// of them after `domain`).
    pub fn rail_domains(&self) -> impl Iterator<Item = &Arc<dyn Domain>> {
        self.rails.iter().map(|r| &r.domain)
    }
}

/// The answer to a session id this client has no session under.
pub(super) fn unknown_session(id: u64) -> ControlError {
    ControlError::Invalid(format!(
        "unknown session {id:#x} (closed, or never opened: a session that opens no \
         Move stream within rcpd's --session-grace is closed)"
    ))
}

/// The MESSAGE frames of a tcp session's connections: notices of
/// operations under its standing grants, on the data path
/// ([`super::BufferGrants::notify_frame`]). Only the session's client
/// holds the key that binds a connection to it, as for its rkeys. Holds
/// the session weakly (the session holds the domain that holds this).
struct SessionMessages {
    buffers: Arc<dyn super::BufferGrants>,
    session: std::sync::Weak<SessionState>,
    id: u64,
}

impl crate::provider::tcp::Messages for SessionMessages {
    fn message(&self, payload: &[u8]) -> crate::provider::tcp::Answer {
        let s = self.session.upgrade();
        if let Some(s) = &s {
            *s.last_used.lock().unwrap() = Instant::now();
        }
        self.buffers.notify_frame(s.as_deref(), self.id, payload)
    }
}

/// [`Service::buffer_call`]'s: the buffers' service and the session while
/// it is open.
pub(super) type BufferCall = (Arc<dyn super::BufferGrants>, Option<Arc<SessionState>>);

impl Service {
    /// Session `id`, for the client that opened it: to any other client
    /// it does not exist (a client with the token is trusted with its own
    /// transfers, not with another's session).
    pub(super) fn session(&self, id: u64, client: ClientId) -> Result<Arc<SessionState>> {
        self.session_if_open(id, client)?
            .ok_or_else(|| unknown_session(id))
    }

    /// For a buffer call about session `id` of `req`'s client: the
    /// buffers' service (an rcpd without it answers UNIMPLEMENTED) and the
    /// session while it is open, its idle time started again.
    pub(super) fn buffer_call<T>(
        &self,
        req: &tonic::Request<T>,
        id: u64,
    ) -> std::result::Result<BufferCall, tonic::Status> {
        let Some(b) = self.buffers.clone() else {
            return Err(tonic::Status::unimplemented(
                "this rcpd does not grant buffers",
            ));
        };
        let session = self.session_if_open(id, ClientId::of(req))?;
        if let Some(s) = &session {
            *s.last_used.lock().unwrap() = std::time::Instant::now();
        }
        Ok((b, session))
    }

    /// Session `id` if it is still open (`None` once closed), refused as
    /// unknown when another client opened it.
    pub(super) fn session_if_open(
        &self,
        id: u64,
        client: ClientId,
    ) -> Result<Option<Arc<SessionState>>> {
        match self.sessions.get(id) {
            Some(s) if s.client != client => Err(unknown_session(id)),
            s => Ok(s),
        }
    }

    /// What this rcpd offers a session (the handshake's other half).
    fn terms(&self) -> Terms {
        Terms {
            runs: self.link.kind,
            serves: [ProviderKind::Verbs, ProviderKind::Tcp]
                .into_iter()
                .filter(|&k| self.link.serves(k))
                .collect(),
            checks: self.cfg.checks.clone(),
            window_size: self.link.window_size as u64,
            max_windows: self
                .cfg
                .windows_per_session
                .min(self.link.slots.capacity() as u32),
            max_open_files: self.cfg.max_open_files,
            timeout_ns: self.cfg.timeout.as_nanos() as u64,
        }
    }

    pub(super) fn handshake(
        &self,
        client: ClientId,
        req: proto::HandshakeRequest,
    ) -> std::result::Result<proto::HandshakeResponse, tonic::Status> {
        // The protocol decides (`protocol::negotiate`); this sets up what
        // it agreed.
        let agreed = negotiate(&req, &self.terms()).map_err(|r| status(r.reason, r.message))?;
        Ok(self.open_session(client, req, agreed)?)
    }

    fn open_session(
        &self,
        client: ClientId,
        req: proto::HandshakeRequest,
        agreed: Agreed,
    ) -> Result<proto::HandshakeResponse> {
        let kind = agreed.provider;
        // The limits checked and a place taken in one step: handshakes
        // setting up their QPs at once cannot pass them.
        self.sweep();
        let place = self.sessions.reserve(client).map_err(|e| {
            let what = format!("handshake refused: {e}");
            self.limited(e.limit(), 1, client, &req.client_name, &what);
            ControlError::Exceeded(e.to_string())
        })?;
        let id = place.id();
        let mut resp = proto::HandshakeResponse {
            session_id: id,
            ..agreed.response()
        };
        let mut qp = None;
        let mut rd = (1, 1);
        let mut rails = Vec::new();
        let sd = match kind {
            ProviderKind::Tcp => {
                let sd = self.link.session_domain(kind)?;
                let t = self.link.tcp_target.as_ref().expect("tcp target");
                resp.tcp_session_key = sd
                    .tcp
                    .as_ref()
                    .expect("a tcp session domain has a key")
                    .key()
                    .to_vec();
                let a = t.local_addr();
                resp.tcp_data_host = if a.ip().is_unspecified() {
                    String::new()
                } else {
                    a.ip().to_string()
                };
                resp.tcp_data_port = u32::from(a.port());
                sd
            }
            ProviderKind::Verbs => {
                let (sd, mut more) =
                    self.verbs_rails(id, &req, agreed.qps_per_rail, &mut resp, &mut rd)?;
                qp = sd.channel.clone();
                rails = more
                    .drain(..)
                    .map(|d| SessionRail {
                        qp: d.channel.expect("a verbs rail has a QP"),
                        domain: d.domain,
                    })
                    .collect();
                sd
            }
        };
        let params = Params {
            rails: 1 + rails.len() as u32,
            ..agreed.params
        };
        let p = params;
        let tcp_domain = sd.tcp_domain.clone();
        let state = Arc::new(SessionState {
            kind,
            params,
            domain: sd.domain,
            _tcp_binding: sd.tcp,
            qp,
            messages: Mutex::new(None),
            rails,
            rd,
            epoch: AtomicU64::new(0),
            active: AtomicU64::new(0),
            last_used: Mutex::new(Instant::now()),
            moved: AtomicBool::new(false),
            client,
            client_name: req
                .client_name
                .chars()
                .take(crate::escape::MAX_LOGGED)
                .collect(),
        });
        if let (Some(d), Some(b)) = (tcp_domain, &self.buffers) {
            d.take_messages(Arc::new(SessionMessages {
                buffers: b.clone(),
                session: Arc::downgrade(&state),
                id,
            }));
        }
        place.commit(state);
        tracing::info!(
            session = format_args!("{id:#x}"),
            %client,
            name = %crate::escape::esc(&req.client_name),
            provider = %kind,
            block_size = p.block_size,
            window_count = p.window_count,
            check = %p.check,
            keepalive_ms = p.keepalive_ns / 1_000_000,
            "session opened"
        );
        Ok(resp)
    }

    /// Verbs: pair the client's rails with rcpd's (the rule of
    /// [`crate::control::rails`], logged a pair at a time), make a QP for
    /// each pair and connect it; fills the response's endpoints and depths.
    /// Each pair's QP gets its rail's domain ([`ServerLink::rail_domain`]:
    /// memory windows where the device has them, else a protection domain
    /// of its own and a registration per grant). Returns rail 0's domain
    /// and those of rails 1.. .
    fn verbs_rails(
        &self,
        id: u64,
        req: &proto::HandshakeRequest,
        per: u32,
        resp: &mut proto::HandshakeResponse,
        rd: &mut (u32, u32),
    ) -> Result<(SessionDomain, Vec<SessionDomain>)> {
        let offered = offered_rails(req)?;
        let client: Vec<RailAddr> = offered
            .iter()
            .map(|o| RailAddr {
                gid: o.ep.gid,
                prefix_len: o.prefix_len,
            })
            .collect();
        // --qps-per-rail: each of rcpd's rails as many times as the
        // client repeated each of its own.
        let per = per as usize;
        let devs = self.link.rails();
        let server: Vec<(usize, RailAddr)> = devs
            .iter()
            .enumerate()
            .flat_map(|(k, d)| std::iter::repeat_n((k, d.rail_addr()), per))
            .collect();
        let addrs: Vec<RailAddr> = server.iter().map(|(_, a)| *a).collect();
        let pairs = pair(&client, &addrs).map_err(|e| ControlError::Invalid(e.to_string()))?;
        let mut domains = Vec::with_capacity(pairs.len());
        let (mut client_rd, mut server_rd, mut resp_rd) = (u32::MAX, u32::MAX, u32::MAX);
        for p in &pairs {
            let (v, cep) = (offered[p.local].params, &offered[p.local].ep);
            let k = server[p.remote].0;
            let dev = devs[k];
            let sd = self.link.rail_domain(k)?;
            let caps = dev.ctx.caps();
            client_rd = client_rd.min(v.max_qp_init_rd_atom.min(caps.max_qp_rd_atom).max(1));
            server_rd = server_rd.min(caps.max_qp_init_rd_atom.min(v.max_qp_rd_atom).max(1));
            resp_rd = resp_rd.min(caps.max_qp_rd_atom);
            domains.push((sd, cep, dev, p));
        }
        *rd = (server_rd, resp_rd);
        let (connected, mtu) = connect_pairs(id, req, domains, *rd, resp)?;
        resp.path_mtu = mtu;
        resp.client_rd_atomic = client_rd;
        resp.server_rd_atomic = server_rd;
        resp.max_inline = offered[connected[0].2].params.max_inline;
        let mut sds = connected.into_iter();
        let (first, dev, _) = sds.next().expect("at least one rail connected");
        resp.verbs = Some(dev.params(first.channel.as_ref().expect("a verbs rail has a QP")));
        let sds = sds.map(|(sd, ..)| sd);
        Ok((first, sds.collect()))
    }

    pub(super) fn reconnect(
        &self,
        client: ClientId,
        req: proto::ReconnectRequest,
    ) -> Result<proto::ReconnectResponse> {
        let s = self.session(req.session_id, client)?;
        let epoch = s.epoch.fetch_add(1, Relaxed) as u32 + 1;
        let qp = match req.rail {
            0 => s.qp.as_ref(),
            k => Some(
                &s.rails
                    .get(k as usize - 1)
                    .ok_or_else(|| {
                        ControlError::Invalid(format!(
                            "reconnect of rail {k}: the session has {} rail(s)",
                            s.rails.len() + 1
                        ))
                    })?
                    .qp,
            ),
        };
        match qp {
            None => Ok(proto::ReconnectResponse {
                endpoint: None,
                epoch,
            }),
            Some(q) => {
                let cep: QpEndpoint =
                    ep_from_proto(req.endpoint.as_ref().ok_or_else(|| {
                        ControlError::Invalid("reconnect without endpoint".into())
                    })?)?;
                // Reset and connect under one lock: no bind or invalidate
                // of a memory window comes in between. Windows bound
                // before stay bound (rxe keeps a type-2 window's binding
                // across ERR -> RESET -> RTS: the client reposts into
                // them), and are revoked by deallocation when done;
                // windows granted while the QP could not send are bound
                // before the lock is let go, so the client's rejoined rail
                // finds them.
                let ep = q
                    .reconnect(&cep, &connect_params(s.rd.0, s.rd.1, QpRetry::default()))
                    .map_err(|e| ControlError::Provider(e.into()))?;
                Ok(proto::ReconnectResponse {
                    endpoint: Some(ep_to_proto(&ep)),
                    epoch,
                })
            }
        }
    }
}

impl Service {
    /// `BufferMessages`: a message QP for session `req.session_id`'s
    /// notices (verbs sessions only), connected to the client's; it
    /// replaces the session's last one and goes with the session.
    pub(super) fn buffer_messages(
        &self,
        client: ClientId,
        req: proto::BufferMessagesRequest,
    ) -> std::result::Result<proto::BufferMessagesResponse, tonic::Status> {
        let Some(buffers) = self.buffers.clone() else {
            return Err(tonic::Status::unimplemented(
                "this rcpd does not grant buffers",
            ));
        };
        let s = self.session(req.session_id, client)?;
        let qp = s.qp.as_ref().ok_or_else(|| {
            ControlError::Invalid(format!(
                "session {:#x} is not over verbs: its notices go on its tcp connections",
                req.session_id
            ))
        })?;
        let cep = ep_from_proto(
            req.endpoint
                .as_ref()
                .ok_or_else(|| ControlError::Invalid("BufferMessages without endpoint".into()))?,
        )?;
        let provider = |e: crate::verbs::VerbsError| ControlError::Provider(e.into());
        let prep = qp.prepare_messages().map_err(provider)?;
        let ep = prep.endpoint();
        let m = SessionMessages {
            buffers,
            session: Arc::downgrade(&s),
            id: req.session_id,
        };
        // The messenger posts its answers later on its own thread: what
        // comes after an answer runs before it here.
        let handler: crate::verbs::messages::Handler = Box::new(move |payload| {
            let a = crate::provider::tcp::Messages::message(&m, payload);
            if let Some(then) = a.then {
                then();
            }
            a.bytes
        });
        let messenger = prep
            .connect(
                &cep,
                &connect_params(1, 1, QpRetry::default()),
                Some(handler),
                &format!("rcpd-msg-{:x}", req.session_id & 0xffff),
            )
            .map_err(provider)?;
        let old = s.messages.lock().unwrap().replace(messenger);
        drop(old);
        tracing::info!(
            session = format_args!("{:#x}", req.session_id),
            "message QP connected: notices come on it"
        );
        Ok(proto::BufferMessagesResponse {
            endpoint: Some(ep_to_proto(&ep)),
        })
    }
}

/// One of the client's rails as its handshake offers it.
struct Offered<'a> {
    params: &'a proto::VerbsParams,
    prefix_len: u8,
    ep: QpEndpoint,
}

/// The client's rails, each with its endpoint (an older client's one
/// unnamed rail: its `verbs` params, prefix 0).
fn offered_rails(req: &proto::HandshakeRequest) -> Result<Vec<Offered<'_>>> {
    let offered: Vec<(&proto::VerbsParams, u8)> = if req.rails.is_empty() {
        vec![(
            req.verbs.as_ref().ok_or_else(|| {
                ControlError::Invalid("verbs chosen but the request has no verbs params".into())
            })?,
            0,
        )]
    } else {
        req.rails
            .iter()
            .map(|r| {
                let v = r
                    .verbs
                    .as_ref()
                    .ok_or_else(|| ControlError::Invalid("a rail without verbs params".into()))?;
                Ok((v, r.prefix_len.min(128) as u8))
            })
            .collect::<Result<_>>()?
    };
    offered
        .into_iter()
        .map(|(params, prefix_len)| {
            let ep = ep_from_proto(params.endpoint.as_ref().ok_or_else(|| {
                ControlError::Invalid("verbs params without an endpoint".into())
            })?)?;
            Ok(Offered {
                params,
                prefix_len,
                ep,
            })
        })
        .collect()
}

/// A pair's domain, the client's endpoint, rcpd's device and the pairing.
type PairDomain<'a> = (SessionDomain, &'a QpEndpoint, &'a Device, &'a RailPair);

/// A connected pair's domain, rcpd's device and the client's rail.
type Connected<'a> = (SessionDomain, &'a Device, usize);

/// Connect each pair's QP with `rd` (rcpd's read depths); with several
/// pairs one that cannot connect (its port went down) is left out and the
/// client sees fewer pairs. Fills the response's pairings (a client that
/// named its rails); returns the connected domains with their device and
/// client rail, and the path MTU they share.
fn connect_pairs<'a>(
    id: u64,
    req: &proto::HandshakeRequest,
    domains: Vec<PairDomain<'a>>,
    rd: (u32, u32),
    resp: &mut proto::HandshakeResponse,
) -> Result<(Vec<Connected<'a>>, u32)> {
    let several = domains.len() > 1;
    let mut connected = Vec::with_capacity(domains.len());
    let mut first_err = None;
    let mut mtu = u32::MAX;
    for (sd, cep, dev, p) in domains {
        let ch = sd.channel.clone().expect("a verbs session domain has a QP");
        match ch.handshake(cep, &connect_params(rd.0, rd.1, QpRetry::default())) {
            Ok(()) => {}
            Err(e) if several => {
                tracing::warn!(
                    session = format_args!("{id:#x}"),
                    rail = %dev.rail_name(),
                    error = %e,
                    "rail left out of this session"
                );
                first_err.get_or_insert(e);
                continue;
            }
            Err(e) => return Err(ControlError::Provider(e.into())),
        }
        mtu = mtu.min(cep.mtu.min(ch.endpoint().mtu));
        tracing::info!(
            session = format_args!("{id:#x}"),
            client_rail = p.local,
            client_gid = %cep.gid,
            rail = %dev.rail_name(),
            gid = %dev.gid,
            by = %p.by,
            "rail paired"
        );
        if !req.rails.is_empty() {
            resp.rails.push(proto::RailPairing {
                client_rail: p.local as u32,
                verbs: Some(dev.params(&ch)),
                paired_by: p.by.to_string(),
            });
        }
        connected.push((sd, dev, p.local));
    }
    if connected.is_empty() {
        let e = first_err.expect("a pair failed to connect");
        return Err(ControlError::Provider(e.into()));
    }
    Ok((connected, mtu))
}
