//! The legacy runner: drives an engine [`Transfer`] (one file, uniform
//! blocks) over a [`Channel`], with file I/O through [`BlockIo`]. The
//! control plane of today uses it; it goes, with `engine::Transfer`, when
//! the control plane moves to the session-long [`super::DataPath`].
//!
//! Threads: the calling thread owns the `Transfer` (it is `&mut`) and is the
//! only one that posts; a scoped completion thread per run polls the
//! channel's CQ ([`completion_loop`]) and sends each batch, stamped with the
//! time it was polled, over an mpsc channel (batch vectors come back over a
//! second channel for reuse). No lock is shared on the fast path.
//!
//! Fast path, per loop: absorb completion batches → act on engine events
//! (`BlockDone` → drain (pull) → `release_buffer`; `WindowDone` → control
//! plane) → post every chain the engine allows (fill (push) → one `post`
//! per chain) → wait for the next batch. The error path is apart: on an
//! `ErrorBatch` asking to reconnect it waits (bounded) for the failed
//! epoch's flushes, calls the caller's `reconnect` with exponential backoff
//! and then `Transfer::reconnected`, which reposts the unconfirmed blocks.

mod io;
#[cfg(test)]
mod tests;

pub use io::{BlockIo, MemoryIo, NullIo, Staging};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::completion::{completion_loop, pin_current_thread, AvoidCpu};
use super::config::{ConfigError, DataPathConfig, PollMode};
use super::port::PortMonitor;
use super::stats::DataPathStats;
pub use super::{ReconnectError, Report};
use crate::engine::{
    ErrorCause, Event, LocalSeg, OpKind, Recovery, State, Transfer, TransferError, WcStatus,
    WindowError, WorkCompletion,
};
use crate::mem::PeerSpan;
use crate::provider::{Channel, ProviderError};

