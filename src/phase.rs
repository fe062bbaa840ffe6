//! Set-up timing of a copy, for measuring (issue 21): with `RCP_PHASES=1` in
//! the environment, [`mark`] prints one line per phase on stderr,
//! `rcp phase <ms> <what>`, the milliseconds since [`start`] (the binary
//! calls it first thing in `main`; the time before it, exec and dynamic
//! linking, is not counted). Without the variable a mark is one relaxed
//! load.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::Instant;

static T0: OnceLock<Instant> = OnceLock::new();
/// 0: not looked at yet, 1: off, 2: on.
static ON: AtomicU8 = AtomicU8::new(0);
static FIRST_WINDOW: AtomicBool = AtomicBool::new(false);

fn on() -> bool {
    match ON.load(Relaxed) {
        0 => {
            let on = std::env::var_os("RCP_PHASES").is_some_and(|v| v != "0" && !v.is_empty());
            ON.store(if on { 2 } else { 1 }, Relaxed);
            on
        }
        v => v == 2,
    }
}

/// Start the clock (the first call wins).
pub fn start() {
    T0.get_or_init(Instant::now);
}

/// Print `what` with the time since [`start`], when `RCP_PHASES` is set.
pub fn mark(what: &str) {
    if on() {
        let ms = T0.get_or_init(Instant::now).elapsed().as_secs_f64() * 1e3;
        eprintln!("rcp phase {ms:8.3} {what}");
    }
}

/// [`mark`] the first window handed to the data path, once per process.
pub fn first_window() {
    if on() && !FIRST_WINDOW.swap(true, Relaxed) {
        mark("first window submitted to the data path");
    }
}
