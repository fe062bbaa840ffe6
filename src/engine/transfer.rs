//! The transfer state machine.
//!
//! A [`Transfer`] moves one file range over one reliable-connected queue pair
//! by one-sided operations, block by block. It does no I/O: the runtime asks
//! it what to post ([`Transfer::poll_transmit`]), feeds it completions
//! ([`Transfer::on_completion`]), timer ticks ([`Transfer::poll_timeout`]) and
//! grants ([`Transfer::add_window`]), and acts on the [`Event`]s it queues
//! ([`Transfer::poll_event`]).
//!
//! # Protocol with the runtime
//!
//! 1. `poll_transmit(now)` returns a [`Batch`]: one chain, one doorbell. For a
//!    push ([`OpKind::Write`]) fill each request's local buffer with the file
//!    bytes of `batch.blocks[i]` first; then post `batch.wrs`. If the post
//!    fails, call [`Transfer::post_failed`] with how many were accepted.
//! 2. Feed every completion to `on_completion`. A successful signaled
//!    completion confirms its request and every earlier unsignaled one:
//!    [`Event::BlockDone`] for each. For a pull ([`OpKind::Read`]) write the
//!    buffer to the file; in both cases then [`Transfer::release_buffer`] it.
//! 3. The first failure of an epoch (error completion, request timeout,
//!    [`Transfer::connection_lost`]) stops posting and queues
//!    [`Event::ErrorBatch`] saying whether to reconnect or give up. Later
//!    completions of that epoch (flushes) are absorbed; when nothing is
//!    outstanding, [`Event::ReadyToReconnect`]. After replacing the queue
//!    pair call [`Transfer::reconnected`]: the unconfirmed blocks, and only
//!    those, are posted again.
//! 4. Done when [`Transfer::is_complete`].
//!
//! A provider that does not report flushed *unsignaled* requests leaves the
//! transfer in [`State::Flushing`]; the runtime may call `reconnected` at any
//! time (everything still outstanding is then unconfirmed), and a request
//! timeout also ends the flush.
//!
//! Time is a `u64` of nanoseconds on any monotonic clock the runtime likes;
//! the engine only compares and adds.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::ops::Range;

use super::batch::{BatchPolicy, BatchPolicyError};
use super::blocks::{BlockPlan, BlockSizeError, BlockSpan, BlockState, BlockStates};
use super::credits::Credits;
use super::inflight::InFlight;
use super::slots::{Slots, WrId, MAX_SLOTS};
use super::window::{Window, WindowError, Windows};
use super::wr::{LocalSeg, OpKind, WcStatus, WorkCompletion, WorkRequest};

/// Static parameters of a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferConfig {
    /// `Write` for a push, `Read` for a pull.
    pub op: OpKind,
    /// Bytes to move.
    pub file_len: u64,
    /// Block size, a power of two `>= 4096`.
    pub block_size: u64,
    /// Send-queue depth of the queue pair (`1..=65536`): credits and slots.
    pub sq_depth: usize,
    /// Chain length and signaling.
    pub batch: BatchPolicy,
    /// Writes of at most this many bytes are posted inline; 0 disables.
    pub max_inline: u32,
    /// A request outstanding this long (nanoseconds) fails the epoch; 0
    /// disables.
    pub request_timeout_ns: u64,
    /// Reconnects allowed in a row without a block confirmed in between;
    /// the next fruitless failure fails the transfer (no endless retry).
    pub max_retries: u32,
}

impl TransferConfig {
    /// Defaults: chains of 32 signaled at the tail, no inline, no timeout,
    /// 3 fruitless retries.
    pub fn new(op: OpKind, file_len: u64, block_size: u64, sq_depth: usize) -> Self {
        TransferConfig {
            op,
            file_len,
            block_size,
            sq_depth,
            batch: BatchPolicy::default(),
            max_inline: 0,
            request_timeout_ns: 0,
            max_retries: 3,
        }
    }
}

