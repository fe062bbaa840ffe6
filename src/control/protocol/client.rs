//! The client's side of one Move stream: see the module docs of [`super`].

use std::collections::{HashMap, VecDeque};

use super::rail_watch::RailWatch;
use super::{
    Bitmap, Digest, DigestChain, Failure, FileId, FrameKind, FrameSeq, IdSet, Liveness, Params,
    Reason, SeqCheck, Side, Violation, WindowId,
};
use crate::proto::{self, ClientFrame, Direction, ServerFrame};

/// A file the job wants moved (the driver keeps its local path).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FileSpec {
    pub direction: Direction,
    /// Path beneath the server root. Push: the destination (an existing
    /// directory means "inside it", as `name`); pull: the source.
    pub remote: String,
    /// Push: the name inside an existing remote directory.
    pub name: String,
    pub preserve: bool,
    pub resume: bool,
    pub create_parents: bool,
    /// Ask the receiving side for the flat SHA-256 too.
    pub flat_sha256: bool,
    /// Push `--delta`: blocks the destination holds already (a bitmap as
    /// `OpenFile.have_blocks`) and their digests, in block order.
    pub keep_blocks: Vec<u8>,
    pub keep_digests: Vec<Vec<u8>>,
    /// Push: the fan-out this file belongs to (`OpenFile.fanout`).
    pub fanout: String,
    /// A tree's file (`create_parents`) whose destination name was free
    /// when the plan looked: the receiving side need not look again
    /// before it makes the file (`OpenFile.absent`).
    pub absent: bool,
}

/// Push: what [`ClientAction::OpenSource`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceMeta {
    pub length: u64,
    pub mode: u32,
    pub mtime_ns: i64,
    pub fingerprint: Vec<u8>,
}

/// Pull with resume: what [`ClientAction::FindResume`] found of an
/// interrupted copy: the verified blocks and the source identity they were
/// read from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Held {
    pub blocks: Bitmap,
    pub length: u64,
    pub mtime_ns: i64,
    pub fingerprint: Vec<u8>,
}

/// What the driver must do for the client. Each action that expects an
/// answer names the method that takes it.
#[derive(Debug, PartialEq)]
pub enum ClientAction {
    /// Push: open the local source (length, mode, mtime, fingerprint).
    /// Answer: [`ClientCore::source_ready`].
    OpenSource { file: FileId },
    /// Pull with resume: look for an interrupted copy of the file. Answer:
    /// [`ClientCore::resume_found`].
    FindResume { file: FileId },
    /// Pull: create the local destination for the file the server opened
    /// (or keep the resumed one when `opened.resumed`). Answer:
    /// [`ClientCore::dest_ready`].
    CreateDest { file: FileId, opened: proto::Opened },
    /// Push: read each extent's block from its file into a staging slot at
    /// its offset, digest it, WRITE the extents into the granted window and
    /// answer [`ClientCore::sent`] with the digests once the WRITEs
    /// completed.
    Send { grant: proto::Grant },
    /// Pull: READ the grant's extents into a staging slot, check each
    /// against `grant.digests`, write the matching blocks to their files and
    /// answer [`ClientCore::fetched`] with the indices that did not match.
    Fetch { grant: proto::Grant },
    /// Push, resume: digest these blocks of the source (they do not move;
    /// the file digest covers them). Answer: [`ClientCore::hashed`].
    Hash { file: FileId, blocks: Vec<u64> },
    /// Push: every block was read; check the source did not change.
    /// Answer: [`ClientCore::source_checked`].
    CheckSource { file: FileId },
    /// Pull: seal each file (its digest must be `digest`) and publish the
    /// batch. Answer: [`ClientCore::committed`] for each file.
    Commit { files: Vec<(FileId, Digest)> },
    /// The file is over: release its local resources. No answer.
    Close { file: FileId },
    /// End the stream with this outcome; the last action.
    End(Result<(), Failure>),
}

/// A file finished.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileDone {
    pub file: FileId,
    /// Push: the server's path (relative to its root).
    pub remote_path: String,
    pub length: u64,
    /// Bytes of the blocks that moved (less than `length` after a resume).
    pub moved: u64,
    pub digest: Digest,
    /// When asked for: push, the server's; pull, the local destination's.
    pub flat_sha256: Vec<u8>,
    pub resumed: bool,
}

/// What happened, for the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientEvent {
    FileDone(FileDone),
}

/// Pull: what [`ClientAction::Commit`] did for one file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalCommit {
    /// The flat SHA-256, when the file asked for it.
    pub flat_sha256: Vec<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Not started (over the open limit).
    Queued,
    /// OpenSource / FindResume out.
    Preparing,
    /// OpenFile sent.
    Opening,
    /// Pull: CreateDest out.
    Creating,
    Open,
    /// Pull: handed to a Commit action.
    Committing,
}

