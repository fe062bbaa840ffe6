//! Session data path and completion-loop tests on the fake channel (no
//! device, no memory touched). They check the runtime's bookkeeping, not
//! RDMA: tests/datapath_fabric.rs does that on soft-RoCE, tests/tcp_datapath.rs
//! on the TCP provider.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedReceiver;

use super::fake::{recv_event, wait_until, within, FakeChannel, FakePort, HANG_GUARD};
use super::*;
use crate::engine::{Extent, OpKind, WcStatus, WindowJob};
use crate::provider::Channel;

const SLOT: u64 = 4096;

/// A window of `n` extents of `len` bytes, one every 4 KiB.
fn job(id: u64, op: OpKind, n: u64, len: u32) -> WindowJob {
    WindowJob {
        id,
        op,
        local_addr: 0x1_0000_0000 + (id << 24),
        lkey: 7,
        remote_addr: 0x2_0000_0000 + (id << 24),
        rkey: 9,
        extents: (0..n)
            .map(|k| Extent {
                offset: k * SLOT,
                len,
            })
            .collect(),
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

fn no_reconnect() -> ReconnectFn {
    Box::new(|| panic!("no reconnect expected"))
}

/// A reconnect that resets the fake and counts its calls.
fn resetting(ch: &Arc<FakeChannel>) -> (ReconnectFn, Arc<AtomicU32>) {
    let calls = Arc::new(AtomicU32::new(0));
    let (ch, n) = (ch.clone(), calls.clone());
    let f: ReconnectFn = Box::new(move || {
        n.fetch_add(1, Relaxed);
        ch.reset();
        Ok(())
    });
    (f, calls)
}

fn start(c: DataPathConfig, ch: &Arc<FakeChannel>, reconnect: ReconnectFn) -> DataPath {
    let ch: Arc<dyn Channel> = ch.clone();
    DataPath::start(c, ch, reconnect, None).unwrap()
}

fn submit(dp: &DataPath, w: WindowJob) {
    // SAFETY: the fake channel touches no memory.
    unsafe { dp.submit(w) }.unwrap();
}

/// Wait for every window in `ids` to be done (each exactly once); other
/// events are returned.
fn wait_done(ev: &mut UnboundedReceiver<DpEvent>, ids: &[u64]) -> Vec<DpEvent> {
    let mut done: HashMap<u64, u32> = HashMap::new();
    let mut other = Vec::new();
    let deadline = Instant::now() + HANG_GUARD;
    while done.len() < ids.len() {
        assert!(Instant::now() < deadline, "windows not done: {done:?}");
        match recv_event(ev).expect("data path ended") {
            DpEvent::WindowDone { id } => {
                assert!(ids.contains(&id), "unknown window {id}");
                *done.entry(id).or_default() += 1;
                assert_eq!(done[&id], 1, "window {id} done twice");
            }
            DpEvent::Failed(e) => panic!("failed: {e}"),
            e => other.push(e),
        }
    }
    other
}

fn wait_failed(ev: &mut UnboundedReceiver<DpEvent>) -> DataPathError {
    loop {
        match recv_event(ev).expect("data path ended") {
            DpEvent::Failed(e) => return e,
            DpEvent::WindowDone { .. }
            | DpEvent::Reconnected { .. }
            | DpEvent::RailDown { .. }
            | DpEvent::RailFenced { .. }
            | DpEvent::RailPaused { .. }
            | DpEvent::RailUp { .. } => {}
        }
    }
}

#[test]
fn a_batch_of_32_is_one_post() {
    let ch = Arc::new(FakeChannel::new(128));
    let dp = start(cfg(PollMode::Event), &ch, no_reconnect());
    let mut ev = dp.take_events().unwrap();
    assert!(dp.take_events().is_none(), "taken once");
    submit(&dp, job(1, OpKind::Write, 32, 4096));
    wait_done(&mut ev, &[1]);
    let r = dp.close();
    assert_eq!(ch.posts.load(Relaxed), 1);
    assert_eq!(
        (r.counters.doorbells, r.counters.posted, r.counters.signaled),
        (1, 32, 1)
    );
    assert_eq!(
        (
            r.counters.extents_confirmed,
            r.counters.bytes_confirmed,
            r.counters.windows_done
        ),
        (32, 32 * 4096, 1)
    );
    assert_eq!(r.counters.completions, 1);
    assert_eq!(r.latency.count(), 1);
    assert_eq!(r.outstanding_at_close, 0);
    assert!(
        recv_event(&mut ev).is_none(),
        "events end with the data path"
    );
}

#[test]
fn burst_of_100k_never_exceeds_sq_depth() {
    let ch = Arc::new(FakeChannel::new(128));
    let dp = start(
        cfg(PollMode::Hybrid { empty_polls: 64 }),
        &ch,
        no_reconnect(),
    );
    let mut ev = dp.take_events().unwrap();
    let ids: Vec<u64> = (0..100).collect();
    for &id in &ids {
        submit(&dp, job(id, OpKind::Write, 1000, 64));
    }
    wait_done(&mut ev, &ids);
    let stats = dp.stats().clone();
    let r = dp.close();
    let n = 100_000;
    assert_eq!(r.counters.extents_confirmed, n);
    assert!(ch.max_outstanding.load(Relaxed) <= 128);
    assert_eq!(ch.overflows.load(Relaxed), 0);
    assert_eq!(r.counters.doorbells, ch.posts.load(Relaxed));
    assert_eq!(r.counters.posted, ch.posted.load(Relaxed));
    // The live stats are the engine's counters, published.
    assert_eq!(stats.counters().posted, n);
    assert_eq!(stats.counters().extents_confirmed, n);
    assert_eq!(stats.counters().windows_done, 100);
    assert_eq!(stats.counters().doorbells, r.counters.doorbells);
    assert_eq!(stats.counters().completions, r.counters.completions);
    assert_eq!(stats.sq_free.load(Relaxed), 128);
    assert!(r.counters.doorbells >= n / 32, "{}", r.counters.doorbells);
}

#[test]
fn tx_depth_caps_the_requests_outstanding() {
    for (depth, mode) in [(1, PollMode::Poll), (3, PollMode::Event)] {
        let ch = Arc::new(FakeChannel::new(128));
        let c = DataPathConfig {
            batch: 8,
            signal_every: 1,
            tx_depth: Some(depth),
            ..cfg(mode)
        };
        let dp = start(c, &ch, no_reconnect());
        assert_eq!(dp.stream_config().sq_depth, depth);
        let mut ev = dp.take_events().unwrap();
        submit(&dp, job(1, OpKind::Write, 500, 100));
        wait_done(&mut ev, &[1]);
        let r = dp.close();
        assert_eq!(r.counters.extents_confirmed, 500);
        assert_eq!(
            ch.max_outstanding.load(Relaxed),
            depth as u64,
            "depth {depth}"
        );
        // Chains are cut to what the depth allows.
        assert!(
            r.counters.doorbells >= 500 / depth as u64,
            "{}",
            r.counters.doorbells
        );
    }
}

#[test]
fn error_mid_stream_reconnects_once_and_reposts_only_unconfirmed() {
    for flush_unsignaled in [true, false] {
        let mut fake = FakeChannel::new(128);
        fake.flush_unsignaled = flush_unsignaled;
        // Request 1000 fails (mid-chain: unsignaled), later ones are flushed.
        fake.fail_at(1000, WcStatus::RetryExceeded);
        let ch = Arc::new(fake);
        let (reconnect, calls) = resetting(&ch);
        let dp = start(cfg(PollMode::Event), &ch, reconnect);
        let mut ev = dp.take_events().unwrap();
        let ids: Vec<u64> = (0..8).collect();
        for &id in &ids {
            submit(&dp, job(id, OpKind::Read, 512, 4096));
        }
        let other = wait_done(&mut ev, &ids);
        let stats = dp.stats().clone();
        let r = dp.close();
        assert_eq!(calls.load(Relaxed), 1);
        assert!(
            matches!(other[..], [DpEvent::Reconnected { epoch: 1, .. }]),
            "{other:?}"
        );
        assert_eq!(r.counters.reconnects, 1);
        assert_eq!(r.reconnect_seconds.len(), 1);
        // No port monitor: no link-up time to measure from.
        assert!(r.port_up_to_first_wr_seconds.is_empty());
        let n = 8 * 512;
        let reposted = stats.counters().reposted;
        assert!(reposted > 0 && reposted <= 128, "reposted {reposted}");
        // Every extent posted once, plus the unconfirmed ones once more.
        assert_eq!(r.counters.posted, n + reposted);
        assert_eq!(
            r.counters.extents_confirmed, n,
            "every extent confirmed once"
        );
        assert_eq!(r.counters.errors.get(WcStatus::RetryExceeded), 1);
        assert!(r.counters.errors.get(WcStatus::Flushed) > 0);
        assert_eq!(stats.counters().failures, 1);
    }
}

#[test]
fn remote_access_error_fails_without_reconnect_and_refuses_submits() {
    let ch = Arc::new(FakeChannel::new(128));
    ch.fail_at(40, WcStatus::RemoteAccess);
    let dp = start(cfg(PollMode::Event), &ch, no_reconnect());
    let mut ev = dp.take_events().unwrap();
    submit(&dp, job(5, OpKind::Write, 1024, 4096));
    let e = wait_failed(&mut ev);
    match &e {
        DataPathError::Failed {
            status,
            window,
            extent,
            ..
        } => {
            assert_eq!(*status, Some(WcStatus::RemoteAccess));
            assert_eq!((*window, *extent), (Some(5), Some(40)));
        }
        other => panic!("{other:?}"),
    }
    assert!(!e.is_retryable());
    let msg = e.to_string();
    assert!(
        msg.contains("rem_access_err") && msg.contains("40"),
        "{msg}"
    );
    assert!(dp.is_stopped());
    // SAFETY: the fake channel touches no memory.
    let refused = unsafe { dp.submit(job(6, OpKind::Write, 1, 1)) };
    assert!(
        matches!(refused, Err(DataPathError::Stopped)),
        "{refused:?}"
    );
    assert_eq!(ch.resets.load(Relaxed), 0);
    let r = dp.close();
    assert_eq!(r.counters.windows_done, 0);
}

#[test]
fn reconnect_failures_back_off_then_give_up() {
    let ch = Arc::new(FakeChannel::new(64));
    ch.fail_at(10, WcStatus::RetryExceeded);
    let mut c = cfg(PollMode::Event);
    c.backoff.max_attempts = 3;
    let calls = Arc::new(AtomicU32::new(0));
    let n = calls.clone();
    let dp = start(
        c,
        &ch,
        Box::new(move || {
            n.fetch_add(1, Relaxed);
            Err(ReconnectError::retryable("peer unreachable"))
        }),
    );
    let mut ev = dp.take_events().unwrap();
    submit(&dp, job(1, OpKind::Write, 256, 4096));
    let e = wait_failed(&mut ev);
    assert_eq!(calls.load(Relaxed), 3);
    assert!(
        matches!(e, DataPathError::Reconnect { attempts: 3, .. }),
        "{e}"
    );
    assert!(e.is_retryable());
    dp.close();
}

/// A reconnect that cannot succeed (the tcp provider's) is not retried:
/// the data path gives up after the first attempt, whatever the backoff
/// allows, and says so.
#[test]
fn a_permanent_reconnect_error_gives_up_at_once() {
    let ch = Arc::new(FakeChannel::new(64));
    ch.fail_at(10, WcStatus::RetryExceeded);
    let mut c = cfg(PollMode::Event);
    c.backoff.max_attempts = 8;
    let calls = Arc::new(AtomicU32::new(0));
    let n = calls.clone();
    let dp = start(
        c,
        &ch,
        Box::new(move || {
            n.fetch_add(1, Relaxed);
            Err(ReconnectError::permanent(
                "this connection cannot be replaced",
            ))
        }),
    );
    let mut ev = dp.take_events().unwrap();
    submit(&dp, job(1, OpKind::Write, 256, 4096));
    let e = wait_failed(&mut ev);
    assert_eq!(calls.load(Relaxed), 1, "a permanent error is not retried");
    match &e {
        DataPathError::Reconnect {
            attempts: 1,
            source,
        } => assert!(source.is_permanent(), "{e}"),
        other => panic!("not a reconnect failure: {other}"),
    }
    assert!(e.to_string().contains("not retried"), "{e}");
    dp.close();
}

#[test]
fn hybrid_wakes_on_completions_and_drains() {
    let ch = Arc::new(FakeChannel::new(128));
    let dp = start(
        cfg(PollMode::Hybrid { empty_polls: 8 }),
        &ch,
        no_reconnect(),
    );
    let mut ev = dp.take_events().unwrap();
    submit(&dp, job(1, OpKind::Write, 2048, 4096));
    wait_done(&mut ev, &[1]);
    let r = dp.close();
    assert_eq!(r.counters.extents_confirmed, 2048);
    assert_eq!(r.counters.completions, 64);
}

#[test]
fn qp_in_error_before_the_first_post_is_flushed_and_reconnected() {
    let ch = Arc::new(FakeChannel::new(128));
    ch.set_error();
    let (reconnect, calls) = resetting(&ch);
    let dp = start(cfg(PollMode::Event), &ch, reconnect);
    let mut ev = dp.take_events().unwrap();
    submit(&dp, job(1, OpKind::Write, 300, 4096));
    wait_done(&mut ev, &[1]);
    let stats = dp.stats().clone();
    let r = dp.close();
    assert_eq!((r.counters.reconnects, calls.load(Relaxed)), (1, 1));
    assert_eq!(stats.counters().reposted, 128);
    assert_eq!(r.counters.extents_confirmed, 300);
}

#[test]
fn a_request_timeout_takes_the_error_path() {
    let ch = Arc::new(FakeChannel::new(64));
    // Completions are lost until the reconnect resets the fake.
    ch.swallow.store(true, Relaxed);
    let c = DataPathConfig {
        request_timeout: Duration::from_millis(100),
        ..cfg(PollMode::Event)
    };
    let (reconnect, calls) = resetting(&ch);
    let dp = start(c, &ch, reconnect);
    let mut ev = dp.take_events().unwrap();
    let t0 = Instant::now();
    submit(&dp, job(1, OpKind::Read, 200, 4096));
    wait_done(&mut ev, &[1]);
    assert!(t0.elapsed() >= Duration::from_millis(100));
    let stats = dp.stats().clone();
    let r = dp.close();
    assert_eq!(calls.load(Relaxed), 1);
    assert_eq!(stats.counters().timeouts, 64, "every request in flight");
    assert_eq!(r.counters.reconnects, 1);
    assert_eq!(r.counters.extents_confirmed, 200);
}

#[test]
fn a_post_failure_puts_the_unposted_back() {
    let ch = Arc::new(FakeChannel::new(128));
    *ch.refuse_after.lock().unwrap() = Some(3);
    let dp = start(cfg(PollMode::Event), &ch, no_reconnect());
    let mut ev = dp.take_events().unwrap();
    submit(&dp, job(1, OpKind::Write, 100, 4096));
    wait_done(&mut ev, &[1]);
    let r = dp.close();
    assert_eq!(r.counters.post_failures, 1);
    assert_eq!(r.counters.extents_confirmed, 100);
    assert_eq!(
        r.counters.posted, 100,
        "requests refused are not counted as posted"
    );
    assert_eq!(ch.posted.load(Relaxed), 100);
    assert_eq!(r.counters.reconnects, 0);
}

#[test]
fn many_windows_submitted_from_other_threads() {
    let ch = Arc::new(FakeChannel::new(128));
    let dp = Arc::new(start(cfg(PollMode::Poll), &ch, no_reconnect()));
    let mut ev = dp.take_events().unwrap();
    let ids: Vec<u64> = (0..1000).collect();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let dp = &dp;
            s.spawn(move || {
                for id in (t * 250)..(t + 1) * 250 {
                    let op = if id % 2 == 0 {
                        OpKind::Write
                    } else {
                        OpKind::Read
                    };
                    submit(dp, job(id, op, 1 + id % 7, 1 + id as u32 % 300));
                }
            });
        }
        wait_done(&mut ev, &ids);
    });
    let dp = Arc::into_inner(dp).unwrap();
    let r = dp.close();
    assert_eq!(r.counters.windows_done, 1000);
    let extents: u64 = ids.iter().map(|id| 1 + id % 7).sum();
    assert_eq!(r.counters.extents_confirmed, extents);
}

