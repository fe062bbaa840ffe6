//! The per-file cost of the receiving side for small files, to count with strace:
//! `create -> write_block -> commit` (or `seal`, then one `publish` of them all)
//! for N files of 16 KiB, resumable as rcpd makes them.
//!
//! ```text
//! cargo build --release --example small_file_syscalls
//! for n in 0 100; do rm -rf /tmp/out && mkdir /tmp/out
//!   strace -f -c -o /tmp/st-$n target/release/examples/small_file_syscalls /tmp/out $n [batch]
//! done   # (calls at 100 - calls at 0) / 100 = syscalls per file
//! ```

use rcp::files::{
    block_digest, file_digest, publish, Destination, DestinationOptions, DirHandle, SourceId,
    Timestamp, DEFAULT_BLOCK_SIZE,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(dir), Some(n)) = (args.first(), args.get(1)) else {
        eprintln!("usage: small_file_syscalls DIR N [batch]");
        std::process::exit(2);
    };
    let n: usize = n.parse()?;
    let batch = args.get(2).is_some_and(|a| a == "batch");
    let dir = DirHandle::open(dir)?;
    let data = vec![7u8; 16 << 10];
    let len = data.len() as u64;
    let bd = block_digest(&data);
    let derived = file_digest(len, DEFAULT_BLOCK_SIZE, [&bd]);
    let opts = DestinationOptions {
        resume: Some(SourceId {
            len,
            mtime: Timestamp::default(),
            fingerprint: [1; 32],
        }),
        ..Default::default()
    };
    let mut sealed = Vec::new();
    for i in 0..n {
        let mut d = Destination::create(&dir, format!("f{i}"), len, opts.clone())?;
        d.write_block(0, &data, bd)?;
        if batch {
            sealed.push(d.seal(derived)?);
        } else {
            d.commit(derived)?;
        }
    }
    for r in publish(sealed) {
        r?;
    }
    Ok(())
}
