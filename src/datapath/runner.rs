//! The session data path: one [`DataPath`] per session drives an engine
//! [`Stream`] over one provider [`Channel`] for as long as the session lasts.
//!
//! Threads, both started by [`DataPath::start`] and both living until
//! [`DataPath::close`] (or drop):
//! - the *posting thread* (`rcp-post`) owns the `Stream`. It waits on one
//!   input queue that carries both the completion thread's batches and the
//!   windows [`DataPath::submit`] hands in (so a submission wakes it at
//!   once), absorbs everything queued, acts on the stream's events
//!   (`WindowDone` → [`DpEvent::WindowDone`], error batch → the error path),
//!   posts every chain the stream allows (one `post` per chain, the engine's
//!   batches reused, no allocation per request) and publishes the engine's
//!   counters into [`DataPathStats`]. With a rate limit it takes each
//!   chain's bytes from a [`TokenBucket`] first; short of tokens it waits
//!   on its input queue until the bucket will hold them, so completions
//!   and submissions are still taken at once meanwhile (no spinning, no
//!   sleep that delays them). With nothing queued and nothing
//!   outstanding it blocks (no spinning); in poll mode, with requests
//!   outstanding, it spins [`POSTER_SPIN`] for the next batch before it
//!   parks. While a pinned completion thread polls (poll, hybrid), it keeps
//!   off that CPU ([`AvoidCpu`]).
//! - the *completion thread* (`rcp-cq`), pinned per `cq_cpu`, runs
//!   [`completion_loop`] (poll / event / hybrid) and sends every non-empty
//!   batch, stamped with the time it was polled, to the posting thread.
//!
//! The error path is apart from the fast path and runs on the posting
//! thread: on an error batch asking to reconnect it waits (at most
//! `flush_timeout`) for the failed epoch's flushes, waits for `PORT_ACTIVE`
//! when a [`PortMonitor`] says the port is down, calls the caller's
//! `reconnect` with [`Backoff`](super::Backoff), then
//! [`Stream::reconnected`], which posts exactly the unconfirmed extents
//! again, and reports [`DpEvent::Reconnected`]. A terminal failure is one
//! [`DpEvent::Failed`]; every window not done by then is lost.
//!
//! Counting: the engine's [`Counters`](crate::engine::stream::Counters) are
//! the one count of requests posted, doorbells, signaled, inline,
//! completions, errors and post failures; [`Report`] and [`DataPathStats`]
//! read them. The completion thread counts only its own polls, arms, waits
//! and wakeups; this runner only what the engine cannot see (post →
//! completion latency of signaled requests, reconnect and port times).

use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::bucket::TokenBucket;
use super::completion::{completion_loop, pin_current_thread, AvoidCpu};
use super::config::{ConfigError, DataPathConfig, PollMode};
use super::port::PortMonitor;
use super::report::Report;
use super::stats::{DataPathStats, Latencies};
use crate::engine::slots::WrId;
use crate::engine::stream::{Batch, ErrorCause, Event, Recovery, State, WindowError};
use crate::engine::{Stream, StreamConfig, WcStatus, WindowJob, WorkCompletion};
use crate::provider::{Channel, ProviderError};

/// An error from the caller's reconnect callback.
pub type ReconnectError = Box<dyn std::error::Error + Send + Sync>;

/// The caller's reconnect callback: replace the connection after an error
/// batch (verbs: reset the QP, exchange endpoints, handshake). Called on the
/// posting thread, retried with backoff.
pub type ReconnectFn = Box<dyn FnMut() -> Result<(), ReconnectError> + Send>;