#[test]
fn bad_and_duplicate_windows_are_refused_at_submit() {
    let ch = Arc::new(FakeChannel::new(16));
    ch.swallow.store(true, Relaxed);
    let dp = start(cfg(PollMode::Event), &ch, no_reconnect());
    let mut bad = job(1, OpKind::Write, 2, 10);
    bad.extents[1].offset = 5;
    // SAFETY: the fake channel touches no memory.
    let e = unsafe { dp.submit(bad) }.unwrap_err();
    assert!(
        matches!(
            e,
            DataPathError::Window {
                id: 1,
                source: crate::engine::stream::WindowError::Overlap { index: 1 }
            }
        ),
        "{e}"
    );
    submit(&dp, job(2, OpKind::Write, 4, 10));
    // SAFETY: as above.
    let e = unsafe { dp.submit(job(2, OpKind::Read, 1, 1)) }.unwrap_err();
    assert!(e.to_string().contains("window 2"), "{e}");
    // An empty window is done at once, and its id is free again.
    let mut ev = dp.take_events().unwrap();
    let mut empty = job(3, OpKind::Read, 0, 1);
    empty.extents.clear();
    submit(&dp, empty.clone());
    wait_done(&mut ev, &[3]);
    submit(&dp, empty);
    wait_done(&mut ev, &[3]);
    dp.close();
}

