//! The client's side of a link: its staging registered on every rail and
//! a QP each (verbs), or the tcp provider's domain.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::datapath::QpRetry;
use crate::mem::{Arena, ArenaConfig, BlockPool, PeerSpan};
use crate::provider::tcp::{wire::KEY_LEN, TcpChannel, TcpDomain, DEFAULT_CONNS};
use crate::provider::verbs::{VerbsChannel, VerbsDomain};
use crate::provider::{Access, Channel, Domain, ProviderKind, Registration};

use super::{connect_params, ep_from_proto, provider, Device};
use crate::control::error::{ControlError, Result};
use crate::parse::RailName;
use crate::proto;

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
                let (addr, key) = tcp_target(resp, server_host)?;
                self.connect_tcp(addr, key)
            }
        }
    }

    /// The tcp provider's data connections to `addr`, each opening with
    /// `key` (the session's, from [`tcp_target`]).
    pub fn connect_tcp(
        &self,
        addr: SocketAddr,
        key: Option<[u8; KEY_LEN]>,
    ) -> Result<Arc<dyn Channel>> {
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

/// Where a tcp session's data connections go (`server_host` where rcpd
/// listens on every address) and the key they open with.
pub fn tcp_target(
    resp: &proto::HandshakeResponse,
    server_host: &str,
) -> Result<(SocketAddr, Option<[u8; KEY_LEN]>)> {
    let host = if resp.tcp_data_host.is_empty()
        || resp.tcp_data_host == "0.0.0.0"
        || resp.tcp_data_host == "::"
    {
        server_host.to_string()
    } else {
        resp.tcp_data_host.clone()
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = u16::try_from(resp.tcp_data_port)
        .map_err(|_| ControlError::Invalid(format!("TCP data port {}", resp.tcp_data_port)))?;
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
    Ok((addr, key))
}