/// Why the data path could not start, refused a window, or stopped.
#[derive(Debug, thiserror::Error)]
pub enum DataPathError {
    #[error("data path configuration: {0}")]
    Config(#[from] ConfigError),
    #[error("data path failed: {reason} (status {}, window {}, extent {})",
        .status.map_or("none", |s| s.label()),
        .window.map_or("none".to_string(), |w| w.to_string()),
        .extent.map_or("none".to_string(), |e| e.to_string()))]
    Failed {
        status: Option<WcStatus>,
        window: Option<u64>,
        extent: Option<u32>,
        reason: &'static str,
    },
    #[error("reconnect failed after {attempts} attempts: {source}")]
    Reconnect {
        attempts: u32,
        source: ReconnectError,
    },
    #[error("completion thread: {0}")]
    Completion(#[source] ProviderError),
    #[error("the completion thread panicked")]
    CompletionPanicked,
    #[error("window {id} refused: {source}")]
    Window { id: u64, source: WindowError },
    #[error("the data path has stopped (failed or closed)")]
    Stopped,
    #[error("starting a data-path thread: {0}")]
    Spawn(#[source] std::io::Error),
}

impl DataPathError {
    /// Whether a new session may succeed where this one failed (the
    /// connection went away) as opposed to a failure a retry would repeat
    /// (a remote access error, a bad window).
    pub fn is_retryable(&self) -> bool {
        match self {
            DataPathError::Failed { status, .. } => status.is_none_or(|s| s.is_retryable()),
            DataPathError::Reconnect { .. }
            | DataPathError::Completion(_)
            | DataPathError::Stopped => true,
            _ => false,
        }
    }
}

/// What the data path tells its owner, in order.
#[derive(Debug)]
pub enum DpEvent {
    /// Every extent of the window is confirmed: its staging region is the
    /// caller's again (read it after a READ), its id free.
    WindowDone { id: u64 },
    /// The connection was replaced after an error batch; `seconds` from the
    /// error to the new epoch.
    Reconnected { epoch: u32, seconds: f64 },
    /// Terminal: the data path posts no more, and every window not done is
    /// lost (redo it on a new session). Memory of those windows is the
    /// caller's again once [`DataPath::close`] has returned and the channel
    /// has been reset or dropped (see [`DataPath::submit`]).
    Failed(DataPathError),
}

struct CqBatch {
    at: Instant,
    wcs: Vec<WorkCompletion>,
}

/// How the completion thread ended.
enum CqEnd {
    Stopped,
    Error(ProviderError),
    Panicked,
}

/// The posting thread's one input queue.
enum Input {
    Cq(CqBatch),
    Submit(WindowJob),
    CqEnded(CqEnd),
    Close,
}

/// What the caller's side and the posting thread share.
#[derive(Default)]
struct Shared {
    /// Failed or closing: `submit` refuses.
    stopped: AtomicBool,
    /// Ids submitted and not yet done (so `submit` refuses a live id at
    /// once instead of the posting thread later).
    live: Mutex<HashSet<u64>>,
    /// The posting thread's kernel thread id (tests read its CPU time).
    #[cfg(test)]
    poster_tid: std::sync::atomic::AtomicI32,
}

/// A session-long data path over one channel. See the module docs.
pub struct DataPath {
    tx: Sender<Input>,
    shared: Arc<Shared>,
    events: Mutex<Option<UnboundedReceiver<DpEvent>>>,
    poster: Option<JoinHandle<Report>>,
    stats: Arc<DataPathStats>,
    cfg: DataPathConfig,
    stream_cfg: StreamConfig,
}

impl std::fmt::Debug for DataPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataPath")
            .field("stream", &self.stream_cfg)
            .field("stopped", &self.shared.stopped.load(Relaxed))
            .finish_non_exhaustive()
    }
}

/// In poll mode, how long the poster spins for the next completion batch
/// before it parks (the completion thread keeps spinning on the CQ).
pub const POSTER_SPIN: Duration = Duration::from_micros(20);

/// Longest the error path sleeps at once while it waits for flushes.
const IDLE_SLICE: Duration = Duration::from_millis(50);

