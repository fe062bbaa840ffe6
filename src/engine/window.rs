//! Remote windows: peer memory granted for a range of the file.
//!
//! For a push the server grants a window of registered memory into which the
//! client WRITEs the blocks of `file_offset .. file_offset + len`; for a pull
//! it grants one the client READs from. A window covers whole blocks, lies
//! inside the file and overlaps no other live window. [`Windows`] holds the
//! live ones, maps a block to its remote address and counts what is left of
//! each so the transfer can say when one is done.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::Range;

use super::blocks::{BlockPlan, BlockSpan};
use super::wr::RemoteSeg;

/// A grant of remote memory for a file range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// Server-chosen id, unique among live windows.
    pub id: u64,
    /// Peer address of the first byte.
    pub remote_addr: u64,
    /// Peer memory key.
    pub rkey: u32,
    /// Bytes covered.
    pub len: u64,
    /// File offset of the first byte.
    pub file_offset: u64,
    /// The server's grant epoch; carried, not interpreted.
    pub epoch: u32,
}

impl Window {
    /// File offset one past the last byte.
    pub fn end(&self) -> u64 {
        self.file_offset.saturating_add(self.len)
    }

    /// The block indices the window covers (assumes it is valid for `plan`).
    pub fn blocks(&self, plan: &BlockPlan) -> Range<u64> {
        let first = self.file_offset / plan.block_size();
        let last = self.end().min(plan.len()).div_ceil(plan.block_size());
        first..last.max(first)
    }

    /// Where `block` lands on the peer (assumes the window covers it).
    pub fn remote_for(&self, block: &BlockSpan) -> RemoteSeg {
        debug_assert!(block.file_offset >= self.file_offset && block.file_offset < self.end());
        RemoteSeg {
            addr: self.remote_addr + (block.file_offset - self.file_offset),
            rkey: self.rkey,
        }
    }
}

/// Why a window was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowError {
    /// `len` is 0.
    Empty {
        /// Window id.
        id: u64,
    },
    /// `file_offset` is not a multiple of the block size.
    Misaligned {
        /// Window id.
        id: u64,
        /// The offending offset.
        file_offset: u64,
        /// The block size.
        block_size: u64,
    },
    /// The window ends inside a block that is not the file's last.
    RaggedEnd {
        /// Window id.
        id: u64,
        /// File offset one past the window.
        end: u64,
        /// The block size.
        block_size: u64,
    },
    /// The window reaches past the file (or its last block).
    OutOfFile {
        /// Window id.
        id: u64,
        /// File offset one past the window.
        end: u64,
        /// File length.
        file_len: u64,
    },
    /// `remote_addr + len` overflows.
    AddressOverflow {
        /// Window id.
        id: u64,
    },
    /// Covers bytes of another live window.
    Overlap {
        /// Window id.
        id: u64,
        /// The live window it overlaps.
        other: u64,
    },
    /// Another live window has this id.
    DuplicateId {
        /// Window id.
        id: u64,
    },
}

impl fmt::Display for WindowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            WindowError::Empty { id } => write!(f, "window {id} is empty"),
            WindowError::Misaligned {
                id,
                file_offset,
                block_size,
            } => write!(
                f,
                "window {id}: file offset {file_offset} is not a multiple of the block size {block_size}"
            ),
            WindowError::RaggedEnd {
                id,
                end,
                block_size,
            } => write!(
                f,
                "window {id}: end {end} is not a multiple of the block size {block_size} nor the end of the file"
            ),
            WindowError::OutOfFile { id, end, file_len } => {
                write!(f, "window {id}: end {end} is past the file ({file_len} bytes)")
            }
            WindowError::AddressOverflow { id } => {
                write!(f, "window {id}: remote address range overflows")
            }
            WindowError::Overlap { id, other } => {
                write!(f, "window {id} overlaps live window {other}")
            }
            WindowError::DuplicateId { id } => write!(f, "window id {id} is already live"),
        }
    }
}

impl std::error::Error for WindowError {}

#[derive(Clone, Debug)]
struct Live {
    window: Window,
    remaining: u64,
}

