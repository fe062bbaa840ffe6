//! The server's window ledger for one Move stream: see the module docs of
//! [`super`].

use std::collections::{BTreeMap, HashMap, VecDeque};

use super::EXTENT_ALIGN;
use super::{
    Bitmap, Digest, DigestChain, Failure, FileId, FrameKind, FrameSeq, IdSet, Liveness, Params,
    Reason, SeqCheck, Side, Violation, WindowId,
};
use crate::proto::{self, ClientFrame, Direction, ServerFrame};

/// Most extents in one window (a 4 MiB window of 4 KiB-aligned extents
/// holds 1024).
const MAX_EXTENTS: usize = 4096;

/// Largest file accepted (16 TiB).
pub const MAX_FILE_LEN: u64 = 16 << 40;

/// A window made reachable ([`ServerCore::granted`]): its address, its
/// rkey, and (a session over several rails) its rkey on each rail, the
/// first being `rkey`; pull: the digest of each extent as read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Granted {
    pub addr: u64,
    pub rkey: u32,
    pub rail_rkeys: Vec<u32>,
    pub digests: Vec<Digest>,
}

/// What the driver must do for the ledger. Each action that expects an
/// answer names the method that takes it.
#[derive(Debug, PartialEq, Eq)]
pub enum ServerAction {
    /// Push: resolve the destination beneath the root and create (or, with
    /// `resume`, resume) it. Pull: open the source (and compare the held
    /// blocks' identity for a resume). Answer: [`ServerCore::opened`].
    Open { file: FileId, open: proto::OpenFile },
    /// Grant window `window` in `round`: for round 0 take an arena slot for
    /// it (waiting for one if the arena is busy); for a later round revoke
    /// the remote access of the previous grant first. With `fill` (pull),
    /// read each extent's block from its file into the slot at its offset
    /// and digest it. Then give the session's data path access to the slot
    /// (REMOTE_READ with `fill`, REMOTE_WRITE without). Answer:
    /// [`ServerCore::granted`].
    Grant {
        window: WindowId,
        round: u32,
        extents: Vec<proto::Extent>,
        fill: bool,
    },
    /// Push: revoke the window's remote access, digest each extent as it
    /// landed, compare with `expected` (one per extent), write the matching
    /// blocks to their files and answer [`ServerCore::verified`] once they
    /// are written.
    Verify {
        window: WindowId,
        round: u32,
        extents: Vec<proto::Extent>,
        expected: Vec<Digest>,
    },
    /// Revoke the window's remote access and return its slot. No answer.
    Release { window: WindowId },
    /// Pull, resume: digest these blocks of the source (they do not move,
    /// but the file digest covers them). Answer: [`ServerCore::hashed`].
    Hash { file: FileId, blocks: Vec<u64> },
    /// Pull: every block of the file was read; check that the source did
    /// not change. Answer: [`ServerCore::source_checked`].
    CheckSource { file: FileId },
    /// Push: seal each file (its digest must be `digest`) and publish the
    /// batch (durable, then renamed into place). Answer:
    /// [`ServerCore::committed`] for each file.
    Commit { files: Vec<(FileId, Digest)> },
    /// The file is over: close its source, or drop its destination (kept for
    /// `--resume` when it was not committed). No answer.
    Close { file: FileId },
    /// End the stream with this outcome; the last action. The driver drops
    /// whatever it still holds for the stream (slots, registrations,
    /// destinations, suspended for resume).
    End(Result<(), Failure>),
}

/// What [`ServerAction::Open`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenedFile {
    /// Push: the length the client announced; pull: the source's.
    pub length: u64,
    pub mode: u32,
    pub mtime_ns: i64,
    /// The server-side path, relative to the root.
    pub path: String,
    /// Blocks that do not move (a resume).
    pub skip: Option<Bitmap>,
    /// Pull: the source's fingerprint.
    pub fingerprint: Vec<u8>,
}

