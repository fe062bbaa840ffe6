//! The driver of one Move stream: frames in and out of a
//! [`ServerCore`], its I/O actions on blocking threads (their answers come
//! back over a channel and are fed to the core in batches), time passed in.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, OwnedSemaphorePermit, TryAcquireError};
use tonic::{Status, Streaming};

use super::io::{FileHandle, StreamIo, WindowSlot};
use super::limits::{ClientId, Watchdog};
use super::session::MoveSlot;
use super::Service;
use crate::control::error::ControlError;
use crate::control::protocol::{
    files_whole_in, CommittedFile, Digest, Failure, FileId, FrameKind, Granted, OpenedFile, Reason,
    ServerAction, ServerCore, Side, Violation, WindowId,
};
use crate::metrics::{ClientLimit, Outcome};
use crate::proto::{self, ClientFrame, Direction, ServerFrame};

type Tx = mpsc::Sender<Result<ServerFrame, Status>>;

/// What opening a file gave.
type OpenResult = Result<(FileHandle, OpenedFile), Failure>;

/// An answer from a blocking job.
enum Done {
    Opened(Vec<(FileId, OpenResult)>),
    Granted {
        window: WindowId,
        round: u32,
        slot: Option<WindowSlot>,
        /// Pull: the window was filled from the file (bytes moved).
        fill: bool,
        r: Result<Granted, Failure>,
        /// Pull: the sources of the files the window held whole, checked by
        /// the job that read them ([`Driver::prechecked`]).
        checked: Vec<(FileId, Result<(), Failure>)>,
    },
    Verified {
        window: WindowId,
        round: u32,
        slot: WindowSlot,
        r: Result<Vec<u32>, Failure>,
    },
    Hashed(FileId, Result<Vec<(u64, Digest)>, Failure>),
    Checked(FileId, Result<(), Failure>),
    Committed(Vec<(FileId, Result<CommittedFile, Failure>)>),
    /// Answers of a batch of small jobs, sent at once.
    Many(Vec<Done>),
}

/// Opens answered in the first chunk of a batch ([`open_chunks`]).
const FIRST_OPENS: usize = 32;

/// How a batch of `n` opens is answered: in chunks of [`FIRST_OPENS`],
/// then twice as many each time. A stream's first frame opens up to
/// `--max-open-files` (1024) files at once; answered together, the first
/// window was granted only once the last of them was open (~7 ms of small
/// files), with the client waiting. Answered in growing chunks, the first
/// window is granted, filled and moving while the rest are opened, and a
/// large batch still costs a few hand-offs, not one per file.
fn open_chunks(n: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let (mut left, mut next) = (n, FIRST_OPENS);
    while left > 0 {
        let c = next.min(left);
        out.push(c);
        left -= c;
        next *= 2;
    }
    out
}

/// A commit batch this large is published as two halves at once
/// ([`commit_parts`]).
const SPLIT_COMMIT: usize = 128;

/// A group commit's batch as the jobs that publish it. Files verified
/// while a batch was out form the next one, so the last batch of a tree
/// of small files holds hundreds, published one by one (~16 µs each on
/// tmpfs) with the client idle: two halves at once take half that. Each
/// half is a group commit of its own (its sync, then its renames). A
/// batch that names a path twice stays whole: its order decides which
/// lands last.
fn commit_parts<F>(batch: Vec<(F, FileHandle, Digest)>) -> Vec<Vec<(F, FileHandle, Digest)>> {
    if batch.len() < SPLIT_COMMIT {
        return vec![batch];
    }
    let mut seen = std::collections::HashSet::with_capacity(batch.len());
    let distinct = batch.iter().all(|(_, h, _)| match h {
        FileHandle::Push { path, .. } => seen.insert(path.as_str()),
        FileHandle::Pull { .. } => true,
    });
    if !distinct {
        return vec![batch];
    }
    let mut first = batch;
    let second = first.split_off(first.len() / 2);
    vec![first, second]
}

/// What the driver knows of an open file.
struct FileInfo {
    held: FileHandle,
    length: u64,
    started: Instant,
}

