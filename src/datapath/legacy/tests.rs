//! Legacy runner tests on the fake channel (no device). They check the
//! runtime's bookkeeping, not RDMA: tests/datapath_fabric.rs does that on
//! soft-RoCE.

use std::io;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use super::super::fake::FakeChannel;
use super::*;
use crate::datapath::{allowed_cpus, Backoff, DataPathConfig, PollMode, PortMonitor};
use crate::engine::{LocalSeg, OpKind, Transfer, WcStatus, Window};

const BLOCK: u64 = 4096;

fn transfer(op: OpKind, blocks: u64, cfg: &DataPathConfig, ch: &FakeChannel) -> Transfer {
    let caps = crate::provider::Channel::caps(ch);
    let tc = cfg
        .transfer_config(op, blocks * BLOCK, BLOCK, &caps)
        .unwrap();
    let bufs = (0..caps.sq_depth as u64)
        .map(|i| LocalSeg {
            addr: 0x1_0000_0000 + i * BLOCK,
            len: BLOCK as u32,
            lkey: 7,
        })
        .collect();
    let mut t = Transfer::new(tc, bufs).unwrap();
    t.add_window(Window {
        id: 1,
        remote_addr: 0x2_0000_0000,
        rkey: 9,
        len: blocks * BLOCK,
        file_offset: 0,
        epoch: 0,
    })
    .unwrap();
    t
}

/// Counts fills, drains and confirmations per block.
#[derive(Default)]
struct CountIo {
    filled: Vec<u32>,
    drained: Vec<u32>,
    done: Vec<u32>,
    windows_done: Vec<u64>,
}

impl CountIo {
    fn new(blocks: u64) -> Self {
        let v = vec![0; blocks as usize];
        CountIo {
            filled: v.clone(),
            drained: v.clone(),
            done: v,
            windows_done: vec![],
        }
    }
}

impl BlockIo for CountIo {
    fn fill(&mut self, off: u64, _l: LocalSeg) -> io::Result<()> {
        self.filled[(off / BLOCK) as usize] += 1;
        Ok(())
    }
    fn drain(&mut self, off: u64, _l: LocalSeg) -> io::Result<()> {
        self.drained[(off / BLOCK) as usize] += 1;
        Ok(())
    }
    fn block_done(&mut self, b: u64, _o: u64, _l: u32) {
        self.done[b as usize] += 1;
    }
    fn window_done(&mut self, id: u64) {
        self.windows_done.push(id);
    }
}

fn cfg(mode: PollMode) -> DataPathConfig {
    DataPathConfig {
        poll_mode: mode,
        flush_timeout: Duration::from_millis(300),
        backoff: Backoff {
            initial: Duration::from_millis(1),
            ..Backoff::default()
        },
        ..DataPathConfig::default()
    }
}

fn no_reconnect() -> Result<(), ReconnectError> {
    panic!("no reconnect expected")
}

#[test]
fn a_batch_of_32_is_one_post() {
    let ch = FakeChannel::new(128);
    let c = cfg(PollMode::Event);
    let mut t = transfer(OpKind::Write, 32, &c, &ch);
    let mut io = CountIo::new(32);
    let r = run_transfer(&ch, &mut t, &mut io, &c, &mut no_reconnect).unwrap();
    assert_eq!(ch.posts.load(Relaxed), 1);
    assert_eq!((r.doorbells, r.posted, r.signaled), (1, 32, 1));
    assert_eq!((r.msgs, r.bytes), (32, 32 * BLOCK));
    assert!(io.filled.iter().all(|&n| n == 1));
    assert!(io.done.iter().all(|&n| n == 1));
    assert_eq!(io.windows_done, [1]);
    assert_eq!(r.latency.count(), 1);
}

