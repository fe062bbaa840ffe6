//! A perftest-like benchmark of the data path (engine + runner) on the verbs
//! provider, loopback in one process: two QPs on one device, A posts.
//!
//! ```text
//! bench [--op write|read] [--size BYTES] [--batch N] [--signal-every N]
//!       [--inline N] [--mode poll|event|hybrid] [--iters N | --seconds S]
//!       [--qps N] [--device NAME]
//! bench --compare [--device NAME]
//! ```
//! One machine-parsable line per run:
//! `bench op=write size=64 batch=32 signal=32 inline=0 mode=poll qps=1 msgs=.. msg_per_s=.. ...`
//! Messages smaller than the engine's 4 KiB minimum block are posted as the
//! first `size` bytes of each block (`DataPathConfig::payload_cap`).
//! Latency is post → completion of each signaled request (for a chain: its
//! tail) as seen by the completion thread. CPU time is the process's
//! (getrusage: user + system, both threads) per message.

use std::time::Instant;

use rcp::datapath::*;
use rcp::engine::{LocalSeg, OpKind, Transfer, Window};
use rcp::mem::{Arena, ArenaConfig};
use rcp::provider::Channel;
use rcp::verbs::*;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SQ: u32 = 128;
/// Staging bytes per QP on A; remote region bytes per QP on B.
const REGION: usize = 32 << 20;

struct Qp {
    a: VerbsChannel,
    b: VerbsChannel,
    a_arena: Arena,
    a_mr: MemoryRegion,
    b_arena: Arena,
    b_mr: MemoryRegion,
}

struct Side {
    pd: std::sync::Arc<ProtectionDomain>,
    ctx: std::sync::Arc<Context>,
    port: u8,
    gid_index: u32,
}

fn side(device: Option<&str>) -> R<Side> {
    let ctx = Context::open(device)?;
    let (port, gid) = ctx.select_port(None)?;
    Ok(Side {
        pd: ProtectionDomain::new(&ctx)?,
        ctx,
        port: port.port,
        gid_index: gid.entry.index,
    })
}

fn channel(s: &Side) -> R<VerbsChannel> {
    let cc = CompletionChannel::new(&s.ctx)?;
    let cq = CompletionQueue::new(&s.ctx, 4 * SQ, Some(&cc))?;
    let qp = QueuePair::new(
        &s.pd,
        &cq,
        &cq,
        QpConfig {
            port: s.port,
            gid_index: s.gid_index,
            sq_depth: SQ,
            max_send_sge: 1,
            max_inline: 64,
            remote_access: Access::REMOTE_WRITE | Access::REMOTE_READ,
        },
    )?;
    Ok(VerbsChannel::new(qp))
}

fn arena(s: &Side) -> R<(Arena, MemoryRegion)> {
    let mut cfg = ArenaConfig::new(REGION);
    cfg.numa_node = s.ctx.numa_node();
    let a = Arena::new(&cfg)?;
    let mr = s.pd.register_arena(
        &a,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    )?;
    Ok((a, mr))
}

fn rig(device: Option<&str>, qps: usize) -> R<Vec<Qp>> {
    let (sa, sb) = (side(device)?, side(device)?);
    let mut out = Vec::new();
    for _ in 0..qps {
        let (a, b) = (channel(&sa)?, channel(&sb)?);
        let (ea, eb) = (a.endpoint(), b.endpoint());
        a.handshake(&eb, &ConnectParams::default())?;
        b.handshake(&ea, &ConnectParams::default())?;
        let (a_arena, a_mr) = arena(&sa)?;
        let (b_arena, b_mr) = arena(&sb)?;
        out.push(Qp {
            a,
            b,
            a_arena,
            a_mr,
            b_arena,
            b_mr,
        });
    }
    Ok(out)
}

#[derive(Clone, Debug)]
struct Opts {
    op: OpKind,
    size: u64,
    batch: usize,
    signal: usize,
    inline: u32,
    mode: PollMode,
    iters: u64,
    seconds: Option<f64>,
    qps: usize,
}

