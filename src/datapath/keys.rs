//! The keys of a data path's rails past the first: a window carries rail
//! 0's `(lkey, rkey)`, and each other rail's [`RailSpec::keys`] maps them
//! to that rail's through a [`RailKeys`].
//!
//! - rkeys: a window's rkey on every rail, by its rkey on rail 0, held
//!   before the window is submitted and released at its `WindowDone` (the
//!   peer grants each window on every rail);
//! - lkeys: the key of local memory on every rail, by its key on rail 0
//!   (a session's staging, services' buffers), held while the memory's
//!   registrations live; a key not entered maps to the rail's
//!   `default_lkey`, its staging's ([`RailKeys::map_for`]).
//!
//! One way in and out for both, used by [`crate::datapath::lend`] alone:
//! `hold_*` enters a key's keys per rail, or counts one more holder of the
//! same keys (windows that share a remote registration, registrations
//! that several windows hold), and refuses other keys under a key held;
//! `release_*` lets go of one holder, the last removing the entry.
//!
//! [`RailSpec::keys`]: crate::datapath::RailSpec::keys

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::runner::KeyMapFn;

/// A key's keys on every rail, and its holders.
type Entries = HashMap<u32, (Vec<u32>, usize)>;

#[derive(Default)]
struct Maps {
    rkeys: Entries,
    lkeys: Entries,
}

/// The keys of every rail of a data path, by rail 0's (module docs).
#[derive(Default)]
pub struct RailKeys(Mutex<Maps>);

/// A key already entered with other keys per rail.
#[derive(Debug, thiserror::Error)]
#[error("{what} {key:#x} is entered already with keys {have:x?} per rail, not {want:x?}")]
pub struct KeyConflict {
    /// `lkey` or `rkey`.
    pub what: &'static str,
    pub key: u32,
    pub have: Vec<u32>,
    pub want: Vec<u32>,
}

/// Count one more holder of `key`'s `rails`, or enter them.
fn hold(m: &mut Entries, what: &'static str, key: u32, rails: Vec<u32>) -> Result<(), KeyConflict> {
    match m.get_mut(&key) {
        Some((have, n)) if *have == rails => {
            *n += 1;
            Ok(())
        }
        Some((have, _)) => Err(KeyConflict {
            what,
            key,
            have: have.clone(),
            want: rails,
        }),
        None => {
            m.insert(key, (rails, 1));
            Ok(())
        }
    }
}

/// One holder of `key` lets go; the last removes it.
fn release(m: &mut Entries, key: u32) {
    if let Some((_, n)) = m.get_mut(&key) {
        *n -= 1;
        if *n == 0 {
            m.remove(&key);
        }
    }
}

fn on(m: &Entries, key: u32, rail: usize) -> Option<u32> {
    m.get(&key).and_then(|(v, _)| v.get(rail).copied())
}

impl RailKeys {
    /// Enter a window's rkey on every rail (`rails[0]` is `rkey`), or
    /// count one more holder of the same keys; refused when `rkey` is
    /// entered with other keys (two live windows that disagree on a rail's
    /// key).
    pub fn hold_rkeys(&self, rkey: u32, rails: Vec<u32>) -> Result<(), KeyConflict> {
        hold(&mut self.0.lock().unwrap().rkeys, "rkey", rkey, rails)
    }

    /// A window whose rail-0 rkey is `rkey` ended: one holder lets go, the
    /// last removes its keys.
    pub fn release_rkeys(&self, rkey: u32) {
        release(&mut self.0.lock().unwrap().rkeys, rkey);
    }

    /// The rkey on `rail` of the window whose rail-0 rkey is `rkey`. A
    /// window that is not known (never: the lending path holds its keys
    /// before it submits) keeps `rkey`, which the rail's device refuses with a remote
    /// access error: the rail fails, the bytes never land elsewhere.
    pub fn get(&self, rkey: u32, rail: usize) -> u32 {
        on(&self.0.lock().unwrap().rkeys, rkey, rail).unwrap_or(rkey)
    }

    /// Enter local memory's key on every rail (`rails[0]` is `lkey`), or
    /// count one more holder of the same keys; refused when `lkey` is
    /// entered with other keys.
    pub fn hold_lkeys(&self, lkey: u32, rails: Vec<u32>) -> Result<(), KeyConflict> {
        hold(&mut self.0.lock().unwrap().lkeys, "lkey", lkey, rails)
    }

    /// One holder of `lkey`'s keys lets go; the last removes them.
    pub fn release_lkeys(&self, lkey: u32) {
        release(&mut self.0.lock().unwrap().lkeys, lkey);
    }

    /// The key on `rail` of local memory whose rail-0 key is `lkey`, if
    /// it is entered.
    pub fn lkey(&self, lkey: u32, rail: usize) -> Option<u32> {
        on(&self.0.lock().unwrap().lkeys, lkey, rail)
    }

    /// Rail `rail`'s key map: a window's `(lkey, rkey)` on rail 0 → the
    /// rail's: the entered lkey, else `default_lkey` (the staging's on the
    /// rail), and the entered rkey ([`RailKeys::get`]). One lock a chain.
    pub fn map_for(self: &Arc<Self>, rail: usize, default_lkey: u32) -> KeyMapFn {
        let keys = self.clone();
        Box::new(move |lkey, rkey| {
            let m = keys.0.lock().unwrap();
            (
                on(&m.lkeys, lkey, rail).unwrap_or(default_lkey),
                on(&m.rkeys, rkey, rail).unwrap_or(rkey),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_map_takes_entered_keys_and_the_rails_defaults() {
        let k = Arc::new(RailKeys::default());
        let m = k.map_for(1, 0x50);
        assert_eq!(m(0x10, 0x20), (0x50, 0x20), "nothing entered");
        k.hold_rkeys(0x20, vec![0x20, 0x21]).unwrap();
        k.hold_lkeys(0x10, vec![0x10, 0x11]).unwrap();
        assert_eq!(m(0x10, 0x20), (0x11, 0x21));
        assert_eq!(m(0x99, 0x20), (0x50, 0x21), "the staging's lkey");
        k.release_rkeys(0x20);
        assert_eq!(m(0x10, 0x20), (0x11, 0x20));
    }

    #[test]
    fn keys_stay_while_a_holder_holds_them() {
        let k = RailKeys::default();
        k.hold_lkeys(1, vec![1, 2]).unwrap();
        k.hold_lkeys(1, vec![1, 2]).unwrap();
        let e = k.hold_lkeys(1, vec![1, 3]).unwrap_err();
        assert_eq!((e.what, e.have, e.want), ("lkey", vec![1, 2], vec![1, 3]));
        k.release_lkeys(1);
        assert_eq!(k.lkey(1, 1), Some(2), "one holder left");
        k.release_lkeys(1);
        assert_eq!(k.lkey(1, 1), None);
        k.release_lkeys(1);
        k.hold_lkeys(1, vec![1, 3]).unwrap();
        assert_eq!(k.lkey(1, 1), Some(3));

        // Two windows of one remote registration: the first's end leaves
        // the second's keys.
        k.hold_rkeys(7, vec![7, 8]).unwrap();
        k.hold_rkeys(7, vec![7, 8]).unwrap();
        assert!(k.hold_rkeys(7, vec![7, 9]).is_err());
        k.release_rkeys(7);
        assert_eq!(k.get(7, 1), 8);
        k.release_rkeys(7);
        assert_eq!(k.get(7, 1), 7);
        // Released by all, the key takes other keys (a window granted anew).
        k.hold_rkeys(7, vec![7, 9]).unwrap();
        assert_eq!(k.get(7, 1), 9);
    }
}
