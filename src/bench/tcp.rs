//! The bench over the TCP provider, for hosts without RDMA: loopback lanes
//! in one process, each a [`TcpChannel`] posting into the region a
//! [`TcpTarget`] on 127.0.0.1 serves, through the same session data path
//! (engine, posting and completion threads) a copy over tcp uses.

use std::sync::Arc;

use super::run::{run_lanes, Lane, Link, REGION, SQ};
use super::wire::Region;
use super::{BenchError, BenchOptions, Measured};
use crate::mem::{Arena, ArenaConfig, PeerSpan};
use crate::provider::tcp::{TcpChannel, TcpDomain, TcpTarget, DEFAULT_CONNS};
use crate::provider::{Access, Domain, Registration};

/// The target side of a tcp loopback lane. Fields drop in order: the
/// target stops serving before its registration and region go.
struct TcpPeer {
    _target: TcpTarget,
    _reg: Arc<dyn Registration>,
    _arena: Arena,
}

fn arena() -> Result<(Arena, PeerSpan), BenchError> {
    let a = Arena::new(&ArenaConfig::new(REGION)).map_err(|e| BenchError::Mem(e.to_string()))?;
    let span = PeerSpan::new(&a, a.addr(), a.len())
        .ok_or_else(|| BenchError::Mem("a span over the whole arena".into()))?;
    Ok((a, span))
}

fn provider(e: crate::provider::ProviderError) -> BenchError {
    BenchError::Mem(format!("tcp provider: {e}"))
}

/// One loopback lane: a target on 127.0.0.1 with a region, a channel to it
/// with its staging.
fn lane() -> Result<Lane, BenchError> {
    let (t_arena, t_span) = arena()?;
    let t_domain = TcpDomain::new();
    // SAFETY: the bench never reads or writes its arenas from the CPU (no
    // block, slice or span borrower over them): the only accesses are the
    // requests it measures, whose bytes nobody looks at; the registration
    // drops (after the target) before the arena.
    let t_reg = unsafe {
        t_domain.register(
            &t_span,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
    }
    .map_err(provider)?;
    let target = TcpTarget::bind(t_domain, "127.0.0.1:0").map_err(provider)?;
    let (arena, span) = arena()?;
    let domain = TcpDomain::new();
    let reg = domain
        .register_local(&span, Access::LOCAL_WRITE)
        .map_err(provider)?;
    let ch = TcpChannel::connect_endpoint(domain, &target.endpoint(), DEFAULT_CONNS, SQ)
        .map_err(provider)?;
    let remote = Region {
        addr: t_reg.addr(),
        rkey: t_reg.rkey(),
        len: t_reg.len() as u64,
    };
    Ok(Lane {
        link: Link::Tcp {
            ch: Arc::new(ch),
            _peer: Some(Box::new(TcpPeer {
                _target: target,
                _reg: t_reg,
                _arena: t_arena,
            })),
        },
        arena,
        lkey: reg.lkey(),
        _reg: Box::new(reg),
        remote,
        numa_node: None,
    })
}

/// `rcp bench --transport tcp`: `o` in one process over the TCP provider
/// on 127.0.0.1 ([`super::run_loopback`] with `o.tcp`).
pub(super) fn run_loopback_tcp(o: &BenchOptions) -> Result<Measured, BenchError> {
    o.validate()?;
    let lanes = (0..o.qps).map(|_| lane()).collect::<Result<Vec<_>, _>>()?;
    run_lanes(&lanes, o)
}