/// A [`TransferConfig`] or buffer list that cannot work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigError {
    /// Bad batch policy.
    Batch(BatchPolicyError),
    /// Bad block size.
    BlockSize(BlockSizeError),
    /// `sq_depth` not in `1..=65536`.
    SqDepth(usize),
    /// No local buffer given.
    NoBuffers,
    /// A local buffer shorter than the block size.
    BufferTooSmall {
        /// Position in the list.
        index: usize,
        /// Its length.
        len: u32,
        /// The block size.
        block_size: u64,
    },
    /// Two buffers with the same address.
    DuplicateBuffer {
        /// The address.
        addr: u64,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ConfigError::Batch(e) => e.fmt(f),
            ConfigError::BlockSize(e) => e.fmt(f),
            ConfigError::SqDepth(d) => {
                write!(f, "sq_depth = {d} is out of range (1..={MAX_SLOTS})")
            }
            ConfigError::NoBuffers => f.write_str("no local buffers"),
            ConfigError::BufferTooSmall {
                index,
                len,
                block_size,
            } => write!(
                f,
                "local buffer {index} has {len} bytes, less than the block size {block_size}"
            ),
            ConfigError::DuplicateBuffer { addr } => {
                write!(f, "local buffer address {addr:#x} given twice")
            }
        }
    }
}

impl std::error::Error for ConfigError {}

/// A call the transfer's state does not allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferError {
    /// The transfer is complete or failed; nothing to reconnect.
    Terminal,
    /// [`Transfer::post_failed`] got a batch that is not the latest one.
    NotLastBatch,
    /// [`Transfer::release_buffer`] got a buffer that is not lent out.
    BufferNotLent {
        /// Its address.
        addr: u64,
    },
}

impl fmt::Display for TransferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            TransferError::Terminal => f.write_str("transfer is complete or failed"),
            TransferError::NotLastBatch => {
                f.write_str("post_failed must be given the latest batch, before the next poll")
            }
            TransferError::BufferNotLent { addr } => {
                write!(f, "buffer {addr:#x} is not lent out by a BlockDone")
            }
        }
    }
}

impl std::error::Error for TransferError {}

/// One chain to post with one doorbell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Epoch the requests belong to.
    pub epoch: u32,
    /// The requests, in post order.
    pub wrs: Vec<WorkRequest>,
    /// `blocks[i]` is the file range of `wrs[i]` (fill it before a write).
    pub blocks: Vec<BlockSpan>,
}

/// What started the error path of an epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCause {
    /// A completion with a non-success status.
    Completion {
        /// Its `wr_id`.
        wr_id: u64,
        /// Its status.
        status: WcStatus,
        /// The block of that request.
        block: u64,
    },
    /// A request outstanding longer than the timeout.
    Timeout {
        /// The oldest expired `wr_id`.
        wr_id: u64,
    },
    /// The runtime reported the connection gone.
    ConnectionLost,
}

/// What the runtime should do about an error batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recovery {
    /// Replace the queue pair, then call [`Transfer::reconnected`].
    Reconnect,
    /// Give up; see [`State::Failed`].
    Fail,
}

/// Something the runtime must act on or report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// A block is confirmed. For a pull, write `local` (first `len` bytes) to
    /// the file at `file_offset`; then [`Transfer::release_buffer`] it.
    BlockDone {
        /// Block index.
        block: u64,
        /// The local buffer holding (pull) or that held (push) the data.
        local: LocalSeg,
        /// File offset of the block.
        file_offset: u64,
        /// Bytes.
        len: u32,
    },
    /// Every block of a window is confirmed; the window is no longer live.
    WindowDone {
        /// Window id.
        window_id: u64,
    },
    /// The epoch failed: posting stopped.
    ErrorBatch {
        /// The failed epoch.
        epoch: u32,
        /// What failed first.
        cause: ErrorCause,
        /// Reconnect or give up.
        action: Recovery,
    },
    /// A request expired; its context is freed (log it).
    Timeout {
        /// Its `wr_id`.
        wr_id: u64,
        /// Its block.
        block: u64,
    },
    /// Every request of the failed epoch is accounted for.
    ReadyToReconnect {
        /// The failed epoch.
        epoch: u32,
        /// Blocks that will be posted again.
        unconfirmed: u64,
    },
}

/// Where the transfer stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Posting and completing.
    Running,
    /// An error arrived: not posting, absorbing the epoch's remaining
    /// completions.
    Flushing,
    /// Nothing outstanding; waiting for [`Transfer::reconnected`].
    NeedsReconnect,
    /// Given up (terminal).
    Failed {
        /// The status that decided it, if a completion did.
        status: Option<WcStatus>,
        /// The block of that completion.
        block: Option<u64>,
        /// Why.
        reason: &'static str,
    },
    /// Every block confirmed (terminal).
    Complete,
}

