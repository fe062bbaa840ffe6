//! Who sends to whom in a fan-out, and what a failure changes: a
//! deterministic core with no I/O ([`Chain`]), driven by
//! [`super::run`] and tested with failures in every order.
//!
//! The nodes form a chain: the source sends to node 0, node i forwards to
//! node i + 1 (each such forwarding is a *hop*, all started at once: a
//! node forwards what it verified as it arrives). When a hop fails, both
//! of its ends are probed:
//! - the receiver does not answer: it is cut out as unreachable, and the
//!   nodes it fed get their files from its sender instead, resuming from
//!   what each has verified;
//! - the sender does not answer: the same for the sender;
//! - both answer: the receiver failed for a reason of its own (a refused
//!   token, a full disk): it is cut out with that reason the same way;
//!   but when the sender refused the hop itself (its Copy API refused the
//!   request: a token it does not take, a peer its `--copy-peers` does
//!   not allow), the sender stays (it may still receive everything) and
//!   only stops forwarding: the receiver gets its files from the sender's
//!   sender.
//!
//! Every event names its hop; an event of a hop that was cancelled or
//! already settled changes nothing (late, duplicated or reordered
//! reports are harmless).

use std::collections::{BTreeMap, VecDeque};

/// A node's index in the chain.
pub type NodeIx = usize;
/// A hop's id, unique in a fan-out.
pub type HopId = u64;

/// Where a hop's files come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sender {
    /// The fan-out's source (the rcp client, or the rcpd a Copy asked).
    Source,
    Node(NodeIx),
}

/// What became of a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeState {
    /// Still receiving.
    Waiting,
    /// It holds every file, verified and committed.
    Done,
    /// It answered but could not take the files (the reason).
    Failed(String),
    /// It did not answer (the failure it was found after): cut out.
    Unreachable(String),
}

impl NodeState {
    /// Done, failed or unreachable.
    pub fn settled(&self) -> bool {
        *self != NodeState::Waiting
    }
}

/// What the driver does for the chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Start sending every file from `from` to `to`; resumed (the
    /// receiver keeps what it verified) after a re-route.
    Start {
        hop: HopId,
        from: Sender,
        to: NodeIx,
        resume: bool,
    },
    /// Stop the hop; what it reports later is ignored.
    Cancel { hop: HopId },
    /// Find out whether these nodes answer; [`Chain::probed`] takes it.
    Probe { hop: HopId, nodes: Vec<NodeIx> },
}

#[derive(Clone, Copy, Debug)]
struct Hop {
    from: Sender,
    to: NodeIx,
}

/// The chain's state; see the module doc.
#[derive(Debug)]
pub struct Chain {
    states: Vec<NodeState>,
    /// The hop feeding each node now (or last, once done).
    feeder: Vec<Option<(HopId, Sender)>>,
    running: BTreeMap<HopId, Hop>,
    /// Failed hops waiting for their probes: the failure's reason, and
    /// whether the sender refused the hop.
    probing: BTreeMap<HopId, (Hop, String, bool)>,
    /// Nodes that refused to forward.
    no_forward: Vec<bool>,
    next: HopId,
    actions: VecDeque<Action>,
}

impl Chain {
    /// A chain of `nodes` nodes, every hop started; the source's `resume`
    /// as the user asked.
    pub fn new(nodes: usize, resume: bool) -> Chain {
        let mut c = Chain {
            states: vec![NodeState::Waiting; nodes],
            feeder: vec![None; nodes],
            running: BTreeMap::new(),
            probing: BTreeMap::new(),
            no_forward: vec![false; nodes],
            next: 1,
            actions: VecDeque::new(),
        };
        for to in 0..nodes {
            let from = match to {
                0 => Sender::Source,
                n => Sender::Node(n - 1),
            };
            c.start(from, to, resume || to > 0);
        }
        c
    }

    fn start(&mut self, from: Sender, to: NodeIx, resume: bool) {
        let hop = self.next;
        self.next += 1;
        self.running.insert(hop, Hop { from, to });
        self.feeder[to] = Some((hop, from));
        self.actions.push_back(Action::Start {
            hop,
            from,
            to,
            resume,
        });
    }

    /// The next thing to do.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Every node's state, in chain order.
    pub fn states(&self) -> &[NodeState] {
        &self.states
    }

    /// Nothing runs or waits for a probe: every node is settled.
    pub fn is_finished(&self) -> bool {
        self.running.is_empty() && self.probing.is_empty()
    }

    /// `hop` sent every file and its receiver committed them.
    pub fn hop_done(&mut self, hop: HopId) {
        let Some(h) = self.running.remove(&hop) else {
            return;
        };
        if self.states[h.to] == NodeState::Waiting {
            self.states[h.to] = NodeState::Done;
        }
    }

    /// `hop` failed with `reason` (`by_sender`: the sender refused it
    /// before it began): its ends are probed.
    pub fn hop_failed(&mut self, hop: HopId, reason: String, by_sender: bool) {
        let Some(h) = self.running.remove(&hop) else {
            return;
        };
        let mut nodes = vec![h.to];
        if let Sender::Node(u) = h.from {
            nodes.push(u);
        }
        self.probing.insert(hop, (h, reason, by_sender));
        self.actions.push_back(Action::Probe { hop, nodes });
    }

