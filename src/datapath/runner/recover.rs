//! The posting thread's error path: reconnects asked of the helpers,
//! reconnected rails rejoining, reconnects given up, and the times a
//! report gives (reconnect, fail-over, port up → first request).

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use super::msg::Cmd;
use super::poster::Poster;
use super::{DataPathError, DpEvent, ReconnectError};
use crate::engine::stream::{RailState, State};

impl Poster {
    pub(super) fn reconnect_gave_up(&mut self, rail: usize, attempts: u32, source: ReconnectError) {
        let running = self.stream.state() == State::Running;
        if !self.multi() || !running {
            self.fail(DataPathError::Reconnect { attempts, source });
            return;
        }
        tracing::warn!(rail, attempts, error = %source, "rail reconnect given up; pausing it");
        let now = self.now_ns();
        self.stream.rail_reconnect_failed(rail, now);
    }

    /// Time the first extent confirmed after a one-rail reconnect.
    pub(super) fn note_progress(&mut self) {
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
    pub(super) fn note_failover(&mut self) {
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

    /// Ask the helpers for the reconnects the rails need; let reconnected
    /// rails rejoin.
    pub(super) fn drive_rails(&mut self) {
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
    pub(super) fn rejoin(&mut self, r: usize) {
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
}
