//! What a grant costs rcpd on each of its verbs paths, for one 4 MiB window:
//!
//! - per-grant registration (the fallback): `ibv_reg_mr` + `ibv_dereg_mr`
//!   of the window, in a PD of the session's own (and, per session,
//!   `ibv_alloc_pd` + `ibv_dealloc_pd`);
//! - memory windows (the arena registered once): a type-2 window bound to
//!   the session's QP (`IBV_WR_BIND_MW`, posted and its completion polled)
//!   and invalidated (`IBV_WR_LOCAL_INV`, the same), the window reused from
//!   a pool as rcpd does.
//!
//! Each figure is the mean of `--rounds` operations; the passes are
//! interleaved (`--runs` of them, each measuring every kind once) and the
//! median pass is printed, with the spread (min..max of the passes).
//!
//! ```text
//! pd_registration_cost [--device rxe0] [--rounds 200] [--runs 7]
//! ```
//! Needs an RDMA device (soft-RoCE: `scripts/testbed.sh run lo -- ...`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rcp::mem::{Arena, ArenaConfig, PeerSpan};
use rcp::provider::Access;
use rcp::verbs::{
    ConnectParams, Context, MemoryRegion, MwPool, PreparedQp, ProtectionDomain, QpBuilder,
    QueuePair,
};

type R<T> = Result<T, Box<dyn std::error::Error>>;

const WIN: usize = 4 << 20;
const TIMEOUT: Duration = Duration::from_secs(5);

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// A QP in INIT; `events`: its CQ with a completion channel (rcpd's QPs
/// sleep on it for their binds' and invalidates' completions).
fn qp(
    ctx: &Arc<Context>,
    pd: &Arc<ProtectionDomain>,
    remote: Access,
    events: bool,
) -> R<PreparedQp> {
    let (port, gid) = ctx.select_port(None)?;
    Ok(QpBuilder::new(pd, port.port, gid.entry.index)
        .sq_depth(16)
        .remote_access(remote)
        .events(events)
        .build()?)
}