#[test]
fn close_while_windows_are_outstanding_returns_promptly() {
    // Completions never come: close gives the requests in flight the flush
    // timeout, drops what is queued, and says what it left.
    let ch = Arc::new(FakeChannel::new(64));
    ch.swallow.store(true, Relaxed);
    let dp = start(cfg(PollMode::Poll), &ch, no_reconnect());
    for id in 0..50 {
        submit(&dp, job(id, OpKind::Write, 1000, 4096));
    }
    wait_until("the send queue is full", || ch.posted.load(Relaxed) == 64);
    // Returns although nothing completes (a close that waited for the
    // queue would never return).
    let r = within("close", move || dp.close());
    assert_eq!(r.outstanding_at_close, 64);
    assert_eq!(r.counters.windows_done, 0);
    assert_eq!(ch.posted.load(Relaxed), 64, "nothing queued was posted");

    // With completions flowing, queued windows are dropped at once.
    let ch = Arc::new(FakeChannel::new(64));
    let dp = start(cfg(PollMode::Event), &ch, no_reconnect());
    for id in 0..50 {
        submit(&dp, job(id, OpKind::Write, 10_000, 64));
    }
    let r = within("close", move || dp.close());
    assert!(
        r.counters.extents_confirmed < 500_000,
        "closing does not finish the queue"
    );
    assert_eq!(r.outstanding_at_close, 0);
}