impl DataPath {
    /// Start the posting and completion threads over `channel`. `reconnect`
    /// replaces the connection after an error batch; with `monitor`, a
    /// reconnect waits for the port while it is down instead of sleeping its
    /// backoff blind.
    pub fn start(
        cfg: DataPathConfig,
        channel: Arc<dyn Channel>,
        reconnect: ReconnectFn,
        monitor: Option<Arc<dyn PortMonitor>>,
    ) -> Result<DataPath, DataPathError> {
        cfg.validate()?;
        let stream_cfg = cfg.stream_config(&channel.caps())?;
        let stream = Stream::new(stream_cfg).expect("stream_config validated it");
        let depth = stream_cfg.sq_depth;
        let stats = Arc::new(DataPathStats::default());
        stats.sq_free.store(depth as u64, Relaxed);
        let shared = Arc::new(Shared::default());
        let (tx, rx) = mpsc::channel::<Input>();
        let (ev_tx, ev_rx) = unbounded_channel();
        let (recycle_tx, recycle_rx) = mpsc::channel::<Vec<WorkCompletion>>();
        let stop = Arc::new(AtomicBool::new(false));

        let cq = {
            let (channel, stats, stop, tx) =
                (channel.clone(), stats.clone(), stop.clone(), tx.clone());
            let (mode, cpu) = (cfg.poll_mode, cfg.cq_cpu);
            std::thread::Builder::new()
                .name("rcp-cq".into())
                .spawn(move || {
                    if let Some(cpu) = cpu {
                        if let Err(e) = pin_current_thread(cpu) {
                            tracing::warn!(cpu, error = %e, "cannot pin the completion thread");
                        }
                    }
                    let run = std::panic::catch_unwind(AssertUnwindSafe(|| {
                        completion_loop(&*channel, mode, &stop, &stats, &mut |wcs, at| {
                            let mut v = recycle_rx
                                .try_recv()
                                .unwrap_or_else(|_| Vec::with_capacity(wcs.len()));
                            v.clear();
                            v.extend_from_slice(wcs);
                            tx.send(Input::Cq(CqBatch { at, wcs: v })).is_ok()
                        })
                    }));
                    let end = match run {
                        Ok(Ok(())) => CqEnd::Stopped,
                        Ok(Err(e)) => CqEnd::Error(e),
                        Err(_) => CqEnd::Panicked,
                    };
                    let _ = tx.send(Input::CqEnded(end));
                })
                .map_err(DataPathError::Spawn)?
        };

        let now = Instant::now();
        let poster = Poster {
            // Engine time starts at `now`: the bucket starts empty there.
            bucket: cfg.rate_limit.map(|r| TokenBucket::new(r, 0)),
            events0: monitor.as_ref().map_or(0, |m| m.events_seen()),
            cfg: cfg.clone(),
            stream,
            channel,
            rx,
            recycle: recycle_tx,
            events: ev_tx,
            reconnect,
            monitor,
            stats: stats.clone(),
            shared: shared.clone(),
            start: now,
            post_times: vec![(u64::MAX, now); depth],
            latency: Latencies::default(),
            reconnect_seconds: Vec::new(),
            port_up_to_first_wr: Vec::new(),
            port_waits: 0,
            reconnect_started: None,
            port_up_at: None,
            last_progress: now,
            last_confirmed: 0,
            post_fail_run: 0,
            closing: false,
            failed: false,
            cq_ended: false,
            batch: Batch::default(),
            sq_depth: depth as u64,
        };
        let poster = std::thread::Builder::new()
            .name("rcp-post".into())
            .spawn({
                let stop = stop.clone();
                move || poster.run(cq, stop)
            })
            .map_err(|e| {
                // The completion thread's next send fails (the poster and
                // its receiver are gone), or it sees `stop`.
                stop.store(true, Relaxed);
                DataPathError::Spawn(e)
            })?;
        Ok(DataPath {
            tx,
            shared,
            events: Mutex::new(Some(ev_rx)),
            poster: Some(poster),
            stats,
            cfg,
            stream_cfg,
        })
    }

