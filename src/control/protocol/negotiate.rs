//! The handshake's decisions, as pure functions: what rcpd grants a
//! client's request ([`negotiate`]), and whether the client accepts what
//! rcpd granted ([`check_grant`]). Every parameter a client proposes has a
//! floor and a ceiling here, and is clamped or refused here:
//!
//! | parameter | floor | ceiling | out of range |
//! | --- | --- | --- | --- |
//! | `block_size` | [`MIN_BLOCK_SIZE`] | the window size | refused (0: [`DEFAULT_BLOCK_SIZE`]) |
//! | `window_count` | 1 | [`MAX_WINDOWS`], rcpd's windows per session and free arena slots | clamped |
//! | `timeout_ms` | [`MIN_TIMEOUT_NS`] | [`MAX_TIMEOUT_NS`] | clamped (0: rcpd's own) |
//! | keepalive period | [`MIN_KEEPALIVE_NS`] | a third of the shorter timeout | follows the timeouts, clamped |
//! | `qps_per_rail` | 1 | [`MAX_QPS_PER_RAIL`] | clamped (0: 1) |
//!
//! The retry bound ([`DEFAULT_MAX_RETRIES`]) is rcpd's and travels in the
//! answer (`HandshakeResponse.max_retries`, since 2.2); an rcpd of 2.1
//! sends none and means the default. The client refuses one over
//! [`MAX_RETRIES`].

use super::{Failure, FrameKind, Params, Reason, Side, Violation};
use crate::control::rails::MAX_QPS_PER_RAIL;
use crate::control::{DEFAULT_BLOCK_SIZE, VERSION_MAJOR, VERSION_MINOR};
use crate::files::Check;
use crate::proto;
use crate::provider::ProviderKind;

/// The smallest block (extents in a window are aligned to it).
pub const MIN_BLOCK_SIZE: u64 = super::EXTENT_ALIGN;
/// Most windows a session may have granted at once (a client's staging
/// slots).
pub const MAX_WINDOWS: u32 = 64;
/// A client's timeout below this counts as this (1 s), above
/// [`MAX_TIMEOUT_NS`] as that (24 h).
pub const MIN_TIMEOUT_NS: u64 = 1_000_000_000;
pub const MAX_TIMEOUT_NS: u64 = 24 * 3600 * 1_000_000_000;
/// Keepalives go out at most every 250 ms (4 a second), whatever the
/// timeouts.
pub const MIN_KEEPALIVE_NS: u64 = 250_000_000;
/// Times a damaged block moves again before its file fails.
pub const DEFAULT_MAX_RETRIES: u32 = 3;
/// The most resends a client accepts an rcpd to ask for.
pub const MAX_RETRIES: u32 = 16;

/// Check a block size: a power of two, [`MIN_BLOCK_SIZE`] ..= `max`; 0
/// means the default ([`DEFAULT_BLOCK_SIZE`], at most `max`). The one rule,
/// for rcp's flag, its library and rcpd.
pub fn check_block_size(bs: u64, max: u64) -> Result<u64, String> {
    if bs == 0 {
        return Ok(DEFAULT_BLOCK_SIZE.min(max));
    }
    if !bs.is_power_of_two() || bs < MIN_BLOCK_SIZE || bs > max {
        return Err(format!(
            "block size {bs} must be a power of two between {MIN_BLOCK_SIZE} and {max}"
        ));
    }
    Ok(bs)
}

/// The keepalive period of an end whose timeout is `own` when its peer's
/// is `peer` (0: the peer did not say): a third of the shorter, never
/// under [`MIN_KEEPALIVE_NS`].
pub fn keepalive_for(own: u64, peer: u64) -> u64 {
    let shorter = if peer == 0 { own } else { own.min(peer) };
    (shorter / 3).max(MIN_KEEPALIVE_NS)
}

/// A peer's timeout (in ms on the wire; 0: it did not say) as this end
/// takes it: clamped to [`MIN_TIMEOUT_NS`] ..= [`MAX_TIMEOUT_NS`].
pub fn peer_timeout_ns(ms: u32) -> u64 {
    match ms {
        0 => 0,
        ms => (u64::from(ms) * 1_000_000).clamp(MIN_TIMEOUT_NS, MAX_TIMEOUT_NS),
    }
}

