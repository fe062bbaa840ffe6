//! The threads beside the posting thread, per rail: the completion thread
//! ([`CqThread`]), the reconnect helper ([`Helper`]) and, with several
//! rails, the port watcher ([`spawn_watcher`]).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::msg::{Cmd, CqBatch, CqEnd, Input};
use super::spec::{FenceFn, RailReconnectFn};
use crate::datapath::completion::completion_loop;
use crate::datapath::config::{Backoff, PollMode};
use crate::datapath::cpus::pin_current_thread;
use crate::datapath::port::PortMonitor;
use crate::datapath::stats::DataPathStats;
use crate::engine::WorkCompletion;
use crate::provider::Channel;

/// Longest a helper or port watcher blocks at once before it looks at its
/// stop signal.
pub(super) const SLICE: Duration = Duration::from_millis(20);

/// A rail's completion thread, as it is started.
pub(super) struct CqThread {
    pub(super) rail: usize,
    /// Several rails: the thread's name carries the rail's index.
    pub(super) multi: bool,
    pub(super) channel: Arc<dyn Channel>,
    pub(super) mode: PollMode,
    /// The CPU to pin it to.
    pub(super) cpu: Option<usize>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) stats: Arc<DataPathStats>,
    pub(super) tx: Sender<Input>,
    /// Batch vectors the posting thread is done with, to be reused.
    pub(super) recycle: Receiver<Vec<WorkCompletion>>,
}

impl CqThread {
    /// Start the thread (`rcp-cq`, `rcp-cq<i>` with several rails).
    pub(super) fn spawn(self) -> std::io::Result<JoinHandle<()>> {
        let suffix = if self.multi {
            self.rail.to_string()
        } else {
            String::new()
        };
        std::thread::Builder::new()
            .name(format!("rcp-cq{suffix}"))
            .spawn(move || self.run())
    }

    /// Pin, run [`completion_loop`] (sending every batch to the posting
    /// thread), then say how it ended.
    fn run(self) {
        let CqThread {
            rail: i,
            channel,
            mode,
            cpu,
            stop,
            stats,
            tx,
            recycle,
            ..
        } = self;
        if let Some(cpu) = cpu {
            if let Err(e) = pin_current_thread(cpu) {
                tracing::warn!(rail = i, cpu, error = %e, "cannot pin the completion thread");
            }
        }
        let run = std::panic::catch_unwind(AssertUnwindSafe(|| {
            completion_loop(&*channel, mode, &stop, &stats, &mut |wcs, at| {
                let mut v = recycle
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
    }
}

/// A rail's reconnect helper: brings the rail back when asked, off the
/// posting thread.
pub(super) struct Helper {
    pub(super) rail: usize,
    pub(super) reconnect: RailReconnectFn,
    pub(super) fence: Option<FenceFn>,
    pub(super) monitor: Option<Arc<dyn PortMonitor>>,
    pub(super) backoff: Backoff,
    pub(super) cmds: Receiver<Cmd>,
    pub(super) tx: Sender<Input>,
    pub(super) stats: Arc<DataPathStats>,
    pub(super) port_waits: Arc<AtomicU64>,
}

impl Helper {
    /// Start the helper thread (`rcp-rail<i>`).
    pub(super) fn spawn(self) -> std::io::Result<JoinHandle<()>> {
        std::thread::Builder::new()
            .name(format!("rcp-rail{}", self.rail))
            .spawn(move || self.run())
    }

    fn run(mut self) {
        while let Ok(Cmd::Reconnect { fence, after }) = self.cmds.recv() {
            if !self.bring_back(fence, after) {
                break;
            }
        }
        // The posting thread's close waits on its input for this (not for
        // a slice to pass).
        let _ = self.tx.send(Input::HelperEnded(self.rail));
    }

    /// Sleep `d`; false if told to stop meanwhile.
    fn sleep(&self, d: Duration) -> bool {
        match self.cmds.recv_timeout(d) {
            Err(RecvTimeoutError::Timeout) => true,
            // Only `Stop` comes while a reconnect is asked for.
            Ok(_) | Err(RecvTimeoutError::Disconnected) => false,
        }
    }

    /// One reconnect: fence, cool-down, port, attempts with backoff (a
    /// permanent error ends them). False if told to stop.
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
                    // A permanent error would only repeat: give up at once.
                    if n >= attempts || e.is_permanent() {
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

/// Start a rail's port watcher (`rcp-port<i>`; several rails).
pub(super) fn spawn_watcher(
    rail: usize,
    m: Arc<dyn PortMonitor>,
    stop: Arc<AtomicBool>,
    tx: Sender<Input>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("rcp-port{rail}"))
        .spawn(move || watch_port(rail, &*m, &stop, &tx))
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// The close waits on its input for the helper's last word: without
    /// it, a helper still waking from `Stop` cost every close a slice.
    #[test]
    fn a_stopped_helper_says_so_on_the_posting_threads_input() {
        let (cmd_tx, cmds) = mpsc::channel::<Cmd>();
        let (tx, rx) = mpsc::channel::<Input>();
        let h = Helper {
            rail: 3,
            reconnect: Box::new(|_| Ok(())),
            fence: None,
            monitor: None,
            backoff: Backoff::default(),
            cmds,
            tx,
            stats: Arc::new(DataPathStats::with_rails(4)),
            port_waits: Arc::new(AtomicU64::new(0)),
        }
        .spawn()
        .unwrap();
        cmd_tx.send(Cmd::Stop).unwrap();
        // The one message this helper sends when told only to stop.
        match rx.recv().unwrap() {
            Input::HelperEnded(rail) => assert_eq!(rail, 3),
            _ => panic!("a stopped helper's last word is HelperEnded"),
        }
        h.join().unwrap();
    }
}
