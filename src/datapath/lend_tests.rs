//! A lending data path over two rails: two tcp channels, each to a target
//! of its own, with local and remote domains of their own, so every key
//! differs per rail as on two devices. A buffer's windows spread over both
//! rails, each rail posting under its own registration's lkey and the rkey
//! named for it; the bytes land exact both ways (a rail posting under rail
//! 0's keys would be refused by its domains: the data path would fail);
//! the key map is empty again once the windows are done and the
//! registrations let go. And what a lending path refuses: several rails
//! without a key map, registrations not one per rail, rkeys not one per
//! rail.

use std::sync::Arc;
use std::time::Duration;

use super::fake::{wait_until, HANG_GUARD};
use super::keys::RailKeys;
use super::lend::{LendError, LendingPath, RailRegs};
use super::*;
use crate::engine::{Extent, OpKind, WindowJob};
use crate::mem::memfd::{LeaseKind, LeasedRange, LocalBuffer, ServiceBuffer};
use crate::mem::{Arena, ArenaConfig, PeerSpan};
use crate::provider::tcp::{TcpChannel, TcpDomain, TcpTarget, DEFAULT_CONNS};
use crate::provider::{Access, Channel, Domain, Registration};

/// The buffer; windows move its first half (write) into its second (read).
const LEN: u64 = 4 << 20;
const WIN: u64 = 256 << 10;
const CHUNK: u64 = 64 << 10;
const WINDOWS: u64 = LEN / 2 / WIN;

/// One rail: its channel, the local domain it looks lkeys up in, and the
/// remote memory's registration in the target's domain.
struct Rail {
    local: Arc<TcpDomain>,
    channel: Arc<TcpChannel>,
    rreg: Arc<dyn Registration>,
    _target: TcpTarget,
}

/// Fields drop in order: the rails (and their registrations) before the
/// remote memory.
struct Rig {
    rails: Vec<Rail>,
    remote: Arena,
    remote_span: PeerSpan,
}

fn rig() -> Rig {
    let remote = Arena::new(&ArenaConfig::new(LEN as usize)).unwrap();
    let remote_span = PeerSpan::new(&remote, remote.addr(), remote.len()).unwrap();
    let rails = (0..2)
        .map(|_| {
            let rd = TcpDomain::new();
            // SAFETY: the test reads the remote memory only once every
            // window that names it is done.
            let rreg =
                unsafe { rd.register(&remote_span, Access::REMOTE_WRITE | Access::REMOTE_READ) }
                    .unwrap();
            let target = TcpTarget::bind(rd, "127.0.0.1:0").unwrap();
            let local = TcpDomain::new();
            let channel =
                TcpChannel::connect_endpoint(local.clone(), &target.endpoint(), DEFAULT_CONNS, 128)
                    .unwrap();
            Rail {
                local,
                channel: Arc::new(channel),
                rreg,
                _target: target,
            }
        })
        .collect();
    Rig {
        rails,
        remote,
        remote_span,
    }
}

/// The rig's two rails as a data path; rail 1 maps keys through `keys`.
fn start(r: &Rig, keys: Option<&Arc<RailKeys>>) -> DataPath {
    let cfg = DataPathConfig {
        poll_mode: PollMode::Event,
        batch: 16,
        signal_every: 4,
        flush_timeout: Duration::from_secs(1),
        ..DataPathConfig::default()
    };
    let specs = r
        .rails
        .iter()
        .enumerate()
        .map(|(k, rail)| {
            let ch: Arc<dyn Channel> = rail.channel.clone();
            let spec = RailSpec::new(
                ch,
                Box::new(|_| Err(ReconnectError::permanent("no reconnect over this rig"))),
            );
            match keys {
                // No staging here: an lkey not entered maps to 0, which no
                // domain knows.
                Some(keys) if k > 0 => spec.with_keys(keys.map_for(k, 0)),
                _ => spec,
            }
        })
        .collect();
    DataPath::start_rails(cfg, specs).unwrap()
}

