//! A buffer operation's cores: the rounds of `BufferGrant` → WRITEs or
//! READs → `BufferDone` → granted again, as plain state with time passed
//! in (the files' rounds are [`super::ServerCore`] and
//! [`super::ClientCore`]'s). The drivers (`control::buffers::grant` on the
//! exposing rcpd, `control::buffers::peer` on the initiating one) register
//! and revoke keys, post windows, hash ranges and send the RPCs; these
//! cores decide what each answer means.
//!
//! # Types that matter
//! - [`GrantCore`]: the exposing side of one grant: which ranges move in
//!   this round, the round against the session's `max_retries`, ranges
//!   granted again so far, and the round's deadline
//!   ([`GrantCore::poll_timeout`]): a peer that says nothing for the
//!   timeout loses the grant.
//! - [`OpCore`]: the initiating side of one operation: checks the grant and
//!   every range granted again (count, rail rkeys by the files' rule
//!   [`super::rail_rkeys_fit`], only ranges that were moving, the round
//!   bound) and decides whether the operation is done, moves ranges again
//!   or is damaged.
//!
//! # What the cores guarantee (tested in `buffer_tests`, over a link that
//! drops, duplicates and reorders RPCs)
//! - Nothing unverified is reported done: an operation is done only when
//!   every range's last move was verified (a write by the exposer, which
//!   hashes what landed; a read by the initiator, which hashes what it
//!   read); an exposer ends a write's grant as written only then.
//! - Rounds are bounded: at most `max_retries` rounds after the first, on
//!   both sides; a peer that grants past the bound broke the protocol.
//! - No grant stays: a grant ends with its operation's last `BufferDone`,
//!   its failure, or its round's timeout, whichever comes first.
//! - A `BufferDone` of another round (a duplicate, a late one) changes
//!   nothing.

use super::{rail_rkeys_fit, Failure, Reason};
use crate::proto;

/// A range's index among its operation's (and its grant's).
pub type RangeIdx = u32;

/// Where a grant stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrantPhase {
    /// Its ranges are registered for the peer, which moves them.
    Live,
    /// A `BufferDone` came: the round's keys are revoked and its ranges
    /// verified ([`GrantCore::verified`] next).
    Verifying,
    /// Over: nothing of it may be registered any more.
    Ended,
}

/// What a `BufferDone` asks of the exposer's driver, its keys revoked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DoneStep {
    /// The operation failed on the peer: end the grant (tell the owner
    /// nothing).
    Failed,
    /// Hash these ranges (a write's, in this round) and compare each with
    /// the peer's digest; [`GrantCore::verified`] with those that differ.
    Hash(Vec<RangeIdx>),
    /// Nothing to hash (a read, whose peer compared; or no check): these
    /// did not match; [`GrantCore::verified`] with them.
    Checked(Vec<RangeIdx>),
}

/// What the exposer does after a round's verification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GrantNext {
    /// Register these ranges again for the next round (the leases kept)
    /// and answer with them granted again; [`GrantCore::regrant_failed`]
    /// if that fails.
    Regrant(Vec<RangeIdx>),
    /// The grant is over: answer `bad` and tell the owner (the ranges in
    /// `bad` did not match in the end; none: it moved intact).
    End { bad: Vec<RangeIdx> },
}

/// The exposing side of one grant.
#[derive(Clone, Debug)]
pub struct GrantCore {
    ranges: u32,
    write: bool,
    /// Ranges are checked (the session's check is not `none`).
    checked: bool,
    /// The ranges moving in this round: every one in the first, then the
    /// ones granted again.
    moving: Vec<RangeIdx>,
    round: u32,
    resent: u32,
    max_retries: u32,
    timeout_ns: u64,
    deadline: u64,
    phase: GrantPhase,
}

impl GrantCore {
    /// A grant of `ranges` ranges made at `now`, for a write or a read,
    /// on a session that retries `max_retries` rounds and whose peer must
    /// answer each round within `timeout_ns`.
    pub fn new(
        ranges: u32,
        write: bool,
        checked: bool,
        max_retries: u32,
        timeout_ns: u64,
        now: u64,
    ) -> GrantCore {
        GrantCore {
            ranges,
            write,
            checked,
            moving: (0..ranges).collect(),
            round: 0,
            resent: 0,
            max_retries,
            timeout_ns,
            deadline: now.saturating_add(timeout_ns),
            phase: GrantPhase::Live,
        }
    }

    pub fn phase(&self) -> GrantPhase {
        self.phase
    }

    /// The round now (0: the first).
    pub fn round(&self) -> u32 {
        self.round
    }