/// Running totals, for metrics and logs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Requests posted.
    pub posted: u64,
    /// Chains posted (doorbells rung).
    pub doorbells: u64,
    /// Signaled requests posted.
    pub signaled: u64,
    /// Inline requests posted.
    pub inline: u64,
    /// Completions received (all, including stale).
    pub completions: u64,
    /// Non-success completions by [`WcStatus::label`].
    pub errors: BTreeMap<&'static str, u64>,
    /// Completions whose `wr_id` named no live request (old epoch, reused
    /// slot, duplicate).
    pub stale: u64,
    /// Requests that expired.
    pub timeouts: u64,
    /// Epochs that failed.
    pub error_batches: u64,
    /// Reconnects (epochs started after the first).
    pub reconnects: u64,
    /// Blocks put back to pending by a failed epoch.
    pub reposted: u64,
    /// Calls to [`Transfer::post_failed`].
    pub post_failures: u64,
    /// Blocks confirmed.
    pub blocks_confirmed: u64,
}

#[derive(Clone, Copy, Debug)]
struct Ctx {
    block: u64,
    buf: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Buf {
    Free,
    Posted,
    Lent,
}

/// The state of one transfer over one queue pair. See the module docs.
#[derive(Debug)]
pub struct Transfer {
    cfg: TransferConfig,
    plan: BlockPlan,
    blocks: BlockStates,
    windows: Windows,
    /// Block ranges in live windows waiting to be posted, in order.
    ready: VecDeque<Range<u64>>,
    credits: Credits,
    slots: Slots<Ctx>,
    inflight: InFlight,
    bufs: Vec<LocalSeg>,
    buf_state: Vec<Buf>,
    free_bufs: Vec<u32>,
    buf_by_addr: HashMap<u64, u32>,
    epoch: u32,
    state: State,
    /// Blocks of the failed epoch to post again after the reconnect.
    unconfirmed: Vec<u64>,
    confirmed_in_epoch: u64,
    fruitless_epochs: u32,
    bytes_confirmed: u64,
    events: VecDeque<Event>,
    counters: Counters,
    scratch: Vec<WrId>,
}

impl Transfer {
    /// A transfer in epoch 0 with no windows yet, staging through `buffers`
    /// (each at least one block long; at most `buffers.len()` blocks are in
    /// flight or lent out at once).
    pub fn new(cfg: TransferConfig, buffers: Vec<LocalSeg>) -> Result<Self, ConfigError> {
        cfg.batch.validate().map_err(ConfigError::Batch)?;
        let plan = BlockPlan::new(cfg.file_len, cfg.block_size).map_err(ConfigError::BlockSize)?;
        if !(1..=MAX_SLOTS).contains(&cfg.sq_depth) {
            return Err(ConfigError::SqDepth(cfg.sq_depth));
        }
        if buffers.is_empty() {
            return Err(ConfigError::NoBuffers);
        }
        let mut buf_by_addr = HashMap::with_capacity(buffers.len());
        for (index, b) in buffers.iter().enumerate() {
            if u64::from(b.len) < cfg.block_size {
                return Err(ConfigError::BufferTooSmall {
                    index,
                    len: b.len,
                    block_size: cfg.block_size,
                });
            }
            if buf_by_addr.insert(b.addr, index as u32).is_some() {
                return Err(ConfigError::DuplicateBuffer { addr: b.addr });
            }
        }
        let blocks = BlockStates::new(plan.count());
        let state = if blocks.all_done() {
            State::Complete
        } else {
            State::Running
        };
        Ok(Transfer {
            cfg,
            plan,
            blocks,
            windows: Windows::new(plan),
            ready: VecDeque::new(),
            credits: Credits::new(cfg.sq_depth),
            slots: Slots::new(cfg.sq_depth, 0),
            inflight: InFlight::with_capacity(cfg.sq_depth),
            buf_state: vec![Buf::Free; buffers.len()],
            free_bufs: (0..buffers.len() as u32).rev().collect(),
            bufs: buffers,
            buf_by_addr,
            epoch: 0,
            state,
            unconfirmed: Vec::new(),
            confirmed_in_epoch: 0,
            fruitless_epochs: 0,
            bytes_confirmed: 0,
            events: VecDeque::new(),
            counters: Counters::default(),
            scratch: Vec::new(),
        })
    }

