//! A client session: the handshake, and the data path it sets up once for
//! every file moved over it.

use std::sync::Arc;

use tokio::sync::mpsc::UnboundedReceiver;

use super::io::FileJob;
use super::{Client, ClientOptions, Rpc};
use crate::control::error::{ControlError, Result};
use crate::control::link::{
    connect_params, ep_from_proto, ep_to_proto, resolve_transport, ClientLink,
};
use crate::control::protocol::{check_from_wire, check_to_wire, Params};
use crate::control::{VERSION_MAJOR, VERSION_MINOR, WINDOW_SIZE};
use crate::datapath::{DataPath, DataPathConfig, DpEvent, PollMode, ReconnectError, Report};
use crate::mem::Block;
use crate::proto;
use crate::provider::{Channel, ProviderKind};
use crate::verbs::PortWatcher;

/// Times a damaged block moves again before its file fails.
const MAX_RETRIES: u32 = 3;

/// Sees files start, progress and finish (the binary draws bars, the Copy
/// API counts).
pub trait Observer: Send + Sync {
    fn file_start(&self, _name: &str, _len: u64) {}
    fn progress(&self, _bytes: u64) {}
    fn file_done(&self, _r: &FileResult) {}
}

/// An observer that ignores everything.
pub struct Quiet;
impl Observer for Quiet {}

/// The outcome of one file.
#[derive(Clone, Debug, Default)]
pub struct FileResult {
    /// Push: the remote path relative to the server root; pull: the local
    /// path.
    pub path: String,
    /// Where it came from: push, the local path; pull, the remote path.
    pub source: String,
    pub length: u64,
    /// Bytes moved over the data path (less than `length` after a resume).
    pub moved: u64,
    /// The file digest (derived from the block digests).
    pub digest: Vec<u8>,
    /// The flat SHA-256, when asked for.
    pub flat_sha256: Option<Vec<u8>>,
    pub seconds: f64,
    pub resumed: bool,
}

/// What a session's data path did, for summaries and metrics.
#[derive(Clone, Debug, Default)]
pub struct SessionStats {
    pub report: Report,
}

/// A session: one data path, any number of files.
pub struct Session {
    pub(super) rpc: Rpc,
    pub(super) opts: ClientOptions,
    pub(super) dp: Option<DataPath>,
    pub(super) events: Option<UnboundedReceiver<DpEvent>>,
    pub(super) link: Arc<ClientLink>,
    pub(super) id: u64,
    pub(super) params: Params,
    /// Staging lent to the device by a stream that failed: kept until the
    /// data path is closed (see `DataPath::submit`'s contract).
    pub(super) quarantine: Vec<Block>,
    /// What the session's files did (the data path's report is filed
    /// under it).
    pub(super) direction: Option<&'static str>,
    /// Which provider and why (for the user).
    pub transport: String,
    pub kind: ProviderKind,
}

/// The data-path settings a client uses on `kind`.
pub fn datapath_config(kind: ProviderKind, o: &ClientOptions) -> DataPathConfig {
    let batch = o.batch.clamp(1, 64);
    DataPathConfig {
        batch,
        signal_every: o.signal_every.clamp(1, batch),
        max_inline: o.inline,
        // Busy polling costs a core per session; the default sleeps when
        // idle (the TCP provider's completions are condvar-driven anyway).
        poll_mode: o.poll_mode.unwrap_or(match kind {
            ProviderKind::Verbs => PollMode::Hybrid { empty_polls: 1024 },
            ProviderKind::Tcp => PollMode::Event,
        }),
        cq_cpu: o.cq_cpu,
        qp_retry: o.qp_retry,
        // A request outstanding this long means the peer or the link is
        // gone: the error path takes over.
        request_timeout: o.timeout,
        rate_limit: o
            .bwlimit
            .filter(|&r| r > 0)
            .map(crate::datapath::RateLimit::new),
        ..DataPathConfig::default()
    }
}

impl Client {
    /// Open a session: provider, handshake, data path.
    pub async fn session(&self) -> Result<Session> {
        let (kind, why) = resolve_transport(self.opts.transport, self.opts.device.as_deref());
        self.session_with(kind, why).await
    }

