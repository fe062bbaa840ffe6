//! Registered memory: the hugepage arena, its blocks, NUMA placement and the
//! locked-memory limit.
//!
//! `unsafe` here is limited to mapping, binding and slicing the arena. The
//! invariants: the mapping lives until the last [`Arena`], [`Block`],
//! [`PeerSpan`] or memory registration holding its `Arc` is dropped; a
//! [`Block`] is the single owner of its bytes; while a work request naming a
//! block is in flight the device owns those bytes until the completion that
//! retires it, and the data path does not touch them. [`PeerSpan`]s alias
//! (they are `Clone`, several may cover the same bytes): writing through one
//! ([`PeerSpan::with_mut`]) is `unsafe`, its caller vouching that no request,
//! grant or other borrower touches the range meanwhile.

pub mod arena;
pub mod memfd;
pub mod memlock;
pub mod numa;

pub use arena::{Arena, ArenaConfig, ArenaError, Backing, Block, BlockPool, PeerSpan, HUGE_PAGE};
pub use memlock::{ensure_lockable, MemlockError};
