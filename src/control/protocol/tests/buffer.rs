//! Buffer operations' cores ([`GrantCore`], [`OpCore`]): each answer's
//! checks, and a Pair of an exposing rcpd and initiating operations over a
//! simulated link that drops, duplicates, delays and reorders RPCs, with
//! damage in flight and a clock passed in.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::super::buffer::*;
use super::{Reason, Rng};
use crate::proto;

fn range(rkey: u32, rails: &[u32]) -> proto::GrantedRange {
    proto::GrantedRange {
        addr: 4096,
        rkey,
        rail_rkeys: rails.to_vec(),
    }
}

fn grant(n: usize) -> proto::BufferGrantResponse {
    proto::BufferGrantResponse {
        grant: 1,
        ranges: (0..n as u32).map(|k| range(k + 1, &[])).collect(),
        digests: Vec::new(),
        standing: None,
    }
}

fn answer(bad: &[u32], again: usize) -> proto::BufferDoneResponse {
    proto::BufferDoneResponse {
        bad: bad.to_vec(),
        again: (0..again as u32).map(|k| range(100 + k, &[])).collect(),
    }
}

fn done_req(round: Option<u32>, digests: usize, bad: &[u32]) -> proto::BufferDoneRequest {
    proto::BufferDoneRequest {
        session_id: 1,
        grant: 1,
        digests: vec![vec![0; 32]; digests],
        failed: String::new(),
        bad: bad.to_vec(),
        round,
    }
}

#[test]
fn an_initiator_refuses_a_grant_of_the_wrong_shape() {
    let mut op = OpCore::new(3, true, 1, 3);
    let e = op.granted(&grant(2)).unwrap_err();
    assert_eq!(e.reason, Reason::Protocol);
    assert!(e.message.contains("granted 2 ranges for 3"), "{e}");
    assert!(op.is_over());

    // Two rails: each range names its key on both, rail 0's first (the
    // files' rule).
    let mut op = OpCore::new(1, true, 2, 3);
    let mut g = grant(1);
    g.ranges[0].rail_rkeys = vec![9, 1];
    let e = op.granted(&g).unwrap_err();
    assert!(
        e.message.contains("rail rkeys on a session of 2 rails"),
        "{e}"
    );
    let mut op = OpCore::new(1, true, 2, 3);
    g.ranges[0].rail_rkeys = vec![1, 9];
    op.granted(&g).unwrap();
}

#[test]
fn an_initiator_is_done_only_when_nothing_is_bad_on_either_side() {
    let mut op = OpCore::new(2, true, 1, 3);
    op.granted(&grant(2)).unwrap();
    assert_eq!(op.round_done(&[], answer(&[], 0)).unwrap(), OpNext::Done);

    // A read whose peer took no notice of a mismatch found here: damaged.
    let mut op = OpCore::new(2, false, 1, 3);
    op.granted(&grant(2)).unwrap();
    assert_eq!(
        op.round_done(&[1], answer(&[], 0)).unwrap(),
        OpNext::Damaged {
            bad: vec![1],
            rounds: 0
        }
    );
}

#[test]
fn an_initiator_moves_again_only_what_was_moving_within_the_bound() {
    let mut op = OpCore::new(3, true, 1, 1);
    op.granted(&grant(3)).unwrap();
    match op.round_done(&[], answer(&[2], 1)).unwrap() {
        OpNext::Again(a) => assert_eq!(a.iter().map(|x| x.0).collect::<Vec<_>>(), [2]),
        other => panic!("{other:?}"),
    }
    assert_eq!((op.round(), op.moving()), (1, &[2][..]));
    // Past the bound of 1 retry: the peer broke the protocol.
    let e = op.round_done(&[], answer(&[2], 1)).unwrap_err();
    assert!(e.message.contains("past the retry bound 1"), "{e}");

    // Range 0 was not moving in round 1.
    let mut op = OpCore::new(3, true, 1, 3);
    op.granted(&grant(3)).unwrap();
    op.round_done(&[], answer(&[2], 1)).unwrap();
    let e = op.round_done(&[], answer(&[0], 1)).unwrap_err();
    assert!(
        e.message.contains("range 0 is bad but was not moving"),
        "{e}"
    );

    // As many granted again as bad; none twice.
    let mut op = OpCore::new(3, true, 1, 3);
    op.granted(&grant(3)).unwrap();
    let e = op.round_done(&[], answer(&[0, 1], 1)).unwrap_err();
    assert!(
        e.message.contains("1 ranges granted again for 2 bad"),
        "{e}"
    );
    let mut op = OpCore::new(3, true, 1, 3);
    op.granted(&grant(3)).unwrap();
    let e = op.round_done(&[], answer(&[1, 1], 2)).unwrap_err();
    assert!(e.message.contains("twice"), "{e}");
}