    /// Ranges granted again so far, over all rounds.
    pub fn resent(&self) -> u32 {
        self.resent
    }

    /// The ranges moving in this round.
    pub fn moving(&self) -> &[RangeIdx] {
        &self.moving
    }

    /// When the grant expires unless its peer answers the round: while it
    /// is live.
    pub fn poll_timeout(&self) -> Option<u64> {
        (self.phase == GrantPhase::Live).then_some(self.deadline)
    }

    /// Time passed: `true` when the grant expired now (its peer said
    /// nothing for the round's timeout; the driver revokes it).
    pub fn handle_timeout(&mut self, now: u64) -> bool {
        if self.phase == GrantPhase::Live && now >= self.deadline {
            self.phase = GrantPhase::Ended;
            return true;
        }
        false
    }

    /// The peer's `BufferDone`. An error ends a live grant (the request
    /// broke the protocol), except for a `BufferDone` of another round (a
    /// late or repeated one), which changes nothing: the grant stays in
    /// its phase.
    pub fn done(&mut self, req: &proto::BufferDoneRequest) -> Result<DoneStep, Failure> {
        match self.phase {
            GrantPhase::Live => {}
            GrantPhase::Verifying => {
                return Err(Failure::new(
                    Reason::Protocol,
                    format!(
                        "a BufferDone for grant {} while its last one is verified",
                        req.grant
                    ),
                ))
            }
            GrantPhase::Ended => {
                return Err(Failure::new(
                    Reason::Retryable,
                    format!("grant {} is over (revoked or timed out)", req.grant),
                ))
            }
        }
        if let Some(r) = req.round.filter(|&r| r != self.round) {
            // Not this round's: a duplicate or a late one. The grant goes
            // on; its peer is not listening for this answer.
            return Err(Failure::new(
                Reason::Protocol,
                format!(
                    "a BufferDone for round {r} of grant {}, which is in round {}",
                    req.grant, self.round
                ),
            ));
        }
        if !req.failed.is_empty() {
            self.phase = GrantPhase::Ended;
            return Ok(DoneStep::Failed);
        }
        let step = self.step(req);
        self.phase = if step.is_ok() {
            GrantPhase::Verifying
        } else {
            GrantPhase::Ended
        };
        step
    }

    fn step(&self, req: &proto::BufferDoneRequest) -> Result<DoneStep, Failure> {
        if !self.write {
            let mut bad = req.bad.clone();
            bad.sort_unstable();
            bad.dedup();
            if let Some(i) = bad.iter().find(|i| !self.moving.contains(i)) {
                return Err(Failure::new(
                    Reason::Protocol,
                    format!(
                        "range {i} was not read in round {} of grant {}",
                        self.round, req.grant
                    ),
                ));
            }
            return Ok(DoneStep::Checked(bad));
        }
        if !self.checked {
            return Ok(DoneStep::Checked(Vec::new()));
        }
        if req.digests.len() != self.ranges as usize {
            return Err(Failure::new(
                Reason::Invalid,
                format!("{} digests for {} ranges", req.digests.len(), self.ranges),
            ));
        }
        Ok(DoneStep::Hash(self.moving.clone()))
    }

    /// The round verified at `now`: `bad` did not match. With a session
    /// still open (`may_regrant`) and rounds left, they are granted again;
    /// else the grant ends.
    pub fn verified(&mut self, now: u64, bad: Vec<RangeIdx>, may_regrant: bool) -> GrantNext {
        debug_assert_eq!(self.phase, GrantPhase::Verifying);
        if !bad.is_empty() && may_regrant && self.round < self.max_retries {
            self.round += 1;
            self.resent += bad.len() as u32;
            self.moving = bad.clone();
            self.deadline = now.saturating_add(self.timeout_ns);
            self.phase = GrantPhase::Live;
            return GrantNext::Regrant(bad);
        }
        self.phase = GrantPhase::Ended;
        GrantNext::End { bad }
    }

    /// Registering the ranges granted again failed: the grant is over.
    pub fn regrant_failed(&mut self) {
        self.phase = GrantPhase::Ended;
    }
}

/// What the initiator does after a round's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpNext {
    /// Every range moved and matched.
    Done,
    /// Move these ranges again, where the peer granted them.
    Again(Vec<(RangeIdx, proto::GrantedRange)>),
    /// These ranges still did not match after `rounds` rounds of resends:
    /// the operation failed ([`damaged_message`]).
    Damaged { bad: Vec<RangeIdx>, rounds: u32 },
}

