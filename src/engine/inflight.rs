//! The retirement rule for one reliable-connected send queue.
//!
//! An RC queue completes requests in post order. A successful *signaled*
//! completion for `X` therefore retires `X` and every earlier unsignaled
//! request on the same queue. An error completion is reported even for an
//! unsignaled request, so the error path retires (as unconfirmed) everything
//! up to and including the failed request the same way. [`InFlight`] keeps the
//! outstanding `wr_id`s in post order so either costs O(requests retired).

use std::collections::VecDeque;

use super::slots::WrId;

/// Outstanding requests of one send queue, oldest first.
#[derive(Clone, Debug, Default)]
pub struct InFlight {
    queue: VecDeque<WrId>,
}

impl InFlight {
    /// An empty queue with room for `depth` requests.
    pub fn with_capacity(depth: usize) -> Self {
        InFlight {
            queue: VecDeque::with_capacity(depth),
        }
    }

    /// Record a request as posted (after every earlier one).
    pub fn push(&mut self, id: WrId) {
        self.queue.push_back(id);
    }

    /// Remove and return `id` and every request posted before it, oldest
    /// first. `None` (and nothing removed) if `id` is not outstanding.
    pub fn retire_through(
        &mut self,
        id: WrId,
    ) -> Option<std::collections::vec_deque::Drain<'_, WrId>> {
        let k = self.queue.iter().position(|&x| x == id)?;
        Some(self.queue.drain(..=k))
    }

    /// Remove the newest request if it is `id` (undoing a post that failed).
    pub fn pop_newest_if(&mut self, id: WrId) -> bool {
        if self.queue.back() == Some(&id) {
            self.queue.pop_back();
            true
        } else {
            false
        }
    }

    /// Remove and return everything outstanding, oldest first.
    pub fn drain_all(&mut self) -> std::collections::vec_deque::Drain<'_, WrId> {
        self.queue.drain(..)
    }

    /// The outstanding requests, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = WrId> + '_ {
        self.queue.iter().copied()
    }

    /// Oldest outstanding request.
    pub fn oldest(&self) -> Option<WrId> {
        self.queue.front().copied()
    }

    /// Newest outstanding request.
    pub fn newest(&self) -> Option<WrId> {
        self.queue.back().copied()
    }

    /// Number outstanding.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Nothing outstanding.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u64) -> Vec<WrId> {
        (0..n).map(WrId).collect()
    }

    #[test]
    fn signaled_retires_earlier_unsignaled() {
        let mut q = InFlight::default();
        for id in ids(6) {
            q.push(id);
        }
        let r: Vec<WrId> = q.retire_through(WrId(3)).unwrap().collect();
        assert_eq!(r, ids(4));
        assert_eq!(q.len(), 2);
        assert_eq!(q.oldest(), Some(WrId(4)));
    }

    #[test]
    fn unknown_id_retires_nothing() {
        let mut q = InFlight::default();
        for id in ids(3) {
            q.push(id);
        }
        assert!(q.retire_through(WrId(99)).is_none());
        assert_eq!(q.len(), 3);
        q.retire_through(WrId(0)).unwrap();
        assert!(q.retire_through(WrId(0)).is_none(), "retired once only");
    }

    #[test]
    fn undo_newest_and_drain() {
        let mut q = InFlight::default();
        for id in ids(3) {
            q.push(id);
        }
        assert!(!q.pop_newest_if(WrId(1)));
        assert!(q.pop_newest_if(WrId(2)));
        assert_eq!(q.newest(), Some(WrId(1)));
        let rest: Vec<WrId> = q.drain_all().collect();
        assert_eq!(rest, ids(2));
        assert!(q.is_empty());
    }
}
