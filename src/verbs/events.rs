//! Asynchronous device events (`ibv_get_async_event`): port down/up, device
//! fatal, QP fatal, GID table changes.
//!
//! [`AsyncEvents`] reads a context's async fd, set `O_NONBLOCK` so it can be
//! polled with a timeout; every event is copied out and acked at once (an
//! unacked QP/CQ event would block that object's destroy). [`PortWatcher`] is
//! a thread over it that keeps the port's state and a short history, and lets
//! the data path's reconnect wait for `PORT_ACTIVE` instead of sleeping blind
//! ([`crate::datapath::PortMonitor`]).
//!
//! One reader per context: the async fd is the context's, and the events
//! queued on it go to whoever reads first.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdma_sys::*;

use super::device::{Context, PortState};
use super::error::VerbsError;

/// What happened (`ibv_event_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AsyncEventKind {
    CqErr,
    QpFatal,
    QpReqErr,
    QpAccessErr,
    CommEst,
    SqDrained,
    PathMig,
    PathMigErr,
    DeviceFatal,
    PortActive,
    PortErr,
    LidChange,
    PkeyChange,
    SmChange,
    SrqErr,
    SrqLimitReached,
    QpLastWqeReached,
    ClientReregister,
    GidChange,
    WqFatal,
    Other(u32),
}

impl AsyncEventKind {
    /// From the raw `ibv_event_type` value (never trusted to be in range).
    pub fn from_raw(v: u32) -> Self {
        use AsyncEventKind::*;
        match v {
            0 => CqErr,
            1 => QpFatal,
            2 => QpReqErr,
            3 => QpAccessErr,
            4 => CommEst,
            5 => SqDrained,
            6 => PathMig,
            7 => PathMigErr,
            8 => DeviceFatal,
            9 => PortActive,
            10 => PortErr,
            11 => LidChange,
            12 => PkeyChange,
            13 => SmChange,
            14 => SrqErr,
            15 => SrqLimitReached,
            16 => QpLastWqeReached,
            17 => ClientReregister,
            18 => GidChange,
            19 => WqFatal,
            o => Other(o),
        }
    }

    /// The element of `ibv_async_event` this kind carries.
    fn element(self) -> Element {
        use AsyncEventKind::*;
        match self {
            CqErr => Element::Cq,
            QpFatal | QpReqErr | QpAccessErr | CommEst | SqDrained | PathMig | PathMigErr
            | QpLastWqeReached => Element::Qp,
            SrqErr | SrqLimitReached => Element::Srq,
            WqFatal => Element::Wq,
            PortActive | PortErr | LidChange | PkeyChange | SmChange | ClientReregister
            | GidChange => Element::Port,
            DeviceFatal | Other(_) => Element::None,
        }
    }

    /// The libibverbs name (`IBV_EVENT_PORT_ACTIVE` ...), for logs.
    pub fn name(self) -> &'static str {
        use AsyncEventKind::*;
        match self {
            CqErr => "CQ_ERR",
            QpFatal => "QP_FATAL",
            QpReqErr => "QP_REQ_ERR",
            QpAccessErr => "QP_ACCESS_ERR",
            CommEst => "COMM_EST",
            SqDrained => "SQ_DRAINED",
            PathMig => "PATH_MIG",
            PathMigErr => "PATH_MIG_ERR",
            DeviceFatal => "DEVICE_FATAL",
            PortActive => "PORT_ACTIVE",
            PortErr => "PORT_ERR",
            LidChange => "LID_CHANGE",
            PkeyChange => "PKEY_CHANGE",
            SmChange => "SM_CHANGE",
            SrqErr => "SRQ_ERR",
            SrqLimitReached => "SRQ_LIMIT_REACHED",
            QpLastWqeReached => "QP_LAST_WQE_REACHED",
            ClientReregister => "CLIENT_REREGISTER",
            GidChange => "GID_CHANGE",
            WqFatal => "WQ_FATAL",
            Other(_) => "OTHER",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Element {
    Cq,
    Qp,
    Srq,
    Wq,
    Port,
    None,
}

/// One event, copied out of libibverbs before it was acked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AsyncEvent {
    pub kind: AsyncEventKind,
    /// The port, for port events (`PORT_ACTIVE`, `PORT_ERR`, `GID_CHANGE` ...).
    pub port: Option<u8>,
    /// The QP number, for QP events (`QP_FATAL` ...).
    pub qpn: Option<u32>,
}

/// `struct ibv_async_event` with the event type as a plain `u32`: rdma-sys
/// declares it as a Rust enum, and a value the kernel adds later would be
/// undefined behaviour to read through that type. Same layout (checked by a
/// test against rdma-sys's struct).
#[repr(C)]
struct RawAsyncEvent {
    element: RawElement,
    event_type: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
union RawElement {
    ptr: *mut libc::c_void,
    port_num: libc::c_int,
}

/// The reader of one context's async events.
pub struct AsyncEvents {
    ctx: Arc<Context>,
}

impl AsyncEvents {
    /// Set the context's async fd non-blocking and read its events from here.
    pub fn new(ctx: &Arc<Context>) -> Result<AsyncEvents, VerbsError> {
        // SAFETY: ctx is open for the Arc's lifetime; async_fd is a plain int
        // field set by ibv_open_device and never changed.
        let fd = unsafe { (*ctx.ctx).async_fd };
        let flags = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFL)
            .map_err(|e| VerbsError::new("fcntl(async_fd)", e as i32, ctx.name().to_string()))?;
        let flags = nix::fcntl::OFlag::from_bits_retain(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETFL(flags))
            .map_err(|e| VerbsError::new("fcntl(async_fd)", e as i32, ctx.name().to_string()))?;
        Ok(AsyncEvents { ctx: ctx.clone() })
    }

