//! The posting thread's posting: every chain the stream and the rate
//! limit allow, each on its rail's channel, and the counters published.

use std::time::Duration;
use std::time::Instant;

use super::poster::Poster;
use crate::engine::slots::WrId;
use crate::provider::ProviderError;

impl Poster {
    /// Post every chain the stream (and the rate limit) allows now; with a
    /// chain held back by the rate limit, how long until it may go.
    pub(super) fn post_all(&mut self) -> Option<Duration> {
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

    pub(super) fn publish(&self) {
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
}