/// Run one Move stream to its end.
pub(super) async fn run(
    svc: Arc<Service>,
    client: ClientId,
    mut rx: Streaming<ClientFrame>,
    tx: Tx,
) {
    let timeout = svc.cfg.timeout;
    let first = match tokio::time::timeout(timeout, rx.message()).await {
        Ok(Ok(Some(f))) => f,
        Ok(Ok(None)) => return,
        Ok(Err(s)) => {
            tracing::debug!(status = %s, "move stream broke before its first frame");
            let _ = tx.send(Err(ControlError::from(s).into())).await;
            return;
        }
        Err(_) => {
            let e = Failure::new(Reason::Retryable, "no frame from the client");
            let _ = tx.send(Err(e.into())).await;
            return;
        }
    };
    let session = match svc.session(first.session_id, client) {
        Ok(s) => s,
        Err(e) => {
            let _ = tx.send(Err(e.into())).await;
            return;
        }
    };
    // One stream per session at a time: a second would double every
    // per-session limit (windows, open files).
    let Some(slot) = session.begin_move() else {
        let v = Violation::new(
            Side::Client,
            FrameKind::Move,
            format!(
                "session {:#x} already has a Move stream running (one at a time)",
                first.session_id
            ),
        );
        tracing::warn!(error = %v, "second Move stream refused");
        let _ = tx.send(Err(Failure::from(v).into())).await;
        return;
    };
    session
        .moved
        .store(true, std::sync::atomic::Ordering::Relaxed);
    // Wait for a transfer slot, the client's share first; the client hears
    // keepalives meanwhile, so a queued client does not take the wait for a
    // dead server.
    let keepalive = Duration::from_nanos(session.params.keepalive_ns);
    let mine = match svc.client_slots.try_acquire(client) {
        Ok(p) => p,
        Err(sem) => {
            let what = format!(
                "Move stream waits: the client runs its share of {} transfers \
                 (--max-transfers-per-client)",
                svc.client_slots.per_client()
            );
            svc.limited(
                ClientLimit::TransfersPerClient,
                1,
                client,
                &session.client_name,
                &what,
            );
            let wait = svc.client_slots.acquire(client, sem);
            match with_keepalives(wait, keepalive, &tx).await {
                Some(p) => p,
                None => return,
            }
        }
    };
    let Some(permit) = transfer_slot(&svc, client, &session.client_name, keepalive, &tx).await
    else {
        return;
    };
    let mut d = Driver::new(svc.clone(), session.clone(), client, tx, slot);
    d.core.handle_frame(d.now(), first);
    d.run(&mut rx).await;
    drop((permit, mine));
}

/// One of rcpd's transfer slots (`--max-transfers`), waited for with
/// keepalives when all are taken (counted once, as `transfers`); `None`
/// when the client is gone or rcpd shuts down (told to the client).
async fn transfer_slot(
    svc: &Service,
    client: ClientId,
    name: &str,
    keepalive: Duration,
    tx: &Tx,
) -> Option<OwnedSemaphorePermit> {
    let slots = svc.transfers.clone();
    let got = match slots.clone().try_acquire_owned() {
        Ok(p) => Ok(p),
        Err(TryAcquireError::Closed) => Err(()),
        Err(TryAcquireError::NoPermits) => {
            let what = "Move stream waits: rcpd runs all its transfers (--max-transfers)";
            svc.limited(ClientLimit::Transfers, 1, client, name, what);
            with_keepalives(slots.acquire_owned(), keepalive, tx)
                .await?
                .map_err(|_| ())
        }
    };
    if got.is_err() {
        let e = ControlError::Retryable("rcpd is shutting down".into());
        let _ = tx.send(Err(e.into())).await;
    }
    got.ok()
}

/// `wait`, sending keepalives every `every` meanwhile; `None` when the
/// client is gone.
async fn with_keepalives<T>(
    wait: impl std::future::Future<Output = T>,
    every: Duration,
    tx: &Tx,
) -> Option<T> {
    tokio::pin!(wait);
    loop {
        tokio::select! {
            r = &mut wait => return Some(r),
            _ = tokio::time::sleep(every) => {
                if tx.send(Ok(ServerFrame::default())).await.is_err() {
                    return None;
                }
            }
        }
    }
}

