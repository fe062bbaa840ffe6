//! The service API's `Copy`: this rcpd copies one of its paths to or from
//! another rcpd, acting as that rcpd's client ([`CopyService`], the
//! [`Copier`] `daemon` plugs into the server).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::client::{ClientOptions, FileResult, Observer};
use super::copy_peers::{Admitted, CopyPeers};
use super::error::{ControlError, Result};
use super::fanout::{self, Fanout};
use super::fsutil;
use super::jobs::{self, Job, Pool, Watcher};
use super::server::{BoxStream, Copier, Service};
use crate::escape::esc;
use crate::proto::{CopyProgress, CopyRequest, Direction, NodeResult};

/// Copies for services, with this rcpd's client settings (its token, TLS
/// identity, data-path settings), over sessions kept warm in `pool`, to
/// the peers `peers` admits only.
pub struct CopyService {
    pub opts: ClientOptions,
    pub pool: Arc<Pool>,
    pub peers: Arc<CopyPeers>,
}

impl Copier for CopyService {
    fn copy(
        &self,
        svc: Arc<Service>,
        req: CopyRequest,
    ) -> BoxFuture<'static, std::result::Result<BoxStream<CopyProgress>, Status>> {
        let (opts, pool, peers) = (self.opts.clone(), self.pool.clone(), self.peers.clone());
        Box::pin(async move { start(svc, opts, pool, &peers, req).await })
    }
}

#[derive(Default)]
struct Counts {
    bytes: AtomicU64,
    total: AtomicU64,
    files: AtomicU64,
    files_total: AtomicU64,
}

struct Obs(Arc<Counts>);

impl Watcher for Obs {}

impl Observer for Obs {
    fn file_start(&self, _name: &str, len: u64) {
        self.0.total.fetch_add(len, Relaxed);
        self.0.files_total.fetch_add(1, Relaxed);
    }
    fn progress(&self, n: u64) {
        self.0.bytes.fetch_add(n, Relaxed);
    }
    fn file_done(&self, _r: &FileResult) {
        self.0.files.fetch_add(1, Relaxed);
    }
}

fn snapshot(c: &Counts) -> CopyProgress {
    CopyProgress {
        bytes_done: c.bytes.load(Relaxed),
        bytes_total: c.total.load(Relaxed),
        files_done: c.files.load(Relaxed),
        files_total: c.files_total.load(Relaxed),
        ..Default::default()
    }
}