fn cpu_ns() -> u64 {
    use nix::sys::resource::{getrusage, UsageWho};
    let u = getrusage(UsageWho::RUSAGE_SELF).expect("getrusage");
    let t = |tv: nix::sys::time::TimeVal| {
        tv.tv_sec() as u64 * 1_000_000_000 + tv.tv_usec() as u64 * 1000
    };
    t(u.user_time()) + t(u.system_time())
}

/// One data-path run of `iters` messages on one QP.
fn run_qp(q: &Qp, o: &Opts, iters: u64) -> R<Report> {
    let block = o.size.next_power_of_two().max(4096);
    let mut cfg = DataPathConfig {
        batch: o.batch,
        signal_every: o.signal,
        max_inline: Some(o.inline),
        poll_mode: o.mode,
        ..DataPathConfig::default()
    };
    if o.size < block {
        cfg.payload_cap = Some(o.size as u32);
    }
    let caps = q.a.caps();
    let tc = cfg.transfer_config(o.op, iters * block, block, &caps)?;
    let nbuf = (REGION as u64 / block).min(u64::from(SQ));
    let bufs = (0..nbuf)
        .map(|i| LocalSeg {
            addr: q.a_arena.addr() + i * block,
            len: block as u32,
            lkey: q.a_mr.lkey(),
        })
        .collect();
    let mut t = Transfer::new(tc, bufs)?;
    // Windows of the remote region, all mapped onto the same memory.
    let wlen = (REGION as u64 / block) * block;
    let total = iters * block;
    let (base, rkey) = (q.b_arena.addr(), q.b_mr.rkey());
    let mut k = 0u64;
    let mut io = NullIo {
        windows: move || {
            let off = k * wlen;
            (off < total).then(|| {
                k += 1;
                Window {
                    id: k,
                    remote_addr: base,
                    rkey,
                    len: wlen.min(total - off),
                    file_offset: off,
                    epoch: 0,
                }
            })
        },
    };
    let r = run_transfer(&q.a, &mut t, &mut io, &cfg, &mut || {
        let ea = q.a.reset()?;
        let eb = q.b.reset()?;
        q.a.handshake(&eb, &ConnectParams::default())?;
        q.b.handshake(&ea, &ConnectParams::default())?;
        Ok(())
    })?;
    Ok(r)
}

fn merge(into: &mut Report, r: Report, seconds_max: bool) {
    into.bytes += r.bytes;
    into.msgs += r.msgs;
    into.posted += r.posted;
    into.doorbells += r.doorbells;
    into.signaled += r.signaled;
    into.inline += r.inline;
    into.completions += r.completions;
    into.polls += r.polls;
    into.empty_polls += r.empty_polls;
    into.arms += r.arms;
    into.wakeups += r.wakeups;
    into.seconds = if seconds_max {
        into.seconds.max(r.seconds)
    } else {
        into.seconds + r.seconds
    };
    // Keep the first run's latency samples plus later ones.
    if into.latency.count() == 0 {
        into.latency = r.latency;
    }
}

