//! Two rails on a real fabric (soft-RoCE in the test VM's `rails`
//! topology: rxea0, rxea1 in namespace a, rxeb0, rxeb1 in b, a subnet per
//! veth pair): `rcp doctor` lists both rails; the pairing rule matches the
//! devices' real GIDs by subnet; a data path over two rails
//! (`DataPath::start_rails`, a QP per rail, each side's memory registered
//! in every rail's protection domain) moves a copy with both rails carrying
//! blocks; one rail cut for 5 s mid-copy is absorbed by the other and
//! rejoins.
//!
//! `#[ignore]`d in a plain `cargo test` (no device, and one flips a link).
//! The VM suite runs them in the rails topology (target name ends in
//! `rails_fabric`). Elsewhere: `RCP_RAILS_A` / `RCP_RAILS_B` (each side's
//! rails, `NAME[:PORT],...`), `RCP_RAILS_CUT` (`NETNS:NETDEV` of the rail
//! to cut, the netdev of A's second rail).

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::pattern::pattern;
use common::verbs_rig::{bytes, fill, whole};
use rcp::control::rails::{pair, PairedBy, RailAddr};
use rcp::datapath::{
    DataPath, DataPathConfig, DpEvent, FenceFn, PollMode, PortMonitor, RailReconnectFn, RailSpec,
    ReconnectError,
};
use rcp::engine::{Extent, OpKind, WindowJob};
use rcp::mem::{Arena, ArenaConfig};
use rcp::parse::RailName;
use rcp::provider::verbs::VerbsChannel;
use rcp::provider::Channel;
use rcp::verbs::{
    Access, ConnectParams, Context, Gid, MemoryRegion, PortWatcher, ProtectionDomain, QpBuilder,
};
use tokio::sync::mpsc::UnboundedReceiver;

const SQ: u32 = 128;

fn names(var: &str, default: &str) -> Vec<RailName> {
    let v = std::env::var(var).unwrap_or_else(|_| default.to_string());
    rcp::parse::rails(&v).unwrap_or_else(|e| panic!("{var}: {e}"))
}

fn side_a() -> Vec<RailName> {
    names("RCP_RAILS_A", "rxea0,rxea1")
}

fn side_b() -> Vec<RailName> {
    names("RCP_RAILS_B", "rxeb0,rxeb1")
}

/// One end of one rail: its QP as a channel, the side's arena registered
/// in the rail's PD. Fields drop in order: the QP before the registration
/// (the arena outlives every rail: see [`Rails`]).
struct RailEnd {
    ch: Arc<VerbsChannel>,
    mr: MemoryRegion,
    ctx: Arc<Context>,
    port: u8,
    gid: Gid,
}

fn rail_end(name: &RailName, arena: &Arena) -> RailEnd {
    let ctx = Context::open(Some(name.device.as_str())).expect("open the rail's device");
    let (port, choice) = ctx
        .select_port(None)
        .expect("an ACTIVE port with a usable GID");
    if let Some(p) = name.port {
        assert_eq!(p, port.port, "{name}: the test takes the first ACTIVE port");
    }
    eprintln!(
        "rail {name} port {} GID {}: {}",
        port.port, choice.entry.gid, choice.reason
    );
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let remote = Access::REMOTE_WRITE | Access::REMOTE_READ;
    let qp = QpBuilder::new(&pd, port.port, choice.entry.index)
        .sq_depth(SQ)
        .max_inline(64)
        .remote_access(remote)
        .events(true)
        .build()
        .unwrap();
    // SAFETY: the tests touch an arena's bytes only while no request names
    // them; the only peer is the other side of the same test.
    let mr = unsafe { pd.register_arena(arena, Access::LOCAL_WRITE | remote) }.unwrap();
    RailEnd {
        ch: Arc::new(qp.into_channel()),
        mr,
        ctx,
        port: port.port,
        gid: choice.entry.gid,
    }
}

fn addrs(ends: &[RailEnd]) -> Vec<RailAddr> {
    ends.iter()
        .map(|e| RailAddr {
            gid: e.gid,
            // The test bed's subnets are /24.
            prefix_len: 24,
        })
        .collect()
}