#[test]
fn burst_of_100k_never_exceeds_sq_depth() {
    let ch = FakeChannel::new(128);
    let c = cfg(PollMode::Hybrid { empty_polls: 64 });
    let n = 100_000;
    let mut t = transfer(OpKind::Write, n, &c, &ch);
    let mut io = CountIo::new(n);
    let dp = DataPath::new(c).unwrap();
    let r = dp.run(&ch, &mut t, &mut io, &mut no_reconnect).unwrap();
    assert!(t.is_complete());
    assert_eq!(r.msgs, n);
    assert!(ch.max_outstanding.load(Relaxed) <= 128);
    assert_eq!(ch.overflows.load(Relaxed), 0);
    assert!(io.done.iter().all(|&k| k == 1));
    assert_eq!(r.doorbells, ch.posts.load(Relaxed));
    assert_eq!(dp.stats().posted.load(Relaxed), n);
    assert_eq!(dp.stats().sq_free.load(Relaxed), 128);
    assert!(r.doorbells >= n / 32, "{}", r.doorbells);
}

#[test]
fn tx_depth_caps_the_requests_outstanding() {
    for (depth, mode) in [(1, PollMode::Poll), (3, PollMode::Event)] {
        let ch = FakeChannel::new(128);
        let c = DataPathConfig {
            batch: 8,
            signal_every: 1,
            tx_depth: Some(depth),
            ..cfg(mode)
        };
        let n = 500;
        let mut t = transfer(OpKind::Write, n, &c, &ch);
        let mut io = CountIo::new(n);
        let r = run_transfer(&ch, &mut t, &mut io, &c, &mut no_reconnect).unwrap();
        assert_eq!(r.msgs, n);
        assert_eq!(
            ch.max_outstanding.load(Relaxed),
            depth as u64,
            "depth {depth}"
        );
        // Chains are cut to what the depth allows.
        assert!(r.doorbells >= n / depth as u64, "{}", r.doorbells);
    }
}

#[test]
fn error_mid_stream_reconnects_once_and_reposts_only_unconfirmed() {
    for flush_unsignaled in [true, false] {
        let mut ch = FakeChannel::new(128);
        ch.flush_unsignaled = flush_unsignaled;
        // Request 1000 fails (mid-chain: unsignaled), later ones are flushed.
        ch.fail_at(1000, WcStatus::RetryExceeded);
        let c = cfg(PollMode::Event);
        let n = 4096;
        let mut t = transfer(OpKind::Read, n, &c, &ch);
        let mut io = CountIo::new(n);
        let mut calls = 0;
        let r = run_transfer(&ch, &mut t, &mut io, &c, &mut || {
            calls += 1;
            ch.reset();
            Ok(())
        })
        .unwrap();
        assert_eq!(calls, 1);
        assert_eq!(r.reconnects, 1);
        assert_eq!(r.reconnect_seconds.len(), 1);
        // No port monitor: no link-up time to measure from.
        assert!(r.port_up_to_first_wr_seconds.is_empty());
        assert!(t.is_complete());
        let reposted = t.counters().reposted;
        assert!(reposted > 0 && reposted <= 128, "reposted {reposted}");
        // Every block posted once, plus the unconfirmed ones once more.
        assert_eq!(r.posted, n + reposted);
        assert!(io.done.iter().all(|&k| k == 1), "every block done once");
        assert!(
            io.drained.iter().all(|&k| k == 1),
            "every block drained once"
        );
        assert_eq!(r.errors.get("retry_exc_err"), Some(&1));
        assert!(r.errors.get("wr_flush_err").copied().unwrap_or(0) > 0);
    }
}

