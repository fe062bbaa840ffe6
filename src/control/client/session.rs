//! A client session: the handshake, and the data path it sets up once for
//! every file moved over it.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;

use super::{Client, ClientOptions, Rpc};
use crate::control::error::{status_reason, ControlError, Reason, Result};
use crate::control::link::{
    connect_params, ep_from_proto, ep_to_proto, rails_or_default, resolve_transport, tcp_target,
    ClientLink, ClientRail,
};
use crate::control::protocol::negotiate::{provider_to_wire, timeout_ms, MAX_WINDOWS};
use crate::control::protocol::{check_block_size, check_grant, check_to_wire, Params, Staging};
use crate::control::rails::MAX_QPS_PER_RAIL;
use crate::control::{VERSION_MAJOR, VERSION_MINOR, WINDOW_SIZE};
use crate::datapath::config::DEFAULT_MAX_INLINE;
use crate::datapath::lend::{LendingPath, RailRegs};
use crate::datapath::RailKeys;
use crate::datapath::{DataPath, DataPathConfig, PollMode, RailSpec, Report};
use crate::parse::RailName;
use crate::proto;
use crate::provider::verbs::{VerbsChannel, VerbsDomain};
use crate::provider::{Channel, ProviderKind};
use crate::verbs::PortWatcher;

/// Sees files start, progress and finish (the binary draws bars, the Copy
/// API counts).
pub trait Observer: Send + Sync {
    fn file_start(&self, _name: &str, _len: u64) {}
    fn progress(&self, _bytes: u64) {}
    fn file_done(&self, _r: &FileResult) {}
}

/// An observer that ignores everything.
pub struct Quiet;
impl Observer for Quiet {}

/// The outcome of one file.
#[derive(Clone, Debug, Default)]
pub struct FileResult {
    /// Push: the remote path relative to the server root; pull: the local
    /// path.
    pub path: String,
    /// Where it came from: push, the local path; pull, the remote path.
    pub source: String,
    pub length: u64,
    /// Bytes moved over the data path (less than `length` after a resume).
    pub moved: u64,
    /// The file digest (derived from the block digests).
    pub digest: Vec<u8>,
    /// The flat SHA-256, when asked for.
    pub flat_sha256: Option<Vec<u8>>,
    pub seconds: f64,
    pub resumed: bool,
}

/// What a session's data path did, for summaries and metrics.
#[derive(Clone, Debug, Default)]
pub struct SessionStats {
    pub report: Report,
    /// Each rail's `device:port`, in the data path's order (empty: tcp).
    pub rails: Vec<String>,
}

/// A session: one data path, any number of files.
pub struct Session {
    pub(super) rpc: Rpc,
    pub(super) opts: ClientOptions,
    /// The data path, lent the staging's blocks window by window (the
    /// lending path keeps a window's block until its end, also past a
    /// stream that failed, until it is closed).
    pub(super) dp: Option<LendingPath>,
    /// The staging's registrations on every rail of the data path (its
    /// windows' `regs`; rail 0's key is each window's `lkey`); `None`: a
    /// session that maps no staging ([`Client::bare_session`]). Declared
    /// before `link`: they go before the link's QPs and arena.
    pub(super) staging: Option<Arc<RailRegs>>,
    pub(super) link: Arc<ClientLink>,
    pub(super) id: u64,
    pub(super) params: Params,
    /// The next window's id on the data path (unique for the session's
    /// life: a failed stream's windows may still be lent).
    pub(super) next_window: u64,
    /// A stream failed (it may have left windows in the data path): no
    /// other runs on the session.
    pub(super) broken: bool,
    /// Each rail's `device:port`, in the data path's order.
    pub(super) rail_names: Vec<String>,
    /// Verbs: each data-path rail's index in `link.rails`.
    pub(super) used: Vec<usize>,
    /// Set when the stream gave up on RDMA because every rail stayed down
    /// (`ClientOptions::tcp_fallback_after`): why, for the user.
    pub(super) fallback: Option<String>,
    /// What the session's files did (the data path's report is filed
    /// under it).
    pub(super) direction: Option<proto::Direction>,
    /// Which provider and why (for the user).
    pub transport: String,
    pub kind: ProviderKind,
    /// TCP: where the data connections go and their key (a connection of
    /// its own carries messages, [`crate::provider::tcp::wire::Op::Message`]).
    pub(super) tcp_target: Option<DataTarget>,
}