#[test]
fn a_read_is_granted_again_exactly_what_it_found_bad() {
    let mut op = OpCore::new(3, false, 1, 3);
    op.granted(&grant(3)).unwrap();
    // The peer re-grants 0 where 0 and 2 were read bad: 2 would be left
    // damaged and called done.
    let e = op.round_done(&[0, 2], answer(&[0], 1)).unwrap_err();
    assert_eq!(e.reason, Reason::Protocol);
    assert!(e.message.contains("where [0, 2] were read bad"), "{e}");
}

#[test]
fn an_exposer_verifies_regrants_within_the_bound_and_then_ends() {
    let mut g = GrantCore::new(3, true, true, 1, 1_000, 0);
    assert_eq!(g.poll_timeout(), Some(1_000));
    assert_eq!(
        g.done(&done_req(Some(0), 3, &[])).unwrap(),
        DoneStep::Hash(vec![0, 1, 2])
    );
    assert_eq!(g.poll_timeout(), None, "no timeout while it verifies");
    assert_eq!(g.verified(500, vec![1], true), GrantNext::Regrant(vec![1]));
    assert_eq!(
        (g.round(), g.resent(), g.poll_timeout()),
        (1, 1, Some(1_500))
    );
    assert_eq!(
        g.done(&done_req(Some(1), 3, &[])).unwrap(),
        DoneStep::Hash(vec![1])
    );
    // Out of retries: over, with range 1 bad.
    assert_eq!(
        g.verified(600, vec![1], true),
        GrantNext::End { bad: vec![1] }
    );
    assert_eq!(g.phase(), GrantPhase::Ended);
    let e = g.done(&done_req(Some(1), 3, &[])).unwrap_err();
    assert_eq!(e.reason, Reason::Retryable);
}

#[test]
fn an_exposer_ends_without_a_session_and_on_its_timeout() {
    let mut g = GrantCore::new(2, true, true, 3, 1_000, 0);
    g.done(&done_req(None, 2, &[])).unwrap();
    assert_eq!(
        g.verified(10, vec![0], false),
        GrantNext::End { bad: vec![0] }
    );

    let mut g = GrantCore::new(2, false, true, 3, 1_000, 0);
    assert!(!g.handle_timeout(999));
    assert!(g.handle_timeout(1_000));
    assert_eq!(g.phase(), GrantPhase::Ended);
    assert_eq!(g.poll_timeout(), None);
}

#[test]
fn an_exposer_refuses_what_breaks_the_protocol_and_ignores_other_rounds() {
    // A read's bad range that was not read this round: the grant ends.
    let mut g = GrantCore::new(3, false, true, 3, 1_000, 0);
    g.done(&done_req(None, 0, &[1])).unwrap();
    g.verified(1, vec![1], true);
    let e = g.done(&done_req(Some(1), 0, &[2])).unwrap_err();
    assert_eq!(e.reason, Reason::Protocol);
    assert!(e.message.contains("range 2 was not read in round 1"), "{e}");
    assert_eq!(g.phase(), GrantPhase::Ended);

    // A write with digests for another count of ranges: the grant ends.
    let mut g = GrantCore::new(3, true, true, 3, 1_000, 0);
    let e = g.done(&done_req(Some(0), 2, &[])).unwrap_err();
    assert_eq!(e.reason, Reason::Invalid);
    assert_eq!(g.phase(), GrantPhase::Ended);

    // Another round's BufferDone (repeated, late): nothing changes.
    let mut g = GrantCore::new(3, true, true, 3, 1_000, 0);
    g.done(&done_req(Some(0), 3, &[])).unwrap();
    g.verified(5, vec![0], true);
    let before = (g.round(), g.moving().to_vec(), g.poll_timeout());
    let e = g.done(&done_req(Some(0), 3, &[])).unwrap_err();
    assert!(
        e.message
            .contains("for round 0 of grant 1, which is in round 1"),
        "{e}"
    );
    assert_eq!(g.phase(), GrantPhase::Live);
    assert_eq!(before, (g.round(), g.moving().to_vec(), g.poll_timeout()));

    // A failure from the peer ends it, in any round.
    let mut req = done_req(None, 0, &[]);
    req.failed = "cancelled".into();
    assert_eq!(g.done(&req).unwrap(), DoneStep::Failed);
    assert_eq!(g.phase(), GrantPhase::Ended);
}

