//! Data paths over two rails (two fake channels), one failing: the copy
//! goes on over the other, the failed rail comes back in the background,
//! a flapping rail is paused, events and per-rail figures say so.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedReceiver;

use super::fake::{recv_event, wait_until, within, FakeChannel, FakePort, HANG_GUARD};
use super::*;
use crate::engine::stream::ErrorCause;
use crate::engine::{Extent, OpKind, WcStatus, WindowJob};
use crate::provider::Channel;

const SLOT: u64 = 4096;

fn job(id: u64, n: u64) -> WindowJob {
    WindowJob {
        id,
        op: if id % 2 == 0 {
            OpKind::Write
        } else {
            OpKind::Read
        },
        local_addr: 0x1_0000_0000 + (id << 24),
        lkey: 7,
        remote_addr: 0x2_0000_0000 + (id << 24),
        rkey: 9,
        extents: (0..n)
            .map(|k| Extent {
                offset: k * SLOT,
                len: 4096,
            })
            .collect(),
    }
}

fn cfg() -> DataPathConfig {
    DataPathConfig {
        poll_mode: PollMode::Event,
        flush_timeout: Duration::from_millis(300),
        backoff: Backoff {
            initial: Duration::from_millis(1),
            ..Backoff::default()
        },
        ..DataPathConfig::default()
    }
}

fn submit(dp: &DataPath, w: WindowJob) {
    // SAFETY: the fake channels touch no memory.
    unsafe { dp.submit(w) }.unwrap();
}

/// A reconnect that resets the fake and counts its calls.
fn resetting(ch: &Arc<FakeChannel>, rail: usize) -> (RailReconnectFn, Arc<AtomicU32>) {
    let calls = Arc::new(AtomicU32::new(0));
    let (ch, n) = (ch.clone(), calls.clone());
    let f: RailReconnectFn = Box::new(move |r| {
        assert_eq!(r, rail, "each rail's callback is given its rail");
        n.fetch_add(1, Relaxed);
        ch.reset();
        Ok(())
    });
    (f, calls)
}

fn rail(ch: &Arc<FakeChannel>, reconnect: RailReconnectFn) -> RailSpec {
    let c: Arc<dyn Channel> = ch.clone();
    RailSpec::new(c, reconnect)
}

/// Events until every window in `ids` is done (each once); the others are
/// returned with the time they came.
fn wait_done(ev: &mut UnboundedReceiver<DpEvent>, ids: &[u64]) -> Vec<(Instant, DpEvent)> {
    let mut done: HashMap<u64, u32> = HashMap::new();
    let mut other = Vec::new();
    let deadline = Instant::now() + HANG_GUARD;
    while done.len() < ids.len() {
        assert!(
            Instant::now() < deadline,
            "windows not done: {}",
            done.len()
        );
        match recv_event(ev).expect("data path ended") {
            DpEvent::WindowDone { id } => {
                assert!(ids.contains(&id), "unknown window {id}");
                *done.entry(id).or_default() += 1;
                assert_eq!(done[&id], 1, "window {id} done twice");
            }
            DpEvent::Failed(e) => panic!("failed: {e}"),
            e => other.push((Instant::now(), e)),
        }
    }
    other
}

/// The next event that is not a `WindowDone`.
fn next_other(ev: &mut UnboundedReceiver<DpEvent>) -> DpEvent {
    loop {
        match recv_event(ev).expect("data path ended") {
            DpEvent::WindowDone { .. } => {}
            DpEvent::Failed(e) => panic!("failed: {e}"),
            e => return e,
        }
    }
}

fn names(evs: &[(Instant, DpEvent)]) -> Vec<String> {
    evs.iter()
        .map(|(_, e)| match e {
            DpEvent::RailDown { rail, .. } => format!("down {rail}"),
            DpEvent::RailFenced { rail, .. } => format!("fenced {rail}"),
            DpEvent::RailPaused { rail, for_ } => format!("paused {rail} {}ms", for_.as_millis()),
            DpEvent::RailUp { rail } => format!("up {rail}"),
            e => format!("{e:?}"),
        })
        .collect()
}

