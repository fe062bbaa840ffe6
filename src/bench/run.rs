//! The bench on a device: lanes (one QP, its staging and the region it
//! targets), loopback, server and client.

use std::io::BufReader;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::wire::{self, QpInfo, Region};
use super::{BenchError, BenchOptions, Measured, MAX_QPS};
use crate::datapath::{DataPath, DataPathConfig, DpEvent, ReconnectError, ReconnectFn, Report};
use crate::engine::{Extent, WindowJob};
use crate::mem::{Arena, ArenaConfig};
use crate::provider::verbs::VerbsChannel;
use crate::provider::Channel;
use crate::verbs::{Access, ConnectParams, Context, MemoryRegion, ProtectionDomain, QpBuilder};

/// Send-queue depth of every bench QP.
pub(super) const SQ: u32 = 128;
/// Staging bytes per QP on the posting side; region bytes per QP on the
/// target side.
pub(super) const REGION: usize = 32 << 20;
/// Bytes per window (larger messages: one message per window).
const WINDOW: u64 = 4 << 20;

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
    let qp = QpBuilder::new(&s.pd, s.port, s.gid_index)
        .sq_depth(SQ)
        .max_inline(64)
        .remote_access(Access::REMOTE_WRITE | Access::REMOTE_READ)
        .events(true)
        .build()?;
    Ok(qp.into_channel())
}

