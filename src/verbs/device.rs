//! Devices: list, open by name, capabilities, port attributes and the
//! port's GID table (chosen from in `gid.rs`).

use std::ffi::CStr;
use std::fmt;
use std::sync::Arc;

use rdma_sys::*;

use super::error::{Hint, VerbsError};
use super::gid::{Gid, GidEntry, GidType};

/// Capabilities that decide queue sizes, SGE counts and rd_atomic. Queried
/// from the device, never assumed (a ConnectX and rxe differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCaps {
    pub max_qp_wr: u32,
    pub max_cqe: u32,
    pub max_sge: u32,
    pub max_qp_rd_atom: u32,
    pub max_qp_init_rd_atom: u32,
    pub max_mr_size: u64,
    /// Memory windows the device can have allocated at once.
    pub max_mw: u32,
    /// Which memory windows the device supports (`device_cap_flags`).
    pub mem_windows: MemWindowCaps,
    pub phys_port_cnt: u8,
}

/// The memory-window bits of `device_cap_flags`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemWindowCaps {
    /// IBV_DEVICE_MEM_WINDOW: memory windows at all (type 1).
    pub any: bool,
    /// IBV_DEVICE_MEM_WINDOW_TYPE_2A: type 2 windows bound to a QP number.
    pub type_2a: bool,
    /// IBV_DEVICE_MEM_WINDOW_TYPE_2B: type 2 windows bound to a QP number
    /// and PD (rxe).
    pub type_2b: bool,
}

impl MemWindowCaps {
    pub fn from_flags(flags: u32) -> MemWindowCaps {
        let has = |f: ibv_device_cap_flags| flags & f.0 == f.0;
        MemWindowCaps {
            any: has(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW),
            type_2a: has(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2A),
            type_2b: has(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B),
        }
    }

    /// Type 2 windows (2A or 2B): bound by a work request on one QP.
    pub fn type_2(&self) -> bool {
        self.type_2a || self.type_2b
    }
}

impl fmt::Display for MemWindowCaps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut v = Vec::new();
        if self.any {
            v.push("MEM_WINDOW");
        }
        if self.type_2a {
            v.push("MEM_WINDOW_TYPE_2A");
        }
        if self.type_2b {
            v.push("MEM_WINDOW_TYPE_2B");
        }
        if v.is_empty() {
            v.push("no memory windows");
        }
        f.write_str(&v.join("|"))
    }
}

/// Port link layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkLayer {
    Infiniband,
    Ethernet,
    Unknown(u8),
}

/// Port state (`ibv_port_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortState {
    Down,
    Init,
    Armed,
    Active,
    Other(u32),
}

/// What `ibv_query_port` tells about one port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortAttr {
    pub port: u8,
    pub state: PortState,
    /// Active MTU in bytes (256..4096).
    pub active_mtu: u32,
    pub lid: u16,
    pub link_layer: LinkLayer,
    pub gid_tbl_len: u32,
}

/// Path MTU from bytes to `ibv_mtu`, rounding down to a valid value.
pub fn mtu_enum(bytes: u32) -> ibv_mtu::Type {
    match bytes {
        4096.. => ibv_mtu::IBV_MTU_4096,
        2048.. => ibv_mtu::IBV_MTU_2048,
        1024.. => ibv_mtu::IBV_MTU_1024,
        512.. => ibv_mtu::IBV_MTU_512,
        _ => ibv_mtu::IBV_MTU_256,
    }
}

fn mtu_bytes(m: ibv_mtu::Type) -> u32 {
    match m {
        ibv_mtu::IBV_MTU_256 => 256,
        ibv_mtu::IBV_MTU_512 => 512,
        ibv_mtu::IBV_MTU_1024 => 1024,
        ibv_mtu::IBV_MTU_2048 => 2048,
        ibv_mtu::IBV_MTU_4096 => 4096,
        _ => 1024,
    }
}