#[derive(Debug)]
struct File {
    spec: FileSpec,
    state: State,
    length: u64,
    blocks: u64,
    skip: Option<Bitmap>,
    /// Blocks that move.
    moving: u64,
    /// Push: moving blocks sent in round 0 (their digests in `chain`);
    /// pull: moving blocks checked and written.
    done: u64,
    /// Push: the file digest being derived.
    chain: Option<DigestChain>,
    /// Push: Hash or CheckSource out / FileEnd sent.
    checking: bool,
    end_sent: bool,
    /// Pull: the server's file digest.
    end: Option<Digest>,
    held: Option<Held>,
    resumed: bool,
    remote_path: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WinState {
    /// Send / Fetch out.
    Moving,
    /// Pull: fetched, waiting until its files are ready.
    Held,
    /// Done sent; push: waiting for the Ack; pull: for the next round.
    Answered,
}

#[derive(Debug)]
struct Window {
    dir: Direction,
    round: u32,
    state: WinState,
    grant: proto::Grant,
    /// Pull: the grant's first extents, this many, are of files known to
    /// have their destinations (files open in order, so each look at a
    /// held window goes on from here rather than from its first extent).
    open_upto: usize,
}

#[derive(Debug, PartialEq, Eq)]
enum Phase {
    Running,
    Ended,
}

/// The client's side of one Move stream. See the module docs of [`super`].
#[derive(Debug)]
pub struct ClientCore {
    p: Params,
    files: HashMap<FileId, File>,
    queued: VecDeque<FileId>,
    active: usize,
    next_file: FileId,
    windows: HashMap<WindowId, Window>,
    /// Windows over (a duplicate grant of one is ignored).
    finished: IdSet,
    ready: Vec<FileId>,
    committing: usize,
    io: usize,
    no_more: bool,
    out: ClientFrame,
    actions: VecDeque<ClientAction>,
    events: VecDeque<ClientEvent>,
    live: Liveness,
    /// Frame numbers, sent and heard.
    seq: FrameSeq,
    phase: Phase,
    /// The data path's confirmed bytes, as last told.
    confirmed: u64,
    /// `--transport auto`: the rails' watch, which says why the stream
    /// gave up on RDMA, for the tcp fallback.
    watch: Option<RailWatch>,
}

fn frame_is_empty(f: &ClientFrame) -> bool {
    f.open.is_empty() && f.done.is_empty() && f.end.is_empty() && f.abort.is_none()
}

impl ClientCore {
    /// A stream of `session` that starts at `now`.
    pub fn new(p: Params, session: u64, now: u64) -> Self {
        ClientCore {
            p,
            files: HashMap::new(),
            queued: VecDeque::new(),
            active: 0,
            next_file: 1,
            windows: HashMap::new(),
            finished: IdSet::starting_at(1),
            ready: Vec::new(),
            committing: 0,
            io: 0,
            no_more: false,
            out: ClientFrame {
                session_id: session,
                ..ClientFrame::default()
            },
            actions: VecDeque::new(),
            events: VecDeque::new(),
            live: Liveness::new(p.timeout_ns, p.keepalive_ns, now),
            seq: FrameSeq::default(),
            phase: Phase::Running,
            confirmed: 0,
            watch: None,
        }
    }

    /// The agreed parameters.
    pub fn params(&self) -> &Params {
        &self.p
    }

    /// `--transport auto`, from `now` on: give up on the RDMA data path
    /// (abort as [`Reason::Retryable`], saying why in
    /// [`fallback`](Self::fallback)) once every rail has failed since the
    /// last confirmed byte, that byte is more than `after_ns` old, and
    /// windows wait on the data path. That covers links that are down
    /// (ports down, rails fenced and waiting) and paths that drop RDMA
    /// traffic (rails failing again as soon as they reconnect), and not a
    /// copy with nothing to move. The driver tells the counters
    /// ([`data_path`](Self::data_path)); the decision and its clock are
    /// the [`RailWatch`]'s, the rule buffer sessions use too.
    pub fn watch_rails(&mut self, now: u64, after_ns: u64) {
        self.watch(RailWatch::new(now, after_ns));
    }

    /// [`watch_rails`](Self::watch_rails) with the watch made
    /// (`control::fallback::rail_watch`).
    pub fn watch(&mut self, w: RailWatch) {
        self.watch = Some(w);
    }

