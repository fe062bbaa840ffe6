//! The caller's side of a data path: [`DataPath`], started step by step
//! (configurations, counters, each rail's threads, the posting thread),
//! then fed windows, read for events and closed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::helpers::{spawn_watcher, CqThread, Helper};
use super::msg::{Cmd, Input, Shared};
use super::poster::{Poster, RailRt, RailThreads};
use super::spec::{RailSpec, ReconnectFn};
use super::{DataPathError, DpEvent};
use crate::datapath::config::{ConfigError, DataPathConfig};
use crate::datapath::port::PortMonitor;
use crate::datapath::report::Report;
use crate::datapath::stats::DataPathStats;
use crate::engine::stream::{RailConfig, WindowError, MAX_RAILS};
use crate::engine::{Stream, StreamConfig, WindowJob, WorkCompletion};
use crate::provider::Channel;

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
        let (stream_cfg, rail_cfgs) = rail_configs(&cfg, &rails)?;
        let stream =
            Stream::with_rails(stream_cfg, &rail_cfgs).expect("stream_config validated it");
        let stats = Arc::new(stats_for(&rail_cfgs));
        let shared = Arc::new(Shared::default());
        let (tx, rx) = mpsc::channel::<Input>();
        let (ev_tx, ev_rx) = unbounded_channel();
        let start = Starting {
            cfg: &cfg,
            multi: rails.len() > 1,
            stats: &stats,
            tx: &tx,
            stop: Arc::new(AtomicBool::new(false)),
        };
        let mut rts = Vec::with_capacity(rails.len());
        for (i, spec) in rails.into_iter().enumerate() {
            rts.push(start.rail(i, spec, rail_cfgs[i].sq_depth)?);
        }
        let poster = Poster::new(
            cfg.clone(),
            stream,
            rts,
            rx,
            ev_tx,
            stats.clone(),
            shared.clone(),
        );
        let poster = start.poster(poster)?;
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

/// The engine configuration of a data path over `rails` (rail 0's) and
/// each rail's, as decided for its channel; refused if `cfg` is invalid or
/// the number of rails is out of range.
fn rail_configs(
    cfg: &DataPathConfig,
    rails: &[RailSpec],
) -> Result<(StreamConfig, Vec<RailConfig>), DataPathError> {
    cfg.validate()?;
    if !(1..=MAX_RAILS).contains(&rails.len()) {
        return Err(DataPathError::Config(ConfigError::Field {
            field: "rails",
            value: rails.len().to_string(),
            reason: format!("1..={MAX_RAILS} rails"),
        }));
    }
    let mut stream_cfgs = Vec::with_capacity(rails.len());
    for r in rails {
        stream_cfgs.push(cfg.stream_config(&r.channel.caps())?);
    }
    let rail_cfgs = stream_cfgs.iter().map(RailConfig::of).collect();
    Ok((stream_cfgs[0], rail_cfgs))
}

/// Live counters for rails of these depths, every queue free.
fn stats_for(rail_cfgs: &[RailConfig]) -> DataPathStats {
    let stats = DataPathStats::with_rails(rail_cfgs.len());
    let total_depth: usize = rail_cfgs.iter().map(|r| r.sq_depth).sum();
    stats.sq_free.store(total_depth as u64, Relaxed);
    for (s, r) in stats.rails.iter().zip(rail_cfgs) {
        s.sq_free.store(r.sq_depth as u64, Relaxed);
    }
    stats
}

/// What the threads of a starting data path are given, and the stop
/// signal that ends every thread started so far if a later spawn fails.
struct Starting<'a> {
    cfg: &'a DataPathConfig,
    multi: bool,
    stats: &'a Arc<DataPathStats>,
    tx: &'a Sender<Input>,
    stop: Arc<AtomicBool>,
}

impl Starting<'_> {
    /// A spawn's result; on failure everything started so far is stopped.
    fn spawned<T>(&self, r: std::io::Result<T>) -> Result<T, DataPathError> {
        r.map_err(|e| {
            self.stop.store(true, Relaxed);
            DataPathError::Spawn(e)
        })
    }

    /// Rail `i`'s threads (completion thread, reconnect helper, with
    /// several rails and a monitor a port watcher) and the posting
    /// thread's view of it.
    fn rail(&self, i: usize, spec: RailSpec, sq_depth: usize) -> Result<RailRt, DataPathError> {
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
            None => self.cfg.cq_cpu,
        };
        let (recycle_tx, recycle_rx) = mpsc::channel::<Vec<WorkCompletion>>();
        let cq = CqThread {
            rail: i,
            multi: self.multi,
            channel: channel.clone(),
            mode: self.cfg.poll_mode,
            cpu,
            stop: self.stop.clone(),
            stats: self.stats.clone(),
            tx: self.tx.clone(),
            recycle: recycle_rx,
        };
        let cq = self.spawned(cq.spawn())?;
        let (cmd_tx, cmd_rx) = mpsc::channel::<Cmd>();
        let port_waits = Arc::new(AtomicU64::new(0));
        let helper = Helper {
            rail: i,
            reconnect,
            fence,
            monitor: monitor.clone(),
            backoff: self.cfg.backoff,
            cmds: cmd_rx,
            tx: self.tx.clone(),
            stats: self.stats.clone(),
            port_waits: port_waits.clone(),
        };
        let helper = self.spawned(helper.spawn())?;
        let watcher = match (&monitor, self.multi) {
            (Some(m), true) => Some(self.spawned(spawn_watcher(
                i,
                m.clone(),
                self.stop.clone(),
                self.tx.clone(),
            ))?),
            _ => None,
        };
        let threads = RailThreads {
            cmds: cmd_tx,
            helper,
            cq,
            watcher,
            recycle: recycle_tx,
            port_waits,
            cpu,
        };
        Ok(RailRt::new(channel, monitor, keys, sq_depth, threads))
    }

    /// The posting thread (`rcp-post`).
    fn poster(&self, poster: Poster) -> Result<JoinHandle<Report>, DataPathError> {
        let stop = self.stop.clone();
        // On failure the completion threads' next send fails (the poster
        // and its receiver are gone), or they see `stop`.
        self.spawned(
            std::thread::Builder::new()
                .name("rcp-post".into())
                .spawn(move || poster.run(stop)),
        )
    }
}
