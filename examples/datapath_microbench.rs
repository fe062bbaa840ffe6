//! The runner's own cost per message, without a device: the session
//! [`DataPath`] drives an in-process null channel, which completes every
//! signaled request at post time and touches no memory. What is left is the
//! posting loop, the engine and the hand-off between the completion thread
//! and the poster. The windows are `rcp bench`'s: 8 windows of 1024 extents
//! of 64 B (one every 4 KiB) in flight, each submitted again when done.
//!
//! `cargo run --release --example datapath_microbench -- [MSGS] [poll|event|hybrid]`
//! prints one line per round: messages/s and CPU ns per message.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use rcp::datapath::{DataPath, DataPathConfig, DpEvent, PollMode, ReconnectError, ReconnectFn};
use rcp::engine::{Extent, OpKind, WcStatus, WindowJob, WorkCompletion, WorkRequest};
use rcp::provider::{Channel, ChannelCaps, PostFailure, ProviderError, ProviderKind};

const DEPTH: u32 = 128;
const SIZE: u32 = 64;
const SLOT: u64 = 4096;
const WINDOW: u64 = 4 << 20;

/// Completes every signaled request at post time.
#[derive(Default)]
struct NullChannel {
    /// Completions, and whether `wake` was called since the last `wait`.
    cq: Mutex<(VecDeque<WorkCompletion>, bool)>,
    cv: Condvar,
}

impl Channel for NullChannel {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Tcp
    }
    fn caps(&self) -> ChannelCaps {
        ChannelCaps {
            sq_depth: DEPTH,
            max_inline: 0,
            max_sge: 1,
        }
    }
    /// # Safety
    ///
    /// None needed: touches no memory.
    unsafe fn post(&self, wrs: &[WorkRequest]) -> Result<(), PostFailure> {
        let mut cq = self.cq.lock().unwrap();
        for wr in wrs.iter().filter(|w| w.signaled) {
            cq.0.push_back(WorkCompletion {
                wr_id: wr.wr_id,
                status: WcStatus::Success,
                byte_len: wr.local.len,
            });
        }
        drop(cq);
        self.cv.notify_one();
        Ok(())
    }
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, ProviderError> {
        let mut cq = self.cq.lock().unwrap();
        let n = out.len().min(cq.0.len());
        for (o, c) in out.iter_mut().zip(cq.0.drain(..n)) {
            *o = c;
        }
        Ok(n)
    }
    fn arm(&self) -> Result<(), ProviderError> {
        Ok(())
    }
    fn wait(&self, timeout: Duration) -> Result<bool, ProviderError> {
        let cq = self.cq.lock().unwrap();
        let (mut cq, _) = self
            .cv
            .wait_timeout_while(cq, timeout, |(q, woken)| q.is_empty() && !*woken)
            .unwrap();
        cq.1 = false;
        Ok(!cq.0.is_empty())
    }
    fn wake(&self) {
        self.cq.lock().unwrap().1 = true;
        self.cv.notify_all();
    }
}

fn cpu_ns() -> u64 {
    use nix::sys::resource::{getrusage, UsageWho};
    let u = getrusage(UsageWho::RUSAGE_SELF).unwrap();
    let t = |tv: nix::sys::time::TimeVal| {
        tv.tv_sec() as u64 * 1_000_000_000 + tv.tv_usec() as u64 * 1000
    };
    t(u.user_time()) + t(u.system_time())
}

fn cfg(mode: PollMode) -> DataPathConfig {
    DataPathConfig {
        poll_mode: mode,
        max_inline: Some(0),
        ..DataPathConfig::default()
    }
}

/// `rcp bench`'s run: 8 windows of 1024 extents of 64 B in flight, each
/// resubmitted when done.
fn session(msgs: u64, mode: PollMode) -> (f64, u64, u64) {
    let ch: Arc<dyn Channel> = Arc::new(NullChannel::default());
    let reconnect: ReconnectFn = Box::new(|| Err(ReconnectError::permanent("no")));
    let dp = DataPath::start(cfg(mode), ch, reconnect, None).unwrap();
    let mut ev = dp.take_events().unwrap();
    let per = WINDOW / SLOT;
    let slots = 8u64;
    let mut left = msgs;
    let mut seq = 0u64;
    let mut submit = |w: u64, left: &mut u64| {
        if *left == 0 {
            return false;
        }
        let n = (*left).min(per);
        *left -= n;
        let job = WindowJob {
            id: seq * slots + w,
            op: OpKind::Write,
            local_addr: 0x1000_0000 + w * WINDOW,
            lkey: 1,
            remote_addr: 0x8000_0000 + w * WINDOW,
            rkey: 2,
            extents: (0..n)
                .map(|k| Extent {
                    offset: k * SLOT,
                    len: SIZE,
                })
                .collect(),
        };
        seq += 1;
        // SAFETY: the addresses are made up and back no memory: the null
        // channel never dereferences them, so there is nothing to lend to a
        // device, before or after this window's WindowDone.
        unsafe { dp.submit(job) }.unwrap();
        true
    };
    let cpu0 = cpu_ns();
    let t0 = Instant::now();
    let mut in_flight = 0;
    for w in 0..slots {
        if submit(w, &mut left) {
            in_flight += 1;
        }
    }
    while in_flight > 0 {
        match ev.blocking_recv().unwrap() {
            DpEvent::WindowDone { id } => {
                in_flight -= 1;
                if submit(id % slots, &mut left) {
                    in_flight += 1;
                }
            }
            e => panic!("{e:?}"),
        }
    }
    let (secs, cpu) = (t0.elapsed().as_secs_f64(), cpu_ns() - cpu0);
    let r = dp.close();
    (secs, cpu, r.counters.extents_confirmed)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let msgs: u64 = args.next().map_or(2_000_000, |s| s.parse().unwrap());
    let mode: PollMode = args.next().map_or(PollMode::Event, |s| s.parse().unwrap());
    for round in 0..3 {
        let (secs, cpu, n) = session(msgs, mode);
        assert_eq!(n, msgs);
        println!(
            "round={round} runner=session mode={mode} msgs={n} seconds={secs:.3} msg_per_s={:.0} cpu_ns_per_msg={:.0}",
            n as f64 / secs,
            cpu as f64 / n as f64
        );
    }
}