    /// Queue a window; the posting thread is woken at once. Windows are
    /// served in the order submitted. Refused at once if the data path has
    /// stopped ([`DataPathError::Stopped`]), the extents are not sorted and
    /// disjoint, one is empty or overflows, or a window with the same id is
    /// live (submitted and not done).
    ///
    /// # Safety
    ///
    /// For every extent `e` of `w`, `[w.local_addr + e.offset, + e.len)` is
    /// memory registered under `w.lkey` with the provider of the channel
    /// this data path runs on, stays mapped, and is lent to the device:
    /// the caller (and everyone else) does not write it (WRITE window: the
    /// device reads it) or neither reads nor writes it (READ window: the
    /// device writes it)
    /// - until [`DpEvent::WindowDone`] for `w.id` has been received, or
    /// - if that never comes (the data path failed, or was closed first),
    ///   until [`close`](Self::close) or drop has returned *and* the
    ///   channel has been reset or dropped: a request may still be in the
    ///   device after the data path gave up on it (`close` waits up to
    ///   `flush_timeout` for requests in flight;
    ///   [`Report::outstanding_at_close`] says how many it left).
    ///
    /// The remote side (`remote_addr`, `rkey`) is the peer's to vouch for;
    /// the device refuses a bad rkey or range (the window then fails).
    pub unsafe fn submit(&self, w: WindowJob) -> Result<(), DataPathError> {
        if self.shared.stopped.load(Relaxed) {
            return Err(DataPathError::Stopped);
        }
        let id = w.id;
        w.validate()
            .map_err(|source| DataPathError::Window { id, source })?;
        if !self.shared.live.lock().unwrap().insert(id) {
            return Err(DataPathError::Window {
                id,
                source: WindowError::DuplicateId(id),
            });
        }
        self.tx.send(Input::Submit(w)).map_err(|_| {
            self.shared.live.lock().unwrap().remove(&id);
            DataPathError::Stopped
        })
    }

    /// The event stream, once (`None` after the first call). Use it from
    /// async code with `.recv().await`, from a thread with
    /// `blocking_recv()`. It ends (`None`) when the data path is closed.
    /// Events not taken accumulate (one per window).
    pub fn take_events(&self) -> Option<UnboundedReceiver<DpEvent>> {
        self.events.lock().unwrap().take()
    }

    /// Whether the data path has failed or is closing (submit refuses).
    pub fn is_stopped(&self) -> bool {
        self.shared.stopped.load(Relaxed)
    }

    /// Live counters for the metrics exporter (the engine's, published by
    /// the posting thread, plus the completion thread's).
    pub fn stats(&self) -> &Arc<DataPathStats> {
        &self.stats
    }

    /// The configuration.
    pub fn config(&self) -> &DataPathConfig {
        &self.cfg
    }

    /// The engine configuration it runs with (depth, batch policy, inline
    /// limit as decided for this channel).
    pub fn stream_config(&self) -> &StreamConfig {
        &self.stream_cfg
    }

    /// Stop: windows not yet posted are dropped, requests in flight get up
    /// to `flush_timeout` to retire, both threads are joined. Returns what
    /// the data path did over its life.
    pub fn close(mut self) -> Report {
        self.shutdown()
    }

    /// The posting thread's kernel thread id, once it runs (0 before).
    #[cfg(test)]
    pub(crate) fn poster_tid(&self) -> i32 {
        self.shared.poster_tid.load(Relaxed)
    }

    fn shutdown(&mut self) -> Report {
        self.shared.stopped.store(true, Relaxed);
        let _ = self.tx.send(Input::Close);
        match self.poster.take().map(JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => {
                tracing::error!("the data path's posting thread panicked");
                Report::default()
            }
            None => Report::default(),
        }
    }
}

impl Drop for DataPath {
    fn drop(&mut self) {
        if self.poster.is_some() {
            self.shutdown();
        }
    }
}

/// The posting thread's state: owns the stream.
struct Poster {
    cfg: DataPathConfig,
    stream: Stream,
    channel: Arc<dyn Channel>,
    rx: Receiver<Input>,
    recycle: Sender<Vec<WorkCompletion>>,
    events: UnboundedSender<DpEvent>,
    reconnect: ReconnectFn,
    monitor: Option<Arc<dyn PortMonitor>>,
    stats: Arc<DataPathStats>,
    shared: Arc<Shared>,
    /// Engine time is nanoseconds since this.
    start: Instant,
    /// By slot index: the `wr_id` and post time of the last signaled
    /// request posted in that slot.
    post_times: Vec<(u64, Instant)>,
    latency: Latencies,
    reconnect_seconds: Vec<f64>,
    port_up_to_first_wr: Vec<f64>,
    port_waits: u64,
    /// Set by the error path until the first extent confirmed after it:
    /// when it started and the extents confirmed by then.
    reconnect_started: Option<(Instant, u64)>,
    /// When the port came back, for a reconnect that found it down.
    port_up_at: Option<Instant>,
    /// When an extent was last confirmed (or the start).
    last_progress: Instant,
    last_confirmed: u64,
    post_fail_run: u32,
    closing: bool,
    failed: bool,
    cq_ended: bool,
    /// The chain being posted (its vector reused).
    batch: Batch,
    sq_depth: u64,
    events0: u64,
    /// The rate limit, if any: a chain's bytes are taken before it posts.
    bucket: Option<TokenBucket>,
}

