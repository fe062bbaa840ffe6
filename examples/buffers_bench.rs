//! Buffer operations between two rcpds, timed (docs/benchmarks.md,
//! "Buffers from services"). One process is both services: an owner on
//! rcpd B's socket (a buffer exposed `rw` as `bench`) and an initiator on
//! rcpd A's socket, which writes into and reads from B's buffer through A.
//! A unix socket is a path, so the two rcpds may live in different network
//! namespaces.
//!
//! ```text
//! buffers_bench throughput --socket A.sock --owner-socket B.sock --peer B_HOST:PORT
//!     [--mib 64] [--range-mib 1] [--passes 5] [--ops write,read] [--verify CHECK]
//!     [--cpu-pids PID,PID] [--clk-tck 100]
//! buffers_bench latency --socket A.sock --owner-socket B.sock --peer B_HOST:PORT
//!     [--size 4096] [--iters 1000] [--warmup 20] [--passes 1] [--verify CHECK]
//! ```
//!
//! relay (`buffers_bench relay [--size 4096] [--iters 1000] [--warmup 20]
//! [--passes 1]`, no rcpd): the reference for latency, the same bytes over
//! the same channels without rcp: this process (the service) writes a frame
//! of `--size` bytes to a relay process on a unix socket, which forwards it
//! over TCP on loopback to a second relay process, which forwards it on a
//! unix socket back to this process (the owner); timed from the write until
//! the owner has read the whole frame. Two children of this binary
//! (`relay-hop`) are the relays: blocking reads and writes, no framing but
//! a 4-byte length.
//!
//! `--grant standing` (throughput, latency): the owner exposes its buffer with
//! standing grants (docs/buffers.md), instead of a grant per operation.
//!
//! throughput: buffers of `--mib` MiB on both sides; each pass writes all of
//! the initiator's buffer into the owner's as one operation of `--range-mib`
//! MiB descriptors, and reads it back the same way (`--ops`). A pass is
//! timed from the `write`/`read` request to its `wait` answering; the
//! destination is cleared before and compared with the source after (both
//! untimed), and the owner's event must name every range. With
//! `--cpu-pids` (the two rcpds), CPU seconds (user + system) of those
//! processes and of this one over the timed part are reported per GiB.
//! One small write and read first, untimed, open the session and register
//! the buffers.
//!
//! latency: `--iters` writes of `--size` bytes, one at a time, each timed
//! from its request until the owner's `written` event (the notification)
//! has arrived here; its `wait` follows. Median, p99, min, max; and the
//! medians of the time to the write's handle and to the wait's answer.
//!
//! hash (`buffers_bench hash [--mib 64] [--verify blake3]`, no rcpd): how
//! fast this process hashes 1 MiB blocks with the check, on one thread (as
//! rcpd hashes an operation's ranges) and on the pool.
//!
//! `--verify`: the operation's check (`none`, `xxh3`, `sha256`, `blake3`);
//! rcpd's default (blake3 unless `--verify` restricts it) when not given.
//! Output: one `bufbench ...` line of `key=value` per pass and a summary.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant;

use rcp::control::buffers::client::{Buffer, OpOptions, ServiceClient};

type R<T> = Result<T, Box<dyn std::error::Error>>;

const MIB: u64 = 1 << 20;
const EXPOSED: &str = "bench";

struct Args(Vec<String>);

impl Args {
    fn get(&self, name: &str) -> Option<&str> {
        let i = self.0.iter().position(|a| a == name)?;
        self.0.get(i + 1).map(String::as_str)
    }

    fn num<T: FromStr>(&self, name: &str, default: T) -> R<T> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| format!("{name} {v:?}: not a number").into()),
        }
    }

    fn need(&self, name: &str) -> R<&str> {
        self.get(name)
            .ok_or_else(|| format!("{name} is required").into())
    }
}