    /// The context's async fd (readable when an event is queued).
    pub fn fd(&self) -> RawFd {
        // SAFETY: as in `new`.
        unsafe { (*self.ctx.ctx).async_fd }
    }

    /// Whether the fd is non-blocking (it is after [`AsyncEvents::new`]).
    pub fn is_nonblocking(&self) -> bool {
        nix::fcntl::fcntl(self.fd(), nix::fcntl::FcntlArg::F_GETFL)
            .map(|f| nix::fcntl::OFlag::from_bits_retain(f).contains(nix::fcntl::OFlag::O_NONBLOCK))
            .unwrap_or(false)
    }

    /// The next queued event, `None` when there is none now.
    pub fn try_next(&self) -> Result<Option<AsyncEvent>, VerbsError> {
        let mut raw = RawAsyncEvent {
            element: RawElement {
                ptr: std::ptr::null_mut(),
            },
            event_type: 0,
        };
        let p = (&mut raw as *mut RawAsyncEvent).cast::<ibv_async_event>();
        // SAFETY: ctx is open; `raw` has the layout of ibv_async_event (see
        // RawAsyncEvent) and lives across the call. The fd is O_NONBLOCK, so
        // with nothing queued the call fails with EAGAIN instead of blocking.
        let rc = unsafe { ibv_get_async_event(self.ctx.ctx, p) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(None),
                n => Err(VerbsError::new(
                    "ibv_get_async_event",
                    n.unwrap_or(libc::EIO),
                    self.ctx.name().to_string(),
                )),
            };
        }
        let kind = AsyncEventKind::from_raw(raw.event_type);
        let (mut port, mut qpn) = (None, None);
        match kind.element() {
            // SAFETY: for port events libibverbs fills `port_num`.
            Element::Port => port = u8::try_from(unsafe { raw.element.port_num }).ok(),
            Element::Qp => {
                // SAFETY: for QP events the element is the QP's ibv_qp, which
                // cannot be destroyed before this event is acked (below), so
                // reading its number here is valid.
                let qp = unsafe { raw.element.ptr }.cast::<ibv_qp>();
                if !qp.is_null() {
                    // SAFETY: as above, qp is non-null and alive.
                    qpn = Some(unsafe { (*qp).qp_num });
                }
            }
            _ => {}
        }
        // SAFETY: `raw` was filled by ibv_get_async_event on this context and
        // is acked exactly once, after we stopped reading its element.
        unsafe { ibv_ack_async_event(p) };
        Ok(Some(AsyncEvent { kind, port, qpn }))
    }

    /// Wait up to `timeout` for the next event.
    pub fn wait(&self, timeout: Duration) -> Result<Option<AsyncEvent>, VerbsError> {
        if let Some(e) = self.try_next()? {
            return Ok(Some(e));
        }
        if !super::error::wait_readable(self.fd(), timeout, "poll(async_fd)", self.ctx.name())? {
            return Ok(None);
        }
        self.try_next()
    }
}

/// Events kept in a [`PortWatcher`]'s history.
const HISTORY: usize = 64;
/// How often the watcher thread checks whether it should stop.
const SLICE: Duration = Duration::from_millis(100);

struct Shared {
    port: u8,
    state: Mutex<Watched>,
    changed: Condvar,
    events: AtomicU64,
    stop: AtomicBool,
}

struct Watched {
    active: bool,
    /// When the last PORT_ACTIVE for the port was read.
    active_at: Option<Instant>,
    fatal: bool,
    history: VecDeque<(Instant, AsyncEvent)>,
}

/// A thread that reads a context's async events and keeps the state of one
/// port. Stops (and joins) on drop.
pub struct PortWatcher {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    device: String,
}

