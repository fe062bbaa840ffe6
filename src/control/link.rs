//! Provider setup for both ends: the client's staging memory and channel,
//! the server's window arena (registered once for memory windows, or per
//! grant), TCP target and per-session QPs and domains.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use crate::datapath::QpRetry;
use crate::mem::{Arena, ArenaConfig, BlockPool, PeerSpan};
use crate::provider::tcp::{SessionBinding, TcpChannel, TcpDomain, TcpTarget, DEFAULT_CONNS};
use crate::provider::verbs::{MwDomain, RegisteredSlots, VerbsChannel, VerbsDomain};
use crate::provider::{Access, Channel, Domain, ProviderKind, Registration};
use crate::verbs::{
    device_names, ConnectParams, Context, Gid, MwPool, ProtectionDomain, QpBuilder, QpEndpoint,
};

use super::error::{ControlError, Result};
use super::rails::RailAddr;
use crate::parse::RailName;
use crate::proto;

/// Which provider to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// Verbs when an RDMA device has an ACTIVE port, else TCP.
    Auto,
    Verbs,
    Tcp,
}

impl std::str::FromStr for Transport {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Transport::Auto),
            "verbs" | "rdma" => Ok(Transport::Verbs),
            "tcp" => Ok(Transport::Tcp),
            o => Err(format!("unknown transport {o:?} (auto, verbs or tcp)")),
        }
    }
}

/// Resolve `auto`: the provider and a sentence saying why. `rails`: the
/// devices named by `--device` (empty: every device).
pub fn resolve_transport(t: Transport, rails: &[RailName]) -> (ProviderKind, String) {
    match t {
        Transport::Verbs => (ProviderKind::Verbs, "verbs (asked for)".into()),
        Transport::Tcp => (ProviderKind::Tcp, "tcp (asked for)".into()),
        Transport::Auto => {
            let names = match rails {
                [] => device_names(),
                r => r.iter().map(|r| r.device.clone()).collect(),
            };
            if names.is_empty() {
                return (
                    ProviderKind::Tcp,
                    "tcp: no RDMA device found (transport auto)".into(),
                );
            }
            let mut why = Vec::new();
            for n in &names {
                match Context::open(Some(n)).and_then(|c| c.active_port()) {
                    Ok(p) => {
                        return (
                            ProviderKind::Verbs,
                            format!("verbs: {n} port {} is ACTIVE (transport auto)", p.port),
                        )
                    }
                    Err(e) => why.push(format!("{n}: {e}")),
                }
            }
            (
                ProviderKind::Tcp,
                format!(
                    "tcp: no ACTIVE RDMA port (transport auto; {})",
                    why.join("; ")
                ),
            )
        }
    }
}

/// An ACTIVE port seen while choosing the default rails.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortSeen {
    pub rail: RailName,
    pub numa_node: Option<u32>,
    /// The netdev of its GID is in this process's network namespace (a
    /// port whose netdev lives in another one is some other tenant's).
    pub local_netdev: bool,
}

/// The rails taken without `--device`: every ACTIVE port whose netdev is
/// in this network namespace, on the NUMA node of the first of them (the
/// node the arena is placed on; a port of unknown node goes with any).
/// Returns the rails and, for the log, the ports left out with why.
pub fn pick_default_rails(seen: &[PortSeen]) -> (Vec<RailName>, Vec<(RailName, String)>) {
    let mut skipped = Vec::new();
    let ours: Vec<&PortSeen> = seen
        .iter()
        .filter(|p| {
            if !p.local_netdev {
                skipped.push((
                    p.rail.clone(),
                    "its netdev is in another network namespace".into(),
                ));
            }
            p.local_netdev
        })
        .collect();
    let node = ours.iter().find_map(|p| p.numa_node);
    let mut rails = Vec::new();
    for p in ours {
        match (node, p.numa_node) {
            (Some(n), Some(m)) if n != m => skipped.push((
                p.rail.clone(),
                format!("NUMA node {m}, not the arena's node {n}"),
            )),
            _ => rails.push(p.rail.clone()),
        }
    }
    (rails, skipped)
}