/// The names of RDMA devices on this host (empty when there are none).
pub fn device_names() -> Vec<String> {
    let mut n = 0i32;
    // SAFETY: ibv_get_device_list returns a NULL-terminated array we own until
    // ibv_free_device_list; we only read the names before freeing it.
    unsafe {
        let list = ibv_get_device_list(&mut n);
        if list.is_null() {
            return Vec::new();
        }
        let mut names = Vec::with_capacity(n.max(0) as usize);
        for i in 0..n.max(0) as usize {
            let dev = *list.add(i);
            if dev.is_null() {
                break;
            }
            names.push(
                CStr::from_ptr(ibv_get_device_name(dev))
                    .to_string_lossy()
                    .into_owned(),
            );
        }
        ibv_free_device_list(list);
        names
    }
}

/// An open device (`ibv_context`). Shared by everything made from it; closed
/// when the last PD, CQ or QP holding it is dropped.
pub struct Context {
    pub(crate) ctx: *mut ibv_context,
    name: String,
    caps: DeviceCaps,
}

// SAFETY: an ibv_context is thread-safe per libibverbs (all provider entry
// points lock internally); we never hand out &mut to its fields.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Open a device by name, or the first device when `name` is `None`.
    pub fn open(name: Option<&str>) -> Result<Arc<Context>, VerbsError> {
        let mut n = 0i32;
        // SAFETY: the list is valid until ibv_free_device_list; ibv_open_device
        // keeps its own reference to the device, so freeing the list after
        // opening is allowed by the libibverbs API.
        unsafe {
            let list = ibv_get_device_list(&mut n);
            if list.is_null() {
                return Err(
                    VerbsError::last("ibv_get_device_list", "listing RDMA devices")
                        .with_hint(Hint::Device),
                );
            }
            let mut chosen: *mut ibv_device = std::ptr::null_mut();
            let mut names = Vec::new();
            for i in 0..n.max(0) as usize {
                let dev = *list.add(i);
                let dn = CStr::from_ptr(ibv_get_device_name(dev))
                    .to_string_lossy()
                    .into_owned();
                if chosen.is_null() && name.is_none_or(|w| w == dn) {
                    chosen = dev;
                }
                names.push(dn);
            }
            if chosen.is_null() {
                ibv_free_device_list(list);
                let what = match name {
                    Some(w) => format!("opening device {w:?} (present: {})", list_or_none(&names)),
                    None => "opening the first RDMA device: none present".to_string(),
                };
                return Err(
                    VerbsError::new("ibv_open_device", libc::ENODEV, what).with_hint(Hint::Device)
                );
            }
            let dn = CStr::from_ptr(ibv_get_device_name(chosen))
                .to_string_lossy()
                .into_owned();
            let ctx = ibv_open_device(chosen);
            ibv_free_device_list(list);
            if ctx.is_null() {
                return Err(VerbsError::last("ibv_open_device", format!("opening {dn}")));
            }
            let mut attr: ibv_device_attr = std::mem::zeroed();
            let rc = ibv_query_device(ctx, &mut attr);
            if rc != 0 {
                ibv_close_device(ctx);
                return Err(VerbsError::new(
                    "ibv_query_device",
                    rc,
                    format!("querying {dn}"),
                ));
            }
            let caps = DeviceCaps {
                max_qp_wr: attr.max_qp_wr.max(0) as u32,
                max_cqe: attr.max_cqe.max(0) as u32,
                max_sge: attr.max_sge.max(0) as u32,
                max_qp_rd_atom: attr.max_qp_rd_atom.max(0) as u32,
                max_qp_init_rd_atom: attr.max_qp_init_rd_atom.max(0) as u32,
                max_mr_size: attr.max_mr_size,
                max_mw: attr.max_mw.max(0) as u32,
                mem_windows: MemWindowCaps::from_flags(attr.device_cap_flags),
                phys_port_cnt: attr.phys_port_cnt,
            };
            Ok(Arc::new(Context {
                ctx,
                name: dn,
                caps,
            }))
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn caps(&self) -> DeviceCaps {
        self.caps
    }

    /// `ibv_query_port`.
    pub fn port(&self, port: u8) -> Result<PortAttr, VerbsError> {
        // SAFETY: ctx is open for self's lifetime; attr is a plain out-struct.
        let attr = unsafe {
            let mut attr: ibv_port_attr = std::mem::zeroed();
            let rc = ___ibv_query_port(self.ctx, port, &mut attr);
            if rc != 0 {
                return Err(VerbsError::new(
                    "ibv_query_port",
                    rc,
                    format!("querying {} port {port}", self.name),
                ));
            }
            attr
        };
        Ok(PortAttr {
            port,
            state: match attr.state {
                ibv_port_state::IBV_PORT_DOWN => PortState::Down,
                ibv_port_state::IBV_PORT_INIT => PortState::Init,
                ibv_port_state::IBV_PORT_ARMED => PortState::Armed,
                ibv_port_state::IBV_PORT_ACTIVE => PortState::Active,
                s => PortState::Other(s),
            },
            active_mtu: mtu_bytes(attr.active_mtu),
            lid: attr.lid,
            // IBV_LINK_LAYER_INFINIBAND = 1, IBV_LINK_LAYER_ETHERNET = 2 (verbs.h);
            // 0 (unspecified) is reported by old IB drivers and means InfiniBand.
            link_layer: match attr.link_layer {
                0 | 1 => LinkLayer::Infiniband,
                2 => LinkLayer::Ethernet,
                o => LinkLayer::Unknown(o),
            },
            gid_tbl_len: attr.gid_tbl_len.max(0) as u32,
        })
    }

    /// The first ACTIVE port, or an error naming the ports' states.
    pub fn active_port(&self) -> Result<PortAttr, VerbsError> {
        let mut seen = Vec::new();
        for p in 1..=self.caps.phys_port_cnt.max(1) {
            let a = self.port(p)?;
            if a.state == PortState::Active {
                return Ok(a);
            }
            seen.push(format!("port {p} {:?}", a.state));
        }
        Err(VerbsError::new(
            "ibv_query_port",
            libc::ENETDOWN,
            format!(
                "looking for an ACTIVE port on {} ({})",
                self.name,
                seen.join(", ")
            ),
        )
        .with_hint(Hint::PortDown))
    }

    /// The first ACTIVE port and the GID to address QPs by on it (an
    /// operator's `gid_index` wins; see [`super::gid::choose_gid`]). The
    /// choice is logged with its reason.
    pub fn select_port(
        &self,
        gid_index: Option<u32>,
    ) -> Result<(PortAttr, super::gid::GidChoice), VerbsError> {
        self.select_rail_port(None, gid_index)
    }

    /// [`select_port`](Self::select_port) on port `port` when given (a rail
    /// named `NAME:PORT`): it must be ACTIVE.
    pub fn select_rail_port(
        &self,
        port: Option<u8>,
        gid_index: Option<u32>,
    ) -> Result<(PortAttr, super::gid::GidChoice), VerbsError> {
        let port = match port {
            None => self.active_port()?,
            Some(p) => {
                if p > self.caps.phys_port_cnt.max(1) {
                    return Err(VerbsError::new(
                        "ibv_query_port",
                        libc::EINVAL,
                        format!(
                            "{} has {} port(s); there is no port {p}",
                            self.name,
                            self.caps.phys_port_cnt.max(1)
                        ),
                    )
                    .with_hint(Hint::PortDown));
                }
                let a = self.port(p)?;
                if a.state != PortState::Active {
                    return Err(VerbsError::new(
                        "ibv_query_port",
                        libc::ENETDOWN,
                        format!("{} port {p} is {:?}, not ACTIVE", self.name, a.state),
                    )
                    .with_hint(Hint::PortDown));
                }
                a
            }
        };
        let table = gid_table(self, port.port, port.gid_tbl_len)?;
        let choice = super::gid::choose_gid(&table, gid_index).map_err(|why| {
            VerbsError::new(
                "ibv_query_gid",
                libc::EINVAL,
                format!("choosing a GID on {} port {}: {why}", self.name, port.port),
            )
            .with_hint(Hint::Gid)
        })?;
        tracing::info!(
            device = %self.name,
            port = port.port,
            gid_index = choice.entry.index,
            gid = %choice.entry.gid,
            mtu = port.active_mtu,
            "GID chosen: {}",
            choice.reason
        );
        Ok((port, choice))
    }

    /// The NUMA node the device sits on, from sysfs (`None` when unknown).
    pub fn numa_node(&self) -> Option<u32> {
        crate::mem::numa::device_numa_node(&self.name)
    }
}

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every child object (PD, CQ, channel, QP) holds an Arc to this
        // Context, so when we get here none is left.
        unsafe {
            ibv_close_device(self.ctx);
        }
    }
}

