//! The Move protocol's core: what each end of a session's Move stream does,
//! as plain data and functions (the quinn-proto shape; `crate::engine` is
//! the model in this repository). No sockets, no files, no clocks, no
//! threads: the drivers in `control::server` and `control::client` move
//! frames, run the I/O the cores ask for ([`ServerAction`],
//! [`ClientAction`]) and pass time in as nanoseconds.
//!
//! # Types that matter
//! - [`ServerCore`]: rcpd's window ledger for one session: opens files,
//!   packs their blocks into windows of the arena (many small files share
//!   one window), grants them, and decides what a `WindowDone` means (ack,
//!   resend, re-read, fail), when files are committed (in batches) and when
//!   the stream is over.
//! - [`ClientCore`]: rcp's side: keeps up to `max_open_files` files open,
//!   answers grants by moving windows, reports digests, sends each file's
//!   digest when its last block is handed over, and commits pulled files in
//!   batches.
//! - [`Params`]: what both ends agreed at the handshake, decided by
//!   [`negotiate()`] (rcpd) and checked by [`check_grant`] (rcp), with the
//!   floor and ceiling of every parameter a client proposes
//!   ([`negotiate`](mod@negotiate)).
//! - [`Liveness`]: keepalives and the progress timeout, the same on both
//!   ends.
//!
//! # One window loop for both directions
//! A window is a slot of the server's arena holding extents (one block of
//! one file each, at 4 KiB-aligned offsets). The server grants it; the side
//! that sends data puts the blocks in it (pull: the server reads them from
//! its files before the grant; push: the client WRITEs them after it), the
//! side that receives checks each block against the sender's digest and
//! writes the good ones, and a block that does not match moves again under
//! the next round of the same window, at most [`Params::max_retries`] times.
//! Which side sends is the file's direction; the ledger is the same.
//!
//! # What the cores guarantee (tested in `tests`, with dropped, duplicated
//! and reordered frames and random I/O outcomes)
//! - Nothing is committed that was not verified: a file is committed only
//!   when every block of it that moved matched the sender's digest and the
//!   sender's file digest arrived.
//! - Nothing verified is sent twice: a block that matched is never granted
//!   again; only the extents that did not match are.
//! - Every window granted is released exactly once, and no more windows are
//!   granted at once than agreed.
//! - A stream whose peer stops answering, or that makes no progress, ends
//!   within the timeout with [`Reason::Retryable`]; so does one that lost
//!   or reordered frames ([`FrameSeq`]: at the next frame that arrives, a
//!   keepalive at the latest). Duplicated frames change nothing.
//! - A message outside the protocol (a WindowDone for a window never
//!   granted, window 0 included; a FileEnd for a file never opened, file 0
//!   included; a frame after Abort; ...) ends the stream with a
//!   [`Violation`] naming the message and why ([`Reason::Protocol`]), and
//!   nothing is committed after it. A frame after Abort reaches a core
//!   only if its driver keeps reading (the server's stops at the Abort, so
//!   the stream's status is the abort's); the core still refuses it and
//!   logs it, once.

pub mod buffer;
mod client;
pub mod negotiate;
pub mod rail_watch;
mod server;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};

pub use client::{
    ClientAction, ClientCore, ClientEvent, FileDone, FileSpec, Held, LocalCommit, SourceMeta,
    OPEN_DIGEST_BYTES,
};
pub use negotiate::{check_block_size, check_grant, negotiate, Agreed, Refusal, Staging, Terms};
pub use server::{CommittedFile, Granted, OpenedFile, ServerAction, ServerCore, MAX_FILE_LEN};

pub use crate::proto::Reason;

/// A file's id on a Move stream (chosen by the client).
pub type FileId = u32;
/// A window's id (chosen by the server, unique within its session).
pub type WindowId = u64;
/// A block or file digest (its length is the check's).
pub type Digest = Vec<u8>;