#[test]
fn two_rails_share_a_copy_and_report_each_rail() {
    let (a, b) = (
        Arc::new(FakeChannel::new(64)),
        Arc::new(FakeChannel::new(128)),
    );
    let dp = DataPath::start_rails(
        cfg(),
        vec![
            rail(&a, Box::new(|_| panic!("no reconnect"))),
            rail(&b, Box::new(|_| panic!("no reconnect"))),
        ],
    )
    .unwrap();
    assert_eq!(dp.rail_configs().len(), 2);
    assert_eq!(dp.rail_configs()[1].sq_depth, 128);
    let mut ev = dp.take_events().unwrap();
    let ids: Vec<u64> = (0..40).collect();
    for &id in &ids {
        submit(&dp, job(id, 256));
    }
    let other = wait_done(&mut ev, &ids);
    assert!(other.is_empty(), "{:?}", names(&other));
    let stats = dp.stats().clone();
    let r = dp.close();
    let n = 40 * 256;
    assert_eq!(r.counters.extents_confirmed, n);
    assert_eq!(r.rails.len(), 2);
    assert!(
        r.rails.iter().all(|x| x.counters.extents_confirmed > 0),
        "both rails carried blocks"
    );
    assert_eq!(
        r.rails
            .iter()
            .map(|x| x.counters.extents_confirmed)
            .sum::<u64>(),
        n
    );
    assert_eq!(
        r.rails
            .iter()
            .map(|x| x.counters.bytes_confirmed)
            .sum::<u64>(),
        r.counters.bytes_confirmed
    );
    assert_eq!(r.rails[0].counters.posted, a.posted.load(Relaxed));
    assert_eq!(r.rails[1].counters.posted, b.posted.load(Relaxed));
    assert!(a.max_outstanding.load(Relaxed) <= 64);
    assert!(b.max_outstanding.load(Relaxed) <= 128);
    // The live per-rail figures are the engine's, published; the totals
    // keep their meaning.
    assert_eq!(stats.rails.len(), 2);
    assert_eq!(stats.counters().extents_confirmed, n);
    for (i, s) in stats.rails.iter().enumerate() {
        assert_eq!(
            s.counters().extents_confirmed,
            r.rails[i].counters.extents_confirmed
        );
        assert_eq!(s.state_label(), "running");
    }
    assert_eq!(stats.sq_free.load(Relaxed), 64 + 128);
    assert_eq!(stats.rails[1].sq_free.load(Relaxed), 128);
}