    /// Accept a window grant; its unconfirmed blocks become postable (after
    /// those already waiting). A window whose blocks are all confirmed yields
    /// [`Event::WindowDone`] at once.
    pub fn add_window(&mut self, w: Window) -> Result<(), WindowError> {
        self.windows.validate(&w)?;
        let range = w.blocks(&self.plan);
        let remaining = range
            .clone()
            .filter(|&b| self.blocks.get(b) != BlockState::Done)
            .count() as u64;
        self.windows.insert(w, remaining)?;
        if remaining == 0 {
            self.events.push_back(Event::WindowDone { window_id: w.id });
        } else {
            self.ready.push_back(range);
        }
        Ok(())
    }

    /// Next postable block of a live window, skipping confirmed ones.
    fn next_ready(&mut self) -> Option<BlockSpan> {
        while let Some(r) = self.ready.front_mut() {
            let Some(b) = r.next() else {
                self.ready.pop_front();
                continue;
            };
            if self.blocks.get(b) == BlockState::Pending {
                return self.plan.block(b);
            }
        }
        None
    }

    /// The next chain to post, or `None` if nothing can be posted now (not
    /// running, no credits, no free buffer, or no block in a live window).
    /// The returned requests are already accounted as posted at `now`.
    pub fn poll_transmit(&mut self, now: u64) -> Option<Batch> {
        if self.state != State::Running {
            return None;
        }
        let room = self
            .cfg
            .batch
            .chain_len(self.credits.available().min(self.free_bufs.len()));
        let mut spans = Vec::with_capacity(room);
        while spans.len() < room {
            let Some(s) = self.next_ready() else { break };
            // A chain ends with a window's last block, so that block's WR is
            // signaled and the window is confirmed as soon as it lands,
            // not when a chain reaching into later windows does; the
            // caller also gets to post one window while it fills the next.
            let ends_window = self
                .windows
                .find(s.file_offset)
                .is_some_and(|w| s.file_offset + u64::from(s.len) >= w.end());
            spans.push(s);
            if ends_window {
                break;
            }
        }
        if spans.is_empty() {
            return None;
        }
        let n = spans.len();
        let took = self.credits.try_take(n);
        debug_assert_eq!(took, n);
        let mut wrs = Vec::with_capacity(n);
        for (i, span) in spans.iter().enumerate() {
            let signaled = self.cfg.batch.is_signaled(i, n);
            let buf = self.free_bufs.pop().expect("room counted free buffers");
            self.buf_state[buf as usize] = Buf::Posted;
            let remote = self
                .windows
                .find(span.file_offset)
                .expect("ready blocks lie in live windows")
                .remote_for(span);
            let b = self.bufs[buf as usize];
            let local = LocalSeg {
                addr: b.addr,
                len: span.len,
                lkey: b.lkey,
            };
            let ctx = Ctx {
                block: span.index,
                buf,
            };
            let id = self
                .slots
                .alloc(ctx, now, signaled)
                .expect("a slot per credit");
            self.inflight.push(id);
            self.blocks.set_in_flight(span.index, self.epoch);
            let inline = self.cfg.op == OpKind::Write
                && self.cfg.max_inline > 0
                && span.len <= self.cfg.max_inline;
            self.counters.signaled += u64::from(signaled);
            self.counters.inline += u64::from(inline);
            wrs.push(WorkRequest {
                wr_id: id.0,
                kind: self.cfg.op,
                local,
                remote,
                signaled,
                inline,
            });
        }
        self.counters.posted += n as u64;
        self.counters.doorbells += 1;
        Some(Batch {
            epoch: self.epoch,
            wrs,
            blocks: spans,
        })
    }