struct Driver {
    svc: Arc<Service>,
    io: Arc<StreamIo>,
    core: ServerCore,
    t0: Instant,
    tx: Tx,
    files: HashMap<FileId, FileInfo>,
    slots: HashMap<WindowId, WindowSlot>,
    done_tx: mpsc::UnboundedSender<Done>,
    done_rx: mpsc::UnboundedReceiver<Done>,
    /// The session's one stream: given back before the client can see
    /// the end (so it may start the next one at once).
    slot: Option<MoveSlot>,
    /// Ends the stream when nothing moves (its slot goes to others).
    watchdog: Watchdog,
    client: ClientId,
    session: Arc<super::SessionState>,
    /// Every rail of the session is the tcp provider's: granting a window
    /// and revoking it are a map insert and remove ([`StreamIo::cheap_grants`]),
    /// done on the driver rather than handed to a blocking thread.
    cheap_grants: bool,
    /// Pull: sources checked by the job that filled their window (files it
    /// held whole), until the core asks for the check: answered then on
    /// the driver, with no job of its own.
    prechecked: HashMap<FileId, Result<(), Failure>>,
    /// Push grants to make on the driver ([`Self::cheap_grants`]) once the
    /// frames queued before them are sent: a grant must not share a frame
    /// with the Ack that freed its window's place (a client reads a
    /// frame's grants before its acks, and would count one window too
    /// many).
    deferred_grants: Vec<(WindowId, u32, Vec<proto::Extent>)>,
}

impl Driver {
    fn new(
        svc: Arc<Service>,
        session: Arc<super::SessionState>,
        client: ClientId,
        tx: Tx,
        slot: MoveSlot,
    ) -> Driver {
        let p = session.params;
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let io = Arc::new(StreamIo::new(svc.clone(), session.clone()));
        Driver {
            cheap_grants: io.cheap_grants(),
            prechecked: HashMap::new(),
            deferred_grants: Vec::new(),
            io,
            watchdog: Watchdog::new(svc.cfg.timeout.as_nanos() as u64, 0),
            client,
            session,
            svc,
            core: ServerCore::new(p, 0),
            t0: Instant::now(),
            tx,
            files: HashMap::new(),
            slots: HashMap::new(),
            done_tx,
            done_rx,
            slot: Some(slot),
        }
    }

    fn now(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }

    async fn run(&mut self, rx: &mut Streaming<ClientFrame>) {
        let mut client_open = true;
        let end = loop {
            if let Some(r) = self.act() {
                break r;
            }
            let now = self.now();
            let mut gone = false;
            while let Some(f) = self.core.poll_frame(now) {
                if self.tx.send(Ok(f)).await.is_err() {
                    gone = true;
                    break;
                }
            }
            if gone {
                // Nobody reads the response any more: the client is gone.
                self.core.client_closed(self.now());
                if client_open {
                    client_open = false;
                }
                continue;
            }
            if !self.deferred_grants.is_empty() {
                // The frames before them are out: grant, then send.
                self.grant_deferred();
                continue;
            }
            let at = |t: u64| tokio::time::Instant::from_std(self.t0 + Duration::from_nanos(t));
            let deadline = self.core.poll_timeout().map(at);
            let stalled = self.watchdog.deadline().map(at);
            tokio::select! {
                m = rx.message(), if client_open => {
                    let now = self.now();
                    match m {
                        Ok(Some(f)) => self.core.handle_frame(now, f),
                        Ok(None) => {
                            client_open = false;
                            self.core.client_closed(now);
                        }
                        Err(s) => {
                            // A frame that does not decode, or the
                            // connection broke: either way the stream ends
                            // with what went wrong, never as a success.
                            tracing::debug!(status = %s, "the client's side of the stream broke");
                            client_open = false;
                            let f = ControlError::from(s).failure();
                            self.core.client_failed(now, f);
                        }
                    }
                }
                Some(d) = self.done_rx.recv() => {
                    self.apply(d);
                    while let Ok(d) = self.done_rx.try_recv() {
                        self.apply(d);
                    }
                }
                _ = sleep_until(deadline), if deadline.is_some() => {
                    let now = self.now();
                    self.core.handle_timeout(now);
                }
                _ = sleep_until(stalled), if stalled.is_some() => {
                    let now = self.now();
                    if self.watchdog.expired(now) {
                        self.cut_off(now);
                    }
                }
            }
        };
        self.slot = None;
        // The last frames (FileFailed), then the status.
        while let Some(f) = self.core.poll_frame(self.now()) {
            if self.tx.send(Ok(f)).await.is_err() {
                break;
            }
        }
        let open = std::mem::take(&mut self.files);
        match end {
            Ok(()) => tracing::debug!("move stream done"),
            Err(f) => {
                tracing::warn!(reason = ?f.reason, error = %crate::escape::esc(&f.message), files_open = open.len(), "move stream ended with an error");
                for fi in open.values() {
                    self.svc.metrics.transfer_ended(
                        fi.held.direction(),
                        Outcome::Error,
                        0,
                        fi.started.elapsed().as_secs_f64(),
                        None,
                    );
                }
                let _ = self.tx.send(Err(f.into())).await;
            }
        }
        // Destinations left are suspended for --resume (an fdatasync and a
        // manifest each), windows revoked: off the runtime's threads.
        let slots = std::mem::take(&mut self.slots);
        tokio::task::spawn_blocking(move || {
            drop(slots);
            drop(open);
        });
    }

