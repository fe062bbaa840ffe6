//! The driver of one Move stream on the client: frames in and out of a
//! [`ClientCore`], its I/O on blocking threads, windows through the
//! session's data path, time passed in.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::io::{self, FileJob, Local};
use super::session::{FileResult, Observer, Session};
use crate::control::error::{ControlError, Result};
use crate::control::protocol::{
    files_whole_in, ClientAction, ClientCore, ClientEvent, Digest, Failure, FileId, Held,
    LocalCommit, Reason, SourceMeta, WindowId,
};
use crate::datapath::lend::{LendError, LendingPath, Loan};
use crate::datapath::DpEvent;
use crate::engine::{Extent, OpKind, WindowJob};
use crate::files::{Destination, DirCache, DirHandle};
use crate::mem::{Block, BlockPool};
use crate::proto::{self, ClientFrame, Direction};

/// What FindResume found: the local directory and name, and an
/// interrupted copy there with what it holds.
type Found = (DirHandle, std::ffi::OsString, Option<(Destination, Held)>);

/// An answer from a blocking job.
enum Done {
    Source(
        FileId,
        Result<(Arc<crate::files::SourceFile>, SourceMeta), Failure>,
    ),
    Resume(FileId, Result<Found, Failure>),
    Dest(
        FileId,
        Result<(DirHandle, std::ffi::OsString, Destination), Failure>,
    ),
    Filled {
        grant: proto::Grant,
        slot: Block,
        r: Result<Vec<Digest>, Failure>,
        /// The sources of the files the window held whole, checked by the
        /// job that read them ([`Driver::prechecked`]).
        checked: Vec<(FileId, Result<(), Failure>)>,
    },
    Checked {
        window: WindowId,
        round: u32,
        bytes: u64,
        slot: Block,
        r: Result<Vec<u32>, Failure>,
    },
    Hashed(FileId, Result<Vec<(u64, Digest)>, Failure>),
    SourceChecked(FileId, Result<(), Failure>),
    Committed(Vec<(FileId, Result<LocalCommit, Failure>)>),
    /// The answers of a batch of small jobs ([`Driver::spawn_batch`]), sent
    /// at once: one wake-up of the driver, one frame for all of them.
    Many(Vec<Done>),
}

/// Blocking work of one file, batched by [`Driver::spawn_batch`]; an
/// answer for the driver, if it wants one.
type Job = Box<dyn FnOnce() -> Option<Done> + Send>;

/// Answers of one [`Driver::spawn_batch`] sent together, at most: the first
/// files' opens reach the server while the rest of a large batch is opened.
const BATCH_ANSWERS: usize = 16;

/// A window in the data path (its staging block is the lending path's
/// until the window's end).
struct InFlight {
    /// WRITE (push: the device reads the slot) or READ (pull: it fills
    /// it).
    op: OpKind,
    grant: proto::Grant,
    /// Push: the digests of what was written.
    digests: Vec<Digest>,
}

struct Driver<'a> {
    s: &'a mut Session,
    core: ClientCore,
    t0: Instant,
    out: Option<mpsc::UnboundedSender<ClientFrame>>,
    jobs: HashMap<FileId, (FileJob, Instant)>,
    locals: HashMap<FileId, Local>,
    in_flight: HashMap<u64, InFlight>,
    done_tx: mpsc::UnboundedSender<Done>,
    done_rx: mpsc::UnboundedReceiver<Done>,
    /// Push: sources checked by the job that filled their window (files it
    /// held whole), until the core asks for the check: answered then on
    /// the driver, with no job of its own, and the FileEnd goes out with
    /// the window's WindowDone.
    prechecked: HashMap<FileId, std::result::Result<(), Failure>>,
    /// Pull: the local directories opened last, shared with the jobs that
    /// create destinations in them.
    dirs: Arc<DirCache<PathBuf>>,
    /// A SIGINT or SIGTERM ([`crate::control::interrupt`]) aborted the stream.
    interrupted: bool,
}

fn now_of(t0: Instant) -> u64 {
    t0.elapsed().as_nanos() as u64
}