/// Extents in a window start at multiples of this (O_DIRECT reads land in
/// aligned memory; a page per tiny file is the price).
pub const EXTENT_ALIGN: u64 = 4096;

/// What both ends agreed at the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Block size (a power of two, at least 4096, at most `window_size`).
    pub block_size: u64,
    /// Bytes per window.
    pub window_size: u64,
    /// Windows the session may have granted at once.
    pub window_count: u32,
    /// Files the session may have open at once.
    pub max_open_files: u32,
    /// How blocks are checked (the digests' length and the file digest's
    /// hash follow from it).
    pub check: crate::files::Check,
    /// A stream that waits and makes no progress this long ends, as does
    /// one whose peer sent nothing this long.
    pub timeout_ns: u64,
    /// A keepalive goes out when nothing was sent this long: a third of the
    /// shorter of the two ends' timeouts, at least 250 ms
    /// ([`negotiate::keepalive_for`]).
    pub keepalive_ns: u64,
    /// Times a damaged block moves again before its file fails (rcpd's,
    /// sent in the handshake's answer).
    pub max_retries: u32,
    /// Rails of the session's data path: a Grant on a session of several
    /// carries the window's rkey on each.
    pub rails: u32,
}

impl Params {
    /// Bytes of a block digest on the wire.
    pub fn digest_len(&self) -> usize {
        self.check.digest_len()
    }

    /// Blocks of a file of `len` bytes.
    pub fn blocks(&self, len: u64) -> u64 {
        len.div_ceil(self.block_size)
    }

    /// Bytes of block `b` of a file of `len` bytes.
    pub fn block_len(&self, len: u64, b: u64) -> u32 {
        (len - b * self.block_size).min(self.block_size) as u32
    }
}

/// A check on the wire.
pub fn check_to_wire(c: crate::files::Check) -> crate::proto::Check {
    match c {
        crate::files::Check::Blake3 => crate::proto::Check::Blake3,
        crate::files::Check::Sha256 => crate::proto::Check::Sha256,
        crate::files::Check::Xxh3 => crate::proto::Check::Xxh3,
        crate::files::Check::None => crate::proto::Check::None,
    }
}

/// A check from the wire (`None` for one this build does not know).
pub fn check_from_wire(c: i32) -> Option<crate::files::Check> {
    match crate::proto::Check::try_from(c).ok()? {
        crate::proto::Check::Blake3 => Some(crate::files::Check::Blake3),
        crate::proto::Check::Sha256 => Some(crate::files::Check::Sha256),
        crate::proto::Check::Xxh3 => Some(crate::files::Check::Xxh3),
        crate::proto::Check::None => Some(crate::files::Check::None),
        crate::proto::Check::Unspecified => None,
    }
}

/// rcpd's half of the check negotiation: the first of the client's
/// `offered` checks (wire values, preferred first) that rcpd `allows`
/// (`RCPD_VERIFY`). A value this build does not know is passed over, which
/// is how an rcpd of protocol 2.1 answers a client that offers
/// `[BLAKE3, SHA-256]`: with SHA-256. An empty offer (a client older than
/// the list) means SHA-256. None allowed: a usage failure naming both
/// lists.
pub fn choose_check(
    offered: &[i32],
    allows: &[crate::files::Check],
) -> Result<crate::files::Check, Failure> {
    use crate::files::Check;
    let offered: Vec<Check> = if offered.is_empty() {
        vec![Check::Sha256]
    } else {
        offered.iter().filter_map(|&c| check_from_wire(c)).collect()
    };
    if let Some(&c) = offered.iter().find(|c| allows.contains(c)) {
        return Ok(c);
    }
    let names = |v: &[Check]| v.iter().map(|c| c.name()).collect::<Vec<_>>().join(", ");
    Err(Failure::invalid(if offered.is_empty() {
        format!(
            "the client offered no check this rcpd knows (it accepts {}: RCPD_VERIFY)",
            names(allows)
        )
    } else {
        format!(
                "this rcpd accepts only the checks {} (RCPD_VERIFY); the client offered {} (rcp --verify)",
                names(allows),
                names(&offered)
            )
    }))
}

