//! The posting thread's end: the last flushes, the threads stopped and
//! joined, and the [`Report`] of what the data path did.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::thread::JoinHandle;
use std::time::Instant;

use super::helpers::SLICE;
use super::msg::{Cmd, Input};
use super::poster::Poster;
use crate::datapath::report::{RailReport, Report};

impl Poster {
    /// Close: post nothing more, give the requests in flight up to
    /// `flush_timeout` to retire, stop and join every thread.
    pub(super) fn finish(mut self, stop: &AtomicBool) -> Report {
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
            // A completion thread asleep in its channel's wait sees `stop`
            // now, not when its slice ends.
            r.channel.wake();
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
        // meanwhile (and dropped) until the helper says it ends (one that
        // panicked says nothing: looked at every slice).
        let mut ended = vec![false; self.rails.len()];
        for (i, r) in self.rails.iter_mut().enumerate() {
            if let Some(h) = r.helper.take() {
                while !ended[i] && !h.is_finished() {
                    if let Ok(Input::HelperEnded(rail)) = self.rx.recv_timeout(SLICE) {
                        if let Some(e) = ended.get_mut(rail) {
                            *e = true;
                        }
                    }
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