/// The live windows of one transfer, keyed by file offset.
#[derive(Clone, Debug)]
pub struct Windows {
    plan: BlockPlan,
    by_offset: BTreeMap<u64, Live>,
    by_id: HashMap<u64, u64>,
}

impl Windows {
    /// No windows yet, for a transfer cut by `plan`.
    pub fn new(plan: BlockPlan) -> Self {
        Windows {
            plan,
            by_offset: BTreeMap::new(),
            by_id: HashMap::new(),
        }
    }

    /// Check `w` is well-formed for the plan and overlaps no live window.
    ///
    /// The end must be a block boundary, or the file's end, or the end of the
    /// file's last (short) block: a server may register whole blocks.
    pub fn validate(&self, w: &Window) -> Result<(), WindowError> {
        let id = w.id;
        let bs = self.plan.block_size();
        let file_len = self.plan.len();
        if w.len == 0 {
            return Err(WindowError::Empty { id });
        }
        if w.file_offset % bs != 0 {
            return Err(WindowError::Misaligned {
                id,
                file_offset: w.file_offset,
                block_size: bs,
            });
        }
        let end = w.file_offset.checked_add(w.len);
        let limit = file_len.div_ceil(bs) * bs;
        match end {
            Some(end) if end <= limit => {
                if end % bs != 0 && end != file_len {
                    return Err(WindowError::RaggedEnd {
                        id,
                        end,
                        block_size: bs,
                    });
                }
            }
            _ => {
                return Err(WindowError::OutOfFile {
                    id,
                    end: w.end(),
                    file_len,
                })
            }
        }
        if w.remote_addr.checked_add(w.len).is_none() {
            return Err(WindowError::AddressOverflow { id });
        }
        if self.by_id.contains_key(&id) {
            return Err(WindowError::DuplicateId { id });
        }
        if let Some(other) = self.overlapping(w) {
            return Err(WindowError::Overlap { id, other });
        }
        Ok(())
    }

    fn overlapping(&self, w: &Window) -> Option<u64> {
        // The live window starting at or before `w` may reach into it...
        if let Some((_, l)) = self.by_offset.range(..=w.file_offset).next_back() {
            if l.window.end() > w.file_offset {
                return Some(l.window.id);
            }
        }
        // ...and so may one starting inside it.
        self.by_offset
            .range(w.file_offset..w.end())
            .next()
            .map(|(_, l)| l.window.id)
    }

    /// Validate and add `w`, with `remaining` blocks of it still to confirm
    /// (the caller knows which of its blocks are already done). A window
    /// with nothing remaining is validated but not kept.
    pub fn insert(&mut self, w: Window, remaining: u64) -> Result<(), WindowError> {
        self.validate(&w)?;
        if remaining > 0 {
            self.by_id.insert(w.id, w.file_offset);
            self.by_offset.insert(
                w.file_offset,
                Live {
                    window: w,
                    remaining,
                },
            );
        }
        Ok(())
    }

    /// The live window covering file byte `offset`.
    pub fn find(&self, offset: u64) -> Option<&Window> {
        let (_, l) = self.by_offset.range(..=offset).next_back()?;
        (offset < l.window.end()).then_some(&l.window)
    }

    /// One block at `offset` was confirmed. Returns the window's id if that
    /// was its last; the window is then no longer live.
    pub fn block_done(&mut self, offset: u64) -> Option<u64> {
        let (&start, l) = self.by_offset.range_mut(..=offset).next_back()?;
        if offset >= l.window.end() {
            return None;
        }
        l.remaining -= 1;
        if l.remaining > 0 {
            return None;
        }
        let id = l.window.id;
        self.by_offset.remove(&start);
        self.by_id.remove(&id);
        Some(id)
    }

    /// The live window with this id.
    pub fn get(&self, id: u64) -> Option<&Window> {
        let off = self.by_id.get(&id)?;
        self.by_offset.get(off).map(|l| &l.window)
    }

    /// Number of live windows.
    pub fn len(&self) -> usize {
        self.by_offset.len()
    }

