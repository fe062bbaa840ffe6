//! The block plan: a transfer of `len` bytes cut into fixed-size blocks.
//!
//! Block `i` covers file bytes `i * block_size ..` up to `block_size` bytes;
//! the last block is shorter when `len` is not a multiple; a 0-byte transfer
//! has no blocks. [`BlockStates`] tracks each block as pending, in flight (in
//! some epoch) or done (confirmed by a successful completion) in one bit per
//! block plus a small map for the blocks in flight.

use std::collections::HashMap;
use std::fmt;

/// Smallest block size.
pub const MIN_BLOCK_SIZE: u64 = 4096;
/// Largest block size (a work request length is a `u32`).
pub const MAX_BLOCK_SIZE: u64 = 1 << 31;

/// A block size that is not a power of two in `4096..=2^31`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSizeError(pub u64);

impl fmt::Display for BlockSizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "block size {} must be a power of two in {MIN_BLOCK_SIZE}..={MAX_BLOCK_SIZE}",
            self.0
        )
    }
}

impl std::error::Error for BlockSizeError {}

/// One block: its index and the file bytes it covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockSpan {
    /// Block index.
    pub index: u64,
    /// First file byte.
    pub file_offset: u64,
    /// Bytes (`block_size`, or less for the last block).
    pub len: u32,
}

/// How a transfer is cut into blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockPlan {
    len: u64,
    block_size: u64,
}

impl BlockPlan {
    /// Plan for `len` bytes in blocks of `block_size`.
    pub fn new(len: u64, block_size: u64) -> Result<Self, BlockSizeError> {
        if !block_size.is_power_of_two() || !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&block_size)
        {
            return Err(BlockSizeError(block_size));
        }
        Ok(BlockPlan { len, block_size })
    }

    /// Number of blocks (`ceil(len / block_size)`).
    pub fn count(&self) -> u64 {
        self.len.div_ceil(self.block_size)
    }

    /// Block `index`, or `None` past the end.
    pub fn block(&self, index: u64) -> Option<BlockSpan> {
        if index >= self.count() {
            return None;
        }
        let file_offset = index * self.block_size;
        let len = (self.len - file_offset).min(self.block_size) as u32;
        Some(BlockSpan {
            index,
            file_offset,
            len,
        })
    }

    /// Index of the block holding file byte `offset`.
    pub fn block_of(&self, offset: u64) -> u64 {
        offset / self.block_size
    }

    /// Transfer length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// A 0-byte transfer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Block size in bytes.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }
}

/// State of one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Not posted (or posted in an epoch that failed before confirming it).
    Pending,
    /// Posted in `epoch`, not yet confirmed.
    InFlight {
        /// Epoch it was posted in.
        epoch: u32,
    },
    /// Confirmed by a successful completion; never posted again.
    Done,
}

/// Per-block state for a whole plan.
#[derive(Clone, Debug)]
pub struct BlockStates {
    done: Vec<u64>,
    in_flight: HashMap<u64, u32>,
    count: u64,
    done_count: u64,
}

impl BlockStates {
    /// `count` blocks, all pending.
    pub fn new(count: u64) -> Self {
        BlockStates {
            done: vec![0; count.div_ceil(64) as usize],
            in_flight: HashMap::new(),
            count,
            done_count: 0,
        }
    }

    fn is_done(&self, i: u64) -> bool {
        self.done[(i / 64) as usize] & (1 << (i % 64)) != 0
    }

    /// State of block `i`.
    pub fn get(&self, i: u64) -> BlockState {
        assert!(i < self.count, "block {i} out of range");
        if self.is_done(i) {
            BlockState::Done
        } else if let Some(&epoch) = self.in_flight.get(&i) {
            BlockState::InFlight { epoch }
        } else {
            BlockState::Pending
        }
    }

    /// Mark block `i` posted in `epoch`. Panics if it is done.
    pub fn set_in_flight(&mut self, i: u64, epoch: u32) {
        assert!(!self.is_done(i), "block {i} is done; it must not be posted");
        self.in_flight.insert(i, epoch);
    }

    /// Mark block `i` pending again (its request failed or was not posted).
    pub fn set_pending(&mut self, i: u64) {
        self.in_flight.remove(&i);
    }

    /// Mark block `i` confirmed. Returns `false` if it already was.
    pub fn set_done(&mut self, i: u64) -> bool {
        self.in_flight.remove(&i);
        if self.is_done(i) {
            return false;
        }
        self.done[(i / 64) as usize] |= 1 << (i % 64);
        self.done_count += 1;
        true
    }

    /// Blocks confirmed.
    pub fn done_count(&self) -> u64 {
        self.done_count
    }

    /// Blocks in flight.
    pub fn in_flight_count(&self) -> usize {
        self.in_flight.len()
    }

    /// Every block confirmed (true for 0 blocks).
    pub fn all_done(&self) -> bool {
        self.done_count == self.count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_block_sizes() {
        assert_eq!(BlockPlan::new(1, 4095), Err(BlockSizeError(4095)));
        assert_eq!(BlockPlan::new(1, 2048), Err(BlockSizeError(2048)));
        assert_eq!(BlockPlan::new(1, 6144), Err(BlockSizeError(6144)));
        assert_eq!(BlockPlan::new(1, 1 << 32), Err(BlockSizeError(1 << 32)));
        assert!(BlockPlan::new(1, 4096).is_ok());
        assert!(BlockPlan::new(1, 1 << 31).is_ok());
    }

    #[test]
    fn zero_and_one_byte() {
        let z = BlockPlan::new(0, 4096).unwrap();
        assert_eq!(z.count(), 0);
        assert!(z.block(0).is_none());
        assert!(BlockStates::new(0).all_done());
        let one = BlockPlan::new(1, 4096).unwrap();
        assert_eq!(one.count(), 1);
        assert_eq!(
            one.block(0),
            Some(BlockSpan {
                index: 0,
                file_offset: 0,
                len: 1
            })
        );
    }

    #[test]
    fn last_block_is_short() {
        let p = BlockPlan::new(3 * 4096 + 100, 4096).unwrap();
        assert_eq!(p.count(), 4);
        assert_eq!(p.block(2).unwrap().len, 4096);
        assert_eq!(p.block(3).unwrap().file_offset, 3 * 4096);
        assert_eq!(p.block(3).unwrap().len, 100);
        assert_eq!(p.block_of(3 * 4096 + 99), 3);
        let exact = BlockPlan::new(2 * 8192, 8192).unwrap();
        assert_eq!(exact.count(), 2);
        assert_eq!(exact.block(1).unwrap().len, 8192);
    }

    #[test]
    fn states_move_and_count() {
        let mut s = BlockStates::new(130);
        assert_eq!(s.get(129), BlockState::Pending);
        s.set_in_flight(129, 3);
        assert_eq!(s.get(129), BlockState::InFlight { epoch: 3 });
        assert_eq!(s.in_flight_count(), 1);
        s.set_pending(129);
        assert_eq!(s.get(129), BlockState::Pending);
        s.set_in_flight(64, 1);
        assert!(s.set_done(64));
        assert!(!s.set_done(64), "confirmed once only");
        assert_eq!(s.get(64), BlockState::Done);
        assert_eq!(s.get(63), BlockState::Pending);
        assert_eq!(s.done_count(), 1);
        assert_eq!(s.in_flight_count(), 0);
        assert!(!s.all_done());
    }
}
