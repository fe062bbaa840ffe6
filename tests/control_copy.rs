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
    let a = Rcpd::start(&ra, "tcp", Some("tok"), &[]);
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

#[test]
fn metrics_are_scraped_during_a_copy() {
    let tmp = tempfile::tempdir().unwrap();
    common::metrics::metrics_during_copy("tcp", tmp.path(), 64 << 20);
}
