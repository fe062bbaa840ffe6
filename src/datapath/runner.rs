//! The session data path: one [`DataPath`] per session drives an engine
//! [`Stream`] over one provider [`Channel`], or over several (*rails*, one
//! channel each), for as long as the session lasts.
//!
//! Threads, all started by [`DataPath::start`] / [`DataPath::start_rails`]
//! and all living until [`DataPath::close`] (or drop):
//! - the *posting thread* (`rcp-post`) owns the `Stream`. It waits on one
//!   input queue that carries the completion threads' batches, the windows
//!   [`DataPath::submit`] hands in (so a submission wakes it at once) and
//!   the reconnect helpers' and port watchers' news, absorbs everything
//!   queued, acts on the stream's events (`WindowDone` →
//!   [`DpEvent::WindowDone`], rail events → `DpEvent::Rail*`), asks for
//!   reconnects, posts every chain the stream allows (one `post` per chain
//!   on the chain's rail, the engine's batches reused, no allocation per
//!   request) and publishes the engine's counters into [`DataPathStats`].
//!   With a rate limit it takes each chain's bytes from a [`TokenBucket`]
//!   first; short of tokens it waits on its input queue until the bucket
//!   will hold them, so completions and submissions are still taken at
//!   once meanwhile (no spinning, no sleep that delays them). With nothing
//!   queued and nothing outstanding it blocks (no spinning); in poll mode,
//!   with requests outstanding, it spins [`POSTER_SPIN`] for the next
//!   batch before it parks. While pinned completion threads poll (poll,
//!   hybrid), it keeps off their CPUs ([`AvoidCpu`]). It never sleeps in a
//!   backoff or blocks in a reconnect.
//! - a *completion thread* per rail (`rcp-cq`), pinned per its rail's CQ
//!   CPU (or `cq_cpu`), runs [`completion_loop`] (poll / event / hybrid)
//!   and sends every non-empty batch, stamped with the time it was polled
//!   and its rail, to the posting thread.
//! - a *reconnect helper* per rail (`rcp-rail`), idle until the posting
//!   thread asks it to bring its rail back: it fences the rail's queue pair
//!   (the rail's [`FenceFn`], if any), waits out the rail's cool-down, waits
//!   for `PORT_ACTIVE` while a [`PortMonitor`] says the port is down, and
//!   calls the rail's reconnect callback with [`Backoff`],
//!   then tells the posting thread. The other rails post meanwhile.
//! - with several rails, a *port watcher* per rail that has a
//!   [`PortMonitor`] (`rcp-port`): the port going down is the rail's
//!   failure (Soft-RoCE retries a dead link forever, so the port event may
//!   come first and alone). A one-rail data path consults its monitor only
//!   in the reconnect, as before.
//!
//! # One rail
//!
//! The error path is the engine's one-rail protocol: on an error batch the
//! posting thread waits (at most `flush_timeout`) for the failed epoch's
//! flushes, then has the helper reconnect (waiting for the port, with
//! backoff); [`Stream::rail_reconnected`] posts exactly the unconfirmed extents
//! again and [`DpEvent::Reconnected`] is reported. A terminal failure is one
//! [`DpEvent::Failed`]; every window not done by then is lost.
//!
//! # Several rails
//!
//! A rail's error batch, request timeout, post failure or port going down
//! fences it in the engine ([`crate::engine::stream::rail`]): its
//! outstanding extents are posted on the surviving rails at once
//! ([`DpEvent::RailDown`], [`DpEvent::RailFenced`]), its helper brings it
//! back in the background ([`DpEvent::RailUp`]), and a rail that keeps
//! failing is paused ([`DpEvent::RailPaused`], [`RailPause`](super::RailPause)).
//! All rails down: the stream waits for a reconnect under the same retry
//! budget; a reconnect given up with no rail running fails the data path
//! (as one rail's does), with another rail running it pauses the rail.
//!
//! What the caller must do with several rails:
//! - on [`DpEvent::RailFenced`], fence the named windows' remote regions
//!   before reusing them for other data: the failed rail's queue pair
//!   could still land a delayed WRITE there (reset the peer's QP of that
//!   rail, which the rail's reconnect does, or invalidate the region's rkey
//!   and grant the next data under a new one). Do not invalidate a named
//!   window's rkey while it is live: its extents are posted again with it.
//!   Locally nothing is needed: the data path raises `WindowDone` only once
//!   no rail's device can touch the window's staging memory any more
//!   (flushes, the rail's [`FenceFn`] or its reconnect retire its zombie
//!   requests). Give each rail a fence callback (verbs: move the QP to the
//!   error state) so that a rail whose port is down does not hold windows
//!   until it is reconnected.
//! - register every window's memory with every rail's provider; where the
//!   keys differ per rail (rails on different devices), give the rail a key
//!   map ([`RailSpec::keys`]) from the window's (rail 0's) keys to its own.
//!
//! Counting: the engine's [`Counters`](crate::engine::stream::Counters)
//! (of the stream and of each rail) are the one count of requests posted,
//! doorbells, signaled, inline, completions, errors, failures and post
//! failures; [`Report`] and [`DataPathStats`] hold copies of them. The completion threads count only their own polls, arms,
//! waits and wakeups; this runner only what the engine cannot see (post →
//! completion latency of signaled requests, reconnect, fail-over and port
//! times).

use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::bucket::TokenBucket;
use super::completion::{completion_loop, pin_current_thread, AvoidCpu};
use super::config::{Backoff, ConfigError, CqCpu, DataPathConfig, PollMode};
use super::port::PortMonitor;
use super::report::{RailReport, Report};
use super::stats::{DataPathStats, Latencies};
use crate::engine::slots::WrId;
use crate::engine::stream::{
    AnyEvent, Batch, ErrorCause, Event, RailConfig, RailEvent, RailState, State, WindowError,
};
use crate::engine::{Stream, StreamConfig, WcStatus, WindowJob, WorkCompletion};
use crate::provider::{Channel, ProviderError};

/// An error from the caller's reconnect callback.
pub type ReconnectError = Box<dyn std::error::Error + Send + Sync>;

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