#[test]
fn an_idle_poster_sleeps_even_in_poll_mode() {
    let ch = Arc::new(FakeChannel::new(64));
    let dp = start(cfg(PollMode::Poll), &ch, no_reconnect());
    let mut ev = dp.take_events().unwrap();
    submit(&dp, job(1, OpKind::Write, 64, 64));
    wait_done(&mut ev, &[1]);
    // Idle, the poster blocks on its input queue without a timeout: only
    // an input wakes it (a poster that spins or wakes on a timer never
    // parks so).
    wait_until("the idle poster parks", || dp.poster_parks().1);
    let (parks, _) = dp.poster_parks();
    // Nothing wakes it meanwhile (no empty batches, no timers): still the
    // same park. A slow machine only makes spurious wakes rarer.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(dp.poster_parks(), (parks, true), "the idle poster woke");
    // ... and the next window wakes it.
    submit(&dp, job(2, OpKind::Write, 1, 64));
    wait_done(&mut ev, &[2]);
    wait_until("the poster parks again", || {
        let (n, parked) = dp.poster_parks();
        parked && n > parks
    });
    dp.close();
}

#[test]
fn close_wakes_the_completion_thread_out_of_its_wait() {
    let ch = Arc::new(FakeChannel::new(64));
    let dp = start(cfg(PollMode::Event), &ch, no_reconnect());
    let mut ev = dp.take_events().unwrap();
    submit(&dp, job(1, OpKind::Write, 8, 64));
    wait_done(&mut ev, &[1]);
    // Idle in event mode: the completion thread sleeps in `wait`.
    let waits = ch.waits.load(Relaxed);
    wait_until("the completion thread waits", || {
        ch.waits.load(Relaxed) > waits
    });
    assert_eq!(
        ch.wakes.load(Relaxed),
        0,
        "nothing woke the channel before close"
    );
    let r = dp.close();
    assert_eq!(r.counters.bytes_confirmed, 8 * 64);
    // Closing woke it (a wait then ends at once, not after its slice).
    assert_eq!(
        ch.wakes.load(Relaxed),
        1,
        "close wakes each rail's channel once"
    );
}