/// Both sides' rails, paired by the rule and connected: `a[k]` talks to
/// `b[peer[k]]`. The rails drop before the arenas.
struct Rails {
    a: Vec<RailEnd>,
    b: Vec<RailEnd>,
    peer: Vec<usize>,
    a_arena: Arena,
    b_arena: Arena,
}

fn connect(len: usize) -> Rails {
    assert!(
        !rcp::verbs::device_names().is_empty(),
        "no RDMA device found: the fabric tests must run where one exists"
    );
    let arena = || {
        let a = Arena::new(&ArenaConfig::new(len)).unwrap();
        assert!(a.len() >= len);
        a
    };
    let (a_arena, b_arena) = (arena(), arena());
    let a: Vec<RailEnd> = side_a().iter().map(|n| rail_end(n, &a_arena)).collect();
    // B's rails the other way round: the rule pairs by subnet, not order.
    let b: Vec<RailEnd> = side_b()
        .iter()
        .rev()
        .map(|n| rail_end(n, &b_arena))
        .collect();
    let pairs = pair(&addrs(&a), &addrs(&b)).expect("the rails pair");
    assert_eq!(pairs.len(), a.len().min(b.len()));
    let mut peer = Vec::new();
    for p in &pairs {
        eprintln!(
            "pair: a rail {} ({}) <-> b rail {} ({}): {}",
            p.local, a[p.local].gid, p.remote, b[p.remote].gid, p.by
        );
        assert_eq!(
            p.by,
            PairedBy::SameSubnet,
            "the test bed's rails share a subnet pairwise"
        );
        assert_eq!(p.local, peer.len());
        let (x, y) = (&a[p.local].ch, &b[p.remote].ch);
        let (ex, ey) = (x.endpoint(), y.endpoint());
        x.handshake(&ey, &ConnectParams::default()).unwrap();
        y.handshake(&ex, &ConnectParams::default()).unwrap();
        peer.push(p.remote);
    }
    Rails {
        a,
        b,
        peer,
        a_arena,
        b_arena,
    }
}

impl Rails {
    /// A's data path over every rail: rail `k`'s reconnect resets and
    /// reconnects `a[k]` and its peer, its fence takes `a[k]` to the error
    /// state, its monitor watches `a[k]`'s port, and its keys are the
    /// registrations in its own PDs.
    fn data_path(&self, cfg: DataPathConfig) -> (DataPath, UnboundedReceiver<DpEvent>) {
        let mut specs = Vec::new();
        for (k, e) in self.a.iter().enumerate() {
            let (x, y) = (e.ch.clone(), self.b[self.peer[k]].ch.clone());
            let reconnect: RailReconnectFn = Box::new(move |_rail: usize| {
                let step = ReconnectError::retryable;
                let ex = x.reset().map_err(step)?;
                let ey = y.reset().map_err(step)?;
                x.handshake(&ey, &ConnectParams::default()).map_err(step)?;
                y.handshake(&ex, &ConnectParams::default()).map_err(step)?;
                Ok(())
            });
            let f = e.ch.clone();
            let fence: FenceFn = Box::new(move |_rail: usize| {
                f.set_error()?;
                Ok(())
            });
            let ch: Arc<dyn Channel> = e.ch.clone();
            let monitor: Arc<dyn PortMonitor> =
                Arc::new(PortWatcher::spawn(&e.ctx, e.port).expect("watch the rail's port"));
            let mut spec = RailSpec::new(ch, reconnect)
                .with_fence(fence)
                .with_monitor(monitor);
            if k > 0 {
                let keys = (e.mr.lkey(), self.b[self.peer[k]].mr.rkey());
                spec = spec.with_keys(Box::new(move |_: u32, _: u32| keys));
            }
            specs.push(spec);
        }
        let dp = DataPath::start_rails(cfg, specs).unwrap();
        let ev = dp.take_events().unwrap();
        (dp, ev)
    }