/// The client's half: the check rcpd `chose` (a wire value), which must be
/// one the client `offered`. An rcpd of 2.1 or older answers with one of
/// its own checks, never BLAKE3.
pub fn accept_check(
    offered: &[crate::files::Check],
    chose: i32,
) -> Result<crate::files::Check, Failure> {
    match check_from_wire(chose) {
        Some(c) if offered.contains(&c) => Ok(c),
        _ => Err(Failure::invalid(format!(
            "rcpd chose check {chose} where this rcp offered {}",
            offered
                .iter()
                .map(|c| c.name())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// Why a stream or a file failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    /// Machine-readable: the exit code comes from it.
    pub reason: Reason,
    /// What to tell the user.
    pub message: String,
}

impl Failure {
    /// A failure for `reason`.
    pub fn new(reason: Reason, message: impl Into<String>) -> Self {
        Failure {
            reason,
            message: message.into(),
        }
    }

    /// A request that cannot be served as asked (not a protocol
    /// violation: see [`Violation`]).
    pub fn invalid(message: impl Into<String>) -> Self {
        Failure::new(Reason::Invalid, message)
    }
}

/// Which end of a Move stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Client,
    Server,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Client => "the client",
            Side::Server => "the server",
        })
    }
}

/// The kinds of message a Move stream carries (the parts of a
/// `ClientFrame` and a `ServerFrame`), to name the one that broke the
/// protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    // Client -> server.
    /// A Move stream itself (its first frame).
    Move,
    OpenFile,
    WindowDone,
    FileEnd,
    Abort,
    /// A frame of the client's after its Abort (the Abort is its last).
    AfterAbort,
    // Server -> client.
    Opened,
    Grant,
    Ack,
    Committed,
    // The handshake's answer.
    Handshake,
}

impl std::fmt::Display for FrameKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FrameKind::Move => "Move",
            FrameKind::OpenFile => "OpenFile",
            FrameKind::WindowDone => "WindowDone",
            FrameKind::FileEnd => "FileEnd",
            FrameKind::Abort => "Abort",
            FrameKind::AfterAbort => "a frame after Abort",
            FrameKind::Opened => "Opened",
            FrameKind::Grant => "Grant",
            FrameKind::Ack => "Ack",
            FrameKind::Committed => "Committed",
            FrameKind::Handshake => "HandshakeResponse",
        })
    }
}

/// A message outside the protocol: who sent it, which it was and why it is
/// refused. It ends the stream as [`Reason::Protocol`] (exit code 8, gRPC
/// `ABORTED`), and nothing is committed after it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{by} broke the protocol: {frame}: {why}")]
pub struct Violation {
    pub by: Side,
    pub frame: FrameKind,
    pub why: String,
}

impl Violation {
    /// `frame` from `by` is refused because `why`.
    pub fn new(by: Side, frame: FrameKind, why: impl Into<String>) -> Self {
        Violation {
            by,
            frame,
            why: why.into(),
        }
    }
}

impl From<Violation> for Failure {
    fn from(v: Violation) -> Self {
        Failure::new(Reason::Protocol, v.to_string())
    }
}

/// Whether a granted window or range carries a key per rail as a session
/// of `rails` rails needs: with several, one per rail, rail 0's (`rkey`)
/// first; with one, the list is not read. Files' grants and buffer ranges
/// are checked by it alike.
pub fn rail_rkeys_fit(rails: u32, rkey: u32, rail_rkeys: &[u32]) -> bool {
    rails < 2 || (rail_rkeys.len() == rails as usize && rail_rkeys.first() == Some(&rkey))
}

/// Bitmap of blocks (bit i of byte i/8, LSB first), as on the wire.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bitmap {
    pub bits: Vec<u8>,
    pub len: u64,
}