/// What goes wrong on the simulated link and in flight.
#[derive(Clone, Copy, Debug, Default)]
struct LinkFaults {
    /// A range damaged as it moves.
    damage: f64,
    /// An RPC request or answer lost.
    drop: f64,
    /// An RPC request delivered twice (its client takes the first answer).
    dup: f64,
    /// Messages delivered in any order, not as sent.
    reorder: bool,
}

/// An RPC on the link.
#[derive(Clone, Debug)]
enum Rpc {
    Grant {
        op: usize,
        seq: u64,
    },
    Done {
        op: usize,
        seq: u64,
        req: proto::BufferDoneRequest,
    },
    GrantAnswer {
        op: usize,
        seq: u64,
        r: Result<proto::BufferGrantResponse, Reason>,
    },
    DoneAnswer {
        op: usize,
        seq: u64,
        r: Result<proto::BufferDoneResponse, Reason>,
    },
}

/// An exposer's grant: its core, what it promised each range's key is,
/// and whom it serves.
struct SimGrant {
    core: GrantCore,
    op: usize,
    keys: HashMap<u32, u32>,
}

#[derive(Clone, Debug, PartialEq)]
enum OpState {
    WaitGrant {
        seq: u64,
        until: u64,
    },
    Move,
    WaitDone {
        seq: u64,
        until: u64,
        mine: Vec<u32>,
    },
    Over(Result<(), Reason>),
}

struct SimOp {
    write: bool,
    core: OpCore,
    grant: u64,
    keys: HashMap<u32, u32>,
    state: OpState,
    /// The source's bytes (one word a range) and where they land.
    src: Vec<u64>,
    dst: Vec<u64>,
}

/// An exposing rcpd and the operations of peers, over one lossy link.
struct BufSim {
    rng: Rng,
    f: LinkFaults,
    now: u64,
    timeout: u64,
    max_retries: u32,
    link: Vec<(u64, Rpc)>,
    grants: HashMap<u64, SimGrant>,
    next_grant: u64,
    next_key: u32,
    next_seq: u64,
    ops: Vec<SimOp>,
    /// Owner events: (op, intact) for each write's grant ended as written.
    written: Vec<(usize, bool)>,
    /// The most rounds any core reached.
    max_round: u32,
}

impl BufSim {
    fn new(ops: &[(bool, u32)], max_retries: u32, f: LinkFaults, seed: u64) -> BufSim {
        let mut rng = Rng::new(seed);
        let ops = ops
            .iter()
            .map(|&(write, n)| {
                let src: Vec<u64> = (0..n).map(|_| rng.next() | 1).collect();
                SimOp {
                    write,
                    core: OpCore::new(n, write, 1, max_retries),
                    grant: 0,
                    keys: HashMap::new(),
                    state: OpState::Move,
                    dst: vec![0; n as usize],
                    src,
                }
            })
            .collect();
        let mut s = BufSim {
            rng,
            f,
            now: 1,
            timeout: 1_000_000_000,
            max_retries,
            link: Vec::new(),
            grants: HashMap::new(),
            next_grant: 0,
            next_key: 0,
            next_seq: 0,
            ops,
            written: Vec::new(),
            max_round: 0,
        };
        for k in 0..s.ops.len() {
            let seq = s.seq();
            s.ops[k].state = OpState::WaitGrant {
                seq,
                until: s.now + s.timeout,
            };
            s.send(Rpc::Grant { op: k, seq });
        }
        s
    }