/// The pattern of seed `seed` at byte `off` (a multiple of 8) into `out`
/// (a multiple of 8 long): splitmix64 of the word's index.
fn pattern(seed: u64, off: u64, out: &mut [u8]) {
    for (i, c) in out.chunks_exact_mut(8).enumerate() {
        let mut z = (seed << 40) ^ (off / 8 + i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        c.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
}

/// `buf` filled with the pattern of `seed`, or zeros when `None`.
fn fill(buf: &Buffer, seed: Option<u64>) -> R<()> {
    let mut chunk = vec![0u8; MIB as usize];
    let mut off = 0;
    while off < buf.local.len() {
        let n = (buf.local.len() - off).min(MIB) as usize;
        if let Some(s) = seed {
            pattern(s, off, &mut chunk[..n]);
        }
        if !buf.local.write_at(off, &chunk[..n]) {
            return Err("fill: outside the buffer".into());
        }
        off += n as u64;
    }
    Ok(())
}

/// Whether the first `len` bytes of `buf` hold the pattern of `seed`: the
/// first offset that differs, as an error.
fn compare(buf: &Buffer, seed: u64, len: u64) -> R<()> {
    let (mut want, mut got) = (vec![0u8; MIB as usize], vec![0u8; MIB as usize]);
    let mut off = 0;
    while off < len {
        let n = (len - off).min(MIB) as usize;
        pattern(seed, off, &mut want[..n]);
        if !buf.local.read_at(off, &mut got[..n]) {
            return Err("compare: outside the buffer".into());
        }
        if let Some(i) = (0..n).find(|&i| want[i] != got[i]) {
            return Err(
                format!("the bytes at {} differ from what was sent", off + i as u64).into(),
            );
        }
        off += n as u64;
    }
    Ok(())
}

/// CPU seconds (user + system) so far of `pids` and of this process.
struct Cpu {
    pids: Vec<u32>,
    tck: f64,
}

impl Cpu {
    fn of_pid(&self, pid: u32) -> R<f64> {
        let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        // After the command's closing parenthesis: state is field 3, utime 14, stime 15.
        let rest = &s[s.rfind(')').ok_or("/proc stat without a command")? + 2..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = f[11].parse::<u64>()? + f[12].parse::<u64>()?;
        Ok(ticks as f64 / self.tck)
    }

    /// (the pids' seconds, this process's seconds).
    fn now(&self) -> R<(f64, f64)> {
        let mut daemons = 0.0;
        for &p in &self.pids {
            daemons += self.of_pid(p)?;
        }
        let u = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)?;
        let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
        Ok((daemons, secs(u.user_time()) + secs(u.system_time())))
    }
}

struct Bench {
    init: ServiceClient,
    owner: ServiceClient,
    src: Buffer,
    dst: Buffer,
    peer: String,
    check: Option<String>,
}

impl Bench {
    async fn open(a: &Args, size: u64) -> R<Bench> {
        let sock = PathBuf::from(a.need("--socket")?);
        let owner_sock = PathBuf::from(a.need("--owner-socket")?);
        let owner = ServiceClient::connect(Some(&owner_sock), None).await?;
        let dst = owner.create_buffer(size).await?;
        match a.get("--grant") {
            None | Some("per-op") => owner.expose(&dst, EXPOSED, 0, size, "rw", &[]).await?,
            Some("standing") => {
                owner
                    .expose_standing(&dst, EXPOSED, 0, size, "rw", &[])
                    .await?
            }
            Some(g) => return Err(format!("--grant {g}: per-op or standing").into()),
        }
        let init = ServiceClient::connect(Some(&sock), None).await?;
        let src = init.create_buffer(size).await?;
        Ok(Bench {
            init,
            owner,
            src,
            dst,
            peer: a.need("--peer")?.to_string(),
            check: a.get("--verify").map(str::to_string),
        })
    }

    /// One operation, started and waited for: its seconds, from the request
    /// to the wait's answer.
    async fn run(&self, op: &str, descs: &[(u64, u64, u64)], message: Option<&str>) -> R<f64> {
        let opts = OpOptions {
            message,
            check: self.check.as_deref(),
        };
        let t0 = Instant::now();
        let (buf, peer) = (&self.src, self.peer.as_str());
        let h = if op == "write" {
            self.init
                .write_with(buf, peer, EXPOSED, descs, opts)
                .await?
        } else {
            self.init.read_with(buf, peer, EXPOSED, descs, opts).await?
        };
        let bytes = self.init.wait(h).await?;
        let secs = t0.elapsed().as_secs_f64();
        let want: u64 = descs.iter().map(|d| d.2).sum();
        if bytes != want {
            return Err(format!("{op}: {bytes} bytes moved, not {want}").into());
        }
        Ok(secs)
    }

    /// The owner's next event: `written` / `read` naming `ranges` ranges
    /// with no error.
    async fn owner_event(&self, kind: &str, ranges: usize) -> R<serde_json::Value> {
        let ev = self
            .owner
            .next_event()
            .await
            .ok_or("the owner's connection closed")?;
        let n = ev["ranges"].as_array().map_or(0, Vec::len);
        if ev["event"] != kind || n != ranges || ev.get("error").is_some() {
            return Err(format!("the owner's event is not {kind} of {ranges} ranges: {ev}").into());
        }
        Ok(ev)
    }
}

fn descs(total: u64, range: u64) -> Vec<(u64, u64, u64)> {
    (0..total)
        .step_by(range as usize)
        .map(|o| (o, o, range.min(total - o)))
        .collect()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The q-quantile of sorted `v` (nearest rank).
fn quantile(v: &[f64], q: f64) -> f64 {
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[i - 1]
}

async fn throughput(a: &Args) -> R<()> {
    let size = a.num("--mib", 64u64)? * MIB;
    let range = a.num("--range-mib", 1u64)? * MIB;
    let passes: u32 = a.num("--passes", 5)?;
    let ops: Vec<String> = a
        .get("--ops")
        .unwrap_or("write,read")
        .split(',')
        .map(str::to_string)
        .collect();
    if let Some(o) = ops.iter().find(|o| *o != "write" && *o != "read") {
        return Err(format!("--ops: {o:?} is not write or read").into());
    }
    let pids = match a.get("--cpu-pids") {
        Some(s) => s
            .split(',')
            .map(str::parse)
            .collect::<Result<Vec<u32>, _>>()?,
        None => Vec::new(),
    };
    let cpu = Cpu {
        pids,
        tck: a.num("--clk-tck", 100.0)?,
    };
    let b = Bench::open(a, size).await?;
    let check = b.check.clone().unwrap_or_else(|| "default".into());
    // Untimed: the session to the peer and the buffers' registrations.
    for op in &ops {
        b.run(op, &[(0, 0, 4096)], None).await?;
        b.owner_event(if op == "write" { "written" } else { "read" }, 1)
            .await?;
    }
    let d = descs(size, range);
    let mut mbs: Vec<(String, Vec<f64>)> = ops.iter().map(|o| (o.clone(), Vec::new())).collect();
    for p in 1..=passes {
        for (op, v) in mbs.iter_mut() {
            let op = op.as_str();
            let seed = u64::from(p) * 2 + u64::from(op == "read");
            let (from, to) = if op == "write" {
                (&b.src, &b.dst)
            } else {
                (&b.dst, &b.src)
            };
            fill(from, Some(seed))?;
            fill(to, None)?;
            let (d0, s0) = cpu.now()?;
            let secs = b.run(op, &d, None).await?;
            let (d1, s1) = cpu.now()?;
            b.owner_event(if op == "write" { "written" } else { "read" }, d.len())
                .await?;
            compare(to, seed, size)?;
            let rate = size as f64 / secs / 1e6;
            v.push(rate);
            let gib = size as f64 / (1u64 << 30) as f64;
            let mut line = format!(
                "bufbench mode=throughput op={op} check={check} mib={} range_mib={} pass={p} secs={secs:.3} mb_per_s={rate:.1}",
                size / MIB,
                range / MIB
            );
            if !cpu.pids.is_empty() {
                line += &format!(
                    " cpu_rcpds_s={:.3} cpu_services_s={:.3} cpu_s_per_gib={:.3}",
                    d1 - d0,
                    s1 - s0,
                    (d1 - d0 + s1 - s0) / gib
                );
            }
            println!("{line}");
        }
    }
    for (op, v) in &mut mbs {
        let m = median(v);
        println!(
            "bufbench summary mode=throughput op={op} check={check} mib={} range_mib={} passes={passes} median_mb_per_s={m:.1} min={:.1} max={:.1}",
            size / MIB,
            range / MIB,
            v[0],
            v[v.len() - 1]
        );
    }
    Ok(())
}

async fn latency(a: &Args) -> R<()> {
    let size: u64 = a.num("--size", 4096)?;
    let iters: usize = a.num("--iters", 1000)?;
    let warmup: usize = a.num("--warmup", 20)?;
    let passes: u32 = a.num("--passes", 1)?;
    let b = Bench::open(a, size.next_multiple_of(MIB)).await?;
    let check = b.check.clone().unwrap_or_else(|| "default".into());
    let grant = a.get("--grant").unwrap_or("per-op");
    fill(&b.src, Some(1))?;
    let d = [(0, 0, size)];
    let opts = OpOptions {
        message: Some("bench"),
        check: b.check.as_deref(),
    };
    for p in 1..=passes {
        // Per write: the event's arrival, the handle's, the wait's answer.
        let (mut us, mut handle, mut done) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..warmup + iters {
            let t0 = Instant::now();
            let h = b
                .init
                .write_with(&b.src, &b.peer, EXPOSED, &d, opts)
                .await?;
            let th = t0.elapsed().as_secs_f64() * 1e6;
            // An operation that failed sends the owner nothing: after a
            // while, its own end says why.
            let ev = match tokio::time::timeout(
                std::time::Duration::from_secs(30),
                b.owner_event("written", 1),
            )
            .await
            {
                Ok(ev) => ev?,
                Err(_) => {
                    let end = b.init.wait(h).await;
                    return Err(
                        format!("write {i}: no owner's event in 30 s; the write: {end:?}").into(),
                    );
                }
            };
            let t = t0.elapsed().as_secs_f64() * 1e6;
            if ev["message"] != "bench" {
                return Err(format!("the owner's event lost the message: {ev}").into());
            }
            b.init.wait(h).await?;
            if i >= warmup {
                us.push(t);
                handle.push(th);
                done.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
        us.sort_by(f64::total_cmp);
        let mut m = us.clone();
        println!(
            "bufbench mode=latency op=write+notify grant={grant} check={check} size={size} iters={iters} pass={p} p50_us={:.1} p99_us={:.1} min_us={:.1} max_us={:.1} handle_p50_us={:.1} waited_p50_us={:.1}",
            median(&mut m),
            quantile(&us, 0.99),
            us[0],
            us[us.len() - 1],
            median(&mut handle),
            median(&mut done)
        );
    }
    compare(&b.dst, 1, size)?;
    Ok(())
}

/// How fast this process hashes `--mib` MiB in 1 MiB blocks with
/// `--verify`'s check: one block after another on one thread (what rcpd
/// does for a buffer operation's ranges), and on the process-wide pool
/// (what copies do).
fn hash(a: &Args) -> R<()> {
    use rcp::files::Check;
    let size = a.num("--mib", 64u64)? * MIB;
    let name = a.get("--verify").unwrap_or("blake3");
    let check =
        Check::from_name(name).ok_or_else(|| format!("--verify {name:?}: no such check"))?;
    let mut data = vec![0u8; size as usize];
    pattern(1, 0, &mut data);
    let blocks: Vec<&[u8]> = data.chunks(MIB as usize).collect();
    let t = Instant::now();
    let one: Vec<_> = blocks.iter().map(|b| check.block(b)).collect();
    let serial = size as f64 / t.elapsed().as_secs_f64() / 1e6;
    let t = Instant::now();
    let pool = check.blocks(&blocks);
    let parallel = size as f64 / t.elapsed().as_secs_f64() / 1e6;
    if one != pool {
        return Err("the pool's digests differ from one thread's".into());
    }
    println!(
        "bufbench mode=hash check={name} mib={} one_thread_mb_per_s={serial:.1} pool_mb_per_s={parallel:.1}",
        size / MIB
    );
    Ok(())
}

/// Copy length-prefixed frames from `from` to `to` until `from` ends.
fn forward(mut from: impl std::io::Read, mut to: impl std::io::Write) -> R<()> {
    let mut buf = Vec::new();
    loop {
        let mut len = [0u8; 4];
        if from.read_exact(&mut len).is_err() {
            return Ok(());
        }
        buf.resize(u32::from_le_bytes(len) as usize, 0);
        from.read_exact(&mut buf)?;
        to.write_all(&len)?;
        to.write_all(&buf)?;
    }
}

/// One relay of `relay`: `--unix-in PATH --tcp-out ADDR` (the first) or
/// `--tcp-in ADDR --unix-out PATH` (the second); one connection each way.
/// Says `listening` on its output once it listens.
fn relay_hop(a: &Args) -> R<()> {
    use std::os::unix::net::{UnixListener, UnixStream};
    let listening = || println!("listening");
    if let Some(path) = a.get("--unix-in") {
        let l = UnixListener::bind(path)?;
        listening();
        let (c, _) = l.accept()?;
        let out = std::net::TcpStream::connect(a.need("--tcp-out")?)?;
        out.set_nodelay(true)?;
        return forward(c, out);
    }
    let l = std::net::TcpListener::bind(a.need("--tcp-in")?)?;
    listening();
    let (c, _) = l.accept()?;
    c.set_nodelay(true)?;
    forward(c, UnixStream::connect(a.need("--unix-out")?)?)
}

/// A `relay-hop` child with `args`, once it listens.
fn hop(args: &[&std::ffi::OsStr]) -> R<std::process::Child> {
    use std::io::BufRead;
    let mut c = std::process::Command::new(std::env::current_exe()?)
        .arg("relay-hop")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(c.stdout.as_mut().expect("piped")).read_line(&mut line)?;
    if line.trim() != "listening" {
        return Err(format!("relay-hop {args:?} did not start").into());
    }
    Ok(c)
}

/// The relay reference of `latency` (the module docs).
fn relay(a: &Args) -> R<()> {
    use std::io::{Read, Write};
    use std::os::unix::net::{UnixListener, UnixStream};
    let size: usize = a.num("--size", 4096)?;
    let iters: usize = a.num("--iters", 1000)?;
    let warmup: usize = a.num("--warmup", 20)?;
    let passes: u32 = a.num("--passes", 1)?;
    let dir = std::env::temp_dir().join(format!("rcp-relay.{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (a_sock, owner_sock) = (dir.join("a.sock"), dir.join("owner.sock"));
    let owner = UnixListener::bind(&owner_sock)?;
    // A free port for relay B (taken back from the kernel just before).
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .to_string();
    let mut hb = hop(&[
        "--tcp-in".as_ref(),
        port.as_ref(),
        "--unix-out".as_ref(),
        owner_sock.as_os_str(),
    ])?;
    let mut ha = hop(&[
        "--unix-in".as_ref(),
        a_sock.as_os_str(),
        "--tcp-out".as_ref(),
        port.as_ref(),
    ])?;
    let mut svc = UnixStream::connect(&a_sock)?;
    let (mut own, _) = owner.accept()?;
    let frame: Vec<u8> = (0..size).map(|i| i as u8).collect();
    let mut got = vec![0u8; size];
    for p in 1..=passes {
        let mut us = Vec::new();
        for i in 0..warmup + iters {
            let t0 = Instant::now();
            svc.write_all(&(size as u32).to_le_bytes())?;
            svc.write_all(&frame)?;
            let mut len = [0u8; 4];
            own.read_exact(&mut len)?;
            own.read_exact(&mut got)?;
            let t = t0.elapsed().as_secs_f64() * 1e6;
            if got != frame {
                return Err("the relays changed the bytes".into());
            }
            if i >= warmup {
                us.push(t);
            }
        }
        us.sort_by(f64::total_cmp);
        let mut m = us.clone();
        println!(
            "bufbench mode=relay size={size} iters={iters} pass={p} p50_us={:.1} p99_us={:.1} min_us={:.1} max_us={:.1}",
            median(&mut m),
            quantile(&us, 0.99),
            us[0],
            us[us.len() - 1]
        );
    }
    drop((svc, own));
    let _ = (ha.wait(), hb.wait());
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[tokio::main]
async fn main() -> R<()> {
    let a = Args(std::env::args().skip(1).collect());
    match a.0.first().map(String::as_str) {
        Some("throughput") => throughput(&a).await,
        Some("latency") => latency(&a).await,
        Some("hash") => hash(&a),
        Some("relay") => relay(&a),
        Some("relay-hop") => relay_hop(&a),
        _ => {
            eprintln!("usage: buffers_bench throughput|latency|hash --socket A.sock --owner-socket B.sock --peer HOST:PORT [...] (see the source's header)");
            std::process::exit(2);
        }
    }
}