/// The data-path settings a client uses on `kind`.
pub fn datapath_config(kind: ProviderKind, o: &ClientOptions) -> DataPathConfig {
    let batch = o.batch.clamp(1, 64);
    DataPathConfig {
        batch,
        signal_every: o.signal_every.clamp(1, batch),
        max_inline: o.inline,
        poll_mode: o.poll_mode.unwrap_or(PollMode::default_for(kind)),
        cq_cpu: o.cq_cpu,
        qp_retry: o.qp_retry,
        // A request outstanding this long means the peer or the link is
        // gone: the error path takes over.
        request_timeout: o.timeout,
        rate_limit: o
            .bwlimit
            .filter(|&r| r > 0)
            .map(crate::datapath::RateLimit::new),
        ..DataPathConfig::default()
    }
}

impl Client {
    /// Open a session: provider, handshake, data path.
    pub async fn session(&self) -> Result<Session> {
        let (kind, why) = resolve_transport(self.opts.transport, &self.opts.rails);
        self.session_with(kind, why).await
    }

    /// [`Client::session`] with the provider already chosen.
    pub async fn session_with(&self, kind: ProviderKind, why: String) -> Result<Session> {
        self.open_session(kind, why, true).await
    }

    /// A session that maps no staging: its link, handshake and data path
    /// only, for windows whose bytes are registered apart (buffer
    /// operations post from services' pages). It moves no files.
    pub(crate) async fn bare_session(&self, kind: ProviderKind, why: String) -> Result<Session> {
        self.open_session(kind, why, false).await
    }

    async fn open_session(
        &self,
        kind: ProviderKind,
        why: String,
        staging: bool,
    ) -> Result<Session> {
        let o = self.opts.clone();
        let bs = check_block_size(o.block_size, WINDOW_SIZE as u64).map_err(ControlError::Usage)?;
        o.check_bwlimit()?;
        // Without staging the handshake still asks for one window (rcpd
        // grants at least one); no stream runs to use it.
        let windows = if staging {
            o.windows.clamp(1, MAX_WINDOWS)
        } else {
            1
        };
        let per = o.qps_per_rail.clamp(1, MAX_QPS_PER_RAIL);
        let link = open_link(&o, kind, if staging { windows } else { 0 }, per).await?;
        crate::phase::mark("staging mapped and registered");
        let req = handshake_request(&o, kind, &link, per, bs, windows);
        let resp = self.rpc.clone().handshake(req.clone()).await?.into_inner();
        crate::phase::mark("handshake answered");
        // The protocol checks what was granted (`protocol::check_grant`).
        let mut params = check_grant(
            &req,
            &resp,
            &Staging {
                slot_size: WINDOW_SIZE as u64,
                transfers: o.transfers,
                timeout_ns: o.timeout.as_nanos() as u64,
            },
        )?;
        if params.check.is_none() {
            tracing::warn!(
                "--verify none: blocks are not checked end to end, only by the link's CRCs"
            );
        }
        let link = Arc::new(link);
        let started = match kind {
            ProviderKind::Tcp => self.tcp_data_path(&o, &link, &resp).await?,
            ProviderKind::Verbs => {
                let s = self.verbs_data_path(&o, &link, &resp).await?;
                params.rails = s.rail_names.len() as u32;
                s
            }
        };
        let dp = started.dp;
        let events = dp
            .take_events()
            .ok_or_else(|| ControlError::Other("the data path's events are taken".into()))?;
        let lp = LendingPath::new(dp, events, started.keys)
            .map_err(|e| ControlError::Other(e.to_string()))?;
        let staging = match link.staging_regs(&started.used) {
            Some(regs) => Some(
                lp.rail_regs(regs)
                    .map_err(|e| ControlError::Other(format!("staging keys: {e}")))?,
            ),
            None => None,
        };
        crate::phase::mark("data path started");
        Ok(Session {
            rpc: self.rpc.clone(),
            opts: o,
            dp: Some(lp),
            staging,
            link,
            id: resp.session_id,
            params,
            next_window: 1,
            broken: false,
            rail_names: started.rail_names,
            used: started.used,
            fallback: None,
            direction: None,
            transport: why,
            kind,
            tcp_target: started.tcp_target,
        })
    }

