//! Which permission bits a received file gets, rsync's rule without `-p`:
//! a file that already stands at the final name keeps its own permission
//! bits when it is replaced; a new file gets the source's permission bits
//! masked by the receiver's umask (never wider than the source). `-p`
//! ([`super::Preserve`]) sets the source's bits, special ones included.
//!
//! A named temp file is created `0600` (a partial is nobody else's to
//! read) and given its final mode once, at seal. An unnamed one
//! (`super::unnamed`), which no one can open by name, is created with its
//! final mode.

use std::sync::OnceLock;

/// Permission bits only: without `-p` setuid, setgid and sticky never come
/// along (from the source, nor from the file replaced).
const PERMISSION_BITS: u32 = 0o777;

/// The mode a temp file is created with.
pub(crate) const TEMP_MODE: u32 = 0o600;

/// The mode of a received file without `-p`: the replaced file's permission
/// bits when there is one (`existing`), else `source`'s masked by `umask`.
/// `source` is `None` when the sender did not say (then `0666`, as a
/// created file gets).
pub fn received_mode(existing: Option<u32>, source: Option<u32>, umask: u32) -> u32 {
    match existing {
        Some(m) => m & PERMISSION_BITS,
        None => source.unwrap_or(0o666) & PERMISSION_BITS & !umask,
    }
}

/// The mode a copied directory is made with (`mkdir` masks it by the
/// umask): the source directory's bits `source`, plus the owner's rwx, as
/// the copy writes into it. Never wider than the source for group and
/// others (rsync's rule without `-p`).
pub fn made_dir_mode(source: u32) -> u32 {
    (source & 0o7777) | 0o700
}

/// The mode a directory asked for by a peer is made with: a copied
/// directory's bits `source` as [`made_dir_mode`] has them, or, for 0
/// (none given), `0o777`, as `mkdir -p` under the umask.
pub fn asked_dir_mode(source: u32) -> u32 {
    match source {
        0 => 0o777,
        m => made_dir_mode(m),
    }
}

/// This process's umask, read once (from `/proc/self/status`, which reads
/// it without changing it; where that is missing, `022`).
pub fn process_umask() -> u32 {
    static UMASK: OnceLock<u32> = OnceLock::new();
    *UMASK.get_or_init(|| {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| parse_umask(&s))
            .unwrap_or(0o022)
    })
}

fn parse_umask(status: &str) -> Option<u32> {
    let line = status.lines().find(|l| l.starts_with("Umask:"))?;
    u32::from_str_radix(line["Umask:".len()..].trim(), 8).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_file_gets_the_source_bits_masked() {
        assert_eq!(received_mode(None, Some(0o600), 0o022), 0o600);
        assert_eq!(received_mode(None, Some(0o755), 0o022), 0o755);
        assert_eq!(received_mode(None, Some(0o777), 0o027), 0o750);
        assert_eq!(received_mode(None, Some(0o644), 0o077), 0o600);
        assert_eq!(received_mode(None, None, 0o022), 0o644);
    }

    #[test]
    fn special_bits_never_come_along() {
        assert_eq!(received_mode(None, Some(0o4755), 0), 0o755);
        assert_eq!(received_mode(Some(0o2750), Some(0o644), 0), 0o750);
    }

    #[test]
    fn an_existing_file_keeps_its_bits() {
        assert_eq!(received_mode(Some(0o600), Some(0o644), 0o022), 0o600);
        assert_eq!(received_mode(Some(0o666), Some(0o600), 0o077), 0o666);
    }

    #[test]
    fn a_made_directory_is_the_owners_to_write_and_no_wider() {
        assert_eq!(made_dir_mode(0o500), 0o700);
        assert_eq!(made_dir_mode(0o750), 0o750);
        assert_eq!(made_dir_mode(0o1777), 0o1777);
    }

    #[test]
    fn umask_is_read_from_proc() {
        assert_eq!(
            parse_umask("Name:\tx\nUmask:\t0027\nState:\tR\n"),
            Some(0o027)
        );
        assert_eq!(parse_umask("Name:\tx\n"), None);
    }
}
