//! The service API: a service asks rcpd A to copy to and from rcpd B.

mod common;

use common::*;
use rcp::control::{Client, ClientOptions};
use rcp::proto::{CopyRequest, Direction};

async fn copy(a: &Rcpd, req: CopyRequest) -> Result<rcp::proto::CopyProgress, tonic::Status> {
    let c = Client::connect(
        &a.addr(),
        ClientOptions {
            token: Some("tok".into()),
            ..ClientOptions::default()
        },
    )
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
fn copy_between_two_rcpds() {
    let tmp = tempfile::tempdir().unwrap();
    let (ra, rb) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir_all(ra.join("data")).unwrap();
    std::fs::create_dir_all(rb.join("incoming")).unwrap();
    let a = Rcpd::start(&ra, "tcp", Some("tok"), &["--copy-peers", &copy_peers()]);
    let b = Rcpd::start(&rb, "tcp", Some("tok"), &[]);
    make_file(&ra.join("data/x.bin"), (5 << 20) + 3, 11);
    make_file(&rb.join("y.bin"), 777_777, 12);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // A pushes its data/x.bin to B's incoming/.
        let p = copy(
            &a,
            CopyRequest {
                direction: Direction::Push as i32,
                local_path: "data/x.bin".into(),
                remote: b.addr(),
                remote_path: "incoming/".into(),
                transport: "tcp".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        assert!(p.done && p.error.is_empty(), "{p:?}");
        assert_eq!(p.sha256, sha256sum(&ra.join("data/x.bin")));
        assert_eq!(
            sha256sum(&rb.join("incoming/x.bin")),
            sha256sum(&ra.join("data/x.bin"))
        );
        // A pulls B's y.bin into its data/.
        let p = copy(
            &a,
            CopyRequest {
                direction: Direction::Pull as i32,
                local_path: "data".into(),
                remote: b.addr(),
                remote_path: "y.bin".into(),
                transport: "tcp".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        assert!(p.done && p.error.is_empty(), "{p:?}");
        assert_eq!(
            sha256sum(&ra.join("data/y.bin")),
            sha256sum(&rb.join("y.bin"))
        );
        // Escapes of the local root are refused before anything happens.
        let e = copy(
            &a,
            CopyRequest {
                direction: Direction::Push as i32,
                local_path: "../b/y.bin".into(),
                remote: b.addr(),
                remote_path: "z".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
        // A missing remote file fails with its status.
        let e = copy(
            &a,
            CopyRequest {
                direction: Direction::Pull as i32,
                local_path: "data".into(),
                remote: b.addr(),
                remote_path: "nope".into(),
                transport: "tcp".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound, "{e}");
    });
}

/// A asked to pull a tree into its root, where the destination tree holds
/// a symlink to a directory outside A's root at a directory's name: A
/// replaces the link by a directory and writes nothing outside its root.
#[test]
fn a_copy_into_the_root_never_writes_through_a_link_out_of_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (ra, rb) = (tmp.path().join("a"), tmp.path().join("b"));
    let outside = tmp.path().join("outside");
    std::fs::create_dir_all(ra.join("data/t")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::os::unix::fs::symlink(&outside, ra.join("data/t/sub")).unwrap();
    std::fs::create_dir_all(rb.join("t/sub")).unwrap();
    make_file(&rb.join("t/sub/f"), 5000, 13);
    let a = Rcpd::start(&ra, "tcp", Some("tok"), &["--copy-peers", &copy_peers()]);
    let b = Rcpd::start(&rb, "tcp", Some("tok"), &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let p = rt.block_on(copy(
        &a,
        CopyRequest {
            direction: Direction::Pull as i32,
            local_path: "data".into(),
            remote: b.addr(),
            remote_path: "t".into(),
            recursive: true,
            transport: "tcp".into(),
            ..Default::default()
        },
    ));
    let p = p.unwrap_or_else(|e| panic!("{e}\n{}", a.log()));
    assert!(p.done && p.error.is_empty(), "{p:?}");
    assert_eq!(
        names(&outside),
        Vec::<String>::new(),
        "written outside A's root"
    );
    let sub = std::fs::symlink_metadata(ra.join("data/t/sub")).unwrap();
    assert!(sub.is_dir(), "{sub:?}");
    assert_eq!(
        sha256sum(&ra.join("data/t/sub/f")),
        sha256sum(&rb.join("t/sub/f"))
    );
}

#[test]
fn metrics_are_scraped_during_a_copy() {
    let tmp = tempfile::tempdir().unwrap();
    common::metrics::metrics_during_copy("tcp", tmp.path(), 64 << 20);
}

/// A listener on [`host`] that counts the connections made to it (each is
/// dropped at once): a peer that must never be dialled.
struct Recorder {
    addr: String,
    seen: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Recorder {
    fn start() -> Recorder {
        let l = std::net::TcpListener::bind(format!("{}:0", host())).unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let s = seen.clone();
        std::thread::spawn(move || {
            for c in l.incoming() {
                if c.is_ok() {
                    s.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            }
        });
        Recorder { addr, seen }
    }

    fn seen(&self) -> usize {
        self.seen.load(std::sync::atomic::Ordering::SeqCst)
    }
}

fn push_to(remote: &str, remote_path: &str) -> CopyRequest {
    CopyRequest {
        direction: Direction::Push as i32,
        local_path: "x.bin".into(),
        remote: remote.into(),
        remote_path: remote_path.into(),
        transport: "tcp".into(),
        ..Default::default()
    }
}

/// rcpd dials only the peers of its --copy-peers: a Copy elsewhere is
/// refused naming the flag and nothing connects there; with no list only
/// a Copy to itself goes through.
#[test]
fn copy_goes_only_to_listed_peers() {
    let tmp = tempfile::tempdir().unwrap();
    let (ra, rb, rc) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
    );
    for r in [&ra, &rb, &rc] {
        std::fs::create_dir_all(r).unwrap();
    }
    let b = Rcpd::start(&rb, "tcp", Some("tok"), &[]);
    let stranger = Recorder::start();
    // A lists B alone (its address and port); C lists nobody.
    let a = Rcpd::start(&ra, "tcp", Some("tok"), &["--copy-peers", &b.addr()]);
    let c = Rcpd::start(&rc, "tcp", Some("tok"), &[]);
    make_file(&ra.join("x.bin"), 300_001, 21);
    make_file(&rc.join("x.bin"), 300_002, 22);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let p = copy(&a, push_to(&b.addr(), "from-a.bin")).await.unwrap();
        assert!(p.done && p.error.is_empty(), "{p:?}");
        let e = copy(&a, push_to(&stranger.addr, "x.bin"))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
        assert!(
            e.message().contains("--copy-peers") && e.message().contains(&stranger.addr),
            "{e}"
        );
        // B listed by address and port: B's address at another port is not B.
        let e = copy(&a, push_to(&c.addr(), "from-a.bin"))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
        // With no list: refused, saying none are listed; to itself, copied.
        let e = copy(&c, push_to(&stranger.addr, "x.bin"))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
        assert!(
            e.message().contains("--copy-peers") && e.message().contains("none are"),
            "{e}"
        );
        let e = copy(&c, push_to(&b.addr(), "from-c.bin"))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
        let p = copy(&c, push_to(&c.addr(), "again.bin")).await.unwrap();
        assert!(p.done && p.error.is_empty(), "{p:?}");
    });
    assert_eq!(
        sha256sum(&rb.join("from-a.bin")),
        sha256sum(&ra.join("x.bin"))
    );
    assert_eq!(
        sha256sum(&rc.join("again.bin")),
        sha256sum(&rc.join("x.bin"))
    );
    assert!(!rb.join("from-c.bin").exists());
    assert!(!rc.join("from-a.bin").exists());
    assert_eq!(stranger.seen(), 0, "an unlisted peer was connected to");
    // B saw A's session only, C's own copy went to C.
    assert_eq!(b.log().matches("session opened").count(), 1, "{}", b.log());
    assert!(a.log().contains("copy refused"), "{}", a.log());
}