fn lending(r: &Rig, keys: Option<Arc<RailKeys>>) -> Result<LendingPath, LendError> {
    let dp = start(r, keys.as_ref());
    let ev = dp.take_events().unwrap();
    LendingPath::new(dp, ev, keys)
}

/// Each rail's rkey of the remote memory, rail 0's first.
fn rkeys(r: &Rig) -> Vec<u32> {
    r.rails.iter().map(|x| x.rreg.rkey()).collect()
}

/// The buffer's registration in every rail's local domain.
fn regs(r: &Rig, path: &LendingPath, buf: &ServiceBuffer) -> Arc<RailRegs> {
    let regs = r
        .rails
        .iter()
        .map(|x| {
            x.local
                .register_local(&buf.span(), Access::LOCAL_WRITE)
                .unwrap()
        })
        .collect();
    path.rail_regs(regs).unwrap()
}

fn window(
    id: u64,
    op: OpKind,
    local: &LeasedRange,
    lkey: u32,
    remote: u64,
    rkey: u32,
) -> WindowJob {
    WindowJob {
        id,
        op,
        local_addr: local.span().addr(),
        lkey,
        remote_addr: remote,
        rkey,
        extents: (0..WIN / CHUNK)
            .map(|k| Extent {
                offset: k * CHUNK,
                len: CHUNK as u32,
            })
            .collect(),
    }
}

/// Wait for `n` windows' ends (bounded by HANG_GUARD).
async fn wait_done(path: &LendingPath, n: u64) {
    let mut done = 0;
    while done < n {
        let next = tokio::time::timeout(HANG_GUARD, path.next_event())
            .await
            .expect("a window's end within HANG_GUARD");
        match next.expect("the data path ended") {
            (DpEvent::WindowDone { .. }, Some(_range)) => done += 1,
            (DpEvent::Failed(e), _) => panic!("the data path failed: {e}"),
            (e, _) => println!("event {e:?}"),
        }
    }
}

fn rail_bytes(stats: &DataPathStats) -> Vec<u64> {
    stats
        .rails
        .iter()
        .map(|r| r.counters().bytes_confirmed)
        .collect()
}