#[test]
fn a_failing_rail_is_absorbed_while_it_reconnects_in_the_background() {
    let (a, b) = (
        Arc::new(FakeChannel::new(64)),
        Arc::new(FakeChannel::new(64)),
    );
    b.fail_at(300, WcStatus::RetryExceeded);
    // Rail 1's reconnect blocks until the test lets it go: the copy must
    // finish over rail 0 meanwhile.
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = Mutex::new(go_rx);
    let calls = Arc::new(AtomicU32::new(0));
    let reconnect: RailReconnectFn = {
        let (b, calls) = (b.clone(), calls.clone());
        Box::new(move |r| {
            assert_eq!(r, 1);
            calls.fetch_add(1, Relaxed);
            // Bounded: a test that fails before letting it go must not
            // hang in the data path's drop, which waits for this thread.
            let _ = go_rx.lock().unwrap().recv_timeout(HANG_GUARD);
            b.reset();
            Ok(())
        })
    };
    let dp = DataPath::start_rails(
        cfg(),
        vec![
            rail(&a, Box::new(|_| panic!("rail 0 never fails"))),
            rail(&b, reconnect),
        ],
    )
    .unwrap();
    let mut ev = dp.take_events().unwrap();
    // Windows until rail 1 has been given its failing request: how the
    // extents spread over the two rails depends on how fast each one's
    // completions come back (on a loaded machine rail 0 may take most of
    // the first windows), so the failure is reached by progress.
    let (mut ids, mut other) = (Vec::new(), Vec::new());
    while b.posted.load(Relaxed) <= 300 {
        let next = ids.len() as u64;
        assert!(next < 16 * 1000, "rail 1 was never given 301 requests");
        let batch: Vec<u64> = (next..next + 16).collect();
        for &id in &batch {
            submit(&dp, job(id, 512));
        }
        other.extend(wait_done(&mut ev, &batch));
        ids.extend(batch);
    }
    // The helper thread calls the reconnect on its own time: the windows
    // can all be done before it gets there.
    wait_until("rail 1 reconnecting", || calls.load(Relaxed) == 1);
    assert_eq!(names(&other), ["down 1", "fenced 1"]);
    match &other[0].1 {
        DpEvent::RailDown {
            rail: 1,
            epoch: 0,
            cause:
                ErrorCause::Completion {
                    status: WcStatus::RetryExceeded,
                    ..
                },
        } => {}
        e => panic!("{e:?}"),
    }
    let DpEvent::RailFenced { windows, .. } = &other[1].1 else {
        unreachable!()
    };
    assert!(!windows.is_empty() && windows.iter().all(|w| ids.contains(w)));
    go_tx.send(()).unwrap();
    assert!(matches!(next_other(&mut ev), DpEvent::RailUp { rail: 1 }));
    // It carries work again.
    let before = dp.stats().rails[1].counters().extents_confirmed;
    let from = ids.len() as u64;
    let more: Vec<u64> = (from..from + 8).collect();
    for &id in &more {
        submit(&dp, job(id, 256));
    }
    assert!(wait_done(&mut ev, &more).is_empty());
    let stats = dp.stats().clone();
    let r = dp.close();
    assert!(
        r.rails[1].counters.extents_confirmed > before,
        "rail 1 rejoined"
    );
    assert_eq!(
        r.counters.extents_confirmed,
        16 * 512 + 8 * 256,
        "every extent confirmed once"
    );
    assert_eq!(
        (r.rails[1].counters.fences, r.rails[1].counters.reconnects),
        (1, 1)
    );
    assert_eq!(r.rails[0].counters.fences, 0);
    assert_eq!(r.rails[1].counters.errors.get(WcStatus::RetryExceeded), 1);
    assert_eq!(r.rails[1].failover_seconds.len(), 1, "one failover");
    assert_eq!(r.rails[1].reconnect_seconds.len(), 1);
    assert_eq!(r.counters.reconnects, 1);
    assert!(stats.rails[1].counters().errors.total() >= 1);
    assert_eq!(stats.rails[1].counters().fences, 1);
}

#[test]
fn a_port_going_down_fails_the_rail_and_its_fence_releases_the_windows() {
    let (a, b) = (
        Arc::new(FakeChannel::new(64)),
        Arc::new(FakeChannel::new(64)),
    );
    // Rail 1's link is dead: nothing it posts ever completes (rxe retries
    // forever, no error surfaces); its port says so when the test brings it
    // down, once rail 1 carries requests, and comes back when the test
    // brings it up, once the rail's reconnect waits for it.
    b.swallow.store(true, Relaxed);
    let port = FakePort::new(true);
    let (reconnect, calls) = resetting(&b, 1);
    let fences = Arc::new(AtomicU32::new(0));
    let fence: FenceFn = {
        let (b, fences) = (b.clone(), fences.clone());
        Box::new(move |r| {
            assert_eq!(r, 1);
            fences.fetch_add(1, Relaxed);
            // Like a QP reset: its requests are gone.
            b.reset();
            b.swallow.store(true, Relaxed);
            Ok(())
        })
    };
    // The request timeout never fires here: only the port says the rail
    // is gone.
    let c = DataPathConfig {
        request_timeout: Duration::from_secs(3600),
        ..cfg()
    };
    let monitor: Arc<dyn PortMonitor> = port.clone();
    let dp = DataPath::start_rails(
        c,
        vec![
            rail(&a, Box::new(|_| panic!("rail 0 never fails"))),
            rail(&b, reconnect).with_monitor(monitor).with_fence(fence),
        ],
    )
    .unwrap();
    let mut ev = dp.take_events().unwrap();
    let ids: Vec<u64> = (0..8).collect();
    for &id in &ids {
        submit(&dp, job(id, 256));
    }
    let stats = dp.stats().clone();
    wait_until("rail 1 carries requests", || b.posted.load(Relaxed) > 0);
    assert_eq!(stats.rails[1].counters().extents_confirmed, 0);
    port.set_active(false);
    // Held by rail 1 until its port went down, then done over rail 0.
    let other = wait_done(&mut ev, &ids);
    assert_eq!(names(&other), ["down 1", "fenced 1"]);
    assert!(matches!(
        other[0].1,
        DpEvent::RailDown {
            rail: 1,
            cause: ErrorCause::ConnectionLost,
            ..
        }
    ));
    assert_eq!(fences.load(Relaxed), 1);
    // The rail comes back once its port does, and not before.
    wait_until("rail 1's reconnect waits for its port", || {
        stats.rails[1].port_waits.load(Relaxed) >= 1
    });
    assert_eq!(calls.load(Relaxed), 0, "no attempt while the port is down");
    port.set_active(true);
    assert!(matches!(next_other(&mut ev), DpEvent::RailUp { rail: 1 }));
    assert_eq!(
        calls.load(Relaxed),
        1,
        "the first attempt waited for the port"
    );
    let r = dp.close();
    assert_eq!(r.counters.extents_confirmed, 8 * 256);
    assert_eq!(r.rails[1].port_waits, 1, "{r:?}");
    assert_eq!(r.rails[1].counters.fences, 1);
    assert!(r.rails[1].counters.requeued > 0);
    assert_eq!(r.outstanding_at_close, 0);
}