    /// Nothing moved for the timeout: the stream ends (what it wrote stays
    /// resumable), its transfer slot goes to the next stream.
    fn cut_off(&mut self, now: u64) {
        let t = self.svc.cfg.timeout;
        let what = format!(
            "Move stream ended: nothing moved for {t:?} (no bytes, no file committed; --timeout)"
        );
        self.svc.limited(
            ClientLimit::NoProgress,
            1,
            self.client,
            &self.session.client_name,
            &what,
        );
        let f = Failure::new(
            Reason::Retryable,
            format!(
                "rcpd ended the stream: nothing moved for {t:?} (no bytes, no file committed; \
                 rcpd's --timeout), its transfer slot goes to other clients"
            ),
        );
        self.core.client_failed(now, f);
    }

    /// Start every action the core has; the outcome when it ended.
    fn act(&mut self) -> Option<Result<(), Failure>> {
        let mut opens = Vec::new();
        let now = self.now();
        // Source checks and closes of this round, on one blocking thread:
        // a window of small files ends many files at once.
        let mut checks: Vec<(FileId, FileHandle)> = Vec::new();
        let mut closes: Vec<FileInfo> = Vec::new();
        while let Some(a) = self.core.poll_action() {
            match a {
                ServerAction::Open { file, open } => opens.push((file, open)),
                ServerAction::Grant {
                    window,
                    round,
                    extents,
                    fill,
                } => self.grant(window, round, extents, fill),
                ServerAction::Verify {
                    window,
                    round,
                    extents,
                    expected,
                } => self.verify(window, round, extents, expected),
                ServerAction::Release { window } => {
                    // A pull window is still reachable: revoking it may be an
                    // invalidate posted and polled on the session's QP, so the
                    // slot goes back off the runtime's threads (on tcp it is
                    // a map remove, done here).
                    if let Some(slot) = self.slots.remove(&window) {
                        if self.cheap_grants {
                            drop(slot);
                        } else {
                            tokio::task::spawn_blocking(move || drop(slot));
                        }
                    }
                }
                ServerAction::Hash { file, blocks } => {
                    let Some(fi) = self.files.get(&file) else {
                        continue;
                    };
                    let (io, held, len, tx) = (
                        self.io.clone(),
                        fi.held.clone(),
                        fi.length,
                        self.done_tx.clone(),
                    );
                    self.watchdog.job_started(now);
                    tokio::task::spawn_blocking(move || {
                        let _ = tx.send(Done::Hashed(file, io.hash(&held, &blocks, len)));
                    });
                }
                ServerAction::CheckSource { file } => {
                    if let Some(r) = self.prechecked.remove(&file) {
                        self.core.source_checked(now, file, r);
                        continue;
                    }
                    let Some(fi) = self.files.get(&file) else {
                        continue;
                    };
                    checks.push((file, fi.held.clone()));
                }
                ServerAction::Commit { files } => self.spawn_commit(files),
                ServerAction::Close { file } => {
                    self.prechecked.remove(&file);
                    if let Some(fi) = self.files.remove(&file) {
                        if fi.held.direction() == Direction::Pull {
                            // A pulled file finished.
                            self.watchdog.moved(now);
                            self.svc.metrics.transfer_ended(
                                Direction::Pull,
                                Outcome::Ok,
                                fi.length,
                                fi.started.elapsed().as_secs_f64(),
                                None,
                            );
                        }
                        if fi.held.drop_may_block() {
                            // A destination dropped uncommitted syncs its
                            // manifest: off the runtime's threads.
                            closes.push(fi);
                        }
                        // A source or a committed destination only closes
                        // its fds: dropped here, no job.
                    }
                }
                ServerAction::End(r) => {
                    self.spawn_checks_and_closes(checks, closes);
                    return Some(r);
                }
            }
        }
        self.spawn_checks_and_closes(checks, closes);
        self.spawn_opens(opens);
        None
    }