/// A timeout on the wire (ms).
pub fn timeout_ms(ns: u64) -> u32 {
    (ns / 1_000_000).min(u64::from(u32::MAX)) as u32
}

/// Why a handshake was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    /// [`Reason::Version`] or [`Reason::Invalid`].
    pub reason: Reason,
    pub message: String,
}

impl Refusal {
    fn invalid(message: impl Into<String>) -> Self {
        Refusal {
            reason: Reason::Invalid,
            message: message.into(),
        }
    }
}

impl From<Refusal> for Failure {
    fn from(r: Refusal) -> Self {
        Failure::new(r.reason, r.message)
    }
}

/// What this rcpd offers a session.
#[derive(Clone, Debug)]
pub struct Terms {
    /// The provider it runs (named in a refusal).
    pub runs: ProviderKind,
    /// The providers it serves sessions over (a verbs rcpd may serve tcp
    /// too).
    pub serves: Vec<ProviderKind>,
    /// The checks a client may ask for.
    pub checks: Vec<Check>,
    /// Bytes per window of its arena.
    pub window_size: u64,
    /// Most windows one session may have granted at once (its setting, and
    /// the arena's slots).
    pub max_windows: u32,
    pub max_open_files: u32,
    /// Its own timeout.
    pub timeout_ns: u64,
}

/// What rcpd agreed with a client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Agreed {
    pub provider: ProviderKind,
    /// The session's parameters on rcpd's side (its own timeout, the
    /// keepalive period of the shorter of both).
    pub params: Params,
    /// The client's timeout as taken (0: it did not say).
    pub client_timeout_ns: u64,
    /// Verbs: QPs per rail.
    pub qps_per_rail: u32,
}

impl Agreed {
    /// The negotiated part of the handshake's answer; the session id and
    /// the link's endpoints are the driver's.
    pub fn response(&self) -> proto::HandshakeResponse {
        let p = &self.params;
        proto::HandshakeResponse {
            version_major: VERSION_MAJOR,
            version_minor: VERSION_MINOR,
            provider: provider_to_wire(self.provider) as i32,
            block_size: p.block_size,
            window_size: p.window_size,
            window_count: p.window_count,
            check: super::check_to_wire(p.check) as i32,
            max_open_files: p.max_open_files,
            timeout_ms: timeout_ms(p.timeout_ns),
            max_retries: p.max_retries,
            ..Default::default()
        }
    }
}

/// A provider on the wire.
pub fn provider_to_wire(k: ProviderKind) -> proto::Provider {
    match k {
        ProviderKind::Verbs => proto::Provider::Verbs,
        ProviderKind::Tcp => proto::Provider::Tcp,
    }
}

fn provider_from_wire(p: i32) -> Option<ProviderKind> {
    match proto::Provider::try_from(p).ok()? {
        proto::Provider::Verbs => Some(ProviderKind::Verbs),
        proto::Provider::Tcp => Some(ProviderKind::Tcp),
        proto::Provider::Unspecified => None,
    }
}

/// rcpd's answer to a client's handshake: the provider (the client's
/// preference, first one served), the check (likewise; none offered means
/// SHA-256, as a client of 2.0 does), the block size (refused out of
/// range), windows, the client's timeout and QPs per rail (clamped, see
/// the module docs), and rcpd's limits.
pub fn negotiate(req: &proto::HandshakeRequest, t: &Terms) -> Result<Agreed, Refusal> {
    if req.version_major != VERSION_MAJOR {
        return Err(Refusal {
            reason: Reason::Version,
            message: format!(
                "protocol {}.{} is not supported: this rcpd speaks {VERSION_MAJOR}.{VERSION_MINOR}; \
                 use an rcp of the same major version",
                req.version_major, req.version_minor
            ),
        });
    }
    let provider = req
        .providers
        .iter()
        .filter_map(|&p| provider_from_wire(p))
        .find(|k| t.serves.contains(k))
        .ok_or_else(|| {
            let asked: Vec<&str> = req
                .providers
                .iter()
                .map(|&p| {
                    proto::Provider::try_from(p)
                        .map(|p| p.as_str_name())
                        .unwrap_or("?")
                })
                .collect();
            Refusal::invalid(format!(
                "this rcpd runs the {} provider; the client offered {asked:?} (try --transport {})",
                t.runs, t.runs
            ))
        })?;
    // The check: the one rule, `protocol::choose_check`.
    let check = super::choose_check(&req.checks, &t.checks).map_err(|f| Refusal {
        reason: f.reason,
        message: f.message,
    })?;
    let block_size = check_block_size(req.block_size, t.window_size).map_err(Refusal::invalid)?;
    let window_count = req
        .window_count
        .clamp(1, t.max_windows.clamp(1, MAX_WINDOWS));
    let client_timeout_ns = peer_timeout_ns(req.timeout_ms);
    let params = Params {
        block_size,
        window_size: t.window_size,
        window_count,
        max_open_files: t.max_open_files.max(1),
        check,
        timeout_ns: t.timeout_ns,
        keepalive_ns: keepalive_for(t.timeout_ns, client_timeout_ns),
        max_retries: DEFAULT_MAX_RETRIES,
        rails: 1,
    };
    Ok(Agreed {
        provider,
        params,
        client_timeout_ns,
        qps_per_rail: req.qps_per_rail.clamp(1, MAX_QPS_PER_RAIL),
    })
}