/// Every ACTIVE port of every device, for [`pick_default_rails`].
fn ports_seen(gid_index: Option<u32>) -> Vec<PortSeen> {
    let mut out = Vec::new();
    for name in device_names() {
        let Ok(ctx) = Context::open(Some(&name)) else {
            continue;
        };
        for p in 1..=ctx.caps().phys_port_cnt.max(1) {
            let Ok(port) = ctx.port(p) else { continue };
            if port.state != crate::verbs::PortState::Active {
                continue;
            }
            let netdev = crate::verbs::gid_table(&ctx, p, port.gid_tbl_len)
                .ok()
                .and_then(|t| crate::verbs::choose_gid(&t, gid_index).ok())
                .and_then(|c| c.entry.netdev);
            out.push(PortSeen {
                rail: RailName {
                    device: name.clone(),
                    port: Some(p),
                },
                numa_node: ctx.numa_node(),
                // Without a netdev (InfiniBand) the port is nobody else's.
                local_netdev: netdev
                    .is_none_or(|n| std::path::Path::new("/sys/class/net").join(n).exists()),
            });
        }
    }
    out
}

/// `rails`, or (empty) the default ([`pick_default_rails`]), logged.
pub fn rails_or_default(rails: &[RailName], gid_index: Option<u32>) -> Vec<RailName> {
    if !rails.is_empty() {
        return rails.to_vec();
    }
    let (picked, skipped) = pick_default_rails(&ports_seen(gid_index));
    for (r, why) in &skipped {
        tracing::info!(rail = %r, "rail not used by default: {why}");
    }
    if !picked.is_empty() {
        tracing::info!(
            rails = %crate::parse::RailList(picked.clone()),
            "no --device: every ACTIVE port of this namespace and NUMA node"
        );
    }
    picked
}

pub fn ep_to_proto(e: &QpEndpoint) -> proto::QpEndpoint {
    proto::QpEndpoint {
        qpn: e.qpn,
        psn: e.psn,
        gid: e.gid.0.to_vec(),
        lid: u32::from(e.lid),
        mtu: e.mtu,
    }
}

pub fn ep_from_proto(e: &proto::QpEndpoint) -> Result<QpEndpoint> {
    let gid: [u8; 16] = e.gid.as_slice().try_into().map_err(|_| {
        ControlError::Invalid(format!("QP endpoint GID has {} bytes, not 16", e.gid.len()))
    })?;
    if e.qpn == 0 || e.qpn > 0x00ff_ffff || e.psn > 0x00ff_ffff {
        return Err(ControlError::Invalid(format!(
            "QP endpoint qpn {} / psn {} out of the 24-bit range",
            e.qpn, e.psn
        )));
    }
    if !matches!(e.mtu, 256 | 512 | 1024 | 2048 | 4096) {
        return Err(ControlError::Invalid(format!(
            "QP endpoint MTU {} is not one of 256..4096",
            e.mtu
        )));
    }
    Ok(QpEndpoint {
        qpn: e.qpn,
        psn: e.psn,
        gid: Gid(gid),
        lid: u16::try_from(e.lid)
            .map_err(|_| ControlError::Invalid(format!("LID {} out of range", e.lid)))?,
        mtu: e.mtu,
    })
}

/// A device opened with its active port and chosen GID: one rail.
pub struct Device {
    pub ctx: Arc<Context>,
    pub pd: Arc<ProtectionDomain>,
    pub port: u8,
    pub gid_index: u32,
    pub gid: Gid,
    pub gid_reason: String,
}

impl Device {
    /// Open `rail` (`None`: the first device with an ACTIVE port).
    pub fn open(rail: Option<&RailName>, gid_index: Option<u32>) -> Result<Device> {
        let ctx = Context::open(rail.map(|r| r.device.as_str())).map_err(provider)?;
        let (port, gid) = ctx
            .select_rail_port(rail.and_then(|r| r.port), gid_index)
            .map_err(provider)?;
        let pd = ProtectionDomain::new(&ctx).map_err(provider)?;
        Ok(Device {
            ctx,
            pd,
            port: port.port,
            gid_index: gid.entry.index,
            gid: gid.entry.gid,
            gid_reason: gid.reason,
        })
    }

    /// `device:port`, for logs and summaries.
    pub fn rail_name(&self) -> String {
        format!("{}:{}", self.ctx.name(), self.port)
    }

    /// The rail's address for pairing (the subnet's prefix is not known
    /// here: [`RailAddr`]'s default applies).
    pub fn rail_addr(&self) -> RailAddr {
        RailAddr {
            gid: self.gid,
            prefix_len: 0,
        }
    }