impl Bitmap {
    /// All clear.
    pub fn new(len: u64) -> Self {
        Bitmap {
            bits: vec![0; len.div_ceil(8) as usize],
            len,
        }
    }

    /// From the wire; `None` if the length does not fit `len` bits.
    pub fn from_bytes(bits: Vec<u8>, len: u64) -> Option<Self> {
        (bits.len() as u64 == len.div_ceil(8)).then_some(Bitmap { bits, len })
    }

    /// Every block of `len` set except `missing`.
    pub fn all_but(len: u64, missing: &[u64]) -> Self {
        let mut b = Bitmap::new(len);
        for i in 0..len {
            b.set(i);
        }
        for &m in missing {
            if m < len {
                b.bits[(m / 8) as usize] &= !(1 << (m % 8));
            }
        }
        b
    }

    /// Set bit `i`.
    pub fn set(&mut self, i: u64) {
        if i < self.len {
            self.bits[(i / 8) as usize] |= 1 << (i % 8);
        }
    }

    pub fn get(&self, i: u64) -> bool {
        i < self.len && self.bits[(i / 8) as usize] & (1 << (i % 8)) != 0
    }

    pub fn count(&self) -> u64 {
        self.bits.iter().map(|b| u64::from(b.count_ones())).sum()
    }
}

/// The files of a window's `extents` that it holds whole: every block of
/// the file (its length from `len`, `None` for a file not known), each
/// once. Once such a window is read, nothing of these files is left to
/// read, so the job that read it may check their sources too (one hand-off
/// less per window of small files). Files with no blocks, or blocks
/// elsewhere (larger files, resumed ones), are not listed.
pub fn files_whole_in(
    extents: &[crate::proto::Extent],
    block_size: u64,
    len: impl Fn(FileId) -> Option<u64>,
) -> Vec<FileId> {
    let mut fb: Vec<(FileId, u64)> = extents.iter().map(|e| (e.file, e.block)).collect();
    fb.sort_unstable();
    fb.dedup();
    fb.chunk_by(|a, b| a.0 == b.0)
        .filter_map(|run| {
            let file = run[0].0;
            let blocks = len(file)?.div_ceil(block_size);
            (blocks > 0 && run.len() as u64 == blocks && run.iter().all(|&(_, b)| b < blocks))
                .then_some(file)
        })
        .collect()
}

/// The file digest of the Move protocol, [`crate::files::file_digest`]:
/// SHA-256 over `"rcp-file-digest-v1\0" || len (u64 LE) || block_size (u64
/// LE) || d0 || d1 || ...`, the digests of every block of the file in
/// order. Cheap (it hashes 32 bytes per block, never the data again) and
/// order-fixed.
pub fn file_digest<'a>(
    len: u64,
    block_size: u64,
    blocks: impl IntoIterator<Item = &'a [u8]>,
) -> Digest {
    let mut c = DigestChain::new(crate::files::Check::Sha256, len, block_size);
    for (i, d) in blocks.into_iter().enumerate() {
        c.add(i as u64, d.to_vec());
    }
    c.finish().unwrap_or_default()
}

/// [`file_digest`] fed with block digests in any order (windows are filled
/// concurrently); built on [`crate::files::FileDigest`].
#[derive(Clone)]
pub struct DigestChain {
    check: crate::files::Check,
    digest: crate::files::FileDigest,
    next: u64,
    blocks: u64,
    pending: BTreeMap<u64, Digest>,
    /// A digest of the wrong length was given.
    bad: bool,
}

impl std::fmt::Debug for DigestChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DigestChain")
            .field("next", &self.next)
            .field("blocks", &self.blocks)
            .finish_non_exhaustive()
    }
}

impl DigestChain {
    /// For a file of `len` bytes in blocks of `block_size`, checked with
    /// `check`.
    pub fn new(check: crate::files::Check, len: u64, block_size: u64) -> Self {
        DigestChain {
            check,
            digest: crate::files::FileDigest::with_check(check, len, block_size),
            next: 0,
            blocks: len.div_ceil(block_size),
            pending: BTreeMap::new(),
            bad: false,
        }
    }

