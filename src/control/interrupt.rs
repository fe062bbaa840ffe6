//! SIGINT and SIGTERM during `rcp push/pull`: the binary [`raise`]s the
//! signal it caught; every Move stream driver waiting on [`wait`] aborts its
//! copy (an Abort frame to rcpd, the verified blocks kept on both sides for
//! `--resume`) and the job ends with [`Reason::Interrupted`]. The binary then
//! says what was done, how to continue, and exits with [`Signal::exit_code`].
//!
//! Process-wide, as signals are.

use std::sync::atomic::{AtomicU8, Ordering};

use tokio::sync::Notify;

use super::error::{exit, Reason};
use super::protocol::Failure;

/// The signals that end a copy cleanly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Int,
    Term,
}

impl Signal {
    pub fn name(self) -> &'static str {
        match self {
            Signal::Int => "SIGINT",
            Signal::Term => "SIGTERM",
        }
    }

    /// The shell's habit: 128 + the signal's number.
    pub fn exit_code(self) -> i32 {
        match self {
            Signal::Int => exit::INTERRUPTED,
            Signal::Term => exit::TERMINATED,
        }
    }

    /// What an aborted copy fails with.
    pub fn failure(self) -> Failure {
        Failure::new(
            Reason::Interrupted,
            format!("interrupted by {}", self.name()),
        )
    }
}

/// Where a signal is recorded and waited for: one per process ([`raise`],
/// [`raised`], [`wait`]); the tests make their own.
struct Interrupts {
    /// 0: none yet; 1 + the signal's index.
    raised: AtomicU8,
    notify: Notify,
}

impl Interrupts {
    const fn new() -> Self {
        Interrupts {
            raised: AtomicU8::new(0),
            notify: Notify::const_new(),
        }
    }

    fn raise(&self, sig: Signal) {
        let v = match sig {
            Signal::Int => 1,
            Signal::Term => 2,
        };
        let _ = self
            .raised
            .compare_exchange(0, v, Ordering::SeqCst, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    fn raised(&self) -> Option<Signal> {
        match self.raised.load(Ordering::SeqCst) {
            1 => Some(Signal::Int),
            2 => Some(Signal::Term),
            _ => None,
        }
    }

    async fn wait(&self) -> Signal {
        loop {
            // Registered before the flag is read: a raise in between still
            // wakes it.
            let woken = self.notify.notified();
            if let Some(s) = self.raised() {
                return s;
            }
            woken.await;
        }
    }
}

static PROCESS: Interrupts = Interrupts::new();

/// A signal arrived: every [`wait`] returns it (the first one raised stays).
pub fn raise(sig: Signal) {
    PROCESS.raise(sig)
}

/// The signal raised, if one was.
pub fn raised() -> Option<Signal> {
    PROCESS.raised()
}

/// Until a signal is raised (at once if one was).
pub async fn wait() -> Signal {
    PROCESS.wait().await
}

/// The failure of a copy the signal ended, if one was raised.
pub fn failure() -> Option<Failure> {
    raised().map(Signal::failure)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_waiter_sees_the_first_signal() {
        // Not the process's: a raise there would abort every copy of the
        // tests running beside this one.
        static I: Interrupts = Interrupts::new();
        let w = tokio::spawn(I.wait());
        tokio::task::yield_now().await;
        assert_eq!(I.raised(), None);
        I.raise(Signal::Term);
        I.raise(Signal::Int);
        assert_eq!(w.await.unwrap(), Signal::Term);
        assert_eq!(I.wait().await, Signal::Term, "at once once raised");
        assert_eq!(Signal::Term.exit_code(), 143);
        assert_eq!(Signal::Int.exit_code(), 130);
    }
}