/// The caller's reconnect callback of a one-rail data path: replace the
/// connection after an error batch (verbs: reset the QP, exchange
/// endpoints, handshake). Called on the rail's reconnect helper thread,
/// retried with backoff.
pub type ReconnectFn = Box<dyn FnMut() -> Result<(), ReconnectError> + Send>;

/// A rail's reconnect callback, given the rail's index: replace that rail's
/// connection (verbs: reset its QP, exchange endpoints with the peer's QP of
/// the same rail, handshake). Called on the rail's helper thread while the
/// other rails post, retried with backoff.
pub type RailReconnectFn = Box<dyn FnMut(usize) -> Result<(), ReconnectError> + Send>;

/// A rail's fence callback, given the rail's index: take the failed rail's
/// queue pair out of service at once (verbs: move it to the error state, so
/// its send queue is flushed, or reset it). `Ok` promises that the channel
/// touches no memory of any request posted on it before the call. Called on
/// the rail's helper thread when the rail is fenced, before its reconnect.
pub type FenceFn = Box<dyn FnMut(usize) -> Result<(), ReconnectError> + Send>;

/// A key map of a rail: the window's `(lkey, rkey)` (those of rail 0) →
/// this rail's.
pub type KeyMapFn = Box<dyn Fn(u32, u32) -> (u32, u32) + Send>;

/// One rail of a data path: its channel and what the data path needs to
/// run and recover it.
pub struct RailSpec {
    /// The rail's connected channel.
    pub channel: Arc<dyn Channel>,
    /// Replaces the rail's connection.
    pub reconnect: RailReconnectFn,
    /// The rail's port; with several rails its going down fails the rail,
    /// and a reconnect waits for it to come back.
    pub monitor: Option<Arc<dyn PortMonitor>>,
    /// Takes the rail's queue pair out of service when the rail is fenced
    /// (see [`FenceFn`]); without it, the rail's zombie requests (and the
    /// windows they hold) wait for their flushes or the reconnect.
    pub fence: Option<FenceFn>,
    /// Where its completion thread runs: resolved with `numa_node` and the
    /// rail's index ([`CqCpu::for_thread`]); `None`: the configuration's
    /// `cq_cpu`.
    pub cq_cpu: Option<CqCpu>,
    /// The NUMA node of the rail's device (for `cq_cpu: Some(CqCpu::Auto)`).
    pub numa_node: Option<u32>,
    /// The window's `(lkey, rkey)` → this rail's, for rails whose
    /// registrations differ from rail 0's (another device); `None`: the
    /// same keys.
    pub keys: Option<KeyMapFn>,
}

impl RailSpec {
    /// A rail over `channel`, reconnected by `reconnect`, nothing else.
    pub fn new(channel: Arc<dyn Channel>, reconnect: RailReconnectFn) -> Self {
        RailSpec {
            channel,
            reconnect,
            monitor: None,
            fence: None,
            cq_cpu: None,
            numa_node: None,
            keys: None,
        }
    }

    /// With a port monitor.
    pub fn with_monitor(mut self, m: Arc<dyn PortMonitor>) -> Self {
        self.monitor = Some(m);
        self
    }

    /// With a fence callback.
    pub fn with_fence(mut self, f: FenceFn) -> Self {
        self.fence = Some(f);
        self
    }

    /// With its own CQ CPU choice.
    pub fn with_cq_cpu(mut self, c: CqCpu, numa_node: Option<u32>) -> Self {
        self.cq_cpu = Some(c);
        self.numa_node = numa_node;
        self
    }

    /// With a key map.
    pub fn with_keys(mut self, k: KeyMapFn) -> Self {
        self.keys = Some(k);
        self
    }
}

impl std::fmt::Debug for RailSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RailSpec")
            .field("caps", &self.channel.caps())
            .field("monitor", &self.monitor.is_some())
            .field("fence", &self.fence.is_some())
            .field("cq_cpu", &self.cq_cpu)
            .field("keys", &self.keys.is_some())
            .finish_non_exhaustive()
    }
}

/// What the data path tells its owner, in order.
#[derive(Debug)]
pub enum DpEvent {
    /// Every extent of the window is confirmed and no device can touch its
    /// staging any more: its staging region is the caller's again (read it
    /// after a READ), its id free.
    WindowDone { id: u64 },
    /// One rail: the connection was replaced after an error batch;
    /// `seconds` from the error to the new epoch.
    Reconnected { epoch: u32, seconds: f64 },
    /// Several rails: rail `rail` failed in `epoch` and posts no more; its
    /// helper reconnects it in the background.
    RailDown {
        rail: usize,
        epoch: u32,
        cause: ErrorCause,
    },
    /// Several rails: the failed rail's outstanding extents are being posted
    /// on the other rails; `windows` had requests on it. The caller fences
    /// their remote regions before reusing them (module docs).
    RailFenced { rail: usize, windows: Vec<u64> },
    /// Several rails: the rail failed again soon after its last failure (or
    /// could not be reconnected); it rejoins no sooner than `for_` from now.
    RailPaused { rail: usize, for_: Duration },
    /// Several rails: the rail was reconnected and carries chains again.
    RailUp { rail: usize },
    /// Terminal: the data path posts no more, and every window not done is
    /// lost (redo it on a new session). Memory of those windows is the
    /// caller's again once [`DataPath::close`] has returned and the
    /// channels have been reset or dropped (see [`DataPath::submit`]).
    Failed(DataPathError),
}

struct CqBatch {
    at: Instant,
    wcs: Vec<WorkCompletion>,
}

/// How a completion thread ended.
enum CqEnd {
    Stopped,
    Error(ProviderError),
    Panicked,
}

/// The posting thread's one input queue.
enum Input {
    Cq(usize, CqBatch),
    Submit(WindowJob),
    CqEnded(usize, CqEnd),
    /// A rail's helper brought it back, or gave up after `attempts`.
    Reconnected {
        rail: usize,
        result: Result<(), (u32, ReconnectError)>,
    },
    /// A rail's fence callback returned `Ok`: its queue pair touches no
    /// memory any more.
    Fenced(usize),
    /// A rail's port went down.
    PortDown(usize),
    Close,
}

/// What the posting thread asks a rail's helper.
enum Cmd {
    /// Bring the rail back: fence it first (if `fence`), wait `after`, then
    /// reconnect.
    Reconnect {
        fence: bool,
        after: Duration,
    },
    Stop,
}

