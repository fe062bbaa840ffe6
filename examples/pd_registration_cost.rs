//! What per-session protection domains and per-window registrations cost:
//! ibv_alloc_pd + ibv_dealloc_pd, ibv_reg_mr + ibv_dereg_mr of one 4 MiB
//! window, and both together (a new PD and window per transfer), each the
//! mean of N rounds.
//!
//! ```text
//! pd_registration_cost [--device rxe0] [--rounds 200]
//! ```
//! Needs an RDMA device (soft-RoCE: `scripts/testbed.sh run lo -- ...`).

use std::time::Instant;

use rcp::mem::{Arena, ArenaConfig, PeerSpan};
use rcp::provider::Access;
use rcp::verbs::{Context, ProtectionDomain};

type R<T> = Result<T, Box<dyn std::error::Error>>;

const WIN: usize = 4 << 20;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() -> R<()> {
    let args: Vec<String> = std::env::args().collect();
    let rounds: u32 = arg(&args, "--rounds").map_or(Ok(200), |v| v.parse())?;
    let ctx = Context::open(arg(&args, "--device").as_deref())?;
    let arena = Arena::new(&ArenaConfig::new(WIN))?;
    println!("arena backing: {:?}", arena.backing());
    let span = PeerSpan::new(&arena, arena.addr(), WIN).ok_or("window span")?;
    let shared_pd = ProtectionDomain::new(&ctx)?;
    // Warm up (the first registration pins the pages).
    drop(shared_pd.register_span(&span, Access::REMOTE_WRITE)?);
    let time = |f: &mut dyn FnMut() -> R<()>| -> R<f64> {
        let t = Instant::now();
        for _ in 0..rounds {
            f()?;
        }
        Ok(t.elapsed().as_secs_f64() * 1e6 / f64::from(rounds))
    };
    let pd_us = time(&mut || {
        drop(ProtectionDomain::new(&ctx)?);
        Ok(())
    })?;
    let mr_us = time(&mut || {
        drop(shared_pd.register_span(&span, Access::REMOTE_WRITE)?);
        Ok(())
    })?;
    let both_us = time(&mut || {
        let pd = ProtectionDomain::new(&ctx)?;
        drop(pd.register_span(&span, Access::REMOTE_WRITE)?);
        Ok(())
    })?;
    println!(
        "per-session PD alloc+dealloc: {pd_us:.1} us; 4 MiB window reg_mr+dereg: {mr_us:.1} us; \
         both (new PD + window per transfer): {both_us:.1} us  (mean of {rounds}, device {})",
        ctx.name()
    );
    Ok(())
}
