//! The posting thread (`rcp-post`): owns the engine [`Stream`], takes its
//! inputs (completion batches, windows, the helpers' news) from one queue,
//! acts on the stream's events, asks the helpers for reconnects and posts
//! every chain the stream and the rate limit allow (module docs of
//! [`runner`](super)).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use super::msg::{Cmd, CqBatch, CqEnd, Input, Shared};
use super::spec::KeyMapFn;
use super::{DataPathError, DpEvent};
use crate::datapath::bucket::TokenBucket;
use crate::datapath::config::{DataPathConfig, PollMode};
use crate::datapath::cpus::AvoidCpu;
use crate::datapath::port::PortMonitor;
use crate::datapath::report::Report;
use crate::datapath::stats::{DataPathStats, Latencies};
use crate::engine::slots::WrId;
use crate::engine::stream::{AnyEvent, Batch, Event, RailEvent, RailState, State};
use crate::engine::{Stream, WorkCompletion};
use crate::provider::Channel;

/// In poll mode, how long the poster spins for the next completion batch
/// before it parks (the completion thread keeps spinning on the CQ).
pub const POSTER_SPIN: Duration = Duration::from_micros(20);

/// The posting thread's view of one rail.
pub(super) struct RailRt {
    pub(super) channel: Arc<dyn Channel>,
    pub(super) monitor: Option<Arc<dyn PortMonitor>>,
    pub(super) keys: Option<KeyMapFn>,
    pub(super) cmds: Sender<Cmd>,
    pub(super) helper: Option<JoinHandle<()>>,
    pub(super) cq: Option<JoinHandle<()>>,
    pub(super) watcher: Option<JoinHandle<()>>,
    pub(super) recycle: Sender<Vec<WorkCompletion>>,
    /// By slot index: the `wr_id` and post time of the last signaled
    /// request posted in that slot.
    pub(super) post_times: Vec<(u64, Instant)>,
    /// A reconnect is asked for and not answered.
    pub(super) reconnecting: bool,
    /// Reconnected: to rejoin at the next round.
    pub(super) rejoin: bool,
    /// When the rail last failed (until it runs again).
    pub(super) failed_at: Option<Instant>,
    /// One rail: when the error path stops waiting for flushes.
    pub(super) flush_deadline: Option<Instant>,
    /// After a fence: the engine's `posted` count at which the rail's
    /// extents are all posted again elsewhere.
    pub(super) failover: Option<u64>,
    pub(super) reconnect_seconds: Vec<f64>,
    pub(super) failover_seconds: Vec<f64>,
    pub(super) port_waits: Arc<AtomicU64>,
    pub(super) post_fail_run: u32,
    pub(super) cq_ended: bool,
    pub(super) events0: u64,
    /// The CPU its completion thread is pinned to.
    pub(super) cpu: Option<usize>,
}

/// A rail's threads, as started, and what the posting thread keeps of
/// them.
pub(super) struct RailThreads {
    pub(super) cmds: Sender<Cmd>,
    pub(super) helper: JoinHandle<()>,
    pub(super) cq: JoinHandle<()>,
    pub(super) watcher: Option<JoinHandle<()>>,
    pub(super) recycle: Sender<Vec<WorkCompletion>>,
    pub(super) port_waits: Arc<AtomicU64>,
    /// The CPU its completion thread is pinned to.
    pub(super) cpu: Option<usize>,
}

impl RailRt {
    /// Rail state at the start, its threads running.
    pub(super) fn new(
        channel: Arc<dyn Channel>,
        monitor: Option<Arc<dyn PortMonitor>>,
        keys: Option<KeyMapFn>,
        sq_depth: usize,
        t: RailThreads,
    ) -> Self {
        RailRt {
            events0: monitor.as_ref().map_or(0, |m| m.events_seen()),
            channel,
            monitor,
            keys,
            cmds: t.cmds,
            helper: Some(t.helper),
            cq: Some(t.cq),
            watcher: t.watcher,
            recycle: t.recycle,
            post_times: vec![(u64::MAX, Instant::now()); sq_depth],
            reconnecting: false,
            rejoin: false,
            failed_at: None,
            flush_deadline: None,
            failover: None,
            reconnect_seconds: Vec::new(),
            failover_seconds: Vec::new(),
            port_waits: t.port_waits,
            post_fail_run: 0,
            cq_ended: false,
            cpu: t.cpu,
        }
    }
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
pub(super) struct Poster {
    pub(super) cfg: DataPathConfig,
    pub(super) stream: Stream,
    pub(super) rails: Vec<RailRt>,
    pub(super) rx: Receiver<Input>,
    pub(super) events: UnboundedSender<DpEvent>,
    pub(super) stats: Arc<DataPathStats>,
    pub(super) shared: Arc<Shared>,
    /// Engine time is nanoseconds since this.
    pub(super) start: Instant,
    pub(super) latency: Latencies,
    pub(super) reconnect_seconds: Vec<f64>,
    pub(super) port_up_to_first_wr: Vec<f64>,
    /// One rail: set when it is reconnected, until the first extent
    /// confirmed after it: when its error path started and the extents
    /// confirmed by then.
    pub(super) reconnect_started: Option<(Instant, u64)>,
    /// When the port came back, for a reconnect that found it down.
    pub(super) port_up_at: Option<Instant>,
    /// When an extent was last confirmed (or the start).
    pub(super) last_progress: Instant,
    pub(super) last_confirmed: u64,
    pub(super) closing: bool,
    pub(super) failed: bool,
    /// The chain being posted (its vector reused).
    pub(super) batch: Batch,
    /// The rate limit, if any: a chain's bytes are taken before it posts.
    pub(super) bucket: Option<TokenBucket>,
}

impl Poster {
    /// The posting thread's state at the start: engine time starts now.
    pub(super) fn new(
        cfg: DataPathConfig,
        stream: Stream,
        rails: Vec<RailRt>,
        rx: Receiver<Input>,
        events: UnboundedSender<DpEvent>,
        stats: Arc<DataPathStats>,
        shared: Arc<Shared>,
    ) -> Self {
        let now = Instant::now();
        Poster {
            // Engine time starts at `now`: the bucket starts empty there.
            bucket: cfg.rate_limit.map(|r| TokenBucket::new(r, 0)),
            cfg,
            stream,
            rails,
            rx,
            events,
            stats,
            shared,
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
        }
    }

    pub(super) fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    pub(super) fn multi(&self) -> bool {
        self.rails.len() > 1
    }

    pub(super) fn run(mut self, stop: Arc<AtomicBool>) -> Report {
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

    pub(super) fn drain_inputs(&mut self) {
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
    pub(super) fn wait_input(&mut self, timeout: Option<Duration>) {
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
            // Only at close, which waits for it there.
            Input::HelperEnded(_) => {}
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

    /// Act on the stream's events, in order.
    pub(super) fn handle_events(&mut self) {
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

    pub(super) fn fail(&mut self, e: DataPathError) {
        if self.failed {
            return;
        }
        self.failed = true;
        self.shared.stopped.store(true, Relaxed);
        tracing::error!(error = %e, "data path failed");
        let _ = self.events.send(DpEvent::Failed(e));
    }
}
