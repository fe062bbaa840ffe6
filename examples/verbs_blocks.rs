//! Move blocks between two hosts with one-sided RDMA WRITE and READ and
//! verify them: the smallest end-to-end use of the verbs layer.
//!
//! ```text
//! verbs_blocks serve  --listen 0.0.0.0:7470 [--device rxe0] [--mib 64]
//! verbs_blocks client --connect HOST:7470   [--device rxe0] [--mib 64] [--block 1048576] [--bad-rkey]
//! ```
//! The two sides exchange QP endpoints, the arena address and rkey over a TCP
//! socket (a stand-in for the gRPC control plane), then the client WRITEs
//! half the arena into the server in chained batches of 32 (only the last
//! WR of each chain signaled), READs the other half back, and both sides
//! compare SHA-256 digests. `--bad-rkey` sends one WRITE with a corrupted
//! rkey instead and expects a remote access error with the server's memory
//! unchanged.
//!
//! On soft-RoCE: `modprobe rdma_rxe; rdma link add rxe0 type rxe netdev lo`,
//! then run both ends (or `scripts/testbed.sh run lo -- ...`).

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use rcp::engine::{LocalSeg, OpKind, RemoteSeg, WcStatus, WorkCompletion, WorkRequest};
use rcp::mem::{Arena, ArenaConfig, PeerSpan};
use rcp::verbs::*;
use sha2::{Digest, Sha256};

type R<T> = Result<T, Box<dyn std::error::Error>>;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// One end: its QP (a [`PreparedQp`] until [`End::connect`], then a
/// [`QueuePair`] in RTS) and its registered arena. Fields drop in order:
/// the QP before the registration before the memory.
struct End<Q> {
    qp: Q,
    mr: MemoryRegion,
    arena: Arena,
}

impl End<PreparedQp> {
    fn connect(self, peer: &QpEndpoint) -> R<End<QueuePair>> {
        Ok(End {
            qp: self.qp.handshake(peer, &ConnectParams::default())?,
            mr: self.mr,
            arena: self.arena,
        })
    }
}

fn open(device: Option<String>, mib: usize) -> R<End<PreparedQp>> {
    let ctx = Context::open(device.as_deref())?;
    let (port, gid) = ctx.select_port(
        arg(&std::env::args().collect::<Vec<_>>(), "--gid-index")
            .map(|s| s.parse())
            .transpose()?,
    )?;
    eprintln!(
        "{}: port {} mtu {} GID {} ({})",
        ctx.name(),
        port.port,
        port.active_mtu,
        gid.entry.gid,
        gid.reason
    );
    let pd = ProtectionDomain::new(&ctx)?;
    let qp = QpBuilder::new(&pd, port.port, gid.entry.index)
        .sq_depth(256)
        .remote_access(Access::REMOTE_WRITE | Access::REMOTE_READ)
        .build()?;
    let mut cfg = ArenaConfig::new(mib << 20);
    cfg.numa_node = ctx.numa_node();
    let arena = Arena::new(&cfg)?;
    // SAFETY: the two ends take turns over the TCP socket: the bytes are
    // filled before "ready" and digested only after the client's requests
    // completed ("verify", "unchanged?"), never while a request names them.
    let mr = unsafe {
        pd.register_arena(
            &arena,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
    }?;
    Ok(End { qp, mr, arena })
}

fn pattern(span: &PeerSpan, seed: u64) {
    // SAFETY: filled before any request names the span (the transfer starts after).
    unsafe {
        span.with_mut(0, span.len(), |b| {
            let mut x = seed | 1;
            for c in b.chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
            }
        })
    };
}

fn sha(span: &PeerSpan) -> String {
    span.with(0, span.len(), |b| hex::encode(Sha256::digest(b)))
        .unwrap()
}

fn line(r: &mut impl BufRead) -> R<Vec<String>> {
    let mut s = String::new();
    if r.read_line(&mut s)? == 0 {
        return Err("peer closed the connection".into());
    }
    Ok(s.split_whitespace().map(str::to_string).collect())
}

fn ep_words(e: &QpEndpoint) -> String {
    format!(
        "{} {} {} {} {}",
        e.qpn,
        e.psn,
        hex::encode(e.gid.0),
        e.lid,
        e.mtu
    )
}