fn region(s: &Side) -> Result<(Arena, MemoryRegion), BenchError> {
    let mut cfg = ArenaConfig::new(REGION);
    cfg.numa_node = s.ctx.numa_node();
    let a = Arena::new(&cfg).map_err(|e| BenchError::Mem(e.to_string()))?;
    // SAFETY: the bench never reads or writes its arenas from the CPU
    // (no block, slice or span over them): the only accesses are the
    // requests it measures, whose bytes nobody looks at.
    let mr = unsafe {
        s.pd.register_arena(
            &a,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
    }?;
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
pub(super) struct Peer {
    ch: Arc<VerbsChannel>,
    _arena: Arena,
    _mr: MemoryRegion,
}

/// What a lane posts through: a QP (with, loopback, the QP it is
/// connected to), or the TCP provider's channel (with, loopback, the
/// target it talks to).
pub(super) enum Link {
    Verbs {
        ch: Arc<VerbsChannel>,
        peer: Option<Peer>,
    },
    Tcp {
        ch: Arc<crate::provider::tcp::TcpChannel>,
        /// Loopback: what keeps the target and its region alive
        /// (dropped after the channel: fields drop in order).
        _peer: Option<Box<dyn std::any::Any + Send + Sync>>,
    },
}

/// One QP (or TCP channel) that posts, its staging, and the region it
/// targets.
pub(super) struct Lane {
    pub(super) link: Link,
    pub(super) arena: Arena,
    /// The staging's local key.
    pub(super) lkey: u32,
    /// What keeps `lkey` valid (a memory region, a TCP registration).
    pub(super) _reg: Box<dyn std::any::Any + Send + Sync>,
    pub(super) remote: Region,
    /// The posting device's NUMA node (for `--cq-cpu auto`).
    pub(super) numa_node: Option<u32>,
}

impl Lane {
    fn channel(&self) -> Arc<dyn Channel> {
        match &self.link {
            Link::Verbs { ch, .. } => ch.clone(),
            Link::Tcp { ch, .. } => ch.clone(),
        }
    }

    /// After a failure: nothing may still write the staging arena when it
    /// is reused. A QP goes to the error state; a TCP lane is never reused
    /// (its runs are not repeated after a failure, and its channel drops
    /// before its arena).
    fn stop(&self) {
        if let Link::Verbs { ch, .. } = &self.link {
            let _ = ch.set_error();
        }
    }
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

/// The windows of a lane: `count` windows of `per` messages, message `k`
/// of window `w` at offset `w * bytes + k * slot` on both sides (staging
/// and the peer's region have the same layout).
#[derive(Clone, Copy, Debug)]
struct Layout {
    slot: u64,
    per: u64,
    bytes: u64,
    count: u64,
}

fn layout(l: &Lane, o: &BenchOptions) -> Result<Layout, BenchError> {
    let slot = o.block();
    let bytes = WINDOW.max(slot);
    let room = l.remote.len.min(l.arena.len() as u64);
    let count = room / bytes;
    if count == 0 {
        return Err(BenchError::Invalid(format!(
            "--size {}: larger than the {room} byte region",
            o.size
        )));
    }
    Ok(Layout {
        slot,
        per: bytes / slot,
        bytes,
        count,
    })
}

/// Messages `n` of `o.size` bytes into window slot `w`.
fn window(l: &Lane, o: &BenchOptions, lay: &Layout, id: u64, w: u64, n: u64) -> WindowJob {
    let base = w * lay.bytes;
    WindowJob {
        id,
        op: o.op,
        local_addr: l.arena.addr() + base,
        lkey: l.lkey,
        remote_addr: l.remote.addr + base,
        rkey: l.remote.rkey,
        extents: (0..n)
            .map(|k| Extent {
                offset: k * lay.slot,
                len: o.size as u32,
            })
            .collect(),
    }
}

/// The data path of lane number `i`, for every round of a run.
fn start_lane(i: usize, l: &Lane, o: &BenchOptions) -> Result<DataPath, BenchError> {
    let cfg = DataPathConfig {
        batch: o.batch,
        signal_every: o.signal_every,
        max_inline: Some(o.inline),
        poll_mode: o.mode,
        cq_cpu: o.cq_cpu.for_thread(l.numa_node, i),
        tx_depth: o.tx_depth.map(|t| t as usize),
        ..DataPathConfig::default()
    };
    let (me, peer) = match &l.link {
        Link::Verbs { ch, peer } => (ch.clone(), peer.as_ref().map(|p| p.ch.clone())),
        Link::Tcp { .. } => {
            let reconnect: ReconnectFn = Box::new(|| {
                Err(ReconnectError::permanent(
                    "the bench does not reconnect over tcp; run it again",
                ))
            });
            return Ok(DataPath::start(cfg, l.channel(), reconnect, None)?);
        }
    };
    let reconnect: ReconnectFn = Box::new(move || -> Result<(), ReconnectError> {
        let Some(p) = &peer else {
            return Err(ReconnectError::permanent(
                "the bench does not reconnect across hosts; run it again",
            ));
        };
        let ea = me.reset().map_err(ReconnectError::retryable)?;
        let eb = p.reset().map_err(ReconnectError::retryable)?;
        me.handshake(&eb, &ConnectParams::default())
            .map_err(ReconnectError::retryable)?;
        p.handshake(&ea, &ConnectParams::default())
            .map_err(ReconnectError::retryable)?;
        Ok(())
    });
    Ok(DataPath::start(cfg, l.channel(), reconnect, None)?)
}

/// Rounds of `o.iters` messages on lane number `i` until `deadline` (one
/// round without it): every window slot of the region in flight, each
/// submitted again as soon as it is done. The report's seconds are from the
/// first submit to the last window done.
fn run_lane(
    i: usize,
    l: &Lane,
    o: &BenchOptions,
    deadline: Option<Instant>,
) -> Result<Report, BenchError> {
    let lay = layout(l, o)?;
    let dp = start_lane(i, l, o)?;
    let mut events = dp.take_events().expect("fresh data path");
    let t0 = Instant::now();
    let mut seq = 0u64;
    let result = (|| -> Result<(), BenchError> {
        loop {
            let mut left = o.iters;
            let mut in_flight = 0u64;
            let mut submit = |w: u64, left: &mut u64| -> Result<bool, BenchError> {
                if *left == 0 {
                    return Ok(false);
                }
                let n = (*left).min(lay.per);
                *left -= n;
                // Window ids name their slot: id % count.
                let id = seq * lay.count + w;
                seq += 1;
                // SAFETY: window slot `w` of the staging arena (registered
                // under `l.lkey`, alive as long as the lane) is used by this
                // window alone: a slot is submitted again only after its
                // WindowDone, and the bench never reads or writes the
                // staging memory. On failure the data path is closed and the
                // lane's channel reset (or dropped) before the arena is
                // reused.
                unsafe { dp.submit(window(l, o, &lay, id, w, n)) }?;
                Ok(true)
            };
            for w in 0..lay.count {
                if submit(w, &mut left)? {
                    in_flight += 1;
                }
            }
            while in_flight > 0 {
                match events.blocking_recv() {
                    Some(DpEvent::WindowDone { id }) => {
                        in_flight -= 1;
                        if submit(id % lay.count, &mut left)? {
                            in_flight += 1;
                        }
                    }
                    Some(DpEvent::Reconnected { epoch, seconds }) => {
                        tracing::warn!(lane = i, epoch, seconds, "bench lane reconnected");
                    }
                    Some(DpEvent::Failed(e)) => return Err(e.into()),
                    // One rail per lane: never raised.
                    Some(
                        e @ (DpEvent::RailDown { .. }
                        | DpEvent::RailFenced { .. }
                        | DpEvent::RailPaused { .. }
                        | DpEvent::RailUp { .. }),
                    ) => tracing::warn!(lane = i, ?e, "bench lane rail event"),
                    None => return Err(crate::datapath::DataPathError::Stopped.into()),
                }
            }
            match deadline {
                Some(d) if Instant::now() < d => continue,
                _ => return Ok(()),
            }
        }
    })();
    let seconds = t0.elapsed().as_secs_f64();
    let mut r = dp.close();
    if let Err(e) = result {
        // Nothing may still write the staging arena when it is reused.
        l.stop();
        return Err(e);
    }
    r.seconds = seconds;
    Ok(r)
}

fn merge(into: &mut Report, r: Report, seconds_max: bool) {
    into.counters.add(&r.counters);
    into.polls += r.polls;
    into.empty_polls += r.empty_polls;
    into.arms += r.arms;
    into.waits += r.waits;
    into.wakeups += r.wakeups;
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

/// Run `o` on the first `o.qps` lanes, one thread and one data path each;
/// each lane repeats rounds of `o.iters` until `o.seconds` when set.
pub(super) fn run_lanes(lanes: &[Lane], o: &BenchOptions) -> Result<Measured, BenchError> {
    let n = o.qps.min(lanes.len());
    let cpu0 = cpu_ns();
    let deadline = o
        .seconds
        .map(|s| Instant::now() + Duration::from_secs_f64(s));
    let reports: Vec<Result<Report, BenchError>> = std::thread::scope(|s| {
        let hs: Vec<_> = lanes[..n]
            .iter()
            .enumerate()
            .map(|(i, l)| s.spawn(move || run_lane(i, l, o, deadline)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("bench thread"))
            .collect()
    });
    let mut total = Report::default();
    for r in reports {
        merge(&mut total, r?, true);
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
            link: Link::Verbs {
                ch: Arc::new(a),
                peer: Some(Peer {
                    ch: Arc::new(b),
                    _arena: b_arena,
                    _mr: b_mr,
                }),
            },
            arena,
            lkey: mr.lkey(),
            _reg: Box::new(mr),
            remote,
            numa_node: sa.ctx.numa_node(),
        });
    }
    Ok(out)
}

/// The bench in one process over verbs: A posts into B's region on the
/// same device.
pub(super) fn run_loopback_verbs(o: &BenchOptions) -> Result<Measured, BenchError> {
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
            link: Link::Verbs {
                ch: Arc::new(ch),
                peer: None,
            },
            arena,
            lkey: mr.lkey(),
            _reg: Box::new(mr),
            remote: reg,
            numa_node: s.ctx.numa_node(),
        });
    }
    wire::expect(&mut r, "ready")?;
    let m = run_lanes(&lanes, o);
    let _ = wire::write_line(&mut w, "done");
    let _ = wire::expect(&mut r, "bye");
    m
}