    /// The provider accepted only the first `posted` requests of `batch`
    /// (the latest one from [`poll_transmit`](Self::poll_transmit)); the rest
    /// go back to pending with their credits, slots and buffers. A batch whose
    /// requests the error path already took back is ignored.
    pub fn post_failed(&mut self, batch: &Batch, posted: usize) -> Result<(), TransferError> {
        let unposted = &batch.wrs[posted.min(batch.wrs.len())..];
        if unposted.is_empty() {
            return Ok(());
        }
        let live = |t: &Self, wr: &WorkRequest| t.slots.get(WrId(wr.wr_id)).is_ok();
        if batch.epoch != self.epoch || !unposted.iter().any(|wr| live(self, wr)) {
            return Ok(());
        }
        if !unposted.iter().all(|wr| live(self, wr)) {
            return Err(TransferError::NotLastBatch);
        }
        // Undo newest first; each must be the queue's newest.
        for wr in unposted.iter().rev() {
            let id = WrId(wr.wr_id);
            if !self.inflight.pop_newest_if(id) {
                return Err(TransferError::NotLastBatch);
            }
            let slot = self.slots.free(id).expect("checked live");
            self.free_buffer(slot.user.buf);
            self.blocks.set_pending(slot.user.block);
            self.ready.push_front(slot.user.block..slot.user.block + 1);
            self.give_credits(1);
            self.counters.posted -= 1;
            self.counters.signaled -= u64::from(wr.signaled);
            self.counters.inline -= u64::from(wr.inline);
        }
        if posted == 0 {
            self.counters.doorbells -= 1;
        }
        self.counters.post_failures += 1;
        Ok(())
    }

    fn give_credits(&mut self, n: usize) {
        let r = self.credits.give(n);
        debug_assert!(r.is_ok(), "engine over-returned credits: {r:?}");
    }

    fn free_buffer(&mut self, buf: u32) {
        self.buf_state[buf as usize] = Buf::Free;
        self.free_bufs.push(buf);
    }

    /// Feed one completion. Stale ones (old epoch, reused slot, duplicate)
    /// are counted and ignored.
    pub fn on_completion(&mut self, wc: &WorkCompletion) {
        self.counters.completions += 1;
        if !wc.status.is_success() {
            *self.counters.errors.entry(wc.status.label()).or_default() += 1;
        }
        let id = WrId(wc.wr_id);
        let block = match self.slots.get(id) {
            Ok(s) => s.user.block,
            Err(_) => {
                self.counters.stale += 1;
                return;
            }
        };
        match self.state {
            State::Running | State::Flushing => {}
            // Outstanding requests of a failed transfer: nothing to do.
            _ => return,
        }
        if wc.status.is_success() {
            self.retire_confirmed(id);
        } else {
            if self.state == State::Running {
                let cause = ErrorCause::Completion {
                    wr_id: wc.wr_id,
                    status: wc.status,
                    block,
                };
                self.enter_error(
                    cause,
                    Some(wc.status),
                    Some(block),
                    wc.status.is_retryable(),
                );
            } else if !wc.status.is_retryable() {
                self.fail(
                    Some(wc.status),
                    Some(block),
                    "non-retryable completion status",
                );
                self.events.push_back(Event::ErrorBatch {
                    epoch: self.epoch,
                    cause: ErrorCause::Completion {
                        wr_id: wc.wr_id,
                        status: wc.status,
                        block,
                    },
                    action: Recovery::Fail,
                });
            }
            self.retire_unconfirmed(id);
        }
        if self.state == State::Flushing && self.inflight.is_empty() {
            self.drained();
        }
    }

    /// Feed several completions in order.
    pub fn on_completions(&mut self, wcs: &[WorkCompletion]) {
        for wc in wcs {
            self.on_completion(wc);
        }
    }

    /// `id` succeeded: it and every earlier request are confirmed.
    fn retire_confirmed(&mut self, id: WrId) {
        let mut ids = std::mem::take(&mut self.scratch);
        ids.extend(
            self.inflight
                .retire_through(id)
                .expect("live ids are queued"),
        );
        for &rid in &ids {
            let slot = self.slots.free(rid).expect("queued ids are live");
            self.give_credits(1);
            let Ctx { block, buf } = slot.user;
            self.buf_state[buf as usize] = Buf::Lent;
            let span = self.plan.block(block).expect("planned block");
            let fresh = self.blocks.set_done(block);
            debug_assert!(fresh, "block {block} confirmed twice");
            self.bytes_confirmed += u64::from(span.len);
            self.confirmed_in_epoch += 1;
            self.counters.blocks_confirmed += 1;
            let b = self.bufs[buf as usize];
            self.events.push_back(Event::BlockDone {
                block,
                local: LocalSeg {
                    addr: b.addr,
                    len: span.len,
                    lkey: b.lkey,
                },
                file_offset: span.file_offset,
                len: span.len,
            });
            if let Some(window_id) = self.windows.block_done(span.file_offset) {
                self.events.push_back(Event::WindowDone { window_id });
            }
        }
        ids.clear();
        self.scratch = ids;
        if self.blocks.all_done() && matches!(self.state, State::Running | State::Flushing) {
            self.state = State::Complete;
        }
    }

