//! Test-only faults, compiled in only with the `fault-injection` feature
//! (the test scripts'; off in normal builds, debug or release): one table
//! of armed faults, keyed by what they damage, counted down as they fire.
//! The damage itself is done where the bytes are (a pulled block in
//! `control::client::io`, a buffer range in `control::buffers::faults`).
//!
//! Keys:
//! - [`PULLED_BLOCKS`]: blocks rcp pulls, damaged before their check;
//!   armed from `RCP_TEST_CORRUPT_PULLED_BLOCKS=N` at first use (rcp runs
//!   as its own process in the tests);
//! - `range:NAME` ([`range_key`]): ranges of exposure NAME, damaged before
//!   their check (tests of buffers run rcpd in process and arm it);
//! - [`NO_MAKE_DIRS`]: rcpd answers `MakeDirs` UNIMPLEMENTED, as an rcpd
//!   before 2.11 does; armed from `RCP_TEST_NO_MAKE_DIRS=N` at first use.

use std::collections::HashMap;
use std::sync::Mutex;

/// Pulled blocks (`RCP_TEST_CORRUPT_PULLED_BLOCKS`).
pub const PULLED_BLOCKS: &str = "pulled-blocks";

/// `MakeDirs` calls answered as an older rcpd would (`RCP_TEST_NO_MAKE_DIRS`).
pub const NO_MAKE_DIRS: &str = "no-make-dirs";

/// The key of exposure `name`'s ranges.
pub fn range_key(name: &str) -> String {
    format!("range:{name}")
}

static ARMED: Mutex<Option<HashMap<String, u32>>> = Mutex::new(None);

fn with<R>(f: impl FnOnce(&mut HashMap<String, u32>) -> R) -> R {
    let mut g = ARMED.lock().unwrap();
    let m = g.get_or_insert_with(|| {
        let mut m = HashMap::new();
        let n = |var| {
            std::env::var(var)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        m.insert(
            PULLED_BLOCKS.to_string(),
            n("RCP_TEST_CORRUPT_PULLED_BLOCKS"),
        );
        m.insert(NO_MAKE_DIRS.to_string(), n("RCP_TEST_NO_MAKE_DIRS"));
        m
    });
    f(m)
}

/// The next `n` faults under `key` fire ([`u32::MAX`]: every one from now
/// on; 0: none).
pub fn arm(key: &str, n: u32) {
    with(|m| m.insert(key.to_string(), n));
}

/// Whether a fault under `key` fires now (one fewer left).
pub fn fire(key: &str) -> bool {
    with(|m| match m.get_mut(key) {
        Some(n) if *n > 0 => {
            if *n != u32::MAX {
                *n -= 1;
            }
            true
        }
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn armed_faults_fire_as_many_times_as_armed() {
        let k = range_key("faults-test");
        assert!(!fire(&k));
        arm(&k, 2);
        assert!(fire(&k) && fire(&k) && !fire(&k));
        arm(&k, u32::MAX);
        assert!((0..100).all(|_| fire(&k)));
        arm(&k, 0);
        assert!(!fire(&k));
    }
}