    /// A QP on the device's port and GID, in `pd` (it reaches only memory
    /// registered in `pd`): the rest is the caller's to set.
    pub fn qp_builder(&self, pd: &Arc<ProtectionDomain>) -> QpBuilder {
        QpBuilder::new(pd, self.port, self.gid_index)
    }

    /// The verbs parameters of `ch`'s QP for the peer.
    pub fn params(&self, ch: &VerbsChannel) -> proto::VerbsParams {
        let caps = self.ctx.caps();
        proto::VerbsParams {
            endpoint: Some(ep_to_proto(&ch.endpoint())),
            max_qp_rd_atom: caps.max_qp_rd_atom,
            max_qp_init_rd_atom: caps.max_qp_init_rd_atom,
            max_inline: ch.caps().max_inline,
        }
    }
}

fn provider(e: crate::verbs::VerbsError) -> ControlError {
    ControlError::Provider(e.into())
}

/// RTR/RTS parameters: initiator and responder depths, and (for the side
/// that issues requests) the ACK timeout and retry count.
pub fn connect_params(init: u32, resp: u32, retry: QpRetry) -> ConnectParams {
    ConnectParams {
        max_rd_atomic: init.clamp(1, 255) as u8,
        max_dest_rd_atomic: resp.clamp(1, 255) as u8,
        timeout: retry.ack_timeout,
        retry_cnt: retry.retry_cnt,
        ..ConnectParams::default()
    }
}

/// One of the client's rails: the device, the session's QP on it and the
/// staging registered in its protection domain.
pub struct ClientRail {
    pub device: Device,
    /// The rail's QP, created before the handshake.
    pub channel: Arc<VerbsChannel>,
    /// The key the staging is registered under in the rail's PD (0: the
    /// link maps no staging).
    pub lkey: u32,
    // Fields drop in order: the QP before the registration.
    _reg: Option<Arc<dyn Registration>>,
}

impl ClientRail {
    /// The handshake's parameters for this rail's QP.
    pub fn params(&self) -> proto::VerbsParams {
        self.device.params(&self.channel)
    }
}

/// The client's local side: staging windows registered with its provider
/// once, for the whole session (verbs: in every rail's PD).
pub struct ClientLink {
    pub kind: ProviderKind,
    /// Verbs: one per rail, in the order given (`--device`, each repeated
    /// `--qps-per-rail` times).
    pub rails: Vec<ClientRail>,
    pub tcp_domain: Option<Arc<TcpDomain>>,
    /// TCP: the staging's registration.
    tcp_reg: Option<Arc<dyn Registration>>,
    /// Staging windows, each laid out like the server window it moves
    /// (`None`: a link that moves no files, only memory registered apart).
    /// Declared last: the arena outlives every registration of it.
    pub slots: Option<BlockPool>,
}

