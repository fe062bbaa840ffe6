//! How a job runs over sessions, for the rcp binary, library callers and
//! rcpd's Copy API alike: the provider tried first, and the tcp fallback.
//!
//! With `--transport auto` a copy that tried verbs continues over the tcp
//! provider (rcpd of `--transport auto` serves both) when
//! - the verbs session cannot be set up (a device, QP or registration that
//!   fails, an rcpd that does not serve verbs), for any reason tcp need not
//!   share: not a refused token, a usage error, a protocol version or a
//!   limit; or
//! - its stream gave up on RDMA: every rail down past
//!   [`ClientOptions::tcp_fallback_after`](crate::control::client::ClientOptions::tcp_fallback_after)
//!   with blocks waiting, or the data path failing retryably
//!   ([`Session::fallback`]). The files not finished then move again over
//!   tcp with resume, so what was verified does not move twice.
//!
//! Either is said once, to the [`Watcher`] and in the log; an explicit
//! `--transport verbs` never falls back.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use futures::future::BoxFuture;

use super::{Plan, Totals};
use crate::control::client::{Client, FileJob, FileResult, Observer, Session, SessionStats};
use crate::control::error::{ControlError, Reason, Result};
use crate::control::fallback::{after_fallback, continuing, tcp_fallback};
use crate::control::link::resolve_transport;
use crate::provider::ProviderKind;

/// Where a job's sessions come from and where they go when it is done: a
/// [`Client`] opens a fresh one and closes it; a pool may keep them warm.
pub trait Sessions: Sync {
    /// The provider to try first, and why (for the user).
    fn first(&self) -> (ProviderKind, String);
    /// A session over `kind` (`why` said so).
    fn open(&self, kind: ProviderKind, why: String) -> BoxFuture<'_, Result<Session>>;
    /// The job is done with `s`; `ok`: its last stream ended well (a
    /// failed stream's session is never used again). What its data path
    /// did, when it was closed.
    fn finish(&self, s: Session, ok: bool) -> BoxFuture<'_, Option<SessionStats>>;
    /// Whether `s` came warm from a pool: if its stream fails before any
    /// file finished (the peer may have dropped it), the job runs once
    /// more on a fresh session.
    fn warm(&self, _s: &Session) -> bool {
        false
    }
}

impl Sessions for Client {
    fn first(&self) -> (ProviderKind, String) {
        let o = self.options();
        resolve_transport(o.transport, &o.rails)
    }

    fn open(&self, kind: ProviderKind, why: String) -> BoxFuture<'_, Result<Session>> {
        Box::pin(self.session_with(kind, why))
    }

    fn finish(&self, s: Session, _ok: bool) -> BoxFuture<'_, Option<SessionStats>> {
        Box::pin(async move { s.close().await.ok() })
    }
}

/// Watches a job: its files, and the sessions they move over.
pub trait Watcher: Observer {
    /// A session of the job is open (its provider, why, its check).
    fn session(&self, _s: &Session) {}
    /// The job leaves verbs for the tcp provider: why (one sentence).
    fn fell_back(&self, _why: &str) {}
}

/// What a job did.
#[derive(Debug)]
pub struct Outcome {
    pub totals: Totals,
    /// The provider the last files moved over.
    pub kind: ProviderKind,
    /// The block check the (last) session agreed on.
    pub check: crate::files::Check,
    /// Why the job left verbs for tcp, when it did.
    pub fell_back: Option<String>,
    /// What the last session's data path did (`None`: it was not closed
    /// cleanly, or a pool kept it open).
    pub stats: Option<SessionStats>,
    /// Whether a session was opened at all (not when every file was left
    /// as it was).
    pub session: bool,
}

/// Whether a stream's failure may be its session's, not the files': what
/// a peer that dropped or forgot the session (restarted) answers.
fn stale(e: &ControlError) -> bool {
    matches!(
        e.reason(),
        Reason::Retryable | Reason::Invalid | Reason::Other | Reason::Unspecified
    )
}