/// Read a port's GID table: values from `ibv_query_gid`, types and netdevs
/// from sysfs (`/sys/class/infiniband/DEV/ports/P/gid_attrs`).
pub fn gid_table(ctx: &Context, port: u8, len: u32) -> Result<Vec<GidEntry>, VerbsError> {
    let mut out = Vec::new();
    let base = format!(
        "/sys/class/infiniband/{}/ports/{port}/gid_attrs",
        ctx.name()
    );
    for index in 0..len.min(256) {
        let gid = query_gid(ctx, port, index)?;
        if gid.is_zero() {
            continue;
        }
        let kind = std::fs::read_to_string(format!("{base}/types/{index}"))
            .map(|s| GidType::parse(&s))
            .unwrap_or(GidType::Unknown);
        let netdev = std::fs::read_to_string(format!("{base}/ndevs/{index}"))
            .ok()
            .map(|s| s.trim().to_string());
        out.push(GidEntry {
            index,
            gid,
            kind,
            netdev,
        });
    }
    Ok(out)
}

/// `ibv_query_gid` for one index.
pub fn query_gid(ctx: &Context, port: u8, index: u32) -> Result<Gid, VerbsError> {
    // SAFETY: ctx is open; the out-parameter is a plain 16-byte union.
    unsafe {
        let mut g: rdma_sys::ibv_gid = std::mem::zeroed();
        let rc = rdma_sys::ibv_query_gid(ctx.ctx, port, index as i32, &mut g);
        if rc != 0 {
            return Err(VerbsError::new(
                "ibv_query_gid",
                if rc < 0 { libc::EINVAL } else { rc },
                format!("reading GID {index} of {} port {port}", ctx.name()),
            )
            .with_hint(Hint::Gid));
        }
        Ok(Gid(g.raw))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_rounds_down() {
        assert_eq!(mtu_enum(4096), ibv_mtu::IBV_MTU_4096);
        assert_eq!(mtu_enum(9000), ibv_mtu::IBV_MTU_4096);
        assert_eq!(mtu_enum(1500), ibv_mtu::IBV_MTU_1024);
        assert_eq!(mtu_bytes(mtu_enum(2048)), 2048);
        assert_eq!(mtu_bytes(mtu_enum(100)), 256);
    }

    #[test]
    fn memory_window_flags() {
        // What rxe advertises: MEM_WINDOW | MEM_WINDOW_TYPE_2B.
        let rxe = MemWindowCaps::from_flags(
            ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW.0
                | ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0
                | ibv_device_cap_flags::IBV_DEVICE_RC_RNR_NAK_GEN.0,
        );
        assert!(rxe.any && rxe.type_2b && !rxe.type_2a && rxe.type_2());
        assert_eq!(rxe.to_string(), "MEM_WINDOW|MEM_WINDOW_TYPE_2B");
        let type1 = MemWindowCaps::from_flags(ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW.0);
        assert!(!type1.type_2());
        assert!(!MemWindowCaps::from_flags(0).type_2());
    }
}
