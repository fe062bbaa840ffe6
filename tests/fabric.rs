//! Verbs on a real RDMA device (soft-RoCE in the test VM).
//!
//! These tests are `#[ignore]`d in a plain `cargo test` because a host without
//! an RDMA device cannot run them; `scripts/test-all.sh` runs them inside the
//! soft-RoCE VM with `--ignored`, where a missing device is a failure.
//! Devices: `RCP_TEST_DEV_A` / `RCP_TEST_DEV_B` (default: the first device for
//! both ends), so the same tests run on one rxe on `lo` and across two
//! namespaces joined by veth.

mod common;

use std::time::{Duration, Instant};

use common::verbs_rig::{bytes, fill, Side};
use rcp::engine::{LocalSeg, OpKind, RemoteSeg, WcStatus, WorkCompletion, WorkRequest};
use rcp::mem::{Backing, PeerSpan};
use rcp::verbs::*;

const NEEDS: &str = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)";

/// Send-queue depth of the test QPs (CQs of four times that).
const SQ: u32 = 256;

fn pair(arena_bytes: usize) -> (Side, Side) {
    common::verbs_rig::pair(arena_bytes, arena_bytes, SQ)
}

fn wait_completions(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let mut out = Vec::new();
    let mut buf = [WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        byte_len: 0,
    }; 64];
    let deadline = Instant::now() + Duration::from_secs(30);
    while out.len() < n {
        let k = cq.poll(&mut buf).unwrap();
        out.extend_from_slice(&buf[..k]);
        if k == 0 {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {n} completions, got {out:?}"
            );
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    out
}

fn op(
    kind: OpKind,
    id: u64,
    local: &Side,
    laddr: u64,
    len: usize,
    raddr: u64,
    rkey: u32,
) -> WorkRequest {
    WorkRequest {
        wr_id: id,
        kind,
        local: LocalSeg {
            addr: laddr,
            len: len as u32,
            lkey: local.mr.lkey(),
        },
        remote: RemoteSeg { addr: raddr, rkey },
        signaled: true,
        inline: false,
    }
}