/// The initiating side of one operation.
#[derive(Clone, Debug)]
pub struct OpCore {
    ranges: u32,
    read: bool,
    rails: u32,
    max_retries: u32,
    round: u32,
    moving: Vec<RangeIdx>,
    granted: bool,
    over: bool,
}

impl OpCore {
    /// An operation (a write or a read) of `ranges` ranges on a session of
    /// `rails` rails whose peer retries at most `max_retries` rounds.
    pub fn new(ranges: u32, write: bool, rails: u32, max_retries: u32) -> OpCore {
        OpCore {
            ranges,
            read: !write,
            rails,
            max_retries,
            round: 0,
            moving: (0..ranges).collect(),
            granted: false,
            over: false,
        }
    }

    /// The round now (0: the first); what its `BufferDone` names.
    pub fn round(&self) -> u32 {
        self.round
    }

    /// The ranges moving in this round.
    pub fn moving(&self) -> &[RangeIdx] {
        &self.moving
    }

    /// Whether it is over (done, damaged or broken).
    pub fn is_over(&self) -> bool {
        self.over
    }

    /// Check the peer's grant: a range for each, each with a key per rail.
    pub fn granted(&mut self, g: &proto::BufferGrantResponse) -> Result<(), Failure> {
        if self.granted {
            return Err(self.broke("BufferGrant", "a second grant".into()));
        }
        if g.ranges.len() != self.ranges as usize {
            return Err(self.broke(
                "BufferGrant",
                format!("granted {} ranges for {}", g.ranges.len(), self.ranges),
            ));
        }
        self.check_rails("BufferGrant", &g.ranges)?;
        self.granted = true;
        Ok(())
    }

    /// The round's answer. `mine`: for a read, the ranges that did not
    /// match here (the driver hashed what landed); for a write, none.
    pub fn round_done(
        &mut self,
        mine: &[RangeIdx],
        resp: proto::BufferDoneResponse,
    ) -> Result<OpNext, Failure> {
        if self.over || !self.granted {
            return Err(self.broke("BufferDone", "an answer for no round".into()));
        }
        if let Some(i) = resp.bad.iter().find(|i| !self.moving.contains(i)) {
            return Err(self.broke(
                "BufferDone",
                format!(
                    "range {i} is bad but was not moving in round {}",
                    self.round
                ),
            ));
        }
        if resp.again.is_empty() {
            self.over = true;
            let mut bad = if resp.bad.is_empty() {
                // A peer that takes no notice of a read's mismatch still
                // fails it.
                mine.to_vec()
            } else {
                resp.bad
            };
            bad.sort_unstable();
            bad.dedup();
            return Ok(if bad.is_empty() {
                OpNext::Done
            } else {
                OpNext::Damaged {
                    bad,
                    rounds: self.round,
                }
            });
        }
        if self.round >= self.max_retries {
            return Err(self.broke(
                "BufferDone",
                format!(
                    "round {} is past the retry bound {}",
                    self.round + 1,
                    self.max_retries
                ),
            ));
        }
        if resp.again.len() != resp.bad.len() {
            return Err(self.broke(
                "BufferDone",
                format!(
                    "{} ranges granted again for {} bad",
                    resp.again.len(),
                    resp.bad.len()
                ),
            ));
        }
        let mut seen = resp.bad.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != resp.bad.len() {
            return Err(self.broke(
                "BufferDone",
                "a range granted again twice in one round".into(),
            ));
        }
        if self.read {
            // A read's bad ranges are the ones this side found: each is
            // read again, or one would be left damaged and called done.
            let mut want = mine.to_vec();
            want.sort_unstable();
            want.dedup();
            if seen != want {
                return Err(self.broke(
                    "BufferDone",
                    format!("ranges {seen:?} granted again where {want:?} were read bad"),
                ));
            }
        }
        self.check_rails("BufferDone", &resp.again)?;
        self.round += 1;
        self.moving = resp.bad.clone();
        Ok(OpNext::Again(
            resp.bad.into_iter().zip(resp.again).collect(),
        ))
    }

    /// The operation failed before its end (a data path, a cancel, an
    /// RPC): it is over.
    pub fn abandon(&mut self) {
        self.over = true;
    }

    fn check_rails(&mut self, what: &str, ranges: &[proto::GrantedRange]) -> Result<(), Failure> {
        match ranges
            .iter()
            .position(|g| !rail_rkeys_fit(self.rails, g.rkey, &g.rail_rkeys))
        {
            None => Ok(()),
            Some(i) => Err(self.broke(
                what,
                format!(
                    "range {i} granted with {} rail rkeys on a session of {} rails",
                    ranges[i].rail_rkeys.len(),
                    self.rails
                ),
            )),
        }
    }