impl Session {
    /// Move `files` over one Move stream, up to the session's files in
    /// flight at once; `obs` sees each start, the progress and each result.
    /// The first file that fails ends the stream with its error (what was
    /// verified stays resumable).
    pub async fn transfer(
        &mut self,
        files: &mut (dyn Iterator<Item = FileJob> + Send),
        obs: &dyn Observer,
    ) -> Result<()> {
        run(self, files, obs).await
    }

    /// [`transfer`](Self::transfer) of a list; the results, in the order
    /// the files finished.
    pub async fn transfer_all(&mut self, files: Vec<FileJob>) -> Result<Vec<FileResult>> {
        struct Collect(std::sync::Mutex<Vec<FileResult>>);
        impl Observer for Collect {
            fn file_done(&self, r: &FileResult) {
                self.0.lock().unwrap().push(r.clone());
            }
        }
        let c = Collect(Default::default());
        self.transfer(&mut files.into_iter(), &c).await?;
        Ok(c.0.into_inner().unwrap())
    }
}

/// Run one Move stream for `files` over `s`.
pub(super) async fn run(
    s: &mut Session,
    files: &mut (dyn Iterator<Item = FileJob> + Send),
    obs: &dyn Observer,
) -> Result<()> {
    let (out_tx, out_rx) = mpsc::unbounded_channel();
    let core = core_of(s);
    let mut inbound = s
        .rpc
        .clone()
        .r#move(UnboundedReceiverStream::new(out_rx))
        .await?
        .into_inner();
    if s.broken || s.dp.is_none() {
        return Err(ControlError::Other(
            "the session's data path is gone (an earlier stream failed)".into(),
        ));
    }
    if s.staging.is_none() {
        return Err(ControlError::Usage(
            "this session maps no staging (Client::bare_session): it moves no files".into(),
        ));
    }
    let mut d = Driver::new(s, core, out_tx);
    let mut server_open = true;
    let end = d.drive(files, obs, &mut inbound, &mut server_open).await;
    // Windows still in the data path stay lent to it until it is closed.
    let locals = d.wind_down(obs);
    // Destinations left are suspended for --resume: off the runtime.
    tokio::task::spawn_blocking(move || drop(locals));
    match end {
        Ok(()) => {
            // Let the server see our end and close its side.
            if server_open {
                let _ = tokio::time::timeout(Duration::from_secs(5), async {
                    while let Ok(Some(_)) = inbound.message().await {}
                })
                .await;
            }
            Ok(())
        }
        Err(f) => {
            // A failed stream may leave windows in the data path: the
            // session is not reused.
            s.broken = true;
            Err(ControlError::Failed(f))
        }
    }
}

/// The stream's protocol core for session `s`.
fn core_of(s: &Session) -> ClientCore {
    let mut core = ClientCore::new(s.params, s.id, 0);
    // --transport auto over verbs: the core watches the rails for the tcp
    // fallback. Whether to continue over tcp is the jobs policy's
    // (jobs::run): the stream only ends, saying why.
    if let Some(w) =
        crate::control::fallback::rail_watch(s.opts.transport, s.kind, s.opts.tcp_fallback_after, 0)
    {
        core.watch(w);
    }
    core
}

impl<'a> Driver<'a> {
    fn new(s: &'a mut Session, core: ClientCore, out: mpsc::UnboundedSender<ClientFrame>) -> Self {
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        Driver {
            s,
            core,
            t0: Instant::now(),
            out: Some(out),
            jobs: HashMap::new(),
            locals: HashMap::new(),
            in_flight: HashMap::new(),
            done_tx,
            done_rx,
            prechecked: HashMap::new(),
            dirs: Arc::default(),
            interrupted: false,
        }
    }

