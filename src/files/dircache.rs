//! [`DirCache`]: the directories a stream opened last, by the name it gave
//! them.

use std::collections::VecDeque;
use std::sync::Mutex;

use super::root::DirHandle;

/// The directories a stream opened last, by the name it gave them: a
/// tree's files arrive directory by directory, so a few entries spare
/// nearly every file the lookup and open of its parent (two path walks per
/// file on a tree of small files). Bounded ([`DirCache::CAPACITY`]), so a
/// tree of many directories holds a few descriptors, not one each.
///
/// A directory renamed or replaced while cached is still the one written
/// into, as with any open directory handle; what is created there is
/// confined to it all the same.
pub struct DirCache<K> {
    recent: Mutex<VecDeque<(K, DirHandle)>>,
}

impl<K: PartialEq> Default for DirCache<K> {
    fn default() -> Self {
        DirCache {
            recent: Mutex::new(VecDeque::with_capacity(Self::CAPACITY)),
        }
    }
}

impl<K: PartialEq> DirCache<K> {
    /// Directories kept at most.
    pub const CAPACITY: usize = 16;

    /// The directory cached as `key`, if any (it becomes the most recent).
    pub fn get<Q>(&self, key: &Q) -> Option<DirHandle>
    where
        K: std::borrow::Borrow<Q>,
        Q: PartialEq + ?Sized,
    {
        let mut r = self.recent.lock().unwrap();
        let i = r.iter().position(|(k, _)| k.borrow() == key)?;
        let e = r.remove(i)?;
        let d = e.1.clone();
        r.push_front(e);
        Some(d)
    }

    /// Cache `dir` as `key`, the least recent entry making room.
    pub fn insert(&self, key: K, dir: DirHandle) {
        let mut r = self.recent.lock().unwrap();
        if let Some(i) = r.iter().position(|(k, _)| *k == key) {
            r.remove(i);
        }
        if r.len() == Self::CAPACITY {
            r.pop_back();
        }
        r.push_front((key, dir));
    }

    /// How many directories are cached.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.recent.lock().unwrap().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> DirHandle {
        DirHandle::open("/").unwrap()
    }

    #[test]
    fn keeps_the_most_recent_and_no_more() {
        let c = DirCache::<String>::default();
        for i in 0..DirCache::<String>::CAPACITY + 4 {
            c.insert(format!("d{i}"), dir());
        }
        assert_eq!(c.len(), DirCache::<String>::CAPACITY);
        // The first four went to make room; the rest are there.
        assert!(c.get("d0").is_none());
        assert!(c.get("d3").is_none());
        assert!(c.get("d4").is_some());
        assert!(c.get("d19").is_some());
    }

    #[test]
    fn a_hit_is_kept_over_older_entries() {
        let c = DirCache::<String>::default();
        for i in 0..DirCache::<String>::CAPACITY {
            c.insert(format!("d{i}"), dir());
        }
        // d0 is the least recent until it is used.
        assert!(c.get("d0").is_some());
        c.insert("new".into(), dir());
        assert!(c.get("d0").is_some(), "the entry just used stays");
        assert!(c.get("d1").is_none(), "the least recent made room");
        // Inserting a key again replaces it, not duplicates it.
        c.insert("new".into(), dir());
        assert_eq!(c.len(), DirCache::<String>::CAPACITY);
    }
}