    /// Window `id`: `n` extents of `ext` bytes at `at` of both arenas, in
    /// rail 0's keys.
    fn window(&self, id: u64, at: u64, n: u64, ext: u32) -> WindowJob {
        WindowJob {
            id,
            op: OpKind::Write,
            local_addr: self.a_arena.addr() + at,
            lkey: self.a[0].mr.lkey(),
            remote_addr: self.b_arena.addr() + at,
            rkey: self.b[self.peer[0]].mr.rkey(),
            extents: (0..n)
                .map(|k| Extent {
                    offset: k * u64::from(ext),
                    len: ext,
                })
                .collect(),
        }
    }
}

fn cfg() -> DataPathConfig {
    DataPathConfig {
        poll_mode: PollMode::Hybrid { empty_polls: 256 },
        ..DataPathConfig::default()
    }
}

/// WRITE `len` bytes from A to B in 1 MiB windows of `ext`-byte extents,
/// all submitted at once; every event with the time it came, until every
/// window is done.
fn copy(
    r: &Rails,
    dp: &DataPath,
    ev: &mut UnboundedReceiver<DpEvent>,
    len: usize,
    ext: u32,
) -> Vec<(Instant, DpEvent)> {
    const W: u64 = 1 << 20;
    let windows = len as u64 / W;
    for id in 0..windows {
        let w = r.window(id, id * W, W / u64::from(ext), ext);
        // SAFETY: A's arena is registered in every rail's PD (`mr` of
        // each RailEnd) and lent to the device from here until the
        // window's WindowDone: the test writes it only before the data
        // path starts and reads B's only after it is closed. If the data
        // path fails the test panics, and the arenas drop after the QPs.
        unsafe { dp.submit(w) }.unwrap();
    }
    let mut done = 0;
    let mut other = Vec::new();
    while done < windows {
        match ev.blocking_recv().expect("data path ended") {
            DpEvent::WindowDone { .. } => done += 1,
            DpEvent::Failed(e) => panic!("data path failed: {e}"),
            e => {
                eprintln!("event: {e:?}");
                other.push((Instant::now(), e));
            }
        }
    }
    other
}

/// [`copy`] with a cut: windows are submitted `backlog` at a time (both
/// rails stay full), and `cut` starts on a thread of its own once
/// `cut_after` windows are done, before the rest are even submitted: the
/// cut lands mid-copy however fast the machine. This thread keeps
/// submitting while `cut` runs (`ip link` takes a while under emulation):
/// were it to wait, the data path would drain its backlog and the cut rail
/// could be idle when its link goes down. Returns the other events and
/// what `cut` returned.
fn copy_with_cut<T>(
    r: &Rails,
    dp: &DataPath,
    ev: &mut UnboundedReceiver<DpEvent>,
    len: usize,
    ext: u32,
    (backlog, cut_after): (u64, u64),
    cut: impl FnOnce() -> T + Send + 'static,
) -> (Vec<(Instant, DpEvent)>, T)
where
    T: Send + 'static,
{
    const W: u64 = 1 << 20;
    let windows = len as u64 / W;
    assert!(
        cut_after + backlog < windows,
        "the cut must leave work queued"
    );
    let submit = |id: u64| {
        let w = r.window(id, id * W, W / u64::from(ext), ext);
        // SAFETY: as in `copy`: A's arena is registered in every rail's
        // PD and lent to the device until the window's WindowDone; the
        // test writes it only before the data path starts and reads B's
        // only after it is closed.
        unsafe { dp.submit(w) }.unwrap();
    };
    let mut next = 0;
    while next < backlog {
        submit(next);
        next += 1;
    }
    let (mut done, mut other, mut cut, mut got) = (0, Vec::new(), Some(cut), None);
    while done < windows {
        match ev.blocking_recv().expect("data path ended") {
            DpEvent::WindowDone { .. } => {
                done += 1;
                if done == cut_after {
                    got = cut.take().map(std::thread::spawn);
                }
                if next < windows {
                    submit(next);
                    next += 1;
                }
            }
            DpEvent::Failed(e) => panic!("data path failed: {e}"),
            e => {
                eprintln!("event: {e:?}");
                other.push((Instant::now(), e));
            }
        }
    }
    let got = got.expect("the cut started").join().expect("the cut");
    (other, got)
}

