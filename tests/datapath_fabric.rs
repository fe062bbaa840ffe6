//! The data path on a real RDMA device (soft-RoCE in the test VM): the
//! engine + legacy runner (`datapath::legacy`, what the control plane uses
//! today) on `VerbsChannel`, two QPs on one device, data verified
//! byte for byte.
//!
//! `#[ignore]`d in a plain `cargo test` (no device); run them in the VM:
//! `cargo test --test datapath_fabric --no-run`, then
//! `bash scripts/testbed.sh run lo -- target/debug/deps/datapath_fabric-<hash> --ignored --test-threads=1`.
//! Devices: `RCP_TEST_DEV_A` / `RCP_TEST_DEV_B` (default: the first device).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rcp::datapath::legacy::*;
use rcp::datapath::{DataPathConfig, PollMode};
use rcp::engine::{LocalSeg, OpKind, Transfer, WcStatus, Window};
use rcp::mem::{Arena, ArenaConfig, PeerSpan};
use rcp::provider::Channel;
use rcp::verbs::*;

const SQ: u32 = 128;

struct End {
    ch: VerbsChannel,
    arena: Arena,
    mr: MemoryRegion,
}

fn dev(var: &str) -> Option<String> {
    std::env::var(var).ok().filter(|s| !s.is_empty())
}

fn end(dev: Option<String>, arena_bytes: usize) -> End {
    assert!(!device_names().is_empty(), "no RDMA device found");
    let ctx = Context::open(dev.as_deref()).expect("open device");
    let (port, gid) = ctx
        .select_port(None)
        .expect("an ACTIVE port with a usable GID");
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cc = CompletionChannel::new(&ctx).unwrap();
    let cq = CompletionQueue::new(&ctx, 4 * SQ, Some(&cc)).unwrap();
    let remote = Access::REMOTE_WRITE | Access::REMOTE_READ;
    let qp = QueuePair::new(
        &pd,
        &cq,
        &cq,
        QpConfig {
            port: port.port,
            gid_index: gid.entry.index,
            sq_depth: SQ,
            max_send_sge: 1,
            max_inline: 64,
            remote_access: remote,
        },
    )
    .unwrap();
    let mut cfg = ArenaConfig::new(arena_bytes);
    cfg.numa_node = ctx.numa_node();
    let arena = Arena::new(&cfg).unwrap();
    let mr = pd
        .register_arena(&arena, Access::LOCAL_WRITE | remote)
        .unwrap();
    End {
        ch: VerbsChannel::new(qp),
        arena,
        mr,
    }
}

fn pair(a_bytes: usize, b_bytes: usize) -> (End, End) {
    let a = end(dev("RCP_TEST_DEV_A"), a_bytes);
    let b = end(dev("RCP_TEST_DEV_B"), b_bytes);
    let (ea, eb) = (a.ch.endpoint(), b.ch.endpoint());
    a.ch.handshake(&eb, &ConnectParams::default()).unwrap();
    b.ch.handshake(&ea, &ConnectParams::default()).unwrap();
    (a, b)
}

/// The reconnect the control plane would do: reset both QPs, exchange the
/// new endpoints (in-process here), handshake.
fn reconnect(a: &End, b: &End) -> Result<(), ReconnectError> {
    let ea = a.ch.reset()?;
    let eb = b.ch.reset()?;
    a.ch.handshake(&eb, &ConnectParams::default())?;
    b.ch.handshake(&ea, &ConnectParams::default())?;
    Ok(())
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = vec![0u8; len];
    for c in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    v
}

fn whole(e: &End) -> PeerSpan {
    PeerSpan::new(&e.arena, e.arena.addr(), e.arena.len()).unwrap()
}

/// Local staging buffers: `n` blocks at the start of A's arena.
fn buffers(a: &End, block: u64, n: u64) -> Vec<LocalSeg> {
    (0..n)
        .map(|i| LocalSeg {
            addr: a.arena.addr() + i * block,
            len: block as u32,
            lkey: a.mr.lkey(),
        })
        .collect()
}

fn window(b: &End, id: u64, file_offset: u64, len: u64, rkey: u32) -> Window {
    Window {
        id,
        remote_addr: b.arena.addr() + file_offset,
        rkey,
        len,
        file_offset,
        epoch: 0,
    }
}

fn dp_cfg() -> DataPathConfig {
    DataPathConfig {
        poll_mode: PollMode::Hybrid { empty_polls: 256 },
        ..DataPathConfig::default()
    }
    .from_env()
    .unwrap()
}