    /// Block `b`'s digest; a block already given is ignored.
    pub fn add(&mut self, b: u64, d: Digest) {
        if b < self.next || b >= self.blocks {
            return;
        }
        self.pending.entry(b).or_insert(d);
        while let Some(d) = self.pending.remove(&self.next) {
            match self.check.from_wire(&d) {
                Some(d) => self.digest.push(&d),
                None => self.bad = true,
            }
            self.next += 1;
        }
    }

    /// Every block's digest is in.
    pub fn is_complete(&self) -> bool {
        self.next == self.blocks
    }

    /// The file digest (as on the wire), once complete (and every block
    /// digest was one).
    pub fn finish(self) -> Option<Digest> {
        let check = self.check;
        (self.is_complete() && !self.bad).then(|| check.wire(&self.digest.finish()))
    }
}

/// Keepalives and the progress timeout of one end of a Move stream.
///
/// - Every keepalive period (a third of the shorter of both ends' timeouts)
///   without a frame sent, the end sends an empty frame (a keepalive): a
///   stopped process or a hung host sends none, so its peer notices within
///   its timeout.
/// - An end that waits (on its peer or on its own I/O) and has heard
///   nothing from the peer for `timeout`, or seen no progress (a frame that
///   carried something, an I/O action completed) for `timeout`, ends the
///   stream as [`Reason::Retryable`].
/// - Each end counts its progress (every answered action and data-path
///   movement) and says the count in every frame; a frame whose count
///   grew is the peer's progress.
#[derive(Clone, Copy, Debug)]
pub struct Liveness {
    timeout: u64,
    keepalive: u64,
    last_heard: u64,
    last_progress: u64,
    last_sent: u64,
    /// Ours: grows with every answered action and data-path movement.
    progress: u64,
    /// The peer's, as last heard.
    peer_progress: u64,
}

impl Liveness {
    /// Starting at `now`: end after `timeout_ns`, keepalives every
    /// `keepalive_ns`.
    pub fn new(timeout_ns: u64, keepalive_ns: u64, now: u64) -> Self {
        Liveness {
            timeout: timeout_ns,
            keepalive: keepalive_ns.max(1),
            last_heard: now,
            last_progress: now,
            last_sent: now,
            progress: 0,
            peer_progress: 0,
        }
    }

    /// Something moved here (an action finished; the data path confirmed
    /// bytes): progress, counted for the next frame to say.
    pub fn note_progress(&mut self, now: u64) {
        self.progress += 1;
        self.progressed(now);
    }

    /// Our progress count, as a frame says it.
    pub fn progress(&self) -> u64 {
        self.progress
    }

    /// Whether a frame carrying the peer's `progress` count moved it.
    pub fn peer_moved(&mut self, progress: u64) -> bool {
        let moved = progress > self.peer_progress;
        self.peer_progress = self.peer_progress.max(progress);
        moved
    }

    /// A frame arrived; `progress` unless it was a keepalive.
    pub fn heard(&mut self, now: u64, progress: bool) {
        self.last_heard = self.last_heard.max(now);
        if progress {
            self.progressed(now);
        }
    }

    /// Local I/O completed.
    pub fn progressed(&mut self, now: u64) {
        self.last_progress = self.last_progress.max(now);
    }

    /// A frame went out.
    pub fn sent(&mut self, now: u64) {
        self.last_sent = self.last_sent.max(now);
    }

    /// Whether a keepalive is due at `now`.
    pub fn keepalive_due(&self, now: u64) -> bool {
        self.timeout > 0 && now >= self.last_sent + self.keepalive_every()
    }

    fn keepalive_every(&self) -> u64 {
        self.keepalive
    }