fn prepare(len: usize) -> (Rails, Vec<u8>) {
    let r = connect(len);
    let data = pattern(len, 0x7a11);
    // SAFETY: no data path runs yet: no request names A's arena.
    unsafe { fill(&whole(&r.a_arena), 0x7a11) };
    (r, data)
}

fn verify(r: &Rails, data: &[u8]) {
    let got = bytes(&whole(&r.b_arena));
    assert!(&got[..data.len()] == data, "B's bytes differ from A's");
}

#[test]
#[ignore = "needs the rails topology: scripts/testbed.sh run rails"]
fn doctor_lists_every_rail() {
    let d = rcp::doctor::diagnose(&rcp::doctor::DoctorOptions {
        arena_bytes: 64 << 20,
        ..Default::default()
    });
    for c in &d.checks {
        eprintln!("{c}");
    }
    for n in side_a().iter().chain(&side_b()) {
        let c = d
            .checks
            .iter()
            .find(|c| c.name == "rail" && c.detail.starts_with(&format!("{}:", n.device)))
            .unwrap_or_else(|| panic!("no rail line for {n}"));
        assert_eq!(c.level, rcp::doctor::Level::Ok, "{c}");
        assert!(c.detail.contains("GID ::ffff:192.168."), "{c}");
    }
    let c = d
        .checks
        .iter()
        .find(|c| c.name == "rails")
        .expect("rails line");
    assert_eq!(c.level, rcp::doctor::Level::Ok, "{c}");
}

#[test]
#[ignore = "needs the rails topology: scripts/testbed.sh run rails"]
fn two_rails_carry_one_copy() {
    let len = 16 << 20;
    let (r, data) = prepare(len);
    let (dp, mut ev) = r.data_path(cfg());
    let t0 = Instant::now();
    let other = copy(&r, &dp, &mut ev, len, 64 << 10);
    let secs = t0.elapsed().as_secs_f64();
    let rep = dp.close();
    for (k, x) in rep.rails.iter().enumerate() {
        eprintln!(
            "rail {k}: {} blocks, {} bytes, {} posted",
            x.counters.extents_confirmed, x.counters.bytes_confirmed, x.counters.posted
        );
    }
    eprintln!("{len} bytes over two rails in {secs:.2} s");
    assert!(other.is_empty(), "{other:?}");
    assert_eq!(rep.counters.bytes_confirmed, len as u64);
    assert_eq!(rep.rails.len(), 2);
    assert!(
        rep.rails.iter().all(|x| x.counters.extents_confirmed > 0),
        "both rails carried blocks: {:?}",
        rep.rails
            .iter()
            .map(|x| x.counters.extents_confirmed)
            .collect::<Vec<_>>()
    );
    assert_eq!(
        rep.rails
            .iter()
            .map(|x| x.counters.bytes_confirmed)
            .sum::<u64>(),
        len as u64
    );
    assert!(
        rep.counters.errors.total() == 0,
        "{:?}",
        rep.counters.errors
    );
    verify(&r, &data);
}

/// `ip -batch -` in the namespace of `spec` (`NS:DEV`), started before the
/// copy: a link set down or up at a point of the copy's progress is then a
/// line on its stdin, not an exec of `ip` (about a second under TCG, in
/// which a 64 MiB copy can end before the cut lands).
struct IpBatch {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    out: std::io::BufReader<std::process::ChildStdout>,
    dev: String,
}