    fn seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// Put `m` on the link (lost, or delivered once or twice, later).
    fn send(&mut self, m: Rpc) {
        if self.rng.chance(self.f.drop) {
            return;
        }
        let request = matches!(m, Rpc::Grant { .. } | Rpc::Done { .. });
        let copies = if request && self.rng.chance(self.f.dup) {
            2
        } else {
            1
        };
        for _ in 0..copies {
            let at = self.now + self.rng.below(200_000_000);
            self.link.push((at, m.clone()));
        }
    }

    fn key(&mut self) -> u32 {
        self.next_key += 1;
        self.next_key
    }

    /// Keys for `ranges` of grant `id` (new ones each round; the old ones
    /// are revoked).
    fn register(&mut self, id: u64, ranges: &[u32]) -> Vec<proto::GrantedRange> {
        let mut out = Vec::new();
        let mut keys = HashMap::new();
        for &i in ranges {
            let k = self.key();
            keys.insert(i, k);
            out.push(range(k, &[]));
        }
        self.grants.get_mut(&id).unwrap().keys = keys;
        out
    }

    /// The exposer's buffer: a write's destination or a read's source.
    fn exposed(&mut self, op: usize) -> &mut Vec<u64> {
        let o = &mut self.ops[op];
        if o.write {
            &mut o.dst
        } else {
            &mut o.src
        }
    }

    fn serve(&mut self, m: Rpc) {
        match m {
            Rpc::Grant { op, seq } => {
                self.next_grant += 1;
                let id = self.next_grant;
                let o = &self.ops[op];
                let n = o.src.len() as u32;
                let core =
                    GrantCore::new(n, o.write, true, self.max_retries, self.timeout, self.now);
                let digests = if o.write {
                    Vec::new()
                } else {
                    o.src.iter().map(|w| w.to_le_bytes().to_vec()).collect()
                };
                self.grants.insert(
                    id,
                    SimGrant {
                        core,
                        op,
                        keys: HashMap::new(),
                    },
                );
                let ranges = self.register(id, &(0..n).collect::<Vec<_>>());
                let r = Ok(proto::BufferGrantResponse {
                    grant: id,
                    ranges,
                    digests,
                    standing: None,
                });
                self.send(Rpc::GrantAnswer { op, seq, r });
            }
            Rpc::Done { op, seq, req } => {
                let r = self.done(req);
                self.send(Rpc::DoneAnswer { op, seq, r });
            }
            Rpc::GrantAnswer { op, seq, r } => self.granted(op, seq, r),
            Rpc::DoneAnswer { op, seq, r } => self.answered(op, seq, r),
        }
    }

    /// The exposer's `BufferDone` (the driver of grant.rs, in small).
    fn done(&mut self, req: proto::BufferDoneRequest) -> Result<proto::BufferDoneResponse, Reason> {
        let id = req.grant;
        let Some(g) = self.grants.get_mut(&id) else {
            return Err(Reason::Retryable);
        };
        let step = match g.core.done(&req) {
            Ok(s) => s,
            Err(e) => {
                if g.core.phase() == GrantPhase::Ended {
                    self.grants.remove(&id);
                }
                return Err(e.reason);
            }
        };
        g.keys.clear();
        let op = g.op;
        let bad = match step {
            DoneStep::Failed => {
                self.grants.remove(&id);
                return Ok(proto::BufferDoneResponse::default());
            }
            DoneStep::Checked(bad) => bad,
            DoneStep::Hash(moving) => {
                let got = self.exposed(op).clone();
                moving
                    .into_iter()
                    .filter(|&i| req.digests[i as usize] != got[i as usize].to_le_bytes())
                    .collect()
            }
        };
        let g = self.grants.get_mut(&id).unwrap();
        match g.core.verified(self.now, bad, true) {
            GrantNext::Regrant(bad) => {
                self.max_round = self.max_round.max(g.core.round());
                let again = self.register(id, &bad);
                Ok(proto::BufferDoneResponse { bad, again })
            }
            GrantNext::End { bad } => {
                self.grants.remove(&id);
                if self.ops[op].write && bad.is_empty() {
                    let o = &self.ops[op];
                    self.written.push((op, o.src == o.dst));
                }
                Ok(proto::BufferDoneResponse {
                    bad,
                    again: Vec::new(),
                })
            }
        }
    }