impl Poster {
    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn run(mut self, cq: JoinHandle<()>, stop: Arc<AtomicBool>) -> Report {
        // A pinned completion thread that spins owns its core: the poster
        // keeps off it rather than take turns with a thread that never
        // sleeps.
        #[cfg(test)]
        self.shared
            .poster_tid
            .store(nix::unistd::gettid().as_raw(), Relaxed);
        let _off_cq_core = match (self.cfg.cq_cpu, self.cfg.poll_mode) {
            (Some(c), PollMode::Poll | PollMode::Hybrid { .. }) => Some(AvoidCpu::new(c)),
            _ => None,
        };
        loop {
            self.drain_inputs();
            if self.closing {
                break;
            }
            let wait = self.step();
            if self.closing {
                break;
            }
            self.wait_input(wait);
        }
        self.finish(cq, &stop)
    }

    /// One round after the inputs are absorbed: timers, events (and the
    /// error path), posting, publishing. Returns how long to wait for the
    /// next input (`None`: until one comes).
    fn step(&mut self) -> Option<Duration> {
        let mut throttled;
        loop {
            self.note_progress();
            if let Some(t) = self.stream.next_timeout() {
                let now = self.now_ns();
                if now >= t {
                    self.stream.poll_timeout(now);
                }
            }
            if let Some(cause) = self.handle_events() {
                self.recover(cause);
                if self.closing {
                    return None;
                }
            }
            throttled = if self.failed { None } else { self.post_all() };
            self.publish();
            // A post failure may have raised an error batch: act on it now.
            if !self.stream.has_events() {
                break;
            }
        }
        let timer = self
            .stream
            .next_timeout()
            .map(|t| Duration::from_nanos(t.saturating_sub(self.now_ns())));
        match (timer, throttled) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn drain_inputs(&mut self) {
        loop {
            match self.rx.try_recv() {
                Ok(i) => self.input(i),
                Err(TryRecvError::Empty) => return,
                Err(TryRecvError::Disconnected) => {
                    self.closing = true;
                    return;
                }
            }
        }
    }

    /// Wait up to `timeout` (`None`: without limit) for one input and take
    /// it. In poll mode with requests outstanding, spin briefly first.
    fn wait_input(&mut self, timeout: Option<Duration>) {
        let mut timeout = timeout;
        if self.cfg.poll_mode == PollMode::Poll && self.stream.outstanding() > 0 {
            let t0 = Instant::now();
            let spin = timeout.map_or(POSTER_SPIN, |t| t.min(POSTER_SPIN));
            let end = t0 + spin;
            let mut spins = 0u32;
            loop {
                match self.rx.try_recv() {
                    Ok(i) => return self.input(i),
                    Err(TryRecvError::Disconnected) => {
                        self.closing = true;
                        return;
                    }
                    Err(TryRecvError::Empty) => {}
                }
                spins = spins.wrapping_add(1);
                if spins % 64 == 0 && Instant::now() >= end {
                    break;
                }
                std::hint::spin_loop();
            }
            timeout = timeout.map(|t| t.saturating_sub(t0.elapsed()));
        }
        let got = match timeout {
            Some(t) => match self.rx.recv_timeout(t) {
                Ok(i) => Some(i),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => {
                    self.closing = true;
                    None
                }
            },
            None => match self.rx.recv() {
                Ok(i) => Some(i),
                Err(_) => {
                    self.closing = true;
                    None
                }
            },
        };
        if let Some(i) = got {
            self.input(i);
        }
    }

    fn input(&mut self, i: Input) {
        match i {
            Input::Cq(b) => self.absorb(b),
            Input::Submit(w) => {
                let id = w.id;
                if let Err(e) = self.stream.add_window(w) {
                    // Only a failed stream refuses a window `submit` let
                    // through; the Failed event already said it is lost.
                    self.shared.live.lock().unwrap().remove(&id);
                    tracing::debug!(window = id, error = %e, "window dropped");
                }
            }
            Input::CqEnded(end) => {
                self.cq_ended = true;
                match end {
                    CqEnd::Stopped => {}
                    CqEnd::Error(e) => self.fail(DataPathError::Completion(e)),
                    CqEnd::Panicked => self.fail(DataPathError::CompletionPanicked),
                }
            }
            Input::Close => self.closing = true,
        }
    }

    fn absorb(&mut self, b: CqBatch) {
        for wc in &b.wcs {
            if !wc.status.is_success() {
                continue;
            }
            let i = WrId(wc.wr_id).index();
            if let Some(slot) = self.post_times.get_mut(i) {
                if slot.0 == wc.wr_id {
                    slot.0 = u64::MAX;
                    self.latency
                        .record(b.at.saturating_duration_since(slot.1).as_nanos() as u64);
                }
            }
        }
        self.stream.on_completions(&b.wcs);
        let _ = self.recycle.send(b.wcs);
    }

    /// Time the first extent confirmed after a reconnect.
    fn note_progress(&mut self) {
        let c = self.stream.counters().extents_confirmed;
        if c == self.last_confirmed {
            return;
        }
        self.last_confirmed = c;
        let now = Instant::now();
        self.last_progress = now;
        let Some((t0, at)) = self.reconnect_started else {
            return;
        };
        if c <= at {
            return;
        }
        self.reconnect_started = None;
        let s = now.saturating_duration_since(t0);
        self.reconnect_seconds.push(s.as_secs_f64());
        self.stats
            .reconnect_ns
            .fetch_add(s.as_nanos() as u64, Relaxed);
        let up = self
            .port_up_at
            .take()
            .map(|t| now.saturating_duration_since(t).as_secs_f64());
        if let Some(u) = up {
            self.port_up_to_first_wr.push(u);
        }
        tracing::info!(
            seconds = s.as_secs_f64(),
            port_up_to_first_wr_seconds = up,
            "first extent confirmed after reconnect"
        );
    }

    /// Act on the stream's events; the cause when an error batch asks for a
    /// reconnect.
    fn handle_events(&mut self) -> Option<ErrorCause> {
        let mut recover = None;
        while let Some(ev) = self.stream.poll_event() {
            match ev {
                Event::WindowDone { id } => {
                    self.shared.live.lock().unwrap().remove(&id);
                    let _ = self.events.send(DpEvent::WindowDone { id });
                }
                Event::ErrorBatch {
                    epoch,
                    cause,
                    action,
                } => {
                    tracing::warn!(epoch, ?cause, ?action, "error batch");
                    if action == Recovery::Reconnect {
                        recover = Some(cause);
                    }
                }
                Event::Timeout {
                    wr_id,
                    window,
                    extent,
                } => {
                    tracing::warn!(
                        wr_id,
                        window,
                        extent,
                        "request timed out; its context is freed"
                    );
                }
                Event::ReadyToReconnect { epoch, unconfirmed } => {
                    tracing::info!(epoch, unconfirmed, "failed epoch drained");
                }
            }
        }
        if let State::Failed {
            status,
            window,
            extent,
            reason,
        } = self.stream.state()
        {
            self.fail(DataPathError::Failed {
                status,
                window,
                extent,
                reason,
            });
        }
        if self.failed {
            None
        } else {
            recover
        }
    }

    /// Post every chain the stream (and the rate limit) allows now; with a
    /// chain held back by the rate limit, how long until it may go.
    fn post_all(&mut self) -> Option<Duration> {
        let now = self.now_ns();
        loop {
            if let Some(b) = &mut self.bucket {
                let need = self.stream.next_chain_bytes()?;
                if let Err(wait) = b.take(need, now) {
                    return Some(wait);
                }
            }
            if !self.stream.poll_transmit_into(now, &mut self.batch) {
                return None;
            }
            let t = Instant::now();
            // SAFETY: every local segment of the chain is an extent of a
            // window handed in through `DataPath::submit`, whose caller
            // guaranteed (its `# Safety`) that the bytes are registered
            // under the window's lkey with this channel's provider and left
            // to the device until the window's `WindowDone` (which the
            // stream raises only after the completion retiring this request)
            // or until the data path stopped and the channel was reset or
            // dropped. The stream posts an extent again only after the
            // request before it was retired by a reconnect.
            let res = unsafe { self.channel.post(&self.batch.wrs) };
            let posted = match &res {
                Ok(()) => self.batch.wrs.len(),
                Err(f) => f.posted,
            };
            for wr in &self.batch.wrs[..posted] {
                if wr.signaled {
                    self.post_times[WrId(wr.wr_id).index()] = (wr.wr_id, t);
                }
            }
            match res {
                Ok(()) => self.post_fail_run = 0,
                Err(f) => {
                    if let Some(b) = &mut self.bucket {
                        let refused: u64 = self.batch.wrs[f.posted.min(self.batch.wrs.len())..]
                            .iter()
                            .map(|w| u64::from(w.local.len))
                            .sum();
                        b.give_back(refused);
                    }
                    self.post_fail_run += 1;
                    tracing::warn!(
                        posted = f.posted,
                        chain = self.batch.wrs.len(),
                        error = %f.error,
                        "post failed"
                    );
                    if let Err(e) = self.stream.post_failed(&self.batch, f.posted) {
                        tracing::error!(error = %e, "engine refused post_failed");
                    }
                    if matches!(f.error, ProviderError::Closed) || self.post_fail_run >= 3 {
                        // The connection is unusable: take the error path.
                        self.stream.connection_lost();
                        return None;
                    }
                    // Try again at once: the refused requests are first in
                    // line; three refusals in a row end it above.
                }
            }
        }
    }

    fn publish(&self) {
        let used = self.stream.credits_in_use() as u64;
        self.stats
            .publish(self.stream.counters(), self.sq_depth.saturating_sub(used));
    }

    fn fail(&mut self, e: DataPathError) {
        if self.failed {
            return;
        }
        self.failed = true;
        self.shared.stopped.store(true, Relaxed);
        tracing::error!(error = %e, "data path failed");
        let _ = self.events.send(DpEvent::Failed(e));
    }

    /// Wait about `d`, taking inputs meanwhile; returns early on close.
    fn pause(&mut self, d: Duration) {
        let end = Instant::now() + d;
        while !self.closing {
            let now = Instant::now();
            if now >= end {
                return;
            }
            self.wait_input(Some(end - now));
        }
    }

    /// The error path: wait (bounded) for the failed epoch's flushes, then
    /// reconnect with backoff and start the next epoch.
    fn recover(&mut self, cause: ErrorCause) {
        let t0 = Instant::now();
        tracing::warn!(
            ?cause,
            outstanding = self.stream.outstanding(),
            "error path: flushing"
        );
        let deadline = t0 + self.cfg.flush_timeout;
        while self.stream.state() == State::Flushing {
            let now = Instant::now();
            if now >= deadline {
                tracing::warn!(
                    outstanding = self.stream.outstanding(),
                    "flush incomplete after {:?}: reconnecting anyway",
                    self.cfg.flush_timeout
                );
                break;
            }
            self.wait_input(Some((deadline - now).min(IDLE_SLICE)));
            self.drain_inputs();
            // Successful completions of the failed epoch still confirm
            // extents; a non-retryable one fails the stream here.
            self.note_progress();
            let _ = self.handle_events();
            if self.closing || self.failed {
                return;
            }
        }
        if self.closing || self.failed {
            return;
        }
        // Reconnecting while the port is down cannot work: wait for it.
        self.wait_port();
        let attempts = self.cfg.backoff.max_attempts;
        let mut n = 0;
        loop {
            if self.closing {
                return;
            }
            match (self.reconnect)() {
                Ok(()) => break,
                Err(e) => {
                    n += 1;
                    if n >= attempts {
                        self.fail(DataPathError::Reconnect {
                            attempts: n,
                            source: e,
                        });
                        return;
                    }
                    let d = self.cfg.backoff.delay(n - 1);
                    tracing::warn!(attempt = n, error = %e, delay_ms = d.as_millis() as u64, "reconnect failed; retrying");
                    if !self.wait_port() {
                        self.pause(d);
                    }
                }
            }
        }
        // Link-up → first completed request is timed when the port came
        // back after the data path last made progress.
        self.port_up_at = self
            .monitor
            .as_ref()
            .and_then(|m| m.active_since())
            .filter(|&a| a >= self.last_progress);
        // Completions of the old epoch still queued are stale to the engine
        // (or confirm what they retire, before the epoch turns).
        self.drain_inputs();
        self.note_progress();
        let _ = self.handle_events();
        if self.closing || self.failed {
            return;
        }
        let reposting = self.stream.unconfirmed().len();
        match self.stream.reconnected() {
            Ok(epoch) => {
                self.reconnect_started = Some((t0, self.stream.counters().extents_confirmed));
                let seconds = t0.elapsed().as_secs_f64();
                tracing::info!(epoch, reposting, seconds, "reconnected");
                let _ = self.events.send(DpEvent::Reconnected { epoch, seconds });
            }
            Err(e) => tracing::error!(error = %e, "reconnected on a failed stream"),
        }
    }

    /// With a port monitor and the port down: wait for PORT_ACTIVE, at most
    /// the backoff cap, and return true (the caller retries at once). False
    /// when there is nothing to wait for (no monitor, or the port is up).
    fn wait_port(&mut self) -> bool {
        let Some(m) = self.monitor.clone() else {
            return false;
        };
        if m.is_active() {
            return false;
        }
        let cap = self.cfg.backoff.cap;
        tracing::warn!(
            cap_ms = cap.as_millis() as u64,
            "port down: waiting for PORT_ACTIVE before reconnecting"
        );
        self.port_waits += 1;
        self.stats.port_waits.fetch_add(1, Relaxed);
        let t = Instant::now();
        if m.wait_active(cap) {
            tracing::info!(
                waited_ms = t.elapsed().as_millis() as u64,
                "PORT_ACTIVE: reconnecting now"
            );
        } else {
            tracing::warn!(
                waited_ms = t.elapsed().as_millis() as u64,
                "port still down; trying anyway"
            );
        }
        true
    }

    /// Close: post nothing more, give the requests in flight up to
    /// `flush_timeout` to retire, stop and join the completion thread.
    fn finish(mut self, cq: JoinHandle<()>, stop: &AtomicBool) -> Report {
        self.shared.stopped.store(true, Relaxed);
        let deadline = Instant::now() + self.cfg.flush_timeout;
        while self.stream.outstanding() > 0 && !self.cq_ended {
            let now = Instant::now();
            if now >= deadline {
                tracing::warn!(
                    outstanding = self.stream.outstanding(),
                    "closing with requests still in flight"
                );
                break;
            }
            self.wait_input(Some(deadline - now));
            self.drain_inputs();
            let _ = self.handle_events();
        }
        stop.store(true, Relaxed);
        if cq.join().is_err() {
            tracing::error!("the completion thread panicked");
        }
        self.drain_inputs();
        let _ = self.handle_events();
        self.note_progress();
        self.publish();
        let c = self.stream.counters();
        let s = &self.stats;
        Report {
            bytes: c.bytes_confirmed,
            seconds: self.start.elapsed().as_secs_f64(),
            msgs: c.extents_confirmed,
            windows_done: c.windows_done,
            posted: c.posted,
            doorbells: c.doorbells,
            signaled: c.signaled,
            inline: c.inline,
            completions: c.completions,
            errors: c.errors.iter().collect(),
            post_failures: c.post_failures,
            reconnects: c.reconnects,
            reconnect_seconds: std::mem::take(&mut self.reconnect_seconds),
            port_up_to_first_wr_seconds: std::mem::take(&mut self.port_up_to_first_wr),
            latency: std::mem::take(&mut self.latency),
            polls: s.polls.load(Relaxed),
            empty_polls: s.empty_polls.load(Relaxed),
            arms: s.arms.load(Relaxed),
            waits: s.waits.load(Relaxed),
            wakeups: s.wakeups.load(Relaxed),
            port_events: self
                .monitor
                .as_ref()
                .map_or(0, |m| m.events_seen().saturating_sub(self.events0)),
            port_waits: self.port_waits,
            outstanding_at_close: self.stream.outstanding() as u64,
        }
    }
}