fn parse_ep(w: &[String]) -> R<QpEndpoint> {
    let g = hex::decode(&w[2])?;
    Ok(QpEndpoint {
        qpn: w[0].parse()?,
        psn: w[1].parse()?,
        gid: Gid(g.try_into().map_err(|_| "bad gid")?),
        lid: w[3].parse()?,
        mtu: w[4].parse()?,
    })
}

fn serve(args: &[String]) -> R<()> {
    let listen = arg(args, "--listen").unwrap_or_else(|| "0.0.0.0:7470".into());
    let mib: usize = arg(args, "--mib")
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(64);
    let end = open(arg(args, "--device"), mib)?;
    let half = end.arena.len() / 2;
    let upper_sha = {
        let upper = PeerSpan::new(&end.arena, end.arena.addr() + half as u64, half).unwrap();
        pattern(&upper, 0xfeed);
        sha(&upper)
    };
    let l = TcpListener::bind(&listen)?;
    eprintln!("serving on {listen}");
    let (s, peer) = l.accept()?;
    eprintln!("client {peer}");
    let mut w = s.try_clone()?;
    let mut r = BufReader::new(s);
    writeln!(
        w,
        "{} {} {} {} {}",
        ep_words(&end.qp.endpoint()),
        end.arena.addr(),
        end.mr.rkey(),
        end.arena.len(),
        upper_sha
    )?;
    let peer_ep = parse_ep(&line(&mut r)?)?;
    let end = end.connect(&peer_ep)?;
    writeln!(w, "ready")?;
    let lower = PeerSpan::new(&end.arena, end.arena.addr(), half).unwrap();
    let whole = PeerSpan::new(&end.arena, end.arena.addr(), end.arena.len()).unwrap();
    let before = sha(&whole);
    // Serve commands until the client says it is done: the QP and the
    // arena must stay up while the client READs.
    loop {
        let cmd = match line(&mut r) {
            Ok(c) if !c.is_empty() => c,
            _ => return Ok(()),
        };
        match cmd[0].as_str() {
            "verify" => {
                let got = sha(&lower);
                let ok = got == cmd[1];
                writeln!(w, "{}", if ok { "ok" } else { "mismatch" })?;
                println!(
                    "server: WRITE target {half} bytes sha256 {got} {}",
                    if ok { "verified" } else { "MISMATCH" }
                );
                if !ok {
                    return Err("written data does not match".into());
                }
            }
            "unchanged?" => {
                let ok = sha(&whole) == before;
                writeln!(w, "{}", if ok { "ok" } else { "changed" })?;
                println!(
                    "server: memory {} after the bad-rkey WRITE",
                    if ok { "unchanged" } else { "CHANGED" }
                );
                if !ok {
                    return Err("memory changed".into());
                }
            }
            "bye" => return Ok(()),
            c => return Err(format!("unknown command {c}").into()),
        }
    }
}

fn drain(cq: &CompletionQueue, want: usize) -> R<Vec<WorkCompletion>> {
    let mut out = Vec::new();
    let mut buf = [WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        byte_len: 0,
    }; POLL_BATCH];
    let deadline = Instant::now() + Duration::from_secs(60);
    while out.len() < want {
        let n = cq.poll(&mut buf)?;
        out.extend_from_slice(&buf[..n]);
        if n == 0 && Instant::now() > deadline {
            return Err("timed out waiting for completions".into());
        }
    }
    Ok(out)
}

/// Post `len` bytes as `block`-sized WRs in chains of 32, only the last of a
/// chain signaled, at most `depth` outstanding. Returns seconds taken.
fn run(
    end: &End<QueuePair>,
    kind: OpKind,
    local: u64,
    remote: u64,
    rkey: u32,
    len: usize,
    block: usize,
) -> R<f64> {
    const BATCH: usize = 32;
    let depth = end.qp.sq_depth() as usize / BATCH * BATCH;
    let mut scratch = PostScratch::with_capacity(BATCH);
    let blocks = len.div_ceil(block);
    let (mut next, mut outstanding) = (0usize, 0usize);
    let t = Instant::now();
    let mut chain = Vec::with_capacity(BATCH);
    while next < blocks || outstanding > 0 {
        while next < blocks && outstanding + BATCH <= depth {
            chain.clear();
            for i in next..(next + BATCH).min(blocks) {
                let off = i * block;
                let n = block.min(len - off);
                chain.push(WorkRequest {
                    wr_id: i as u64,
                    kind,
                    local: LocalSeg {
                        addr: local + off as u64,
                        len: n as u32,
                        lkey: end.mr.lkey(),
                    },
                    remote: RemoteSeg {
                        addr: remote + off as u64,
                        rkey,
                    },
                    signaled: false,
                    inline: false,
                });
            }
            chain.last_mut().unwrap().signaled = true;
            // SAFETY: the arena outlives the run and is not read until every
            // chain's signaled completion has arrived.
            unsafe { end.qp.post_send(&chain, &mut scratch) }?;
            outstanding += chain.len();
            next += chain.len();
        }
        for wc in drain(end.qp.send_cq(), 1)? {
            if wc.status != WcStatus::Success {
                return Err(
                    format!("completion error {:?} on block {}", wc.status, wc.wr_id).into(),
                );
            }
            // The signaled WR retires its whole chain.
            let first = (wc.wr_id as usize / BATCH) * BATCH;
            outstanding -= wc.wr_id as usize + 1 - first;
        }
    }
    Ok(t.elapsed().as_secs_f64())
}