    /// The peer broke the protocol: the operation is over. (The message
    /// reads after the peer's name.)
    fn broke(&mut self, what: &str, why: String) -> Failure {
        self.over = true;
        broken(what, why)
    }
}

/// What the initiator does after a standing operation's notice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StandingNext {
    /// Every range moved and matched; the owner was told.
    Done,
    /// Move these ranges again (the grant stands) and notify the next
    /// round.
    Again(Vec<RangeIdx>),
    /// These ranges still did not match after `rounds` rounds of resends;
    /// the owner was told it failed.
    Damaged { bad: Vec<RangeIdx>, rounds: u32 },
}

/// The initiating side of one operation under a standing grant
/// (`BufferGrantResponse.standing`): its ranges move without a grant each,
/// then a `BufferNotice` tells the exposer, whose answer says which did not
/// match and whether it told the owner (ended). The checks of the answer
/// ([`StandingCore::answered`]): bad ranges are among those that moved in
/// the round, each once; a peer that leaves the operation open past the
/// bound it announced (`max_retries`), or with nothing bad, broke the
/// protocol.
#[derive(Clone, Debug)]
pub struct StandingCore {
    max_retries: u32,
    round: u32,
    resent: u32,
    moving: Vec<RangeIdx>,
    over: bool,
}

impl StandingCore {
    /// An operation of `ranges` ranges on a session whose peer retries at
    /// most `max_retries` rounds.
    pub fn new(ranges: u32, max_retries: u32) -> StandingCore {
        StandingCore {
            max_retries,
            round: 0,
            resent: 0,
            moving: (0..ranges).collect(),
            over: false,
        }
    }

    /// The round now (0: the first), as the notice names it.
    pub fn round(&self) -> u32 {
        self.round
    }

    /// Ranges moved again before this round (the notice's `resent`).
    pub fn resent(&self) -> u32 {
        self.resent
    }

    /// The ranges moving in this round.
    pub fn moving(&self) -> &[RangeIdx] {
        &self.moving
    }

    /// The exposer's answer to the round's notice.
    pub fn answered(&mut self, r: &proto::BufferNoticeResult) -> Result<StandingNext, Failure> {
        if self.over {
            return Err(self.broke("an answer after the operation's end".into()));
        }
        if !r.error.is_empty() {
            self.over = true;
            let reason = Reason::try_from(r.reason).unwrap_or(Reason::Other);
            return Err(Failure::new(reason, r.error.clone()));
        }
        let mut bad = r.bad.clone();
        bad.sort_unstable();
        bad.dedup();
        if bad.len() != r.bad.len() {
            return Err(self.broke("a range bad twice in one answer".into()));
        }
        if let Some(i) = bad.iter().find(|i| !self.moving.contains(i)) {
            return Err(self.broke(format!(
                "range {i} is bad but was not moving in round {}",
                self.round
            )));
        }
        if bad.is_empty() {
            if !r.ended {
                return Err(self.broke("nothing bad, yet the operation goes on".into()));
            }
            self.over = true;
            return Ok(StandingNext::Done);
        }
        if r.ended {
            self.over = true;
            return Ok(StandingNext::Damaged {
                bad,
                rounds: self.round,
            });
        }
        if self.round >= self.max_retries {
            return Err(self.broke(format!(
                "round {} is past the retry bound {}",
                self.round + 1,
                self.max_retries
            )));
        }
        self.round += 1;
        self.resent += bad.len() as u32;
        self.moving = bad.clone();
        Ok(StandingNext::Again(bad))
    }

    fn broke(&mut self, why: String) -> Failure {
        self.over = true;
        broken("BufferNotify", why)
    }
}

/// The peer broke the protocol in its answer to `what`: why. (The message
/// reads after the peer's name.)
fn broken(what: &str, why: String) -> Failure {
    Failure::new(
        Reason::Protocol,
        format!("broke the protocol: {what}: {why}"),
    )
}

/// The message of a damaged operation's end.
pub fn damaged_message(write: bool, bad: &[RangeIdx], rounds: u32) -> String {
    let after = if rounds > 0 {
        format!(
            " after {rounds} {}",
            if write { "resends" } else { "re-reads" }
        )
    } else {
        String::new()
    };
    if write {
        format!("ranges {bad:?} did not land intact{after}")
    } else {
        format!("ranges {bad:?} read do not match their digests{after}")
    }
}