#[test]
fn remote_access_error_fails_without_reconnect() {
    let ch = FakeChannel::new(128);
    ch.fail_at(40, WcStatus::RemoteAccess);
    let c = cfg(PollMode::Event);
    let mut t = transfer(OpKind::Write, 1024, &c, &ch);
    let mut io = CountIo::new(1024);
    let e = run_transfer(&ch, &mut t, &mut io, &c, &mut no_reconnect).unwrap_err();
    match &e {
        DataPathError::Failed { status, block, .. } => {
            assert_eq!(*status, Some(WcStatus::RemoteAccess));
            assert_eq!(*block, Some(40));
        }
        other => panic!("{other:?}"),
    }
    let msg = e.to_string();
    assert!(
        msg.contains("rem_access_err") && msg.contains("40"),
        "{msg}"
    );
    assert_eq!(ch.resets.load(Relaxed), 0);
}

#[test]
fn reconnect_failures_back_off_then_give_up() {
    let ch = FakeChannel::new(64);
    ch.fail_at(10, WcStatus::RetryExceeded);
    let mut c = cfg(PollMode::Event);
    c.backoff.max_attempts = 3;
    let mut t = transfer(OpKind::Write, 256, &c, &ch);
    let mut io = CountIo::new(256);
    let mut calls = 0;
    let e = run_transfer(&ch, &mut t, &mut io, &c, &mut || {
        calls += 1;
        Err("peer unreachable".into())
    })
    .unwrap_err();
    assert_eq!(calls, 3);
    assert!(
        matches!(e, DataPathError::Reconnect { attempts: 3, .. }),
        "{e}"
    );
}

#[test]
fn missing_window_is_an_error_not_a_hang() {
    let ch = FakeChannel::new(64);
    let c = cfg(PollMode::Event);
    let caps = crate::provider::Channel::caps(&ch);
    let tc = c
        .transfer_config(OpKind::Write, 8 * BLOCK, BLOCK, &caps)
        .unwrap();
    let bufs = vec![LocalSeg {
        addr: 0x1000,
        len: BLOCK as u32,
        lkey: 1,
    }];
    let mut t = Transfer::new(tc, bufs).unwrap();
    let e = run_transfer(&ch, &mut t, &mut CountIo::new(8), &c, &mut no_reconnect).unwrap_err();
    assert!(matches!(e, DataPathError::NoWindow { .. }), "{e}");
}

#[test]
fn hybrid_wakes_on_completions_and_drains() {
    let ch = FakeChannel::new(128);
    let c = cfg(PollMode::Hybrid { empty_polls: 8 });
    let mut t = transfer(OpKind::Write, 2048, &c, &ch);
    let r = run_transfer(&ch, &mut t, &mut CountIo::new(2048), &c, &mut no_reconnect).unwrap();
    assert_eq!(r.msgs, 2048);
    assert_eq!(r.completions, 64);
}

#[test]
fn qp_in_error_before_the_first_post_is_flushed_and_reconnected() {
    let ch = FakeChannel::new(128);
    ch.set_error();
    let c = cfg(PollMode::Event);
    let mut t = transfer(OpKind::Write, 300, &c, &ch);
    let mut io = CountIo::new(300);
    let r = run_transfer(&ch, &mut t, &mut io, &c, &mut || {
        ch.reset();
        Ok(())
    })
    .unwrap();
    assert_eq!(r.reconnects, 1);
    assert!(io.done.iter().all(|&k| k == 1));
    assert_eq!(t.counters().reposted, 128);
}

/// A port that goes down with the error and comes back at `up_at`.
struct FakePort {
    up_at: std::sync::Mutex<Option<std::time::Instant>>,
    events: std::sync::atomic::AtomicU64,
}

