//! A fake channel for unit tests: completes signaled requests in order at
//! post time, enforces the send-queue depth, and can inject an error at the
//! n-th request (everything after it is flushed until `reset`), swallow
//! completions (lost CQEs, until `reset`), refuse a post part-way, and
//! record the CPUs the posting thread may use.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use crate::engine::{WcStatus, WorkCompletion, WorkRequest};
use crate::provider::{Channel, ChannelCaps, PostFailure, ProviderError, ProviderKind};

#[derive(Default)]
struct Inner {
    /// Posted and not yet retired by a polled completion: (wr_id, signaled).
    sq: VecDeque<(u64, bool)>,
    cq: VecDeque<WorkCompletion>,
    error: bool,
    /// Fail the request with this 0-based post index.
    fail_at: Option<(u64, WcStatus)>,
    posted_total: u64,
    /// `wake` was called and no `wait` has returned since.
    woken: bool,
}

pub struct FakeChannel {
    inner: Mutex<Inner>,
    cv: Condvar,
    caps: ChannelCaps,
    /// Flushes also report unsignaled requests (verbs does).
    pub flush_unsignaled: bool,
    pub posts: AtomicU64,
    pub arms: AtomicU64,
    pub waits: AtomicU64,
    /// Calls of `wake`.
    pub wakes: AtomicU64,
    pub max_outstanding: AtomicU64,
    pub overflows: AtomicU64,
    pub resets: AtomicU64,
    /// Requests posted (accepted).
    pub posted: AtomicU64,
    /// Successful completions are not reported (until `reset`).
    pub swallow: AtomicBool,
    /// Refuse the next post after this many of its requests.
    pub refuse_after: Mutex<Option<usize>>,
    /// Record `allowed_cpus()` of the posting thread at every post.
    pub record_cpus: AtomicBool,
    pub post_cpus: Mutex<Vec<Vec<usize>>>,
}

impl FakeChannel {
    pub fn new(sq_depth: u32) -> Self {
        FakeChannel {
            inner: Mutex::default(),
            cv: Condvar::new(),
            caps: ChannelCaps {
                sq_depth,
                max_inline: 64,
                max_sge: 1,
            },
            flush_unsignaled: true,
            posts: AtomicU64::new(0),
            arms: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            wakes: AtomicU64::new(0),
            max_outstanding: AtomicU64::new(0),
            overflows: AtomicU64::new(0),
            resets: AtomicU64::new(0),
            posted: AtomicU64::new(0),
            swallow: AtomicBool::new(false),
            refuse_after: Mutex::new(None),
            record_cpus: AtomicBool::new(false),
            post_cpus: Mutex::new(Vec::new()),
        }
    }

    /// The request with 0-based post index `n` completes with `status`.
    pub fn fail_at(&self, n: u64, status: WcStatus) {
        self.inner.lock().unwrap().fail_at = Some((n, status));
    }

    /// The `k`-th request posted from now on (0-based) completes with
    /// `status`.
    pub fn fail_after(&self, k: u64, status: WcStatus) {
        let mut i = self.inner.lock().unwrap();
        i.fail_at = Some((i.posted_total + k, status));
    }

    /// Like `VerbsChannel::set_error`: later requests are flushed.
    pub fn set_error(&self) {
        self.inner.lock().unwrap().error = true;
    }

    /// Like a QP reset + handshake: out of error, send queue empty.
    pub fn reset(&self) {
        let mut i = self.inner.lock().unwrap();
        i.error = false;
        i.sq.clear();
        self.swallow.store(false, Relaxed);
        self.resets.fetch_add(1, Relaxed);
    }
}