#[test]
fn reconnect_waits_for_port_active_instead_of_sleeping() {
    let ch = Arc::new(FakeChannel::new(64));
    ch.fail_at(10, WcStatus::RetryExceeded);
    let mut c = cfg(PollMode::Event);
    // A blind backoff would sleep long after the first failure; the wait
    // for the port gives up no sooner than the cap (a hang guard here).
    c.backoff.initial = Duration::from_secs(600);
    c.backoff.cap = Duration::from_secs(600);
    // Down until the test brings it up, which it does only once the
    // reconnect is waiting for it.
    let port = FakePort::new(false);
    let calls = Arc::new(AtomicU32::new(0));
    let reconnect: ReconnectFn = {
        let (port, ch, calls) = (port.clone(), ch.clone(), calls.clone());
        Box::new(move || {
            calls.fetch_add(1, Relaxed);
            if !port.is_active() {
                return Err(ReconnectError::retryable("port down"));
            }
            ch.reset();
            Ok(())
        })
    };
    let dyn_ch: Arc<dyn Channel> = ch.clone();
    let monitor: Arc<dyn PortMonitor> = port.clone();
    let dp = DataPath::start(c, dyn_ch, reconnect, Some(monitor)).unwrap();
    let mut ev = dp.take_events().unwrap();
    submit(&dp, job(1, OpKind::Write, 256, 4096));
    let stats = dp.stats().clone();
    wait_until("the reconnect waits for the port", || {
        stats.port_waits.load(Relaxed) >= 1
    });
    assert_eq!(calls.load(Relaxed), 0, "no attempt while the port is down");
    port.set_active(true);
    wait_done(&mut ev, &[1]);
    let r = dp.close();
    assert_eq!(r.counters.reconnects, 1);
    assert_eq!(r.port_waits, 1, "{r:?}");
    assert_eq!(r.port_events, 1);
    assert_eq!(
        calls.load(Relaxed),
        1,
        "the first attempt waits for the port"
    );
    // Timed from the port coming back, not from the error.
    let up = port.active_since().expect("up");
    let up_to_wr = &r.port_up_to_first_wr_seconds;
    assert_eq!(up_to_wr.len(), 1, "{r:?}");
    assert!(up_to_wr[0] >= 0.0, "{up_to_wr:?}");
    assert!(
        r.reconnect_seconds[0] > up_to_wr[0],
        "the error path started before the port came back: {r:?}"
    );
    assert!(up.elapsed().as_secs_f64() >= up_to_wr[0]);
    assert_eq!(stats.port_waits.load(Relaxed), r.port_waits);
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
            let ch = Arc::new(FakeChannel::new(128));
            ch.record_cpus.store(true, Relaxed);
            let c = DataPathConfig {
                cq_cpu: Some(cq),
                batch: 4,
                signal_every: 4,
                ..cfg(mode)
            };
            let dp = start(c, &ch, no_reconnect());
            let mut ev = dp.take_events().unwrap();
            submit(&dp, job(1, OpKind::Write, 64, 64));
            wait_done(&mut ev, &[1]);
            dp.close();
            let seen = ch.post_cpus.lock().unwrap();
            assert_eq!(seen.len(), 16);
            for s in seen.iter() {
                assert_eq!(
                    !s.contains(&cq),
                    keeps_off,
                    "{mode}: poster on {s:?}, CQ on {cq}"
                );
            }
            assert_eq!(allowed_cpus(), before, "{mode}: the caller is left alone");
        }
    })
    .join()
    .unwrap();
}