fn bench(rig: &[Qp], o: &Opts) -> R<String> {
    let cpu0 = cpu_ns();
    let t0 = Instant::now();
    let mut total = Report::default();
    let chunk = o.iters;
    loop {
        let reports: Vec<R<Report>> = std::thread::scope(|s| {
            let hs: Vec<_> = rig[..o.qps]
                .iter()
                .map(|q| s.spawn(move || run_qp(q, o, chunk)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("bench thread"))
                .collect()
        });
        let mut round = Report::default();
        for r in reports {
            merge(&mut round, r?, true);
        }
        merge(&mut total, round, false);
        match o.seconds {
            Some(s) if t0.elapsed().as_secs_f64() < s => continue,
            _ => break,
        }
    }
    let cpu = cpu_ns() - cpu0;
    let secs = total.seconds.max(1e-9);
    Ok(format!(
        "bench op={} size={} batch={} signal={} inline={} mode={} qps={} msgs={} seconds={:.3} \
         gbps={:.3} mb_per_s={:.1} msg_per_s={:.0} p50_us={:.1} p99_us={:.1} doorbells={} \
         signaled={} inline_posted={} completions={} cpu_ns_per_msg={:.0} polls={} empty_polls={} arms={} wakeups={}",
        match o.op {
            OpKind::Write => "write",
            OpKind::Read => "read",
        },
        o.size,
        o.batch,
        o.signal,
        o.inline,
        match o.mode {
            PollMode::Hybrid { .. } => "hybrid".to_string(),
            m => m.to_string(),
        },
        o.qps,
        total.msgs,
        secs,
        total.bytes as f64 * 8.0 / secs / 1e9,
        total.bytes as f64 / secs / 1e6,
        total.msgs as f64 / secs,
        total.p50_us(),
        total.p99_us(),
        total.doorbells,
        total.signaled,
        total.inline,
        total.completions,
        cpu as f64 / total.msgs.max(1) as f64,
        total.polls,
        total.empty_polls,
        total.arms,
        total.wakeups,
    ))
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() -> R<()> {
    let args: Vec<String> = std::env::args().collect();
    let device = arg(&args, "--device");
    let num = |n: &str, d: u64| -> R<u64> {
        Ok(arg(&args, n).map(|s| s.parse()).transpose()?.unwrap_or(d))
    };
    let batch = num("--batch", 32)? as usize;
    let mut o = Opts {
        op: match arg(&args, "--op").as_deref() {
            None | Some("write") => OpKind::Write,
            Some("read") => OpKind::Read,
            Some(x) => return Err(format!("--op {x}: expected write or read").into()),
        },
        size: num("--size", 65536)?,
        batch,
        signal: num("--signal-every", batch as u64)? as usize,
        inline: num("--inline", 0)? as u32,
        mode: arg(&args, "--mode")
            .map(|m| m.parse::<PollMode>())
            .transpose()
            .map_err(|e| format!("--mode: {e}"))?
            .unwrap_or(PollMode::Poll),
        iters: num("--iters", 10_000)?,
        seconds: arg(&args, "--seconds").map(|s| s.parse()).transpose()?,
        qps: num("--qps", 1)? as usize,
    };
    if o.size == 0 || o.size > 1 << 30 {
        return Err("--size must be in 1..=1 GiB".into());
    }
    let compare = args.iter().any(|a| a == "--compare");
    let rig = rig(device.as_deref(), if compare { 1 } else { o.qps.max(1) })?;
    if !compare {
        println!("{}", bench(&rig, &o)?);
        return Ok(());
    }
    // The seed document's table, on this device: 64 B writes.
    let small = num("--iters", 100_000)?;
    let runs: Vec<(&str, Opts)> = vec![
        (
            "single post, signal every",
            Opts {
                size: 64,
                batch: 1,
                signal: 1,
                inline: 0,
                iters: small,
                ..o.clone()
            },
        ),
        (
            "batch 32, signal last",
            Opts {
                size: 64,
                batch: 32,
                signal: 32,
                inline: 0,
                iters: small,
                ..o.clone()
            },
        ),
        (
            "batch 32, signal last, inline 64",
            Opts {
                size: 64,
                batch: 32,
                signal: 32,
                inline: 64,
                iters: small,
                ..o.clone()
            },
        ),
        (
            "latency: poll",
            Opts {
                size: 64,
                batch: 1,
                signal: 1,
                inline: 64,
                iters: small / 4,
                mode: PollMode::Poll,
                ..o.clone()
            },
        ),
        (
            "latency: event",
            Opts {
                size: 64,
                batch: 1,
                signal: 1,
                inline: 64,
                iters: small / 4,
                mode: PollMode::Event,
                ..o.clone()
            },
        ),
        (
            "latency: hybrid",
            Opts {
                size: 64,
                batch: 1,
                signal: 1,
                inline: 64,
                iters: small / 4,
                mode: PollMode::Hybrid { empty_polls: 1024 },
                ..o.clone()
            },
        ),
        (
            "bandwidth: 1 MiB write",
            Opts {
                op: OpKind::Write,
                size: 1 << 20,
                batch: 32,
                signal: 32,
                inline: 0,
                iters: 200,
                ..o.clone()
            },
        ),
        (
            "bandwidth: 1 MiB read",
            Opts {
                op: OpKind::Read,
                size: 1 << 20,
                batch: 32,
                signal: 32,
                inline: 0,
                iters: 200,
                ..o.clone()
            },
        ),
    ];
    for (what, r) in runs {
        o = r;
        println!("{}  # {what}", bench(&rig, &o)?);
    }
    Ok(())
}
