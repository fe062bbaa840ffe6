use super::*;
use crate::control::protocol::negotiate::{
    keepalive_for, DEFAULT_MAX_RETRIES, MAX_RETRIES, MAX_TIMEOUT_NS, MAX_WINDOWS, MIN_BLOCK_SIZE,
    MIN_KEEPALIVE_NS, MIN_TIMEOUT_NS,
};
use crate::control::protocol::rail_watch::every_rail_failed;
use crate::control::rails::MAX_QPS_PER_RAIL;
use crate::files::Check;
use crate::provider::ProviderKind;

const S: u64 = 1_000_000_000;

fn terms() -> Terms {
    Terms {
        runs: ProviderKind::Tcp,
        serves: vec![ProviderKind::Tcp],
        checks: vec![Check::Sha256, Check::Xxh3],
        window_size: 4 << 20,
        max_windows: 8,
        max_open_files: 256,
        timeout_ns: 60 * S,
    }
}

fn hello() -> proto::HandshakeRequest {
    proto::HandshakeRequest {
        version_major: crate::control::VERSION_MAJOR,
        version_minor: crate::control::VERSION_MINOR,
        providers: vec![proto::Provider::Tcp as i32],
        block_size: 1 << 20,
        checks: vec![proto::Check::Sha256 as i32],
        window_count: 8,
        timeout_ms: 60_000,
        ..Default::default()
    }
}

fn staging() -> Staging {
    Staging {
        slot_size: 4 << 20,
        transfers: 64,
        timeout_ns: 60 * S,
    }
}

#[test]
fn a_one_ms_timeout_is_clamped_and_keepalives_stay_under_four_a_second() {
    // The client: a 1 ms timeout made rcpd send ~700 keepalives a
    // second on an idle stream.
    let a = negotiate(
        &proto::HandshakeRequest {
            timeout_ms: 1,
            ..hello()
        },
        &terms(),
    )
    .unwrap();
    assert_eq!(a.client_timeout_ns, MIN_TIMEOUT_NS);
    assert!(a.params.keepalive_ns >= MIN_KEEPALIVE_NS, "{a:?}");
    // Idle for 10 s (simulated), the client's keepalives coming every
    // 300 ms: rcpd's keepalives, counted.
    let mut s = ServerCore::new(a.params, 0);
    let (mut now, mut next_client, mut sent) = (0u64, 0u64, 0u32);
    while now < 10 * S {
        if now >= next_client {
            s.handle_frame(now, ClientFrame::default());
            next_client = now + 300_000_000;
        }
        s.handle_timeout(now);
        while s.poll_frame(now).is_some() {
            sent += 1;
        }
        let t = s.poll_timeout().expect("a timer while running");
        now = t.min(next_client).max(now + 1);
    }
    assert!(!s.is_ended(), "a live idle client is kept");
    assert!(sent >= 10, "keepalives still go out: {sent}");
    assert!(sent <= 40, "{sent} keepalives in 10 s");
    // And a server claiming 1 ms gets the same floor from the client.
    let mut resp = negotiate(&hello(), &terms()).unwrap().response();
    resp.timeout_ms = 1;
    let p = check_grant(&hello(), &resp, &staging()).unwrap();
    assert!(p.keepalive_ns >= MIN_KEEPALIVE_NS, "{p:?}");
}