/// What a client brings to the handshake besides its request.
#[derive(Clone, Copy, Debug)]
pub struct Staging {
    /// Bytes per staging slot (a window must fit one).
    pub slot_size: u64,
    /// Files it wants open at once.
    pub transfers: u32,
    /// Its own timeout.
    pub timeout_ns: u64,
}

/// The client's check of rcpd's answer to `req`: the version, and that
/// what was granted is what was asked (the check, the block size) or fits
/// it (windows within the staging, a retry bound within [`MAX_RETRIES`]);
/// the session's parameters on the client's side. rcpd's timeout is
/// clamped as the client's is on rcpd's side, so keepalives never go out
/// more often than [`MIN_KEEPALIVE_NS`] allows.
pub fn check_grant(
    req: &proto::HandshakeRequest,
    resp: &proto::HandshakeResponse,
    local: &Staging,
) -> Result<Params, Failure> {
    if resp.version_major != VERSION_MAJOR {
        return Err(Failure::new(
            Reason::Version,
            format!(
                "rcpd speaks protocol {}.{}, this rcp {VERSION_MAJOR}.{VERSION_MINOR}",
                resp.version_major, resp.version_minor
            ),
        ));
    }
    let bad =
        |why: String| -> Failure { Violation::new(Side::Server, FrameKind::Handshake, why).into() };
    let asked: Vec<Check> = req
        .checks
        .iter()
        .filter_map(|&c| super::check_from_wire(c))
        .collect();
    let check = match super::check_from_wire(resp.check) {
        Some(c) if asked.contains(&c) || (asked.is_empty() && c == Check::Sha256) => c,
        _ => {
            return Err(bad(format!(
                "rcpd chose check {} where this rcp asked for {}",
                resp.check,
                asked
                    .iter()
                    .map(|c| c.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            )))
        }
    };
    let want = check_block_size(req.block_size, local.slot_size)
        .map_err(|m| Failure::new(Reason::Usage, m))?;
    if resp.block_size != want {
        return Err(bad(format!(
            "rcpd granted block size {} instead of {want}",
            resp.block_size
        )));
    }
    let windows = req.window_count.clamp(1, MAX_WINDOWS);
    if resp.window_size > local.slot_size
        || resp.window_size < resp.block_size
        || resp.window_count == 0
        || resp.window_count > windows
    {
        return Err(bad(format!(
            "rcpd's windows of {} bytes x {} do not fit this rcp's staging ({} x {windows}) or its blocks of {}",
            resp.window_size, resp.window_count, local.slot_size, resp.block_size
        )));
    }
    let max_retries = match resp.max_retries {
        // An rcpd of 2.1 does not say: the default it used.
        0 => DEFAULT_MAX_RETRIES,
        n if n > MAX_RETRIES => {
            return Err(bad(format!(
                "rcpd asks for up to {n} resends of a damaged block, more than {MAX_RETRIES}"
            )))
        }
        n => n,
    };
    Ok(Params {
        block_size: resp.block_size,
        window_size: resp.window_size,
        window_count: resp.window_count,
        max_open_files: local.transfers.clamp(1, resp.max_open_files.max(1)),
        check,
        timeout_ns: local.timeout_ns,
        keepalive_ns: keepalive_for(local.timeout_ns, peer_timeout_ns(resp.timeout_ms)),
        max_retries,
        rails: 1,
    })
}