    /// The tcp provider's data path: one connection, which cannot be
    /// reconnected (a break is retried with `--resume`).
    async fn tcp_data_path(
        &self,
        o: &ClientOptions,
        link: &Arc<ClientLink>,
        resp: &proto::HandshakeResponse,
    ) -> Result<Started> {
        let (l2, r2, host) = (link.clone(), resp.clone(), self.host.clone());
        let (channel, target) = tokio::task::spawn_blocking(move || {
            let target = tcp_target(&r2, &host)?;
            Ok::<_, ControlError>((l2.connect_tcp(target.0, target.1)?, target))
        })
        .await
        .map_err(|e| ControlError::Other(e.to_string()))??;
        crate::phase::mark("tcp data connections up");
        let reconnect: crate::datapath::ReconnectFn = Box::new(|| {
            Err(crate::datapath::ReconnectError::permanent(
                "the TCP data connection broke; rerun with --resume",
            ))
        });
        let cfg = datapath_config(ProviderKind::Tcp, o);
        let dp = DataPath::start(cfg, channel.clone(), reconnect, None)
            .map_err(ControlError::DataPath)?;
        if let Some(m) = &o.metrics {
            let sq = channel.caps().sq_depth;
            m.track("tcp", resp.session_id as u32, sq, sq, dp.stats());
        }
        Ok(Started {
            dp,
            keys: None,
            rail_names: Vec::new(),
            used: Vec::new(),
            tcp_target: Some(target),
        })
    }

    /// The verbs data path: the rails the server paired connected, one
    /// [`RailSpec`] each.
    async fn verbs_data_path(
        &self,
        o: &ClientOptions,
        link: &Arc<ClientLink>,
        resp: &proto::HandshakeResponse,
    ) -> Result<Started> {
        let (l2, r2, retry) = (link.clone(), resp.clone(), o.qp_retry);
        let used = tokio::task::spawn_blocking(move || l2.connect_rails(&r2, retry))
            .await
            .map_err(|e| ControlError::Other(e.to_string()))??;
        let rail_names = used
            .iter()
            .map(|&l| link.rails[l].device.rail_name())
            .collect();
        for (k, (&local, p)) in used.iter().zip(&resp.rails).enumerate() {
            tracing::info!(
                rail = k,
                device = %link.rails[local].device.rail_name(),
                gid = %link.rails[local].device.gid,
                by = %p.paired_by,
                "session rail"
            );
        }
        let keys = (used.len() > 1).then(|| Arc::new(RailKeys::default()));
        let epoch = Arc::new(AtomicU32::new(0));
        let specs = used
            .iter()
            .enumerate()
            .map(|(k, &local)| {
                let reconnect = reconnector(
                    link.rails[local].channel.clone(),
                    &self.rpc,
                    resp.session_id,
                    resp.client_rd_atomic,
                    retry,
                    epoch.clone(),
                );
                rail_spec(&link.rails[local], k, reconnect, keys.as_ref())
            })
            .collect();
        let cfg = datapath_config(ProviderKind::Verbs, o);
        let dp = DataPath::start_rails(cfg, specs).map_err(ControlError::DataPath)?;
        let first = &link.rails[used[0]];
        if let Some(m) = &o.metrics {
            let sq = first.channel.caps().sq_depth;
            m.track(
                first.device.ctx.name(),
                first.channel.endpoint().qpn,
                sq,
                sq,
                dp.stats(),
            );
        }
        Ok(Started {
            dp,
            keys,
            rail_names,
            used,
            tcp_target: None,
        })
    }
}

/// A session's data path as started, and what the session keeps of it.
struct Started {
    dp: DataPath,
    keys: Option<Arc<RailKeys>>,
    /// Verbs: each rail's `device:port`.
    rail_names: Vec<String>,
    /// Verbs: each rail's index in the link's rails.
    used: Vec<usize>,
    /// TCP: [`Session::tcp_target`].
    tcp_target: Option<DataTarget>,
}

/// Where a tcp session's data connections go and the key they open with.
pub type DataTarget = (
    std::net::SocketAddr,
    Option<[u8; crate::provider::tcp::wire::KEY_LEN]>,
);

/// The session's staging, registered with `kind`'s provider (verbs: on
/// every rail, `per` queue pairs each).
async fn open_link(
    o: &ClientOptions,
    kind: ProviderKind,
    windows: u32,
    per: u32,
) -> Result<ClientLink> {
    let gid = o.gid_index;
    // Each rail `per` times, a QP each.
    let names: Vec<RailName> = match kind {
        ProviderKind::Verbs => rails_or_default(&o.rails, gid)
            .iter()
            .flat_map(|r| std::iter::repeat_n(r.clone(), per as usize))
            .collect(),
        ProviderKind::Tcp => Vec::new(),
    };
    // Ask the QP for inline room; the data path clamps per WR.
    let inline = o.inline.unwrap_or(DEFAULT_MAX_INLINE);
    let link = tokio::task::spawn_blocking(move || {
        ClientLink::open(kind, &names, gid, WINDOW_SIZE, windows as usize, inline)
    })
    .await
    .map_err(|e| ControlError::Other(e.to_string()))??;
    Ok(link)
}