impl ClientLink {
    /// Open the provider and register `windows` staging windows of
    /// `window_size` bytes (0: map no staging at all); verbs: a QP and a
    /// registration on each of `rails` (empty: the first device with an
    /// ACTIVE port).
    pub fn open(
        kind: ProviderKind,
        rails: &[RailName],
        gid_index: Option<u32>,
        window_size: usize,
        windows: usize,
        max_inline: u32,
    ) -> Result<ClientLink> {
        let arena = (windows > 0)
            .then(|| {
                // Verbs registration pins the staging: faulted in now, on
                // its node. The tcp provider pins nothing: pages fault in
                // as a job reaches them, and a small copy never zeroes the
                // rest.
                let acfg = ArenaConfig {
                    prefault: kind == ProviderKind::Verbs,
                    ..ArenaConfig::new(window_size * windows)
                };
                Arena::new(&acfg).map_err(|e| ControlError::Other(format!("staging arena: {e}")))
            })
            .transpose()?;
        let staging = match &arena {
            Some(a) => Some(
                PeerSpan::new(a, a.addr(), a.len())
                    .ok_or_else(|| ControlError::Other("staging span".into()))?,
            ),
            None => None,
        };
        let mut out = Vec::new();
        let mut tcp_domain = None;
        let mut tcp_reg = None;
        match kind {
            ProviderKind::Verbs => {
                let names: Vec<Option<&RailName>> = match rails {
                    [] => vec![None],
                    r => r.iter().map(Some).collect(),
                };
                let several = names.len() > 1;
                let mut first_err = None;
                for name in names {
                    // With several rails, one that cannot open (its port
                    // is down) is left out of this session; the others
                    // carry it.
                    let dev = match Device::open(name, gid_index) {
                        Ok(d) => d,
                        Err(e) if several => {
                            tracing::warn!(
                                rail = %name.map(ToString::to_string).unwrap_or_default(),
                                error = %e,
                                "rail left out of this session"
                            );
                            first_err.get_or_insert(e);
                            continue;
                        }
                        Err(e) => return Err(e),
                    };
                    let reg = match &staging {
                        Some(st) => Some(
                            VerbsDomain { pd: dev.pd.clone() }
                                .register_local(st, Access::LOCAL_WRITE)?,
                        ),
                        None => None,
                    };
                    let qp = dev
                        .qp_builder(&dev.pd)
                        .max_inline(max_inline)
                        .events(true)
                        .build()
                        .map_err(provider)?;
                    out.push(ClientRail {
                        device: dev,
                        channel: Arc::new(qp.into_channel()),
                        lkey: reg.as_ref().map_or(0, |r| r.lkey()),
                        _reg: reg,
                    });
                }
                if out.is_empty() {
                    return Err(first_err.expect("a rail failed to open"));
                }
            }
            ProviderKind::Tcp => {
                let d = TcpDomain::new();
                if let Some(st) = &staging {
                    tcp_reg = Some(d.register_local(st, Access::LOCAL_WRITE)?);
                }
                tcp_domain = Some(d);
            }
        }
        let slots = arena
            .map(|a| a.into_pool(window_size))
            .transpose()
            .map_err(|e| ControlError::Other(format!("staging pool: {e}")))?;
        Ok(ClientLink {
            kind,
            rails: out,
            tcp_domain,
            tcp_reg,
            slots,
        })
    }

    /// The key of the staging on rail 0 (verbs) or the TCP domain (0: no
    /// staging).
    pub fn lkey(&self) -> u32 {
        match (&self.tcp_reg, self.rails.first()) {
            (Some(r), _) => r.lkey(),
            (None, Some(r)) => r.lkey,
            (None, None) => 0,
        }
    }

    /// The staging's registration on each rail of a data path, in its
    /// order: verbs, the rails `used` names (indices in `rails`); tcp, the
    /// domain's one. `None`: the link maps no staging.
    pub fn staging_regs(&self, used: &[usize]) -> Option<Vec<Arc<dyn Registration>>> {
        self.slots.as_ref()?;
        match &self.tcp_reg {
            Some(r) => Some(vec![r.clone()]),
            None => used.iter().map(|&l| self.rails[l]._reg.clone()).collect(),
        }
    }

    /// Verbs parameters of rail 0 for the handshake request.
    pub fn verbs_params(&self) -> Option<proto::VerbsParams> {
        self.rails.first().map(ClientRail::params)
    }

    /// Every rail's parameters for the handshake request.
    pub fn rail_params(&self) -> Vec<proto::RailParams> {
        self.rails
            .iter()
            .map(|r| proto::RailParams {
                verbs: Some(r.params()),
                prefix_len: u32::from(r.device.rail_addr().prefix_len),
            })
            .collect()
    }

    /// Verbs: connect the rails rcpd paired (its `rails`, or rail 0 alone
    /// to an rcpd that sent none); the local rail of each session rail, in
    /// the session's order. `retry`: the QPs' ACK timeout and retry count
    /// (they issue the requests).
    pub fn connect_rails(
        &self,
        resp: &proto::HandshakeResponse,
        retry: QpRetry,
    ) -> Result<Vec<usize>> {
        let pairs: Vec<(usize, &proto::VerbsParams)> = if resp.rails.is_empty() {
            let v = resp.verbs.as_ref().ok_or_else(|| {
                ControlError::Invalid("server chose verbs but sent no endpoint".into())
            })?;
            vec![(0, v)]
        } else {
            let mut seen = std::collections::HashSet::new();
            resp.rails
                .iter()
                .map(|p| {
                    let k = p.client_rail as usize;
                    if k >= self.rails.len() || !seen.insert(k) {
                        return Err(ControlError::Invalid(format!(
                            "rcpd paired client rail {k}, which this rcp has not (it has {}) or gave twice",
                            self.rails.len()
                        )));
                    }
                    let v = p.verbs.as_ref().ok_or_else(|| {
                        ControlError::Invalid("a rail pairing without an endpoint".into())
                    })?;
                    Ok((k, v))
                })
                .collect::<Result<_>>()?
        };
        for &(k, v) in &pairs {
            let rail = &self.rails[k];
            let ep = ep_from_proto(
                v.endpoint
                    .as_ref()
                    .ok_or_else(|| ControlError::Invalid("server sent no QP endpoint".into()))?,
            )?;
            let caps = rail.device.ctx.caps();
            let params = connect_params(
                resp.client_rd_atomic,
                caps.max_qp_rd_atom.min(v.max_qp_init_rd_atom),
                retry,
            );
            rail.channel.handshake(&ep, &params).map_err(provider)?;
        }
        Ok(pairs.into_iter().map(|(k, _)| k).collect())
    }