/// Run an idle completion loop until `enough` says so (by its counters, not
/// by the clock).
fn run_loop_idle(
    mode: PollMode,
    enough: impl Fn(&DataPathStats) -> bool,
) -> (Arc<DataPathStats>, FakeChannel) {
    let ch = FakeChannel::new(16);
    let stats = Arc::new(DataPathStats::default());
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let h = s.spawn(|| completion_loop(&ch, mode, &stop, &stats, &mut |_, _| true));
        wait_until("the idle loop's counters", || enough(&stats));
        stop.store(true, Relaxed);
        h.join().unwrap().unwrap();
    });
    (stats, ch)
}

#[test]
fn hybrid_arms_and_waits_after_k_empty_polls() {
    let k = 100;
    let (s, ch) = run_loop_idle(PollMode::Hybrid { empty_polls: k }, |s| {
        s.arms.load(Relaxed) >= 3
    });
    let arms = ch.arms.load(Relaxed);
    assert!(arms >= 3, "hybrid never armed");
    assert_eq!(arms, s.arms.load(Relaxed));
    assert_eq!(ch.waits.load(Relaxed), s.waits.load(Relaxed));
    // Each sleep follows K empty polls plus the race-closing poll.
    let polls = s.empty_polls.load(Relaxed);
    assert!(
        polls >= arms * (u64::from(k) + 1),
        "{polls} polls, {arms} arms"
    );
    assert!(
        polls < (arms + 1) * (u64::from(k) + 1),
        "{polls} polls, {arms} arms"
    );
    // Idle: every arm is followed by a wait (a sleep, not a spin), and
    // nothing wakes it.
    assert_eq!(s.waits.load(Relaxed), arms);
    assert_eq!(s.wakeups.load(Relaxed), 0);

    let (s, ch) = run_loop_idle(PollMode::Event, |s| s.arms.load(Relaxed) >= 2);
    assert!(ch.arms.load(Relaxed) >= 2);
    assert_eq!(s.empty_polls.load(Relaxed), 2 * s.arms.load(Relaxed));
    assert_eq!(s.waits.load(Relaxed), s.arms.load(Relaxed));

    let (s, ch) = run_loop_idle(PollMode::Poll, |s| s.empty_polls.load(Relaxed) > 1000);
    assert_eq!(ch.arms.load(Relaxed), 0);
    assert_eq!(s.waits.load(Relaxed), 0, "poll mode never sleeps");
    assert!(s.empty_polls.load(Relaxed) > 1000);
}