impl PortMonitor for FakePort {
    fn is_active(&self) -> bool {
        self.up_at
            .lock()
            .unwrap()
            .is_none_or(|t| std::time::Instant::now() >= t)
    }
    fn wait_active(&self, timeout: Duration) -> bool {
        let end = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < end {
            if self.is_active() {
                self.events.fetch_add(1, Relaxed);
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.is_active()
    }
    fn events_seen(&self) -> u64 {
        self.events.load(Relaxed)
    }
    fn active_since(&self) -> Option<std::time::Instant> {
        let up = *self.up_at.lock().unwrap();
        up.filter(|&t| std::time::Instant::now() >= t)
    }
}

#[test]
fn reconnect_waits_for_port_active_instead_of_sleeping() {
    let ch = FakeChannel::new(64);
    ch.fail_at(10, WcStatus::RetryExceeded);
    let mut c = cfg(PollMode::Event);
    // A blind backoff would sleep 10 s after the first failure.
    c.backoff.initial = Duration::from_secs(10);
    c.backoff.cap = Duration::from_secs(10);
    let port = Arc::new(FakePort {
        up_at: std::sync::Mutex::new(Some(std::time::Instant::now() + Duration::from_millis(300))),
        events: Default::default(),
    });
    let dp = DataPath::new(c.clone())
        .unwrap()
        .with_port_monitor(port.clone());
    let mut t = transfer(OpKind::Write, 256, &c, &ch);
    let mut io = CountIo::new(256);
    let mut calls = 0;
    let t0 = std::time::Instant::now();
    let r = dp
        .run(&ch, &mut t, &mut io, &mut || {
            calls += 1;
            if !port.is_active() {
                return Err("port down".into());
            }
            ch.reset();
            Ok(())
        })
        .unwrap();
    assert!(t.is_complete());
    assert_eq!(r.reconnects, 1);
    assert!(r.port_waits >= 1, "{r:?}");
    assert_eq!(r.port_events, 1);
    assert_eq!(calls, 1, "the first attempt waits for the port");
    // Timed from the port coming back, not from the error.
    let up = *port.up_at.lock().unwrap();
    let up_to_wr = &r.port_up_to_first_wr_seconds;
    assert_eq!(up_to_wr.len(), 1, "{r:?}");
    assert!(up_to_wr[0] >= 0.0 && up_to_wr[0] < 2.0, "{up_to_wr:?}");
    assert!(
        r.reconnect_seconds[0] > up_to_wr[0],
        "the error path started before the port came back: {r:?}"
    );
    assert!(up.unwrap().elapsed().as_secs_f64() >= up_to_wr[0]);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(dp.stats().port_waits.load(Relaxed), r.port_waits);
}

/// Records the CPUs the posting thread may use each time it fills a block.
struct AffinityIo {
    seen: Vec<Vec<usize>>,
}

impl BlockIo for AffinityIo {
    fn fill(&mut self, _off: u64, _l: LocalSeg) -> io::Result<()> {
        self.seen.push(allowed_cpus());
        Ok(())
    }
    fn drain(&mut self, _off: u64, _l: LocalSeg) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn the_poster_keeps_off_a_spinning_completion_core() {
    // On a thread of its own: the harness's threads are shared.
    std::thread::spawn(|| {
        let before = allowed_cpus();
        if before.len() < 2 {
            eprintln!("one CPU: nothing to keep off; checked by the guard's own test");
            return;
        }
        let cq = *before.last().unwrap();
        for (mode, keeps_off) in [
            (PollMode::Poll, true),
            (PollMode::Hybrid { empty_polls: 64 }, true),
            (PollMode::Event, false),
        ] {
            let ch = FakeChannel::new(128);
            let c = DataPathConfig {
                cq_cpu: Some(cq),
                ..cfg(mode)
            };
            let mut t = transfer(OpKind::Write, 64, &c, &ch);
            let mut io = AffinityIo { seen: vec![] };
            run_transfer(&ch, &mut t, &mut io, &c, &mut no_reconnect).unwrap();
            assert_eq!(io.seen.len(), 64);
            for s in &io.seen {
                assert_eq!(
                    !s.contains(&cq),
                    keeps_off,
                    "{mode}: poster on {s:?}, CQ on {cq}"
                );
            }
            assert_eq!(
                allowed_cpus(),
                before,
                "{mode}: affinity restored after the run"
            );
        }
    })
    .join()
    .unwrap();
}