fn client(args: &[String]) -> R<()> {
    let addr = arg(args, "--connect").ok_or("--connect HOST:PORT is required")?;
    let mib: usize = arg(args, "--mib")
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(64);
    let block: usize = arg(args, "--block")
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(1 << 20);
    let bad = args.iter().any(|a| a == "--bad-rkey");
    let end = open(arg(args, "--device"), mib)?;
    // The server may still be mapping its arena: retry for a while.
    let t0 = Instant::now();
    let s = loop {
        match TcpStream::connect(&addr) {
            Ok(s) => break s,
            Err(e) if t0.elapsed() < Duration::from_secs(60) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(e) => return Err(format!("connecting to {addr}: {e}").into()),
        }
    };
    let mut w = s.try_clone()?;
    let mut r = BufReader::new(s);
    let hello = line(&mut r)?;
    let peer_ep = parse_ep(&hello[..5])?;
    let (raddr, rkey, rlen, upper_sha): (u64, u32, usize, String) = (
        hello[5].parse()?,
        hello[6].parse()?,
        hello[7].parse()?,
        hello[8].clone(),
    );
    writeln!(w, "{}", ep_words(&end.qp.endpoint()))?;
    let mut end = end.connect(&peer_ep)?;
    line(&mut r)?; // ready
    let half = rlen.min(end.arena.len()) / 2;
    let src = PeerSpan::new(&end.arena, end.arena.addr(), half).unwrap();
    pattern(&src, 0xc0ffee);
    if bad {
        let err = run(
            &end,
            OpKind::Write,
            src.addr(),
            raddr,
            rkey ^ 0x00ab_0000,
            4096,
            4096,
        )
        .unwrap_err();
        println!("client: bad rkey -> {err}");
        if !err.to_string().contains("RemoteAccess") {
            return Err(format!("expected a remote access error, got: {err}").into());
        }
        writeln!(w, "unchanged?")?;
        let ans = line(&mut r)?;
        if ans[0] != "ok" {
            return Err("server memory changed after a rejected WRITE".into());
        }
        println!("client: remote access error reported, server memory unchanged");
        writeln!(w, "bye")?;
        return Ok(());
    }
    let secs = run(&end, OpKind::Write, src.addr(), raddr, rkey, half, block)?;
    println!(
        "client: RDMA WRITE {half} bytes in {block}-byte blocks: {:.1} MB/s",
        half as f64 / secs / 1e6
    );
    writeln!(w, "verify {}", sha(&src))?;
    if line(&mut r)?[0] != "ok" {
        return Err("server reports the written bytes differ".into());
    }
    let dst = PeerSpan::new(&end.arena, end.arena.addr() + half as u64, half).unwrap();
    let secs = run(
        &end,
        OpKind::Read,
        dst.addr(),
        raddr + half as u64,
        rkey,
        half,
        block,
    )?;
    println!(
        "client: RDMA READ {half} bytes in {block}-byte blocks: {:.1} MB/s",
        half as f64 / secs / 1e6
    );
    if sha(&dst) != upper_sha {
        return Err("bytes read differ from the server's".into());
    }
    println!("client: verified WRITE and READ of {half} bytes each (sha256 match)");
    writeln!(w, "bye")?;
    end.qp.set_error().ok();
    Ok(())
}

fn main() -> R<()> {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("serve") => serve(&args),
        Some("client") => client(&args),
        _ => Err("usage: verbs_blocks serve|client [options] (see the source header)".into()),
    }
}