/// Move `WINDOWS` windows of `op` between the buffer's half at `local` and
/// the remote memory's first half.
async fn move_half(
    r: &Rig,
    path: &LendingPath,
    buf: &ServiceBuffer,
    regs: &Arc<RailRegs>,
    op: OpKind,
    local: u64,
    first_id: u64,
) {
    let kind = match op {
        OpKind::Write => LeaseKind::Shared,
        OpKind::Read => LeaseKind::Exclusive,
    };
    let rk = rkeys(r);
    for i in 0..WINDOWS {
        let range = buf.lease(local + i * WIN, WIN, kind).unwrap().unwrap();
        let job = window(
            first_id + i,
            op,
            &range,
            regs.lkey(),
            r.remote.addr() + i * WIN,
            rk[0],
        );
        path.submit(job, range, regs.clone(), &rk).unwrap();
    }
    wait_done(path, WINDOWS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_moves_over_both_rails_under_each_rails_keys() {
    let r = rig();
    let keys = Arc::new(RailKeys::default());
    let path = lending(&r, Some(keys.clone())).unwrap();
    assert_eq!(path.rails(), 2);
    let svc = LocalBuffer::create(LEN).unwrap();
    let buf = ServiceBuffer::from_memfd(svc.fd().try_clone_to_owned().unwrap(), LEN).unwrap();
    let data: Vec<u8> = (0..LEN / 2).map(|i| (i * 31 + i / 4093) as u8).collect();
    assert!(svc.write_at(0, &data));
    let regs = regs(&r, &path, &buf);
    let l0 = regs.lkey();
    let l1 = keys
        .lkey(l0, 1)
        .expect("rail 1's lkey entered with the registrations");
    assert_ne!(l0, l1, "each rail's domain has keys of its own");
    let stats = path.stats().unwrap().clone();

    move_half(&r, &path, &buf, &regs, OpKind::Write, 0, 1).await;
    let landed = r.remote_span.with(0, data.len(), <[u8]>::to_vec).unwrap();
    assert!(landed == data, "the writes landed byte-exact");
    // The counters are published just after the windows' ends.
    wait_until("the write's bytes counted", || {
        rail_bytes(&stats).iter().sum::<u64>() == LEN / 2
    });
    let wrote = rail_bytes(&stats);
    println!("write: bytes per rail {wrote:?}");
    assert!(
        wrote.iter().all(|&b| b > 0),
        "both rails carried the write: {wrote:?}"
    );

    move_half(&r, &path, &buf, &regs, OpKind::Read, LEN / 2, 100).await;
    let mut back = vec![0u8; data.len()];
    assert!(svc.read_at(LEN / 2, &mut back));
    assert!(back == data, "the reads landed byte-exact");
    wait_until("the read's bytes counted", || {
        rail_bytes(&stats).iter().sum::<u64>() == LEN
    });
    let read: Vec<u64> = rail_bytes(&stats)
        .iter()
        .zip(&wrote)
        .map(|(n, w)| n - w)
        .collect();
    println!("read: bytes per rail {read:?}");
    assert!(
        read.iter().all(|&b| b > 0),
        "both rails carried the read: {read:?}"
    );

    // Every window done: their rkeys are forgotten; the registrations'
    // lkeys once the last holder lets go.
    let rk = rkeys(&r);
    assert_eq!(
        keys.get(rk[0], 1),
        rk[0],
        "the windows' rkeys are forgotten"
    );
    assert_eq!(keys.lkey(l0, 1), Some(l1), "held by the registrations");
    drop(regs);
    assert_eq!(
        keys.lkey(l0, 1),
        None,
        "the registrations' keys go with them"
    );
    assert_eq!(path.lent(), 0);
    tokio::task::spawn_blocking(move || path.close())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lending_path_refuses_what_is_not_one_per_rail() {
    let r = rig();
    let e = lending(&r, None)
        .err()
        .expect("two rails without a key map");
    assert!(matches!(e, LendError::NoKeyMap(2)), "{e}");

    let path = lending(&r, Some(Arc::new(RailKeys::default()))).unwrap();
    let svc = LocalBuffer::create(LEN).unwrap();
    let buf = ServiceBuffer::from_memfd(svc.fd().try_clone_to_owned().unwrap(), LEN).unwrap();
    let one = r.rails[0]
        .local
        .register_local(&buf.span(), Access::LOCAL_WRITE)
        .unwrap();
    let e = path.rail_regs(vec![one]).unwrap_err();
    assert!(
        matches!(e, LendError::RegsPerRail { got: 1, rails: 2 }),
        "{e}"
    );

    let regs = regs(&r, &path, &buf);
    let rk = rkeys(&r);
    let range = buf.lease(0, WIN, LeaseKind::Shared).unwrap().unwrap();
    let job = window(
        1,
        OpKind::Write,
        &range,
        regs.lkey(),
        r.remote.addr(),
        rk[0],
    );
    let e = path.submit(job, range, regs.clone(), &rk[..1]).unwrap_err();
    assert!(matches!(e, LendError::RailRkeys { .. }), "{e}");
    assert_eq!(path.lent(), 0, "a refused window holds nothing");
    assert_eq!(buf.leases_live(), 0, "its lease went back");

    // A window under the id of one still live is refused, and the live
    // one keeps what it holds until its end.
    let range = buf.lease(0, WIN, LeaseKind::Shared).unwrap().unwrap();
    let job = window(
        2,
        OpKind::Write,
        &range,
        regs.lkey(),
        r.remote.addr(),
        rk[0],
    );
    path.submit(job, range, regs.clone(), &rk).unwrap();
    let again = buf.lease(WIN, WIN, LeaseKind::Shared).unwrap().unwrap();
    let job = window(
        2,
        OpKind::Write,
        &again,
        regs.lkey(),
        r.remote.addr() + WIN,
        rk[0],
    );
    let e = path.submit(job, again, regs.clone(), &rk).unwrap_err();
    assert!(matches!(e, LendError::LiveId { id: 2 }), "{e}");
    wait_done(&path, 1).await;
    assert_eq!(
        buf.leases_live(),
        0,
        "the live window's lease went back at its end"
    );
    tokio::task::spawn_blocking(move || path.close())
        .await
        .unwrap();
}

/// A file stream's way: staging blocks of an arena registered on both
/// rails are lent window by window; each comes back at its window's end
/// (READ: holding the bytes that landed), and a window reaching past its
/// block is refused before anything is posted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn staging_blocks_are_lent_and_come_back_at_their_windows_end() {
    let r = rig();
    let keys = Arc::new(RailKeys::default());
    let path = lending(&r, Some(keys.clone())).unwrap();
    let arena = Arena::new(&ArenaConfig::new(2 * WIN as usize)).unwrap();
    let span = PeerSpan::new(&arena, arena.addr(), arena.len()).unwrap();
    let staging = path
        .rail_regs(
            r.rails
                .iter()
                .map(|x| x.local.register_local(&span, Access::LOCAL_WRITE).unwrap())
                .collect(),
        )
        .unwrap();
    let pool = arena.into_pool(WIN as usize).unwrap();
    let rk = rkeys(&r);
    let job = |id, op, b: &crate::mem::Block, remote: u64| WindowJob {
        id,
        op,
        local_addr: b.addr(),
        lkey: staging.lkey(),
        remote_addr: r.remote.addr() + remote,
        rkey: rk[0],
        extents: (0..WIN / CHUNK)
            .map(|k| Extent {
                offset: k * CHUNK,
                len: CHUNK as u32,
            })
            .collect(),
    };

    // The arena may be larger than asked (whole pages): count from here.
    let free = pool.available();
    let mut out = pool.take().unwrap();
    let data: Vec<u8> = (0..WIN).map(|i| (i * 7 + i / 1021) as u8).collect();
    out.as_mut_slice().copy_from_slice(&data);
    path.submit(job(1, OpKind::Write, &out, 0), out, staging.clone(), &rk)
        .unwrap();
    assert_eq!(
        pool.available(),
        free - 1,
        "the written block is the path's"
    );
    let back = next_loan(&path).await;
    assert_eq!(pool.available(), free - 1, "handed back, not dropped");
    drop(back);
    assert_eq!(pool.available(), free);

    let into = pool.take().unwrap();
    path.submit(job(2, OpKind::Read, &into, 0), into, staging.clone(), &rk)
        .unwrap();
    let landed = next_loan(&path).await;
    assert!(
        landed.as_slice() == data,
        "the read landed in the block lent"
    );
    drop(landed);

    // Extents past the block's end: refused, the block back in the pool.
    let short = pool.take().unwrap();
    let mut j = job(3, OpKind::Read, &short, 0);
    j.extents.push(Extent {
        offset: WIN,
        len: CHUNK as u32,
    });
    let e = path.submit(j, short, staging.clone(), &rk).unwrap_err();
    assert!(matches!(e, LendError::OutsideLease { id: 3, .. }), "{e}");
    assert_eq!(pool.available(), free, "a refused window's block went back");
    assert_eq!(path.lent(), 0);
    drop(staging);
    tokio::task::spawn_blocking(move || path.close())
        .await
        .unwrap();
}

/// The block the next WindowDone hands back.
async fn next_loan(path: &LendingPath) -> crate::mem::Block {
    loop {
        let next = tokio::time::timeout(HANG_GUARD, path.next_event())
            .await
            .expect("a window's end within HANG_GUARD");
        match next.expect("the data path ended") {
            (DpEvent::WindowDone { .. }, Some(loan)) => {
                return loan
                    .into_block()
                    .expect("a staging block comes back as one")
            }
            (DpEvent::Failed(e), _) => panic!("the data path failed: {e}"),
            (e, _) => println!("event {e:?}"),
        }
    }
}