/// What the caller's side and the posting thread share.
#[derive(Default)]
struct Shared {
    /// Failed or closing: `submit` refuses.
    stopped: AtomicBool,
    /// Ids submitted and not yet done (so `submit` refuses a live id at
    /// once instead of the posting thread later).
    live: Mutex<HashSet<u64>>,
    /// Times the posting thread blocked on its input queue with no timeout
    /// (idle: only an input wakes it), and whether it is blocked so now.
    #[cfg(test)]
    parks: AtomicU64,
    #[cfg(test)]
    parked: AtomicBool,
    /// Times the posting thread waited for an input (any wait: a poster
    /// that spins shows as many).
    #[cfg(test)]
    waits: AtomicU64,
}

/// A session-long data path over one channel or several rails. See the
/// module docs.
pub struct DataPath {
    tx: Sender<Input>,
    shared: Arc<Shared>,
    events: Mutex<Option<UnboundedReceiver<DpEvent>>>,
    poster: Option<JoinHandle<Report>>,
    stats: Arc<DataPathStats>,
    cfg: DataPathConfig,
    stream_cfg: StreamConfig,
    rail_cfgs: Vec<RailConfig>,
}

impl std::fmt::Debug for DataPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataPath")
            .field("stream", &self.stream_cfg)
            .field("rails", &self.rail_cfgs)
            .field("stopped", &self.shared.stopped.load(Relaxed))
            .finish_non_exhaustive()
    }
}

/// In poll mode, how long the poster spins for the next completion batch
/// before it parks (the completion thread keeps spinning on the CQ).
pub const POSTER_SPIN: Duration = Duration::from_micros(20);

/// Longest a helper or port watcher blocks at once before it looks at its
/// stop signal.
const SLICE: Duration = Duration::from_millis(20);

impl DataPath {
    /// Start a one-rail data path over `channel`. `reconnect` replaces the
    /// connection after an error batch; with `monitor`, a reconnect waits
    /// for the port while it is down instead of sleeping its backoff blind.
    pub fn start(
        cfg: DataPathConfig,
        channel: Arc<dyn Channel>,
        reconnect: ReconnectFn,
        monitor: Option<Arc<dyn PortMonitor>>,
    ) -> Result<DataPath, DataPathError> {
        let mut reconnect = reconnect;
        let mut rail = RailSpec::new(channel, Box::new(move |_| reconnect()));
        rail.monitor = monitor;
        Self::start_rails(cfg, vec![rail])
    }