    /// Feed the core, act, send its frames and wait for the next input,
    /// until the core ends the stream.
    async fn drive(
        &mut self,
        files: &mut (dyn Iterator<Item = FileJob> + Send),
        obs: &dyn Observer,
        inbound: &mut tonic::Streaming<proto::ServerFrame>,
        server_open: &mut bool,
    ) -> std::result::Result<(), Failure> {
        let mut fed_all = false;
        loop {
            self.feed(files, obs, &mut fed_all);
            if let Some(r) = self.act() {
                return r;
            }
            self.report(obs);
            let now = now_of(self.t0);
            // The data path's counters, for the core (progress, the rails'
            // watch).
            let confirmed = self
                .s
                .dp
                .as_ref()
                .and_then(LendingPath::stats)
                .map_or(0, |st| st.counters().bytes_confirmed);
            let failures = self.rail_failures();
            self.core.data_path(now, confirmed, &failures);
            if let Some(r) = self.act() {
                return r;
            }
            self.send_frames(now);
            self.wait(obs, inbound, server_open).await;
        }
    }

    /// Hand the core files while it has room; tell it when there are no
    /// more.
    fn feed(
        &mut self,
        files: &mut (dyn Iterator<Item = FileJob> + Send),
        obs: &dyn Observer,
        fed_all: &mut bool,
    ) {
        while !*fed_all && self.core.room() > 0 {
            match files.next() {
                Some(job) => {
                    self.s.direction.get_or_insert(job.spec.direction);
                    obs.file_start(&job.local.display().to_string(), job.len_hint);
                    let id = self.core.add_file(job.spec.clone());
                    self.jobs.insert(id, (job, Instant::now()));
                }
                None => {
                    *fed_all = true;
                    self.core.finish();
                }
            }
        }
    }

    /// The core's frames, out to the server.
    fn send_frames(&mut self, now: u64) {
        while let Some(f) = self.core.poll_frame(now) {
            if let Some(o) = &self.out {
                let _ = o.send(f);
            }
        }
    }

    /// Wait for one input (a server frame, a blocking job's answer, a data
    /// path event or the core's timer) and hand it to the core.
    async fn wait(
        &mut self,
        obs: &dyn Observer,
        inbound: &mut tonic::Streaming<proto::ServerFrame>,
        server_open: &mut bool,
    ) {
        let deadline = self
            .core
            .poll_timeout()
            .map(|t| tokio::time::Instant::from_std(self.t0 + Duration::from_nanos(t)));
        tokio::select! {
            m = inbound.message(), if *server_open => {
                let now = now_of(self.t0);
                match m {
                    Ok(Some(f)) => self.core.handle_frame(now, f),
                    Ok(None) => {
                        *server_open = false;
                        self.core.server_closed(now, Ok(()));
                    }
                    Err(st) => {
                        *server_open = false;
                        let e = ControlError::from(st);
                        self.core.server_closed(now, Err(e.failure()));
                    }
                }
            }
            Some(x) = self.done_rx.recv() => {
                self.apply(x, obs);
                while let Ok(x) = self.done_rx.try_recv() {
                    self.apply(x, obs);
                }
            }
            ev = next_event(self.s.dp.as_ref()) => match ev {
                Some((ev, loan)) => self.data_path(ev, loan, obs),
                None => self.core.abort(Failure::new(Reason::Retryable, "the data path stopped")),
            },
            _ = sleep_until(deadline), if deadline.is_some() => {
                let now = now_of(self.t0);
                self.core.handle_timeout(now);
            }
            sig = crate::control::interrupt::wait(), if !self.interrupted => {
                // Abort (an Abort frame to rcpd): what was verified is kept
                // on both sides for --resume.
                self.interrupted = true;
                self.core.abort(sig.failure());
            }
        }
    }

    /// The stream ended: note a fallback, tell the observer the last files,
    /// send what is queued (an Abort) and close our side. Returns the
    /// local destinations left.
    fn wind_down(mut self, obs: &dyn Observer) -> HashMap<FileId, Local> {
        if let Some(why) = self.core.fallback() {
            self.s.fallback = Some(why.to_string());
        }
        self.report(obs);
        let now = now_of(self.t0);
        self.send_frames(now);
        self.out = None;
        std::mem::take(&mut self.locals)
    }
}