    /// Connect the data channel: verbs, rail 0 alone ([`connect_rails`]
    /// for several); tcp, the session's connections.
    ///
    /// [`connect_rails`]: Self::connect_rails
    pub fn connect(
        &self,
        resp: &proto::HandshakeResponse,
        server_host: &str,
        retry: QpRetry,
    ) -> Result<Arc<dyn Channel>> {
        match self.kind {
            ProviderKind::Verbs => {
                let used = self.connect_rails(resp, retry)?;
                Ok(self.rails[used[0]].channel.clone())
            }
            ProviderKind::Tcp => {
                let host = if resp.tcp_data_host.is_empty()
                    || resp.tcp_data_host == "0.0.0.0"
                    || resp.tcp_data_host == "::"
                {
                    server_host.to_string()
                } else {
                    resp.tcp_data_host.clone()
                };
                let host = host.trim_start_matches('[').trim_end_matches(']');
                let port = u16::try_from(resp.tcp_data_port).map_err(|_| {
                    ControlError::Invalid(format!("TCP data port {}", resp.tcp_data_port))
                })?;
                let addr: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(&(host, port))
                    .map_err(ControlError::io(format!("resolving {host}")))?
                    .next()
                    .ok_or_else(|| ControlError::Other(format!("{host} has no address")))?;
                let key = match resp.tcp_session_key.len() {
                    0 => None,
                    _ => Some(resp.tcp_session_key.as_slice().try_into().map_err(|_| {
                        ControlError::Invalid(format!(
                            "TCP session key of {} bytes, not 16",
                            resp.tcp_session_key.len()
                        ))
                    })?),
                };
                let ch = TcpChannel::connect_session(
                    self.tcp_domain.clone().expect("tcp link has a domain"),
                    addr,
                    // A connection per staging window at most: a copy of
                    // one window needs one connection (and its threads).
                    DEFAULT_CONNS
                        .min(self.slots.as_ref().map_or(1, BlockPool::capacity))
                        .max(1),
                    128,
                    key,
                )?;
                Ok(Arc::new(ch))
            }
        }
    }
}

/// Whether rcpd gives access to its windows through memory windows
/// (`--memory-windows`, `RCPD_MEMORY_WINDOWS`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MemoryWindows {
    /// Memory windows where the device has type-2 windows, else a
    /// registration per grant (said once in the log, with the reason).
    #[default]
    Auto,
    /// Memory windows or rcpd does not start.
    On,
    /// A protection domain per session and a registration per grant.
    Off,
}

impl std::str::FromStr for MemoryWindows {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(MemoryWindows::Auto),
            "on" => Ok(MemoryWindows::On),
            "off" => Ok(MemoryWindows::Off),
            o => Err(format!(
                "unknown memory-windows mode {o:?} (auto, on or off)"
            )),
        }
    }
}

/// How the server builds its memory and provider.
#[derive(Clone, Debug)]
pub struct ServerLinkConfig {
    pub kind: ProviderKind,
    /// Verbs: the rails rcpd serves on (empty: the default rails); the
    /// arena sits on the first one's NUMA node.
    pub rails: Vec<RailName>,
    pub gid_index: Option<u32>,
    pub arena_bytes: usize,
    pub hugepage_dir: Option<PathBuf>,
    pub window_size: usize,
    /// Where the TCP target listens (port 0: ephemeral).
    pub tcp_listen: SocketAddr,
    /// Verbs: memory windows or a registration per grant.
    pub memory_windows: MemoryWindows,
    /// Verbs: also serve sessions over the tcp provider (rcpd's
    /// `--transport auto`), for clients whose rails are all down.
    pub tcp_fallback: bool,
}

