//! The floor of a small-file copy: the CPU a tree of files costs the file
//! system alone, with no network, no check and no threads, against which
//! rcp's (and rsync's) CPU per file is read.
//!
//! For every regular file under SRC (walked first, not timed):
//! - read side: open, fstat, one pread of the whole file (at most 1 MiB)
//!   into a buffer every file reuses, close;
//! - write side, `bare`: create a temp name exclusively beside the final
//!   one, one pwrite (of the buffer, whatever the last file read left in
//!   it), rename it into place, close (what any tool that never
//!   shows a partial file does, without fsync: tmpfs is the case measured);
//! - write side, `rcp`: the same through `rcp::files` as rcpd does it
//!   ([`Destination::create`], `write_block`, `seal`, one [`publish`] per
//!   256 files), the block digest given, not computed.
//!
//! Directories are opened once each. CPU is this process's user + system
//! time (`getrusage`), per file.
//!
//! ```text
//! cargo run --release --example file_floor -- SRC DST [bare|rcp]
//! ```

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rcp::files::{
    block_digest, file_digest, publish, Destination, DestinationOptions, DirHandle,
    DEFAULT_BLOCK_SIZE,
};

fn cpu_seconds() -> f64 {
    let u = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
        .expect("getrusage");
    let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
    t(u.user_time()) + t(u.system_time())
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let t = e.file_type()?;
        if t.is_dir() {
            walk(&e.path(), out)?;
        } else if t.is_file() {
            out.push(e.path());
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(src), Some(dst)) = (args.first(), args.get(1)) else {
        eprintln!("usage: file_floor SRC DST [bare|rcp]");
        std::process::exit(2);
    };
    let through_rcp = match args.get(2).map(String::as_str) {
        None | Some("bare") => false,
        Some("rcp") => true,
        Some(m) => return Err(format!("unknown mode {m}: bare or rcp").into()),
    };
    let (src, dst) = (Path::new(src), Path::new(dst));
    let mut files = Vec::new();
    walk(src, &mut files)?;
    files.sort();
    let n = files.len().max(1) as f64;
    // The destination's directories, made and opened before the clock starts.
    let mut dirs = HashMap::new();
    for f in &files {
        let parent = dst.join(f.parent().unwrap().strip_prefix(src)?);
        if !dirs.contains_key(&parent) {
            std::fs::create_dir_all(&parent)?;
            dirs.insert(parent.clone(), DirHandle::open(&parent)?);
        }
    }

    // One buffer for every file, as a copy reuses its window slots (a
    // fresh allocation per file would add its page faults to the floor).
    let mut buf = vec![0u8; 1 << 20];
    let mut lens = Vec::with_capacity(files.len());
    let c0 = cpu_seconds();
    for f in &files {
        let file = std::fs::File::open(f)?;
        let len = file.metadata()?.len() as usize;
        file.read_exact_at(&mut buf[..len], 0)?;
        lens.push(len);
    }
    let c1 = cpu_seconds();
    // The block digest as a copy has it on arrival: given, not computed
    // here (the check's cost is not the file system's).
    let bd = block_digest(&[]);
    let mut sealed = Vec::new();
    for (f, &len) in files.iter().zip(&lens) {
        let buf = &buf[..len];
        let rel = f.strip_prefix(src)?;
        let parent = dst.join(rel.parent().unwrap());
        let name = rel.file_name().unwrap();
        if through_rcp {
            let len = buf.len() as u64;
            let opts = DestinationOptions::default();
            let mut d = Destination::create(&dirs[&parent], name, len, opts)?;
            d.write_block(0, buf, bd)?;
            sealed.push(d.seal(file_digest(len, DEFAULT_BLOCK_SIZE, [&bd]))?);
            if sealed.len() == 256 {
                for r in publish(std::mem::take(&mut sealed)) {
                    r?;
                }
            }
        } else {
            let fin = parent.join(name);
            let mut tmp = fin.clone().into_os_string();
            tmp.push(".part");
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&tmp)?;
            file.write_all_at(buf, 0)?;
            std::fs::rename(&tmp, &fin)?;
        }
    }
    for r in publish(sealed) {
        r?;
    }
    let c2 = cpu_seconds();
    println!(
        "{} files: read side {:.1} us/file, write side ({}) {:.1} us/file",
        files.len(),
        (c1 - c0) * 1e6 / n,
        if through_rcp { "rcp::files" } else { "bare" },
        (c2 - c1) * 1e6 / n,
    );
    Ok(())
}