    /// `id` failed: it and every earlier request are unconfirmed.
    fn retire_unconfirmed(&mut self, id: WrId) {
        let mut ids = std::mem::take(&mut self.scratch);
        ids.extend(
            self.inflight
                .retire_through(id)
                .expect("live ids are queued"),
        );
        for &rid in &ids {
            self.unconfirm(rid);
        }
        ids.clear();
        self.scratch = ids;
    }

    /// Every outstanding request is unconfirmed (the queue pair is gone).
    fn abandon_outstanding(&mut self) {
        let mut ids = std::mem::take(&mut self.scratch);
        ids.extend(self.inflight.drain_all());
        for &rid in &ids {
            self.unconfirm(rid);
        }
        ids.clear();
        self.scratch = ids;
    }

    /// Free a request's slot and buffer; its block waits for the reconnect.
    /// Its credit stays taken until the queue pair is replaced.
    fn unconfirm(&mut self, id: WrId) {
        let slot = self.slots.free(id).expect("queued ids are live");
        self.free_buffer(slot.user.buf);
        self.blocks.set_pending(slot.user.block);
        self.unconfirmed.push(slot.user.block);
    }

    fn fail(&mut self, status: Option<WcStatus>, block: Option<u64>, reason: &'static str) {
        self.state = State::Failed {
            status,
            block,
            reason,
        };
    }

    /// First failure of the epoch: stop posting, decide the recovery.
    fn enter_error(
        &mut self,
        cause: ErrorCause,
        status: Option<WcStatus>,
        block: Option<u64>,
        retryable: bool,
    ) {
        debug_assert_eq!(self.state, State::Running);
        self.counters.error_batches += 1;
        if self.confirmed_in_epoch == 0 {
            self.fruitless_epochs += 1;
        } else {
            self.fruitless_epochs = 0;
        }
        let action = if !retryable {
            self.fail(status, block, "non-retryable completion status");
            Recovery::Fail
        } else if self.fruitless_epochs > self.cfg.max_retries {
            self.fail(
                status,
                block,
                "retry budget exhausted: too many epochs in a row confirmed nothing",
            );
            Recovery::Fail
        } else {
            self.state = State::Flushing;
            Recovery::Reconnect
        };
        self.events.push_back(Event::ErrorBatch {
            epoch: self.epoch,
            cause,
            action,
        });
    }

    /// Nothing outstanding in a failed epoch.
    fn drained(&mut self) {
        self.state = State::NeedsReconnect;
        self.events.push_back(Event::ReadyToReconnect {
            epoch: self.epoch,
            unconfirmed: self.unconfirmed.len() as u64,
        });
    }

    /// When [`poll_timeout`](Self::poll_timeout) next has work: the oldest
    /// outstanding request's post time plus the timeout. `None` if timeouts
    /// are disabled or nothing is outstanding.
    pub fn next_timeout(&self) -> Option<u64> {
        if self.cfg.request_timeout_ns == 0 {
            return None;
        }
        let oldest = self.inflight.oldest()?;
        let slot = self.slots.get(oldest).ok()?;
        Some(slot.posted_at.saturating_add(self.cfg.request_timeout_ns))
    }

    /// Expire requests outstanding for the timeout or longer: each is freed
    /// and reported ([`Event::Timeout`]); the queue pair is then presumed
    /// stuck, so every outstanding request is unconfirmed and the transfer
    /// needs a reconnect (or fails if the retry budget is spent).
    pub fn poll_timeout(&mut self, now: u64) {
        if self.cfg.request_timeout_ns == 0
            || !matches!(self.state, State::Running | State::Flushing)
        {
            return;
        }
        let expired = self.slots.expired(now, self.cfg.request_timeout_ns);
        let Some(&first) = expired.first() else {
            return;
        };
        for id in &expired {
            let block = self
                .slots
                .get(*id)
                .expect("expired ids are live")
                .user
                .block;
            self.counters.timeouts += 1;
            self.events.push_back(Event::Timeout { wr_id: id.0, block });
        }
        if self.state == State::Running {
            self.enter_error(ErrorCause::Timeout { wr_id: first.0 }, None, None, true);
        }
        self.abandon_outstanding();
        if self.state == State::Flushing {
            self.drained();
        }
    }