/// What the client asks for in its handshake.
fn handshake_request(
    o: &ClientOptions,
    kind: ProviderKind,
    link: &ClientLink,
    per: u32,
    block_size: u64,
    windows: u32,
) -> proto::HandshakeRequest {
    proto::HandshakeRequest {
        version_major: VERSION_MAJOR,
        version_minor: VERSION_MINOR,
        providers: vec![provider_to_wire(kind) as i32],
        verbs: link.verbs_params(),
        rails: link.rail_params(),
        qps_per_rail: per,
        block_size,
        client_name: std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default(),
        checks: o.verify.iter().map(|&c| check_to_wire(c) as i32).collect(),
        window_count: windows,
        timeout_ms: timeout_ms(o.timeout.as_nanos() as u64),
    }
}

/// Rail `k` of a verbs session: its port watched, and with several rails
/// (`keys`) a fence and (past rail 0) a key map.
fn rail_spec(
    rail: &ClientRail,
    k: usize,
    reconnect: crate::datapath::RailReconnectFn,
    keys: Option<&Arc<RailKeys>>,
) -> RailSpec {
    let ch: Arc<dyn Channel> = rail.channel.clone();
    let mut spec = RailSpec::new(ch, reconnect);
    spec.numa_node = rail.device.ctx.numa_node();
    // Watch the port's async events so a reconnect after a link cut starts
    // as soon as the port is ACTIVE again (and, with several rails, a port
    // going down fails its rail at once). Best effort: without it the
    // reconnect backs off blind.
    match PortWatcher::spawn(&rail.device.ctx, rail.device.port) {
        Ok(w) => spec = spec.with_monitor(Arc::new(w)),
        Err(e) => tracing::warn!(
            error = %e,
            rail = k,
            "cannot watch async events; reconnects back off blind"
        ),
    }
    if keys.is_some() {
        let f = rail.channel.clone();
        spec = spec.with_fence(Box::new(move |_| {
            f.set_error()?;
            Ok(())
        }));
    }
    if let (Some(keys), true) = (keys, k > 0) {
        // The staging's key on this rail; memory registered apart (a
        // buffer session's) enters its own keys.
        spec = spec.with_keys(keys.map_for(k, rail.lkey));
    }
    spec
}

impl ClientOptions {
    /// Refuse a rate so low that one window takes longer than half the
    /// progress timeout: a window is done (progress, for both ends) only
    /// when all of it has moved, so at that rate the stream would time out.
    pub fn check_bwlimit(&self) -> Result<()> {
        let Some(rate) = self.bwlimit.filter(|&r| r > 0) else {
            return Ok(());
        };
        let window = WINDOW_SIZE as f64 / rate as f64;
        let half = self.timeout.as_secs_f64() / 2.0;
        if window > half {
            return Err(ControlError::Usage(format!(
                "--bwlimit {rate} B/s: one {} MiB window would take {window:.0} s, more than \
                 half the {} s --timeout; give a higher rate (K/M/G suffixes) or --timeout {} \
                 or more",
                WINDOW_SIZE >> 20,
                self.timeout.as_secs(),
                (window * 2.0).ceil() as u64
            )));
        }
        Ok(())
    }
}

/// A rail's reconnect callback: reset its QP, exchange fresh endpoints
/// with `Reconnect` (naming the rail) and connect again. The QP steps and
/// a transient status are retried; a refusal by rcpd (the session gone,
/// the token refused, a bad request) or an answer outside the protocol is
/// permanent.
fn reconnector(
    vc: Arc<VerbsChannel>,
    rpc: &Rpc,
    id: u64,
    rd: u32,
    retry: crate::datapath::QpRetry,
    epoch: Arc<AtomicU32>,
) -> crate::datapath::RailReconnectFn {
    let rpc = rpc.clone();
    let handle = tokio::runtime::Handle::current();
    Box::new(move |rail: usize| {
        use crate::datapath::ReconnectError;
        let ep = vc.reset().map_err(ReconnectError::retryable)?;
        let epoch = epoch.fetch_add(1, Relaxed) + 1;
        let resp = handle
            .block_on(rpc.clone().reconnect(proto::ReconnectRequest {
                session_id: id,
                endpoint: Some(ep_to_proto(&ep)),
                epoch,
                rail: rail as u32,
            }))
            .map_err(|s| match status_reason(&s) {
                Reason::Retryable | Reason::Other | Reason::Unspecified => {
                    ReconnectError::retryable(s)
                }
                _ => ReconnectError::permanent(s),
            })?;
        let sep = resp
            .into_inner()
            .endpoint
            .ok_or_else(|| ReconnectError::permanent("the server sent no endpoint"))?;
        let sep = ep_from_proto(&sep).map_err(ReconnectError::permanent)?;
        vc.handshake(&sep, &connect_params(rd, rd, retry))
            .map_err(ReconnectError::retryable)?;
        tracing::info!(epoch, rail, "reconnected");
        Ok(())
    })
}

