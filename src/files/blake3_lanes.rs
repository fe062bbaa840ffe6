//! BLAKE3 of many small inputs side by side.
//!
//! `blake3::hash` hashes one input's chunks (1 KiB each) in parallel SIMD
//! lanes, so a 4 KiB input fills 4 of AVX-512's 16 lanes and a batch of
//! 4 KiB buffer operations leaves most of the vector unit idle. BLAKE3's
//! tree makes chunk `c` of one input and chunk `c` of another the same
//! compression with the same counter, so [`hash_each`] hashes chunk `c` of
//! every input of one length in one call of the crate's own SIMD kernels,
//! then their parents the same way, level by level. The result is
//! `blake3::hash` of each input, bit for bit (tested against it).
//!
//! Only inputs of 1, 2, 4 or 8 whole chunks take that path (a balanced
//! tree: every level pairs neighbours), when at least two share a length;
//! every other input is hashed alone with `blake3::hash`. Larger inputs
//! fill the lanes by themselves.
//!
//! The kernels are reached through `blake3::platform`, which the crate
//! marks unstable; Cargo.toml pins the version for that reason.

use blake3::platform::Platform;
use blake3::IncrementCounter;

/// BLAKE3's IV (the spec's, the same as SHA-256's initial hash).
const IV: [u32; 8] = [
    0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19,
];
// The spec's domain flags.
const CHUNK_START: u8 = 1 << 0;
const CHUNK_END: u8 = 1 << 1;
const PARENT: u8 = 1 << 2;
const ROOT: u8 = 1 << 3;

const CHUNK: usize = blake3::CHUNK_LEN;
/// The largest input taken side by side, in chunks: 8 KiB (at 16 KiB one
/// input fills AVX-512's lanes alone).
const MAX_CHUNKS: usize = 8;

/// `blake3::hash` of each of `inputs`, in their order.
pub fn hash_each(inputs: &[&[u8]]) -> Vec<[u8; 32]> {
    let mut out = vec![[0u8; 32]; inputs.len()];
    // Inputs by their number of chunks (1, 2, 4, 8: index log2).
    let mut by_size: [Vec<usize>; 4] = Default::default();
    for (i, x) in inputs.iter().enumerate() {
        match lane_class(x.len()) {
            Some(k) => by_size[k].push(i),
            None => out[i] = *blake3::hash(x).as_bytes(),
        }
    }
    let platform = Platform::detect();
    for (k, idx) in by_size.iter().enumerate() {
        match idx.as_slice() {
            [] => {}
            [i] => out[*i] = *blake3::hash(inputs[*i]).as_bytes(),
            _ => {
                let group: Vec<&[u8]> = idx.iter().map(|&i| inputs[i]).collect();
                let hashes = side_by_side(platform, &group, 1 << k);
                for (&i, h) in idx.iter().zip(hashes) {
                    out[i] = h;
                }
            }
        }
    }
    out
}

/// log2 of `len`'s chunks when it is 1, 2, 4 or 8 whole chunks.
fn lane_class(len: usize) -> Option<usize> {
    let chunks = len / CHUNK;
    (len % CHUNK == 0 && chunks.is_power_of_two() && chunks <= MAX_CHUNKS)
        .then(|| chunks.trailing_zeros() as usize)
}

/// The hashes of `inputs`, each exactly `chunks` (a power of two) chunks
/// long.
fn side_by_side(platform: Platform, inputs: &[&[u8]], chunks: usize) -> Vec<[u8; 32]> {
    let n = inputs.len();
    // Level 0: chunk c of input i at cvs[(c * n + i) * 32..]; a lone chunk
    // is its own root.
    let root = if chunks == 1 { ROOT } else { 0 };
    let mut cvs = vec![0u8; chunks * n * 32];
    let mut blocks: Vec<&[u8; CHUNK]> = Vec::with_capacity(n);
    for (c, out) in cvs.chunks_exact_mut(n * 32).enumerate() {
        blocks.clear();
        blocks.extend(inputs.iter().map(|x| {
            <&[u8; CHUNK]>::try_from(&x[c * CHUNK..(c + 1) * CHUNK]).expect("a whole chunk")
        }));
        platform.hash_many(
            &blocks,
            &IV,
            c as u64,
            IncrementCounter::No,
            0,
            CHUNK_START,
            CHUNK_END | root,
            out,
        );
    }
    // Each level pairs neighbours: parent p of input i from children 2p
    // and 2p + 1; the last level's one parent is the root.
    let mut width = chunks;
    while width > 1 {
        let half = width / 2;
        let mut parents = vec![[0u8; 64]; half * n];
        for (p, row) in parents.chunks_exact_mut(n).enumerate() {
            for (i, block) in row.iter_mut().enumerate() {
                let left = (2 * p * n + i) * 32;
                let right = ((2 * p + 1) * n + i) * 32;
                block[..32].copy_from_slice(&cvs[left..left + 32]);
                block[32..].copy_from_slice(&cvs[right..right + 32]);
            }
        }
        let refs: Vec<&[u8; 64]> = parents.iter().collect();
        let flags = if half == 1 { PARENT | ROOT } else { PARENT };
        let mut next = vec![0u8; half * n * 32];
        platform.hash_many(&refs, &IV, 0, IncrementCounter::No, flags, 0, 0, &mut next);
        cvs = next;
        width = half;
    }
    // A root's first 32 output bytes are its chaining value.
    cvs.chunks_exact(32)
        .map(|h| h.try_into().expect("32 bytes"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(seed: usize, len: usize) -> Vec<u8> {
        (0..len)
            .map(|j| (seed.wrapping_mul(31) ^ j.wrapping_mul(7) ^ (j >> 8)) as u8)
            .collect()
    }

    #[test]
    fn each_hash_is_blake3s_whatever_the_mix_of_lengths() {
        // Side by side (1-8 chunks, many of a length), alone (one of its
        // length, or not whole chunks, or larger), empty, in any order.
        let lens = [
            4096, 1024, 4096, 0, 3000, 2048, 8192, 4096, 16384, 1024, 2048, 8192, 4095, 4097, 1,
            12288, 5120,
        ];
        let mut data: Vec<Vec<u8>> = lens.iter().enumerate().map(|(i, &l)| input(i, l)).collect();
        // Enough of one length for more than one SIMD pass (16 lanes).
        data.extend((0..37).map(|i| input(100 + i, 4096)));
        let inputs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let want: Vec<[u8; 32]> = inputs.iter().map(|x| *blake3::hash(x).as_bytes()).collect();
        assert_eq!(hash_each(&inputs), want);
        assert_eq!(hash_each(&[]), Vec::<[u8; 32]>::new());
    }

    #[test]
    fn only_balanced_trees_of_up_to_eight_chunks_go_side_by_side() {
        assert_eq!(lane_class(1024), Some(0));
        assert_eq!(lane_class(4096), Some(2));
        assert_eq!(lane_class(8192), Some(3));
        for len in [0, 1, 1023, 3072, 4095, 16384, 6144] {
            assert_eq!(lane_class(len), None, "{len}");
        }
    }
}