    /// The runtime lost the connection (async QP error, TCP reset): every
    /// outstanding request is unconfirmed and the transfer needs a reconnect
    /// (or fails if the retry budget is spent). No-op unless running or
    /// flushing.
    pub fn connection_lost(&mut self) {
        match self.state {
            State::Running => self.enter_error(ErrorCause::ConnectionLost, None, None, true),
            State::Flushing => {}
            _ => return,
        }
        self.abandon_outstanding();
        if self.state == State::Flushing {
            self.drained();
        }
    }

    /// The runtime replaced the queue pair. Starts the next epoch and returns
    /// it: credits are full again, slots of older epochs are gone (their
    /// completions count as stale), and exactly the unconfirmed blocks are
    /// posted again, first. Confirmed blocks are never posted again. Anything
    /// still outstanding is abandoned as unconfirmed.
    pub fn reconnected(&mut self) -> Result<u32, TransferError> {
        if matches!(self.state, State::Failed { .. } | State::Complete) {
            return Err(TransferError::Terminal);
        }
        self.abandon_outstanding();
        self.epoch = self.epoch.wrapping_add(1);
        let leftover = self.slots.clear(self.epoch);
        debug_assert!(leftover.is_empty());
        self.credits.reset();
        let mut again = std::mem::take(&mut self.unconfirmed);
        again.sort_unstable();
        again.dedup();
        self.counters.reposted += again.len() as u64;
        // Push runs of consecutive blocks to the front, keeping order.
        let mut runs: Vec<Range<u64>> = Vec::new();
        for b in again {
            match runs.last_mut() {
                Some(r) if r.end == b => r.end += 1,
                _ => runs.push(b..b + 1),
            }
        }
        for r in runs.into_iter().rev() {
            self.ready.push_front(r);
        }
        self.counters.reconnects += 1;
        self.confirmed_in_epoch = 0;
        self.state = State::Running;
        Ok(self.epoch)
    }

    /// Hand back a buffer lent by [`Event::BlockDone`] once its data is
    /// written to the file (pull) or right away (push).
    pub fn release_buffer(&mut self, local: LocalSeg) -> Result<(), TransferError> {
        let addr = local.addr;
        match self.buf_by_addr.get(&addr) {
            Some(&i) if self.buf_state[i as usize] == Buf::Lent => {
                self.free_buffer(i);
                Ok(())
            }
            _ => Err(TransferError::BufferNotLent { addr }),
        }
    }

    /// Next queued event, oldest first.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Every block confirmed.
    pub fn is_complete(&self) -> bool {
        self.blocks.all_done()
    }

    /// Where the transfer stands.
    pub fn state(&self) -> State {
        self.state
    }

    /// Current epoch (0 until the first reconnect).
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// Bytes in confirmed blocks.
    pub fn bytes_confirmed(&self) -> u64 {
        self.bytes_confirmed
    }

    /// The block plan.
    pub fn plan(&self) -> &BlockPlan {
        &self.plan
    }

    /// State of block `i`.
    pub fn block_state(&self, i: u64) -> BlockState {
        self.blocks.get(i)
    }

    /// Blocks the failed epoch left unconfirmed so far, unordered; they are
    /// posted again after [`reconnected`](Self::reconnected). Empty while
    /// running.
    pub fn unconfirmed(&self) -> &[u64] {
        &self.unconfirmed
    }

    /// Requests posted and not yet retired.
    pub fn outstanding(&self) -> usize {
        self.inflight.len()
    }

    /// Send-queue credits taken (never above `sq_depth`).
    pub fn credits_in_use(&self) -> usize {
        self.credits.in_use()
    }

    /// Local buffers free for new posts.
    pub fn free_buffers(&self) -> usize {
        self.free_bufs.len()
    }

    /// Running totals.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }
}

#[cfg(test)]
mod tests;
