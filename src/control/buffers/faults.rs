//! Test-only faults for buffer operations, compiled in only with the
//! `fault-injection` feature (the test scripts'; off in normal builds,
//! debug or release), on the one table of `crate::faults` (as the files'
//! `RCP_TEST_CORRUPT_PULLED_BLOCKS`): `corrupt_ranges` makes the next
//! ranges of an exposure that are checked arrive damaged, one byte flipped
//! just before their digest is compared, as if damaged on the way. Where:
//! for a write, on the exposing rcpd, in what landed (after the grant was
//! revoked); for a read, on the reader, in what its READs landed; under a
//! standing grant, whose ranges the peer's device may reach at any time,
//! nothing is written: the exposing rcpd counts the range as not matching
//! (`damaged`). Keyed by
//! the exposure's name, so tests running side by side in one process do
//! not see each other's faults.

use crate::mem::memfd::LeasedRange;

/// The next `n` ranges of exposure `name` checked arrive damaged
/// ([`u32::MAX`]: every one from now on; 0: none).
#[cfg(feature = "fault-injection")]
pub fn corrupt_ranges(name: &str, n: u32) {
    crate::faults::arm(&crate::faults::range_key(name), n);
}

/// Damage `range` of exposure `name` if a fault is armed for it (with
/// the `fault-injection` feature only).
///
/// # Safety
///
/// As [`LeasedRange::with_mut`]: no device reaches the range now.
#[cfg(feature = "fault-injection")]
pub(crate) unsafe fn inject(name: &str, range: &mut LeasedRange) {
    if crate::faults::fire(&crate::faults::range_key(name)) {
        // SAFETY: the caller's contract (this function's).
        let done = unsafe { range.with_mut(|b| b[0] ^= 0x5a) };
        tracing::warn!(
            name = %crate::escape::esc(name),
            offset = range.lease().offset(),
            damaged = done.is_some(),
            "test fault: damaged a buffer range"
        );
    }
}

/// Without the `fault-injection` feature: no faults.
///
/// # Safety
///
/// Nothing to uphold; the same signature as the feature's.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) unsafe fn inject(_name: &str, _range: &mut LeasedRange) {}

/// Whether the range of exposure `name` being checked now counts as
/// damaged (a fault armed for it), with nothing written: a standing
/// grant's ranges stay reachable by the peer's device while checked.
#[cfg(feature = "fault-injection")]
pub(crate) fn damaged(name: &str) -> bool {
    let fired = crate::faults::fire(&crate::faults::range_key(name));
    if fired {
        tracing::warn!(name = %crate::escape::esc(name), "test fault: a buffer range counted damaged");
    }
    fired
}

/// Without the `fault-injection` feature: no faults.
#[cfg(not(feature = "fault-injection"))]
#[inline(always)]
pub(crate) fn damaged(_name: &str) -> bool {
    false
}