#[test]
fn a_flapping_rail_is_paused_with_growing_cooldowns() {
    let (a, b) = (
        Arc::new(FakeChannel::new(32)),
        Arc::new(FakeChannel::new(32)),
    );
    b.fail_after(100, WcStatus::RetryExceeded);
    // Each reconnect arms the next failure, twice.
    let rearm = Arc::new(AtomicU32::new(2));
    // When each reconnect was called, read on the helper's own clock: the
    // test thread may see the events late.
    let called = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let reconnect: RailReconnectFn = {
        let (b, rearm, called) = (b.clone(), rearm.clone(), called.clone());
        Box::new(move |_| {
            called.lock().unwrap().push(Instant::now());
            b.reset();
            if rearm.load(Relaxed) > 0 {
                rearm.fetch_sub(1, Relaxed);
                b.fail_after(100, WcStatus::RetryExceeded);
            }
            Ok(())
        })
    };
    let c = DataPathConfig {
        rail_pause: RailPause {
            flap_window: Duration::from_secs(10),
            initial: Duration::from_millis(100),
            cap: Duration::from_millis(400),
        },
        ..cfg()
    };
    let dp = DataPath::start_rails(
        c,
        vec![
            rail(&a, Box::new(|_| panic!("rail 0 never fails"))),
            rail(&b, reconnect),
        ],
    )
    .unwrap();
    let mut ev = dp.take_events().unwrap();
    // Keep work flowing until rail 1 has come back three times.
    let mut next = 0u64;
    let mut live = 0;
    for _ in 0..8 {
        submit(&dp, job(next, 128));
        next += 1;
        live += 1;
    }
    let mut seen: Vec<(Instant, DpEvent)> = Vec::new();
    let deadline = Instant::now() + HANG_GUARD;
    let ups = |s: &[(Instant, DpEvent)]| {
        s.iter()
            .filter(|e| matches!(e.1, DpEvent::RailUp { .. }))
            .count()
    };
    while live > 0 {
        assert!(Instant::now() < deadline, "{:?}", names(&seen));
        match recv_event(&mut ev).expect("data path ended") {
            DpEvent::WindowDone { .. } => {
                live -= 1;
                if ups(&seen) < 3 {
                    submit(&dp, job(next, 128));
                    next += 1;
                    live += 1;
                }
            }
            DpEvent::Failed(e) => panic!("{e}"),
            e => seen.push((Instant::now(), e)),
        }
    }
    assert_eq!(
        names(&seen),
        [
            "down 1",
            "fenced 1",
            "up 1",
            "down 1",
            "fenced 1",
            "paused 1 100ms",
            "up 1",
            "down 1",
            "fenced 1",
            "paused 1 200ms",
            "up 1",
        ]
    );
    // Each paused rail was reconnected no sooner than its cool-down after
    // the reconnect before it (the failure, then the pause, came between).
    let called = called.lock().unwrap().clone();
    assert_eq!(called.len(), 3, "three reconnects");
    for (k, p) in [(1, 5), (2, 9)] {
        let DpEvent::RailPaused { for_, .. } = seen[p].1 else {
            unreachable!()
        };
        let waited = called[k] - called[k - 1];
        assert!(waited >= for_, "{waited:?} < {for_:?}");
    }
    let stats = dp.stats().clone();
    let r = dp.close();
    assert_eq!(
        r.counters.extents_confirmed,
        next * 128,
        "every extent confirmed once"
    );
    assert_eq!(
        (r.rails[1].counters.failures, r.rails[1].counters.pauses),
        (3, 2)
    );
    assert_eq!(stats.rails[1].counters().pauses, 2);
    assert_eq!(stats.rails[0].state_label(), "running");
}