    /// The answer to [`Action::Probe`]: whether each node answered (a
    /// node not listed did not).
    pub fn probed(&mut self, hop: HopId, answered: &[NodeIx]) {
        let Some((h, reason, by_sender)) = self.probing.remove(&hop) else {
            return;
        };
        let up = |n: NodeIx| answered.contains(&n);
        match h.from {
            Sender::Node(u) if !up(u) => {
                self.cut(
                    u,
                    NodeState::Unreachable(format!("does not answer ({reason})")),
                );
            }
            Sender::Node(u) if by_sender => {
                // It answers but will not forward: the receiver gets its
                // files from further up.
                self.no_forward[u] = true;
                if self.states[h.to] == NodeState::Waiting {
                    let from = self.sender_of(u);
                    self.start(from, h.to, true);
                }
            }
            _ if !up(h.to) => {
                self.cut(h.to, NodeState::Unreachable(reason));
            }
            _ if self.feeder[h.to].is_some_and(|(f, _)| f == hop) => {
                self.cut(h.to, NodeState::Failed(reason));
            }
            // A hop into a node that has another sender now: nothing to do.
            _ => {}
        }
    }

    /// Cut `n` out: its hops stop, the nodes it fed get their files from
    /// its nearest sender still in the chain.
    fn cut(&mut self, n: NodeIx, state: NodeState) {
        if matches!(
            self.states[n],
            NodeState::Failed(_) | NodeState::Unreachable(_)
        ) {
            return;
        }
        self.states[n] = state;
        let stop: Vec<HopId> = self
            .running
            .iter()
            .filter(|(_, h)| h.to == n || h.from == Sender::Node(n))
            .map(|(&id, _)| id)
            .collect();
        for hop in stop {
            self.running.remove(&hop);
            self.actions.push_back(Action::Cancel { hop });
        }
        let from = self.sender_of(n);
        let fed: Vec<NodeIx> = (0..self.states.len())
            .filter(|&j| {
                self.states[j] == NodeState::Waiting
                    && self.feeder[j].is_some_and(|(_, s)| s == Sender::Node(n))
            })
            .collect();
        for j in fed {
            self.start(from, j, true);
        }
    }

    /// The nearest sender of `n` still in the chain and forwarding: its
    /// feeder's, past every node cut out or refusing to forward.
    fn sender_of(&self, mut n: NodeIx) -> Sender {
        loop {
            match self.feeder[n].map(|(_, s)| s) {
                None | Some(Sender::Source) => return Sender::Source,
                Some(Sender::Node(u)) if self.forwards(u) => return Sender::Node(u),
                Some(Sender::Node(u)) => n = u,
            }
        }
    }