    /// The data path's counters at `now`: bytes confirmed so far (bytes
    /// landing are progress before their window's answer is: a slow link
    /// is not a stalled client), and each rail's failures so far.
    pub fn data_path(&mut self, now: u64, confirmed: u64, rail_failures: &[u64]) {
        if confirmed > self.confirmed {
            self.confirmed = confirmed;
            self.note_progress(now);
        }
        let waiting = self.phase == Phase::Running && self.data_path_waits();
        let Some(w) = &mut self.watch else {
            return;
        };
        if w.data_path(now, confirmed, rail_failures, waiting) {
            let why = w.gave_up().unwrap_or_default().to_string();
            tracing::warn!("{why}");
            self.abort(Failure::new(Reason::Retryable, why));
        }
    }

    /// The data path failed with `f`: the stream ends; with the rails
    /// watched and `f` retryable, the tcp fallback is why.
    pub fn data_path_failed(&mut self, f: Failure) {
        if self.phase == Phase::Running {
            if let Some(w) = &mut self.watch {
                if w.failed(&f) {
                    tracing::warn!("{}", w.gave_up().unwrap_or_default());
                }
            }
        }
        self.abort(f);
    }

    /// Why the stream gave up on RDMA (the rails' watch), if it did.
    pub fn fallback(&self) -> Option<&str> {
        self.watch.as_ref().and_then(RailWatch::gave_up)
    }

    /// Windows wait on the data path (their Send or Fetch is out).
    fn data_path_waits(&self) -> bool {
        self.windows.values().any(|w| w.state == WinState::Moving)
    }

    /// When the rails' watch next decides.
    fn watch_deadline(&self) -> Option<u64> {
        self.watch.as_ref()?.deadline(self.data_path_waits())
    }

    /// Files that could start now without waiting (feed about this many).
    pub fn room(&self) -> usize {
        (self.p.max_open_files as usize).saturating_sub(self.active + self.queued.len())
    }

    /// Files added and not yet finished.
    pub fn unfinished(&self) -> usize {
        self.files.len()
    }

    /// Move a file; its id names it in actions and events.
    pub fn add_file(&mut self, spec: FileSpec) -> FileId {
        let file = self.next_file;
        self.next_file += 1;
        self.files.insert(
            file,
            File {
                spec,
                state: State::Queued,
                length: 0,
                blocks: 0,
                skip: None,
                moving: 0,
                done: 0,
                chain: None,
                checking: false,
                end_sent: false,
                end: None,
                held: None,
                resumed: false,
                remote_path: String::new(),
            },
        );
        self.queued.push_back(file);
        self.start_files();
        file
    }

    /// No more files will be added: the stream ends once every file is over.
    pub fn finish(&mut self) {
        self.no_more = true;
        self.maybe_finish();
    }

    /// Give up, telling the server why.
    pub fn abort(&mut self, f: Failure) {
        if self.phase == Phase::Running {
            self.out.abort = Some(proto::Abort {
                reason: f.message.clone(),
            });
            self.end(Err(f));
        }
    }

    /// The next thing to do, oldest first. Pulled files are committed here,
    /// when the driver asks, so every file it finished since it last asked
    /// goes into the same batch.
    pub fn poll_action(&mut self) -> Option<ClientAction> {
        if self.actions.is_empty() {
            self.commit_ready();
        }
        self.actions.pop_front()
    }

    /// The next event for the job.
    pub fn poll_event(&mut self) -> Option<ClientEvent> {
        self.events.pop_front()
    }

    /// The frame to send now, or a keepalive when due.
    pub fn poll_frame(&mut self, now: u64) -> Option<ClientFrame> {
        if frame_is_empty(&self.out)
            && (self.phase == Phase::Ended || !self.live.keepalive_due(now))
        {
            return None;
        }
        self.live.sent(now);
        let session = self.out.session_id;
        let mut f = std::mem::take(&mut self.out);
        self.out.session_id = session;
        // Files whose `--delta` digests would make the frame larger than a
        // message may be go in the next frames.
        self.out.open = f.open.split_off(opens_that_fit(&f.open));
        f.progress = self.live.progress();
        f.seq = self.seq.stamp();
        Some(f)
    }

    /// When [`handle_timeout`](Self::handle_timeout) next has work.
    pub fn poll_timeout(&self) -> Option<u64> {
        match self.phase {
            Phase::Running => [
                self.live.next_deadline(self.waiting()),
                self.watch_deadline(),
            ]
            .into_iter()
            .flatten()
            .min(),
            Phase::Ended => None,
        }
    }

    /// Time passed: end a stream whose server stopped answering or that
    /// makes no progress.
    pub fn handle_timeout(&mut self, now: u64) {
        if self.phase != Phase::Running {
            return;
        }
        if let Some(f) = self.live.expired(now, self.waiting()) {
            self.end(Err(f));
        }
    }

