//! The tests' pseudo-random bytes: xorshift64 of a seed, 8 bytes at a
//! time. Every rig writes and checks its data with this one stream.

/// The pattern of a seed, as a stream.
pub struct Pattern(u64);

impl Pattern {
    pub fn new(seed: u64) -> Self {
        Pattern(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next `b.len()` bytes of the stream (calls of a multiple of 8
    /// bytes each continue it without a seam).
    pub fn fill(&mut self, b: &mut [u8]) {
        let x = &mut self.0;
        for c in b.chunks_mut(8) {
            *x ^= *x << 13;
            *x ^= *x >> 7;
            *x ^= *x << 17;
            c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
        }
    }
}

/// The pattern of `seed` over `b`.
pub fn pattern_into(b: &mut [u8], seed: u64) {
    Pattern::new(seed).fill(b);
}

/// `len` bytes of the pattern of `seed`.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    pattern_into(&mut v, seed);
    v
}
