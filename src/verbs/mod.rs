//! The verbs layer: safe RAII types over rdma-sys (libibverbs).
//!
//! Ownership follows the verbs object tree: a [`QueuePair`] holds its
//! [`ProtectionDomain`] and [`CompletionQueue`]s, which hold the
//! [`Context`]; a [`MemoryRegion`] holds its PD and the arena mapping it
//! covers; a [`MemoryWindow`] holds its PD and, while it may be bound, the
//! region it is bound into. Nothing is destroyed while a child lives.
//!
//! Every queue pair is built by [`QpBuilder`] (`qp.rs`): it sizes the QP
//! and its completion queue in one place, from the device's queried caps,
//! and gives a [`PreparedQp`] in INIT whose handshake with the peer's
//! endpoint takes it to RTS (or which becomes a provider channel still in
//! INIT, `into_channel` in [`crate::provider::verbs`]).
//!
//! `unsafe` invariants, where they live:
//! - `ibv_*` handles are valid from creation to `Drop` (each type's `Drop`);
//! - registered memory stays mapped while its `MemoryRegion` lives (`pd.rs`);
//! - a memory window keeps its region registered while it may be bound, and
//!   one whose bind or invalidate did not succeed is revoked by
//!   deallocation, never reused (`mw.rs`);
//! - [`QueuePair::post_send`] is `unsafe`: the caller owns each local buffer
//!   until the completion that retires its request (`qp.rs`);
//! - a message QP's receives and SENDs own their blocks until their
//!   completions, and the QP goes before the blocks (`messages.rs`);
//! - every completion event is acked before the CQ is destroyed (`cq.rs`);
//! - every async event is acked right after it is copied out, so no QP or CQ
//!   destroy waits on it (`events.rs`).

pub mod counts;
pub mod cq;
pub mod device;
pub mod error;
pub mod events;
pub mod gid;
pub mod messages;
pub mod mw;
pub mod pd;
pub mod post;
pub mod qp;

pub use counts::{counts, VerbsCounts};
pub use cq::{CompletionChannel, CompletionQueue, POLL_BATCH};
pub use device::{
    device_names, gid_table, Context, DeviceCaps, LinkLayer, MemWindowCaps, PortAttr, PortState,
};
pub use error::{Hint, VerbsError};
pub use events::{AsyncEvent, AsyncEventKind, AsyncEvents, PortWatcher};
pub use gid::{choose_gid, Gid, GidChoice, GidEntry, GidType};
pub use mw::{MemoryWindow, MwPool, MwState};
pub use pd::{Access, MemoryRegion, ProtectionDomain};
pub use post::PostScratch;
pub use qp::{
    sq_entries, ConnectParams, PostError, PreparedQp, QpBuilder, QpEndpoint, QpState, QueuePair,
};
