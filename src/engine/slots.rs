//! Work-request context slots, addressed by `wr_id`.
//!
//! A fixed array (one slot per send-queue entry) with an O(1) free list. The
//! `wr_id` handed to the device is a [`WrId`]: slot index, the slot's
//! generation (bumped on every allocation) and the queue-pair epoch. A
//! completion whose `wr_id` names a free slot, a slot since reused, or an
//! older epoch is *stale*: it is rejected, never credited to the new work.

use std::fmt;

/// Largest slot array (the index has 16 bits in a [`WrId`]).
pub const MAX_SLOTS: usize = 1 << 16;

/// A `wr_id`: `epoch` (low 16 bits) << 48 | `generation` << 16 | `index`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WrId(pub u64);

impl WrId {
    fn new(epoch: u32, generation: u32, index: usize) -> Self {
        debug_assert!(index < MAX_SLOTS);
        WrId(((epoch as u64 & 0xffff) << 48) | ((generation as u64) << 16) | index as u64)
    }

    /// Slot index.
    pub fn index(self) -> usize {
        (self.0 & 0xffff) as usize
    }

    /// Generation of the slot when this id was issued.
    pub fn generation(self) -> u32 {
        (self.0 >> 16) as u32
    }

    /// Low 16 bits of the epoch the id was issued in.
    pub fn epoch_bits(self) -> u16 {
        (self.0 >> 48) as u16
    }
}

impl fmt::Display for WrId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "wr {}#{}@{}",
            self.index(),
            self.generation(),
            self.epoch_bits()
        )
    }
}

/// Why a `wr_id` does not name live work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stale {
    /// Issued in another epoch (a completion from a replaced queue pair).
    OldEpoch,
    /// The slot is free, or was reused since (generation differs), or the
    /// index is out of range.
    Reused,
}

impl fmt::Display for Stale {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stale::OldEpoch => f.write_str("wr_id from an older epoch"),
            Stale::Reused => f.write_str("wr_id names a free or reused slot"),
        }
    }
}

impl std::error::Error for Stale {}

/// What a live slot holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot<T> {
    /// The caller's context.
    pub user: T,
    /// When the request was posted (caller's clock, nanoseconds).
    pub posted_at: u64,
    /// Whether the request asked for a completion.
    pub signaled: bool,
}

#[derive(Debug)]
struct Entry<T> {
    generation: u32,
    slot: Option<Slot<T>>,
}

/// Fixed-capacity slot array indexed by [`WrId`].
#[derive(Debug)]
pub struct Slots<T> {
    entries: Vec<Entry<T>>,
    free: Vec<u16>,
    epoch: u32,
}

impl<T> Slots<T> {
    /// `capacity` slots (`1..=65536`), all free, in `epoch`.
    pub fn new(capacity: usize, epoch: u32) -> Self {
        assert!(
            (1..=MAX_SLOTS).contains(&capacity),
            "slot capacity {capacity} out of range"
        );
        let entries = (0..capacity)
            .map(|_| Entry {
                generation: 0,
                slot: None,
            })
            .collect();
        let mut s = Slots {
            entries,
            free: Vec::with_capacity(capacity),
            epoch,
        };
        s.refill_free_list();
        s
    }

    fn refill_free_list(&mut self) {
        self.free.clear();
        // Pop order is ascending index: slot 0 first.
        self.free
            .extend((0..self.entries.len() as u32).rev().map(|i| i as u16));
    }

    /// Store a context; `None` when every slot is in use.
    pub fn alloc(&mut self, user: T, posted_at: u64, signaled: bool) -> Option<WrId> {
        let index = self.free.pop()? as usize;
        let e = &mut self.entries[index];
        debug_assert!(e.slot.is_none());
        e.generation = e.generation.wrapping_add(1);
        e.slot = Some(Slot {
            user,
            posted_at,
            signaled,
        });
        Some(WrId::new(self.epoch, e.generation, index))
    }

    fn check(&self, id: WrId) -> Result<usize, Stale> {
        if id.epoch_bits() != self.epoch as u16 {
            return Err(Stale::OldEpoch);
        }
        let i = id.index();
        match self.entries.get(i) {
            Some(e) if e.generation == id.generation() && e.slot.is_some() => Ok(i),
            _ => Err(Stale::Reused),
        }
    }

    /// The live context `id` names.
    pub fn get(&self, id: WrId) -> Result<&Slot<T>, Stale> {
        let i = self.check(id)?;
        Ok(self.entries[i].slot.as_ref().expect("checked live"))
    }