/// Why a run ended without completing the transfer.
#[derive(Debug, thiserror::Error)]
pub enum DataPathError {
    #[error("data path configuration: {0}")]
    Config(#[from] ConfigError),
    #[error("transfer failed: {reason} (status {}, block {})",
        .status.map_or("none", |s| s.label()),
        .block.map_or("none".to_string(), |b| b.to_string()))]
    Failed {
        status: Option<WcStatus>,
        block: Option<u64>,
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
    #[error("block I/O at file offset {file_offset}: {source}")]
    Io {
        file_offset: u64,
        source: std::io::Error,
    },
    #[error("engine: {0}")]
    Engine(#[from] TransferError),
    #[error("window refused: {0}")]
    Window(#[from] WindowError),
    #[error("stalled: nothing outstanding and no window to post into ({confirmed} of {total} bytes confirmed)")]
    NoWindow { confirmed: u64, total: u64 },
}

struct CqBatch {
    at: Instant,
    wcs: Vec<WorkCompletion>,
}

/// Runs transfers with one configuration and one set of live counters.
pub struct DataPath {
    cfg: DataPathConfig,
    stats: Arc<DataPathStats>,
    monitor: Option<Arc<dyn PortMonitor>>,
}

/// Run `transfer` to completion over `channel`; see [`DataPath::run`].
pub fn run_transfer(
    channel: &dyn Channel,
    transfer: &mut Transfer,
    io: &mut dyn BlockIo,
    cfg: &DataPathConfig,
    reconnect: &mut dyn FnMut() -> Result<(), ReconnectError>,
) -> Result<Report, DataPathError> {
    DataPath::new(cfg.clone())?.run(channel, transfer, io, reconnect)
}

impl DataPath {
    /// A data path with fresh counters.
    pub fn new(cfg: DataPathConfig) -> Result<Self, ConfigError> {
        Self::with_stats(cfg, Arc::new(DataPathStats::default()))
    }

    /// A data path counting into `stats` (shared with an exporter or with
    /// other data paths).
    pub fn with_stats(cfg: DataPathConfig, stats: Arc<DataPathStats>) -> Result<Self, ConfigError> {
        cfg.validate()?;
        Ok(DataPath {
            cfg,
            stats,
            monitor: None,
        })
    }

    /// Let the reconnect path wait on `monitor` while the port is down
    /// (and retry as soon as it is ACTIVE) instead of sleeping its backoff.
    pub fn with_port_monitor(mut self, monitor: Arc<dyn PortMonitor>) -> Self {
        self.monitor = Some(monitor);
        self
    }

    /// The live counters.
    pub fn stats(&self) -> &Arc<DataPathStats> {
        &self.stats
    }

    /// The configuration.
    pub fn config(&self) -> &DataPathConfig {
        &self.cfg
    }

    /// Run `transfer` (built for this channel, e.g. from
    /// [`DataPathConfig::transfer_config`]) until it is complete or fails.
    /// Windows already added are used, and `io.next_window()` is asked for
    /// more. `reconnect` replaces the connection after an error batch (for
    /// verbs: reset, exchange endpoints, handshake); it is retried with
    /// backoff.
    pub fn run(
        &self,
        channel: &dyn Channel,
        transfer: &mut Transfer,
        io: &mut dyn BlockIo,
        reconnect: &mut dyn FnMut() -> Result<(), ReconnectError>,
    ) -> Result<Report, DataPathError> {
        let stop = AtomicBool::new(false);
        let (tx, rx) = mpsc::channel::<CqBatch>();
        let (recycle_tx, recycle_rx) = mpsc::channel::<Vec<WorkCompletion>>();
        let snap = Snapshot::of(&self.stats);
        let events0 = self.monitor.as_ref().map_or(0, |m| m.events_seen());
        let (result, cq_result) = std::thread::scope(|s| {
            let stats = &*self.stats;
            let stop = &stop;
            let (mode, cpu) = (self.cfg.poll_mode, self.cfg.cq_cpu);
            let handle = std::thread::Builder::new()
                .name("rcp-cq".into())
                .spawn_scoped(s, move || {
                    if let Some(cpu) = cpu {
                        if let Err(e) = pin_current_thread(cpu) {
                            tracing::warn!(cpu, error = %e, "cannot pin the completion thread");
                        }
                    }
                    completion_loop(channel, mode, stop, stats, &mut |wcs, at| {
                        let mut v = recycle_rx
                            .try_recv()
                            .unwrap_or_else(|_| Vec::with_capacity(wcs.len()));
                        v.clear();
                        v.extend_from_slice(wcs);
                        tx.send(CqBatch { at, wcs: v }).is_ok()
                    })
                })
                .expect("spawn the completion thread");
            let mut poster = Poster {
                cfg: &self.cfg,
                stats: &self.stats,
                channel,
                transfer,
                io,
                rx,
                recycle: recycle_tx,
                report: Report::default(),
                post_times: HashMap::new(),
                reconnect_started: None,
                port_up_at: None,
                last_progress: Instant::now(),
                monitor: self.monitor.as_deref(),
                post_fail_run: 0,
                op: None,
                inline_limit: self.cfg.inline_for(&channel.caps()),
                sq_depth: channel.caps().sq_depth as u64,
            };
            // A pinned completion thread that spins owns its core: the
            // poster (and whatever it spawns) keeps off it for the run
            // rather than take turns with a thread that never sleeps.
            let _off_cq_core = match (cpu, mode) {
                (Some(c), PollMode::Poll | PollMode::Hybrid { .. }) => Some(AvoidCpu::new(c)),
                _ => None,
            };
            let result = poster.run(reconnect);
            stop.store(true, Relaxed);
            drop(poster); // drops rx: the completion thread's next send fails
            (result, handle.join())
        });
        let mut report = match (result, cq_result) {
            (Ok(r), _) => r,
            (Err(_), Ok(Err(e))) => return Err(DataPathError::Completion(e)),
            (Err(_), Err(_)) => return Err(DataPathError::CompletionPanicked),
            (Err(e), Ok(Ok(()))) => return Err(e),
        };
        snap.fill(&self.stats, &mut report);
        report.port_events = self.monitor.as_ref().map_or(0, |m| m.events_seen()) - events0;
        Ok(report)
    }
}

struct Snapshot {
    polls: u64,
    empty_polls: u64,
    arms: u64,
    waits: u64,
    wakeups: u64,
}

impl Snapshot {
    fn of(s: &DataPathStats) -> Self {
        Snapshot {
            polls: s.polls.load(Relaxed),
            empty_polls: s.empty_polls.load(Relaxed),
            arms: s.arms.load(Relaxed),
            waits: s.waits.load(Relaxed),
            wakeups: s.wakeups.load(Relaxed),
        }
    }
    fn fill(&self, s: &DataPathStats, r: &mut Report) {
        let now = Snapshot::of(s);
        r.polls = now.polls - self.polls;
        r.empty_polls = now.empty_polls - self.empty_polls;
        r.arms = now.arms - self.arms;
        r.waits = now.waits - self.waits;
        r.wakeups = now.wakeups - self.wakeups;
    }
}

/// The posting side: owns the transfer for the run.
struct Poster<'a> {
    cfg: &'a DataPathConfig,
    stats: &'a DataPathStats,
    channel: &'a dyn Channel,
    transfer: &'a mut Transfer,
    io: &'a mut dyn BlockIo,
    rx: Receiver<CqBatch>,
    recycle: Sender<Vec<WorkCompletion>>,
    report: Report,
    /// Post time of each outstanding signaled request.
    post_times: HashMap<u64, Instant>,
    /// Set by the error path until the first block confirmed after it.
    reconnect_started: Option<Instant>,
    /// When the port came back, for a reconnect that found it down; taken
    /// at the first block confirmed after the reconnect.
    port_up_at: Option<Instant>,
    /// When the last block was confirmed (or the run started).
    last_progress: Instant,
    monitor: Option<&'a dyn PortMonitor>,
    post_fail_run: u32,
    op: Option<OpKind>,
    inline_limit: u32,
    sq_depth: u64,
}

/// Longest the poster sleeps waiting for completions before re-checking
/// timers.
const IDLE_SLICE: Duration = Duration::from_millis(50);

pub use super::POSTER_SPIN;

impl Poster<'_> {
    fn now_ns(&self, start: Instant) -> u64 {
        start.elapsed().as_nanos() as u64
    }

    fn run(
        &mut self,
        reconnect: &mut dyn FnMut() -> Result<(), ReconnectError>,
    ) -> Result<Report, DataPathError> {
        let start = Instant::now();
        // Engine time is nanoseconds since `start` (pending timers of an
        // earlier run would look young; a fresh run posts fresh requests).
        self.take_windows()?;
        loop {
            let mut progressed = self.absorb_ready();
            // Windows granted while others are in flight are posted at once:
            // waiting for the ring to drain first would turn the windows in
            // flight into a round trip per window.
            if self.transfer.state() == State::Running {
                progressed |= self.take_windows()?;
            }
            if let Some(cause) = self.handle_events()? {
                self.recover(cause, reconnect)?;
                progressed = true;
            }
            progressed |= self.post_all(start)?;
            if self.transfer.is_complete() {
                // Let the last events (WindowDone) out.
                self.handle_events()?;
                break;
            }
            if let Some(t) = self.transfer.next_timeout() {
                let now = self.now_ns(start);
                if now >= t {
                    self.transfer.poll_timeout(now);
                    continue;
                }
            }
            if progressed {
                continue;
            }
            if self.transfer.state() == State::Running && self.transfer.outstanding() == 0 {
                // Nothing in flight and nothing postable: ask for windows.
                if !self.take_windows()? {
                    return Err(DataPathError::NoWindow {
                        confirmed: self.transfer.bytes_confirmed(),
                        total: self.transfer.plan().len(),
                    });
                }
                continue;
            }
            if matches!(self.transfer.state(), State::NeedsReconnect) {
                // Reached without an ErrorBatch in this loop (timeout path).
                self.recover(None, reconnect)?;
                continue;
            }
            let wait = self
                .transfer
                .next_timeout()
                .map(|t| Duration::from_nanos(t.saturating_sub(self.now_ns(start))))
                .unwrap_or(IDLE_SLICE)
                .min(IDLE_SLICE);
            self.wait_batch(wait)?;
        }
        let mut report = std::mem::take(&mut self.report);
        report.seconds = start.elapsed().as_secs_f64();
        Ok(report)
    }

    /// Add every window the control plane has now; true if any.
    fn take_windows(&mut self) -> Result<bool, DataPathError> {
        let mut any = false;
        while let Some(w) = self.io.next_window() {
            self.transfer.add_window(w)?;
            any = true;
        }
        Ok(any)
    }

    /// Feed every batch already queued; true if any.
    fn absorb_ready(&mut self) -> bool {
        let mut any = false;
        while let Ok(b) = self.rx.try_recv() {
            self.absorb(b);
            any = true;
        }
        any
    }

    /// Block up to `timeout` for one batch, then take whatever else is
    /// queued. In poll mode the poster spins for at most [`POSTER_SPIN`]
    /// first and then parks: the completion thread already spins on the CQ,
    /// and a second spinning thread starves the provider's own work (rxe's
    /// requester/responder/completer run as kernel work on the same CPUs).
    fn wait_batch(&mut self, timeout: Duration) -> Result<bool, DataPathError> {
        let mut timeout = timeout;
        if self.cfg.poll_mode == PollMode::Poll {
            let t0 = Instant::now();
            let spin_end = t0 + POSTER_SPIN.min(timeout);
            let mut spins = 0u32;
            loop {
                match self.rx.try_recv() {
                    Ok(b) => return self.got_batch(Some(b)),
                    Err(TryRecvError::Disconnected) => return self.got_batch(None),
                    Err(TryRecvError::Empty) => {}
                }
                spins = spins.wrapping_add(1);
                if spins % 64 == 0 && Instant::now() >= spin_end {
                    break;
                }
                std::hint::spin_loop();
            }
            timeout = timeout.saturating_sub(t0.elapsed());
        }
        let got = match self.rx.recv_timeout(timeout) {
            Ok(b) => Some(b),
            Err(RecvTimeoutError::Timeout) => return Ok(false),
            Err(RecvTimeoutError::Disconnected) => None,
        };
        self.got_batch(got)
    }

    fn got_batch(&mut self, got: Option<CqBatch>) -> Result<bool, DataPathError> {
        match got {
            Some(b) => {
                self.absorb(b);
                self.absorb_ready();
                Ok(true)
            }
            // The completion thread ended (provider error): run() reports it.
            None => Err(DataPathError::Completion(ProviderError::Closed)),
        }
    }

    fn absorb(&mut self, b: CqBatch) {
        self.stats.completed.fetch_add(b.wcs.len() as u64, Relaxed);
        for wc in &b.wcs {
            self.report.completions += 1;
            if let Some(t) = self.post_times.remove(&wc.wr_id) {
                if wc.status.is_success() {
                    self.report
                        .latency
                        .record(b.at.saturating_duration_since(t).as_nanos() as u64);
                }
            }
            if !wc.status.is_success() {
                *self.report.errors.entry(wc.status.label()).or_default() += 1;
                self.stats.count_error(wc.status);
            }
        }
        self.transfer.on_completions(&b.wcs);
        self.update_sq_free();
        let _ = self.recycle.send(b.wcs);
    }

    fn update_sq_free(&self) {
        let used = self.transfer.credits_in_use() as u64;
        self.stats
            .sq_free
            .store(self.sq_depth.saturating_sub(used), Relaxed);
    }

    /// Act on queued engine events. Returns the cause when an error batch
    /// asks for a reconnect.
    fn handle_events(&mut self) -> Result<Option<Option<ErrorCause>>, DataPathError> {
        let mut recover = None;
        // Handling events may queue more (a window granted now may be done
        // at once): go round until none is left.
        loop {
            let mut events = Vec::new();
            while let Some(ev) = self.transfer.poll_event() {
                events.push(ev);
            }
            if events.is_empty() {
                break;
            }
            // Pull: every block confirmed here is drained (checked, written) in
            // one call before any of them is reported done, so they can be
            // checked in parallel.
            let cap = self.cfg.payload_cap.unwrap_or(u32::MAX);
            if self.op == Some(OpKind::Read) {
                let chain: Vec<(u64, LocalSeg)> = events
                    .iter()
                    .filter_map(|ev| match ev {
                        Event::BlockDone {
                            local, file_offset, ..
                        } => Some((
                            *file_offset,
                            LocalSeg {
                                len: local.len.min(cap),
                                ..*local
                            },
                        )),
                        _ => None,
                    })
                    .collect();
                if !chain.is_empty() {
                    self.io
                        .drain_chain(&chain)
                        .map_err(|(file_offset, source)| DataPathError::Io {
                            file_offset,
                            source,
                        })?;
                }
            }
            for ev in events {
                match ev {
                    Event::BlockDone {
                        block,
                        local,
                        file_offset,
                        len,
                    } => {
                        // Drained above when this is a READ transfer (every
                        // request of a transfer has one kind, learnt from its
                        // first batch; a block is done only once posted).
                        let moved = local.len.min(cap);
                        self.io.block_done(block, file_offset, len);
                        self.transfer.release_buffer(local)?;
                        self.report.msgs += 1;
                        self.report.bytes += u64::from(moved);
                        self.stats.blocks_done.fetch_add(1, Relaxed);
                        let now = Instant::now();
                        self.last_progress = now;
                        if let Some(t0) = self.reconnect_started.take() {
                            let s = now.saturating_duration_since(t0);
                            self.report.reconnect_seconds.push(s.as_secs_f64());
                            self.stats
                                .reconnect_ns
                                .fetch_add(s.as_nanos() as u64, Relaxed);
                            let up = self
                                .port_up_at
                                .take()
                                .map(|t| now.saturating_duration_since(t).as_secs_f64());
                            if let Some(u) = up {
                                self.report.port_up_to_first_wr_seconds.push(u);
                            }
                            tracing::info!(
                                seconds = s.as_secs_f64(),
                                port_up_to_first_wr_seconds = up,
                                "first block confirmed after reconnect"
                            );
                        }
                    }
                    Event::WindowDone { window_id } => {
                        self.io.window_done(window_id);
                        self.take_windows()?;
                    }
                    Event::ErrorBatch {
                        epoch,
                        cause,
                        action,
                    } => {
                        tracing::warn!(epoch, ?cause, ?action, "error batch");
                        if action == Recovery::Reconnect {
                            recover = Some(Some(cause));
                        }
                    }
                    Event::Timeout { wr_id, block } => {
                        tracing::warn!(wr_id, block, "request timed out; its context is freed");
                    }
                    Event::ReadyToReconnect { epoch, unconfirmed } => {
                        tracing::info!(epoch, unconfirmed, "failed epoch drained");
                    }
                }
            }
        }
        if let State::Failed {
            status,
            block,
            reason,
        } = self.transfer.state()
        {
            return Err(DataPathError::Failed {
                status,
                block,
                reason,
            });
        }
        Ok(recover)
    }

    /// Post every chain the engine allows now; true if any was posted.
    fn post_all(&mut self, start: Instant) -> Result<bool, DataPathError> {
        let mut any = false;
        while let Some(mut batch) = self.transfer.poll_transmit(self.now_ns(start)) {
            let op = batch.wrs[0].kind;
            self.op = Some(op);
            if let Some(cap) = self.cfg.payload_cap {
                for wr in &mut batch.wrs {
                    wr.local.len = wr.local.len.min(cap);
                    wr.inline = op == OpKind::Write
                        && self.inline_limit > 0
                        && wr.local.len <= self.inline_limit;
                }
            }
            if op == OpKind::Write {
                let chain: Vec<(u64, LocalSeg)> = batch
                    .wrs
                    .iter()
                    .zip(&batch.blocks)
                    .map(|(wr, span)| (span.file_offset, wr.local))
                    .collect();
                if let Err((file_offset, source)) = self.io.fill_chain(&chain) {
                    self.transfer.post_failed(&batch, 0)?;
                    return Err(DataPathError::Io {
                        file_offset,
                        source,
                    });
                }
            }
            let t = Instant::now();
            // SAFETY: every local segment is a staging buffer the engine
            // lent to exactly this request (`Transfer` hands a buffer to one
            // block at a time and takes it back only at the completion that
            // retires it, or after a reconnect replaced the queue pair);
            // `BlockIo::fill` above was the last touch before the post, and
            // `drain` runs only after `BlockDone`. The caller of `run`
            // registered the buffers with this channel's provider.
            let res = unsafe { self.channel.post(&batch.wrs) };
            let posted = match &res {
                Ok(()) => batch.wrs.len(),
                Err(f) => f.posted,
            };
            for wr in &batch.wrs[..posted] {
                if wr.signaled {
                    self.post_times.insert(wr.wr_id, t);
                }
                self.report.signaled += u64::from(wr.signaled);
                self.report.inline += u64::from(wr.inline);
                self.stats
                    .bytes_posted
                    .fetch_add(u64::from(wr.local.len), Relaxed);
            }
            let signaled = batch.wrs[..posted].iter().filter(|w| w.signaled).count() as u64;
            let inline = batch.wrs[..posted].iter().filter(|w| w.inline).count() as u64;
            self.stats.signaled.fetch_add(signaled, Relaxed);
            self.stats.inline.fetch_add(inline, Relaxed);
            self.stats.posted.fetch_add(posted as u64, Relaxed);
            self.report.posted += posted as u64;
            if posted > 0 || res.is_ok() {
                self.report.doorbells += 1;
                self.stats.doorbells.fetch_add(1, Relaxed);
            }
            match res {
                Ok(()) => {
                    self.post_fail_run = 0;
                    any = true;
                }
                Err(f) => {
                    self.report.post_failures += 1;
                    self.stats.post_failures.fetch_add(1, Relaxed);
                    self.post_fail_run += 1;
                    tracing::warn!(posted = f.posted, chain = batch.wrs.len(), error = %f.error, "post failed");
                    self.transfer.post_failed(&batch, f.posted)?;
                    if matches!(f.error, ProviderError::Closed) || self.post_fail_run >= 3 {
                        // The connection is unusable: take the error path.
                        self.transfer.connection_lost();
                    }
                    self.update_sq_free();
                    return Ok(any || f.posted > 0);
                }
            }
        }
        self.update_sq_free();
        Ok(any)
    }

    /// The error path: wait (bounded) for the failed epoch's flushes, then
    /// reconnect with backoff and start the next epoch.
    fn recover(
        &mut self,
        cause: Option<ErrorCause>,
        reconnect: &mut dyn FnMut() -> Result<(), ReconnectError>,
    ) -> Result<(), DataPathError> {
        let t0 = Instant::now();
        tracing::warn!(
            ?cause,
            outstanding = self.transfer.outstanding(),
            "error path: flushing"
        );
        let deadline = t0 + self.cfg.flush_timeout;
        while self.transfer.state() == State::Flushing {
            let now = Instant::now();
            if now >= deadline {
                tracing::warn!(
                    outstanding = self.transfer.outstanding(),
                    "flush incomplete after {:?}: reconnecting anyway",
                    self.cfg.flush_timeout
                );
                break;
            }
            self.wait_batch((deadline - now).min(IDLE_SLICE))?;
            // Successful completions of the failed epoch still confirm
            // blocks; a non-retryable one fails the transfer here.
            if let Some(_again) = self.handle_events()? {
                // The engine raises one error batch per epoch; ignore.
            }
        }
        let attempts = self.cfg.backoff.max_attempts;
        let mut n = 0;
        // Reconnecting while the port is down cannot work: wait for it.
        self.wait_port();
        loop {
            match reconnect() {
                Ok(()) => break,
                Err(e) => {
                    n += 1;
                    if n >= attempts {
                        return Err(DataPathError::Reconnect {
                            attempts: n,
                            source: e,
                        });
                    }
                    let d = self.cfg.backoff.delay(n - 1);
                    tracing::warn!(attempt = n, error = %e, delay_ms = d.as_millis() as u64, "reconnect failed; retrying");
                    if !self.wait_port() {
                        std::thread::sleep(d);
                    }
                }
            }
        }
        // Link-up → first completed request is timed when the port came
        // back after the data path last made progress (it was down while
        // the transfer was stuck).
        self.port_up_at = self
            .monitor
            .and_then(|m| m.active_since())
            .filter(|&a| a >= self.last_progress);
        // Completions of the old epoch still queued are stale to the engine.
        self.absorb_ready();
        self.handle_events()?;
        let reposting = self.transfer.unconfirmed().len();
        let epoch = self.transfer.reconnected()?;
        self.post_times.clear();
        self.report.reconnects += 1;
        self.stats.reconnects.fetch_add(1, Relaxed);
        self.reconnect_started = Some(t0);
        tracing::info!(epoch, reposting, "reconnected");
        Ok(())
    }

    /// With a port monitor and the port down: wait for PORT_ACTIVE, at most
    /// the backoff cap, and return true (the caller retries at once). False
    /// when there is nothing to wait for (no monitor, or the port is up).
    fn wait_port(&mut self) -> bool {
        let Some(m) = self.monitor else {
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
        self.report.port_waits += 1;
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
}

/// Transitional, for the legacy control plane only, and deleted with it:
/// [`PeerSpan::with_mut`] without `unsafe` at the call site, so that
/// `src/control` stays free of `unsafe` until it is rewritten.
///
/// This is a safe function over an unsafe contract, the very leak review
/// item 3 names; it is kept to this crate and to that one caller. Its
/// soundness rests on the legacy control plane's protocol, as `with_mut`'s
/// did before it became `unsafe`: the client calls it from `BlockIo::fill`
/// on a staging buffer the legacy engine lent to the block about to be
/// posted (no request names it yet), and the server on a window span it
/// has not granted yet or whose grant is done (no peer request can reach
/// it), each from one thread at a time.
pub(crate) fn span_mut_for_legacy_control<R>(
    span: &PeerSpan,
    at: usize,
    n: usize,
    f: impl FnOnce(&mut [u8]) -> R,
) -> Option<R> {
    // SAFETY: see above: the legacy control plane owns these bytes at every
    // call (a staging buffer between its lending and its post, or a window
    // outside its grant), and no other borrower runs meanwhile.
    unsafe { span.with_mut(at, n, f) }
}