    fn forwards(&self, n: NodeIx) -> bool {
        !self.no_forward[n] && matches!(self.states[n], NodeState::Waiting | NodeState::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(c: &mut Chain) -> Vec<Action> {
        std::iter::from_fn(|| c.poll_action()).collect()
    }

    fn starts(a: &[Action]) -> Vec<(Sender, NodeIx, bool)> {
        a.iter()
            .filter_map(|a| match a {
                Action::Start {
                    from, to, resume, ..
                } => Some((*from, *to, *resume)),
                _ => None,
            })
            .collect()
    }

    fn hop_into(a: &[Action], to: NodeIx) -> HopId {
        a.iter()
            .rev()
            .find_map(|a| match a {
                Action::Start { hop, to: t, .. } if *t == to => Some(*hop),
                _ => None,
            })
            .unwrap()
    }

    #[test]
    fn every_hop_starts_at_once_and_done_hops_finish_the_chain() {
        let mut c = Chain::new(3, false);
        let a = drain(&mut c);
        assert_eq!(
            starts(&a),
            vec![
                (Sender::Source, 0, false),
                (Sender::Node(0), 1, true),
                (Sender::Node(1), 2, true)
            ]
        );
        for to in 0..3 {
            c.hop_done(hop_into(&a, to));
        }
        assert!(c.is_finished());
        assert_eq!(c.states(), vec![NodeState::Done; 3]);
    }

    /// The middle node dies: both hops touching it fail, in either
    /// order, reported twice; the node after it is fed by the one before,
    /// once, resuming.
    #[test]
    fn a_dead_middle_node_is_routed_around_once_whatever_the_order() {
        for first_in in [true, false] {
            let mut c = Chain::new(3, false);
            let a = drain(&mut c);
            let (into1, out1) = (hop_into(&a, 1), hop_into(&a, 2));
            c.hop_done(hop_into(&a, 0));
            let order = if first_in {
                [into1, out1]
            } else {
                [out1, into1]
            };
            for h in order {
                c.hop_failed(h, "connection reset".into(), false);
                c.hop_failed(h, "connection reset".into(), false);
            }
            let probes = drain(&mut c);
            assert_eq!(probes.len(), 2, "{probes:?}");
            for p in &probes {
                let Action::Probe { hop, .. } = p else {
                    panic!("{p:?}")
                };
                c.probed(*hop, &[0, 2]);
                c.probed(*hop, &[0, 2]);
            }
            let a2 = drain(&mut c);
            assert_eq!(starts(&a2), vec![(Sender::Node(0), 2, true)], "{a2:?}");
            assert!(matches!(c.states()[1], NodeState::Unreachable(_)));
            assert!(!c.is_finished());
            c.hop_done(hop_into(&a2, 2));
            assert!(c.is_finished());
            assert_eq!(c.states()[2], NodeState::Done);
        }
    }

    #[test]
    fn a_node_missing_at_the_start_is_skipped() {
        let mut c = Chain::new(3, false);
        let a = drain(&mut c);
        c.hop_failed(hop_into(&a, 0), "connection refused".into(), false);
        let Action::Probe { hop, nodes } = &drain(&mut c)[0] else {
            panic!()
        };
        assert_eq!(nodes, &[0]);
        c.probed(*hop, &[]);
        let a2 = drain(&mut c);
        // Its outgoing hop is cancelled, the source feeds node 1.
        assert!(a2.contains(&Action::Cancel {
            hop: hop_into(&a, 1)
        }));
        assert_eq!(starts(&a2), vec![(Sender::Source, 1, true)]);
        // The cancelled hop's failure, arriving late, changes nothing.
        c.hop_failed(hop_into(&a, 1), "gone".into(), false);
        assert!(drain(&mut c).is_empty());
        c.hop_done(hop_into(&a2, 1));
        c.hop_done(hop_into(&a, 2));
        assert!(c.is_finished());
        assert!(matches!(c.states()[0], NodeState::Unreachable(_)));
        assert_eq!(c.states()[1..], vec![NodeState::Done; 2]);
    }

    #[test]
    fn a_node_refusing_is_failed_with_its_reason_and_routed_around() {
        let mut c = Chain::new(3, false);
        let a = drain(&mut c);
        c.hop_done(hop_into(&a, 0));
        c.hop_failed(hop_into(&a, 1), "token refused".into(), false);
        let Action::Probe { hop, .. } = drain(&mut c)[0].clone() else {
            panic!()
        };
        c.probed(hop, &[0, 1, 2]);
        let a2 = drain(&mut c);
        assert_eq!(starts(&a2), vec![(Sender::Node(0), 2, true)]);
        assert_eq!(c.states()[1], NodeState::Failed("token refused".into()));
        c.hop_done(hop_into(&a2, 2));
        // The old hop 1 -> 2 reports late: ignored.
        c.hop_done(hop_into(&a, 2));
        assert!(c.is_finished());
    }

    /// Node 1 refuses to forward (its Copy API refused the hop) but
    /// receives everything: node 2 is fed by node 0, node 1 stays done,
    /// and a later re-route skips it as a sender.
    #[test]
    fn a_node_that_will_not_forward_still_receives_and_is_passed_over() {
        let mut c = Chain::new(4, false);
        let a = drain(&mut c);
        c.hop_failed(hop_into(&a, 2), "not authenticated".into(), true);
        let Action::Probe { hop, .. } = drain(&mut c)[0].clone() else {
            panic!()
        };
        c.probed(hop, &[0, 1, 2, 3]);
        let a2 = drain(&mut c);
        assert_eq!(starts(&a2), vec![(Sender::Node(0), 2, true)]);
        c.hop_done(hop_into(&a, 1));
        assert_eq!(c.states()[1], NodeState::Done);
        // Node 2 dies: node 3 is fed by node 0, not by node 1.
        c.hop_failed(hop_into(&a, 3), "reset".into(), false);
        let Action::Probe { hop, .. } = drain(&mut c)[0].clone() else {
            panic!()
        };
        c.probed(hop, &[3]);
        let a3 = drain(&mut c);
        assert_eq!(starts(&a3), vec![(Sender::Node(0), 3, true)]);
    }

    /// Two neighbours die: the last node is fed by the first, past both.
    #[test]
    fn a_reroute_skips_every_node_cut_out() {
        let mut c = Chain::new(4, false);
        let a = drain(&mut c);
        c.hop_failed(hop_into(&a, 2), "reset".into(), false);
        let Action::Probe { hop, .. } = drain(&mut c)[0].clone() else {
            panic!()
        };
        c.probed(hop, &[2]); // the sender, node 1, is gone
        let a2 = drain(&mut c);
        assert_eq!(starts(&a2), vec![(Sender::Node(0), 2, true)]);
        c.hop_failed(hop_into(&a2, 2), "reset".into(), false);
        let Action::Probe { hop, .. } = drain(&mut c)[0].clone() else {
            panic!()
        };
        c.probed(hop, &[0]); // now node 2 is gone too
        let a3 = drain(&mut c);
        assert_eq!(starts(&a3), vec![(Sender::Node(0), 3, true)]);
    }
}
