//! The bench on a device: lanes (one QP, its staging and the region it
//! targets), loopback, server and client.

use std::io::BufReader;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::wire::{self, QpInfo, Region};
use super::{BenchError, BenchOptions, Measured, MAX_QPS};
use crate::datapath::{run_transfer, DataPathConfig, NullIo, ReconnectError, Report};
use crate::engine::{LocalSeg, Transfer, Window};
use crate::mem::{Arena, ArenaConfig};
use crate::provider::Channel;
use crate::verbs::{
    Access, CompletionChannel, CompletionQueue, ConnectParams, Context, MemoryRegion,
    ProtectionDomain, QpConfig, QueuePair, VerbsChannel,
};

/// Send-queue depth of every bench QP.
pub(super) const SQ: u32 = 128;
/// Staging bytes per QP on the posting side; region bytes per QP on the
/// target side.
pub(super) const REGION: usize = 32 << 20;

struct Side {
    ctx: Arc<Context>,
    pd: Arc<ProtectionDomain>,
    port: u8,
    gid_index: u32,
}

fn side(device: Option<&str>, gid_index: Option<u32>) -> Result<Side, BenchError> {
    let ctx = Context::open(device)?;
    let (port, gid) = ctx.select_port(gid_index)?;
    Ok(Side {
        pd: ProtectionDomain::new(&ctx)?,
        ctx,
        port: port.port,
        gid_index: gid.entry.index,
    })
}