    fn granted(&mut self, op: usize, seq: u64, r: Result<proto::BufferGrantResponse, Reason>) {
        let o = &mut self.ops[op];
        if !matches!(o.state, OpState::WaitGrant { seq: s, .. } if s == seq) {
            return; // a second answer (a duplicated request's)
        }
        match r.map(|g| (o.core.granted(&g).map_err(|e| e.reason), g)) {
            Ok((Ok(()), g)) => {
                o.grant = g.grant;
                o.keys = g
                    .ranges
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (i as u32, r.rkey))
                    .collect();
                o.state = OpState::Move;
            }
            Ok((Err(e), _)) | Err(e) => o.state = OpState::Over(Err(e)),
        }
    }

    /// The operation's round: each moving range goes over the key it was
    /// given, if the exposer still honours it (else the data path fails).
    fn post(&mut self, op: usize) {
        let moving = self.ops[op].core.moving().to_vec();
        let id = self.ops[op].grant;
        for &i in &moving {
            let key = self.ops[op].keys[&i];
            let live = self.grants.get(&id).is_some_and(|g| {
                g.core.phase() == GrantPhase::Live && g.keys.get(&i) == Some(&key)
            });
            if !live {
                // Remote access error: tell the peer, fail retryably.
                self.ops[op].core.abandon();
                self.ops[op].state = OpState::Over(Err(Reason::Retryable));
                let req = proto::BufferDoneRequest {
                    grant: id,
                    failed: "remote access error".into(),
                    ..Default::default()
                };
                let seq = self.seq();
                self.send(Rpc::Done { op, seq, req });
                return;
            }
            let damage = if self.rng.chance(self.f.damage) { 2 } else { 0 };
            let o = &mut self.ops[op];
            o.dst[i as usize] = o.src[i as usize] ^ damage;
        }
        let o = &self.ops[op];
        let (digests, mine) = if o.write {
            (
                o.src.iter().map(|w| w.to_le_bytes().to_vec()).collect(),
                Vec::new(),
            )
        } else {
            (
                Vec::new(),
                moving
                    .iter()
                    .copied()
                    .filter(|&i| o.dst[i as usize] != o.src[i as usize])
                    .collect(),
            )
        };
        let req = proto::BufferDoneRequest {
            session_id: 1,
            grant: id,
            digests,
            failed: String::new(),
            bad: mine.clone(),
            round: Some(o.core.round()),
        };
        let seq = self.seq();
        self.ops[op].state = OpState::WaitDone {
            seq,
            until: self.now + self.timeout,
            mine,
        };
        self.send(Rpc::Done { op, seq, req });
    }

    fn answered(&mut self, op: usize, seq: u64, r: Result<proto::BufferDoneResponse, Reason>) {
        let o = &mut self.ops[op];
        let OpState::WaitDone { seq: s, mine, .. } = &o.state else {
            return;
        };
        if *s != seq {
            return;
        }
        let mine = mine.clone();
        let next = match r {
            Ok(resp) => o.core.round_done(&mine, resp).map_err(|e| e.reason),
            Err(e) => Err(e),
        };
        let state = match next {
            Ok(OpNext::Done) => OpState::Over(Ok(())),
            Ok(OpNext::Damaged { rounds, .. }) => {
                assert!(rounds <= self.max_retries);
                OpState::Over(Err(Reason::Integrity))
            }
            Ok(OpNext::Again(again)) => {
                self.max_round = self.max_round.max(o.core.round());
                for (i, at) in again {
                    o.keys.insert(i, at.rkey);
                }
                OpState::Move
            }
            Err(e) => {
                o.core.abandon();
                let req = proto::BufferDoneRequest {
                    grant: o.grant,
                    failed: "the peer's answer failed".into(),
                    ..Default::default()
                };
                let seq = self.seq();
                self.send(Rpc::Done { op, seq, req });
                OpState::Over(Err(e))
            }
        };
        self.ops[op].state = state;
    }

    /// One step: time passes; a message is delivered, an operation moves,
    /// or timers fire.
    fn step(&mut self) {
        self.now += self.rng.below(50_000_000);
        for k in 0..self.ops.len() {
            let late = match self.ops[k].state {
                OpState::WaitGrant { until, .. } | OpState::WaitDone { until, .. } => {
                    self.now >= until
                }
                _ => false,
            };
            if late {
                // The RPC's deadline: the operation fails retryably (a
                // grant it never heard of times out on its own).
                self.ops[k].core.abandon();
                self.ops[k].state = OpState::Over(Err(Reason::Retryable));
            }
        }
        self.expire();
        let ready: Vec<usize> = self
            .link
            .iter()
            .enumerate()
            .filter(|(_, (at, _))| *at <= self.now)
            .map(|(i, _)| i)
            .collect();
        if !ready.is_empty() {
            let pick = if self.f.reorder {
                ready[self.rng.below(ready.len() as u64) as usize]
            } else {
                *ready.iter().min_by_key(|&&i| self.link[i].0).unwrap()
            };
            let (_, m) = self.link.remove(pick);
            self.serve(m);
        }
        let moving: Vec<usize> = (0..self.ops.len())
            .filter(|&k| self.ops[k].state == OpState::Move)
            .collect();
        if let Some(&k) = moving.first() {
            self.post(k);
        }
    }

    /// The exposer's timers ([`GrantCore::poll_timeout`]).
    fn expire(&mut self) {
        let now = self.now;
        self.grants.retain(|_, g| !g.core.handle_timeout(now));
    }

    fn run(&mut self) {
        let mut steps = 0;
        while steps < 100_000
            && (!self.link.is_empty()
                || self
                    .ops
                    .iter()
                    .any(|o| !matches!(o.state, OpState::Over(_))))
        {
            self.step();
            steps += 1;
        }
        assert!(steps < 100_000, "the pair did not settle");
        // Past every deadline: nothing granted stays.
        self.now += 2 * self.timeout;
        self.expire();
    }

    fn check(&self) {
        assert!(
            self.grants.is_empty(),
            "grants left: {:?}",
            self.grants.keys().collect::<Vec<_>>()
        );
        assert!(
            self.max_round <= self.max_retries,
            "round {} past {}",
            self.max_round,
            self.max_retries
        );
        for (k, o) in self.ops.iter().enumerate() {
            match &o.state {
                OpState::Over(Ok(())) => assert_eq!(o.src, o.dst, "op {k} done but not intact"),
                OpState::Over(Err(_)) => {}
                other => panic!("op {k} not over: {other:?}"),
            }
        }
        for &(op, intact) in &self.written {
            assert!(intact, "the owner was told op {op}'s write landed, damaged");
        }
    }

    fn outcomes(&self) -> HashSet<Result<(), Reason>> {
        self.ops
            .iter()
            .map(|o| match &o.state {
                OpState::Over(r) => *r,
                _ => unreachable!(),
            })
            .collect()
    }
}