    /// The End action was queued.
    pub fn is_ended(&self) -> bool {
        self.phase == Phase::Ended
    }

    fn waiting(&self) -> bool {
        !(self.files.is_empty() && self.windows.is_empty() && self.io == 0)
    }

    fn action(&mut self, a: ClientAction) {
        if !matches!(a, ClientAction::Close { .. } | ClientAction::End(_)) {
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

    fn end(&mut self, r: Result<(), Failure>) {
        if self.phase == Phase::Ended {
            return;
        }
        self.phase = Phase::Ended;
        self.actions.push_back(ClientAction::End(r));
    }

    /// A message outside the protocol from the server: the stream ends.
    fn violation(&mut self, frame: FrameKind, why: String) {
        self.end(Err(Violation::new(Side::Server, frame, why).into()));
    }

    fn maybe_finish(&mut self) {
        if self.phase == Phase::Running
            && self.no_more
            && self.files.is_empty()
            && self.windows.is_empty()
            && self.io == 0
        {
            self.end(Ok(()));
        }
    }

    /// Start queued files while under the open limit.
    fn start_files(&mut self) {
        while self.phase == Phase::Running && self.active < self.p.max_open_files as usize {
            let Some(file) = self.queued.pop_front() else {
                return;
            };
            let Some(f) = self.files.get_mut(&file) else {
                continue;
            };
            self.active += 1;
            match f.spec.direction {
                Direction::Push => {
                    f.state = State::Preparing;
                    self.action(ClientAction::OpenSource { file });
                }
                _ if f.spec.resume => {
                    f.state = State::Preparing;
                    self.action(ClientAction::FindResume { file });
                }
                _ => self.send_open(file, None),
            }
        }
    }

    fn send_open(&mut self, file: FileId, meta: Option<SourceMeta>) {
        let Some(f) = self.files.get_mut(&file) else {
            return;
        };
        f.state = State::Opening;
        let s = &f.spec;
        let mut o = proto::OpenFile {
            file,
            direction: s.direction as i32,
            path: s.remote.clone(),
            name: s.name.clone(),
            preserve: s.preserve,
            resume: s.resume,
            create_parents: s.create_parents,
            flat_sha256: s.flat_sha256,
            keep_blocks: s.keep_blocks.clone(),
            keep_digests: s.keep_digests.clone(),
            fanout: s.fanout.clone(),
            absent: s.absent && s.direction == Direction::Push,
            ..Default::default()
        };
        if let Some(m) = meta {
            o.length = m.length;
            o.mode = m.mode;
            o.mtime_ns = m.mtime_ns;
            o.source_fingerprint = m.fingerprint;
        }
        if let Some(h) = &f.held {
            o.have_blocks = h.blocks.bits.clone();
            o.have_length = h.length;
            o.have_mtime_ns = h.mtime_ns;
            o.source_fingerprint = h.fingerprint.clone();
        }
        self.out.open.push(o);
    }

    /// The answer to [`ClientAction::OpenSource`].
    pub fn source_ready(&mut self, now: u64, file: FileId, r: Result<SourceMeta, Failure>) {
        self.answered(now);
        if self.phase != Phase::Running {
            return;
        }
        match r {
            Ok(m) => {
                if let Some(f) = self.files.get_mut(&file) {
                    f.length = m.length;
                }
                self.send_open(file, Some(m));
            }
            Err(f) => self.abort(f),
        }
    }

    /// The answer to [`ClientAction::FindResume`].
    pub fn resume_found(&mut self, now: u64, file: FileId, r: Result<Option<Held>, Failure>) {
        self.answered(now);
        if self.phase != Phase::Running {
            return;
        }
        match r {
            Ok(h) => {
                if let Some(f) = self.files.get_mut(&file) {
                    f.held = h;
                }
                self.send_open(file, None);
            }
            Err(f) => self.abort(f),
        }
    }

    /// A frame from the server.
    pub fn handle_frame(&mut self, now: u64, f: ServerFrame) {
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
            || !(f.opened.is_empty()
                && f.grants.is_empty()
                && f.acks.is_empty()
                && f.ends.is_empty()
                && f.committed.is_empty()
                && f.failed.is_empty());
        self.live.heard(now, progress);
        if self.phase != Phase::Running {
            return;
        }
        if let Some(ff) = f.failed.into_iter().next() {
            let reason = Reason::try_from(ff.reason).unwrap_or(Reason::Other);
            // Said by rcpd, about its side.
            return self.end(Err(Failure::new(reason, format!("rcpd: {}", ff.message))));
        }
        for o in f.opened {
            self.on_opened(o);
        }
        for g in f.grants {
            if self.phase != Phase::Running {
                return;
            }
            self.on_grant(g);
        }
        for a in f.acks {
            self.on_ack(a);
        }
        for e in f.ends {
            self.on_end(e);
        }
        for c in f.committed {
            self.on_committed(c);
        }
        self.maybe_finish();
    }

    fn on_opened(&mut self, o: proto::Opened) {
        let p = self.p;
        let Some(f) = self.files.get_mut(&o.file) else {
            return self.violation(
                FrameKind::Opened,
                format!("Opened for unknown file {}", o.file),
            );
        };
        if f.state != State::Opening {
            return; // duplicate
        }
        let dir = f.spec.direction;
        if dir == Direction::Push && o.length != f.length {
            let want = f.length;
            return self.violation(
                FrameKind::Opened,
                format!(
                    "file {}: opened with length {} instead of {want}",
                    o.file, o.length
                ),
            );
        }
        let n = p.blocks(o.length);
        let skip = if o.skip_blocks.is_empty() {
            None
        } else {
            match Bitmap::from_bytes(o.skip_blocks.clone(), n) {
                Some(b) => Some(b),
                None => {
                    return self.violation(
                        FrameKind::Opened,
                        format!("file {}: a bad skip bitmap", o.file),
                    )
                }
            }
        };
        if let (Direction::Pull, Some(s)) = (dir, &skip) {
            // Only blocks we hold may be skipped.
            let held = f.held.as_ref().map(|h| &h.blocks);
            if (0..n).any(|b| s.get(b) && !held.is_some_and(|h| h.get(b))) {
                return self.violation(
                    FrameKind::Opened,
                    format!("file {}: skips blocks we do not hold", o.file),
                );
            }
        }
        f.length = o.length;
        f.blocks = n;
        f.moving = n - skip.as_ref().map_or(0, |s| s.count());
        f.resumed = o.resumed;
        f.remote_path = o.path.clone();
        let skipped: Vec<u64> = match &skip {
            Some(s) => (0..n).filter(|&b| s.get(b)).collect(),
            None => Vec::new(),
        };
        f.skip = skip;
        let file = o.file;
        match dir {
            Direction::Push => {
                f.state = State::Open;
                f.chain = Some(DigestChain::new(p.check, o.length, p.block_size));
                if !skipped.is_empty() {
                    f.checking = true;
                    self.action(ClientAction::Hash {
                        file,
                        blocks: skipped,
                    });
                } else {
                    self.push_progress(file);
                }
            }
            _ => {
                f.state = State::Creating;
                self.action(ClientAction::CreateDest { file, opened: o });
            }
        }
    }

    /// The answer to [`ClientAction::CreateDest`].
    pub fn dest_ready(&mut self, now: u64, file: FileId, r: Result<(), Failure>) {
        self.answered(now);
        if self.phase != Phase::Running {
            return;
        }
        if let Err(f) = r {
            return self.abort(f);
        }
        if let Some(f) = self.files.get_mut(&file) {
            f.state = State::Open;
        }
        // Windows held until their files had destinations.
        let held: Vec<WindowId> = self
            .windows
            .iter()
            .filter(|(_, w)| w.state == WinState::Held)
            .map(|(&id, _)| id)
            .collect();
        for id in held {
            self.try_fetch(id);
        }
        self.pull_progress(file);
    }

    fn on_grant(&mut self, g: proto::Grant) {
        let p = self.p;
        if let Some(w) = self.windows.get(&g.window) {
            if g.round <= w.round {
                return; // duplicate
            }
            if g.round != w.round + 1 || w.state != WinState::Answered {
                return self.violation(
                    FrameKind::Grant,
                    format!(
                        "window {} granted in round {} while in round {}",
                        g.window, g.round, w.round
                    ),
                );
            }
            if g.round > p.max_retries {
                return self.violation(
                    FrameKind::Grant,
                    format!("window {} granted {} times", g.window, g.round),
                );
            }
        } else if g.round != 0 || self.finished.contains(g.window) {
            // A grant of a window already over: a duplicate.
            return;
        } else if self.windows.len() >= p.window_count as usize {
            return self.violation(
                FrameKind::Grant,
                format!("more than {} windows granted at once", p.window_count),
            );
        }
        let dir = match self.check_extents(&g) {
            Ok(d) => d,
            Err(m) => return self.violation(FrameKind::Grant, m),
        };
        match self.windows.get_mut(&g.window) {
            Some(w) => {
                w.round = g.round;
                w.grant = g.clone();
                w.state = WinState::Moving;
                w.open_upto = 0;
            }
            None => {
                self.windows.insert(
                    g.window,
                    Window {
                        dir,
                        round: g.round,
                        state: WinState::Moving,
                        grant: g.clone(),
                        open_upto: 0,
                    },
                );
            }
        }
        match dir {
            Direction::Push => self.action(ClientAction::Send { grant: g }),
            _ => {
                self.windows.get_mut(&g.window).expect("inserted").state = WinState::Held;
                self.try_fetch(g.window);
            }
        }
    }

    /// Check a grant's extents against the files; the direction they share.
    fn check_extents(&self, g: &proto::Grant) -> Result<Direction, String> {
        let p = self.p;
        if g.len > p.window_size {
            return Err(format!("window {} of {} bytes", g.window, g.len));
        }
        if !super::rail_rkeys_fit(p.rails, g.rkey, &g.rail_rkeys) {
            // Several rails: the window's key on each, rail 0's first.
            return Err(format!(
                "window {}: a grant with {} rail rkeys on a session of {} rails",
                g.window,
                g.rail_rkeys.len(),
                p.rails
            ));
        }
        let mut dir = None;
        let mut end = 0u64;
        for (i, e) in g.extents.iter().enumerate() {
            let Some(f) = self.files.get(&e.file) else {
                return Err(format!("window {} names unknown file {}", g.window, e.file));
            };
            if !matches!(f.state, State::Open | State::Creating) {
                return Err(format!(
                    "window {} names file {} before it opened",
                    g.window, e.file
                ));
            }
            if *dir.get_or_insert(f.spec.direction) != f.spec.direction {
                return Err(format!("window {} mixes directions", g.window));
            }
            if e.block >= f.blocks
                || f.skip.as_ref().is_some_and(|s| s.get(e.block))
                || e.len != p.block_len(f.length, e.block)
            {
                return Err(format!(
                    "window {}: file {} block {} ({} bytes) is not a block that moves",
                    g.window, e.file, e.block, e.len
                ));
            }
            if (i > 0 && e.offset < end) || e.offset + u64::from(e.len) > g.len {
                return Err(format!("window {}: extents overlap or overflow", g.window));
            }
            end = e.offset + u64::from(e.len);
        }
        let dir = dir.ok_or_else(|| format!("window {} has no extents", g.window))?;
        if dir == Direction::Pull
            && (g.digests.len() != g.extents.len()
                || g.digests.iter().any(|d| d.len() != p.digest_len()))
        {
            return Err(format!(
                "window {}: digests do not match its extents",
                g.window
            ));
        }
        Ok(dir)
    }

    /// Pull: fetch a window once every file in it has a destination.
    fn try_fetch(&mut self, window: WindowId) {
        let Some(w) = self.windows.get(&window) else {
            return;
        };
        if w.state != WinState::Held {
            return;
        }
        let files = &self.files;
        let more = w.grant.extents[w.open_upto..]
            .iter()
            .take_while(|e| files.get(&e.file).is_some_and(|f| f.state == State::Open))
            .count();
        let w = self.windows.get_mut(&window).expect("present");
        w.open_upto += more;
        if w.open_upto < w.grant.extents.len() {
            return;
        }
        w.state = WinState::Moving;
        let grant = w.grant.clone();
        self.action(ClientAction::Fetch { grant });
    }

    /// The answer to [`ClientAction::Send`]: the digest of each extent, in
    /// order.
    pub fn sent(
        &mut self,
        now: u64,
        window: WindowId,
        round: u32,
        r: Result<Vec<Digest>, Failure>,
    ) {
        self.answered(now);
        if self.phase != Phase::Running {
            return;
        }
        let digests = match r {
            Ok(d) => d,
            Err(f) => return self.abort(f),
        };
        let Some(w) = self.windows.get_mut(&window) else {
            return;
        };
        if w.round != round || w.state != WinState::Moving {
            return;
        }
        w.state = WinState::Answered;
        let extents = w.grant.extents.clone();
        self.out.done.push(proto::WindowDone {
            window,
            round,
            digests: digests.clone(),
            bad: Vec::new(),
        });
        if round == 0 {
            let mut touched = Vec::new();
            for (e, d) in extents.iter().zip(digests) {
                if let Some(f) = self.files.get_mut(&e.file) {
                    if let Some(c) = f.chain.as_mut() {
                        c.add(e.block, d);
                    }
                    f.done += 1;
                    touched.push(e.file);
                }
            }
            touched.dedup();
            for f in touched {
                self.push_progress(f);
            }
        }
    }

    /// The answer to [`ClientAction::Fetch`]: indices of the extents whose
    /// digest did not match (every other block is written).
    pub fn fetched(
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
        let mut bad = match r {
            Ok(b) => b,
            Err(f) => return self.abort(f),
        };
        bad.sort_unstable();
        bad.dedup();
        let Some(w) = self.windows.get_mut(&window) else {
            return;
        };
        if w.round != round || w.state != WinState::Moving {
            return;
        }
        let extents = w.grant.extents.clone();
        if bad.is_empty() {
            self.windows.remove(&window);
            self.finished.insert(window);
        } else {
            w.state = WinState::Answered;
        }
        self.out.done.push(proto::WindowDone {
            window,
            round,
            digests: Vec::new(),
            bad: bad.clone(),
        });
        let mut touched = Vec::new();
        for (i, e) in extents.iter().enumerate() {
            if bad.binary_search(&(i as u32)).is_ok() {
                continue;
            }
            if let Some(f) = self.files.get_mut(&e.file) {
                f.done += 1;
                touched.push(e.file);
            }
        }
        touched.dedup();
        for f in touched {
            self.pull_progress(f);
        }
        self.maybe_finish();
    }

    fn on_ack(&mut self, a: proto::Ack) {
        let Some(w) = self.windows.get(&a.window) else {
            return; // duplicate
        };
        if w.dir != Direction::Push {
            return self.violation(
                FrameKind::Ack,
                format!("Ack for pulled window {}", a.window),
            );
        }
        if w.state != WinState::Answered {
            return; // stale: an Ack of an earlier round
        }
        if a.resend.is_empty() {
            self.windows.remove(&a.window);
            self.finished.insert(a.window);
        }
        // Otherwise the next round's grant says what to send again.
    }

    fn on_end(&mut self, e: proto::FileEnd) {
        let dl = self.p.digest_len();
        let Some(f) = self.files.get_mut(&e.file) else {
            return;
        };
        if f.spec.direction != Direction::Pull || e.digest.len() != dl {
            return self.violation(
                FrameKind::FileEnd,
                format!("a bad FileEnd for file {}", e.file),
            );
        }
        if f.end.is_none() {
            f.end = Some(e.digest);
        }
        self.pull_progress(e.file);
    }

    fn on_committed(&mut self, c: proto::Committed) {
        let Some(f) = self.files.get(&c.file) else {
            return; // duplicate
        };
        if f.spec.direction != Direction::Push || !f.end_sent {
            return self.violation(
                FrameKind::Committed,
                format!("file {} committed before its FileEnd", c.file),
            );
        }
        let f = self.files.remove(&c.file).expect("present");
        self.active -= 1;
        let moved = moved_bytes(&self.p, &f);
        self.events.push_back(ClientEvent::FileDone(FileDone {
            file: c.file,
            remote_path: c.path,
            length: f.length,
            moved,
            digest: c.digest,
            flat_sha256: c.flat_sha256,
            resumed: f.resumed,
        }));
        self.actions.push_back(ClientAction::Close { file: c.file });
        self.start_files();
    }

    /// Push: every moving block sent and every digest in: check the source,
    /// then send FileEnd.
    fn push_progress(&mut self, file: FileId) {
        let Some(f) = self.files.get_mut(&file) else {
            return;
        };
        if f.state == State::Open
            && !f.checking
            && !f.end_sent
            && f.done == f.moving
            && f.chain.as_ref().is_some_and(DigestChain::is_complete)
        {
            f.checking = true;
            self.action(ClientAction::CheckSource { file });
        }
    }

    /// The answer to [`ClientAction::Hash`].
    pub fn hashed(&mut self, now: u64, file: FileId, r: Result<Vec<(u64, Digest)>, Failure>) {
        self.answered(now);
        if self.phase != Phase::Running {
            return;
        }
        let ds = match r {
            Ok(d) => d,
            Err(f) => return self.abort(f),
        };
        if let Some(f) = self.files.get_mut(&file) {
            if let Some(c) = f.chain.as_mut() {
                for (b, d) in ds {
                    c.add(b, d);
                }
            }
            f.checking = false;
        }
        self.push_progress(file);
    }

    /// The answer to [`ClientAction::CheckSource`].
    pub fn source_checked(&mut self, now: u64, file: FileId, r: Result<(), Failure>) {
        self.answered(now);
        if self.phase != Phase::Running {
            return;
        }
        if let Err(f) = r {
            return self.abort(f);
        }
        let Some(f) = self.files.get_mut(&file) else {
            return;
        };
        let Some(digest) = f.chain.take().and_then(DigestChain::finish) else {
            return;
        };
        f.checking = false;
        f.end_sent = true;
        self.out.end.push(proto::FileEnd { file, digest });
    }

    /// Pull: a file whose every moving block is written and whose digest
    /// came is ready to commit.
    fn pull_progress(&mut self, file: FileId) {
        let Some(f) = self.files.get_mut(&file) else {
            return;
        };
        if f.state == State::Open && f.done == f.moving && f.end.is_some() {
            f.state = State::Committing;
            self.ready.push(file);
        }
    }

    fn commit_ready(&mut self) {
        if self.phase != Phase::Running || self.committing > 0 || self.ready.is_empty() {
            return;
        }
        let files: Vec<(FileId, Digest)> = std::mem::take(&mut self.ready)
            .into_iter()
            .filter_map(|f| Some((f, self.files.get(&f)?.end.clone()?)))
            .collect();
        if files.is_empty() {
            return;
        }
        self.committing = files.len();
        self.action(ClientAction::Commit { files });
    }

    /// The answer to [`ClientAction::Commit`], for one file of the batch.
    pub fn committed(&mut self, now: u64, file: FileId, r: Result<LocalCommit, Failure>) {
        self.committing = self.committing.saturating_sub(1);
        if self.committing == 0 {
            self.answered(now);
        } else {
            self.note_progress(now);
        }
        if self.phase != Phase::Running {
            return;
        }
        let c = match r {
            Ok(c) => c,
            Err(f) => return self.abort(f),
        };
        let Some(f) = self.files.remove(&file) else {
            return;
        };
        self.active -= 1;
        let moved = moved_bytes(&self.p, &f);
        self.events.push_back(ClientEvent::FileDone(FileDone {
            file,
            remote_path: f.remote_path.clone(),
            length: f.length,
            moved,
            digest: f.end.clone().unwrap_or_default(),
            flat_sha256: c.flat_sha256,
            resumed: f.resumed,
        }));
        self.actions.push_back(ClientAction::Close { file });
        self.start_files();
        self.maybe_finish();
    }

    /// The server ended the stream (its status, or the end of the stream).
    pub fn server_closed(&mut self, now: u64, r: Result<(), Failure>) {
        self.live.heard(now, true);
        match r {
            Err(f) => self.end(Err(f)),
            Ok(()) if self.files.is_empty() && self.windows.is_empty() => self.maybe_finish(),
            Ok(()) => self.end(Err(Failure::new(
                Reason::Retryable,
                "the server ended the stream early",
            ))),
        }
    }
}

fn moved_bytes(p: &Params, f: &File) -> u64 {
    (0..f.blocks)
        .filter(|&b| !f.skip.as_ref().is_some_and(|s| s.get(b)))
        .map(|b| u64::from(p.block_len(f.length, b)))
        .sum()
}

/// Bytes of `--delta` digests one frame carries in its `OpenFile`s, half
/// a message ([`crate::control::MAX_MESSAGE`]): the rest of the frame and
/// its encoding fit in the other half.
pub const OPEN_DIGEST_BYTES: usize = crate::control::MAX_MESSAGE / 2;

/// How many of `open`, from the first, one frame carries: at least one,
/// and no more than [`OPEN_DIGEST_BYTES`] of their digests together.
fn opens_that_fit(open: &[proto::OpenFile]) -> usize {
    let mut bytes = 0;
    for (i, o) in open.iter().enumerate() {
        bytes += open_digest_bytes(o);
        if i > 0 && bytes > OPEN_DIGEST_BYTES {
            return i;
        }
    }
    open.len()
}

/// What an `OpenFile`'s `--delta` digests add to its frame, with their
/// encoding.
fn open_digest_bytes(o: &proto::OpenFile) -> usize {
    o.keep_blocks.len() + o.keep_digests.iter().map(|d| d.len() + 2).sum::<usize>()
}

#[cfg(test)]
mod frame_tests {
    use super::*;

    fn open_with(digests: usize) -> proto::OpenFile {
        proto::OpenFile {
            keep_digests: vec![vec![0; 32]; digests],
            ..Default::default()
        }
    }

    #[test]
    fn delta_digests_of_many_files_span_frames() {
        // Three files of 25 000 digests (850 kB each): two fit a frame.
        let three = vec![open_with(25_000), open_with(25_000), open_with(25_000)];
        assert_eq!(opens_that_fit(&three), 2);
        assert!(open_digest_bytes(&three[0]) * 2 <= OPEN_DIGEST_BYTES);
        // One alone goes whatever its size; small ones all go.
        assert_eq!(opens_that_fit(&[open_with(100_000), open_with(1)]), 1);
        assert_eq!(opens_that_fit(&vec![open_with(10); 50]), 50);
        assert_eq!(opens_that_fit(&[]), 0);
    }
}