impl Channel for FakeChannel {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Tcp
    }
    fn caps(&self) -> ChannelCaps {
        self.caps
    }
    /// # Safety
    ///
    /// None needed: the fake touches no memory.
    unsafe fn post(&self, wrs: &[WorkRequest]) -> Result<(), PostFailure> {
        self.posts.fetch_add(1, Relaxed);
        if self.record_cpus.load(Relaxed) {
            self.post_cpus
                .lock()
                .unwrap()
                .push(super::cpus::allowed_cpus());
        }
        let refuse = self.refuse_after.lock().unwrap().take();
        let mut i = self.inner.lock().unwrap();
        for (k, wr) in wrs.iter().enumerate() {
            if refuse == Some(k) {
                drop(i);
                self.cv.notify_all();
                return Err(PostFailure {
                    posted: k,
                    error: ProviderError::Protocol("refused (test)".into()),
                });
            }
            if i.sq.len() >= self.caps.sq_depth as usize {
                self.overflows.fetch_add(1, Relaxed);
                return Err(PostFailure {
                    posted: k,
                    error: ProviderError::Protocol("send queue full".into()),
                });
            }
            i.sq.push_back((wr.wr_id, wr.signaled));
            self.posted.fetch_add(1, Relaxed);
            self.max_outstanding.fetch_max(i.sq.len() as u64, Relaxed);
            let n = i.posted_total;
            i.posted_total += 1;
            let status = match i.fail_at {
                _ if i.error => Some(WcStatus::Flushed),
                Some((at, s)) if at == n => {
                    i.error = true;
                    Some(s)
                }
                _ => None,
            };
            let wc = |status| WorkCompletion {
                wr_id: wr.wr_id,
                status,
                byte_len: wr.local.len,
            };
            match status {
                Some(WcStatus::Flushed) if !wr.signaled && !self.flush_unsignaled => {}
                Some(s) => i.cq.push_back(wc(s)),
                None if wr.signaled && !self.swallow.load(Relaxed) => {
                    i.cq.push_back(wc(WcStatus::Success))
                }
                None => {}
            }
        }
        drop(i);
        self.cv.notify_all();
        Ok(())
    }
    fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize, ProviderError> {
        let mut i = self.inner.lock().unwrap();
        let mut n = 0;
        while n < out.len() {
            let Some(wc) = i.cq.pop_front() else { break };
            // The completion retires it and every earlier request.
            if let Some(p) = i.sq.iter().position(|&(id, _)| id == wc.wr_id) {
                i.sq.drain(..=p);
            }
            out[n] = wc;
            n += 1;
        }
        Ok(n)
    }
    fn arm(&self) -> Result<(), ProviderError> {
        self.arms.fetch_add(1, Relaxed);
        Ok(())
    }
    fn wait(&self, timeout: Duration) -> Result<bool, ProviderError> {
        self.waits.fetch_add(1, Relaxed);
        let i = self.inner.lock().unwrap();
        let (mut i, _) = self
            .cv
            .wait_timeout_while(i, timeout, |i| i.cq.is_empty() && !i.woken)
            .unwrap();
        i.woken = false;
        Ok(!i.cq.is_empty())
    }
    fn wake(&self) {
        self.wakes.fetch_add(1, Relaxed);
        self.inner.lock().unwrap().woken = true;
        self.cv.notify_all();
    }
}

/// A port the test brings down and up ([`set_active`](Self::set_active)):
/// `wait_active` blocks until the test says so (or its timeout passes), so a
/// test orders "the reconnect is waiting" before "the port comes back"
/// instead of guessing how long either takes.
pub struct FakePort {
    state: Mutex<PortState>,
    cv: Condvar,
}

#[derive(Default)]
struct PortState {
    active: bool,
    /// When it last came up.
    since: Option<std::time::Instant>,
    /// Transitions (down or up): the "async events" a watcher would see.
    events: u64,
}

impl FakePort {
    pub fn new(active: bool) -> std::sync::Arc<FakePort> {
        std::sync::Arc::new(FakePort {
            state: Mutex::new(PortState {
                active,
                ..PortState::default()
            }),
            cv: Condvar::new(),
        })
    }

    /// Bring the port down or up (an event if it changes).
    pub fn set_active(&self, up: bool) {
        let mut s = self.state.lock().unwrap();
        if s.active != up {
            s.active = up;
            s.events += 1;
            if up {
                s.since = Some(std::time::Instant::now());
            }
        }
        drop(s);
        self.cv.notify_all();
    }
}

impl super::PortMonitor for FakePort {
    fn is_active(&self) -> bool {
        self.state.lock().unwrap().active
    }
    fn wait_active(&self, timeout: Duration) -> bool {
        let s = self.state.lock().unwrap();
        let (s, _) = self
            .cv
            .wait_timeout_while(s, timeout, |s| !s.active)
            .unwrap();
        s.active
    }
    fn events_seen(&self) -> u64 {
        self.state.lock().unwrap().events
    }
    fn active_since(&self) -> Option<std::time::Instant> {
        let s = self.state.lock().unwrap();
        s.since.filter(|_| s.active)
    }
}

/// Poll `cond` until it holds; panics after a generous hang guard (a
/// minute), which no machine's speed comes near: the tests order their
/// steps by what happened, not by how long it took.
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let guard = std::time::Instant::now() + HANG_GUARD;
    while !cond() {
        assert!(std::time::Instant::now() < guard, "hang: never {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// How long a test waits for something that must happen before it calls it
/// a hang.
pub const HANG_GUARD: Duration = Duration::from_secs(120);

/// Run `f` on a thread of its own and return its result; panics if it does
/// not return within the hang guard.
pub fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(HANG_GUARD) {
        Ok(t) => t,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("hang: {what} did not return"),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("{what} panicked"),
    }
}

/// The next data-path event, or `None` once the data path has ended; panics
/// if none comes within the hang guard, so a stalled data path fails its
/// test instead of hanging the suite.
pub fn recv_event(
    ev: &mut tokio::sync::mpsc::UnboundedReceiver<super::DpEvent>,
) -> Option<super::DpEvent> {
    use tokio::sync::mpsc::error::TryRecvError;
    let guard = std::time::Instant::now() + HANG_GUARD;
    loop {
        match ev.try_recv() {
            Ok(e) => return Some(e),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) => {
                assert!(
                    std::time::Instant::now() < guard,
                    "hang: no data path event"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}
