//! Send-queue credits: back-pressure instead of `ENOMEM`.
//!
//! One credit is one send-queue slot. The poster takes credits before it
//! builds a chain and never posts more requests than it holds, so a full ring
//! is never hit. A credit comes back when its request is *retired* (by its own
//! signaled completion or a later one on the same queue), or all at once when
//! the queue pair is replaced ([`Credits::reset`]).

use std::fmt;

/// Credits returned that were never taken. The counter saturates at its
/// depth; this reports the excess so the caller can log the bug.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverReturn {
    /// How many credits the caller tried to give back.
    pub returned: usize,
    /// How many were actually in use.
    pub in_use: usize,
}

impl fmt::Display for OverReturn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} credits returned but only {} in use",
            self.returned, self.in_use
        )
    }
}

impl std::error::Error for OverReturn {}

/// A counter of free send-queue slots, `0..=depth`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credits {
    depth: usize,
    available: usize,
}

impl Credits {
    /// All `depth` credits available.
    pub fn new(depth: usize) -> Self {
        Credits {
            depth,
            available: depth,
        }
    }

    /// Take up to `n` credits; returns how many were taken (maybe 0).
    pub fn try_take(&mut self, n: usize) -> usize {
        let k = n.min(self.available);
        self.available -= k;
        k
    }

    /// Give back `n` credits. Giving back more than are in use is a bug: the
    /// counter saturates at `depth` and the excess is reported.
    pub fn give(&mut self, n: usize) -> Result<(), OverReturn> {
        let in_use = self.in_use();
        if n > in_use {
            self.available = self.depth;
            return Err(OverReturn {
                returned: n,
                in_use,
            });
        }
        self.available += n;
        Ok(())
    }

    /// Credits free to take.
    pub fn available(&self) -> usize {
        self.available
    }

    /// Credits taken and not yet given back.
    pub fn in_use(&self) -> usize {
        self.depth - self.available
    }

    /// The send-queue depth this counter was sized to.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// All credits free again (the queue pair was replaced: none of the old
    /// requests occupy a slot any more).
    pub fn reset(&mut self) {
        self.available = self.depth;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_is_bounded_by_available() {
        let mut c = Credits::new(4);
        assert_eq!(c.try_take(3), 3);
        assert_eq!(c.try_take(3), 1);
        assert_eq!(c.try_take(1), 0);
        assert_eq!(c.available(), 0);
        assert_eq!(c.in_use(), 4);
        c.give(2).unwrap();
        assert_eq!(c.available(), 2);
        assert_eq!(c.in_use(), 2);
    }

    #[test]
    fn over_return_saturates_and_reports() {
        let mut c = Credits::new(8);
        c.try_take(2);
        assert_eq!(
            c.give(3),
            Err(OverReturn {
                returned: 3,
                in_use: 2
            })
        );
        assert_eq!(c.available(), 8);
        assert_eq!(c.in_use(), 0);
        assert!(c.give(1).is_err());
        assert_eq!(c.available(), 8);
    }

    #[test]
    fn reset_frees_everything() {
        let mut c = Credits::new(16);
        c.try_take(16);
        c.reset();
        assert_eq!(c.available(), 16);
        assert_eq!(c.depth(), 16);
    }
}