/// With a rate limit the poster takes each chain's bytes from the bucket:
/// 1 MiB at 2 MiB/s is done no sooner than 0.5 s after the start, and the
/// poster sleeps while it waits for tokens (no spinning).
#[test]
fn a_rate_limited_data_path_posts_no_faster_than_its_rate() {
    let ch = Arc::new(FakeChannel::new(128));
    let rate = 2u64 << 20;
    let c = DataPathConfig {
        rate_limit: Some(RateLimit::new(rate)),
        ..cfg(PollMode::Event)
    };
    let t0 = Instant::now();
    let dp = start(c, &ch, no_reconnect());
    let mut ev = dp.take_events().unwrap();
    // 8 windows of 32 x 4 KiB: a chain of 128 KiB each.
    for id in 1..=8 {
        submit(&dp, job(id, OpKind::Write, 32, 4096));
    }
    wait_done(&mut ev, &[1]);
    let first = t0.elapsed();
    let before = dp.poster_waits();
    wait_done(&mut ev, &[2, 3, 4, 5, 6, 7, 8]);
    let all = t0.elapsed();
    let waits = dp.poster_waits() - before;
    let r = dp.close();
    assert_eq!(r.counters.bytes_confirmed, 1 << 20);
    // The bucket starts empty: 128 KiB takes 62.5 ms, 1 MiB 500 ms.
    assert!(
        first >= Duration::from_micros(62_500),
        "first window {first:?}"
    );
    assert!(all >= Duration::from_millis(500), "1 MiB in {all:?}");
    // While throttled the poster sleeps until the next chain's bytes are
    // earned: a few waits per chain (its timer, its completions), where a
    // spinning one would wait thousands of times.
    println!("{waits} waits for 7 chains");
    assert!(waits <= 7 * 8, "throttled poster waited {waits} times");
    assert_eq!(
        r.counters.doorbells, 8,
        "whole chains, each when its bytes are earned"
    );
}
