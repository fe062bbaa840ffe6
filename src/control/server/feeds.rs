//! Fan-out on the receiving side (docs/fanout.md): the files a push of a
//! fan-out (`OpenFile.fanout`) brings, by fan-out id, each readable as its
//! blocks are verified ([`Growing`]) by the Copy that forwards them to the
//! next node (`CopyRequest.follow`, [`crate::control::fanout`]).

use std::collections::HashMap;
use std::fs::File;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{watch, Notify};

use crate::files::Growing;
use crate::proto;

/// A fan-out nobody added a file to for this long is forgotten (its
/// entries hold a descriptor of each file still being received).
const FORGET_AFTER: Duration = Duration::from_secs(3600);

/// One file of a fan-out as it came here.
#[derive(Clone)]
pub struct FedFile {
    /// What the sender said of it (path, name, length, mode, mtime,
    /// fingerprint, preserve, create_parents).
    pub open: proto::OpenFile,
    /// Where it landed, beneath the root.
    pub path: String,
    /// Its blocks as they are verified; `None` once committed (read from
    /// `path` then: a tree's committed files hold no descriptor).
    pub growing: Option<Arc<Growing>>,
}

#[derive(Default)]
struct Files {
    /// Paths in the order they were first opened.
    order: Vec<String>,
    by_path: HashMap<String, FedFile>,
}

/// The files of one fan-out here.
pub struct Feed {
    files: Mutex<Files>,
    /// How many paths `order` holds: a follower waits on it.
    count: watch::Sender<usize>,
    touched: Mutex<Instant>,
}

impl Feed {
    fn new() -> Self {
        Feed {
            files: Mutex::default(),
            count: watch::channel(0).0,
            touched: Mutex::new(Instant::now()),
        }
    }

    /// The files first opened after the first `from`.
    pub fn since(&self, from: usize) -> Vec<FedFile> {
        let f = self.files.lock().unwrap();
        f.order
            .iter()
            .skip(from)
            .filter_map(|p| f.by_path.get(p).cloned())
            .collect()
    }

    /// The file at `path` as it is now.
    pub fn get(&self, path: &str) -> Option<FedFile> {
        self.files.lock().unwrap().by_path.get(path).cloned()
    }

    /// Wait until more than `seen` files were opened.
    pub async fn more_than(&self, seen: usize) {
        let mut rx = self.count.subscribe();
        let _ = rx.wait_for(|n| *n > seen).await;
    }

    /// A push of this fan-out opened `path`, writing `file`, holding
    /// `held` verified: the file's [`Growing`] (the one it had if an
    /// interrupted copy of it is continued, now following `file`).
    pub fn receiving(
        &self,
        open: &proto::OpenFile,
        path: &str,
        block_size: u64,
        file: File,
        held: Vec<u64>,
    ) -> Arc<Growing> {
        *self.touched.lock().unwrap() = Instant::now();
        let mut f = self.files.lock().unwrap();
        if let Some(g) = f.by_path.get(path).and_then(|e| e.growing.clone()) {
            if g.len() == open.length && g.block_size() == block_size && !g.is_committed() {
                g.restart(file, held);
                return g;
            }
        }
        let g = Arc::new(Growing::new(open.length, block_size, file, held));
        let e = FedFile {
            open: open.clone(),
            path: path.to_string(),
            growing: Some(g.clone()),
        };
        if f.by_path.insert(path.to_string(), e).is_none() {
            f.order.push(path.to_string());
        }
        let n = f.order.len();
        drop(f);
        self.count.send_replace(n);
        g
    }

    /// `path` is committed: its readers are released, later ones read
    /// the file at `path`.
    pub fn committed(&self, path: &str, g: &Growing) {
        g.finish();
        if let Some(e) = self.files.lock().unwrap().by_path.get_mut(path) {
            e.growing = None;
        }
    }
}

/// Every fan-out this rcpd receives, by id.
#[derive(Default)]
pub struct Feeds {
    map: Mutex<HashMap<String, Arc<Feed>>>,
    added: Notify,
}

impl Feeds {
    /// The fan-out `id`, made on its first file.
    pub fn feed(&self, id: &str) -> Arc<Feed> {
        let mut m = self.map.lock().unwrap();
        m.retain(|_, f| f.touched.lock().unwrap().elapsed() < FORGET_AFTER);
        let f = m
            .entry(id.to_string())
            .or_insert_with(|| Arc::new(Feed::new()))
            .clone();
        drop(m);
        self.added.notify_waiters();
        f
    }

    /// The fan-out `id`, once its first file is here (a follower may ask
    /// before the sender's first file opens).
    pub async fn wait(&self, id: &str) -> Arc<Feed> {
        loop {
            let added = self.added.notified();
            tokio::pin!(added);
            added.as_mut().enable();
            if let Some(f) = self.map.lock().unwrap().get(id) {
                return f.clone();
            }
            added.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(len: u64) -> proto::OpenFile {
        proto::OpenFile {
            path: "d/f".into(),
            length: len,
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_follower_finds_files_as_they_open_and_resumed_ones_once() {
        let feeds = Arc::new(Feeds::default());
        let waiter = {
            let feeds = feeds.clone();
            tokio::spawn(async move { feeds.wait("x").await })
        };
        let feed = feeds.feed("x");
        assert!(Arc::ptr_eq(&waiter.await.unwrap(), &feed));
        let g1 = feed.receiving(&open(8), "d/f", 4, tempfile::tempfile().unwrap(), vec![]);
        feed.more_than(0).await;
        // The same file continued by another sender: the same Growing,
        // listed once.
        let g2 = feed.receiving(&open(8), "d/f", 4, tempfile::tempfile().unwrap(), vec![1]);
        assert!(Arc::ptr_eq(&g1, &g2));
        assert_eq!(feed.since(0).len(), 1);
        feed.committed("d/f", &g2);
        assert!(feed.get("d/f").unwrap().growing.is_none());
        assert!(g1.is_committed());
        // Sent again after its commit: a new Growing, still listed once.
        let g3 = feed.receiving(&open(8), "d/f", 4, tempfile::tempfile().unwrap(), vec![]);
        assert!(!Arc::ptr_eq(&g1, &g3));
        assert_eq!(feed.since(0).len(), 1);
    }
}