/// The watcher plus the totals and which files finished.
struct Counting<'a> {
    inner: &'a dyn Watcher,
    totals: Mutex<Totals>,
    /// Files finished, by [`FileJob::source`], counted (a source given
    /// twice).
    done: Mutex<HashMap<String, usize>>,
}

impl Observer for Counting<'_> {
    fn file_start(&self, name: &str, len: u64) {
        self.inner.file_start(name, len);
    }
    fn progress(&self, bytes: u64) {
        self.inner.progress(bytes);
    }
    fn file_done(&self, r: &FileResult) {
        self.totals.lock().unwrap().add(r);
        *self
            .done
            .lock()
            .unwrap()
            .entry(r.source.clone())
            .or_default() += 1;
        self.inner.file_done(r);
    }
}

/// The files of `all` not among `done`, to move again with resume.
fn unfinished(all: &[FileJob], done: &mut HashMap<String, usize>) -> Vec<FileJob> {
    all.iter()
        .filter(|j| match done.get_mut(&j.source()) {
            Some(n) if *n > 0 => {
                *n -= 1;
                false
            }
            _ => true,
        })
        .map(|j| {
            let mut j = j.clone();
            j.spec.resume = true;
            j
        })
        .collect()
}

/// Make `plan`'s directories, then move its files over sessions of
/// `client` with staging sized to what the plan can fill
/// ([`Client::sized_for`]), falling back to tcp as the module says.
pub async fn run(client: &Client, plan: Plan, w: &dyn Watcher) -> Result<Outcome> {
    let sized = client.sized_for(plan.window_bytes());
    run_over(client, &sized, plan, w).await
}

/// [`run`] over sessions from `sessions` (a pool, a test's).
pub async fn run_over(
    client: &Client,
    sessions: &dyn Sessions,
    plan: Plan,
    w: &dyn Watcher,
) -> Result<Outcome> {
    let t0 = Instant::now();
    let transport = client.options().transport;
    let skipped = plan.skipped.len() as u64;
    if plan.files.is_empty() {
        // Nothing moves: no handshake, no data path.
        super::make_dirs(client, &plan).await?;
        return Ok(nothing_moved(client, sessions, skipped, t0));
    }
    // The directories are made while the session is set up: neither
    // needs the other before the first file opens. A session opened for
    // directories that failed is closed unused.
    let fell_back_to = |why: &str| w.fell_back(why);
    let (made, opened) = tokio::join!(
        super::make_dirs(client, &plan),
        open_first(sessions, transport, &fell_back_to),
    );
    let (mut session, mut fell_back) = match (made, opened) {
        (Ok(()), opened) => opened?,
        (Err(e), Ok((session, _))) => {
            sessions.finish(session, false).await;
            return Err(e);
        }
        (Err(e), Err(_)) => return Err(e),
    };
    let files: Vec<FileJob> = plan.files.into_iter().map(|p| p.job).collect();
    let c = Counting {
        inner: w,
        totals: Mutex::new(Totals {
            skipped,
            ..Totals::default()
        }),
        done: Mutex::new(HashMap::new()),
    };
    w.session(&session);
    let mut r = session.transfer(&mut files.iter().cloned(), &c).await;
    if let Err(e) = &r {
        if sessions.warm(&session) && c.done.lock().unwrap().is_empty() && stale(e) {
            tracing::info!(error = %e, "a warm session failed at once; once more on a fresh one");
            let (kind, why) = (session.kind, session.transport.clone());
            sessions.finish(session, false).await;
            session = sessions.open(kind, why).await?;
            w.session(&session);
            let rest = unfinished(&files, &mut c.done.lock().unwrap());
            r = session.transfer(&mut rest.into_iter(), &c).await;
        }
    }
    if let Err(e) = &r {
        let why = fell_back
            .is_none()
            .then(|| tcp_fallback(transport, session.kind, e, session.fallback()))
            .flatten()
            .map(|w| continuing(&w));
        if let Some(why) = why {
            tracing::warn!("{why}");
            w.fell_back(&why);
            sessions.finish(session, false).await;
            let rest = unfinished(&files, &mut c.done.lock().unwrap());
            session = sessions
                .open(ProviderKind::Tcp, format!("tcp: {why}"))
                .await
                .map_err(|e| after_fallback(&why, e))?;
            w.session(&session);
            r = session.transfer(&mut rest.into_iter(), &c).await;
            fell_back = Some(why);
        }
    }
    let (kind, check) = (session.kind, session.check());
    // A session the job fell back to is kept like any that ended well: a
    // pool's next job to the peer uses it while it is warm (over tcp) and
    // tries verbs again once it went unused for the pool's idle time; the
    // rule buffer sessions follow (`buffers::sessions`). rcp's own jobs
    // keep nothing: its next run tries verbs first.
    let stats = sessions.finish(session, r.is_ok()).await;
    if let Err(e) = r {
        return Err(match &fell_back {
            Some(why) => after_fallback(why, e),
            None => e,
        });
    }
    let mut totals = c.totals.into_inner().unwrap();
    totals.seconds = t0.elapsed().as_secs_f64();
    Ok(Outcome {
        totals,
        kind,
        check,
        fell_back,
        stats,
        session: true,
    })
}

