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
use rcp::verbs::{ConnectParams, Context, MwPool, PreparedQp, ProtectionDomain, QpBuilder};

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

    // Memory windows: the window registered once with MW_BIND in the PD of
    // a "session" QP, connected to a "client" QP on the same device.
    let mw_setup = if caps.mem_windows.type_2() {
        // SAFETY: no remote right (MW_BIND).
        let mr = Arc::new(unsafe {
            shared_pd.register_span(&span, Access::LOCAL_WRITE | Access::MW_BIND)
        }?);
        let server = qp(
            &ctx,
            &shared_pd,
            Access::REMOTE_WRITE | Access::REMOTE_READ,
            true,
        )?;
        let client_pd = ProtectionDomain::new(&ctx)?;
        let client = qp(&ctx, &client_pd, Access::LOCAL_READ, false)?;
        let (es, ec) = (server.endpoint(), client.endpoint());
        let server = server.handshake(&ec, &ConnectParams::default())?;
        let client = client.handshake(&es, &ConnectParams::default())?;
        let pool = MwPool::new(&shared_pd);
        Some((mr, server, client, pool))
    } else {
        println!(
            "no type-2 memory windows on {}: only registration is measured",
            ctx.name()
        );
        None
    };

    let time = |f: &mut dyn FnMut() -> R<()>| -> R<f64> {
        let t = Instant::now();
        for _ in 0..rounds {
            f()?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e6 / f64::from(rounds))
    };
    let (mut pd_us, mut mr_us, mut both_us) = (Vec::new(), Vec::new(), Vec::new());
    let (mut mw_us, mut bind_us, mut inv_us) = (Vec::new(), Vec::new(), Vec::new());
    let mut mw_setup = mw_setup;
    for _ in 0..runs {
        pd_us.push(time(&mut || {
            drop(ProtectionDomain::new(&ctx)?);
            Ok(())
        })?);
        mr_us.push(time(&mut || {
            // SAFETY: as above, nothing touches the span.
            drop(unsafe { shared_pd.register_span(&span, Access::REMOTE_WRITE) }?);
            Ok(())
        })?);
        both_us.push(time(&mut || {
            let pd = ProtectionDomain::new(&ctx)?;
            // SAFETY: as above.
            drop(unsafe { pd.register_span(&span, Access::REMOTE_WRITE) }?);
            Ok(())
        })?);
        if let Some((mr, server, _client, pool)) = mw_setup.as_mut() {
            let (mut b, mut i) = (Duration::ZERO, Duration::ZERO);
            mw_us.push(time(&mut || {
                let mut mw = pool.take()?;
                let t = Instant::now();
                // SAFETY: as above.
                unsafe { mw.bind(server, mr, span.addr(), WIN, Access::REMOTE_WRITE, TIMEOUT) }?;
                let t2 = Instant::now();
                mw.invalidate(server, TIMEOUT)?;
                i += t2.elapsed();
                b += t2 - t;
                pool.put(mw);
                Ok(())
            })?);
            bind_us.push(b.as_secs_f64() * 1e6 / f64::from(rounds));
            inv_us.push(i.as_secs_f64() * 1e6 / f64::from(rounds));
        }
    }
    let line = |what: &str, v: &mut Vec<f64>| {
        let (med, lo, hi) = stats(v);
        println!("{what:<52} {med:>9.1} us  ({lo:.1}..{hi:.1})");
    };
    println!(
        "median of {runs} interleaved passes, each the mean of {rounds}; device {}, window {} MiB",
        ctx.name(),
        WIN >> 20
    );
    line("per-session PD alloc+dealloc", &mut pd_us);
    line("per grant: reg_mr + dereg_mr of the window", &mut mr_us);
    line("both (a new PD + registration per grant)", &mut both_us);
    if mw_setup.is_some() {
        line(
            "per grant: MW bind + invalidate (pooled window)",
            &mut mw_us,
        );
        line("  of which bind (post + completion)", &mut bind_us);
        line("  of which invalidate (post + completion)", &mut inv_us);
        let (mr, _, _) = stats(&mut mr_us);
        let (mw, _, _) = stats(&mut mw_us);
        println!("reg_mr + dereg_mr / (bind + invalidate) = {:.1}x", mr / mw);
    }
    if let Some((_, _, _, pool)) = &mw_setup {
        println!("memory windows allocated: {}", pool.allocated());
    }
    Ok(())
}