fn channel(s: &Side) -> Result<VerbsChannel, BenchError> {
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

fn region(s: &Side) -> Result<(Arena, MemoryRegion), BenchError> {
    let mut cfg = ArenaConfig::new(REGION);
    cfg.numa_node = s.ctx.numa_node();
    let a = Arena::new(&cfg).map_err(|e| BenchError::Mem(e.to_string()))?;
    let mr = s.pd.register_arena(
        &a,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    )?;
    Ok((a, mr))
}

fn info(s: &Side, ch: &VerbsChannel) -> QpInfo {
    let caps = s.ctx.caps();
    QpInfo {
        ep: ch.endpoint(),
        rd_atom: caps.max_qp_rd_atom,
        init_rd_atom: caps.max_qp_init_rd_atom,
    }
}

/// Initiator depth = min(ours, the peer's responder depth); responder
/// depth = ours.
fn params(local: &QpInfo, peer: &QpInfo) -> ConnectParams {
    ConnectParams {
        max_rd_atomic: local.init_rd_atom.min(peer.rd_atom).clamp(1, 255) as u8,
        max_dest_rd_atomic: local.rd_atom.clamp(1, 255) as u8,
        ..ConnectParams::default()
    }
}

/// The target side of a loopback lane, kept for the lane's life (and for
/// reconnects).
struct Peer {
    ch: VerbsChannel,
    _arena: Arena,
    _mr: MemoryRegion,
}

/// One QP that posts, its staging, and the region it targets.
struct Lane {
    ch: VerbsChannel,
    arena: Arena,
    mr: MemoryRegion,
    remote: Region,
    peer: Option<Peer>,
    /// The posting device's NUMA node (for `--cq-cpu auto`).
    numa_node: Option<u32>,
}

fn cpu_ns() -> u64 {
    use nix::sys::resource::{getrusage, UsageWho};
    let Ok(u) = getrusage(UsageWho::RUSAGE_SELF) else {
        return 0;
    };
    let t = |tv: nix::sys::time::TimeVal| {
        tv.tv_sec() as u64 * 1_000_000_000 + tv.tv_usec() as u64 * 1000
    };
    t(u.user_time()) + t(u.system_time())
}

/// One data-path run of `iters` messages on lane number `i`.
fn run_lane(i: usize, l: &Lane, o: &BenchOptions, iters: u64) -> Result<Report, BenchError> {
    let block = o.block();
    let mut cfg = DataPathConfig {
        batch: o.batch,
        signal_every: o.signal_every,
        max_inline: Some(o.inline),
        poll_mode: o.mode,
        cq_cpu: o.cq_cpu.for_thread(l.numa_node, i),
        tx_depth: o.tx_depth.map(|t| t as usize),
        ..DataPathConfig::default()
    };
    if o.size < block {
        cfg.payload_cap = Some(o.size as u32);
    }
    let wlen = (l.remote.len / block) * block;
    let nbuf = (l.arena.len() as u64 / block).min(u64::from(SQ));
    if wlen == 0 || nbuf == 0 {
        return Err(BenchError::Invalid(format!(
            "--size {}: larger than the {} byte region",
            o.size,
            l.remote.len.min(l.arena.len() as u64)
        )));
    }
    let caps = l.ch.caps();
    let tc = cfg
        .transfer_config(o.op, iters * block, block, &caps)
        .map_err(crate::datapath::DataPathError::from)?;
    let bufs = (0..nbuf)
        .map(|i| LocalSeg {
            addr: l.arena.addr() + i * block,
            len: block as u32,
            lkey: l.mr.lkey(),
        })
        .collect();
    let mut t = Transfer::new(tc, bufs).map_err(|e| BenchError::Invalid(format!("engine: {e}")))?;
    // Windows of the remote region, all mapped onto the same memory.
    let total = iters * block;
    let (base, rkey) = (l.remote.addr, l.remote.rkey);
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
    let r = run_transfer(
        &l.ch,
        &mut t,
        &mut io,
        &cfg,
        &mut || -> Result<(), ReconnectError> {
            let Some(p) = &l.peer else {
                return Err("the bench does not reconnect across hosts; run it again".into());
            };
            let ea = l.ch.reset()?;
            let eb = p.ch.reset()?;
            l.ch.handshake(&eb, &ConnectParams::default())?;
            p.ch.handshake(&ea, &ConnectParams::default())?;
            Ok(())
        },
    )?;
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
    into.waits += r.waits;
    into.wakeups += r.wakeups;
    into.reconnects += r.reconnects;
    into.seconds = if seconds_max {
        into.seconds.max(r.seconds)
    } else {
        into.seconds + r.seconds
    };
    // Keep the first run's latency samples (one QP's is representative).
    if into.latency.count() == 0 {
        into.latency = r.latency;
    }
}

/// Run `o` on the first `o.qps` lanes, one thread each; repeat rounds
/// until `o.seconds` when set.
fn run_lanes(lanes: &[Lane], o: &BenchOptions) -> Result<Measured, BenchError> {
    let n = o.qps.min(lanes.len());
    let cpu0 = cpu_ns();
    let t0 = Instant::now();
    let mut total = Report::default();
    loop {
        let reports: Vec<Result<Report, BenchError>> = std::thread::scope(|s| {
            let hs: Vec<_> = lanes[..n]
                .iter()
                .enumerate()
                .map(|(i, l)| s.spawn(move || run_lane(i, l, o, o.iters)))
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
    Ok(Measured {
        report: total,
        cpu_ns: cpu_ns().saturating_sub(cpu0),
    })
}

/// `qps` loopback lanes: two QPs on the same device, connected in-process.
fn loopback_lanes(o: &BenchOptions, qps: usize) -> Result<Vec<Lane>, BenchError> {
    let dev = o.device.as_deref();
    let (sa, sb) = (side(dev, o.gid_index)?, side(dev, o.gid_index)?);
    let mut out = Vec::new();
    for _ in 0..qps {
        let (a, b) = (channel(&sa)?, channel(&sb)?);
        let (ia, ib) = (info(&sa, &a), info(&sb, &b));
        a.handshake(&ib.ep, &params(&ia, &ib))?;
        b.handshake(&ia.ep, &params(&ib, &ia))?;
        let (arena, mr) = region(&sa)?;
        let (b_arena, b_mr) = region(&sb)?;
        let remote = Region {
            addr: b_arena.addr(),
            rkey: b_mr.rkey(),
            len: b_arena.len() as u64,
        };
        out.push(Lane {
            ch: a,
            arena,
            mr,
            remote,
            peer: Some(Peer {
                ch: b,
                _arena: b_arena,
                _mr: b_mr,
            }),
            numa_node: sa.ctx.numa_node(),
        });
    }
    Ok(out)
}

/// The bench in one process: A posts into B's region on the same device.
pub fn run_loopback(o: &BenchOptions) -> Result<Measured, BenchError> {
    o.validate()?;
    let lanes = loopback_lanes(o, o.qps)?;
    run_lanes(&lanes, o)
}

/// The seed's table ([`super::compare_runs`]) on the local device, one
/// loopback rig for all runs; `out` gets each run as it finishes.
pub fn run_compare(
    base: &BenchOptions,
    small: u64,
    out: &mut dyn FnMut(&str, &BenchOptions, &Measured),
) -> Result<(), BenchError> {
    base.validate()?;
    let runs = super::compare_runs(base, small);
    for (_, o) in &runs {
        o.validate()?;
    }
    let lanes = loopback_lanes(base, 1)?;
    for (what, o) in &runs {
        let m = run_lanes(&lanes, o)?;
        out(what, o, &m);
    }
    Ok(())
}

/// `rcp bench --server`.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// `ADDR:PORT` to listen on.
    pub listen: String,
    pub device: Option<String>,
    pub gid_index: Option<u32>,
    /// Serve clients one after another until killed (perftest exits after
    /// one; so do we by default).
    pub keep_serving: bool,
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> BenchError {
    let context = context.into();
    move |source| BenchError::Io { context, source }
}

/// Handshake timeout (the run itself is not bounded).
const HANDSHAKE: Duration = Duration::from_secs(30);

/// Serve bench clients: regions per QP, endpoints over the handshake; the
/// client runs the data path. `on_listen` gets the bound address.
pub fn serve(so: &ServerOptions, on_listen: &mut dyn FnMut(SocketAddr)) -> Result<(), BenchError> {
    let s = side(so.device.as_deref(), so.gid_index)?;
    let l = TcpListener::bind(&so.listen).map_err(io_err(format!("listening on {}", so.listen)))?;
    on_listen(l.local_addr().map_err(io_err("local address"))?);
    loop {
        let (stream, peer) = l.accept().map_err(io_err("accepting a client"))?;
        tracing::info!(%peer, "bench client");
        let r = serve_one(&s, stream);
        match &r {
            Ok(()) => tracing::info!(%peer, "bench client done"),
            Err(e) => tracing::warn!(%peer, error = %e, "bench client failed"),
        }
        if !so.keep_serving {
            return r;
        }
    }
}

fn serve_one(s: &Side, stream: TcpStream) -> Result<(), BenchError> {
    stream
        .set_read_timeout(Some(HANDSHAKE))
        .map_err(io_err("socket"))?;
    let _ = stream.set_nodelay(true);
    let mut w = stream.try_clone().map_err(io_err("socket"))?;
    let mut r = BufReader::new(stream);
    let n = wire::parse_hello(&wire::read_words(&mut r)?, MAX_QPS)?;
    let mut lanes = Vec::with_capacity(n);
    for _ in 0..n {
        let ch = channel(s)?;
        let (arena, mr) = region(s)?;
        let reg = Region {
            addr: arena.addr(),
            rkey: mr.rkey(),
            len: arena.len() as u64,
        };
        wire::write_line(&mut w, &wire::qp_line(&info(s, &ch), Some(&reg)))?;
        lanes.push((ch, arena, mr));
    }
    for (ch, _, _) in &lanes {
        let (peer, _) = wire::parse_qp(&wire::read_words(&mut r)?, false)?;
        ch.handshake(&peer.ep, &params(&info(s, ch), &peer))?;
    }
    wire::write_line(&mut w, "ready")?;
    // The client runs now, for as long as it takes; the regions stay up
    // until it says done (or goes away).
    r.get_ref()
        .set_read_timeout(None)
        .map_err(io_err("socket"))?;
    let end = wire::expect(&mut r, "done");
    let _ = wire::write_line(&mut w, "bye");
    for (ch, _, _) in &lanes {
        let _ = ch.set_error();
    }
    end
}

/// `rcp bench HOST[:PORT]`: run `o` against a `rcp bench --server`.
pub fn run_client(addr: &str, o: &BenchOptions) -> Result<Measured, BenchError> {
    o.validate()?;
    let s = side(o.device.as_deref(), o.gid_index)?;
    // The server may still be opening its device: retry for a while.
    let t0 = Instant::now();
    let stream = loop {
        match TcpStream::connect(addr) {
            Ok(c) => break c,
            Err(_) if t0.elapsed() < HANDSHAKE => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => return Err(io_err(format!("connecting to {addr}"))(e)),
        }
    };
    stream
        .set_read_timeout(Some(HANDSHAKE))
        .map_err(io_err("socket"))?;
    let _ = stream.set_nodelay(true);
    let mut w = stream.try_clone().map_err(io_err("socket"))?;
    let mut r = BufReader::new(stream);
    wire::write_line(&mut w, &wire::hello(o.qps))?;
    let mut remote = Vec::with_capacity(o.qps);
    for _ in 0..o.qps {
        let (q, reg) = wire::parse_qp(&wire::read_words(&mut r)?, true)?;
        remote.push((q, reg.expect("parsed with a region")));
    }
    let mut lanes = Vec::with_capacity(o.qps);
    for (peer, reg) in remote {
        let ch = channel(&s)?;
        let me = info(&s, &ch);
        wire::write_line(&mut w, &wire::qp_line(&me, None))?;
        ch.handshake(&peer.ep, &params(&me, &peer))?;
        let (arena, mr) = region(&s)?;
        lanes.push(Lane {
            ch,
            arena,
            mr,
            remote: reg,
            peer: None,
            numa_node: s.ctx.numa_node(),
        });
    }
    wire::expect(&mut r, "ready")?;
    let m = run_lanes(&lanes, o);
    let _ = wire::write_line(&mut w, "done");
    let _ = wire::expect(&mut r, "bye");
    m
}