/// How a verbs rcpd makes a granted window reachable.
pub enum WindowAccess {
    /// The arena registered once at start (a region per window slot, in
    /// the device's PD, where every session's QP lives); a grant binds a
    /// type-2 memory window of `pool` to the session's QP.
    MemoryWindows {
        slots: Arc<RegisteredSlots>,
        pool: Arc<MwPool>,
    },
    /// A protection domain per session (its QP in it) and a registration
    /// per grant in it: the device has no type-2 memory windows, or
    /// `--memory-windows off`, or the TCP provider (whose per-grant
    /// registration is a table entry).
    PerGrant {
        /// Why (for the log and `doctor`-style reports).
        reason: String,
    },
}

/// The server's provider: window slots of its arena, the device (verbs) or
/// the TCP target, how windows are made reachable ([`WindowAccess`]), and
/// a domain per session ([`ServerLink::session_domain`]) through which the
/// windows granted to it are reachable.
pub struct ServerLink {
    pub kind: ProviderKind,
    /// Verbs: rail 0 (its PD holds the arena's registration for memory
    /// windows).
    pub device: Option<Device>,
    /// Verbs: rails 1.. (each with the arena registered once in its PD,
    /// like rail 0, where it has memory windows).
    pub extra: Vec<Device>,
    pub tcp_target: Option<TcpTarget>,
    /// How grants reach rail 0's sessions (tcp: per grant).
    pub windows: WindowAccess,
    /// How grants reach the sessions of rails 1.., in the order of `extra`.
    pub extra_windows: Vec<WindowAccess>,
    pub slots: BlockPool,
    pub window_size: usize,
}

/// rcpd's side of a session's QP: it only responds to the client's
/// requests; its send queue carries the binds and invalidates of memory
/// windows, one at a time, whose completions rcpd sleeps for on the CQ's
/// completion channel.
const SERVER_SQ_DEPTH: u32 = 16;

impl ServerLink {
    pub fn open(cfg: &ServerLinkConfig) -> Result<ServerLink> {
        let (device, extra) = match cfg.kind {
            ProviderKind::Verbs => {
                let names = rails_or_default(&cfg.rails, cfg.gid_index);
                let mut devs = match names.as_slice() {
                    [] => vec![Device::open(None, cfg.gid_index)?],
                    n => n
                        .iter()
                        .map(|r| Device::open(Some(r), cfg.gid_index))
                        .collect::<Result<Vec<_>>>()?,
                };
                let first = devs.remove(0);
                (Some(first), devs)
            }
            ProviderKind::Tcp => (None, Vec::new()),
        };
        let mut acfg = ArenaConfig::new(cfg.arena_bytes);
        acfg.hugepage_dir = cfg.hugepage_dir.clone();
        acfg.numa_node = device.as_ref().and_then(|d| d.ctx.numa_node());
        let arena =
            Arena::new(&acfg).map_err(|e| ControlError::Other(format!("window arena: {e}")))?;
        let windows = match &device {
            Some(dev) => window_access(dev, &arena, cfg)?,
            None => WindowAccess::PerGrant {
                reason: "the tcp provider registers each grant (a table entry)".into(),
            },
        };
        let extra_windows = extra
            .iter()
            .map(|dev| window_access(dev, &arena, cfg))
            .collect::<Result<Vec<_>>>()?;
        let slots = arena
            .into_pool(cfg.window_size)
            .map_err(|e| ControlError::Other(format!("window arena: {e}")))?;
        // No default domain: a data connection reaches only the
        // registrations of the session its hello names.
        let tcp_target = if device.is_none() || cfg.tcp_fallback {
            Some(TcpTarget::bind_sessions(cfg.tcp_listen)?)
        } else {
            None
        };
        if let (Some(_), Some(t)) = (&device, &tcp_target) {
            tracing::info!(
                tcp_data = %t.local_addr(),
                "the tcp provider is served too (transport auto): sessions of clients whose \
                 rails are all down continue over it"
            );
        }
        Ok(ServerLink {
            kind: cfg.kind,
            device,
            extra,
            tcp_target,
            windows,
            extra_windows,
            slots,
            window_size: cfg.window_size,
        })
    }

    /// Whether grants bind memory windows (else: a registration each).
    pub fn memory_windows(&self) -> bool {
        matches!(self.windows, WindowAccess::MemoryWindows { .. })
    }

