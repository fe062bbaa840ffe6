//! Block I/O (legacy runner): where the data path gets the bytes of a block before a WRITE
//! and puts them after a READ, plus the control-plane hooks (windows).
//!
//! The local buffers are the caller's registered memory; the engine hands
//! out their addresses as [`LocalSeg`]s. [`Staging`] maps such a segment
//! back to the caller's [`PeerSpan`] so `fill`/`drain` are plain safe copies.

use std::io;

use crate::engine::{LocalSeg, Window};
use crate::mem::PeerSpan;

/// What the runner asks of the side that owns the file and the memory.
pub trait BlockIo {
    /// Push: copy file bytes `[file_offset, file_offset + local.len)` into
    /// the local buffer `local` before it is posted.
    fn fill(&mut self, file_offset: u64, local: LocalSeg) -> io::Result<()>;
    /// Pull: the local buffer holds file bytes `[file_offset, +local.len)`;
    /// write them out. The buffer is reused after this returns.
    fn drain(&mut self, file_offset: u64, local: LocalSeg) -> io::Result<()>;
    /// Push: [`fill`](Self::fill) each `(file_offset, local)` of a chain
    /// before it is posted, in order (an implementation may hash them in
    /// parallel). On failure, the file offset of the block that failed.
    fn fill_chain(&mut self, blocks: &[(u64, LocalSeg)]) -> Result<(), (u64, io::Error)> {
        for &(off, local) in blocks {
            self.fill(off, local).map_err(|e| (off, e))?;
        }
        Ok(())
    }
    /// Pull: [`drain`](Self::drain) each of the blocks confirmed together,
    /// in order (an implementation may check them in parallel).
    fn drain_chain(&mut self, blocks: &[(u64, LocalSeg)]) -> Result<(), (u64, io::Error)> {
        for &(off, local) in blocks {
            self.drain(off, local).map_err(|e| (off, e))?;
        }
        Ok(())
    }
    /// A block is confirmed (after `drain` for a pull). Default: nothing.
    fn block_done(&mut self, _block: u64, _file_offset: u64, _len: u32) {}
    /// Every block of a window is confirmed (the control plane acks it).
    fn window_done(&mut self, _window_id: u64) {}
    /// Another window grant, if the control plane has one now. Asked at the
    /// start, after each `window_done`, and when nothing can be posted.
    fn next_window(&mut self) -> Option<Window> {
        None
    }
}

/// The caller's staging memory: local buffers as addresses inside a span.
#[derive(Clone, Debug)]
pub struct Staging {
    span: PeerSpan,
}

impl Staging {
    /// Local buffers handed to the engine lie inside `span`.
    pub fn new(span: PeerSpan) -> Self {
        Staging { span }
    }

    /// The span.
    pub fn span(&self) -> &PeerSpan {
        &self.span
    }

    fn offset(&self, local: &LocalSeg) -> io::Result<usize> {
        local
            .addr
            .checked_sub(self.span.addr())
            .map(|o| o as usize)
            .filter(|o| o + local.len as usize <= self.span.len())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "local segment {:#x}+{} is outside the staging span {:?}",
                        local.addr, local.len, self.span
                    ),
                )
            })
    }

    /// Run `f` over the bytes of `local`, mutably.
    ///
    /// # Safety
    ///
    /// As [`PeerSpan::with_mut`]: no request in flight names these bytes
    /// (e.g. `local` is the buffer [`BlockIo::fill`] was handed, before it
    /// is posted) and no other borrower touches them while `f` runs.
    pub unsafe fn with_mut<R>(
        &self,
        local: &LocalSeg,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> io::Result<R> {
        let o = self.offset(local)?;
        // SAFETY: the caller's contract above is `with_mut`'s.
        Ok(unsafe { self.span.with_mut(o, local.len as usize, f) }.expect("bounds checked"))
    }

    /// Run `f` over the bytes of `local`.
    pub fn with<R>(&self, local: &LocalSeg, f: impl FnOnce(&[u8]) -> R) -> io::Result<R> {
        let o = self.offset(local)?;
        Ok(self
            .span
            .with(o, local.len as usize, f)
            .expect("bounds checked"))
    }
}

/// A [`BlockIo`] over an in-memory "file": `fill` copies from `file` into
/// staging, `drain` copies from staging into `file`. Windows come from a
/// queue. For tests and tools.
#[derive(Debug)]
pub struct MemoryIo {
    /// The file bytes.
    pub file: Vec<u8>,
    /// Where the local buffers live.
    pub staging: Staging,
    /// Windows to hand out, in order.
    pub windows: std::collections::VecDeque<Window>,
    /// Windows reported done, in order.
    pub windows_done: Vec<u64>,
    /// How many times each block was reported done.
    pub done_count: Vec<u32>,
}

impl MemoryIo {
    /// `file` staged through `staging`, `blocks` blocks.
    pub fn new(file: Vec<u8>, staging: Staging, blocks: u64) -> Self {
        MemoryIo {
            file,
            staging,
            windows: Default::default(),
            windows_done: Vec::new(),
            done_count: vec![0; blocks as usize],
        }
    }

    fn range(&self, file_offset: u64, len: u32) -> io::Result<std::ops::Range<usize>> {
        let s = file_offset as usize;
        let e = s + len as usize;
        if e > self.file.len() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{s}..{e} past the end of a {}-byte file", self.file.len()),
            ));
        }
        Ok(s..e)
    }
}

impl BlockIo for MemoryIo {
    fn fill(&mut self, file_offset: u64, local: LocalSeg) -> io::Result<()> {
        let r = self.range(file_offset, local.len)?;
        let src = &self.file[r];
        // SAFETY: the runner calls `fill` with the staging buffer the engine
        // lent to this block just before posting it: no request names it
        // yet, and this `MemoryIo` is its only user.
        unsafe { self.staging.with_mut(&local, |d| d.copy_from_slice(src)) }
    }

    fn drain(&mut self, file_offset: u64, local: LocalSeg) -> io::Result<()> {
        let r = self.range(file_offset, local.len)?;
        let dst = &mut self.file[r];
        self.staging.with(&local, |s| dst.copy_from_slice(s))
    }

    fn block_done(&mut self, block: u64, _file_offset: u64, _len: u32) {
        if let Some(c) = self.done_count.get_mut(block as usize) {
            *c += 1;
        }
    }

    fn window_done(&mut self, window_id: u64) {
        self.windows_done.push(window_id);
    }

    fn next_window(&mut self) -> Option<Window> {
        self.windows.pop_front()
    }
}

/// A [`BlockIo`] that moves no file data (benchmarks), handing out windows
/// from a generator.
pub struct NullIo<F: FnMut() -> Option<Window>> {
    /// Called for the next window.
    pub windows: F,
}

impl<F: FnMut() -> Option<Window>> BlockIo for NullIo<F> {
    fn fill(&mut self, _file_offset: u64, _local: LocalSeg) -> io::Result<()> {
        Ok(())
    }
    fn drain(&mut self, _file_offset: u64, _local: LocalSeg) -> io::Result<()> {
        Ok(())
    }
    fn next_window(&mut self) -> Option<Window> {
        (self.windows)()
    }
}
