//! The tcp fallback as a policy of jobs (`jobs::run`), natively: a verbs
//! session that cannot start continues over tcp with `--transport auto`
//! and only then; the Copy API goes through the same policy and never
//! claims a fallback it did not make. (Every rail down mid-copy is the
//! rails VM scenario, tests/control_rails_fabric.rs.)

mod common;

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

use common::*;
use futures::future::BoxFuture;
use rcp::control::client::{Observer, SessionStats};
use rcp::control::jobs::{self, Job, Sessions, Watcher};
use rcp::control::{Client, ClientOptions, ControlError, Session, Transport};
use rcp::proto::{CopyRequest, Direction};
use rcp::provider::{ProviderError, ProviderKind};

/// A client's sessions whose verbs ones cannot start (as with a device
/// whose QP fails to come up): verbs is tried first, as `--transport auto`
/// does on a host with an ACTIVE port; tcp sessions are the client's.
struct VerbsBroken<'a> {
    client: &'a Client,
    verbs_tried: AtomicUsize,
    opened: Mutex<Vec<ProviderKind>>,
    /// Each session the job let go of, and whether it may be kept warm.
    finished: Mutex<Vec<(ProviderKind, bool)>>,
}

impl Sessions for VerbsBroken<'_> {
    fn first(&self) -> (ProviderKind, String) {
        (ProviderKind::Verbs, "verbs: a port is ACTIVE (test)".into())
    }
    fn open(
        &self,
        kind: ProviderKind,
        why: String,
    ) -> BoxFuture<'_, rcp::control::error::Result<Session>> {
        Box::pin(async move {
            if kind == ProviderKind::Verbs {
                self.verbs_tried.fetch_add(1, Relaxed);
                return Err(ControlError::Provider(ProviderError::Protocol(
                    "modify QP to RTR: Connection timed out".into(),
                )));
            }
            let s = self.client.session_with(kind, why).await?;
            self.opened.lock().unwrap().push(s.kind);
            Ok(s)
        })
    }
    fn finish(&self, s: Session, ok: bool) -> BoxFuture<'_, Option<SessionStats>> {
        self.finished.lock().unwrap().push((s.kind, ok));
        self.client.finish(s, ok)
    }
}

#[derive(Default)]
struct Seen {
    fell_back: Mutex<Vec<String>>,
    sessions: Mutex<Vec<(String, String)>>,
    files: AtomicUsize,
}

impl Observer for Seen {
    fn file_done(&self, _r: &rcp::control::FileResult) {
        self.files.fetch_add(1, Relaxed);
    }
}

impl Watcher for Seen {
    fn session(&self, s: &Session) {
        self.sessions
            .lock()
            .unwrap()
            .push((s.kind.to_string(), s.transport.clone()));
    }
    fn fell_back(&self, why: &str) {
        self.fell_back.lock().unwrap().push(why.to_string());
    }
}

fn options(transport: Transport) -> ClientOptions {
    ClientOptions {
        token: Some("tok".into()),
        transport,
        ..ClientOptions::default()
    }
}

#[test]
fn a_verbs_session_that_cannot_start_continues_over_tcp_with_transport_auto() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, "tcp", Some("tok"), &[]);
    let src = tmp.path().join("x.bin");
    make_file(&src, (3 << 20) + 5, 41);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = Client::connect(&d.addr(), options(Transport::Auto))
            .await
            .unwrap();
        let sessions = VerbsBroken {
            client: &client,
            verbs_tried: AtomicUsize::new(0),
            opened: Mutex::new(Vec::new()),
            finished: Mutex::new(Vec::new()),
        };
        let seen = Seen::default();
        let plan = jobs::plan_push(
            &client,
            std::slice::from_ref(&src),
            "x.bin",
            &Job::default(),
        )
        .await
        .unwrap();
        let o = jobs::run_over(&client, &sessions, plan, &seen)
            .await
            .expect("the copy continues over tcp");
        assert_eq!(sessions.verbs_tried.load(Relaxed), 1);
        assert_eq!(*sessions.opened.lock().unwrap(), vec![ProviderKind::Tcp]);
        assert_eq!(o.kind, ProviderKind::Tcp);
        assert_eq!(o.totals.files, 1);
        assert_eq!(seen.files.load(Relaxed), 1);
        // Said once, to the watcher, with the verbs error; the same
        // sentence in the outcome (rcp's --json `fallback`).
        let said = seen.fell_back.lock().unwrap().clone();
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(
            said[0].contains("modify QP to RTR") && said[0].contains("continuing over the tcp"),
            "{}",
            said[0]
        );
        assert_eq!(o.fell_back.as_deref(), Some(said[0].as_str()));
        // The tcp session it fell back to may be kept warm, as any that
        // ended well: the next Copy to the peer uses it while it is warm,
        // and tries verbs again once it went unused (the rule buffer
        // sessions follow).
        assert_eq!(
            *sessions.finished.lock().unwrap(),
            vec![(ProviderKind::Tcp, true)]
        );
        let ss = seen.sessions.lock().unwrap().clone();
        assert_eq!(ss.len(), 1);
        assert_eq!(ss[0].0, "tcp");
        assert!(ss[0].1.starts_with("tcp: the verbs session"), "{}", ss[0].1);
    });
    assert_eq!(sha256sum(&root.join("x.bin")), sha256sum(&src));
}

