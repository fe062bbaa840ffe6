//! The Rust client of the service protocol (control::buffers::client)
//! against an in-process rcpd over the tcp provider: two services on one
//! rcpd, one exposing, the other writing into it and reading it back
//! through the rcpd's own gRPC address (rcpd is its own peer), bytes and
//! the owner's event checked; then an unknown name.

use std::time::Duration;

use rcp::control::buffers::client::ServiceClient;
use rcp::control::daemon::{self, DaemonConfig};
use rcp::control::link::MemoryWindows;
use rcp::control::Transport;

fn config(root: &std::path::Path, socket: &std::path::Path) -> DaemonConfig {
    DaemonConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        health_listen: None,
        metrics_listen: None,
        root: root.to_path_buf(),
        transport: Transport::Tcp,
        rails: Vec::new(),
        gid_index: None,
        arena_mib: 16,
        hugepage_dir: None,
        memory_windows: MemoryWindows::Auto,
        max_transfers: 4,
        max_transfers_per_client: None,
        max_sessions: rcp::control::server::DEFAULT_MAX_SESSIONS,
        max_sessions_per_client: rcp::control::server::DEFAULT_MAX_SESSIONS_PER_CLIENT,
        session_grace: rcp::control::server::DEFAULT_SESSION_GRACE,
        token: None,
        cq_cpu: None,
        batch: 32,
        signal_every: 32,
        shutdown_grace: Duration::from_secs(1),
        timeout: Duration::from_secs(30),
        max_open_files: 64,
        checks: vec![rcp::files::Check::Sha256],
        tls: None,
        tls_peer_ca: None,
        bwlimit: None,
        socket: Some(socket.to_path_buf()),
        copy_pool: Default::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_service_writes_and_reads_another_services_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let sock = dir.path().join("rcpd.sock");
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let cfg = config(&root, &sock);
    let server = tokio::spawn(async move {
        daemon::run(
            cfg,
            async {
                let _ = stop_rx.await;
            },
            move |b, _| {
                let _ = tx.send(b.grpc);
            },
        )
        .await
    });
    let addr = rx.await.unwrap().to_string();

    let owner = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let dst = owner.create_buffer(2 << 20).await.unwrap();
    owner
        .expose(&dst, "rust0", 0, 2 << 20, "rw", &[])
        .await
        .unwrap();

    let writer = ServiceClient::connect(Some(&sock), None).await.unwrap();
    let src = writer.create_buffer(2 << 20).await.unwrap();
    let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i * 7 + 3) as u8).collect();
    assert!(src.local.write_at(0, &data));
    let h = writer
        .write(&src, &addr, "rust0", &[(0, 1 << 20, 1 << 20)], Some("hi"))
        .await
        .unwrap();
    assert_eq!(writer.wait(h).await.unwrap(), 1 << 20);
    let mut got = vec![0u8; 1 << 20];
    assert!(dst.local.read_at(1 << 20, &mut got));
    assert!(got == data, "the owner's buffer holds the writer's bytes");
    let ev = owner.next_event().await.unwrap();
    assert_eq!(ev["event"], "written", "{ev}");
    assert_eq!(ev["message"], "hi", "{ev}");
    assert_eq!(ev["ranges"][0][0], 1 << 20, "{ev}");

    // Read it back into another range of the writer's buffer.
    let h = writer
        .read(&src, &addr, "rust0", &[(1 << 20, 1 << 20, 1 << 20)])
        .await
        .unwrap();
    assert_eq!(writer.wait(h).await.unwrap(), 1 << 20);
    let mut back = vec![0u8; 1 << 20];
    assert!(src.local.read_at(1 << 20, &mut back));
    assert!(back == data, "the read landed the same bytes");

    let h = writer
        .write(&src, &addr, "nope", &[(0, 0, 4096)], None)
        .await
        .unwrap();
    let e = writer.wait(h).await.unwrap_err();
    assert_eq!(e.reason_name(), "not_found", "{e}");

    drop((owner, writer));
    let _ = stop_tx.send(());
    server.await.unwrap().unwrap();
    assert!(!sock.exists(), "rcpd removes its socket when it stops");
}