    /// [`Client::session`] with the provider already chosen.
    pub async fn session_with(&self, kind: ProviderKind, why: String) -> Result<Session> {
        let o = self.opts.clone();
        let bs = o.block_size;
        if !bs.is_power_of_two() || bs < 4096 || bs > WINDOW_SIZE as u64 {
            return Err(ControlError::Usage(format!(
                "block size {bs} must be a power of two between 4096 and {WINDOW_SIZE}"
            )));
        }
        o.check_bwlimit()?;
        let windows = o.windows.clamp(1, 64);
        let (dev, gid) = (o.device.clone(), o.gid_index);
        // Ask the QP for inline room; the data path clamps per WR.
        let inline = o.inline.unwrap_or(64);
        let link = tokio::task::spawn_blocking(move || {
            ClientLink::open(
                kind,
                dev.as_deref(),
                gid,
                WINDOW_SIZE,
                windows as usize,
                inline,
            )
        })
        .await
        .map_err(|e| ControlError::Other(e.to_string()))??;
        let req = proto::HandshakeRequest {
            version_major: VERSION_MAJOR,
            version_minor: VERSION_MINOR,
            providers: vec![match kind {
                ProviderKind::Verbs => proto::Provider::Verbs as i32,
                ProviderKind::Tcp => proto::Provider::Tcp as i32,
            }],
            verbs: link.verbs_params(),
            block_size: bs,
            client_name: std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_default(),
            checks: vec![check_to_wire(o.verify) as i32],
            window_count: windows,
            timeout_ms: o.timeout.as_millis().min(u128::from(u32::MAX)) as u32,
        };
        let resp = self.rpc.clone().handshake(req).await?.into_inner();
        if resp.version_major != VERSION_MAJOR {
            return Err(ControlError::Failed(
                crate::control::protocol::Failure::new(
                    crate::control::error::Reason::Version,
                    format!(
                        "rcpd speaks protocol {}.{}, this rcp {VERSION_MAJOR}.{VERSION_MINOR}",
                        resp.version_major, resp.version_minor
                    ),
                ),
            ));
        }
        let check = match check_from_wire(resp.check) {
            Some(c) if c == o.verify => c,
            _ => {
                return Err(ControlError::Invalid(format!(
                    "rcpd chose check {} where this rcp asked for {}",
                    resp.check, o.verify
                )))
            }
        };
        if check.is_none() {
            tracing::warn!(
                "--verify none: blocks are not checked end to end, only by the link's CRCs"
            );
        }
        if resp.block_size != bs {
            return Err(ControlError::Invalid(format!(
                "server granted block size {} instead of {bs}",
                resp.block_size
            )));
        }
        if resp.window_size > WINDOW_SIZE as u64
            || resp.window_count == 0
            || resp.window_count > windows
        {
            return Err(ControlError::Invalid(format!(
                "server windows of {} bytes x {} do not fit this rcp's staging ({WINDOW_SIZE} x {windows})",
                resp.window_size, resp.window_count
            )));
        }
        let params = Params {
            block_size: bs,
            window_size: resp.window_size,
            window_count: resp.window_count,
            max_open_files: o.transfers.clamp(1, resp.max_open_files.max(1)),
            check,
            timeout_ns: o.timeout.as_nanos() as u64,
            keepalive_ns: Params::keepalive_for(
                o.timeout.as_nanos() as u64,
                u64::from(resp.timeout_ms) * 1_000_000,
            ),
            max_retries: MAX_RETRIES,
        };
        let link = Arc::new(link);
        let (l2, r2, host, retry) = (link.clone(), resp.clone(), self.host.clone(), o.qp_retry);
        let channel: Arc<dyn Channel> =
            tokio::task::spawn_blocking(move || l2.connect(&r2, &host, retry))
                .await
                .map_err(|e| ControlError::Other(e.to_string()))??;
        // Watch the port's async events so a reconnect after a link cut
        // starts as soon as the port is ACTIVE again. Best effort: without
        // it the reconnect backs off blind.
        let monitor: Option<Arc<dyn crate::datapath::PortMonitor>> = match link
            .device
            .as_ref()
            .map(|d| PortWatcher::spawn(&d.ctx, d.port))
        {
            Some(Ok(w)) => Some(Arc::new(w)),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "cannot watch async events; reconnects back off blind");
                None
            }
            None => None,
        };
        let reconnect = reconnector(
            &link,
            &self.rpc,
            resp.session_id,
            resp.client_rd_atomic,
            retry,
        );
        let cfg = datapath_config(kind, &o);
        let dp = DataPath::start(cfg, channel.clone(), reconnect, monitor)
            .map_err(ControlError::DataPath)?;
        if let Some(m) = &o.metrics {
            let (device, qp) = match (&link.device, link.verbs_params()) {
                (Some(d), Some(p)) => (d.ctx.name().to_string(), p.endpoint.map_or(0, |e| e.qpn)),
                _ => ("tcp".to_string(), resp.session_id as u32),
            };
            let sq = channel.caps().sq_depth;
            m.track(&device, qp, sq, sq, dp.stats());
        }
        let events = dp.take_events();
        Ok(Session {
            rpc: self.rpc.clone(),
            opts: o,
            dp: Some(dp),
            events,
            link,
            id: resp.session_id,
            params,
            quarantine: Vec::new(),
            direction: None,
            transport: why,
            kind,
        })
    }
}