/// What [`ServerAction::Commit`] did for one file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommittedFile {
    pub path: String,
    pub length: u64,
    pub digest: Digest,
    pub flat_sha256: Vec<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Block {
    /// Held already (resume): does not move.
    Skip,
    /// Waiting for a window.
    Queued,
    /// In a window, not yet verified (push) / released clean (pull).
    Moving,
    /// Verified and written (push) / read by the client and checked (pull).
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FileState {
    Opening,
    Open,
    /// Handed to a Commit action (push).
    Committing,
}

#[derive(Debug)]
struct File {
    dir: Direction,
    state: FileState,
    length: u64,
    blocks: Vec<Block>,
    /// Blocks that move and are not yet done.
    remaining: u64,
    /// Blocks still queued for a window.
    queued: u64,
    /// Push: the client's file digest (FileEnd).
    end: Option<Digest>,
    /// Pull: the file digest being derived from the blocks read.
    chain: Option<DigestChain>,
    /// Pull: a Hash or CheckSource action is out; FileEnd was sent.
    checking: bool,
    end_sent: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WinState {
    /// A Grant action is out.
    Granting,
    /// Granted to the client: waiting for its WindowDone.
    Granted,
    /// Push: a Verify action is out.
    Verifying,
}

#[derive(Debug)]
struct Window {
    dir: Direction,
    round: u32,
    state: WinState,
    /// The extents of the current round's grant.
    extents: Vec<proto::Extent>,
    /// Pull: their digests, as read.
    digests: Vec<Digest>,
}

#[derive(Debug, PartialEq, Eq)]
enum Phase {
    Running,
    /// End was queued.
    Ended,
}

/// The server's side of one Move stream. See the module docs of [`super`].
#[derive(Debug)]
pub struct ServerCore {
    p: Params,
    files: HashMap<FileId, File>,
    /// Files over (a duplicate OpenFile of one is ignored).
    finished: IdSet,
    /// Blocks waiting for a window, per direction: (file, first, end).
    queue_push: VecDeque<(FileId, u64, u64)>,
    queue_pull: VecDeque<(FileId, u64, u64)>,
    windows: BTreeMap<WindowId, Window>,
    next_window: WindowId,
    /// Push files ready to commit, and files of the Commit action out.
    ready: Vec<FileId>,
    committing: usize,
    /// Actions out that expect an answer.
    io: usize,
    out: ServerFrame,
    actions: VecDeque<ServerAction>,
    live: Liveness,
    /// Frame numbers, sent and heard.
    seq: FrameSeq,
    phase: Phase,
    client_closed: bool,
    /// The client sent Abort: anything after it is out of the protocol.
    aborted: bool,
    /// The first message outside the protocol, if one came.
    violation: Option<Violation>,
}

fn align_up(x: u64) -> u64 {
    x.div_ceil(EXTENT_ALIGN) * EXTENT_ALIGN
}

fn frame_is_empty(f: &ServerFrame) -> bool {
    f.opened.is_empty()
        && f.grants.is_empty()
        && f.acks.is_empty()
        && f.ends.is_empty()
        && f.committed.is_empty()
        && f.failed.is_empty()
}

impl ServerCore {
    /// A stream that starts at `now`.
    pub fn new(p: Params, now: u64) -> Self {
        ServerCore {
            p,
            files: HashMap::new(),
            finished: IdSet::starting_at(1),
            queue_push: VecDeque::new(),
            queue_pull: VecDeque::new(),
            windows: BTreeMap::new(),
            next_window: 1,
            ready: Vec::new(),
            committing: 0,
            io: 0,
            out: ServerFrame::default(),
            actions: VecDeque::new(),
            live: Liveness::new(p.timeout_ns, p.keepalive_ns, now),
            seq: FrameSeq::default(),
            phase: Phase::Running,
            client_closed: false,
            aborted: false,
            violation: None,
        }
    }

    /// The agreed parameters.
    pub fn params(&self) -> &Params {
        &self.p
    }

    /// The next thing to do, oldest first. Windows are packed and commits
    /// batched here, when the driver asks, so everything it answered since
    /// it last asked goes into the same windows and the same batch.
    pub fn poll_action(&mut self) -> Option<ServerAction> {
        if self.actions.is_empty() {
            self.pack();
            self.commit_ready();
        }
        self.actions.pop_front()
    }

    /// The frame to send now: everything queued, or a keepalive when one is
    /// due. `None`: nothing to send.
    pub fn poll_frame(&mut self, now: u64) -> Option<ServerFrame> {
        if self.phase == Phase::Ended && frame_is_empty(&self.out) {
            return None;
        }
        if frame_is_empty(&self.out) && !self.live.keepalive_due(now) {
            return None;
        }
        self.live.sent(now);
        let mut f = std::mem::take(&mut self.out);
        f.progress = self.live.progress();
        f.seq = self.seq.stamp();
        Some(f)
    }

    /// When [`handle_timeout`](Self::handle_timeout) next has work.
    pub fn poll_timeout(&self) -> Option<u64> {
        match self.phase {
            Phase::Running => self.live.next_deadline(self.waiting()),
            Phase::Ended => None,
        }
    }

    /// Time passed: end a stream whose client stopped answering or that
    /// makes no progress.
    pub fn handle_timeout(&mut self, now: u64) {
        if self.phase != Phase::Running {
            return;
        }
        if let Some(f) = self.live.expired(now, self.waiting()) {
            self.end(Err(f));
        }
    }

    /// The stream is over (the End action was queued).
    pub fn is_ended(&self) -> bool {
        self.phase == Phase::Ended
    }

    /// The id the next window will get (every id below it was granted).
    #[cfg(test)]
    pub(super) fn next_window(&self) -> WindowId {
        self.next_window
    }

    /// Windows granted (or being granted) now.
    pub fn windows_live(&self) -> usize {
        self.windows.len()
    }

    /// Files open now.
    pub fn files_open(&self) -> usize {
        self.files.len()
    }

    fn waiting(&self) -> bool {
        !(self.files.is_empty() && self.windows.is_empty() && self.io == 0)
    }

    fn action(&mut self, a: ServerAction) {
        if matches!(
            a,
            ServerAction::Open { .. }
                | ServerAction::Grant { .. }
                | ServerAction::Verify { .. }
                | ServerAction::Hash { .. }
                | ServerAction::CheckSource { .. }
                | ServerAction::Commit { .. }
        ) {
            self.io += 1;
        }
        self.actions.push_back(a);
    }

    fn answered(&mut self, now: u64) {
        self.io = self.io.saturating_sub(1);
        self.note_progress(now);
    }

    /// Something moved here (an action finished; the data path confirmed
    /// bytes): progress, and the next frame (a keepalive at least) says so.
    pub fn note_progress(&mut self, now: u64) {
        self.live.note_progress(now);
    }

    /// End the stream: a failure also goes out as FileFailed for `file`.
    fn end(&mut self, r: Result<(), Failure>) {
        if self.phase == Phase::Ended {
            return;
        }
        if let Err(f) = &r {
            tracing::debug!(reason = ?f.reason, message = %crate::escape::esc(&f.message), "move stream ends");
        }
        self.phase = Phase::Ended;
        self.actions.push_back(ServerAction::End(r));
    }

    fn fail_file(&mut self, file: FileId, f: Failure) {
        self.out.failed.push(proto::FileFailed {
            file,
            reason: f.reason as i32,
            message: f.message.clone(),
        });
        self.end(Err(f));
    }

    /// A message outside the protocol: the stream ends with it (the first
    /// one is kept; nothing is committed after it).
    fn violation(&mut self, frame: FrameKind, why: String) {
        let v = Violation::new(Side::Client, frame, why);
        if self.violation.is_none() {
            self.violation = Some(v.clone());
            if self.phase == Phase::Ended {
                // The stream is over already (an Abort), so its status
                // cannot say it: this is the one line that does.
                tracing::warn!(error = %v, "protocol violation after the end of the stream");
            }
        }
        self.end(Err(v.into()));
    }

    /// The first message outside the protocol the client sent, if any
    /// (also after the stream ended).
    pub fn violation_seen(&self) -> Option<&Violation> {
        self.violation.as_ref()
    }

    /// The client's side of the stream broke (a frame that does not decode,
    /// a transport error): the stream ends with `f`.
    pub fn client_failed(&mut self, now: u64, f: Failure) {
        self.live.heard(now, true);
        self.client_closed = true;
        self.end(Err(f));
    }

    /// The client closed its side of the stream.
    pub fn client_closed(&mut self, now: u64) {
        self.live.heard(now, true);
        self.client_closed = true;
        self.maybe_finish();
    }

    fn maybe_finish(&mut self) {
        if self.phase == Phase::Running
            && self.client_closed
            && self.files.is_empty()
            && self.windows.is_empty()
            && self.io == 0
        {
            self.end(Ok(()));
        } else if self.phase == Phase::Running && self.client_closed {
            // The client went away with work outstanding: what was written
            // stays resumable.
            let open = self.files.len();
            self.end(Err(Failure::new(
                Reason::Retryable,
                format!("the client closed the stream with {open} file(s) unfinished"),
            )));
        }
    }

    /// A frame from the client.
    pub fn handle_frame(&mut self, now: u64, f: ClientFrame) {
        match self.seq.check(f.seq) {
            SeqCheck::Take => {}
            SeqCheck::Duplicate => return self.live.heard(now, false),
            SeqCheck::Gap { expected, got } => {
                self.live.heard(now, false);
                return self.end(Err(FrameSeq::lost(expected, got)));
            }
        }
        let moved = self.live.peer_moved(f.progress);
        let progress = moved
            || !(f.open.is_empty() && f.done.is_empty() && f.end.is_empty())
            || f.abort.is_some();
        self.live.heard(now, progress);
        if self.aborted {
            // The Abort was the client's last word.
            return self.violation(
                FrameKind::AfterAbort,
                "the client sent a frame after its Abort".into(),
            );
        }
        if self.phase != Phase::Running {
            return;
        }
        if let Some(a) = f.abort {
            self.aborted = true;
            self.end(Err(Failure::new(
                Reason::Retryable,
                format!("the client aborted: {}", a.reason),
            )));
            return;
        }
        for o in f.open {
            self.on_open(o);
        }
        for d in f.done {
            if self.phase != Phase::Running {
                return;
            }
            self.on_window_done(d);
        }
        for e in f.end {
            if self.phase != Phase::Running {
                return;
            }
            self.on_file_end(e);
        }
    }

    fn on_open(&mut self, o: proto::OpenFile) {
        if self.phase != Phase::Running {
            return;
        }
        if o.file == 0 {
            return self.violation(
                FrameKind::OpenFile,
                "file id 0 is reserved: ids start at 1".into(),
            );
        }
        if self.files.contains_key(&o.file) || self.finished.contains(u64::from(o.file)) {
            // A duplicate of an OpenFile already taken.
            return;
        }
        let dir = match Direction::try_from(o.direction) {
            Ok(d @ (Direction::Push | Direction::Pull)) => d,
            _ => {
                return self.violation(
                    FrameKind::OpenFile,
                    format!(
                        "file {}: direction {} is neither push nor pull",
                        o.file, o.direction
                    ),
                )
            }
        };
        if self.files.len() >= self.p.max_open_files as usize {
            return self.violation(
                FrameKind::OpenFile,
                format!(
                    "file {}: more than {} files open at once",
                    o.file, self.p.max_open_files
                ),
            );
        }
        if dir == Direction::Push && o.length > MAX_FILE_LEN {
            return self.fail_file(
                o.file,
                Failure::new(
                    Reason::Exceeded,
                    format!(
                        "{}: length {} is over the limit {MAX_FILE_LEN}",
                        o.path, o.length
                    ),
                ),
            );
        }
        self.files.insert(
            o.file,
            File {
                dir,
                state: FileState::Opening,
                length: 0,
                blocks: Vec::new(),
                remaining: 0,
                queued: 0,
                end: None,
                chain: None,
                checking: false,
                end_sent: false,
            },
        );
        let file = o.file;
        self.action(ServerAction::Open { file, open: o });
    }

    /// The answer to [`ServerAction::Open`].
    pub fn opened(&mut self, now: u64, file: FileId, r: Result<OpenedFile, Failure>) {
        self.answered(now);
        if self.phase != Phase::Running {
            return;
        }
        let o = match r {
            Ok(o) => o,
            Err(f) => return self.fail_file(file, f),
        };
        let p = self.p;
        let Some(fs) = self.files.get_mut(&file) else {
            return;
        };
        let n = p.blocks(o.length);
        if o.skip.as_ref().is_some_and(|s| s.len != n) {
            return self.fail_file(file, Failure::invalid("resume bitmap of the wrong length"));
        }
        fs.state = FileState::Open;
        fs.length = o.length;
        fs.blocks = (0..n)
            .map(|b| match &o.skip {
                Some(s) if s.get(b) => Block::Skip,
                _ => Block::Queued,
            })
            .collect();
        let moving = fs.blocks.iter().filter(|b| **b == Block::Queued).count() as u64;
        fs.remaining = moving;
        fs.queued = moving;
        let dir = fs.dir;
        // Queue runs of moving blocks in order.
        let mut runs = Vec::new();
        let mut b = 0;
        while b < n {
            if fs.blocks[b as usize] == Block::Queued {
                let s = b;
                while b < n && fs.blocks[b as usize] == Block::Queued {
                    b += 1;
                }
                runs.push((file, s, b));
            } else {
                b += 1;
            }
        }
        let skipped: Vec<u64> = (0..n)
            .filter(|&b| fs.blocks[b as usize] == Block::Skip)
            .collect();
        if dir == Direction::Pull {
            fs.chain = Some(DigestChain::new(p.check, o.length, p.block_size));
        }
        match dir {
            Direction::Push => self.queue_push.extend(runs),
            _ => self.queue_pull.extend(runs),
        }
        self.out.opened.push(proto::Opened {
            file,
            length: o.length,
            mode: o.mode,
            mtime_ns: o.mtime_ns,
            path: o.path,
            skip_blocks: o.skip.map(|s| s.bits).unwrap_or_default(),
            resumed: !skipped.is_empty(),
            source_fingerprint: o.fingerprint,
        });
        if dir == Direction::Pull {
            if skipped.is_empty() {
                self.pull_progress(file);
            } else {
                if let Some(fs) = self.files.get_mut(&file) {
                    fs.checking = true;
                }
                self.action(ServerAction::Hash {
                    file,
                    blocks: skipped,
                });
            }
        } else {
            self.push_progress(file);
        }
    }

    /// Grant windows while the session may have more and blocks wait.
    fn pack(&mut self) {
        while self.phase == Phase::Running && self.windows.len() < self.p.window_count as usize {
            let dir = if !self.queue_push.is_empty() {
                Direction::Push
            } else if !self.queue_pull.is_empty() {
                Direction::Pull
            } else {
                return;
            };
            let p = self.p;
            let queue = match dir {
                Direction::Push => &mut self.queue_push,
                _ => &mut self.queue_pull,
            };
            let mut extents = Vec::new();
            let mut off = 0u64;
            while let Some(&mut (file, ref mut b, e)) = queue.front_mut() {
                let Some(fs) = self.files.get_mut(&file) else {
                    queue.pop_front();
                    continue;
                };
                let len = p.block_len(fs.length, *b);
                if off + u64::from(len) > p.window_size || extents.len() >= MAX_EXTENTS {
                    break;
                }
                extents.push(proto::Extent {
                    file,
                    block: *b,
                    offset: off,
                    len,
                });
                fs.blocks[*b as usize] = Block::Moving;
                fs.queued -= 1;
                off = align_up(off + u64::from(len));
                *b += 1;
                if *b == e {
                    queue.pop_front();
                }
            }
            if extents.is_empty() {
                return;
            }
            let window = self.next_window;
            self.next_window += 1;
            self.windows.insert(
                window,
                Window {
                    dir,
                    round: 0,
                    state: WinState::Granting,
                    extents: extents.clone(),
                    digests: Vec::new(),
                },
            );
            self.action(ServerAction::Grant {
                window,
                round: 0,
                extents,
                fill: dir == Direction::Pull,
            });
        }
    }

    /// The answer to [`ServerAction::Grant`]: where the window is and its
    /// keys; pull: the digest of each extent as read.
    pub fn granted(&mut self, now: u64, window: WindowId, round: u32, r: Result<Granted, Failure>) {
        self.answered(now);
        if self.phase != Phase::Running {
            return;
        }
        let Granted {
            addr,
            rkey,
            rail_rkeys,
            digests,
        } = match r {
            Ok(v) => v,
            Err(f) => return self.end(Err(f)),
        };
        let Some(w) = self.windows.get_mut(&window) else {
            return;
        };
        if w.round != round || w.state != WinState::Granting {
            return;
        }
        if w.dir == Direction::Pull && digests.len() != w.extents.len() {
            return self.end(Err(Failure::new(
                Reason::Other,
                "a window was filled with the wrong number of digests",
            )));
        }
        w.state = WinState::Granted;
        w.digests = digests.clone();
        let len = w
            .extents
            .iter()
            .map(|e| e.offset + u64::from(e.len))
            .max()
            .unwrap_or(0);
        let extents = w.extents.clone();
        let dir = w.dir;
        self.out.grants.push(proto::Grant {
            window,
            round,
            addr,
            rkey,
            rail_rkeys,
            len,
            extents: extents.clone(),
            digests: if dir == Direction::Pull {
                digests.clone()
            } else {
                Vec::new()
            },
        });
        if dir == Direction::Pull && round == 0 {
            let mut touched = Vec::new();
            for (e, d) in extents.iter().zip(digests) {
                if let Some(fs) = self.files.get_mut(&e.file) {
                    if let Some(c) = fs.chain.as_mut() {
                        c.add(e.block, d);
                    }
                    touched.push(e.file);
                }
            }
            touched.dedup();
            for f in touched {
                self.pull_progress(f);
            }
        }
    }

    fn on_window_done(&mut self, d: proto::WindowDone) {
        let dl = self.p.digest_len();
        let Some(w) = self.windows.get_mut(&d.window) else {
            if d.window == 0 {
                self.violation(
                    FrameKind::WindowDone,
                    "window 0 was never granted (window ids start at 1)".into(),
                );
            } else if d.window >= self.next_window {
                self.violation(
                    FrameKind::WindowDone,
                    format!("window {} was never granted", d.window),
                );
            }
            // Otherwise: a duplicate of a window already finished.
            return;
        };
        if d.round < w.round || (d.round == w.round && w.state == WinState::Verifying) {
            return; // stale or duplicate
        }
        if d.round > w.round || w.state != WinState::Granted {
            let m = format!(
                "window {} round {} is not granted (current round {})",
                d.window, d.round, w.round
            );
            return self.violation(FrameKind::WindowDone, m);
        }
        match w.dir {
            Direction::Push => {
                if d.digests.len() != w.extents.len() || d.digests.iter().any(|x| x.len() != dl) {
                    let m = format!(
                        "window {} needs {} block digests of {dl} bytes, got {}",
                        d.window,
                        w.extents.len(),
                        d.digests.len()
                    );
                    return self.violation(FrameKind::WindowDone, m);
                }
                w.state = WinState::Verifying;
                let (extents, round) = (w.extents.clone(), w.round);
                self.action(ServerAction::Verify {
                    window: d.window,
                    round,
                    extents,
                    expected: d.digests,
                });
            }
            _ => {
                let mut bad = d.bad;
                bad.sort_unstable();
                bad.dedup();
                if bad.iter().any(|&i| i as usize >= w.extents.len()) {
                    let m = format!(
                        "window {}: re-read of extents {bad:?} it does not have",
                        d.window
                    );
                    return self.violation(FrameKind::WindowDone, m);
                }
                self.settle(d.window, bad);
            }
        }
    }

    /// The answer to [`ServerAction::Verify`]: indices of the extents whose
    /// digest did not match (every other one is written).
    pub fn verified(
        &mut self,
        now: u64,
        window: WindowId,
        round: u32,
        r: Result<Vec<u32>, Failure>,
    ) {
        self.answered(now);
        if self.phase != Phase::Running {
            return;
        }
        let bad = match r {
            Ok(b) => b,
            Err(f) => return self.end(Err(f)),
        };
        match self.windows.get(&window) {
            Some(w) if w.round == round && w.state == WinState::Verifying => {}
            _ => return,
        }
        self.settle(window, bad);
    }

    /// A window's current extents are done except `bad`: release it, or
    /// grant the bad ones again.
    fn settle(&mut self, window: WindowId, mut bad: Vec<u32>) {
        bad.sort_unstable();
        bad.dedup();
        let w = self
            .windows
            .get_mut(&window)
            .expect("checked by the caller");
        let (dir, round) = (w.dir, w.round);
        let extents = std::mem::take(&mut w.extents);
        let mut again = Vec::new();
        let mut touched = Vec::new();
        for (i, e) in extents.iter().enumerate() {
            if bad.binary_search(&(i as u32)).is_ok() {
                again.push(*e);
                continue;
            }
            if let Some(fs) = self.files.get_mut(&e.file) {
                if fs.blocks[e.block as usize] == Block::Moving {
                    fs.blocks[e.block as usize] = Block::Done;
                    fs.remaining -= 1;
                }
                touched.push(e.file);
            }
        }
        touched.dedup();
        if dir == Direction::Push {
            self.out.acks.push(proto::Ack {
                window,
                resend: bad.clone(),
            });
        }
        if again.is_empty() {
            self.windows.remove(&window);
            self.actions.push_back(ServerAction::Release { window });
        } else if round >= self.p.max_retries {
            let what = again
                .iter()
                .map(|e| format!("file {} block {}", e.file, e.block))
                .collect::<Vec<_>>()
                .join(", ");
            let file = again[0].file;
            return self.fail_file(
                file,
                Failure::new(
                    Reason::Integrity,
                    format!(
                        "{what} still did not match its digest after {} {}",
                        self.p.max_retries,
                        if dir == Direction::Push {
                            "resends"
                        } else {
                            "re-reads"
                        }
                    ),
                ),
            );
        } else {
            let w = self.windows.get_mut(&window).expect("still live");
            w.round += 1;
            w.state = WinState::Granting;
            w.extents = again.clone();
            w.digests.clear();
            let round = w.round;
            tracing::debug!(
                window,
                round,
                blocks = again.len(),
                "granting damaged blocks again"
            );
            self.action(ServerAction::Grant {
                window,
                round,
                extents: again,
                fill: dir == Direction::Pull,
            });
        }
        for f in touched {
            match dir {
                Direction::Push => self.push_progress(f),
                _ => self.pull_progress(f),
            }
        }
        self.maybe_finish_if_closed();
    }

    fn maybe_finish_if_closed(&mut self) {
        if self.client_closed {
            self.maybe_finish();
        }
    }

    fn on_file_end(&mut self, e: proto::FileEnd) {
        let dl = self.p.digest_len();
        let Some(fs) = self.files.get_mut(&e.file) else {
            if e.file == 0 {
                self.violation(
                    FrameKind::FileEnd,
                    "file 0 was never opened (file ids start at 1)".into(),
                );
            } else if !self.finished.contains(u64::from(e.file)) {
                self.violation(
                    FrameKind::FileEnd,
                    format!("file {} was never opened", e.file),
                );
            }
            // Otherwise: a duplicate for a file already over.
            return;
        };
        if fs.dir != Direction::Push {
            return self.violation(
                FrameKind::FileEnd,
                format!("FileEnd for pulled file {}", e.file),
            );
        }
        if fs.state == FileState::Opening {
            // The client cannot have sent the file's blocks before Opened.
            return self.violation(
                FrameKind::FileEnd,
                format!("file {} is not open yet (no Opened was sent)", e.file),
            );
        }
        if e.digest.len() != dl {
            return self.violation(
                FrameKind::FileEnd,
                format!(
                    "file {}: a file digest of {} bytes, not {dl}",
                    e.file,
                    e.digest.len()
                ),
            );
        }
        match &fs.end {
            Some(d) if *d != e.digest => {
                return self.violation(
                    FrameKind::FileEnd,
                    format!("file {}: two different file digests", e.file),
                )
            }
            Some(_) => return,
            None => fs.end = Some(e.digest),
        }
        self.push_progress(e.file);
    }

    /// Push: a file whose every moving block is verified and whose digest
    /// came is ready to commit.
    fn push_progress(&mut self, file: FileId) {
        let Some(fs) = self.files.get_mut(&file) else {
            return;
        };
        if fs.state == FileState::Open && fs.remaining == 0 && fs.end.is_some() {
            fs.state = FileState::Committing;
            self.ready.push(file);
        }
    }

    /// Commit every ready file in one batch, unless a batch is out: files
    /// that get ready meanwhile form the next one (group commit).
    fn commit_ready(&mut self) {
        if self.phase != Phase::Running || self.committing > 0 || self.ready.is_empty() {
            return;
        }
        let files: Vec<(FileId, Digest)> = std::mem::take(&mut self.ready)
            .into_iter()
            .filter_map(|f| {
                let d = self.files.get(&f)?.end.clone()?;
                Some((f, d))
            })
            .collect();
        if files.is_empty() {
            return;
        }
        self.committing = files.len();
        self.action(ServerAction::Commit { files });
    }

    /// The answer to [`ServerAction::Commit`], for one file of the batch.
    pub fn committed(&mut self, now: u64, file: FileId, r: Result<CommittedFile, Failure>) {
        self.committing = self.committing.saturating_sub(1);
        if self.committing == 0 {
            self.answered(now);
        } else {
            self.note_progress(now);
        }
        if self.phase != Phase::Running {
            return;
        }
        match r {
            Ok(c) => {
                if self.files.remove(&file).is_none() {
                    return;
                }
                self.finished.insert(u64::from(file));
                self.out.committed.push(proto::Committed {
                    file,
                    digest: c.digest,
                    path: c.path,
                    length: c.length,
                    flat_sha256: c.flat_sha256,
                });
                self.actions.push_back(ServerAction::Close { file });
            }
            Err(f) => return self.fail_file(file, f),
        }
        self.maybe_finish_if_closed();
    }

    /// The answer to [`ServerAction::Hash`].
    pub fn hashed(&mut self, now: u64, file: FileId, r: Result<Vec<(u64, Digest)>, Failure>) {
        self.answered(now);
        if self.phase != Phase::Running {
            return;
        }
        let ds = match r {
            Ok(d) => d,
            Err(f) => return self.fail_file(file, f),
        };
        let Some(fs) = self.files.get_mut(&file) else {
            return;
        };
        if let Some(c) = fs.chain.as_mut() {
            for (b, d) in ds {
                c.add(b, d);
            }
        }
        fs.checking = false;
        self.pull_progress(file);
    }

    /// Pull: once every block was read, check the source; once checked,
    /// send FileEnd; once every block was released clean, the file is over.
    fn pull_progress(&mut self, file: FileId) {
        let Some(fs) = self.files.get_mut(&file) else {
            return;
        };
        if fs.state != FileState::Open {
            return;
        }
        if !fs.end_sent
            && !fs.checking
            && fs.queued == 0
            && fs.chain.as_ref().is_some_and(DigestChain::is_complete)
        {
            fs.checking = true;
            self.action(ServerAction::CheckSource { file });
            return;
        }
        if fs.end_sent && fs.remaining == 0 {
            self.files.remove(&file);
            self.finished.insert(u64::from(file));
            self.actions.push_back(ServerAction::Close { file });
            self.maybe_finish_if_closed();
        }
    }

    /// The answer to [`ServerAction::CheckSource`].
    pub fn source_checked(&mut self, now: u64, file: FileId, r: Result<(), Failure>) {
        self.answered(now);
        if self.phase != Phase::Running {
            return;
        }
        if let Err(f) = r {
            return self.fail_file(file, f);
        }
        let Some(fs) = self.files.get_mut(&file) else {
            return;
        };
        let digest = fs
            .chain
            .take()
            .and_then(DigestChain::finish)
            .expect("checked only when complete");
        fs.checking = false;
        fs.end_sent = true;
        self.out.ends.push(proto::FileEnd { file, digest });
        self.pull_progress(file);
    }
}
