//! Provider setup for both ends: which transport, which rails, a device
//! opened and its QPs' parameters; the client's side in `client` (its
//! staging memory and channels), the server's in `server` (its window
//! arena, registered once for memory windows or per grant, the TCP target
//! and per-session QPs and domains).

mod client;
mod server;

pub use client::{tcp_target, ClientLink, ClientRail};
pub use server::{MemoryWindows, ServerLink, ServerLinkConfig, SessionDomain, WindowAccess};

use std::sync::Arc;

use crate::datapath::QpRetry;
use crate::provider::verbs::VerbsChannel;
use crate::provider::{Channel, ProviderKind};
use crate::verbs::{
    device_names, ConnectParams, Context, Gid, ProtectionDomain, QpBuilder, QpEndpoint,
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

impl Transport {
    /// The name `--transport` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Verbs => "verbs",
            Transport::Tcp => "tcp",
        }
    }
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