#[test]
fn out_of_range_parameters_are_clamped_or_refused() {
    let t = terms();
    let ok = |req: proto::HandshakeRequest| negotiate(&req, &t).expect("agreed");
    let refused = |req: proto::HandshakeRequest| negotiate(&req, &t).expect_err("refused");
    // Block sizes: refused outside 4096 ..= the window, 0 is the default.
    for bs in [5000, 2048, 1, 8 << 20, u64::MAX] {
        let r = refused(proto::HandshakeRequest {
            block_size: bs,
            ..hello()
        });
        assert_eq!(r.reason, Reason::Invalid);
        assert_eq!(
            r.message,
            format!("block size {bs} must be a power of two between 4096 and 4194304")
        );
    }
    let bs = |b| {
        ok(proto::HandshakeRequest {
            block_size: b,
            ..hello()
        })
        .params
        .block_size
    };
    assert_eq!(bs(0), crate::control::DEFAULT_BLOCK_SIZE);
    assert_eq!(bs(4096), 4096);
    assert_eq!(bs(4 << 20), 4 << 20);
    // Windows: 1 ..= rcpd's windows per session.
    let wc = |n| {
        ok(proto::HandshakeRequest {
            window_count: n,
            ..hello()
        })
        .params
        .window_count
    };
    assert_eq!(
        (wc(0), wc(1), wc(3), wc(8), wc(9), wc(u32::MAX)),
        (1, 1, 3, 8, 8, 8)
    );
    let big = Terms {
        max_windows: 1000,
        ..terms()
    };
    let a = negotiate(
        &proto::HandshakeRequest {
            window_count: u32::MAX,
            ..hello()
        },
        &big,
    )
    .unwrap();
    assert_eq!(a.params.window_count, MAX_WINDOWS);
    // Timeouts: 0 is "did not say", the rest 1 s ..= 24 h.
    let to = |ms| {
        ok(proto::HandshakeRequest {
            timeout_ms: ms,
            ..hello()
        })
    };
    assert_eq!(to(0).client_timeout_ns, 0);
    assert_eq!(to(0).params.keepalive_ns, 20 * S, "a third of rcpd's own");
    assert_eq!(to(1).client_timeout_ns, MIN_TIMEOUT_NS);
    assert_eq!(to(999).client_timeout_ns, MIN_TIMEOUT_NS);
    assert_eq!(to(3000).client_timeout_ns, 3 * S);
    assert_eq!(to(3000).params.keepalive_ns, S);
    assert_eq!(to(u32::MAX).client_timeout_ns, MAX_TIMEOUT_NS);
    assert_eq!(to(u32::MAX).params.keepalive_ns, 20 * S);
    // rcpd's own timeout is its own.
    assert_eq!(to(1).params.timeout_ns, 60 * S);
    // QPs per rail: 1 ..= 16.
    let qps = |n| {
        ok(proto::HandshakeRequest {
            qps_per_rail: n,
            ..hello()
        })
        .qps_per_rail
    };
    assert_eq!((qps(0), qps(4), qps(u32::MAX)), (1, 4, MAX_QPS_PER_RAIL));
    // The retry bound is rcpd's, once.
    assert_eq!(ok(hello()).params.max_retries, DEFAULT_MAX_RETRIES);
    assert_eq!(ok(hello()).response().max_retries, DEFAULT_MAX_RETRIES);
    // Versions, providers, checks.
    let r = refused(proto::HandshakeRequest {
        version_major: 3,
        ..hello()
    });
    assert_eq!(r.reason, Reason::Version);
    let theirs = format!(
        "protocol 3.{} is not supported",
        crate::control::VERSION_MINOR
    );
    assert!(r.message.contains(&theirs), "{r}");
    let r = refused(proto::HandshakeRequest {
        providers: vec![proto::Provider::Verbs as i32, 77],
        ..hello()
    });
    assert_eq!(r.reason, Reason::Invalid);
    assert!(
        r.message.contains("runs the tcp provider")
            && r.message.contains("[\"PROVIDER_VERBS\", \"?\"]"),
        "{r}"
    );
    let r = refused(proto::HandshakeRequest {
        checks: vec![proto::Check::Unspecified as i32],
        ..hello()
    });
    assert!(r.message.contains("offered no check"), "{r}");
    let r = refused(proto::HandshakeRequest {
        checks: vec![proto::Check::None as i32],
        ..hello()
    });
    assert!(
        r.message.contains("accepts only the checks sha256, xxh3"),
        "{r}"
    );
    // A client of 2.0 offers no check: SHA-256.
    let a = ok(proto::HandshakeRequest {
        checks: vec![],
        ..hello()
    });
    assert_eq!(a.params.check, Check::Sha256);
    // The client's preference, first one served.
    let a = ok(proto::HandshakeRequest {
        checks: vec![proto::Check::None as i32, proto::Check::Xxh3 as i32],
        ..hello()
    });
    assert_eq!(a.params.check, Check::Xxh3);
}

