//! Write-behind for a [`Destination`]: a thread of its own writes verified
//! blocks (and feeds the flat whole-file SHA-256, when enabled) while the
//! caller checks the next window. Without it the receiver's loop does
//! per-block hashing and the `pwrite` (and the serial flat SHA-256) one after
//! the other, and the sender waits on that chain.
//!
//! Jobs are closures run in order against the destination; the queue is
//! bounded, so a slow disk pushes back on the caller (and through it on the
//! windows it grants) instead of piling up memory. The first failing job
//! stops the thread; its error is what the next [`WriteBehind::submit`] or
//! [`WriteBehind::finish`] returns.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::commit::Destination;
use super::error::{FileError, Result};

/// One unit of work for the writer thread.
pub type Job = Box<dyn FnOnce(&mut Destination) -> Result<()> + Send>;

/// A [`Destination`] owned by a writer thread until [`finish`](Self::finish).
pub struct WriteBehind {
    tx: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<Result<Destination>>>,
    /// Set when dropped without [`finish`](Self::finish): queued jobs are
    /// skipped, so the destination (and its temp file lock) is released
    /// at once.
    abandon: Arc<AtomicBool>,
}

impl std::fmt::Debug for WriteBehind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteBehind")
            .field("running", &self.thread.is_some())
            .finish()
    }
}

impl WriteBehind {
    /// Hand `dest` to a new thread; at most `depth` jobs wait in its queue.
    pub fn spawn(dest: Destination, depth: usize) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel::<Job>(depth.max(1));
        let abandon = Arc::new(AtomicBool::new(false));
        let stop = abandon.clone();
        let thread = std::thread::Builder::new()
            .name("rcp-writer".into())
            .spawn(move || {
                let mut dest = dest;
                for job in rx {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    job(&mut dest)?;
                }
                Ok(dest)
            })?;
        Ok(WriteBehind {
            tx: Some(tx),
            thread: Some(thread),
            abandon,
        })
    }

    /// Queue a job (blocks while the queue is full). If the writer stopped
    /// on an error, that error is returned and the destination is gone
    /// (dropped on the writer thread, which keeps or removes the temp file
    /// as [`Destination`]'s drop does).
    pub fn submit(&mut self, job: Job) -> Result<()> {
        let Some(tx) = &self.tx else {
            return Err(stopped());
        };
        if tx.send(job).is_ok() {
            return Ok(());
        }
        self.tx = None;
        match self.join() {
            Ok(_) => Err(stopped()),
            Err(e) => Err(e),
        }
    }

    /// Wait for every queued job and take the destination back.
    pub fn finish(mut self) -> Result<Destination> {
        self.tx = None;
        self.join()
    }

    fn join(&mut self) -> Result<Destination> {
        let Some(t) = self.thread.take() else {
            return Err(stopped());
        };
        t.join().unwrap_or_else(|_| {
            Err(FileError::Io {
                op: "write",
                path: "(writer thread)".into(),
                source: std::io::Error::other("the writer thread panicked"),
            })
        })
    }
}

impl Drop for WriteBehind {
    fn drop(&mut self) {
        // The transfer failed or was interrupted: skip what is still queued
        // (it was never recorded as verified, so a resume sends it again)
        // and wait only for the job in progress, so the destination saves
        // its manifest and unlocks its temp file before the caller goes on,
        // ready for a `--resume` that may already be on its way.
        self.abandon.store(true, Ordering::Relaxed);
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn stopped() -> FileError {
    FileError::Io {
        op: "write",
        path: "(writer thread)".into(),
        source: std::io::Error::other("the writer already stopped on an earlier error"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::files::{block_digest, DestinationOptions, DirHandle};
    use sha2::{Digest, Sha256};

    fn dest(dir: &std::path::Path, len: u64, bs: u64) -> Destination {
        let d = DirHandle::open(dir).unwrap();
        Destination::create(
            &d,
            "out",
            len,
            DestinationOptions {
                block_size: bs,
                flat_sha256: true,
                ..DestinationOptions::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn blocks_written_behind_commit_with_the_right_digest() {
        let tmp = tempfile::tempdir().unwrap();
        let bs = 4096u64;
        let data: Vec<u8> = (0..3 * bs + 17).map(|i| (i * 31 % 251) as u8).collect();
        let mut wb = WriteBehind::spawn(dest(tmp.path(), data.len() as u64, bs), 1).unwrap();
        // Out of order, one job per block.
        for i in [2u64, 0, 3, 1] {
            let blk =
                data[(i * bs) as usize..((i + 1) * bs).min(data.len() as u64) as usize].to_vec();
            wb.submit(Box::new(move |d: &mut Destination| {
                d.write_block(i, &blk, block_digest(&blk))
            }))
            .unwrap();
        }
        let d = wb.finish().unwrap();
        let want: [u8; 32] = Sha256::digest(&data).into();
        assert_eq!(d.commit_flat(want).unwrap().flat_sha256, Some(want));
        assert_eq!(std::fs::read(tmp.path().join("out")).unwrap(), data);
    }

    #[test]
    fn dropping_skips_queued_jobs_and_releases_the_destination() {
        use std::sync::atomic::AtomicUsize;
        let tmp = tempfile::tempdir().unwrap();
        let mut wb = WriteBehind::spawn(dest(tmp.path(), 10, 4096), 1).unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let r = ran.clone();
        wb.submit(Box::new(move |_: &mut Destination| {
            started_tx.send(()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(200));
            r.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }))
        .unwrap();
        started_rx.recv().unwrap();
        let r = ran.clone();
        wb.submit(Box::new(move |_: &mut Destination| {
            r.fetch_add(10, Ordering::SeqCst);
            Ok(())
        }))
        .unwrap();
        drop(wb);
        // The job in progress finished; the queued one never ran.
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        // The destination is gone (not resumable: its temp file too).
        let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn a_failed_job_is_reported_and_later_jobs_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let mut wb = WriteBehind::spawn(dest(tmp.path(), 10, 4096), 1).unwrap();
        wb.submit(Box::new(|d: &mut Destination| {
            d.write_block(1, b"x", block_digest(b"x"))
        }))
        .unwrap();
        // The error surfaces at the latest by finish; a submit in between
        // either queues (writer not yet failed) or returns it.
        let mut err = None;
        for _ in 0..3 {
            if let Err(e) = wb.submit(Box::new(|_: &mut Destination| Ok(()))) {
                err = Some(e);
                break;
            }
        }
        let e = match err {
            Some(e) => e,
            None => wb.finish().unwrap_err(),
        };
        assert!(
            matches!(
                e,
                FileError::OutOfRange {
                    offset: 4096,
                    len: 1,
                    ..
                }
            ),
            "{e}"
        );
        // Not resumable: the dropped destination removed its temp file.
        let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