fn ops() -> impl Strategy<Value = Vec<(bool, u32)>> {
    proptest::collection::vec((any::<bool>(), 1u32..6), 1..6)
}

#[test]
fn a_clean_link_moves_every_operation_intact() {
    let mut s = BufSim::new(
        &[(true, 3), (false, 4), (true, 1)],
        3,
        LinkFaults::default(),
        5,
    );
    s.run();
    s.check();
    assert_eq!(s.outcomes(), HashSet::from([Ok(())]));
    assert_eq!(s.written.len(), 2, "the owner hears of both writes");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, .. ProptestConfig::default() })]

    /// Damage only: every operation ends done and intact, or, with
    /// damage past the retries, `integrity`; rounds stay in the bound.
    #[test]
    fn damage_is_moved_again_within_the_bound(
        ops in ops(),
        damage in 0.0f64..0.6,
        max_retries in 0u32..4,
        seed in any::<u64>(),
    ) {
        let mut s = BufSim::new(&ops, max_retries, LinkFaults { damage, ..Default::default() }, seed);
        s.run();
        s.check();
        for r in s.outcomes() {
            prop_assert!(r == Ok(()) || r == Err(Reason::Integrity), "{:?}", r);
        }
    }

    /// Lost, repeated, late and reordered RPCs too: operations may fail,
    /// but nothing unverified is reported done or written, no grant is
    /// left standing, and no round passes the bound.
    #[test]
    fn a_lossy_link_reports_nothing_unverified_and_leaves_no_grant(
        ops in ops(),
        damage in 0.0f64..0.3,
        drop in 0.0f64..0.3,
        dup in 0.0f64..0.3,
        reorder in any::<bool>(),
        max_retries in 0u32..4,
        seed in any::<u64>(),
    ) {
        let f = LinkFaults { damage, drop, dup, reorder };
        let mut s = BufSim::new(&ops, max_retries, f, seed);
        s.run();
        s.check();
    }
}

