//! A file still being received, readable block by block as its blocks are
//! verified and written: what a fan-out node forwards while it copies
//! ([`Growing`], read through [`SourceFile::growing`](super::SourceFile::growing)).
//!
//! The receiving side marks each block once it is written to the temp
//! file and [`finish`](Growing::finish)es the file at its commit. A reader
//! waits for the blocks of each range it reads and reads them from the
//! file the receiver writes now (a resumed copy may write another temp
//! file: the reader follows it). Nothing here decides that a file failed:
//! an interrupted copy can be resumed by another sender, and the reader
//! waits for that; only the reader's own [`Cancel`] ends its wait.

use std::fs::File;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::error::{FileError, Result};

/// How often a waiting reader looks at its [`Cancel`].
const CANCEL_POLL: Duration = Duration::from_millis(200);

/// A reader's way out of a wait: set by whoever stops the reading (a
/// forwarding copy cancelled or failed).
#[derive(Clone, Debug, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Debug)]
struct State {
    /// Block i written and verified.
    have: Vec<bool>,
    /// The file its blocks are in now.
    file: Option<Arc<File>>,
    committed: bool,
}

/// One file being received; see the module doc.
#[derive(Debug)]
pub struct Growing {
    len: u64,
    block_size: u64,
    state: Mutex<State>,
    cv: Condvar,
}

impl Growing {
    /// A file of `len` bytes in blocks of `block_size`, written to `file`,
    /// holding `held` already (a resumed copy's verified blocks).
    pub fn new(len: u64, block_size: u64, file: File, held: impl IntoIterator<Item = u64>) -> Self {
        let n = len.div_ceil(block_size.max(1)) as usize;
        let mut have = vec![false; n];
        for b in held {
            if let Some(h) = have.get_mut(b as usize) {
                *h = true;
            }
        }
        Growing {
            len,
            block_size: block_size.max(1),
            state: Mutex::new(State {
                have,
                file: Some(Arc::new(file)),
                committed: false,
            }),
            cv: Condvar::new(),
        }
    }

    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// Another copy of the same source writes the file now, to `file`,
    /// holding `held`: what was marked before is forgotten (it was in the
    /// other temp file), readers wait for the blocks of the new one.
    pub fn restart(&self, file: File, held: impl IntoIterator<Item = u64>) {
        let mut s = self.state.lock().unwrap();
        if s.committed {
            return;
        }
        s.have.iter_mut().for_each(|h| *h = false);
        for b in held {
            if let Some(h) = s.have.get_mut(b as usize) {
                *h = true;
            }
        }
        s.file = Some(Arc::new(file));
        drop(s);
        self.cv.notify_all();
    }

    /// The copy writing it ended before its commit: the temp file is let
    /// go (readers wait for another copy of it to [`restart`](Self::restart)
    /// it; nothing holds a descriptor meanwhile).
    pub fn detach(&self) {
        let mut s = self.state.lock().unwrap();
        if !s.committed {
            s.file = None;
        }
    }

    /// Block `index` is written and verified.
    pub fn mark(&self, index: u64) {
        let mut s = self.state.lock().unwrap();
        if let Some(h) = s.have.get_mut(index as usize) {
            *h = true;
        }
        drop(s);
        self.cv.notify_all();
    }

    /// The file is committed: every block is there.
    pub fn finish(&self) {
        let mut s = self.state.lock().unwrap();
        s.committed = true;
        s.have.iter_mut().for_each(|h| *h = true);
        drop(s);
        self.cv.notify_all();
    }

    pub fn is_committed(&self) -> bool {
        self.state.lock().unwrap().committed
    }

    /// Wait until the blocks of `[offset, offset + len)` are there; the
    /// file to read them from.
    pub fn wait_range(&self, offset: u64, len: u64, cancel: &Cancel) -> Result<Arc<File>> {
        let end = (offset + len).min(self.len);
        let first = offset / self.block_size;
        let last = end.div_ceil(self.block_size);
        self.wait(cancel, |s| {
            (first..last).all(|b| s.have.get(b as usize).copied().unwrap_or(true))
        })
    }

    /// Wait for the commit.
    pub fn wait_committed(&self, cancel: &Cancel) -> Result<Arc<File>> {
        self.wait(cancel, |s| s.committed)
    }

    fn wait(&self, cancel: &Cancel, ready: impl Fn(&State) -> bool) -> Result<Arc<File>> {
        let mut s = self.state.lock().unwrap();
        loop {
            if cancel.is_cancelled() {
                return Err(FileError::Cancelled);
            }
            if ready(&s) {
                if let Some(f) = &s.file {
                    return Ok(f.clone());
                }
            }
            s = self.cv.wait_timeout(s, CANCEL_POLL).unwrap().0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    fn file_with(bytes: &[u8]) -> File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    #[test]
    fn a_reader_waits_for_the_blocks_it_reads() {
        let g = Arc::new(Growing::new(8, 4, file_with(&[0; 8]), []));
        let c = Cancel::default();
        let reader = {
            let (g, c) = (g.clone(), c.clone());
            std::thread::spawn(move || {
                let f = g.wait_range(4, 4, &c).unwrap();
                let mut b = [0u8; 4];
                f.read_at(&mut b, 4).unwrap();
                b
            })
        };
        // Block 0 does not release a read of block 1.
        g.mark(0);
        std::thread::sleep(Duration::from_millis(50));
        assert!(!reader.is_finished());
        let f = g.wait_range(0, 4, &c).unwrap();
        f.write_at(&[7; 4], 4).unwrap();
        g.mark(1);
        assert_eq!(reader.join().unwrap(), [7; 4]);
    }

    #[test]
    fn a_restart_forgets_what_the_other_temp_file_held() {
        let g = Growing::new(8, 4, file_with(&[1; 8]), [0, 1]);
        let c = Cancel::default();
        g.restart(file_with(&[2; 8]), [1]);
        let f = g.wait_range(4, 4, &c).unwrap();
        let mut b = [0u8; 1];
        f.read_at(&mut b, 4).unwrap();
        assert_eq!(b, [2]);
        c.cancel();
        assert!(matches!(g.wait_range(0, 4, &c), Err(FileError::Cancelled)));
    }

    #[test]
    fn a_detached_file_waits_for_the_next_copy() {
        let g = Arc::new(Growing::new(4, 4, file_with(&[1; 4]), [0]));
        g.detach();
        let c = Cancel::default();
        let reader = {
            let (g, c) = (g.clone(), c.clone());
            std::thread::spawn(move || g.wait_range(0, 4, &c).map(|_| ()))
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!reader.is_finished(), "no file to read while detached");
        g.restart(file_with(&[2; 4]), [0]);
        reader.join().unwrap().unwrap();
    }

    #[test]
    fn a_cancelled_reader_stops_waiting() {
        let g = Arc::new(Growing::new(8, 4, file_with(&[0; 8]), []));
        let c = Cancel::default();
        let reader = {
            let (g, c) = (g.clone(), c.clone());
            std::thread::spawn(move || g.wait_committed(&c).map(|_| ()))
        };
        c.cancel();
        assert!(matches!(reader.join().unwrap(), Err(FileError::Cancelled)));
        g.finish();
        assert!(g.wait_committed(&Cancel::default()).is_ok());
    }
}