#[test]
fn all_rails_down_then_up() {
    let (a, b) = (
        Arc::new(FakeChannel::new(64)),
        Arc::new(FakeChannel::new(64)),
    );
    a.fail_at(200, WcStatus::RetryExceeded);
    b.fail_at(200, WcStatus::RetryExceeded);
    // Neither reconnect finishes before both rails are down.
    let both_down = Arc::new(std::sync::Barrier::new(2));
    let calls = Arc::new(AtomicU32::new(0));
    let waiting = |ch: &Arc<FakeChannel>| -> RailReconnectFn {
        let (ch, both_down, calls) = (ch.clone(), both_down.clone(), calls.clone());
        Box::new(move |_| {
            calls.fetch_add(1, Relaxed);
            both_down.wait();
            ch.reset();
            Ok(())
        })
    };
    let (ra, rb) = (waiting(&a), waiting(&b));
    let dp = DataPath::start_rails(cfg(), vec![rail(&a, ra), rail(&b, rb)]).unwrap();
    let mut ev = dp.take_events().unwrap();
    let ids: Vec<u64> = (0..8).collect();
    for &id in &ids {
        submit(&dp, job(id, 256));
    }
    let other = wait_done(&mut ev, &ids);
    let mut got = names(&other);
    got.sort();
    assert_eq!(
        got[..4],
        ["down 0", "down 1", "fenced 0", "fenced 1"],
        "{:?}",
        names(&other)
    );
    // Both come back (the second rejoin may still be on its way).
    let mut ups = got.iter().filter(|n| n.starts_with("up")).count();
    while ups < 2 {
        assert!(matches!(next_other(&mut ev), DpEvent::RailUp { .. }));
        ups += 1;
    }
    assert_eq!(calls.load(Relaxed), 2);
    let r = dp.close();
    assert_eq!(r.counters.extents_confirmed, 8 * 256);
    assert_eq!(r.counters.reconnects, 2);
    assert!(r.rails.iter().all(|x| x.counters.fences == 1));
}

#[test]
fn a_rail_that_cannot_reconnect_is_paused_while_the_other_carries_the_copy() {
    let (a, b) = (
        Arc::new(FakeChannel::new(64)),
        Arc::new(FakeChannel::new(64)),
    );
    b.fail_at(50, WcStatus::RetryExceeded);
    let calls = Arc::new(AtomicU32::new(0));
    let reconnect: RailReconnectFn = {
        let calls = calls.clone();
        Box::new(move |_| {
            calls.fetch_add(1, Relaxed);
            Err(ReconnectError::retryable("peer's port unreachable"))
        })
    };
    let mut c = cfg();
    c.backoff.max_attempts = 2;
    // A cool-down no test waits out.
    c.rail_pause.initial = Duration::from_secs(3600);
    let dp = DataPath::start_rails(
        c,
        vec![
            rail(&a, Box::new(|_| panic!("rail 0 never fails"))),
            rail(&b, reconnect),
        ],
    )
    .unwrap();
    let mut ev = dp.take_events().unwrap();
    let ids: Vec<u64> = (0..8).collect();
    for &id in &ids {
        submit(&dp, job(id, 256));
    }
    let mut other = wait_done(&mut ev, &ids);
    if other.len() < 3 {
        other.push((Instant::now(), next_other(&mut ev)));
    }
    assert_eq!(names(&other), ["down 1", "fenced 1", "paused 1 3600000ms"]);
    assert_eq!(calls.load(Relaxed), 2, "max_attempts, then a pause");
    // Closing does not wait out the hour's cool-down.
    let r = within("close", move || dp.close());
    assert_eq!(r.counters.extents_confirmed, 8 * 256);
    assert_eq!(r.rails[1].counters.reconnect_failures, 1);
    assert!(
        !r.rails[1].reconnect_seconds.iter().any(|_| true),
        "never rejoined"
    );
}