/// Median, min and max of `v`.
fn stats(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// The memory-window path, set up once: the window registered with
/// MW_BIND, the "session" QP connected to a "client" QP on the same
/// device, and the pool rcpd takes windows from.
struct MwPath {
    mr: Arc<MemoryRegion>,
    server: QueuePair,
    _client: QueuePair,
    pool: MwPool,
}

/// Each pass's mean per operation, in microseconds.
#[derive(Default)]
struct Figures {
    pd: Vec<f64>,
    mr: Vec<f64>,
    both: Vec<f64>,
    mw: Vec<f64>,
    bind: Vec<f64>,
    inv: Vec<f64>,
}

fn main() -> R<()> {
    let args: Vec<String> = std::env::args().collect();
    let rounds: u32 = arg(&args, "--rounds").map_or(Ok(200), |v| v.parse())?;
    let runs: usize = arg(&args, "--runs").map_or(Ok(7), |v| v.parse())?;
    let ctx = Context::open(arg(&args, "--device").as_deref())?;
    let caps = ctx.caps();
    let arena = Arena::new(&ArenaConfig::new(WIN))?;
    println!(
        "device {}: {}, max_mw {}; arena backing {:?}",
        ctx.name(),
        caps.mem_windows,
        caps.max_mw,
        arena.backing()
    );
    let span = PeerSpan::new(&arena, arena.addr(), WIN).ok_or("window span")?;
    let shared_pd = ProtectionDomain::new(&ctx)?;
    // SAFETY (every registration and bind below): no request ever names
    // the span and nothing reads or writes it: only the cost of granting
    // is measured.
    // Warm up (the first registration pins the pages).
    drop(unsafe { shared_pd.register_span(&span, Access::REMOTE_WRITE) }?);
    let mut mw = if caps.mem_windows.type_2() {
        Some(mw_path(&ctx, &shared_pd, &span)?)
    } else {
        println!(
            "no type-2 memory windows on {}: only registration is measured",
            ctx.name()
        );
        None
    };
    let mut f = Figures::default();
    for _ in 0..runs {
        pass(&ctx, &shared_pd, &span, mw.as_mut(), rounds, &mut f)?;
    }
    print(&ctx, runs, rounds, &mut f, mw.as_ref());
    Ok(())
}

/// Memory windows: the window registered once with MW_BIND in the PD of a
/// "session" QP, connected to a "client" QP on the same device.
fn mw_path(ctx: &Arc<Context>, shared_pd: &Arc<ProtectionDomain>, span: &PeerSpan) -> R<MwPath> {
    // SAFETY: no remote right (MW_BIND).
    let mr =
        Arc::new(unsafe { shared_pd.register_span(span, Access::LOCAL_WRITE | Access::MW_BIND) }?);
    let server = qp(
        ctx,
        shared_pd,
        Access::REMOTE_WRITE | Access::REMOTE_READ,
        true,
    )?;
    let client_pd = ProtectionDomain::new(ctx)?;
    let client = qp(ctx, &client_pd, Access::LOCAL_READ, false)?;
    let (es, ec) = (server.endpoint(), client.endpoint());
    let server = server.handshake(&ec, &ConnectParams::default())?;
    let client = client.handshake(&es, &ConnectParams::default())?;
    let pool = MwPool::new(shared_pd);
    Ok(MwPath {
        mr,
        server,
        _client: client,
        pool,
    })
}

/// One pass: every kind measured once, `rounds` operations each.
fn pass(
    ctx: &Arc<Context>,
    shared_pd: &Arc<ProtectionDomain>,
    span: &PeerSpan,
    mw: Option<&mut MwPath>,
    rounds: u32,
    f: &mut Figures,
) -> R<()> {
    let time = |f: &mut dyn FnMut() -> R<()>| -> R<f64> {
        let t = Instant::now();
        for _ in 0..rounds {
            f()?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e6 / f64::from(rounds))
    };
    f.pd.push(time(&mut || {
        drop(ProtectionDomain::new(ctx)?);
        Ok(())
    })?);
    f.mr.push(time(&mut || {
        // SAFETY: as in main, nothing touches the span.
        drop(unsafe { shared_pd.register_span(span, Access::REMOTE_WRITE) }?);
        Ok(())
    })?);
    f.both.push(time(&mut || {
        let pd = ProtectionDomain::new(ctx)?;
        // SAFETY: as in main.
        drop(unsafe { pd.register_span(span, Access::REMOTE_WRITE) }?);
        Ok(())
    })?);
    if let Some(MwPath {
        mr, server, pool, ..
    }) = mw
    {
        let (mut b, mut i) = (Duration::ZERO, Duration::ZERO);
        f.mw.push(time(&mut || {
            let mut mw = pool.take()?;
            let t = Instant::now();
            // SAFETY: as in main.
            unsafe { mw.bind(server, mr, span.addr(), WIN, Access::REMOTE_WRITE, TIMEOUT) }?;
            let t2 = Instant::now();
            mw.invalidate(server, TIMEOUT)?;
            i += t2.elapsed();
            b += t2 - t;
            pool.put(mw);
            Ok(())
        })?);
        f.bind.push(b.as_secs_f64() * 1e6 / f64::from(rounds));
        f.inv.push(i.as_secs_f64() * 1e6 / f64::from(rounds));
    }
    Ok(())
}

/// The median of the passes, with their spread, a line per kind.
fn print(ctx: &Context, runs: usize, rounds: u32, f: &mut Figures, mw: Option<&MwPath>) {
    let line = |what: &str, v: &mut Vec<f64>| {
        let (med, lo, hi) = stats(v);
        println!("{what:<52} {med:>9.1} us  ({lo:.1}..{hi:.1})");
    };
    println!(
        "median of {runs} interleaved passes, each the mean of {rounds}; device {}, window {} MiB",
        ctx.name(),
        WIN >> 20
    );
    line("per-session PD alloc+dealloc", &mut f.pd);
    line("per grant: reg_mr + dereg_mr of the window", &mut f.mr);
    line("both (a new PD + registration per grant)", &mut f.both);
    if let Some(mw) = mw {
        line("per grant: MW bind + invalidate (pooled window)", &mut f.mw);
        line("  of which bind (post + completion)", &mut f.bind);
        line("  of which invalidate (post + completion)", &mut f.inv);
        let (mr, _, _) = stats(&mut f.mr);
        let (mwv, _, _) = stats(&mut f.mw);
        println!("reg_mr + dereg_mr / (bind + invalidate) = {:.1}x", mr / mwv);
        println!("memory windows allocated: {}", mw.pool.allocated());
    }
}
