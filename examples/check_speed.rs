//! How fast each candidate block check hashes 1 MiB blocks on one core:
//! BLAKE3 (blake3, its SIMD back end chosen at run time), SHA-256 (sha2,
//! SHA-NI when the CPU has it), xxh3-128 (xxhash-rust) and CRC32C (crc32c,
//! SSE4.2). `cargo run --release --example check_speed`;
//! prints GB/s per check, the median of 7 rounds, per second of wall time
//! and per second of the thread's CPU time (which a loaded host's other
//! processes do not take; add `--features blake3/pure` to compare BLAKE3's
//! Rust-intrinsics back ends with its assembly).

use std::time::{Duration, Instant};

/// CPU time of the calling thread so far (user + system).
fn thread_cpu() -> Duration {
    use nix::sys::resource::{getrusage, UsageWho};
    let u = getrusage(UsageWho::RUSAGE_THREAD).expect("getrusage");
    let us = |t: nix::sys::time::TimeVal| t.tv_sec() as u64 * 1_000_000 + t.tv_usec() as u64;
    Duration::from_micros(us(u.user_time()) + us(u.system_time()))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let block: Vec<u8> = (0..1 << 20).map(|i| (i * 7 + i / 3) as u8).collect();
    let rounds = 7;
    let per_round = 512; // 512 MiB per round
    let run = |name: &str, f: &dyn Fn(&[u8]) -> u64| {
        let (mut gbps, mut per_cpu) = (Vec::new(), Vec::new());
        let mut sink = 0u64;
        let bytes = per_round as f64 * (1 << 20) as f64;
        for _ in 0..rounds {
            let (t, c) = (Instant::now(), thread_cpu());
            for _ in 0..per_round {
                sink = sink.wrapping_add(f(&block));
            }
            let cpu = (thread_cpu() - c).as_secs_f64().max(1e-6);
            gbps.push(bytes / t.elapsed().as_secs_f64() / 1e9);
            per_cpu.push(bytes / cpu / 1e9);
        }
        println!(
            "{name:10} {:6.2} GB/s per core, {:6.2} GB/s per CPU second (medians of {rounds}; sink {sink:x})",
            median(gbps),
            median(per_cpu)
        );
    };
    run("blake3", &|b| u64::from(blake3::hash(b).as_bytes()[0]));
    run("sha256", &|b| {
        use sha2::Digest;
        let d = sha2::Sha256::digest(b);
        u64::from(d[0])
    });
    run("xxh3-128", &|b| xxhash_rust::xxh3::xxh3_128(b) as u64);
    run("crc32c", &|b| u64::from(crc32c::crc32c(b)));
}