/// Validate `req`, admit its remote, and start the copy; progress every
/// 500 ms, then a final message (or the error status).
async fn start(
    svc: Arc<Service>,
    opts: ClientOptions,
    pool: Arc<Pool>,
    peers: &Arc<CopyPeers>,
    req: CopyRequest,
) -> Result<BoxStream<CopyProgress>, Status> {
    let dir = Direction::try_from(req.direction)
        .ok()
        .filter(|d| *d != Direction::Unspecified)
        .ok_or_else(|| Status::invalid_argument("copy direction must be push or pull"))?;
    if req.remote.is_empty() || req.remote_path.is_empty() {
        return Err(Status::invalid_argument(
            "copy needs remote and remote_path",
        ));
    }
    // A forwarding copy reads what this rcpd receives (its paths as they
    // came), not local_path.
    let local = match req.follow.is_empty() {
        true => confined_local(&svc, &req.local_path)?,
        false => svc.root().path().to_path_buf(),
    };
    let opts = copy_options(opts, &svc, &req)?;
    if !req.fanout.is_empty() && dir != Direction::Push {
        return Err(Status::invalid_argument("fan-out is a push"));
    }
    // Every node of a fan-out is a peer this rcpd sends to or asks.
    for n in &req.fanout {
        peers.admit(n).await.map_err(|e| {
            tracing::warn!(remote = %esc(n), "fan-out refused: {}", esc(&e));
            Status::from(e)
        })?;
    }
    // Nothing goes to a peer the list does not allow, not even a
    // connection: refused here, naming the flag.
    let peer = peers.admit(&req.remote).await.map_err(|e| {
        tracing::warn!(remote = %esc(&req.remote), "copy refused: {}", esc(&e));
        Status::from(e)
    })?;
    let (tx, rx) = mpsc::channel(16);
    let copy = AdmittedCopy {
        svc,
        peers: peers.clone(),
        pool,
        peer,
        opts,
        dir,
        local,
        req,
    };
    tokio::spawn(copy.run(tx));
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// The local side, confined like any request: resolved beneath the root
/// (the copy then works on that path), its parent an open directory of
/// the root, and the path itself not leading out (a symlink to outside).
fn confined_local(svc: &Service, local_path: &str) -> Result<PathBuf, Status> {
    let rel = fsutil::root_rel(local_path);
    let rp = crate::files::normalize(&rel).map_err(ControlError::from)?;
    let local = svc.root().path().join(rp.to_path());
    if let Some(parent) = fsutil::parent_dir(&rp.to_path()) {
        svc.root()
            .open_dir(&parent.to_string_lossy())
            .map_err(ControlError::from)?;
    }
    match svc.root().stat(&rel) {
        Ok(_) | Err(crate::files::FileError::Path(crate::files::PathError::NotFound { .. })) => {}
        Err(e) => return Err(ControlError::from(e).into()),
    }
    Ok(local)
}

/// This rcpd's client settings with what `req` overrides: the remote's
/// token, the transport, the block size, the checks.
fn copy_options(
    mut opts: ClientOptions,
    svc: &Service,
    req: &CopyRequest,
) -> Result<ClientOptions, Status> {
    // The data path this copy drives shows in this rcpd's /metrics.
    opts.metrics = Some(svc.metrics.clone());
    if !req.remote_token.is_empty() {
        opts.token = Some(req.remote_token.clone());
    }
    if !req.transport.is_empty() {
        opts.transport = req
            .transport
            .parse()
            .map_err(|e: String| Status::invalid_argument(e))?;
    }
    if req.block_size != 0 {
        opts.block_size = req.block_size;
    }
    if req.bwlimit != 0 {
        opts.bwlimit = Some(req.bwlimit);
        opts.check_bwlimit().map_err(Status::from)?;
    }
    if !req.checks.is_empty() {
        opts.verify = req
            .checks
            .iter()
            .map(|&c| {
                crate::control::protocol::check_from_wire(c)
                    .ok_or_else(|| Status::invalid_argument(format!("unknown check {c}")))
            })
            .collect::<Result<_, _>>()?;
    }
    Ok(opts)
}

/// One admitted copy, ready to run.
struct AdmittedCopy {
    svc: Arc<Service>,
    peers: Arc<CopyPeers>,
    pool: Arc<Pool>,
    peer: Admitted,
    opts: ClientOptions,
    dir: Direction,
    local: PathBuf,
    req: CopyRequest,
}

impl AdmittedCopy {
    /// Run the copy, sending its progress to `tx` every 500 ms, then the
    /// final message (and the error status if it failed). The caller
    /// going away ends the copy.
    async fn run(self, tx: mpsc::Sender<Result<CopyProgress, Status>>) {
        let counts = Arc::new(Counts::default());
        let obs = Obs(counts.clone());
        let work = self.work(&obs);
        tokio::pin!(work);
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        let result: Result<(jobs::Outcome, Vec<NodeResult>)> = loop {
            tokio::select! {
                r = &mut work => break r,
                _ = tick.tick() => {
                    if tx.send(Ok(snapshot(&counts))).await.is_err() {
                        return; // the caller went away; dropping `work` ends the copy
                    }
                }
            }
        };
        let mut last = snapshot(&counts);
        last.done = true;
        let remote = &self.req.remote;
        match result {
            Ok((o, nodes)) => {
                let incomplete = fanout::incomplete(&nodes);
                last.nodes = nodes;
                if let Some(e) = incomplete {
                    tracing::warn!(remote = %esc(remote), "fan-out incomplete: {}", esc(&e));
                    last.error = e.to_string();
                    let _ = tx.send(Ok(last)).await;
                    let _ = tx.send(Err(Status::from(e))).await;
                    return;
                }
                if let Some(why) = &o.fell_back {
                    tracing::warn!(remote = %remote, "copy fell back to tcp: {why}");
                }
                let t = o.totals;
                if t.files == 1 {
                    last.sha256 = t.sha256.map(hex::encode).unwrap_or_default();
                }
                tracing::info!(files = t.files, bytes = t.bytes, remote = %esc(remote), "copy done");
                let _ = tx.send(Ok(last)).await;
            }
            Err(e) => {
                tracing::warn!(error = %esc(&e), remote = %esc(remote), "copy failed");
                last.error = e.to_string();
                let _ = tx.send(Ok(last)).await;
                let _ = tx.send(Err(Status::from(e))).await;
            }
        }
    }

    /// The copy itself: the jobs policy runs it, the tcp fallback
    /// included, over a warm session of the pool when it has one. A
    /// fan-out's nodes' results with it.
    async fn work(&self, obs: &Obs) -> Result<(jobs::Outcome, Vec<NodeResult>)> {
        let req = &self.req;
        if !req.fanout.is_empty() {
            return self.fan_out(obs).await;
        }
        if !req.follow.is_empty() {
            let mut opts = self.opts.clone();
            opts.windows = opts.windows.min(fanout::WINDOWS);
            let lease = self.pool.lease(&self.peer, opts).await?;
            let svc = self.svc.clone();
            let client = lease.client();
            let o = fanout::follow::follow(svc, &req.follow, req.follow_files, client, &lease, obs)
                .await?;
            return Ok((o, Vec::new()));
        }
        let lease = self.pool.lease(&self.peer, self.opts.clone()).await?;
        let client = lease.client();
        let job = self.job(String::new());
        let plan = match self.dir {
            Direction::Push => {
                let locals = std::slice::from_ref(&self.local);
                jobs::plan_push(client, locals, &req.remote_path, &job).await?
            }
            _ => {
                let remotes = std::slice::from_ref(&req.remote_path);
                jobs::plan_pull(client, remotes, &self.local, &job).await?
            }
        };
        Ok((jobs::run_over(client, &lease, plan, obs).await?, Vec::new()))
    }

    fn job(&self, fanout: String) -> Job {
        let req = &self.req;
        Job {
            recursive: req.recursive,
            preserve: req.preserve,
            resume: req.resume,
            // The final progress carries the file's sha256sum value, which
            // services compare with what they hold.
            sha256: true,
            // The Copy API moves every file (it has no skip rules yet).
            fanout,
            ..Job::default()
        }
    }

    /// Push to `remote` and along `fanout` (docs/fanout.md): this rcpd is
    /// the source, each node forwards to the next.
    async fn fan_out(&self, obs: &Obs) -> Result<(jobs::Outcome, Vec<NodeResult>)> {
        let req = &self.req;
        let id = fanout::new_id();
        let mut opts = self.opts.clone();
        opts.windows = opts.windows.min(fanout::WINDOWS);
        let src = Arc::new(CopySource {
            pool: self.pool.clone(),
            peers: self.peers.clone(),
            opts,
            local: self.local.clone(),
            remote_path: req.remote_path.clone(),
            job: self.job(id.clone()),
            counts: obs.0.clone(),
            outcome: Default::default(),
            planned: Default::default(),
        });
        let nodes: Vec<String> = std::iter::once(req.remote.clone())
            .chain(req.fanout.iter().cloned())
            .collect();
        let files = fanout::count_files(&nodes, |n| src.count(n)).await?;
        let f = Fanout {
            nodes,
            id,
            files,
            template: CopyRequest {
                remote_path: req.remote_path.clone(),
                recursive: req.recursive,
                preserve: req.preserve,
                transport: req.transport.clone(),
                block_size: req.block_size,
                checks: req.checks.clone(),
                bwlimit: req.bwlimit,
                ..Default::default()
            },
            opts: self.opts.clone(),
            resume: req.resume,
        };
        let states = fanout::run(&f, src.clone()).await;
        let nodes = fanout::results(&states);
        let done = src.outcome.lock().unwrap().take();
        match done {
            Some(o) => Ok((o, nodes)),
            None => Err(ControlError::Failed(
                crate::control::protocol::Failure::new(
                    crate::control::protocol::Reason::Other,
                    fanout::summary(&states),
                ),
            )),
        }
    }
}

/// The Copy API's source of a fan-out: this rcpd's `local`, pushed to a
/// node over the pool's sessions.
struct CopySource {
    pool: Arc<Pool>,
    peers: Arc<CopyPeers>,
    opts: ClientOptions,
    local: PathBuf,
    remote_path: String,
    job: Job,
    counts: Arc<Counts>,
    /// The last send that finished.
    outcome: std::sync::Mutex<Option<jobs::Outcome>>,
    /// The plan that counted the files, and the node it was made against:
    /// the first hop's send, to the same node with the same job, runs it
    /// instead of planning the tree again.
    planned: std::sync::Mutex<Option<(String, jobs::Plan)>>,
}

impl CopySource {
    /// Plan the push against `node`: how many files (the plan is kept).
    async fn count(&self, node: String) -> Result<u64> {
        let peer = self.peers.admit(&node).await?;
        let lease = self.pool.lease(&peer, self.opts.clone()).await?;
        let locals = std::slice::from_ref(&self.local);
        let plan = jobs::plan_push(lease.client(), locals, &self.remote_path, &self.job).await?;
        let files = plan.files.len() as u64;
        *self.planned.lock().unwrap() = Some((node, plan));
        Ok(files)
    }
}

impl fanout::SourceSend for CopySource {
    fn send(self: Arc<Self>, node: String, resume: bool) -> BoxFuture<'static, Result<()>> {
        Box::pin(async move {
            let peer = self.peers.admit(&node).await?;
            let lease = self.pool.lease(&peer, self.opts.clone()).await?;
            let mut job = self.job.clone();
            job.resume |= resume;
            let kept = self.planned.lock().unwrap().take();
            let plan = match kept {
                Some((n, plan)) if n == node && !resume => {
                    tracing::debug!(node = %crate::escape::esc(&node), files = plan.files.len(), "fan-out: the counting plan is the first hop's");
                    plan
                }
                _ => {
                    let locals = std::slice::from_ref(&self.local);
                    jobs::plan_push(lease.client(), locals, &self.remote_path, &job).await?
                }
            };
            let obs = Obs(self.counts.clone());
            let o = jobs::run_over(lease.client(), &lease, plan, &obs).await?;
            *self.outcome.lock().unwrap() = Some(o);
            Ok(())
        })
    }
}