/// Move `len` bytes in `block`-byte blocks with the data path; returns the
/// report and the bytes that ended up on the receiving side.
fn move_and_verify(op: OpKind, len: usize, block: u64, windows: u64) {
    let staging_blocks = 16u64;
    let (a, b) = pair((staging_blocks * block) as usize, len);
    let data = pattern(len, 0xfeed + len as u64);
    let cfg = dp_cfg();
    let tc = cfg
        .transfer_config(op, len as u64, block, &a.ch.caps())
        .unwrap();
    let mut t = Transfer::new(tc, buffers(&a, block, staging_blocks)).unwrap();
    let file = match op {
        OpKind::Write => data.clone(),
        OpKind::Read => {
            // SAFETY: B's region is the target of the transfer below, which
            // has not started: nothing names it yet.
            unsafe { whole(&b).with_mut(0, len, |d| d.copy_from_slice(&data)) }.unwrap();
            vec![0u8; len]
        }
    };
    let mut io = MemoryIo::new(file, Staging::new(whole(&a)), t.plan().count());
    let wlen = len as u64 / windows;
    for w in 0..windows {
        io.windows
            .push_back(window(&b, w, w * wlen, wlen, b.mr.rkey()));
    }
    let t0 = Instant::now();
    let r = run_transfer(&a.ch, &mut t, &mut io, &cfg, &mut || reconnect(&a, &b)).unwrap();
    eprintln!(
        "{op:?} {len} bytes in {block}-byte blocks: {:.3} s, {:.1} MB/s, doorbells {}, p50 {:.1} us p99 {:.1} us",
        t0.elapsed().as_secs_f64(),
        r.bytes as f64 / r.seconds / 1e6,
        r.doorbells,
        r.p50_us(),
        r.p99_us()
    );
    assert!(t.is_complete());
    assert_eq!(r.bytes, len as u64);
    assert_eq!(r.reconnects, 0);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(io.done_count.iter().all(|&c| c == 1));
    assert_eq!(io.windows_done.len() as u64, windows);
    let got = match op {
        OpKind::Write => whole(&b).with(0, len, |s| s.to_vec()).unwrap(),
        OpKind::Read => std::mem::take(&mut io.file),
    };
    assert!(got == data, "{op:?}: data differs");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn push_64mib_in_1mib_blocks_verified() {
    move_and_verify(OpKind::Write, 64 << 20, 1 << 20, 4);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn pull_64mib_in_1mib_blocks_verified() {
    move_and_verify(OpKind::Read, 64 << 20, 1 << 20, 4);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn a_batch_of_32_is_one_doorbell() {
    let (a, b) = pair(32 * 4096, 32 * 4096);
    let cfg = dp_cfg();
    let tc = cfg
        .transfer_config(OpKind::Write, 32 * 4096, 4096, &a.ch.caps())
        .unwrap();
    let mut t = Transfer::new(tc, buffers(&a, 4096, 32)).unwrap();
    let data = pattern(32 * 4096, 3);
    let mut io = MemoryIo::new(data.clone(), Staging::new(whole(&a)), 32);
    io.windows
        .push_back(window(&b, 1, 0, 32 * 4096, b.mr.rkey()));
    let r = run_transfer(&a.ch, &mut t, &mut io, &cfg, &mut || reconnect(&a, &b)).unwrap();
    assert_eq!(
        (r.doorbells, r.posted, r.signaled, r.completions),
        (1, 32, 1, 1)
    );
    assert!(whole(&b).with(0, 32 * 4096, |s| s == &data[..]).unwrap());
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn burst_of_100k_4k_writes_into_a_128_deep_sq() {
    let n: u64 = 100_000;
    let block = 4096u64;
    let region = 4u64 << 20; // every window lands on the same 4 MiB of B
    let (a, b) = pair((SQ as u64 * block) as usize, region as usize);
    let cfg = dp_cfg();
    let mut tc = cfg
        .transfer_config(OpKind::Write, n * block, block, &a.ch.caps())
        .unwrap();
    // The device may grant a deeper SQ than asked (rxe: 255 for 128); hold
    // the engine to 128 credits.
    tc.sq_depth = SQ as usize;
    let mut t = Transfer::new(tc, buffers(&a, block, SQ as u64)).unwrap();
    let (base, rkey) = (b.arena.addr(), b.mr.rkey());
    let mut k = 0u64;
    let mut io = NullIo {
        windows: move || {
            let off = k * region;
            (off < n * block).then(|| {
                k += 1;
                Window {
                    id: k,
                    remote_addr: base,
                    rkey,
                    len: region.min(n * block - off),
                    file_offset: off,
                    epoch: 0,
                }
            })
        },
    };
    let dp = DataPath::new(cfg).unwrap();
    let r = dp
        .run(&a.ch, &mut t, &mut io, &mut || reconnect(&a, &b))
        .unwrap();
    eprintln!(
        "100k x 4 KiB: {:.2} s, {:.0} msg/s, doorbells {}, completions {}, post failures {}",
        r.seconds,
        r.msgs as f64 / r.seconds,
        r.doorbells,
        r.completions,
        r.post_failures
    );
    assert!(t.is_complete());
    assert_eq!(r.msgs, n);
    assert_eq!(r.post_failures, 0, "the SQ was never over-posted");
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(r.doorbells >= n / 32 && r.doorbells < n, "{}", r.doorbells);
    // Every credit back at the end (sq_free counts against the granted depth).
    assert_eq!(
        dp.stats().sq_free.load(Relaxed),
        u64::from(a.ch.caps().sq_depth)
    );
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn qp_error_mid_stream_reconnects_once_and_every_block_verifies() {
    let len = 32usize << 20;
    let block = 256u64 << 10; // 128 blocks
    let staging = 16u64;
    let (a, b) = pair((staging * block) as usize, len);
    let data = pattern(len, 99);
    let cfg = dp_cfg();
    let tc = cfg
        .transfer_config(OpKind::Write, len as u64, block, &a.ch.caps())
        .unwrap();
    let mut t = Transfer::new(tc, buffers(&a, block, staging)).unwrap();
    let mut io = MemoryIo::new(data.clone(), Staging::new(whole(&a)), t.plan().count());
    io.windows
        .push_back(window(&b, 1, 0, len as u64, b.mr.rkey()));
    let dp = DataPath::new(cfg).unwrap();
    let stats = Arc::clone(dp.stats());
    let total = t.plan().count();
    let r = std::thread::scope(|s| {
        let ach = &a.ch;
        s.spawn(move || {
            // Break the QP once a quarter of the blocks is confirmed.
            let deadline = Instant::now() + Duration::from_secs(60);
            while stats.blocks_done.load(Relaxed) < total / 4 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_micros(100));
            }
            eprintln!("set_error after {} blocks", stats.blocks_done.load(Relaxed));
            ach.set_error().unwrap();
        });
        dp.run(&a.ch, &mut t, &mut io, &mut || reconnect(&a, &b))
    })
    .unwrap();
    eprintln!(
        "reconnects {} in {:?} s, errors {:?}, reposted {}",
        r.reconnects,
        r.reconnect_seconds,
        r.errors,
        t.counters().reposted
    );
    assert!(t.is_complete());
    assert_eq!(r.reconnects, 1);
    assert_eq!(
        t.counters().error_batches,
        1,
        "the flush was one error batch"
    );
    assert!(r.errors.get("wr_flush_err").copied().unwrap_or(0) > 0);
    assert!(
        io.done_count.iter().all(|&c| c == 1),
        "every block done once"
    );
    assert!(
        t.counters().reposted <= staging,
        "only in-flight blocks are reposted"
    );
    assert!(whole(&b).with(0, len, |s| s == &data[..]).unwrap());
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn wrong_rkey_is_a_remote_access_error_not_a_hang() {
    let (a, b) = pair(16 * 65536, 1 << 20);
    let cfg = dp_cfg();
    let tc = cfg
        .transfer_config(OpKind::Write, 1 << 20, 65536, &a.ch.caps())
        .unwrap();
    let mut t = Transfer::new(tc, buffers(&a, 65536, 16)).unwrap();
    let mut io = MemoryIo::new(pattern(1 << 20, 1), Staging::new(whole(&a)), 16);
    io.windows
        .push_back(window(&b, 1, 0, 1 << 20, b.mr.rkey() ^ 0x5a5a_0000));
    let before = whole(&b).with(0, 1 << 20, |s| s.to_vec()).unwrap();
    let t0 = Instant::now();
    let e = run_transfer(&a.ch, &mut t, &mut io, &cfg, &mut || {
        panic!("a remote access error must not reconnect")
    })
    .unwrap_err();
    eprintln!("after {:?}: {e}", t0.elapsed());
    assert!(
        matches!(
            e,
            DataPathError::Failed {
                status: Some(WcStatus::RemoteAccess),
                ..
            }
        ),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert!(whole(&b).with(0, 1 << 20, |s| s == &before[..]).unwrap());
}
