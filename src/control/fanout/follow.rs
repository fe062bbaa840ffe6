//! A node's side of a fan-out hop (`CopyRequest.follow`): the files this
//! rcpd receives in the fan-out, pushed to the next node as their blocks
//! are verified here, until every file of the fan-out is there.

use std::path::PathBuf;
use std::sync::Arc;

use crate::control::client::{Client, FileJob, OpenWith, Source};
use crate::control::error::{ControlError, Result};
use crate::control::jobs::{self, Outcome, Planned, Sessions, Watcher};
use crate::control::protocol::{Failure, FileSpec, SourceMeta};
use crate::control::server::feeds::{FedFile, Feed};
use crate::control::server::Service;
use crate::files::{Cancel, FileMeta, SourceFile};
use crate::proto::Direction;

/// The file a fan-out brought to `path`, read as it arrives (or from
/// `path` once committed).
struct Fed {
    svc: Arc<Service>,
    feed: Arc<Feed>,
    path: String,
    cancel: Cancel,
}

fn failure(e: impl Into<ControlError>) -> Failure {
    e.into().failure()
}

impl Source for Fed {
    fn open(&self, bs: u64) -> std::result::Result<(Arc<SourceFile>, SourceMeta), Failure> {
        let f = self
            .feed
            .get(&self.path)
            .ok_or_else(|| Failure::invalid(format!("{} is not in the fan-out", self.path)))?;
        let o = &f.open;
        let mut meta = SourceMeta {
            length: o.length,
            mode: o.mode,
            mtime_ns: o.mtime_ns,
            fingerprint: o.source_fingerprint.clone(),
        };
        let shown = PathBuf::from(&f.path);
        let src = match f.growing {
            Some(g) => {
                let fm = FileMeta {
                    kind: crate::files::FileKind::File,
                    len: o.length,
                    mode: o.mode & 0o7777,
                    mtime: crate::control::fsutil::ts_from_ns(o.mtime_ns),
                    dev: 0,
                    ino: 0,
                };
                let fp = (o.source_fingerprint.len() == 32)
                    .then(|| crate::control::fsutil::fingerprint(&o.source_fingerprint));
                SourceFile::growing(&shown, g, fm, fp, self.cancel.clone()).map_err(failure)?
            }
            None => {
                let s = SourceFile::open_in(self.svc.root(), &f.path).map_err(failure)?;
                if s.len() != o.length {
                    return Err(Failure::invalid(format!(
                        "{} changed here after it was received",
                        f.path
                    )));
                }
                s
            }
        };
        if meta.fingerprint.is_empty() && o.length > bs {
            meta.fingerprint = src.source_id().map_err(failure)?.fingerprint.to_vec();
        }
        Ok((Arc::new(src), meta))
    }
}

/// Cancels the reads of a follow when it ends, however it ends.
struct CancelOnDrop(Cancel);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// Forward the fan-out `id` through `client` (the next node), over
/// `sessions`, until `files` distinct files went; `w` sees the progress.
pub async fn follow(
    svc: Arc<Service>,
    id: &str,
    files: u64,
    client: &Client,
    sessions: &dyn Sessions,
    w: &dyn Watcher,
) -> Result<Outcome> {
    let feed = svc.fanouts.wait(id).await;
    let cancel = Cancel::default();
    let _stop = CancelOnDrop(cancel.clone());
    // The feed lists each path once, in the order it first came: the
    // files sent are the first `sent` of it.
    let mut sent = 0;
    let mut last = None;
    while (sent as u64) < files {
        let batch: Vec<FedFile> = feed.since(sent);
        if batch.is_empty() {
            feed.more_than(sent).await;
            continue;
        }
        let plan = jobs::Plan {
            push: true,
            files: batch
                .iter()
                .map(|f| planned(&svc, &feed, id, f, &cancel))
                .collect(),
            ..jobs::Plan::default()
        };
        let o = jobs::run_over(client, sessions, plan, w).await?;
        sent += batch.len();
        last = Some(merge(last, o));
    }
    last.ok_or_else(|| ControlError::Invalid("a fan-out of no files".into()))
}

/// One fed file as a job: the same destination and name as it came with.
fn planned(
    svc: &Arc<Service>,
    feed: &Arc<Feed>,
    id: &str,
    f: &FedFile,
    cancel: &Cancel,
) -> Planned {
    let o = &f.open;
    let job = FileJob {
        spec: FileSpec {
            direction: Direction::Push,
            remote: o.path.clone(),
            name: o.name.clone(),
            preserve: o.preserve,
            resume: true,
            create_parents: o.create_parents,
            flat_sha256: o.flat_sha256,
            fanout: id.to_string(),
            ..FileSpec::default()
        },
        local: PathBuf::from(&f.path),
        len_hint: o.length,
        source: Some(OpenWith(Arc::new(Fed {
            svc: svc.clone(),
            feed: feed.clone(),
            path: f.path.clone(),
            cancel: cancel.clone(),
        }))),
    };
    Planned {
        job,
        source: f.path.clone(),
        dest: o.path.clone(),
        bytes: o.length,
        mtime_ns: Some(o.mtime_ns),
        mode: None,
    }
}

/// The totals of two batches of a follow.
fn merge(a: Option<Outcome>, mut b: Outcome) -> Outcome {
    if let Some(a) = a {
        b.totals.files += a.totals.files;
        b.totals.bytes += a.totals.bytes;
        b.totals.moved += a.totals.moved;
        b.totals.seconds += a.totals.seconds;
    }
    b
}