impl PortWatcher {
    /// Start watching `port` of `ctx`. The initial state is queried.
    pub fn spawn(ctx: &Arc<Context>, port: u8) -> Result<PortWatcher, VerbsError> {
        let events = AsyncEvents::new(ctx)?;
        let active = ctx.port(port)?.state == PortState::Active;
        let shared = Arc::new(Shared {
            port,
            state: Mutex::new(Watched {
                active,
                active_at: None,
                fatal: false,
                history: VecDeque::new(),
            }),
            changed: Condvar::new(),
            events: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let device = ctx.name().to_string();
        let dev = device.clone();
        let thread = std::thread::Builder::new()
            .name("rcp-async-ev".into())
            .spawn(move || watch(events, &s, &dev))
            .map_err(|e| {
                VerbsError::new(
                    "pthread_create",
                    e.raw_os_error().unwrap_or(libc::EAGAIN),
                    "async event watcher",
                )
            })?;
        Ok(PortWatcher {
            shared,
            thread: Some(thread),
            device,
        })
    }

    pub fn port(&self) -> u8 {
        self.shared.port
    }

    pub fn device(&self) -> &str {
        &self.device
    }

    /// Whether the port is ACTIVE (as of the last event) and the device
    /// has not reported DEVICE_FATAL.
    pub fn is_active(&self) -> bool {
        let w = self.shared.state.lock().unwrap();
        w.active && !w.fatal
    }

    /// When the watcher last read PORT_ACTIVE for its port (`None`: never;
    /// the port was up from the start or is still down).
    pub fn active_since(&self) -> Option<Instant> {
        self.shared.state.lock().unwrap().active_at
    }

    /// Events read so far (all kinds, all ports).
    pub fn events_seen(&self) -> u64 {
        self.shared.events.load(Ordering::Relaxed)
    }

    /// The last events read (at most 64), oldest first.
    pub fn history(&self) -> Vec<(Instant, AsyncEvent)> {
        self.shared
            .state
            .lock()
            .unwrap()
            .history
            .iter()
            .copied()
            .collect()
    }

    /// Block until the port is ACTIVE or `timeout` passes; true if ACTIVE.
    pub fn wait_active(&self, timeout: Duration) -> bool {
        self.wait_until(timeout, |w| w.active && !w.fatal)
    }

    /// Block until an event of `kind` for this port (or the device) has
    /// been read after `since`, or `timeout` passes.
    pub fn wait_event(
        &self,
        kind: AsyncEventKind,
        since: Instant,
        timeout: Duration,
    ) -> Option<AsyncEvent> {
        let mut found = None;
        self.wait_until(timeout, |w| {
            found = w
                .history
                .iter()
                .find(|(t, e)| *t >= since && e.kind == kind)
                .map(|&(_, e)| e);
            found.is_some()
        });
        found
    }

    fn wait_until(&self, timeout: Duration, mut done: impl FnMut(&Watched) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut w = self.shared.state.lock().unwrap();
        loop {
            if done(&w) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            w = self
                .shared
                .changed
                .wait_timeout(w, deadline - now)
                .unwrap()
                .0;
        }
    }
}

fn watch(events: AsyncEvents, s: &Shared, device: &str) {
    while !s.stop.load(Ordering::Relaxed) {
        let ev = match events.wait(SLICE) {
            Ok(Some(ev)) => ev,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(device, error = %e, "async events: read failed; watcher stops");
                return;
            }
        };
        s.events.fetch_add(1, Ordering::Relaxed);
        let mine = ev.port.is_none_or(|p| p == s.port);
        tracing::info!(
            device,
            event = ev.kind.name(),
            port = ev.port,
            qpn = ev.qpn,
            "async event"
        );
        let now = Instant::now();
        let mut w = s.state.lock().unwrap();
        match ev.kind {
            AsyncEventKind::PortActive if mine => {
                w.active = true;
                w.active_at = Some(now);
            }
            AsyncEventKind::PortErr if mine => w.active = false,
            AsyncEventKind::DeviceFatal => w.fatal = true,
            _ => {}
        }
        if w.history.len() >= HISTORY {
            w.history.pop_front();
        }
        w.history.push_back((now, ev));
        drop(w);
        s.changed.notify_all();
    }
}

impl Drop for PortWatcher {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_event_layout_matches_libibverbs() {
        assert_eq!(
            std::mem::size_of::<RawAsyncEvent>(),
            std::mem::size_of::<ibv_async_event>()
        );
        assert_eq!(
            std::mem::align_of::<RawAsyncEvent>(),
            std::mem::align_of::<ibv_async_event>()
        );
        assert_eq!(std::mem::offset_of!(RawAsyncEvent, event_type), 8);
        assert_eq!(std::mem::offset_of!(ibv_async_event, event_type), 8);
    }

    #[test]
    fn kinds_from_raw() {
        assert_eq!(
            AsyncEventKind::from_raw(ibv_event_type::IBV_EVENT_PORT_ACTIVE as u32),
            AsyncEventKind::PortActive
        );
        assert_eq!(
            AsyncEventKind::from_raw(ibv_event_type::IBV_EVENT_PORT_ERR as u32),
            AsyncEventKind::PortErr
        );
        assert_eq!(
            AsyncEventKind::from_raw(ibv_event_type::IBV_EVENT_DEVICE_FATAL as u32),
            AsyncEventKind::DeviceFatal
        );
        assert_eq!(
            AsyncEventKind::from_raw(ibv_event_type::IBV_EVENT_GID_CHANGE as u32),
            AsyncEventKind::GidChange
        );
        assert_eq!(AsyncEventKind::from_raw(77), AsyncEventKind::Other(77));
        assert_eq!(AsyncEventKind::PortErr.name(), "PORT_ERR");
        assert!(AsyncEventKind::QpFatal.element() == Element::Qp);
    }
}
