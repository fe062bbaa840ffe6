//! The session data path: one [`DataPath`] per session drives an engine
//! [`Stream`] over one provider [`Channel`], or over several (*rails*, one
//! channel each), for as long as the session lasts.
//!
//! Threads, all started by [`DataPath::start`] / [`DataPath::start_rails`]
//! and all living until [`DataPath::close`] (or drop):
//! - the *posting thread* (`rcp-post`) owns the `Stream`. It waits on one
//!   input queue that carries the completion threads' batches, the windows
//!   [`DataPath::submit`] hands in (so a submission wakes it at once) and
//!   the reconnect helpers' and port watchers' news, absorbs everything
//!   queued, acts on the stream's events (`WindowDone` →
//!   [`DpEvent::WindowDone`], rail events → `DpEvent::Rail*`), asks for
//!   reconnects, posts every chain the stream allows (one `post` per chain
//!   on the chain's rail, the engine's batches reused, no allocation per
//!   request) and publishes the engine's counters into [`DataPathStats`].
//!   With a rate limit it takes each chain's bytes from a [`TokenBucket`]
//!   first; short of tokens it waits on its input queue until the bucket
//!   will hold them, so completions and submissions are still taken at
//!   once meanwhile (no spinning, no sleep that delays them). With nothing
//!   queued and nothing outstanding it blocks (no spinning); in poll mode,
//!   with requests outstanding, it spins [`POSTER_SPIN`] for the next
//!   batch before it parks. While pinned completion threads poll (poll,
//!   hybrid), it keeps off their CPUs ([`AvoidCpu`]). It never sleeps in a
//!   backoff or blocks in a reconnect.
//! - a *completion thread* per rail (`rcp-cq`), pinned per its rail's CQ
//!   CPU (or `cq_cpu`), runs [`completion_loop`] (poll / event / hybrid)
//!   and sends every non-empty batch, stamped with the time it was polled
//!   and its rail, to the posting thread.
//! - a *reconnect helper* per rail (`rcp-rail`), idle until the posting
//!   thread asks it to bring its rail back: it fences the rail's queue pair
//!   (the rail's [`FenceFn`], if any), waits out the rail's cool-down, waits
//!   for `PORT_ACTIVE` while a [`PortMonitor`] says the port is down, and
//!   calls the rail's reconnect callback with [`Backoff`],
//!   then tells the posting thread. The other rails post meanwhile.
//! - with several rails, a *port watcher* per rail that has a
//!   [`PortMonitor`] (`rcp-port`): the port going down is the rail's
//!   failure (Soft-RoCE retries a dead link forever, so the port event may
//!   come first and alone). A one-rail data path consults its monitor only
//!   in the reconnect, as before.
//!
//! # One rail
//!
//! The error path is the engine's one-rail protocol: on an error batch the
//! posting thread waits (at most `flush_timeout`) for the failed epoch's
//! flushes, then has the helper reconnect (waiting for the port, with
//! backoff); [`Stream::rail_reconnected`] posts exactly the unconfirmed extents
//! again and [`DpEvent::Reconnected`] is reported. A terminal failure is one
//! [`DpEvent::Failed`]; every window not done by then is lost.
//!
//! # Several rails
//!
//! A rail's error batch, request timeout, post failure or port going down
//! fences it in the engine ([`crate::engine::stream::rail`]): its
//! outstanding extents are posted on the surviving rails at once
//! ([`DpEvent::RailDown`], [`DpEvent::RailFenced`]), its helper brings it
//! back in the background ([`DpEvent::RailUp`]), and a rail that keeps
//! failing is paused ([`DpEvent::RailPaused`], [`RailPause`](super::RailPause)).
//! All rails down: the stream waits for a reconnect under the same retry
//! budget; a reconnect given up with no rail running fails the data path
//! (as one rail's does), with another rail running it pauses the rail.
//!
//! What the caller must do with several rails:
//! - on [`DpEvent::RailFenced`], fence the named windows' remote regions
//!   before reusing them for other data: the failed rail's queue pair
//!   could still land a delayed WRITE there (reset the peer's QP of that
//!   rail, which the rail's reconnect does, or invalidate the region's rkey
//!   and grant the next data under a new one). Do not invalidate a named
//!   window's rkey while it is live: its extents are posted again with it.
//!   Locally nothing is needed: the data path raises `WindowDone` only once
//!   no rail's device can touch the window's staging memory any more
//!   (flushes, the rail's [`FenceFn`] or its reconnect retire its zombie
//!   requests). Give each rail a fence callback (verbs: move the QP to the
//!   error state) so that a rail whose port is down does not hold windows
//!   until it is reconnected.
//! - register every window's memory with every rail's provider; where the
//!   keys differ per rail (rails on different devices), give the rail a key
//!   map ([`RailSpec::keys`]) from the window's (rail 0's) keys to its own.
//!
//! Counting: the engine's [`Counters`](crate::engine::stream::Counters)
//! (of the stream and of each rail) are the one count of requests posted,
//! doorbells, signaled, inline, completions, errors, failures and post
//! failures; [`Report`] and [`DataPathStats`] hold copies of them. The completion threads count only their own polls, arms,
//! waits and wakeups; this runner only what the engine cannot see (post →
//! completion latency of signaled requests, reconnect, fail-over and port
//! times).
//!
//! # Modules
//!
//! - `handle`: [`DataPath`], the caller's side: start (the threads, step
//!   by step), submit, events, close;
//! - `spec`: [`RailSpec`] and the callbacks a rail is given;
//! - `event`: [`DpEvent`] and [`DataPathError`];
//! - `msg`: what the threads pass each other: the posting thread's input
//!   queue (`Input`, with the completion threads' batches), the commands
//!   to a rail's helper (`Cmd`) and the state `handle` and the posting
//!   thread share (`Shared`);
//! - `poster`: the posting thread's state, loop and the stream's events;
//! - `post`: its posting (chains onto the rails' channels, the rate limit)
//!   and the counters it publishes;
//! - `recover`: its error path (reconnects asked for, rails rejoining,
//!   reconnects given up) and the recovery times it records;
//! - `helpers`: the threads beside it (a completion thread, a reconnect
//!   helper and a port watcher per rail);
//! - `close`: the posting thread's end: the last flushes, joining the
//!   threads, the [`Report`].

mod close;
mod event;
mod handle;
mod helpers;
mod msg;
mod post;
mod poster;
mod recover;
mod spec;

pub use event::{DataPathError, DpEvent, ReconnectError};
pub use handle::DataPath;
pub use poster::POSTER_SPIN;
pub use spec::{FenceFn, KeyMapFn, RailReconnectFn, RailSpec, ReconnectFn};

#[cfg(doc)]
use super::{
    completion::completion_loop, cpus::AvoidCpu, Backoff, DataPathStats, PortMonitor, Report,
    TokenBucket,
};
#[cfg(doc)]
use crate::{engine::Stream, provider::Channel};