#[test]
fn asked_for_verbs_a_verbs_session_that_cannot_start_is_the_error() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, "tcp", Some("tok"), &[]);
    let src = tmp.path().join("x.bin");
    make_file(&src, 1 << 20, 42);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = Client::connect(&d.addr(), options(Transport::Verbs))
            .await
            .unwrap();
        let sessions = VerbsBroken {
            client: &client,
            verbs_tried: AtomicUsize::new(0),
            opened: Mutex::new(Vec::new()),
            finished: Mutex::new(Vec::new()),
        };
        let seen = Seen::default();
        let plan = jobs::plan_push(
            &client,
            std::slice::from_ref(&src),
            "x.bin",
            &Job::default(),
        )
        .await
        .unwrap();
        let e = jobs::run_over(&client, &sessions, plan, &seen)
            .await
            .expect_err("--transport verbs never falls back");
        assert!(e.to_string().contains("modify QP to RTR"), "{e}");
        assert!(!e.to_string().contains("continuing"), "{e}");
        assert_eq!(e.exit_code(), rcp::control::exit::RETRYABLE);
        assert!(sessions.opened.lock().unwrap().is_empty());
        assert!(seen.fell_back.lock().unwrap().is_empty());
    });
    assert!(!root.join("x.bin").exists());
}

#[test]
fn a_refused_token_is_not_retried_over_tcp() {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, "tcp", Some("tok"), &[]);
    let src = tmp.path().join("x.bin");
    make_file(&src, 4096, 43);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = Client::connect(&d.addr(), options(Transport::Auto))
            .await
            .unwrap();
        // A verbs session refused for its token: tcp would be too.
        struct Refused;
        impl Sessions for Refused {
            fn first(&self) -> (ProviderKind, String) {
                (ProviderKind::Verbs, "verbs (test)".into())
            }
            fn open(
                &self,
                _kind: ProviderKind,
                _why: String,
            ) -> BoxFuture<'_, rcp::control::error::Result<Session>> {
                Box::pin(async { Err(ControlError::Unauthenticated("bad token".into())) })
            }
            fn finish(&self, _s: Session, _ok: bool) -> BoxFuture<'_, Option<SessionStats>> {
                Box::pin(async { None })
            }
        }
        let seen = Seen::default();
        let plan = jobs::plan_push(
            &client,
            std::slice::from_ref(&src),
            "x.bin",
            &Job::default(),
        )
        .await
        .unwrap();
        let e = jobs::run_over(&client, &Refused, plan, &seen)
            .await
            .unwrap_err();
        assert_eq!(e.exit_code(), rcp::control::exit::FATAL, "{e}");
        assert!(seen.fell_back.lock().unwrap().is_empty());
    });
}

async fn copy(a: &Rcpd, req: CopyRequest) -> Result<rcp::proto::CopyProgress, tonic::Status> {
    let c = Client::connect(&a.addr(), options(Transport::Tcp))
        .await
        .unwrap();
    let mut s = c.copy(req).await.map_err(tonic::Status::from)?;
    let mut last = None;
    while let Some(p) = s.message().await? {
        last = Some(p);
    }
    Ok(last.expect("a final progress message"))
}

#[test]
fn the_copy_api_goes_through_the_policy_and_tells_the_truth() {
    let tmp = tempfile::tempdir().unwrap();
    let (ra, rb) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir_all(&ra).unwrap();
    std::fs::create_dir_all(&rb).unwrap();
    // A of --transport auto copies to B, which serves only tcp.
    let a = Rcpd::start(&ra, "auto", Some("tok"), &["--copy-peers", &copy_peers()]);
    let b = Rcpd::start(&rb, "tcp", Some("tok"), &[]);
    make_file(&ra.join("x.bin"), (2 << 20) + 1, 44);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // Asked for verbs: verbs or a truthful error, never "continuing".
        let r = copy(
            &a,
            CopyRequest {
                direction: Direction::Push as i32,
                local_path: "x.bin".into(),
                remote: b.addr(),
                remote_path: "v.bin".into(),
                transport: "verbs".into(),
                ..Default::default()
            },
        )
        .await;
        let e = r.expect_err("B serves no verbs");
        assert!(!e.message().contains("continuing"), "{}", e.message());
        assert!(!rb.join("v.bin").exists());
        // The default (rcpd's auto): over tcp, directly where A has no
        // ACTIVE port, through the policy's fallback where it has one.
        let p = copy(
            &a,
            CopyRequest {
                direction: Direction::Push as i32,
                local_path: "x.bin".into(),
                remote: b.addr(),
                remote_path: "y.bin".into(),
                ..Default::default()
            },
        )
        .await
        .expect("auto reaches B over tcp");
        assert!(p.done && p.error.is_empty(), "{p:?}");
        assert_eq!(p.sha256, sha256sum(&ra.join("x.bin")));
    });
    assert_eq!(sha256sum(&rb.join("y.bin")), sha256sum(&ra.join("x.bin")));
}