    /// Verbs: every rail, rail 0 first.
    pub fn rails(&self) -> Vec<&Device> {
        self.device.iter().chain(&self.extra).collect()
    }

    /// Verbs: a new session's domain and QP on rail `k` (one per QP of a
    /// session over several rails: a memory window is bound to one QP, so
    /// each grant binds one on each of the session's QPs, in the PD where
    /// that rail's device has the arena registered once; where it has no
    /// memory windows, a protection domain of the session's own there and
    /// a registration per grant).
    pub fn rail_domain(&self, k: usize) -> Result<SessionDomain> {
        let no_rail = || ControlError::Other(format!("rcpd has no rail {k}"));
        let (dev, windows) = match k {
            0 => (self.device.as_ref(), Some(&self.windows)),
            k => (self.extra.get(k - 1), self.extra_windows.get(k - 1)),
        };
        domain_on(dev.ok_or_else(no_rail)?, windows.ok_or_else(no_rail)?)
    }
}

/// A session's domain and QP on `dev`, reaching the arena as `windows`
/// says.
fn domain_on(dev: &Device, windows: &WindowAccess) -> Result<SessionDomain> {
    match windows {
        WindowAccess::MemoryWindows { slots, pool } => {
            let q = dev
                .qp_builder(&dev.pd)
                .sq_depth(SERVER_SQ_DEPTH)
                .remote_access(Access::REMOTE_WRITE | Access::REMOTE_READ)
                .events(true)
                .build()
                .map_err(provider)?;
            let ch = Arc::new(q.into_channel());
            Ok(SessionDomain {
                domain: Arc::new(MwDomain {
                    slots: slots.clone(),
                    pool: pool.clone(),
                    channel: ch.clone(),
                }),
                channel: Some(ch),
                tcp: None,
            })
        }
        WindowAccess::PerGrant { .. } => per_grant_domain(dev),
    }
}

/// A session's domain on `dev` without memory windows: a protection domain
/// of its own, the session's QP in it, a registration per grant.
fn per_grant_domain(dev: &Device) -> Result<SessionDomain> {
    let remote = Access::REMOTE_WRITE | Access::REMOTE_READ;
    let pd = ProtectionDomain::new(&dev.ctx).map_err(provider)?;
    let q = dev
        .qp_builder(&pd)
        .sq_depth(SERVER_SQ_DEPTH)
        .remote_access(remote)
        .build()
        .map_err(provider)?;
    Ok(SessionDomain {
        domain: Arc::new(VerbsDomain { pd }),
        channel: Some(Arc::new(q.into_channel())),
        tcp: None,
    })
}

/// Memory windows if the device has them (and they are not turned off):
/// the arena registered once; otherwise a registration per grant. Said
/// once, with the reason.
fn window_access(dev: &Device, arena: &Arena, cfg: &ServerLinkConfig) -> Result<WindowAccess> {
    let caps = dev.ctx.caps();
    let slots = arena.len() / cfg.window_size.max(1);
    let name = dev.ctx.name();
    let why_not = || -> std::result::Result<(Arc<RegisteredSlots>, Arc<MwPool>), String> {
        if cfg.memory_windows == MemoryWindows::Off {
            return Err("--memory-windows off".into());
        }
        if !caps.mem_windows.type_2() {
            return Err(format!(
                "{name} has no type-2 memory windows (device_cap_flags: {})",
                caps.mem_windows
            ));
        }
        if (caps.max_mw as usize) < slots {
            return Err(format!(
                "{name} allows {} memory windows, fewer than the arena's {slots} window slots",
                caps.max_mw
            ));
        }
        crate::mem::ensure_lockable(arena.len() as u64)
            .map_err(|e| format!("registering the {} MiB arena: {e}", arena.len() >> 20))?;
        let pool = Arc::new(MwPool::new(&dev.pd));
        // One allocated up front: a provider without alloc_mw says so here.
        let probe = pool.take().map_err(|e| e.to_string())?;
        pool.put(probe);
        let regs = RegisteredSlots::register(
            &dev.pd,
            arena,
            cfg.window_size,
            Access::LOCAL_WRITE | Access::MW_BIND,
        )
        .map_err(|e| format!("registering the arena for memory windows: {e}"))?;
        Ok((Arc::new(regs), pool))
    };
    match why_not() {
        Ok((regs, pool)) => {
            tracing::info!(
                device = %name,
                caps = %caps.mem_windows,
                max_mw = caps.max_mw,
                regions = regs.len(),
                arena_mib = arena.len() >> 20,
                "memory windows: the window arena is registered once (a region per window slot, \
                 no remote access of its own); each grant binds a type-2 window to the session's QP"
            );
            Ok(WindowAccess::MemoryWindows { slots: regs, pool })
        }
        Err(reason) if cfg.memory_windows == MemoryWindows::On => Err(ControlError::Other(
            format!("--memory-windows on, but memory windows are unavailable: {reason}"),
        )),
        Err(reason) => {
            let msg =
                "no memory windows: a protection domain per session and a registration per grant";
            if cfg.memory_windows == MemoryWindows::Off {
                tracing::info!(device = %name, %reason, "{msg}");
            } else {
                tracing::warn!(device = %name, %reason, "{msg}");
            }
            Ok(WindowAccess::PerGrant { reason })
        }
    }
}