impl Driver<'_> {
    /// Tell the observer of every file the core finished.
    fn report(&mut self, obs: &dyn Observer) {
        while let Some(ClientEvent::FileDone(f)) = self.core.poll_event() {
            let Some((job, started)) = self.jobs.remove(&f.file) else {
                continue;
            };
            let source = job.source();
            let path = match job.spec.direction {
                Direction::Push => f.remote_path,
                _ => job.local.display().to_string(),
            };
            obs.file_done(&FileResult {
                path,
                source,
                length: f.length,
                moved: f.moved,
                digest: f.digest,
                flat_sha256: (!f.flat_sha256.is_empty()).then_some(f.flat_sha256),
                seconds: started.elapsed().as_secs_f64(),
                resumed: f.resumed,
            });
        }
    }

    fn now(&self) -> u64 {
        now_of(self.t0)
    }

    fn spawn(&self, f: impl FnOnce() -> Done + Send + 'static) {
        let tx = self.done_tx.clone();
        tokio::task::spawn_blocking(move || {
            let _ = tx.send(f());
        });
    }

    /// Run `jobs` one after another on one blocking thread and send their
    /// answers together, at most [`BATCH_ANSWERS`] at a time: many small
    /// files' opens (or checks, or closes) cost one hand-off to the blocking
    /// pool and one wake-up of the driver (so one frame to the server), not
    /// one each.
    fn spawn_batch(&self, jobs: Vec<Job>) {
        if jobs.is_empty() {
            return;
        }
        let tx = self.done_tx.clone();
        tokio::task::spawn_blocking(move || {
            let mut out = Vec::new();
            for j in jobs {
                if let Some(d) = j() {
                    out.push(d);
                }
                if out.len() >= BATCH_ANSWERS
                    && tx.send(Done::Many(std::mem::take(&mut out))).is_err()
                {
                    return;
                }
            }
            if !out.is_empty() {
                let _ = tx.send(Done::Many(out));
            }
        });
    }

    fn src(&self, file: FileId) -> Option<Arc<crate::files::SourceFile>> {
        match self.locals.get(&file)? {
            Local::Push { src } => Some(src.clone()),
            Local::Pull { .. } => None,
        }
    }

    fn dest(&self, file: FileId) -> Option<io::SharedDest> {
        match self.locals.get(&file)? {
            Local::Pull { dest, .. } => Some(dest.clone()),
            Local::Push { .. } => None,
        }
    }

    /// Start every action the core has; the outcome when it ended.
    fn act(&mut self) -> Option<std::result::Result<(), Failure>> {
        let (bs, check) = (self.s.params.block_size, self.s.params.check);
        let mut batch: Vec<Job> = Vec::new();
        while let Some(a) = self.core.poll_action() {
            match a {
                ClientAction::OpenSource { file } => {
                    let job = &self.jobs[&file].0;
                    let (path, with) = (job.local.clone(), job.source.clone());
                    batch.push(Box::new(move || {
                        let r = match with {
                            Some(w) => w.0.open(bs),
                            None => io::open_source(&path, bs),
                        };
                        Some(Done::Source(file, r))
                    }));
                }
                ClientAction::FindResume { file } => {
                    let (job, _) = &self.jobs[&file];
                    let (spec, local) = (job.spec.clone(), job.local.clone());
                    let (rpc, tx) = (self.s.rpc.clone(), self.done_tx.clone());
                    let dirs = self.dirs.clone();
                    tokio::spawn(async move {
                        let st = rpc
                            .clone()
                            .stat(proto::StatRequest {
                                path: spec.remote.clone(),
                                fingerprint: true,
                            })
                            .await;
                        let entry = match st {
                            Ok(r) => r
                                .into_inner()
                                .entry
                                .filter(|e| e.r#type == proto::FileType::File as i32),
                            Err(e) => {
                                let _ = tx
                                    .send(Done::Resume(file, Err(ControlError::from(e).failure())));
                                return;
                            }
                        };
                        let r = tokio::task::spawn_blocking(move || {
                            let (dir, name) = io::local_dir(&dirs, &local, spec.create_parents)?;
                            let found = match entry {
                                Some(e) => io::find_resume(check, &dir, &name, &e, bs, &spec)?,
                                None => None,
                            };
                            Ok((dir, name, found))
                        })
                        .await
                        .unwrap_or_else(|e| Err(Failure::new(Reason::Other, e.to_string())));
                        let _ = tx.send(Done::Resume(file, r));
                    });
                }
                ClientAction::CreateDest { file, opened } => {
                    let (job, _) = &self.jobs[&file];
                    let (spec, local) = (job.spec.clone(), job.local.clone());
                    let prior = match self.locals.remove(&file) {
                        Some(Local::Pull {
                            dir, name, resumed, ..
                        }) => Some((dir, name, resumed)),
                        _ => None,
                    };
                    let dirs = self.dirs.clone();
                    batch.push(Box::new(move || {
                        let r = (|| {
                            let (dir, name, resumed) = match prior {
                                Some(p) => p,
                                None => {
                                    let (d, n) = io::local_dir(&dirs, &local, spec.create_parents)?;
                                    (d, n, None)
                                }
                            };
                            let d =
                                io::create_dest(check, &dir, &name, resumed, &opened, bs, &spec)?;
                            Ok((dir, name, d))
                        })();
                        Some(Done::Dest(file, r))
                    }));
                }
                ClientAction::Send { grant } => self.send(grant),
                ClientAction::Fetch { grant } => self.fetch(grant),
                ClientAction::Hash { file, blocks } => {
                    let Some(src) = self.src(file) else { continue };
                    self.spawn(move || Done::Hashed(file, io::hash(check, &src, &blocks, bs)));
                }
                ClientAction::CheckSource { file } => self.check_source(file, &mut batch),
                ClientAction::Commit { files } => {
                    let batch: Vec<_> = files
                        .into_iter()
                        .filter_map(|(f, d)| Some((f, self.dest(f)?, d)))
                        .collect();
                    self.spawn(move || Done::Committed(io::commit(check, batch)));
                }
                ClientAction::Close { file } => self.close(file, &mut batch),
                ClientAction::End(r) => {
                    self.spawn_batch(batch);
                    return Some(r);
                }
            }
        }
        self.spawn_batch(batch);
        None
    }

    /// [`ClientAction::CheckSource`]: answered at once when the job that
    /// filled the file's window checked it, else a job of `batch`.
    fn check_source(&mut self, file: FileId, batch: &mut Vec<Job>) {
        if let Some(r) = self.prechecked.remove(&file) {
            let now = self.now();
            self.core.source_checked(now, file, r);
            return;
        }
        let Some(src) = self.src(file) else { return };
        batch.push(Box::new(move || {
            Some(Done::SourceChecked(
                file,
                src.check_unchanged()
                    .map_err(|e| ControlError::from(e).failure()),
            ))
        }));
    }

    /// [`ClientAction::Close`]: a source or a committed destination only
    /// closes its fds, done here (no job); an uncommitted destination is
    /// suspended for --resume (a sync and a manifest), a job of `batch`.
    fn close(&mut self, file: FileId, batch: &mut Vec<Job>) {
        self.prechecked.remove(&file);
        match self.locals.remove(&file) {
            Some(l) if !io::drop_may_block(&l) => drop(l),
            Some(l) => batch.push(Box::new(move || {
                drop(l);
                None
            })),
            None => {}
        }
    }

    fn take_slot(&mut self) -> Option<Block> {
        let b = self.s.link.slots.as_ref().and_then(BlockPool::take);
        if b.is_none() {
            // Never: the core grants no more windows at once than agreed,
            // which is no more than the staging has, and a slot comes back
            // before its window ends.
            self.core.abort(Failure::new(
                Reason::Other,
                "no staging slot free for a granted window",
            ));
        }
        b
    }

    fn send(&mut self, grant: proto::Grant) {
        let Some(mut slot) = self.take_slot() else {
            return;
        };
        let (bs, check) = (self.s.params.block_size, self.s.params.check);
        let srcs: HashMap<FileId, Arc<crate::files::SourceFile>> = grant
            .extents
            .iter()
            .filter_map(|e| Some((e.file, self.src(e.file)?)))
            .collect();
        // The files this window holds whole are read in full once it is
        // filled: their sources are checked by the same job. (Round 0 only:
        // the core asks for each file's check once, after round 0.)
        let whole = if grant.round == 0 {
            files_whole_in(&grant.extents, bs, |f| srcs.get(&f).map(|s| s.len()))
        } else {
            Vec::new()
        };
        self.spawn(move || {
            let r = io::fill(check, &mut slot, &grant.extents, &srcs, bs);
            let checked = match r {
                Ok(_) => whole
                    .into_iter()
                    .filter_map(|f| Some((f, srcs.get(&f)?)))
                    .map(|(f, src)| {
                        let c = src.check_unchanged();
                        (f, c.map_err(|e| ControlError::from(e).failure()))
                    })
                    .collect(),
                Err(_) => Vec::new(),
            };
            Done::Filled {
                grant,
                slot,
                r,
                checked,
            }
        });
    }

    fn fetch(&mut self, grant: proto::Grant) {
        let Some(slot) = self.take_slot() else { return };
        self.submit(OpKind::Read, grant, slot, Vec::new());
    }

    /// Lend a staging slot to the data path for a window.
    fn submit(&mut self, op: OpKind, grant: proto::Grant, slot: Block, digests: Vec<Digest>) {
        // A slot came from the staging: `run` refuses a session without.
        let staging = self
            .s
            .staging
            .clone()
            .expect("a stream's session maps staging");
        let id = self.s.next_window;
        self.s.next_window += 1;
        let job = WindowJob {
            id,
            op,
            local_addr: slot.addr(),
            lkey: staging.lkey(),
            remote_addr: grant.addr,
            rkey: grant.rkey,
            extents: grant
                .extents
                .iter()
                .map(|e| Extent {
                    offset: e.offset,
                    len: e.len,
                })
                .collect(),
        };
        let lp = self.s.dp.as_ref().expect("a live session has a data path");
        // The lending path keeps the slot until the window's end (or, the
        // stream failing first, until the data path is closed) and enters
        // the window's rkeys on every rail (the core checked there is one
        // per rail) before any extent can be posted.
        let r = lp.submit(job, slot, staging, &grant.rail_rkeys);
        crate::phase::first_window();
        match r {
            Ok(()) => {
                self.in_flight.insert(id, InFlight { op, grant, digests });
            }
            Err(e) => {
                let f = match e {
                    LendError::DataPath(e) => ControlError::DataPath(e).failure(),
                    e => Failure::new(Reason::Other, format!("window {}: {e}", grant.window)),
                };
                self.core.abort(f);
            }
        }
    }

    fn data_path(&mut self, ev: DpEvent, loan: Option<Loan>, obs: &dyn Observer) {
        match ev {
            DpEvent::WindowDone { id } => {
                let Some(l) = self.in_flight.remove(&id) else {
                    return;
                };
                let Some(slot) = loan.and_then(Loan::into_block) else {
                    self.core.abort(Failure::new(
                        Reason::Other,
                        format!("window {id} ended without its staging block"),
                    ));
                    return;
                };
                let (window, round) = (l.grant.window, l.grant.round);
                match l.op {
                    OpKind::Write => {
                        // Progress is what the device has written (it
                        // runs behind the staging under --bwlimit).
                        let bytes: u64 = l.grant.extents.iter().map(|e| u64::from(e.len)).sum();
                        obs.progress(bytes);
                        drop(slot);
                        let now = self.now();
                        self.core.sent(now, window, round, Ok(l.digests));
                    }
                    OpKind::Read => {
                        let dests: HashMap<FileId, _> = l
                            .grant
                            .extents
                            .iter()
                            .filter_map(|e| Some((e.file, self.dest(e.file)?)))
                            .collect();
                        let bytes: u64 = l.grant.extents.iter().map(|e| u64::from(e.len)).sum();
                        let grant = l.grant;
                        let check = self.s.params.check;
                        #[allow(unused_mut)]
                        let mut slot = slot;
                        self.spawn(move || {
                            #[cfg(feature = "fault-injection")]
                            io::inject_faults(&mut slot, &grant.extents);
                            let r = io::check_and_write(
                                check,
                                &slot,
                                &grant.extents,
                                &grant.digests,
                                &dests,
                            );
                            Done::Checked {
                                window: grant.window,
                                round: grant.round,
                                bytes,
                                slot,
                                r,
                            }
                        });
                    }
                }
            }
            DpEvent::Reconnected { epoch, seconds } => {
                tracing::info!(epoch, seconds, "data path reconnected");
            }
            // Rail events: a session over several rails (--device a,b).
            // The data path fences a failed rail and posts its extents on
            // the others itself, and what it asks of the caller on
            // RailFenced (datapath::runner docs) is done already: the
            // rail's fence and reconnect reset its QP at both ends, and
            // rcpd revokes each window on every rail when it is done,
            // before reading or reusing the bytes (docs/rails.md). The
            // driver only logs them.
            e @ (DpEvent::RailDown { .. }
            | DpEvent::RailFenced { .. }
            | DpEvent::RailPaused { .. }
            | DpEvent::RailUp { .. }) => {
                tracing::warn!(?e, "data path rail event");
            }
            DpEvent::Failed(e) => {
                let f = ControlError::DataPath(e).failure();
                self.core.data_path_failed(f);
            }
        }
    }

    /// Each rail's failures so far.
    fn rail_failures(&self) -> Vec<u64> {
        self.s
            .dp
            .as_ref()
            .and_then(LendingPath::stats)
            .map_or(Vec::new(), |st| {
                st.rails.iter().map(|r| r.counters().failures).collect()
            })
    }

    fn apply(&mut self, d: Done, obs: &dyn Observer) {
        let now = self.now();
        match d {
            Done::Many(all) => {
                for d in all {
                    self.apply(d, obs);
                }
            }
            Done::Source(file, r) => {
                let r = r.map(|(src, meta)| {
                    self.locals.insert(file, Local::Push { src });
                    meta
                });
                self.core.source_ready(now, file, r);
            }
            Done::Resume(file, r) => {
                let r = r.map(|(dir, name, found)| {
                    let (resumed, held) = match found {
                        Some((d, h)) => (Some(Box::new(d)), Some(h)),
                        None => (None, None),
                    };
                    self.locals.insert(
                        file,
                        Local::Pull {
                            dir,
                            name,
                            resumed,
                            dest: Arc::new(Mutex::new(None)),
                        },
                    );
                    held
                });
                self.core.resume_found(now, file, r);
            }
            Done::Dest(file, r) => {
                let r = r.map(|(dir, name, d)| {
                    self.locals.insert(
                        file,
                        Local::Pull {
                            dir,
                            name,
                            resumed: None,
                            dest: Arc::new(Mutex::new(Some(d))),
                        },
                    );
                });
                self.core.dest_ready(now, file, r);
            }
            Done::Filled {
                grant,
                slot,
                r,
                checked,
            } => match r {
                Ok(digests) => {
                    self.prechecked.extend(checked);
                    self.submit(OpKind::Write, grant, slot, digests);
                }
                Err(f) => {
                    drop(slot);
                    self.core.sent(now, grant.window, grant.round, Err(f));
                }
            },
            Done::Checked {
                window,
                round,
                bytes,
                slot,
                r,
            } => {
                drop(slot);
                if let Ok(bad) = &r {
                    if bad.is_empty() {
                        obs.progress(bytes);
                    }
                    if round > 0 {
                        tracing::warn!(
                            window,
                            round,
                            damaged_again = bad.len(),
                            "pulled blocks read again after a digest mismatch"
                        );
                    }
                }
                self.core.fetched(now, window, round, r);
            }
            Done::Hashed(file, r) => self.core.hashed(now, file, r),
            Done::SourceChecked(file, r) => self.core.source_checked(now, file, r),
            Done::Committed(rs) => {
                for (file, r) in rs {
                    self.core.committed(now, file, r);
                }
            }
        }
    }
}

/// The lending path's next event (never, without one).
async fn next_event(lp: Option<&LendingPath>) -> Option<(DpEvent, Option<Loan>)> {
    match lp {
        Some(lp) => lp.next_event().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(t: Option<tokio::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}