impl Session {
    /// TCP: where the data connections go and their key.
    pub fn tcp_target(&self) -> Option<DataTarget> {
        self.tcp_target
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// Verbs: the QP of the data path's first rail (a message QP for the
    /// session is built on its path, [`VerbsChannel::prepare_messages`]).
    ///
    /// [`VerbsChannel::prepare_messages`]: crate::provider::verbs::VerbsChannel::prepare_messages
    pub fn first_rail(&self) -> Option<Arc<crate::provider::verbs::VerbsChannel>> {
        let k = *self.used.first()?;
        Some(self.link.rails.get(k)?.channel.clone())
    }

    /// The data path's live counters (bytes confirmed as each chain of
    /// blocks completes), for progress between windows.
    pub fn data_path_stats(&self) -> Option<Arc<crate::datapath::DataPathStats>> {
        self.dp.as_ref().and_then(|dp| dp.stats().cloned())
    }

    /// Why the last transfer gave up on RDMA (`--transport auto`, every
    /// rail down past `tcp_fallback_after`): the jobs policy then continues
    /// over tcp.
    pub fn fallback(&self) -> Option<&str> {
        self.fallback.as_deref()
    }

    /// The rails of the session's data path (1: one QP, or tcp).
    pub fn rails(&self) -> usize {
        self.dp
            .as_ref()
            .and_then(LendingPath::stats)
            .map_or(1, |s| s.rails.len())
    }

    pub fn block_size(&self) -> u64 {
        self.params.block_size
    }

    /// Windows of staging the session maps (and rcpd granted it at once);
    /// 0 for a session that maps none.
    pub fn windows(&self) -> u32 {
        if self.staging.is_some() {
            self.params.window_count
        } else {
            0
        }
    }

    /// The block check the handshake agreed on; file digests are derived
    /// from its block digests ([`crate::files::Check::digest_format`]).
    pub fn check(&self) -> crate::files::Check {
        self.params.check
    }

    /// rcpd's retry bound (the handshake's `max_retries`): rounds a damaged
    /// block, or a buffer's range, moves again before it fails.
    pub fn max_retries(&self) -> u32 {
        self.params.max_retries
    }

    /// The lending path, for a driver of its own (buffers,
    /// `control::buffers::sessions`); the session keeps its link and rcpd's
    /// resources until it is closed or dropped.
    pub(crate) fn take_data_path(&mut self) -> Option<LendingPath> {
        self.dp.take()
    }

    /// The domains the session's local memory registers in, one per rail
    /// of its data path in its order (each rail's protection domain), or
    /// the tcp provider's domain alone.
    pub(crate) fn rail_domains(&self) -> Vec<Arc<dyn crate::provider::Domain>> {
        if let Some(d) = &self.link.tcp_domain {
            return vec![d.clone() as Arc<dyn crate::provider::Domain>];
        }
        self.used
            .iter()
            .map(|&l| {
                Arc::new(VerbsDomain {
                    pd: self.link.rails[l].device.pd.clone(),
                }) as Arc<dyn crate::provider::Domain>
            })
            .collect()
    }

    /// Stop the data path and release the server's resources for this
    /// session; what the data path did.
    pub async fn close(mut self) -> Result<SessionStats> {
        let dp = self.dp.take();
        // Closed, the lending path gives back the windows' blocks (unless
        // the device kept requests).
        let report = tokio::task::spawn_blocking(move || dp.map(LendingPath::close))
            .await
            .map_err(|e| ControlError::Other(e.to_string()))?
            .unwrap_or_default();
        if let Some(m) = &self.opts.metrics {
            m.datapath_report(self.direction, &report);
        }
        self.rpc
            .close_session(proto::CloseSessionRequest {
                session_id: self.id,
            })
            .await?;
        Ok(SessionStats {
            report,
            rails: std::mem::take(&mut self.rail_names),
        })
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Close the data path before the staging it may still be writing
        // is unregistered (the fields drop after this).
        if let Some(dp) = self.dp.take() {
            let _ = crate::blocking::in_place(|| dp.close());
        }
    }
}