    /// Free the slot `id` names and hand back its context.
    pub fn free(&mut self, id: WrId) -> Result<Slot<T>, Stale> {
        let i = self.check(id)?;
        self.free.push(i as u16);
        Ok(self.entries[i].slot.take().expect("checked live"))
    }

    /// Ids of live requests posted at least `timeout` ago (`posted_at +
    /// timeout <= now`), oldest first. They stay allocated: the caller frees
    /// them (and logs them).
    pub fn expired(&self, now: u64, timeout: u64) -> Vec<WrId> {
        let mut out: Vec<(u64, WrId)> = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let s = e.slot.as_ref()?;
                (s.posted_at.saturating_add(timeout) <= now)
                    .then(|| (s.posted_at, WrId::new(self.epoch, e.generation, i)))
            })
            .collect();
        out.sort_unstable();
        out.into_iter().map(|(_, id)| id).collect()
    }

    /// Start `epoch`: every slot is freed (the contexts are returned, in
    /// index order) and ids of earlier epochs are stale from now on.
    pub fn clear(&mut self, epoch: u32) -> Vec<Slot<T>> {
        self.epoch = epoch;
        let out = self
            .entries
            .iter_mut()
            .filter_map(|e| e.slot.take())
            .collect();
        self.refill_free_list();
        out
    }

    /// Live slots.
    pub fn len(&self) -> usize {
        self.entries.len() - self.free.len()
    }

    /// No live slot.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Total slots.
    pub fn capacity(&self) -> usize {
        self.entries.len()
    }

    /// Current epoch.
    pub fn epoch(&self) -> u32 {
        self.epoch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_until_full_then_free() {
        let mut s = Slots::new(3, 1);
        let a = s.alloc("a", 0, false).unwrap();
        let b = s.alloc("b", 0, true).unwrap();
        let c = s.alloc("c", 0, false).unwrap();
        assert!(s.alloc("d", 0, false).is_none());
        assert_eq!(s.len(), 3);
        assert_eq!(s.get(b).unwrap().user, "b");
        assert!(s.get(b).unwrap().signaled);
        assert_eq!(s.free(a).unwrap().user, "a");
        assert_eq!(s.free(c).unwrap().user, "c");
        assert_eq!(s.len(), 1);
        assert_eq!(s.capacity(), 3);
    }

    #[test]
    fn reused_slot_rejects_old_id() {
        let mut s = Slots::new(1, 0);
        let old = s.alloc(1u32, 0, true).unwrap();
        s.free(old).unwrap();
        assert_eq!(s.free(old), Err(Stale::Reused), "double free rejected");
        let new = s.alloc(2u32, 0, true).unwrap();
        assert_eq!(old.index(), new.index());
        assert_ne!(old, new);
        assert_eq!(s.get(old), Err(Stale::Reused));
        assert_eq!(s.free(old), Err(Stale::Reused));
        assert_eq!(s.get(new).unwrap().user, 2);
    }

    #[test]
    fn old_epoch_rejected_after_clear() {
        let mut s = Slots::new(4, 7);
        let a = s.alloc('a', 0, true).unwrap();
        let _b = s.alloc('b', 0, true).unwrap();
        let drained = s.clear(8);
        assert_eq!(drained.len(), 2);
        assert!(s.is_empty());
        let fresh = s.alloc('c', 0, true).unwrap();
        assert_eq!(fresh.index(), a.index());
        assert_eq!(s.get(a), Err(Stale::OldEpoch));
        assert_eq!(fresh.epoch_bits(), 8);
        assert_eq!(s.get(WrId(u64::MAX)), Err(Stale::OldEpoch));
        assert_eq!(s.get(WrId::new(8, 1, 3)), Err(Stale::Reused));
    }

    #[test]
    fn expired_lists_old_requests_oldest_first() {
        let mut s = Slots::new(8, 0);
        let late = s.alloc((), 500, true).unwrap();
        let early = s.alloc((), 100, false).unwrap();
        let _fresh = s.alloc((), 900, true).unwrap();
        assert!(s.expired(599, 1000).is_empty());
        assert_eq!(s.expired(1100, 1000), vec![early]);
        assert_eq!(s.expired(1500, 1000), vec![early, late]);
        // Expiry does not free; the caller does.
        assert_eq!(s.len(), 3);
        s.free(early).unwrap();
        assert_eq!(s.expired(1500, 1000), vec![late]);
    }

    #[test]
    fn wr_id_round_trips_fields() {
        let id = WrId::new(0x1_2345, 0xdead_beef, 0xfffe);
        assert_eq!(id.index(), 0xfffe);
        assert_eq!(id.generation(), 0xdead_beef);
        assert_eq!(id.epoch_bits(), 0x2345);
    }
}