    /// No live window.
    pub fn is_empty(&self) -> bool {
        self.by_offset.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: u64 = 4096;

    fn win(id: u64, file_offset: u64, len: u64) -> Window {
        Window {
            id,
            remote_addr: 0x10_0000 + file_offset,
            rkey: 7,
            len,
            file_offset,
            epoch: 0,
        }
    }

    fn windows(file_len: u64) -> Windows {
        Windows::new(BlockPlan::new(file_len, BS).unwrap())
    }

    #[test]
    fn rejects_malformed() {
        let ws = windows(10 * BS + 10);
        assert_eq!(
            ws.validate(&win(1, 0, 0)),
            Err(WindowError::Empty { id: 1 })
        );
        assert_eq!(
            ws.validate(&win(1, 100, BS)),
            Err(WindowError::Misaligned {
                id: 1,
                file_offset: 100,
                block_size: BS
            })
        );
        assert_eq!(
            ws.validate(&win(1, 0, BS + 1)),
            Err(WindowError::RaggedEnd {
                id: 1,
                end: BS + 1,
                block_size: BS
            })
        );
        assert_eq!(
            ws.validate(&win(1, 10 * BS, 2 * BS)),
            Err(WindowError::OutOfFile {
                id: 1,
                end: 12 * BS,
                file_len: 10 * BS + 10
            })
        );
        assert!(matches!(
            ws.validate(&win(1, BS, u64::MAX - 10)),
            Err(WindowError::OutOfFile { .. })
        ));
        let mut w = win(1, 0, BS);
        w.remote_addr = u64::MAX - 1;
        assert_eq!(ws.validate(&w), Err(WindowError::AddressOverflow { id: 1 }));
        // Ending at the file's end, or at the end of its short last block, is fine.
        assert!(ws.validate(&win(1, 10 * BS, 10)).is_ok());
        assert!(ws.validate(&win(1, 10 * BS, BS)).is_ok());
        assert!(ws.validate(&win(1, 0, 11 * BS)).is_ok());
    }

    #[test]
    fn rejects_overlap_and_duplicate_id() {
        let mut ws = windows(100 * BS);
        ws.insert(win(1, 10 * BS, 10 * BS), 10).unwrap();
        assert_eq!(
            ws.validate(&win(2, 5 * BS, 6 * BS)),
            Err(WindowError::Overlap { id: 2, other: 1 })
        );
        assert_eq!(
            ws.validate(&win(2, 19 * BS, 5 * BS)),
            Err(WindowError::Overlap { id: 2, other: 1 })
        );
        assert_eq!(
            ws.validate(&win(2, 0, 50 * BS)),
            Err(WindowError::Overlap { id: 2, other: 1 })
        );
        assert_eq!(
            ws.validate(&win(2, 12 * BS, BS)),
            Err(WindowError::Overlap { id: 2, other: 1 })
        );
        assert_eq!(
            ws.validate(&win(1, 50 * BS, BS)),
            Err(WindowError::DuplicateId { id: 1 })
        );
        // Adjacent on both sides is fine.
        ws.insert(win(2, 0, 10 * BS), 10).unwrap();
        ws.insert(win(3, 20 * BS, BS), 1).unwrap();
        assert_eq!(ws.len(), 3);
    }

    #[test]
    fn maps_blocks_and_counts_down() {
        let plan = BlockPlan::new(4 * BS + 5, BS).unwrap();
        let mut ws = Windows::new(plan);
        let w = win(9, 2 * BS, 3 * BS);
        assert_eq!(w.blocks(&plan), 2..5);
        ws.insert(w, 3).unwrap();
        let b = plan.block(4).unwrap();
        let found = *ws.find(b.file_offset).unwrap();
        assert_eq!(found.remote_for(&b).addr, w.remote_addr + 2 * BS);
        assert_eq!(found.remote_for(&b).rkey, 7);
        assert!(ws.find(BS).is_none());
        assert_eq!(ws.block_done(2 * BS), None);
        assert_eq!(ws.block_done(3 * BS), None);
        assert_eq!(ws.block_done(4 * BS), Some(9));
        assert!(ws.is_empty());
        assert!(ws.get(9).is_none());
        // The range is free again.
        assert!(ws.validate(&win(10, 2 * BS, BS)).is_ok());
    }
}