    /// Why the stream must end at `now`, if it must. `waiting`: the end has
    /// something outstanding (it is not idle).
    pub fn expired(&self, now: u64, waiting: bool) -> Option<Failure> {
        if self.timeout == 0 {
            return None;
        }
        let secs = |ns: u64| ns as f64 / 1e9;
        if now >= self.last_heard + self.timeout {
            return Some(Failure::new(
                Reason::Retryable,
                format!(
                    "the peer stopped answering: nothing heard for {:.1} s (timeout {:.1} s)",
                    secs(now - self.last_heard),
                    secs(self.timeout)
                ),
            ));
        }
        if waiting && now >= self.last_progress + self.timeout {
            return Some(Failure::new(
                Reason::Retryable,
                format!(
                    "no progress for {:.1} s (timeout {:.1} s)",
                    secs(now - self.last_progress),
                    secs(self.timeout)
                ),
            ));
        }
        None
    }

    /// When [`keepalive_due`](Self::keepalive_due) or
    /// [`expired`](Self::expired) next can change.
    pub fn next_deadline(&self, waiting: bool) -> Option<u64> {
        if self.timeout == 0 {
            return None;
        }
        let mut t = (self.last_sent + self.keepalive_every()).min(self.last_heard + self.timeout);
        if waiting {
            t = t.min(self.last_progress + self.timeout);
        }
        Some(t)
    }
}

/// The numbers of the frames on one Move stream: each end numbers the
/// frames it sends from 1 (`seq`) and checks the peer's.
///
/// The stream is ordered and lossless, so a frame whose number is not the
/// next one means frames were lost or reordered on the way (a broken relay,
/// a stream cut and spliced): the receiver cannot know what it missed, and
/// ends the stream as [`Reason::Retryable`] (a new stream starts clean)
/// instead of taking what follows for a protocol violation. A number
/// already seen is a duplicate and is ignored. A frame numbered 0 carries
/// no number (a keepalive sent before the core started, or an older peer)
/// and is taken as it comes.
#[derive(Clone, Copy, Debug, Default)]
pub struct FrameSeq {
    sent: u64,
    heard: u64,
}

/// What [`FrameSeq::check`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqCheck {
    /// The next frame (or an unnumbered one): take it.
    Take,
    /// Seen before: ignore it.
    Duplicate,
    /// Frames `expected..got` are missing.
    Gap { expected: u64, got: u64 },
}

impl FrameSeq {
    /// The number of the next frame sent.
    pub fn stamp(&mut self) -> u64 {
        self.sent += 1;
        self.sent
    }

    /// A frame numbered `seq` arrived.
    pub fn check(&mut self, seq: u64) -> SeqCheck {
        if seq == 0 {
            return SeqCheck::Take;
        }
        if seq <= self.heard {
            return SeqCheck::Duplicate;
        }
        if seq != self.heard + 1 {
            return SeqCheck::Gap {
                expected: self.heard + 1,
                got: seq,
            };
        }
        self.heard = seq;
        SeqCheck::Take
    }

    /// The failure a gap ends the stream with.
    pub fn lost(expected: u64, got: u64) -> Failure {
        Failure::new(
            Reason::Retryable,
            format!("frames lost on the stream: frame {got} came where {expected} was next"),
        )
    }
}

/// A set of ids handed out in increasing order, most of which end roughly
/// in order: everything below a mark, plus the few above it.
#[derive(Clone, Debug, Default)]
pub struct IdSet {
    below: u64,
    above: BTreeSet<u64>,
}

impl IdSet {
    /// Empty, for ids from `first` on.
    pub fn starting_at(first: u64) -> Self {
        IdSet {
            below: first,
            above: BTreeSet::new(),
        }
    }

    /// Add `id`.
    pub fn insert(&mut self, id: u64) {
        if id < self.below {
            return;
        }
        self.above.insert(id);
        while self.above.remove(&self.below) {
            self.below += 1;
        }
    }

    /// Whether `id` was added (ids below the first count as added).
    pub fn contains(&self, id: u64) -> bool {
        id < self.below || self.above.contains(&id)
    }
}