impl ClientOptions {
    /// Refuse a rate so low that one window takes longer than half the
    /// progress timeout: a window is done (progress, for both ends) only
    /// when all of it has moved, so at that rate the stream would time out.
    pub fn check_bwlimit(&self) -> Result<()> {
        let Some(rate) = self.bwlimit.filter(|&r| r > 0) else {
            return Ok(());
        };
        let window = WINDOW_SIZE as f64 / rate as f64;
        let half = self.timeout.as_secs_f64() / 2.0;
        if window > half {
            return Err(ControlError::Usage(format!(
                "--bwlimit {rate} B/s: one {} MiB window would take {window:.0} s, more than \
                 half the {} s --timeout; give a higher rate (K/M/G suffixes) or --timeout {} \
                 or more",
                WINDOW_SIZE >> 20,
                self.timeout.as_secs(),
                (window * 2.0).ceil() as u64
            )));
        }
        Ok(())
    }
}

/// The data path's reconnect callback: verbs resets the QP, exchanges fresh
/// endpoints with `Reconnect` and connects again; a TCP channel cannot be
/// replaced under a running stream (the caller resumes).
fn reconnector(
    link: &Arc<ClientLink>,
    rpc: &Rpc,
    id: u64,
    rd: u32,
    retry: crate::datapath::QpRetry,
) -> Box<dyn FnMut() -> std::result::Result<(), ReconnectError> + Send> {
    let vc = link.verbs_channel.clone();
    let rpc = rpc.clone();
    let handle = tokio::runtime::Handle::current();
    let mut epoch = 0u32;
    Box::new(move || {
        let Some(vc) = &vc else {
            return Err("the TCP data connection broke; rerun with --resume".into());
        };
        let ep = vc.reset()?;
        epoch += 1;
        let resp = handle.block_on(rpc.clone().reconnect(proto::ReconnectRequest {
            session_id: id,
            endpoint: Some(ep_to_proto(&ep)),
            epoch,
        }))?;
        let sep = resp
            .into_inner()
            .endpoint
            .ok_or("the server sent no endpoint")?;
        vc.handshake(&ep_from_proto(&sep)?, &connect_params(rd, rd, retry))?;
        tracing::info!(epoch, "reconnected");
        Ok(())
    })
}

impl Session {
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn block_size(&self) -> u64 {
        self.params.block_size
    }

    /// The block check the handshake agreed on; file digests are derived
    /// from its block digests (`rcp-file-digest-v1`).
    pub fn check(&self) -> &'static str {
        self.params.check.name()
    }

    /// Move `files` over one Move stream, up to the session's files in
    /// flight at once; `obs` sees each start, the progress and each result.
    /// The first file that fails ends the stream with its error (what was
    /// verified stays resumable).
    pub async fn transfer(
        &mut self,
        files: &mut (dyn Iterator<Item = FileJob> + Send),
        obs: &dyn Observer,
    ) -> Result<()> {
        super::stream::run(self, files, obs).await
    }

    /// [`transfer`](Self::transfer) of a list; the results, in the order
    /// the files finished.
    pub async fn transfer_all(&mut self, files: Vec<FileJob>) -> Result<Vec<FileResult>> {
        struct Collect(std::sync::Mutex<Vec<FileResult>>);
        impl Observer for Collect {
            fn file_done(&self, r: &FileResult) {
                self.0.lock().unwrap().push(r.clone());
            }
        }
        let c = Collect(Default::default());
        self.transfer(&mut files.into_iter(), &c).await?;
        Ok(c.0.into_inner().unwrap())
    }

    /// Stop the data path and release the server's resources for this
    /// session; what the data path did.
    pub async fn close(mut self) -> Result<SessionStats> {
        let dp = self.dp.take();
        let report = tokio::task::spawn_blocking(move || dp.map(DataPath::close))
            .await
            .map_err(|e| ControlError::Other(e.to_string()))?
            .unwrap_or_default();
        // The device has let go of every window now.
        self.quarantine.clear();
        if let Some(m) = &self.opts.metrics {
            m.datapath_report(self.direction.unwrap_or("none"), &report);
        }
        self.rpc
            .close_session(proto::CloseSessionRequest {
                session_id: self.id,
            })
            .await?;
        Ok(SessionStats { report })
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Close the data path before the staging it may still be writing
        // is returned (quarantine drops after this).
        if let Some(dp) = self.dp.take() {
            let _ = crate::control::in_place(|| dp.close());
        }
    }
}
