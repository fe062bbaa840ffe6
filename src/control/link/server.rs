//! The server's side of a link: its window arena, registered once for
//! memory windows or per grant, the TCP target, per-session QPs and
//! domains.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use crate::mem::{Arena, ArenaConfig, BlockPool};
use crate::provider::tcp::{SessionBinding, TcpDomain, TcpTarget};
use crate::provider::verbs::{MwDomain, RegisteredSlots, VerbsChannel, VerbsDomain};
use crate::provider::{Access, Domain, ProviderKind};
use crate::verbs::{MwPool, ProtectionDomain};

use super::{provider, rails_or_default, Device};
use crate::control::error::{ControlError, Result};
use crate::parse::RailName;

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
                tcp_domain: None,
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
        tcp_domain: None,
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
    /// TCP: `domain` as the tcp provider's (who takes its connections'
    /// messages is set on it).
    pub tcp_domain: Option<Arc<TcpDomain>>,
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
                    domain: d.clone(),
                    channel: None,
                    tcp: Some(binding),
                    tcp_domain: Some(d),
                })
            }
            (None, None) => Err(ControlError::Other(format!(
                "this rcpd does not serve the {kind} provider"
            ))),
        }
    }
}