/// One session's access to the server's memory. Every window granted to the
/// session's transfers is reachable through `domain`, and only through the
/// session's own data path: verbs with memory windows, each window is bound
/// to the session's QP (`channel`), so its rkey fails on every other QP;
/// verbs without, the session's QP lives in a protection domain of its own
/// where its windows are registered (an rkey of another PD fails with
/// IBV_WC_REM_ACCESS_ERR on it); tcp, the target serves `domain` only on
/// connections that opened with `tcp`'s key.
pub struct SessionDomain {
    pub domain: Arc<dyn Domain>,
    /// Verbs: the session's QP, in INIT, to connect in the handshake.
    pub channel: Option<Arc<VerbsChannel>>,
    /// TCP: binds the session's data connections to `domain`; dropping it
    /// unbinds the key.
    pub tcp: Option<SessionBinding>,
}

impl ServerLink {
    /// Whether this rcpd serves sessions over `kind`.
    pub fn serves(&self, kind: ProviderKind) -> bool {
        match kind {
            ProviderKind::Verbs => self.device.is_some(),
            ProviderKind::Tcp => self.tcp_target.is_some(),
        }
    }

    /// A new session's domain and (verbs) QP on `kind`'s provider.
    pub fn session_domain(&self, kind: ProviderKind) -> Result<SessionDomain> {
        let tcp = match kind {
            ProviderKind::Tcp => self.tcp_target.as_ref(),
            ProviderKind::Verbs => None,
        };
        match (&self.device, tcp) {
            (Some(dev), None) => domain_on(dev, &self.windows),
            (_, Some(target)) => {
                let d = TcpDomain::new();
                let binding = target.bind_session(&d)?;
                Ok(SessionDomain {
                    domain: d,
                    channel: None,
                    tcp: Some(binding),
                })
            }
            (None, None) => Err(ControlError::Other(format!(
                "this rcpd does not serve the {kind} provider"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(dev: &str, numa: Option<u32>, local: bool) -> PortSeen {
        PortSeen {
            rail: RailName {
                device: dev.into(),
                port: Some(1),
            },
            numa_node: numa,
            local_netdev: local,
        }
    }

    fn names(r: &[RailName]) -> Vec<String> {
        r.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn default_rails_are_this_namespaces_ports_on_the_first_ones_node() {
        let (r, skipped) = pick_default_rails(&[
            seen("mlx5_0", Some(0), true),
            seen("mlx5_1", Some(1), true),
            seen("mlx5_2", Some(0), true),
            seen("mlx5_3", Some(0), false),
        ]);
        assert_eq!(names(&r), ["mlx5_0:1", "mlx5_2:1"]);
        let why: Vec<String> = skipped.iter().map(|(r, w)| format!("{r}: {w}")).collect();
        assert_eq!(
            why,
            [
                "mlx5_3:1: its netdev is in another network namespace",
                "mlx5_1:1: NUMA node 1, not the arena's node 0",
            ]
        );
    }

    #[test]
    fn default_rails_without_numa_information_take_every_local_port() {
        let (r, skipped) = pick_default_rails(&[
            seen("rxea0", None, true),
            seen("rxeb0", None, false),
            seen("rxea1", None, true),
        ]);
        assert_eq!(names(&r), ["rxea0:1", "rxea1:1"]);
        assert_eq!(skipped.len(), 1);
        assert!(pick_default_rails(&[]).0.is_empty());
    }
}