#[test]
fn the_client_refuses_a_grant_it_did_not_ask_for() {
    let req = hello();
    let good = negotiate(&req, &terms()).unwrap().response();
    let p = check_grant(&req, &good, &staging()).unwrap();
    assert_eq!(
        (p.block_size, p.window_count, p.check, p.max_retries),
        (1 << 20, 8, Check::Sha256, DEFAULT_MAX_RETRIES)
    );
    assert_eq!(p.max_open_files, 64, "the client's own, within rcpd's");
    assert_eq!(p.timeout_ns, 60 * S, "its own timeout");
    type Bend = fn(&mut proto::HandshakeResponse);
    let bent: [(Bend, &str); 8] = [
        (
            |r| r.block_size = 4096,
            "block size 4096 instead of 1048576",
        ),
        (|r| r.check = proto::Check::Xxh3 as i32, "chose check 2"),
        (|r| r.check = 99, "chose check 99"),
        (|r| r.window_count = 0, "do not fit"),
        (|r| r.window_count = 9, "do not fit"),
        (|r| r.window_size = 8 << 20, "do not fit"),
        (|r| r.window_size = 4096, "do not fit"),
        (
            |r| r.max_retries = MAX_RETRIES + 1,
            "up to 17 resends of a damaged block",
        ),
    ];
    for (bend, what) in bent {
        let mut r = good.clone();
        bend(&mut r);
        let f = check_grant(&req, &r, &staging()).expect_err(what);
        assert_eq!(f.reason, Reason::Protocol, "{what}: {f:?}");
        assert!(
            f.message
                .starts_with("the server broke the protocol: HandshakeResponse: "),
            "{f:?}"
        );
        assert!(f.message.contains(what), "{what}: {f:?}");
    }
    // An rcpd of 2.1 sends no retry bound: it meant the default.
    let old = proto::HandshakeResponse {
        max_retries: 0,
        version_minor: 1,
        ..good.clone()
    };
    assert_eq!(
        check_grant(&req, &old, &staging()).unwrap().max_retries,
        DEFAULT_MAX_RETRIES
    );
    let five = proto::HandshakeResponse {
        max_retries: 5,
        ..good.clone()
    };
    assert_eq!(check_grant(&req, &five, &staging()).unwrap().max_retries, 5);
    let other = proto::HandshakeResponse {
        version_major: 3,
        ..good
    };
    let f = check_grant(&req, &other, &staging()).unwrap_err();
    assert_eq!(f.reason, Reason::Version, "{f:?}");
}

/// Both ends' parameters for `req` against `t`, as the handshake gives them.
fn agree(req: &proto::HandshakeRequest, t: &Terms, st: &Staging) -> (Params, Params) {
    let a = negotiate(req, t).expect("agreed");
    let c = check_grant(req, &a.response(), st).expect("accepted");
    (a.params, c)
}

#[test]
fn negotiated_sessions_complete_both_ways() {
    let t = Terms {
        window_size: 16384,
        max_windows: 2,
        ..terms()
    };
    let req = proto::HandshakeRequest {
        block_size: 4096,
        window_count: 4,
        timeout_ms: 10_000,
        ..hello()
    };
    let st = Staging {
        slot_size: 16384,
        transfers: 4,
        timeout_ns: 10 * S,
    };
    let (sp, cp) = agree(&req, &t, &st);
    assert_eq!(sp.window_count, 2);
    assert_eq!((sp.keepalive_ns, cp.keepalive_ns), (10 * S / 3, 10 * S / 3));
    for dir in [Direction::Push, Direction::Pull] {
        let files = [0, 1, 4095, 4096, 4097, 20000, 100, 65536];
        let mut s = Sim::pair(sp, cp, dir, &files, Faults::default(), 11);
        s.run(STEPS);
        s.check_complete();
    }
}