    /// Start a data path over `rails` (one channel each, `1..=`
    /// [`MAX_RAILS`](crate::engine::stream::MAX_RAILS)): the posting thread,
    /// a completion thread and a reconnect helper per rail, and (several
    /// rails) a port watcher per rail with a monitor. One rail is exactly
    /// [`start`](Self::start). Each rail's depth and inline limit come from
    /// its channel's caps.
    pub fn start_rails(
        cfg: DataPathConfig,
        rails: Vec<RailSpec>,
    ) -> Result<DataPath, DataPathError> {
        cfg.validate()?;
        if !(1..=crate::engine::stream::MAX_RAILS).contains(&rails.len()) {
            return Err(DataPathError::Config(ConfigError::Field {
                field: "rails",
                value: rails.len().to_string(),
                reason: format!("1..={} rails", crate::engine::stream::MAX_RAILS),
            }));
        }
        let n = rails.len();
        let multi = n > 1;
        let mut stream_cfgs = Vec::with_capacity(n);
        for r in &rails {
            stream_cfgs.push(cfg.stream_config(&r.channel.caps())?);
        }
        let stream_cfg = stream_cfgs[0];
        let rail_cfgs: Vec<RailConfig> = stream_cfgs.iter().map(RailConfig::of).collect();
        let stream =
            Stream::with_rails(stream_cfg, &rail_cfgs).expect("stream_config validated it");
        let stats = Arc::new(DataPathStats::with_rails(n));
        let total_depth: usize = rail_cfgs.iter().map(|r| r.sq_depth).sum();
        stats.sq_free.store(total_depth as u64, Relaxed);
        for (s, r) in stats.rails.iter().zip(&rail_cfgs) {
            s.sq_free.store(r.sq_depth as u64, Relaxed);
        }
        let shared = Arc::new(Shared::default());
        let (tx, rx) = mpsc::channel::<Input>();
        let (ev_tx, ev_rx) = unbounded_channel();
        let stop = Arc::new(AtomicBool::new(false));
        // Everything started so far is stopped if a later spawn fails.
        let fail_start = |stop: &AtomicBool, e: std::io::Error| {
            stop.store(true, Relaxed);
            DataPathError::Spawn(e)
        };

        let mut rts = Vec::with_capacity(n);
        for (i, spec) in rails.into_iter().enumerate() {
            let RailSpec {
                channel,
                reconnect,
                monitor,
                fence,
                cq_cpu,
                numa_node,
                keys,
            } = spec;
            let cpu = match cq_cpu {
                Some(c) => c.for_thread(numa_node, i),
                None => cfg.cq_cpu,
            };
            let (recycle_tx, recycle_rx) = mpsc::channel::<Vec<WorkCompletion>>();
            let cq = {
                let (channel, stats, stop_c, tx) =
                    (channel.clone(), stats.clone(), stop.clone(), tx.clone());
                let mode = cfg.poll_mode;
                std::thread::Builder::new()
                    .name(format!("rcp-cq{}", if multi { i.to_string() } else { String::new() }))
                    .spawn(move || {
                        if let Some(cpu) = cpu {
                            if let Err(e) = pin_current_thread(cpu) {
                                tracing::warn!(rail = i, cpu, error = %e, "cannot pin the completion thread");
                            }
                        }
                        let run = std::panic::catch_unwind(AssertUnwindSafe(|| {
                            completion_loop(&*channel, mode, &stop_c, &stats, &mut |wcs, at| {
                                let mut v = recycle_rx
                                    .try_recv()
                                    .unwrap_or_else(|_| Vec::with_capacity(wcs.len()));
                                v.clear();
                                v.extend_from_slice(wcs);
                                tx.send(Input::Cq(i, CqBatch { at, wcs: v })).is_ok()
                            })
                        }));
                        let end = match run {
                            Ok(Ok(())) => CqEnd::Stopped,
                            Ok(Err(e)) => CqEnd::Error(e),
                            Err(_) => CqEnd::Panicked,
                        };
                        let _ = tx.send(Input::CqEnded(i, end));
                    })
                    .map_err(|e| fail_start(&stop, e))?
            };
            let (cmd_tx, cmd_rx) = mpsc::channel::<Cmd>();
            let port_waits = Arc::new(AtomicU64::new(0));
            let helper = Helper {
                rail: i,
                reconnect,
                fence,
                monitor: monitor.clone(),
                backoff: cfg.backoff,
                cmds: cmd_rx,
                tx: tx.clone(),
                stats: stats.clone(),
                port_waits: port_waits.clone(),
            };
            let helper = std::thread::Builder::new()
                .name(format!("rcp-rail{i}"))
                .spawn(move || helper.run())
                .map_err(|e| fail_start(&stop, e))?;
            let watcher = match (&monitor, multi) {
                (Some(m), true) => {
                    let (m, stop_w, tx) = (m.clone(), stop.clone(), tx.clone());
                    Some(
                        std::thread::Builder::new()
                            .name(format!("rcp-port{i}"))
                            .spawn(move || watch_port(i, &*m, &stop_w, &tx))
                            .map_err(|e| fail_start(&stop, e))?,
                    )
                }
                _ => None,
            };
            rts.push(RailRt {
                events0: monitor.as_ref().map_or(0, |m| m.events_seen()),
                channel,
                monitor,
                keys,
                cmds: cmd_tx,
                helper: Some(helper),
                cq: Some(cq),
                watcher,
                recycle: recycle_tx,
                post_times: vec![(u64::MAX, Instant::now()); rail_cfgs[i].sq_depth],
                reconnecting: false,
                rejoin: false,
                failed_at: None,
                flush_deadline: None,
                failover: None,
                reconnect_seconds: Vec::new(),
                failover_seconds: Vec::new(),
                port_waits,
                post_fail_run: 0,
                cq_ended: false,
                cpu,
            });
        }

        let now = Instant::now();
        let poster = Poster {
            // Engine time starts at `now`: the bucket starts empty there.
            bucket: cfg.rate_limit.map(|r| TokenBucket::new(r, 0)),
            cfg: cfg.clone(),
            stream,
            rails: rts,
            rx,
            events: ev_tx,
            stats: stats.clone(),
            shared: shared.clone(),
            start: now,
            latency: Latencies::default(),
            reconnect_seconds: Vec::new(),
            port_up_to_first_wr: Vec::new(),
            reconnect_started: None,
            port_up_at: None,
            last_progress: now,
            last_confirmed: 0,
            closing: false,
            failed: false,
            batch: Batch::default(),
        };
        let poster = std::thread::Builder::new()
            .name("rcp-post".into())
            .spawn({
                let stop = stop.clone();
                move || poster.run(stop)
            })
            .map_err(|e| {
                // The completion threads' next send fails (the poster and
                // its receiver are gone), or they see `stop`.
                fail_start(&stop, e)
            })?;
        Ok(DataPath {
            tx,
            shared,
            events: Mutex::new(Some(ev_rx)),
            poster: Some(poster),
            stats,
            cfg,
            stream_cfg,
            rail_cfgs,
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
    /// this data path runs on (with several rails: of every rail's channel,
    /// under the lkey the rail's [`RailSpec::keys`] maps `w.lkey` to),
    /// stays mapped, and is lent to the devices:
    /// the caller (and everyone else) does not write it (WRITE window: the
    /// device reads it) or neither reads nor writes it (READ window: the
    /// device writes it)
    /// - until [`DpEvent::WindowDone`] for `w.id` has been received, or
    /// - if that never comes (the data path failed, or was closed first),
    ///   until [`close`](Self::close) or drop has returned *and* the
    ///   channels have been reset or dropped: a request may still be in a
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

    /// The engine configuration it runs with (rail 0's depth, the batch
    /// policy, rail 0's inline limit as decided for its channel).
    pub fn stream_config(&self) -> &StreamConfig {
        &self.stream_cfg
    }

    /// Each rail's depth and inline limit, as decided for its channel.
    pub fn rail_configs(&self) -> &[RailConfig] {
        &self.rail_cfgs
    }

    /// Stop: windows not yet posted are dropped, requests in flight get up
    /// to `flush_timeout` to retire, every thread is joined. Returns what
    /// the data path did over its life.
    pub fn close(mut self) -> Report {
        self.shutdown()
    }

    /// Times the posting thread parked idle (blocked on its input queue
    /// with no timeout), and whether it is parked now.
    #[cfg(test)]
    pub(crate) fn poster_parks(&self) -> (u64, bool) {
        (
            self.shared.parks.load(Relaxed),
            self.shared.parked.load(Relaxed),
        )
    }

    /// Times the posting thread waited for an input, parked or not.
    #[cfg(test)]
    pub(crate) fn poster_waits(&self) -> u64 {
        self.shared.waits.load(Relaxed)
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

/// A rail's reconnect helper: brings the rail back when asked, off the
/// posting thread.
struct Helper {
    rail: usize,
    reconnect: RailReconnectFn,
    fence: Option<FenceFn>,
    monitor: Option<Arc<dyn PortMonitor>>,
    backoff: Backoff,
    cmds: Receiver<Cmd>,
    tx: Sender<Input>,
    stats: Arc<DataPathStats>,
    port_waits: Arc<AtomicU64>,
}

impl Helper {
    fn run(mut self) {
        loop {
            match self.cmds.recv() {
                Ok(Cmd::Reconnect { fence, after }) => {
                    if !self.bring_back(fence, after) {
                        return;
                    }
                }
                Ok(Cmd::Stop) | Err(_) => return,
            }
        }
    }

    /// Sleep `d`; false if told to stop meanwhile.
    fn sleep(&self, d: Duration) -> bool {
        match self.cmds.recv_timeout(d) {
            Err(RecvTimeoutError::Timeout) => true,
            // Only `Stop` comes while a reconnect is asked for.
            Ok(_) | Err(RecvTimeoutError::Disconnected) => false,
        }
    }

    /// One reconnect: fence, cool-down, port, attempts with backoff. False
    /// if told to stop.
    fn bring_back(&mut self, fence: bool, after: Duration) -> bool {
        let rail = self.rail;
        if fence {
            if let Some(f) = &mut self.fence {
                match f(rail) {
                    Ok(()) => {
                        let _ = self.tx.send(Input::Fenced(rail));
                    }
                    Err(e) => {
                        tracing::warn!(rail, error = %e, "cannot fence the rail's queue pair")
                    }
                }
            }
        }
        if !after.is_zero() && !self.sleep(after) {
            return false;
        }
        // Reconnecting while the port is down cannot work: wait for it.
        let Some(_) = self.wait_port() else {
            return false;
        };
        let attempts = self.backoff.max_attempts;
        let mut n = 0;
        loop {
            match (self.reconnect)(rail) {
                Ok(()) => {
                    let _ = self.tx.send(Input::Reconnected {
                        rail,
                        result: Ok(()),
                    });
                    return true;
                }
                Err(e) => {
                    n += 1;
                    if n >= attempts {
                        let _ = self.tx.send(Input::Reconnected {
                            rail,
                            result: Err((n, e)),
                        });
                        return true;
                    }
                    let d = self.backoff.delay(n - 1);
                    tracing::warn!(rail, attempt = n, error = %e, delay_ms = d.as_millis() as u64, "reconnect failed; retrying");
                    match self.wait_port() {
                        None => return false,
                        Some(true) => {}
                        Some(false) => {
                            if !self.sleep(d) {
                                return false;
                            }
                        }
                    }
                }
            }
        }
    }

    /// With a port monitor and the port down: wait for PORT_ACTIVE, at most
    /// the backoff cap, and say `Some(true)` (retry at once). `Some(false)`
    /// when there is nothing to wait for (no monitor, or the port is up);
    /// `None` if told to stop.
    fn wait_port(&self) -> Option<bool> {
        let Some(m) = self.monitor.clone() else {
            return Some(false);
        };
        if m.is_active() {
            return Some(false);
        }
        let cap = self.backoff.cap;
        tracing::warn!(
            rail = self.rail,
            cap_ms = cap.as_millis() as u64,
            "port down: waiting for PORT_ACTIVE before reconnecting"
        );
        self.port_waits.fetch_add(1, Relaxed);
        self.stats.port_waits.fetch_add(1, Relaxed);
        if let Some(r) = self.stats.rails.get(self.rail) {
            r.port_waits.fetch_add(1, Relaxed);
        }
        let t = Instant::now();
        let end = t + cap;
        loop {
            let now = Instant::now();
            if now >= end {
                tracing::warn!(
                    rail = self.rail,
                    waited_ms = t.elapsed().as_millis() as u64,
                    "port still down; trying anyway"
                );
                return Some(true);
            }
            if m.wait_active((end - now).min(SLICE)) {
                tracing::info!(
                    rail = self.rail,
                    waited_ms = t.elapsed().as_millis() as u64,
                    "PORT_ACTIVE: reconnecting now"
                );
                return Some(true);
            }
            match self.cmds.try_recv() {
                Err(TryRecvError::Empty) => {}
                Ok(_) | Err(TryRecvError::Disconnected) => return None,
            }
        }
    }
}

/// A rail's port watcher (several rails): says when the port goes down.
fn watch_port(rail: usize, m: &dyn PortMonitor, stop: &AtomicBool, tx: &Sender<Input>) {
    while !stop.load(Relaxed) {
        if m.is_active() {
            std::thread::sleep(SLICE / 2);
            continue;
        }
        tracing::warn!(rail, "port down");
        if tx.send(Input::PortDown(rail)).is_err() {
            return;
        }
        while !stop.load(Relaxed) && !m.wait_active(SLICE) {}
    }
}

/// The posting thread's view of one rail.
struct RailRt {
    channel: Arc<dyn Channel>,
    monitor: Option<Arc<dyn PortMonitor>>,
    keys: Option<KeyMapFn>,
    cmds: Sender<Cmd>,
    helper: Option<JoinHandle<()>>,
    cq: Option<JoinHandle<()>>,
    watcher: Option<JoinHandle<()>>,
    recycle: Sender<Vec<WorkCompletion>>,
    /// By slot index: the `wr_id` and post time of the last signaled
    /// request posted in that slot.
    post_times: Vec<(u64, Instant)>,
    /// A reconnect is asked for and not answered.
    reconnecting: bool,
    /// Reconnected: to rejoin at the next round.
    rejoin: bool,
    /// When the rail last failed (until it runs again).
    failed_at: Option<Instant>,
    /// One rail: when the error path stops waiting for flushes.
    flush_deadline: Option<Instant>,
    /// After a fence: the engine's `posted` count at which the rail's
    /// extents are all posted again elsewhere.
    failover: Option<u64>,
    reconnect_seconds: Vec<f64>,
    failover_seconds: Vec<f64>,
    port_waits: Arc<AtomicU64>,
    post_fail_run: u32,
    cq_ended: bool,
    events0: u64,
    /// The CPU its completion thread is pinned to.
    cpu: Option<usize>,
}

/// Keeps the calling thread off several CPUs; restores in reverse order.
struct AvoidCpus(Vec<AvoidCpu>);

impl Drop for AvoidCpus {
    fn drop(&mut self) {
        while let Some(g) = self.0.pop() {
            drop(g);
        }
    }
}

/// The posting thread's state: owns the stream.
struct Poster {
    cfg: DataPathConfig,
    stream: Stream,
    rails: Vec<RailRt>,
    rx: Receiver<Input>,
    events: UnboundedSender<DpEvent>,
    stats: Arc<DataPathStats>,
    shared: Arc<Shared>,
    /// Engine time is nanoseconds since this.
    start: Instant,
    latency: Latencies,
    reconnect_seconds: Vec<f64>,
    port_up_to_first_wr: Vec<f64>,
    /// One rail: set when it is reconnected, until the first extent
    /// confirmed after it: when its error path started and the extents
    /// confirmed by then.
    reconnect_started: Option<(Instant, u64)>,
    /// When the port came back, for a reconnect that found it down.
    port_up_at: Option<Instant>,
    /// When an extent was last confirmed (or the start).
    last_progress: Instant,
    last_confirmed: u64,
    closing: bool,
    failed: bool,
    /// The chain being posted (its vector reused).
    batch: Batch,
    /// The rate limit, if any: a chain's bytes are taken before it posts.
    bucket: Option<TokenBucket>,
}

impl Poster {
    fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn multi(&self) -> bool {
        self.rails.len() > 1
    }

    fn run(mut self, stop: Arc<AtomicBool>) -> Report {
        // A pinned completion thread that spins owns its core: the poster
        // keeps off it rather than take turns with a thread that never
        // sleeps.
        let mut cpus: Vec<usize> = match self.cfg.poll_mode {
            PollMode::Poll | PollMode::Hybrid { .. } => {
                self.rails.iter().filter_map(|r| r.cpu).collect()
            }
            PollMode::Event => Vec::new(),
        };
        cpus.sort_unstable();
        cpus.dedup();
        let _off_cq_cores = AvoidCpus(cpus.into_iter().map(AvoidCpu::new).collect());
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
        self.finish(&stop)
    }

    /// One round after the inputs are absorbed: timers, events, rails
    /// (reconnects asked for, rails rejoining), posting, publishing.
    /// Returns how long to wait for the next input (`None`: until one
    /// comes).
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
            self.handle_events();
            self.drive_rails();
            if self.closing {
                return None;
            }
            throttled = if self.failed { None } else { self.post_all() };
            self.note_failover();
            self.publish();
            // A post failure may have raised events: act on them now.
            if !self.stream.has_events() && !self.rails.iter().any(|r| r.rejoin) {
                break;
            }
        }
        let mut wait = throttled;
        let mut at = |d: Duration| wait = Some(wait.map_or(d, |w| w.min(d)));
        if let Some(t) = self.stream.next_timeout() {
            at(Duration::from_nanos(t.saturating_sub(self.now_ns())));
        }
        let now = Instant::now();
        for r in &self.rails {
            if let Some(d) = r.flush_deadline {
                if !r.reconnecting {
                    at(d.saturating_duration_since(now));
                }
            }
        }
        wait
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
        #[cfg(test)]
        self.shared.waits.fetch_add(1, Relaxed);
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
            None => {
                #[cfg(test)]
                {
                    self.shared.parks.fetch_add(1, Relaxed);
                    self.shared.parked.store(true, Relaxed);
                }
                let got = self.rx.recv();
                #[cfg(test)]
                self.shared.parked.store(false, Relaxed);
                match got {
                    Ok(i) => Some(i),
                    Err(_) => {
                        self.closing = true;
                        None
                    }
                }
            }
        };
        if let Some(i) = got {
            self.input(i);
        }
    }

    fn input(&mut self, i: Input) {
        match i {
            Input::Cq(rail, b) => self.absorb(rail, b),
            Input::Submit(w) => {
                let id = w.id;
                if let Err(e) = self.stream.add_window(w) {
                    // Only a failed stream refuses a window `submit` let
                    // through; the Failed event already said it is lost.
                    self.shared.live.lock().unwrap().remove(&id);
                    tracing::debug!(window = id, error = %e, "window dropped");
                }
            }
            Input::CqEnded(rail, end) => {
                self.rails[rail].cq_ended = true;
                match end {
                    CqEnd::Stopped => {}
                    CqEnd::Error(e) => self.fail(DataPathError::Completion(e)),
                    CqEnd::Panicked => self.fail(DataPathError::CompletionPanicked),
                }
            }
            Input::Reconnected { rail, result } => {
                self.rails[rail].reconnecting = false;
                match result {
                    Ok(()) => self.rails[rail].rejoin = true,
                    Err((attempts, source)) => self.reconnect_gave_up(rail, attempts, source),
                }
            }
            Input::Fenced(rail) => {
                tracing::info!(
                    rail,
                    "rail fenced: its queue pair touches no memory any more"
                );
                self.stream.rail_quiesced(rail);
            }
            Input::PortDown(rail) => {
                if self.stream.rail_state(rail) == RailState::Running {
                    tracing::warn!(rail, "port down: the rail fails");
                }
                let now = self.now_ns();
                self.stream.rail_lost(rail, now);
            }
            Input::Close => self.closing = true,
        }
    }

    fn reconnect_gave_up(&mut self, rail: usize, attempts: u32, source: ReconnectError) {
        let running = self.stream.state() == State::Running;
        if !self.multi() || !running {
            self.fail(DataPathError::Reconnect { attempts, source });
            return;
        }
        tracing::warn!(rail, attempts, error = %source, "rail reconnect given up; pausing it");
        let now = self.now_ns();
        self.stream.rail_reconnect_failed(rail, now);
    }

    fn absorb(&mut self, rail: usize, b: CqBatch) {
        let rt = &mut self.rails[rail];
        for wc in &b.wcs {
            if !wc.status.is_success() {
                continue;
            }
            let i = WrId(wc.wr_id).index();
            if let Some(slot) = rt.post_times.get_mut(i) {
                if slot.0 == wc.wr_id {
                    slot.0 = u64::MAX;
                    self.latency
                        .record(b.at.saturating_duration_since(slot.1).as_nanos() as u64);
                }
            }
        }
        let now = self.now_ns();
        self.stream.on_completions(rail, now, &b.wcs);
        let _ = self.rails[rail].recycle.send(b.wcs);
    }

    /// Time the first extent confirmed after a one-rail reconnect.
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

    /// A fenced rail's extents are all posted elsewhere: time it.
    fn note_failover(&mut self) {
        let posted = self.stream.counters().posted;
        for (r, rt) in self.rails.iter_mut().enumerate() {
            let Some(target) = rt.failover else {
                continue;
            };
            if posted < target {
                continue;
            }
            rt.failover = None;
            let s = rt.failed_at.map_or(0.0, |t| t.elapsed().as_secs_f64());
            rt.failover_seconds.push(s);
            tracing::info!(
                rail = r,
                seconds = s,
                "the failed rail's blocks are posted on the others"
            );
        }
    }

    /// Act on the stream's events, in order.
    fn handle_events(&mut self) {
        while let Some(ev) = self.stream.poll_event() {
            match ev {
                AnyEvent::Stream(Event::WindowDone { id }) => {
                    self.shared.live.lock().unwrap().remove(&id);
                    let _ = self.events.send(DpEvent::WindowDone { id });
                }
                AnyEvent::Stream(Event::ErrorBatch {
                    epoch,
                    cause,
                    action,
                }) => {
                    tracing::warn!(epoch, ?cause, ?action, "error batch");
                }
                AnyEvent::Stream(Event::Timeout {
                    wr_id,
                    window,
                    extent,
                }) => {
                    tracing::warn!(wr_id, window, extent, "request timed out");
                }
                AnyEvent::Stream(Event::ReadyToReconnect { epoch, unconfirmed }) => {
                    tracing::info!(epoch, unconfirmed, "failed epoch drained");
                }
                AnyEvent::Rail(RailEvent::Down { rail, epoch, cause }) => {
                    tracing::warn!(rail, epoch, ?cause, "rail down");
                    self.rails[rail].failed_at = Some(Instant::now());
                    let _ = self.events.send(DpEvent::RailDown { rail, epoch, cause });
                }
                AnyEvent::Rail(RailEvent::Fenced {
                    rail,
                    epoch,
                    windows,
                    requeued,
                }) => {
                    tracing::warn!(
                        rail,
                        epoch,
                        windows = windows.len(),
                        requeued,
                        "rail fenced: its blocks go to the other rails"
                    );
                    if requeued > 0 {
                        self.rails[rail].failover = Some(self.stream.counters().posted + requeued);
                    }
                    let _ = self.events.send(DpEvent::RailFenced { rail, windows });
                }
                AnyEvent::Rail(RailEvent::Paused { rail, for_ns, .. }) => {
                    let for_ = Duration::from_nanos(for_ns);
                    tracing::warn!(
                        rail,
                        cool_down_ms = for_.as_millis() as u64,
                        "rail paused: it keeps failing"
                    );
                    let _ = self.events.send(DpEvent::RailPaused { rail, for_ });
                }
                AnyEvent::Rail(RailEvent::Up { rail, epoch }) => {
                    let rt = &mut self.rails[rail];
                    let s = rt.failed_at.take().map(|t| t.elapsed().as_secs_f64());
                    if let Some(s) = s {
                        rt.reconnect_seconds.push(s);
                        self.reconnect_seconds.push(s);
                        self.stats.reconnect_ns.fetch_add((s * 1e9) as u64, Relaxed);
                    }
                    tracing::info!(rail, epoch, seconds = s, "rail up");
                    let _ = self.events.send(DpEvent::RailUp { rail });
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
    }

    /// Ask the helpers for the reconnects the rails need; let reconnected
    /// rails rejoin.
    fn drive_rails(&mut self) {
        if self.failed {
            return;
        }
        for r in 0..self.rails.len() {
            if self.rails[r].rejoin {
                self.rails[r].rejoin = false;
                self.rejoin(r);
                if self.failed || self.closing {
                    return;
                }
            }
            let now = Instant::now();
            let st = self.stream.rail_state(r);
            let rt = &mut self.rails[r];
            if st == RailState::Running {
                rt.flush_deadline = None;
                continue;
            }
            rt.failed_at.get_or_insert(now);
            if rt.reconnecting || rt.rejoin {
                continue;
            }
            let after = match st {
                RailState::Running => unreachable!(),
                RailState::Flushing => {
                    let d = *rt
                        .flush_deadline
                        .get_or_insert(now + self.cfg.flush_timeout);
                    if now < d {
                        continue;
                    }
                    tracing::warn!(
                        outstanding = self.stream.outstanding(),
                        "flush incomplete after {:?}: reconnecting anyway",
                        self.cfg.flush_timeout
                    );
                    Duration::ZERO
                }
                RailState::NeedsReconnect | RailState::Down => Duration::ZERO,
                RailState::Paused { until } => Duration::from_nanos(
                    until.saturating_sub(self.start.elapsed().as_nanos() as u64),
                ),
            };
            let fence = st.is_fenced() && self.stream.rail_outstanding(r) > 0;
            rt.flush_deadline = None;
            rt.reconnecting = true;
            tracing::info!(
                rail = r,
                after_ms = after.as_millis() as u64,
                fence,
                "reconnecting the rail"
            );
            if rt.cmds.send(Cmd::Reconnect { fence, after }).is_err() {
                self.fail(DataPathError::Stopped);
                return;
            }
        }
    }

    /// Rail `r` was reconnected: start its next epoch.
    fn rejoin(&mut self, r: usize) {
        // One rail: the port came back when the data path last made
        // progress or later; time link-up → first completed request.
        if !self.multi() {
            self.port_up_at = self.rails[0]
                .monitor
                .as_ref()
                .and_then(|m| m.active_since())
                .filter(|&a| a >= self.last_progress);
        }
        // Completions of the old epoch still queued are stale to the engine
        // (or confirm what they retire, before the epoch turns).
        self.drain_inputs();
        self.note_progress();
        self.handle_events();
        if self.closing || self.failed {
            return;
        }
        let reposting = self.stream.unconfirmed().len();
        let now = self.now_ns();
        match self.stream.rail_reconnected(r, now) {
            Ok(epoch) => {
                self.rails[r].post_fail_run = 0;
                if !self.multi() {
                    let t0 = self.rails[0].failed_at.take().unwrap_or_else(Instant::now);
                    self.reconnect_started = Some((t0, self.stream.counters().extents_confirmed));
                    let seconds = t0.elapsed().as_secs_f64();
                    self.rails[0].reconnect_seconds.push(seconds);
                    tracing::info!(epoch, reposting, seconds, "reconnected");
                    let _ = self.events.send(DpEvent::Reconnected { epoch, seconds });
                }
            }
            Err(e) => tracing::error!(rail = r, error = %e, "reconnected on a failed stream"),
        }
        self.handle_events();
    }

    /// Post every chain the stream (and the rate limit) allows now; with a
    /// chain held back by the rate limit, how long until it may go.
    fn post_all(&mut self) -> Option<Duration> {
        let now = self.now_ns();
        loop {
            if let Some(b) = &mut self.bucket {
                let (_, need) = self.stream.next_chain()?;
                if let Err(wait) = b.take(need, now) {
                    return Some(wait);
                }
            }
            let r = self.stream.poll_transmit(now, &mut self.batch)?;
            let rt = &mut self.rails[r];
            if let Some(keys) = &rt.keys {
                // A chain is one window's run: its requests share their
                // keys, so the map (a lock and a lookup) is asked once.
                let mut last: Option<((u32, u32), (u32, u32))> = None;
                for wr in &mut self.batch.wrs {
                    let from = (wr.local.lkey, wr.remote.rkey);
                    let to = match last {
                        Some((f, t)) if f == from => t,
                        _ => {
                            let t = keys(from.0, from.1);
                            last = Some((from, t));
                            t
                        }
                    };
                    (wr.local.lkey, wr.remote.rkey) = to;
                }
            }
            let t = Instant::now();
            // SAFETY: every local segment of the chain is an extent of a
            // window handed in through `DataPath::submit`, whose caller
            // guaranteed (its `# Safety`) that the bytes are registered
            // with this rail's provider under the lkey the chain carries
            // (the window's, through the rail's key map) and left to the
            // devices until the window's `WindowDone` (which the stream
            // raises only after every request of the window is retired on
            // every rail: confirmed, flushed, or its rail quiesced or
            // reconnected) or until the data path stopped and the channels
            // were reset or dropped. The stream posts an extent again only
            // after the request before it was retired or made a zombie that
            // holds the window.
            let res = unsafe { rt.channel.post(&self.batch.wrs) };
            let posted = match &res {
                Ok(()) => self.batch.wrs.len(),
                Err(f) => f.posted,
            };
            for wr in &self.batch.wrs[..posted] {
                if wr.signaled {
                    rt.post_times[WrId(wr.wr_id).index()] = (wr.wr_id, t);
                }
            }
            match res {
                Ok(()) => rt.post_fail_run = 0,
                Err(f) => {
                    if let Some(b) = &mut self.bucket {
                        let refused: u64 = self.batch.wrs[f.posted.min(self.batch.wrs.len())..]
                            .iter()
                            .map(|w| u64::from(w.local.len))
                            .sum();
                        b.give_back(refused);
                    }
                    rt.post_fail_run += 1;
                    let run = rt.post_fail_run;
                    tracing::warn!(
                        rail = r,
                        posted = f.posted,
                        chain = self.batch.wrs.len(),
                        error = %f.error,
                        "post failed"
                    );
                    if let Err(e) = self.stream.post_failed(&self.batch, f.posted) {
                        tracing::error!(error = %e, "engine refused post_failed");
                    }
                    if matches!(f.error, ProviderError::Closed) || run >= 3 {
                        // The connection is unusable: take the error path.
                        self.stream.rail_lost(r, now);
                        return None;
                    }
                    // Try again at once: the refused requests are first in
                    // line; three refusals in a row end it above.
                }
            }
        }
    }

    fn publish(&self) {
        let total_depth: usize = (0..self.rails.len())
            .map(|r| self.stream.rail_config(r).sq_depth)
            .sum();
        let used = self.stream.credits_in_use();
        self.stats.publish(
            self.stream.counters(),
            total_depth.saturating_sub(used) as u64,
        );
        for (r, s) in self.stats.rails.iter().enumerate() {
            let free = self.stream.rail_config(r).sq_depth - self.stream.rail_credits_in_use(r);
            s.publish(
                self.stream.rail_counters(r),
                free as u64,
                self.stream.rail_state(r),
            );
        }
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

    /// Close: post nothing more, give the requests in flight up to
    /// `flush_timeout` to retire, stop and join every thread.
    fn finish(mut self, stop: &AtomicBool) -> Report {
        self.shared.stopped.store(true, Relaxed);
        let deadline = Instant::now() + self.cfg.flush_timeout;
        while self.stream.outstanding() > 0 && !self.rails.iter().all(|r| r.cq_ended) {
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
            self.handle_events();
        }
        stop.store(true, Relaxed);
        for r in &mut self.rails {
            let _ = r.cmds.send(Cmd::Stop);
        }
        for (i, r) in self.rails.iter_mut().enumerate() {
            if r.cq
                .take()
                .map(JoinHandle::join)
                .is_some_and(|j| j.is_err())
            {
                tracing::error!(rail = i, "the completion thread panicked");
            }
        }
        // Helpers may be inside a reconnect callback: their news is taken
        // meanwhile (and dropped).
        for r in &mut self.rails {
            if let Some(h) = r.helper.take() {
                while !h.is_finished() {
                    let _ = self.rx.recv_timeout(SLICE);
                }
                let _ = h.join();
            }
            if let Some(w) = r.watcher.take() {
                let _ = w.join();
            }
        }
        self.drain_inputs();
        self.handle_events();
        self.note_progress();
        self.publish();
        let s = &self.stats;
        let rails: Vec<RailReport> = self
            .rails
            .iter_mut()
            .enumerate()
            .map(|(i, rt)| RailReport {
                counters: *self.stream.rail_counters(i),
                reconnect_seconds: std::mem::take(&mut rt.reconnect_seconds),
                failover_seconds: std::mem::take(&mut rt.failover_seconds),
                port_events: rt
                    .monitor
                    .as_ref()
                    .map_or(0, |m| m.events_seen().saturating_sub(rt.events0)),
                port_waits: rt.port_waits.load(Relaxed),
            })
            .collect();
        Report {
            counters: *self.stream.counters(),
            seconds: self.start.elapsed().as_secs_f64(),
            reconnect_seconds: std::mem::take(&mut self.reconnect_seconds),
            port_up_to_first_wr_seconds: std::mem::take(&mut self.port_up_to_first_wr),
            latency: std::mem::take(&mut self.latency),
            polls: s.polls.load(Relaxed),
            empty_polls: s.empty_polls.load(Relaxed),
            arms: s.arms.load(Relaxed),
            waits: s.waits.load(Relaxed),
            wakeups: s.wakeups.load(Relaxed),
            port_events: rails.iter().map(|r| r.port_events).sum(),
            port_waits: rails.iter().map(|r| r.port_waits).sum(),
            outstanding_at_close: self.stream.outstanding() as u64,
            rails,
        }
    }
}