    /// Publish a group commit's batch ([`commit_parts`]: in two halves at
    /// once when large), a job each.
    fn spawn_commit(&mut self, files: Vec<(FileId, Digest)>) {
        let batch: Vec<(FileId, FileHandle, Digest)> = files
            .into_iter()
            .filter_map(|(f, d)| Some((f, self.files.get(&f)?.held.clone(), d)))
            .collect();
        let now = self.now();
        for part in commit_parts(batch) {
            let (io, tx) = (self.io.clone(), self.done_tx.clone());
            self.watchdog.job_started(now);
            tokio::task::spawn_blocking(move || {
                let _ = tx.send(Done::Committed(io.commit(part)));
            });
        }
    }

    /// Open this round's files on one blocking thread, answered in the
    /// chunks of [`open_chunks`] (a job each for the watchdog).
    fn spawn_opens(&mut self, opens: Vec<(FileId, proto::OpenFile)>) {
        if opens.is_empty() {
            return;
        }
        let chunks = open_chunks(opens.len());
        let now = self.now();
        for _ in &chunks {
            self.watchdog.job_started(now);
        }
        let (io, tx) = (self.io.clone(), self.done_tx.clone());
        tokio::task::spawn_blocking(move || {
            let mut opens = opens.into_iter();
            for n in chunks {
                let r = opens
                    .by_ref()
                    .take(n)
                    .map(|(file, o)| (file, io.open(&o)))
                    .collect();
                if tx.send(Done::Opened(r)).is_err() {
                    return;
                }
            }
        });
    }

    /// Check `checks`' sources and drop `closes` on one blocking thread.
    fn spawn_checks_and_closes(
        &mut self,
        checks: Vec<(FileId, FileHandle)>,
        closes: Vec<FileInfo>,
    ) {
        if checks.is_empty() && closes.is_empty() {
            return;
        }
        if !checks.is_empty() {
            // One job for the watchdog: its answer comes as one `Done::Many`.
            self.watchdog.job_started(self.now());
        }
        let (io, tx) = (self.io.clone(), self.done_tx.clone());
        tokio::task::spawn_blocking(move || {
            // The checks first: a close may be slow (a destination dropped
            // uncommitted syncs its manifest), a check's answer is awaited.
            if !checks.is_empty() {
                let r = checks
                    .into_iter()
                    .map(|(file, held)| Done::Checked(file, io.check_source(&held)))
                    .collect();
                let _ = tx.send(Done::Many(r));
            }
            drop(closes);
        });
    }

    fn grant(&mut self, window: WindowId, round: u32, extents: Vec<proto::Extent>, fill: bool) {
        if !fill && self.cheap_grants {
            self.deferred_grants.push((window, round, extents));
            return;
        }
        self.grant_job(window, round, extents, fill);
    }

    /// The deferred push grants, on the driver where a slot is at hand;
    /// the others wait for one in a task.
    fn grant_deferred(&mut self) {
        for (window, round, extents) in std::mem::take(&mut self.deferred_grants) {
            if !self.grant_here(window, round, &extents) {
                self.grant_job(window, round, extents, false);
            }
        }
    }