fn notice(bad: &[u32], ended: bool) -> proto::BufferNoticeResult {
    proto::BufferNoticeResult {
        bad: bad.to_vec(),
        ended,
        ..Default::default()
    }
}

/// A standing operation: done when the exposer found nothing bad; bad
/// ranges move again, counted as resent, until the exposer ends it
/// (damaged) within its bound.
#[test]
fn a_standing_operation_moves_bad_ranges_again_until_the_exposer_ends_it() {
    let mut op = StandingCore::new(3, 2);
    assert_eq!(op.moving(), &[0, 1, 2]);
    assert_eq!(op.answered(&notice(&[], true)).unwrap(), StandingNext::Done);

    let mut op = StandingCore::new(3, 2);
    assert_eq!(
        op.answered(&notice(&[2, 0], false)).unwrap(),
        StandingNext::Again(vec![0, 2])
    );
    assert_eq!(
        (op.round(), op.resent(), op.moving()),
        (1, 2, &[0u32, 2][..])
    );
    assert_eq!(
        op.answered(&notice(&[2], false)).unwrap(),
        StandingNext::Again(vec![2])
    );
    assert_eq!(
        op.answered(&notice(&[2], true)).unwrap(),
        StandingNext::Damaged {
            bad: vec![2],
            rounds: 2
        }
    );
    // Over: a repeated answer is refused.
    let e = op.answered(&notice(&[], true)).unwrap_err();
    assert_eq!(e.reason, Reason::Protocol);
}

/// The exposer's answers are checked: a range bad that was not moving,
/// twice in one answer, an operation left open with nothing bad or past
/// the bound are protocol errors; a refusal is its reason.
#[test]
fn a_standing_operation_refuses_answers_outside_the_protocol() {
    let mut op = StandingCore::new(2, 3);
    op.answered(&notice(&[1], false)).unwrap();
    let e = op.answered(&notice(&[0], false)).unwrap_err();
    assert!(
        e.message.contains("range 0 is bad but was not moving"),
        "{e}"
    );

    let e = StandingCore::new(2, 3)
        .answered(&notice(&[1, 1], false))
        .unwrap_err();
    assert!(e.message.contains("bad twice"), "{e}");

    let e = StandingCore::new(2, 3)
        .answered(&notice(&[], false))
        .unwrap_err();
    assert!(e.message.contains("goes on"), "{e}");

    let mut op = StandingCore::new(1, 1);
    op.answered(&notice(&[0], false)).unwrap();
    let e = op.answered(&notice(&[0], false)).unwrap_err();
    assert_eq!(e.reason, Reason::Protocol);
    assert!(e.message.contains("past the retry bound 1"), "{e}");

    let e = StandingCore::new(1, 3)
        .answered(&proto::BufferNoticeResult {
            error: "no standing grant 7 on this session".into(),
            reason: Reason::FileNotFound as i32,
            ..Default::default()
        })
        .unwrap_err();
    assert_eq!(e.reason, Reason::FileNotFound);
    assert!(e.message.contains("no standing grant 7"), "{e}");
}