#[test]
fn the_retry_bound_travels_on_the_wire() {
    // rcpd grants a damaged block again as often as it said, and the
    // client, told so in the answer, follows it to the end: an integrity
    // failure naming the count, never a violation.
    let t = Terms {
        window_size: 16384,
        ..terms()
    };
    let req = proto::HandshakeRequest {
        block_size: 4096,
        ..hello()
    };
    for bound in [1, DEFAULT_MAX_RETRIES, 5] {
        let mut a = negotiate(&req, &t).unwrap();
        a.params.max_retries = bound;
        let cp = check_grant(&req, &a.response(), &staging()).unwrap();
        assert_eq!(cp.max_retries, bound);
        let faults = Faults {
            damage: 1.0,
            ..Faults::default()
        };
        let mut s = Sim::pair(a.params, cp, Direction::Push, &[5000], faults, 12);
        s.run(STEPS);
        s.check();
        let e = s.seen.client_end.clone().unwrap().unwrap_err();
        assert_eq!(e.reason, Reason::Integrity, "{e:?}");
        assert!(
            e.message.contains(&format!("after {bound} resends")),
            "{e:?}"
        );
    }
    // A client that took a smaller bound than rcpd's (the two constants of
    // before) calls the extra grant a violation: why the bound is sent.
    let a = negotiate(&req, &t).unwrap();
    let mut cp = check_grant(&req, &a.response(), &staging()).unwrap();
    cp.max_retries = 1;
    let faults = Faults {
        damage: 1.0,
        ..Faults::default()
    };
    let mut s = Sim::pair(a.params, cp, Direction::Push, &[5000], faults, 12);
    s.run(STEPS);
    let e = s.seen.client_end.clone().unwrap().unwrap_err();
    assert_eq!(e.reason, Reason::Protocol, "{e:?}");
    assert!(e.message.contains("granted 2 times"), "{e:?}");
}

/// A client core with pull file 1 (one 4 KiB block) open and its window
/// granted: the Fetch is out (the window waits on the data path).
fn client_fetching(p: Params, rail_rkeys: Vec<u32>) -> ClientCore {
    let mut c = ClientCore::new(p, 1, 0);
    let f = c.add_file(FileSpec {
        direction: Direction::Pull,
        remote: "x".into(),
        ..FileSpec::default()
    });
    c.finish();
    assert!(c.poll_frame(0).is_some(), "OpenFile");
    c.handle_frame(
        0,
        ServerFrame {
            opened: vec![proto::Opened {
                file: f,
                length: 4096,
                path: "x".into(),
                ..Default::default()
            }],
            ..Default::default()
        },
    );
    match c.poll_action() {
        Some(ClientAction::CreateDest { file, .. }) => c.dest_ready(0, file, Ok(())),
        other => panic!("{other:?}"),
    }
    c.handle_frame(
        0,
        ServerFrame {
            grants: vec![proto::Grant {
                window: 1,
                rkey: 5,
                len: 4096,
                extents: vec![proto::Extent {
                    file: f,
                    block: 0,
                    offset: 0,
                    len: 4096,
                }],
                digests: vec![vec![0; 32]],
                rail_rkeys,
                ..Default::default()
            }],
            ..Default::default()
        },
    );
    c
}

