//! Batching and selective signaling.
//!
//! Ready requests are posted as *chains*: one `ibv_post_send` (one doorbell)
//! per chain of up to [`BatchPolicy::batch`] work requests. Only every
//! [`BatchPolicy::signal_every`]-th request of a chain asks for a completion,
//! and the last request of every chain always does, so the send queue never
//! ends in unsignaled requests that nothing would ever retire.

use std::fmt;

/// Largest chain the policy allows.
pub const MAX_BATCH: usize = 64;

/// How many work requests go into one doorbell and which of them are signaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchPolicy {
    /// Maximum chain length, `1..=64`.
    pub batch: usize,
    /// Signal every n-th request of a chain, `1..=batch`. The last request of
    /// a chain is signaled regardless.
    pub signal_every: usize,
}

/// A [`BatchPolicy`] value out of range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchPolicyError {
    /// `batch` is not in `1..=64`.
    Batch(usize),
    /// `signal_every` is not in `1..=batch`.
    SignalEvery {
        /// The rejected value.
        signal_every: usize,
        /// The chain length it must not exceed.
        batch: usize,
    },
}

impl fmt::Display for BatchPolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BatchPolicyError::Batch(b) => {
                write!(f, "batch = {b} is out of range (1..={MAX_BATCH})")
            }
            BatchPolicyError::SignalEvery {
                signal_every,
                batch,
            } => write!(
                f,
                "signal_every = {signal_every} is out of range (1..={batch}, the batch size)"
            ),
        }
    }
}

impl std::error::Error for BatchPolicyError {}

impl Default for BatchPolicy {
    /// Chains of 32, only the last of each signaled.
    fn default() -> Self {
        BatchPolicy {
            batch: 32,
            signal_every: 32,
        }
    }
}

impl BatchPolicy {
    /// A validated policy.
    pub fn new(batch: usize, signal_every: usize) -> Result<Self, BatchPolicyError> {
        let p = BatchPolicy {
            batch,
            signal_every,
        };
        p.validate()?;
        Ok(p)
    }

    /// A validated policy that signals only the last request of each chain.
    pub fn with_batch(batch: usize) -> Result<Self, BatchPolicyError> {
        Self::new(batch, batch)
    }

    /// Check both fields are in range.
    pub fn validate(&self) -> Result<(), BatchPolicyError> {
        if !(1..=MAX_BATCH).contains(&self.batch) {
            return Err(BatchPolicyError::Batch(self.batch));
        }
        if !(1..=self.batch).contains(&self.signal_every) {
            return Err(BatchPolicyError::SignalEvery {
                signal_every: self.signal_every,
                batch: self.batch,
            });
        }
        Ok(())
    }

    /// Length of the next chain when `ready` requests could be posted now
    /// (already limited by credits and buffers): `min(ready, batch)`.
    pub fn chain_len(&self, ready: usize) -> usize {
        ready.min(self.batch)
    }

    /// Whether the request at `index` (0-based) of a chain of `chain_len` is
    /// signaled: every `signal_every`-th, and always the last.
    pub fn is_signaled(&self, index: usize, chain_len: usize) -> bool {
        debug_assert!(index < chain_len);
        (index + 1) % self.signal_every == 0 || index + 1 == chain_len
    }

    /// The signaled flags of a chain of `chain_len` requests, in order.
    pub fn signals(&self, chain_len: usize) -> impl Iterator<Item = bool> + '_ {
        (0..chain_len).map(move |i| self.is_signaled(i, chain_len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_32_signal_last() {
        let p = BatchPolicy::default();
        assert_eq!(p, BatchPolicy::new(32, 32).unwrap());
        assert_eq!(p.chain_len(100), 32);
        let s: Vec<bool> = p.signals(32).collect();
        assert_eq!(s.iter().filter(|&&b| b).count(), 1);
        assert!(s[31]);
    }

    #[test]
    fn short_chain_signals_its_last() {
        let p = BatchPolicy::default();
        assert_eq!(p.chain_len(5), 5);
        let s: Vec<bool> = p.signals(5).collect();
        assert_eq!(s, vec![false, false, false, false, true]);
    }

    #[test]
    fn every_nth_and_last() {
        let p = BatchPolicy::new(10, 4).unwrap();
        let signaled: Vec<usize> = p
            .signals(10)
            .enumerate()
            .filter(|(_, s)| *s)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(signaled, vec![3, 7, 9]);
        let all = BatchPolicy::new(3, 1).unwrap();
        assert!(all.signals(3).all(|s| s));
    }

    #[test]
    fn validation_names_the_bad_value() {
        assert_eq!(BatchPolicy::new(0, 1), Err(BatchPolicyError::Batch(0)));
        assert_eq!(BatchPolicy::new(65, 1), Err(BatchPolicyError::Batch(65)));
        assert_eq!(
            BatchPolicy::new(8, 9),
            Err(BatchPolicyError::SignalEvery {
                signal_every: 9,
                batch: 8
            })
        );
        assert!(BatchPolicy::new(8, 0).is_err());
        assert!(BatchPolicy::new(64, 64).is_ok());
        let msg = BatchPolicy::new(65, 1).unwrap_err().to_string();
        assert!(msg.contains("65"), "{msg}");
    }
}