    /// Grant in a task: wait for a slot of the arena if the window has
    /// none, then (on a blocking thread) fill it (pull), check the sources
    /// of the files it holds whole, and make it reachable.
    fn grant_job(&mut self, window: WindowId, round: u32, extents: Vec<proto::Extent>, fill: bool) {
        self.watchdog.job_started(self.now());
        let slot = self.slots.remove(&window);
        let fills: Option<HashMap<FileId, FileHandle>> = fill.then(|| {
            extents
                .iter()
                .filter_map(|e| Some((e.file, self.files.get(&e.file)?.held.clone())))
                .collect()
        });
        // Pull: the files this window holds whole are read in full once it
        // is filled, so the same job checks their sources. (Round 0 only:
        // the core asks for each file's check once, after round 0.)
        let whole = match &fills {
            Some(f) if round == 0 => files_whole_in(&extents, self.io.bs, |id| match f.get(&id) {
                Some(FileHandle::Pull { src }) => Some(src.len()),
                _ => None,
            }),
            _ => Vec::new(),
        };
        let (io, tx, svc) = (self.io.clone(), self.done_tx.clone(), self.svc.clone());
        tokio::spawn(async move {
            let mut slot = match slot {
                Some(s) => s,
                None => {
                    // A slot of the shared arena: waits while other sessions
                    // hold them all.
                    let Ok(permit) = svc.slots.clone().acquire_owned().await else {
                        let _ = tx.send(Done::Granted {
                            window,
                            round,
                            slot: None,
                            fill,
                            r: Err(Failure::new(Reason::Retryable, "rcpd is shutting down")),
                            checked: Vec::new(),
                        });
                        return;
                    };
                    let block = svc.link.slots.take().expect("a permit per free slot");
                    WindowSlot::new(block, permit)
                }
            };
            let r = tokio::task::spawn_blocking(move || {
                let r = io.grant(
                    &mut slot,
                    &extents,
                    fills.as_ref(),
                    StreamIo::used(&extents),
                );
                let checked = match (&r, &fills) {
                    (Ok(_), Some(f)) => whole
                        .into_iter()
                        .filter_map(|id| Some((id, f.get(&id)?)))
                        .map(|(id, held)| (id, io.check_source(held)))
                        .collect(),
                    _ => Vec::new(),
                };
                (slot, r, checked)
            })
            .await;
            let (slot, r, checked) = match r {
                Ok((s, r, c)) => (Some(s), r, c),
                Err(e) => (
                    None,
                    Err(Failure::new(Reason::Other, format!("grant job: {e}"))),
                    Vec::new(),
                ),
            };
            let _ = tx.send(Done::Granted {
                window,
                round,
                slot,
                fill,
                r,
                checked,
            });
        });
    }

    /// Grant a push window on the driver, with no job (tcp: registering
    /// the slot is a map insert, and nothing is read into it), when a slot
    /// is at hand: the window's own, or a free one of the arena. False when
    /// the arena has none free: the caller waits for one in a task.
    fn grant_here(&mut self, window: WindowId, round: u32, extents: &[proto::Extent]) -> bool {
        let mut slot = match self.slots.remove(&window) {
            Some(s) => s,
            None => match self.svc.slots.clone().try_acquire_owned() {
                Ok(permit) => {
                    let block = self.svc.link.slots.take().expect("a permit per free slot");
                    WindowSlot::new(block, permit)
                }
                Err(_) => return false,
            },
        };
        let r = self
            .io
            .grant(&mut slot, extents, None, StreamIo::used(extents));
        self.slots.insert(window, slot);
        let now = self.now();
        self.core.granted(now, window, round, r);
        true
    }

    fn verify(
        &mut self,
        window: WindowId,
        round: u32,
        extents: Vec<proto::Extent>,
        expected: Vec<Digest>,
    ) {
        let Some(mut slot) = self.slots.remove(&window) else {
            let now = self.now();
            self.core.verified(
                now,
                window,
                round,
                Err(Failure::new(
                    Reason::Other,
                    "verify of a window without a slot",
                )),
            );
            return;
        };
        let files: HashMap<FileId, FileHandle> = extents
            .iter()
            .filter_map(|e| Some((e.file, self.files.get(&e.file)?.held.clone())))
            .collect();
        let (io, tx) = (self.io.clone(), self.done_tx.clone());
        self.watchdog.job_started(self.now());
        tokio::task::spawn_blocking(move || {
            let r = io.verify(&mut slot, &extents, &expected, &files);
            let _ = tx.send(Done::Verified {
                window,
                round,
                slot,
                r,
            });
        });
    }