#[test]
fn a_grant_without_a_key_per_rail_is_a_violation() {
    let p = Params {
        rails: 2,
        ..params()
    };
    for (keys, ok) in [
        (vec![5, 9], true),
        (vec![5], false),
        (vec![], false),
        (vec![9, 5], false),
        (vec![5, 9, 11], false),
    ] {
        let mut c = client_fetching(p, keys.clone());
        match c.poll_action() {
            Some(ClientAction::Fetch { grant }) if ok => assert_eq!(grant.rail_rkeys, keys),
            Some(ClientAction::End(Err(f))) if !ok => {
                assert_eq!(f.reason, Reason::Protocol, "{keys:?}: {f:?}");
                assert!(
                    f.message.contains(&format!(
                        "Grant: window 1: a grant with {} rail rkeys on a session of 2 rails",
                        keys.len()
                    )),
                    "{f:?}"
                );
            }
            other => panic!("{keys:?}: {other:?}"),
        }
    }
    // One rail: the grant's rkey is all there is.
    let mut c = client_fetching(params(), vec![]);
    assert!(matches!(c.poll_action(), Some(ClientAction::Fetch { .. })));
}

#[test]
fn the_rails_watch_falls_back_only_when_every_rail_failed_and_nothing_moved() {
    let after = 5 * S;
    let fetching = || {
        let mut c = client_fetching(params(), vec![]);
        assert!(matches!(c.poll_action(), Some(ClientAction::Fetch { .. })));
        c.watch_rails(0, after);
        c
    };
    // Rails down since the start, nothing confirmed: at the limit, not
    // before; the core's timer says when.
    let mut c = fetching();
    assert!(c.poll_timeout().unwrap() <= after);
    c.data_path(after - 1, 0, &[1, 1]);
    assert!(c.fallback().is_none());
    c.data_path(after, 0, &[1, 1]);
    let why = c.fallback().expect("fell back").to_string();
    assert!(
        why.contains("every RDMA rail has been down for 5 s (transport auto)"),
        "{why}"
    );
    match c.poll_action() {
        Some(ClientAction::End(Err(f))) => {
            assert_eq!(f.reason, Reason::Retryable);
            assert_eq!(f.message, why);
        }
        other => panic!("{other:?}"),
    }
    let abort = c.poll_frame(after).expect("the Abort goes out");
    assert_eq!(abort.abort.unwrap().reason, why);
    // One rail still good: no fallback; a look every second after that.
    let mut c = fetching();
    c.data_path(after, 0, &[1, 0]);
    assert!(c.fallback().is_none());
    assert!(c.poll_timeout().unwrap() <= after + S);
    c.data_path(after + S, 0, &[2, 1]);
    assert!(c.fallback().is_some(), "the second rail failed too");
    // Bytes confirmed restart the clock and the count.
    let mut c = fetching();
    c.data_path(3 * S, 100, &[1, 1]);
    c.data_path(after + S, 100, &[1, 1]);
    assert!(c.fallback().is_none(), "5 s not passed since the last byte");
    c.data_path(3 * S + after - 1, 100, &[2, 2]);
    assert!(c.fallback().is_none(), "not {after} ns since the last byte");
    c.data_path(3 * S + after, 100, &[2, 2]);
    assert!(c.fallback().is_some());
    // Nothing waiting on the data path: never.
    let mut c = ClientCore::new(params(), 1, 0);
    c.watch_rails(0, after);
    c.data_path(100 * S, 0, &[9]);
    assert!(c.fallback().is_none());
    // Not watched (not --transport auto): never.
    let mut c = client_fetching(params(), vec![]);
    c.poll_action();
    c.data_path(100 * S, 0, &[9]);
    assert!(c.fallback().is_none());
    // A retryable data-path failure of a watched stream is a fallback; of
    // another kind, or unwatched, not.
    for (watched, reason, falls) in [
        (true, Reason::Retryable, true),
        (true, Reason::Permission, false),
        (false, Reason::Retryable, false),
    ] {
        let mut c = client_fetching(params(), vec![]);
        c.poll_action();
        if watched {
            c.watch_rails(0, after);
        }
        c.data_path_failed(Failure::new(reason, "the link went away"));
        assert_eq!(c.fallback().is_some(), falls, "{watched} {reason:?}");
        if falls {
            assert!(
                c.fallback()
                    .unwrap()
                    .contains("the RDMA data path gave up (the link went away)"),
                "{:?}",
                c.fallback()
            );
        }
        match c.poll_action() {
            Some(ClientAction::End(Err(f))) => assert_eq!(f.reason, reason),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn every_rail_failed_counts_each_rail_since_the_last_progress() {
    assert!(every_rail_failed(&[0, 0], &[1, 2]));
    assert!(every_rail_failed(&[], &[1, 1]));
    // One rail still good: no fallback.
    assert!(!every_rail_failed(&[1, 0], &[1, 3]));
    assert!(!every_rail_failed(&[0, 0], &[0, 0]));
    // No data path, no rails: nothing to judge.
    assert!(!every_rail_failed(&[], &[]));
}

fn block_sizes() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        (12u32..24).prop_map(|s| 1u64 << s),
        any::<u64>(),
        0u64..70_000,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

    /// Whatever a client proposes, rcpd's answer is within every floor and
    /// ceiling, refuses only what cannot be served, and is what a client
    /// accepts.
    #[test]
    fn negotiation_keeps_every_parameter_within_its_bounds(
        block_size in block_sizes(),
        window_count in any::<u32>(),
        timeout_ms in prop_oneof![Just(0u32), 0u32..5000, any::<u32>()],
        qps in any::<u32>(),
        checks in proptest::collection::vec(0i32..5, 0..4),
        ws_shift in 14u32..23,
        max_windows in 1u32..200,
        own_timeout_s in 1u64..600,
        max_open in 1u32..70_000,
        transfers in 1u32..5000,
    ) {
        let t = Terms {
            window_size: 1 << ws_shift,
            max_windows,
            timeout_ns: own_timeout_s * S,
            max_open_files: max_open,
            ..terms()
        };
        let req = proto::HandshakeRequest {
            block_size,
            window_count,
            timeout_ms,
            qps_per_rail: qps,
            checks: checks.clone(),
            ..hello()
        };
        let bs_ok = check_block_size(block_size, t.window_size).is_ok();
        let wanted: Vec<Check> = if checks.is_empty() {
            vec![Check::Sha256]
        } else {
            checks.iter().filter_map(|&c| check_from_wire(c)).collect()
        };
        let check_ok = wanted.iter().any(|c| t.checks.contains(c));
        match negotiate(&req, &t) {
            Err(r) => {
                prop_assert_eq!(r.reason, Reason::Invalid);
                prop_assert!(!(bs_ok && check_ok), "refused {:?}: {}", req, r);
            }
            Ok(a) => {
                prop_assert!(bs_ok && check_ok);
                let p = a.params;
                prop_assert!(p.block_size.is_power_of_two());
                prop_assert!((MIN_BLOCK_SIZE..=t.window_size).contains(&p.block_size));
                prop_assert!(block_size == 0 || p.block_size == block_size);
                prop_assert!(p.window_count >= 1);
                prop_assert!(p.window_count <= max_windows.min(MAX_WINDOWS));
                prop_assert!(p.window_count <= window_count.max(1));
                prop_assert!(p.keepalive_ns >= MIN_KEEPALIVE_NS);
                prop_assert!(p.keepalive_ns <= (t.timeout_ns / 3).max(MIN_KEEPALIVE_NS));
                prop_assert_eq!(p.keepalive_ns, keepalive_for(t.timeout_ns, a.client_timeout_ns));
                prop_assert!(
                    a.client_timeout_ns == 0
                        || (MIN_TIMEOUT_NS..=MAX_TIMEOUT_NS).contains(&a.client_timeout_ns)
                );
                prop_assert_eq!(a.client_timeout_ns == 0, timeout_ms == 0);
                prop_assert!((1..=MAX_QPS_PER_RAIL).contains(&a.qps_per_rail));
                prop_assert!(wanted.contains(&p.check) && t.checks.contains(&p.check));
                prop_assert_eq!(p.max_retries, DEFAULT_MAX_RETRIES);
                // What the client makes of the answer.
                let st = Staging { slot_size: t.window_size, transfers, timeout_ns: 60 * S };
                let c = check_grant(&req, &a.response(), &st);
                prop_assert!(c.is_ok(), "{:?}", c);
                let c = c.unwrap();
                prop_assert_eq!(
                    (c.block_size, c.window_size, c.window_count, c.check, c.max_retries),
                    (p.block_size, p.window_size, p.window_count, p.check, p.max_retries)
                );
                prop_assert!(c.keepalive_ns >= MIN_KEEPALIVE_NS);
                prop_assert!(c.max_open_files >= 1 && c.max_open_files <= max_open);
            }
        }
    }

    /// Sessions run with what random handshakes agreed, over a link that
    /// duplicates frames, with damage: the guarantees hold, and a run fails
    /// only as integrity.
    #[test]
    fn negotiated_sessions_keep_the_guarantees(
        files in proptest::collection::vec(sizes(), 0..12),
        bs_shift in 0u32..3,
        ws_blocks in 1u64..5,
        window_count in any::<u32>(),
        max_windows in 1u32..4,
        transfers in 1u32..9,
        timeout_ms in any::<u32>(),
        damage in 0.0f64..0.15,
        dup in 0.0f64..0.3,
        pull in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let bs = 4096u64 << bs_shift;
        let t = Terms { window_size: bs * ws_blocks, max_windows, ..terms() };
        let req = proto::HandshakeRequest {
            block_size: bs,
            window_count,
            timeout_ms,
            ..hello()
        };
        let st = Staging { slot_size: t.window_size, transfers, timeout_ns: 10 * S };
        let (sp, cp) = agree(&req, &t, &st);
        let dir = if pull { Direction::Pull } else { Direction::Push };
        let faults = Faults { damage, dup, ..Faults::default() };
        let mut s = Sim::pair(sp, cp, dir, &files, faults, seed);
        s.run(STEPS);
        s.check();
        if s.ok() {
            s.check_complete();
        } else {
            let e = s.seen.client_end.clone().unwrap().unwrap_err();
            prop_assert_eq!(e.reason, Reason::Integrity, "{:?}", e);
        }
    }

    /// The rails' watch against a model of the rule: it falls back exactly
    /// when windows wait, the last confirmed byte is `after` old and every
    /// rail failed since it; and its timer never sleeps past the moment it
    /// must look.
    #[test]
    fn the_rails_watch_follows_its_rule(
        rails in 1usize..4,
        after_ms in 1000u64..10_000,
        events in proptest::collection::vec(
            (0u64..3000, any::<bool>(), proptest::collection::vec(any::<bool>(), 3)),
            1..60,
        ),
    ) {
        let after = after_ms * 1_000_000;
        let mut c = client_fetching(params(), vec![]);
        let fetch = matches!(c.poll_action(), Some(ClientAction::Fetch { .. }));
        prop_assert!(fetch);
        c.watch_rails(0, after);
        let (mut now, mut confirmed) = (0u64, 0u64);
        let mut failures = vec![0u64; rails];
        let (mut since, mut before, mut next_look) = (0u64, Vec::<u64>::new(), 0u64);
        let mut fell = false;
        for (dt, grow, fail) in events {
            if !fell {
                let deadline = (since + after).max(next_look);
                let t = c.poll_timeout();
                prop_assert!(t.is_some_and(|t| t <= deadline), "{:?} past {}", t, deadline);
            }
            now += dt * 1_000_000;
            if grow {
                confirmed += 1;
            }
            for k in 0..rails {
                failures[k] += u64::from(fail[k]);
            }
            if grow {
                since = now;
                before = failures.clone();
            }
            let due = !fell && now >= since + after;
            let falls = due && every_rail_failed(&before, &failures);
            if due && !falls {
                next_look = now + S;
            }
            c.data_path(now, confirmed, &failures);
            fell |= falls;
            prop_assert_eq!(c.fallback().is_some(), fell, "at {} ns", now);
        }
    }
}