impl IpBatch {
    fn new(spec: &str) -> IpBatch {
        use std::process::Stdio;
        let (ns, dev) = spec.split_once(':').unwrap_or(("", spec));
        let mut c = Command::new("ip");
        if !ns.is_empty() {
            c.args(["-n", ns]);
        }
        let mut child = c
            .args(["-batch", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("run ip -batch");
        let stdin = child.stdin.take().unwrap();
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        IpBatch {
            child,
            stdin,
            out,
            dev: dev.to_string(),
        }
    }

    /// Set the link `state` (`down`, `up`) and wait until `ip` has (its
    /// next command, a `link show` of the device, answered).
    fn link(&mut self, state: &str) {
        use std::io::{BufRead, Write};
        let dev = &self.dev;
        writeln!(self.stdin, "link set {dev} {state}\nlink show dev {dev}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.out.read_line(&mut line).expect("ip's output");
            assert!(n > 0, "ip -batch ended before `link show dev {dev}`");
            if line.contains(&format!(" {dev}")) && line.contains('<') {
                return;
            }
        }
    }
}

impl Drop for IpBatch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
#[ignore = "needs the rails topology: scripts/testbed.sh run rails"]
fn a_rail_cut_for_5s_is_absorbed_and_rejoins() {
    let cut = std::env::var("RCP_RAILS_CUT").unwrap_or_else(|_| "a:va1".into());
    // No rate limit: both rails stay full (16 windows queued), so the cut
    // rail has extents outstanding at the cut and the failover (its extents
    // posted on rail 0) is exercised. The cut starts after 16 of 64 windows
    // are done, with 48 windows to go, and the copy keeps its backlog while
    // it runs; the asserts below say it landed with work outstanding.
    let len = 64 << 20;
    let (r, data) = prepare(len);
    let mut ip = IpBatch::new(&cut);
    let (dp, mut ev) = r.data_path(cfg());
    let stats = dp.stats().clone();
    let t0 = Instant::now();
    let (mut other, (down_at, cutter)) =
        copy_with_cut(&r, &dp, &mut ev, len, 16 << 10, (16, 16), {
            let (cut, stats) = (cut.clone(), stats.clone());
            move || {
                ip.link("down");
                let down = Instant::now();
                eprintln!(
                    "{cut} down at {:.2} s, {} of {} blocks done",
                    down.duration_since(t0).as_secs_f64(),
                    stats.counters().extents_confirmed,
                    len / (16 << 10)
                );
                let up = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_secs(5));
                    ip.link("up");
                    eprintln!("{cut} up at {:.2} s", t0.elapsed().as_secs_f64());
                });
                (down, up)
            }
        });
    let copied = t0.elapsed();
    cutter.join().expect("the cutter");
    // The copy may end before the rail is back: wait for it to rejoin.
    let until = Instant::now() + Duration::from_secs(120);
    while !other
        .iter()
        .any(|(_, e)| matches!(e, DpEvent::RailUp { rail: 1 }))
        && Instant::now() < until
    {
        match ev.try_recv() {
            Ok(e) => {
                eprintln!("event: {e:?}");
                other.push((Instant::now(), e));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
    let rep = dp.close();
    let at = |f: &dyn Fn(&DpEvent) -> bool| {
        other
            .iter()
            .find(|(_, e)| f(e))
            .map(|(t, _)| t.duration_since(t0).as_secs_f64())
    };
    let down = at(&|e| matches!(e, DpEvent::RailDown { rail: 1, .. }));
    let fenced = at(&|e| matches!(e, DpEvent::RailFenced { rail: 1, .. }));
    let up = at(&|e| matches!(e, DpEvent::RailUp { rail: 1 }));
    let x = &rep.rails[1];
    eprintln!(
        "rails figure: cut at {:.2} s, rail 1 down at {down:?} s, fenced at {fenced:?} s, \
         up at {up:?} s; copy {:.2} s; rail 1 requeued {} extents, failover (error -> its \
         extents posted elsewhere) {:?} s, reconnect {:?} s; blocks rail 0 {} rail 1 {}",
        down_at.duration_since(t0).as_secs_f64(),
        copied.as_secs_f64(),
        x.counters.requeued,
        x.failover_seconds,
        x.reconnect_seconds,
        rep.rails[0].counters.extents_confirmed,
        x.counters.extents_confirmed,
    );
    assert!(down.is_some(), "rail 1 never failed: {other:?}");
    assert!(x.counters.failures >= 1 && x.counters.fences >= 1, "{x:?}");
    assert!(up.is_some(), "rail 1 did not rejoin: {other:?}");
    assert!(
        x.counters.requeued > 0,
        "rail 1 had nothing outstanding at the cut: the failover was not exercised"
    );
    assert!(
        !x.failover_seconds.is_empty(),
        "rail 1's extents were posted on rail 0: {x:?}"
    );
    assert_eq!(rep.counters.bytes_confirmed, len as u64);
    verify(&r, &data);
}