fn post(s: &Side, wrs: &[WorkRequest]) {
    let mut scratch = PostScratch::with_capacity(64);
    // SAFETY: the test owns both arenas for its whole run and reads them only
    // after the completions for these requests arrived.
    unsafe { s.qp.post_send(wrs, &mut scratch) }.unwrap();
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn write_and_read_4k_to_4m_every_byte_checked() {
    let _ = NEEDS;
    let (a, b) = pair(16 << 20);
    eprintln!(
        "A={} qpn={:#x} B={} qpn={:#x} path_mtu={} inline={} backing={:?}",
        a.ctx.name(),
        a.qp.qpn(),
        b.ctx.name(),
        b.qp.qpn(),
        a.qp.path_mtu(),
        a.qp.max_inline(),
        a.arena.backing()
    );
    if std::env::var("RCP_REQUIRE_HUGEPAGES").is_ok() {
        assert_eq!(
            a.arena.backing(),
            &Backing::HugeTlb,
            "the VM configures huge pages"
        );
    }
    let mut size = 4096usize;
    let mut id = 0;
    while size <= 4 << 20 {
        // WRITE: A's [0, size) -> B's [8 MiB, 8 MiB + size)
        let src = PeerSpan::new(&a.arena, a.arena.addr(), size).unwrap();
        let dst = PeerSpan::new(&b.arena, b.arena.addr() + (8 << 20), size).unwrap();
        // SAFETY: the test touches a span only between requests: none in flight names it now.
        unsafe {
            fill(&src, size as u64);
            dst.with_mut(0, size, |d| d.fill(0)).unwrap();
        }
        id += 1;
        post(
            &a,
            &[op(
                OpKind::Write,
                id,
                &a,
                src.addr(),
                size,
                dst.addr(),
                b.mr.rkey(),
            )],
        );
        let wc = wait_completions(&a.cq, 1);
        assert_eq!(wc[0].status, WcStatus::Success, "write {size}");
        assert_eq!(wc[0].wr_id, id);
        assert!(
            bytes(&src) == bytes(&dst),
            "WRITE of {size} bytes: data differs"
        );

        // READ: B's [4 MiB, +size) -> A's [8 MiB, +size)
        let rsrc = PeerSpan::new(&b.arena, b.arena.addr() + (4 << 20), size).unwrap();
        let rdst = PeerSpan::new(&a.arena, a.arena.addr() + (8 << 20), size).unwrap();
        // SAFETY: the test touches a span only between requests: none in flight names it now.
        unsafe {
            fill(&rsrc, !(size as u64));
            rdst.with_mut(0, size, |d| d.fill(0)).unwrap();
        }
        id += 1;
        post(
            &a,
            &[op(
                OpKind::Read,
                id,
                &a,
                rdst.addr(),
                size,
                rsrc.addr(),
                b.mr.rkey(),
            )],
        );
        let wc = wait_completions(&a.cq, 1);
        assert_eq!(wc[0].status, WcStatus::Success, "read {size}");
        assert_eq!(wc[0].byte_len as usize, size);
        assert!(
            bytes(&rsrc) == bytes(&rdst),
            "READ of {size} bytes: data differs"
        );
        eprintln!("verified WRITE and READ of {size} bytes");
        size *= 2;
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn chained_batch_with_one_signal_retires_all() {
    let (a, b) = pair(8 << 20);
    // 32 writes of 64 KiB in one post, only the last signaled.
    let mut wrs = Vec::new();
    for i in 0..32u64 {
        let off = i * 65536;
        let src = PeerSpan::new(&a.arena, a.arena.addr() + off, 65536).unwrap();
        // SAFETY: nothing is posted until the chain below, after the fills.
        unsafe { fill(&src, i) };
        let mut w = op(
            OpKind::Write,
            i,
            &a,
            src.addr(),
            65536,
            b.arena.addr() + off,
            b.mr.rkey(),
        );
        w.signaled = i == 31;
        wrs.push(w);
    }
    post(&a, &wrs);
    let wc = wait_completions(&a.cq, 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (31, WcStatus::Success));
    std::thread::sleep(Duration::from_millis(50));
    let mut more = [WorkCompletion {
        wr_id: 0,
        status: WcStatus::Success,
        byte_len: 0,
    }; 8];
    assert_eq!(
        a.cq.poll(&mut more).unwrap(),
        0,
        "unsignaled WRs must not produce CQEs"
    );
    let all_a = PeerSpan::new(&a.arena, a.arena.addr(), 32 * 65536).unwrap();
    let all_b = PeerSpan::new(&b.arena, b.arena.addr(), 32 * 65536).unwrap();
    assert!(bytes(&all_a) == bytes(&all_b));
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn wrong_rkey_and_out_of_bounds_are_remote_access_errors() {
    for case in ["wrong rkey", "out of bounds", "no remote read right"] {
        let (a, b) = pair(4 << 20);
        // A window registered for REMOTE_WRITE only, 64 KiB.
        let win = PeerSpan::new(&b.arena, b.arena.addr() + (1 << 20), 65536).unwrap();
        // SAFETY: the test reads b's arena only while no request names it.
        let wmr = unsafe { b.pd.register_span(&win, Access::REMOTE_WRITE) }.unwrap();
        let (kind, raddr, rkey) = match case {
            "wrong rkey" => (OpKind::Write, win.addr(), wmr.rkey() ^ 0x5a5a_0000),
            "out of bounds" => (OpKind::Write, win.addr() + 65536 - 100, wmr.rkey()),
            _ => (OpKind::Read, win.addr(), wmr.rkey()),
        };
        let before = bytes(&PeerSpan::new(&b.arena, b.arena.addr(), b.arena.len()).unwrap());
        let src = PeerSpan::new(&a.arena, a.arena.addr(), 4096).unwrap();
        // SAFETY: a fresh pair: nothing is posted on it yet.
        unsafe { fill(&src, 77) };
        post(&a, &[op(kind, 1, &a, src.addr(), 4096, raddr, rkey)]);
        let wc = wait_completions(&a.cq, 1);
        assert_eq!(wc[0].status, WcStatus::RemoteAccess, "{case}: {:?}", wc[0]);
        let after = bytes(&PeerSpan::new(&b.arena, b.arena.addr(), b.arena.len()).unwrap());
        assert!(before == after, "{case}: the target's memory changed");
        // The QP is in error now: a further request is flushed, not executed.
        post(
            &a,
            &[op(
                OpKind::Write,
                2,
                &a,
                src.addr(),
                4096,
                win.addr(),
                wmr.rkey(),
            )],
        );
        let wc = wait_completions(&a.cq, 1);
        assert_eq!(wc[0].status, WcStatus::Flushed, "{case}");
        eprintln!("{case}: remote access error, target memory untouched");
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn qp_resets_and_reconnects_with_fresh_psn() {
    let (mut a, mut b) = pair(4 << 20);
    let old = a.qp.endpoint();
    a.qp.set_error().unwrap();
    let ea = a.qp.reset().unwrap();
    let eb = b.qp.reset().unwrap();
    assert_eq!(ea.qpn, old.qpn);
    assert_eq!(a.qp.state(), QpState::Init);
    a.qp.handshake(&eb, &ConnectParams::default()).unwrap();
    b.qp.handshake(&ea, &ConnectParams::default()).unwrap();
    let src = PeerSpan::new(&a.arena, a.arena.addr(), 8192).unwrap();
    // SAFETY: the reset QP has nothing in flight; the write below is posted after.
    unsafe { fill(&src, 5) };
    post(
        &a,
        &[op(
            OpKind::Write,
            9,
            &a,
            src.addr(),
            8192,
            b.arena.addr(),
            b.mr.rkey(),
        )],
    );
    assert_eq!(wait_completions(&a.cq, 1)[0].status, WcStatus::Success);
    assert!(bytes(&src) == bytes(&PeerSpan::new(&b.arena, b.arena.addr(), 8192).unwrap()));
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-all.sh (soft-RoCE VM)"]
fn doctor_is_healthy_on_the_fabric() {
    let d = rcp::doctor::diagnose(&rcp::doctor::DoctorOptions {
        arena_bytes: 64 << 20,
        ..Default::default()
    });
    for c in &d.checks {
        eprintln!("{c}");
    }
    assert!(
        d.rdma_ready(),
        "doctor finds a problem on a working rxe device"
    );
    for name in ["devices", "device", "port", "gid", "memlock"] {
        let c = d
            .checks
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no {name} check"));
        assert_eq!(c.level, rcp::doctor::Level::Ok, "{c}");
    }
}