    fn apply(&mut self, d: Done) {
        let now = self.now();
        self.watchdog.job_done(now);
        // Progress, for the watchdog: bytes verified into a destination or
        // read into a window, files committed (not keepalives, opens or
        // hashes, which a client can ask for without moving anything).
        let moved = match &d {
            Done::Granted { fill, r, .. } => *fill && r.is_ok(),
            Done::Verified { r, .. } => r.is_ok(),
            Done::Committed(rs) => rs.iter().any(|(_, r)| r.is_ok()),
            _ => false,
        };
        if moved {
            self.watchdog.moved(now);
        }
        self.apply_done(d);
    }

    /// What a finished job means (its watchdog accounting done by `apply`).
    fn apply_done(&mut self, d: Done) {
        let now = self.now();
        match d {
            Done::Many(all) => {
                for d in all {
                    self.apply_done(d);
                }
            }
            Done::Opened(rs) => {
                for (file, r) in rs {
                    let r = r.map(|(held, opened)| {
                        self.svc.metrics.transfer_started();
                        self.files.insert(
                            file,
                            FileInfo {
                                held,
                                length: opened.length,
                                started: Instant::now(),
                            },
                        );
                        opened
                    });
                    self.core.opened(now, file, r);
                }
            }
            Done::Granted {
                window,
                round,
                slot,
                r,
                checked,
                ..
            } => {
                if let Some(s) = slot {
                    self.slots.insert(window, s);
                }
                self.prechecked.extend(checked);
                self.core.granted(now, window, round, r);
            }
            Done::Verified {
                window,
                round,
                slot,
                r,
            } => {
                self.slots.insert(window, slot);
                self.core.verified(now, window, round, r);
            }
            Done::Hashed(file, r) => self.core.hashed(now, file, r),
            Done::Checked(file, r) => self.core.source_checked(now, file, r),
            Done::Committed(rs) => {
                for (file, r) in rs {
                    if let (Ok(c), Some(fi)) = (&r, self.files.get(&file)) {
                        self.svc.metrics.transfer_ended(
                            Direction::Push,
                            Outcome::Ok,
                            c.length,
                            fi.started.elapsed().as_secs_f64(),
                            None,
                        );
                    }
                    self.core.committed(now, file, r);
                }
            }
        }
    }
}

async fn sleep_until(t: Option<tokio::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_batch_of_opens_is_answered_small_first_then_growing() {
        assert_eq!(open_chunks(0), Vec::<usize>::new());
        assert_eq!(open_chunks(5), vec![5]);
        assert_eq!(open_chunks(FIRST_OPENS), vec![FIRST_OPENS]);
        let c = open_chunks(1024);
        assert_eq!(c, vec![32, 64, 128, 256, 512, 32]);
        assert_eq!(c.iter().sum::<usize>(), 1024);
    }

    fn pushed(names: impl Iterator<Item = String>) -> Vec<(usize, FileHandle, Digest)> {
        names
            .enumerate()
            .map(|(i, path)| {
                let h = FileHandle::Push {
                    dest: Arc::default(),
                    path,
                    fed: None,
                };
                (i, h, Vec::new())
            })
            .collect()
    }

    #[test]
    fn a_large_commit_is_two_halves_unless_a_path_is_named_twice() {
        let ids = |parts: &[Vec<(usize, FileHandle, Digest)>]| -> Vec<Vec<usize>> {
            parts
                .iter()
                .map(|p| p.iter().map(|(i, _, _)| *i).collect())
                .collect()
        };
        let small = commit_parts(pushed((0..SPLIT_COMMIT - 1).map(|i| format!("f{i}"))));
        assert_eq!(small.len(), 1);
        let n = SPLIT_COMMIT + 1;
        let parts = commit_parts(pushed((0..n).map(|i| format!("f{i}"))));
        assert_eq!(
            ids(&parts),
            vec![(0..n / 2).collect::<Vec<_>>(), (n / 2..n).collect()]
        );
        // The same name first and last: the batch's order decides.
        let twice = commit_parts(pushed((0..n).map(|i| format!("f{}", i % (n - 1)))));
        assert_eq!(ids(&twice), vec![(0..n).collect::<Vec<_>>()]);
    }
}