/// A session from `sessions` over the provider it tries first or, when
/// that cannot be set up for a reason tcp need not share
/// ([`tcp_fallback`]), over tcp; then why it is over tcp (said to
/// `fell_back` and the log). The one sequence for jobs, the Copy API and
/// buffer operations (`buffers::sessions`).
pub async fn open_first(
    sessions: &dyn Sessions,
    transport: crate::control::Transport,
    fell_back: &(dyn Fn(&str) + Sync),
) -> Result<(Session, Option<String>)> {
    let (kind, why) = sessions.first();
    match sessions.open(kind, why).await {
        Ok(s) => Ok((s, None)),
        Err(e) => {
            let Some(why) = tcp_fallback(transport, kind, &e, None).map(|w| continuing(&w)) else {
                return Err(e);
            };
            tracing::warn!("{why}");
            fell_back(&why);
            let s = sessions
                .open(ProviderKind::Tcp, format!("tcp: {why}"))
                .await
                .map_err(|e| after_fallback(&why, e))?;
            Ok((s, Some(why)))
        }
    }
}

/// The outcome of a job with no file to move (every one left as it was):
/// no session was opened.
fn nothing_moved(client: &Client, sessions: &dyn Sessions, skipped: u64, t0: Instant) -> Outcome {
    let check = client
        .options()
        .verify
        .first()
        .copied()
        .unwrap_or(crate::files::Check::Blake3);
    Outcome {
        totals: Totals {
            skipped,
            seconds: t0.elapsed().as_secs_f64(),
            ..Totals::default()
        },
        kind: sessions.first().0,
        check,
        fell_back: None,
        stats: None,
        session: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_finished_does_not_move_again_and_the_rest_resumes() {
        let all = vec![
            FileJob::push("/a/x".into(), "d/"),
            FileJob::push("/a/y".into(), "d/"),
            FileJob::pull("r/z", "/b/z".into()),
            // The same source given twice: one of them finished.
            FileJob::push("/a/x".into(), "e/"),
        ];
        let mut done: HashMap<String, usize> =
            [("/a/x".to_string(), 1), ("r/z".to_string(), 1)].into();
        let rest = unfinished(&all, &mut done);
        let names: Vec<(String, String)> = rest
            .iter()
            .map(|j| (j.source(), j.spec.remote.clone()))
            .collect();
        assert_eq!(
            names,
            vec![
                ("/a/y".to_string(), "d/".to_string()),
                ("/a/x".to_string(), "e/".to_string())
            ]
        );
        assert!(rest.iter().all(|j| j.spec.resume));
    }
}
