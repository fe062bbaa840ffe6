//! The verbs rig of the fabric tests (tests/fabric.rs, tests/datapath_fabric.rs):
//! a side is a device context, a protection domain, a completion queue, an
//! RC queue pair and an arena registered for local and remote access; a pair
//! is two sides connected in-process. Devices: `RCP_TEST_DEV_A` /
//! `RCP_TEST_DEV_B` (default: the first device for both ends), so the same
//! tests run on one rxe on `lo` and across two namespaces joined by veth.
//! Plus the fill pattern the tests verify against.

use std::sync::Arc;

use rcp::mem::{Arena, ArenaConfig, PeerSpan};
use rcp::verbs::{
    device_names, Access, CompletionQueue, ConnectParams, Context, MemoryRegion, PreparedQp,
    ProtectionDomain, QpBuilder, QpState, QueuePair,
};

/// One end. Fields drop in order: the queue pair before the registration
/// before the memory.
pub struct Side {
    pub qp: QueuePair,
    pub mr: MemoryRegion,
    pub arena: Arena,
    pub cq: Arc<CompletionQueue>,
    pub pd: Arc<ProtectionDomain>,
    pub ctx: Arc<Context>,
}

/// The device named by `var`, if set and not empty.
pub fn dev(var: &str) -> Option<String> {
    std::env::var(var).ok().filter(|s| !s.is_empty())
}

/// A side on the device named by `var` (default: the first device) before
/// its queue pair is connected.
struct Prepared {
    qp: PreparedQp,
    mr: MemoryRegion,
    arena: Arena,
    pd: Arc<ProtectionDomain>,
    ctx: Arc<Context>,
}

/// A side on the device named by `var`: an RC queue pair of `sq_depth`
/// send entries (its CQ with a completion channel) allowing remote WRITE
/// and READ, in INIT; an arena of `arena_bytes` on the device's NUMA node,
/// registered for local write and remote WRITE and READ.
fn prepare(var: &str, arena_bytes: usize, sq_depth: u32) -> Prepared {
    assert!(
        !device_names().is_empty(),
        "no RDMA device found: the fabric tests must run where one exists"
    );
    let ctx = Context::open(dev(var).as_deref()).expect("open device");
    let (port, choice) = ctx
        .select_port(None)
        .expect("an ACTIVE port with a usable GID");
    eprintln!(
        "device {} port {} GID {}: {}",
        ctx.name(),
        port.port,
        choice.entry.gid,
        choice.reason
    );
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let remote = Access::REMOTE_WRITE | Access::REMOTE_READ;
    let qp = QpBuilder::new(&pd, port.port, choice.entry.index)
        .sq_depth(sq_depth)
        .max_inline(64)
        .remote_access(remote)
        .events(true)
        .build()
        .unwrap();
    let mut cfg = ArenaConfig::new(arena_bytes);
    cfg.numa_node = ctx.numa_node();
    let arena = Arena::new(&cfg).unwrap();
    // SAFETY: the fabric tests touch an arena's bytes (fill, bytes,
    // with_mut) only while no request names them; the only peer is the
    // other side of the same test.
    let mr = unsafe { pd.register_arena(&arena, Access::LOCAL_WRITE | remote) }.unwrap();
    Prepared {
        qp,
        mr,
        arena,
        pd,
        ctx,
    }
}

impl Prepared {
    fn connect(self, peer: &rcp::verbs::QpEndpoint) -> Side {
        let qp = self.qp.handshake(peer, &ConnectParams::default()).unwrap();
        Side {
            cq: qp.send_cq().clone(),
            qp,
            mr: self.mr,
            arena: self.arena,
            pd: self.pd,
            ctx: self.ctx,
        }
    }
}

/// Sides A (`RCP_TEST_DEV_A`, `a_bytes` of arena) and B (`RCP_TEST_DEV_B`,
/// `b_bytes`), their queue pairs (`sq_depth` send entries) connected to
/// each other (RTS).
pub fn pair(a_bytes: usize, b_bytes: usize, sq_depth: u32) -> (Side, Side) {
    let a = prepare("RCP_TEST_DEV_A", a_bytes, sq_depth);
    let b = prepare("RCP_TEST_DEV_B", b_bytes, sq_depth);
    let (ea, eb) = (a.qp.endpoint(), b.qp.endpoint());
    let (a, b) = (a.connect(&eb), b.connect(&ea));
    assert_eq!(a.qp.state(), QpState::Rts);
    (a, b)
}

use super::pattern::pattern_into;

/// Fill `span` with the test pattern of `seed`.
///
/// # Safety
///
/// No request in flight names `span`, and none that does is posted until
/// this returns (as [`PeerSpan::with_mut`]).
pub unsafe fn fill(span: &PeerSpan, seed: u64) {
    // SAFETY: the caller's contract, passed on.
    unsafe { span.with_mut(0, span.len(), |b| pattern_into(b, seed)) }.unwrap();
}

/// The whole of `arena` (rounded up to huge pages: at least what was asked).
pub fn whole(arena: &Arena) -> PeerSpan {
    PeerSpan::new(arena, arena.addr(), arena.len()).unwrap()
}

/// A copy of `span`'s bytes.
pub fn bytes(span: &PeerSpan) -> Vec<u8> {
    span.with(0, span.len(), <[u8]>::to_vec).unwrap()
}
