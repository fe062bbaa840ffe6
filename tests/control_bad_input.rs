//! Hostile and broken input against rcpd over TCP: path escapes, wrong
//! tokens, forged rkeys, garbage on the gRPC port, malformed Move frames
//! (protocol 2, sent by hand with `common::raw`), another protocol major, a
//! killed daemon. Each is refused with the right error (and the
//! machine-readable reason in the status details) while another copy in
//! flight finishes, and nothing stored is lost.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::raw::{self, grpc, Client, Move, Session};
use common::*;
use rcp::control::error::Reason;
use rcp::engine::WcStatus;
use rcp::proto::{self, ClientFrame};
use rcp::provider::{Channel, ProviderKind};
use tonic::Code;

const T: &str = "tcp";

struct Bg {
    child: Child,
    src: std::path::PathBuf,
}

/// A 24 MiB push running in the background.
fn copy_in_flight(d: &Rcpd, dir: &Path, token: Option<&str>) -> Bg {
    let src = dir.join("inflight");
    make_file(&src, 24 << 20, 99);
    let child = rcp_cmd(
        d.port,
        T,
        token,
        &["push", "-q", src.to_str().unwrap(), "127.0.0.1:/"],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    Bg { child, src }
}

impl Bg {
    fn finishes(self, root: &Path) {
        let out = self.child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "the copy in flight failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(sha256sum(&self.src), sha256sum(&root.join("inflight")));
    }
}

fn setup(token: Option<&str>) -> (tempfile::TempDir, std::path::PathBuf, Rcpd) {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = Rcpd::start(&root, T, token, &[]);
    (tmp, root, d)
}

#[test]
fn path_escapes_are_refused() {
    let (tmp, root, d) = setup(None);
    std::fs::write(tmp.path().join("secret"), b"outside").unwrap();
    std::os::unix::fs::symlink(tmp.path(), root.join("link")).unwrap();
    let bg = copy_in_flight(&d, tmp.path(), None);
    let f = tmp.path().join("small");
    std::fs::write(&f, b"x").unwrap();
    let fs = f.to_str().unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let os = out.to_str().unwrap();
    for (args, what) in [
        (vec!["push", fs, "127.0.0.1:../escaped"], "escapes"),
        (vec!["push", fs, "127.0.0.1:a/../../escaped"], "escapes"),
        (vec!["push", fs, "127.0.0.1:link/escaped"], "symlink"),
        (vec!["pull", "127.0.0.1:../secret", os], "escapes"),
        (vec!["pull", "127.0.0.1:link/secret", os], "symlink"),
    ] {
        let r = rcp(d.port, T, None, &args);
        assert_eq!(r.code, 6, "{args:?}: {}", r.stderr);
        assert!(r.stderr.contains(what), "{args:?}: {}", r.stderr);
    }
    assert!(!tmp.path().join("escaped").exists());
    assert!(!out.join("secret").exists());
    assert_eq!(
        std::fs::read(tmp.path().join("secret")).unwrap(),
        b"outside"
    );
    bg.finishes(&root);
}

/// `MakeDirs` makes its directories in order and stops at the first it
/// refuses (an escape, a path through a symlink, a file in the way): those
/// before it made, none after; more than rcpd's bound in one call is
/// refused whole.
#[test]
fn make_dirs_stay_beneath_the_root_and_stop_at_the_first_refused() {
    let (tmp, root, d) = setup(None);
    let outside = tmp.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
    std::fs::write(root.join("file"), b"f").unwrap();
    // As rcp asks for a tree's directories (those beneath one made in the
    // same call are made in the handle it holds).
    let dir = |path: &str| proto::MakeDirRequest {
        path: path.into(),
        mode: 0o755,
        replace_link: true,
        ..Default::default()
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        for (bad, why) in [
            ("../escaped", Reason::PathRefused),
            ("link/in", Reason::PathRefused),
            ("file/in", Reason::Invalid),
        ] {
            let e = c
                .make_dirs(proto::MakeDirsRequest {
                    dirs: vec![dir("made"), dir("made/sub"), dir(bad), dir("after")],
                })
                .await
                .unwrap_err();
            assert_eq!(raw::reason(&e), why, "{bad}: {e:?}");
            assert!(root.join("made/sub").is_dir(), "{bad}");
            assert!(!root.join("after").exists(), "{bad}");
        }
        assert!(!tmp.path().join("escaped").exists());
        assert!(!outside.join("in").exists());
        assert!(root.join("file").is_file());
        let many = (0..=rcp::control::server::MAKE_DIRS_MAX)
            .map(|i| dir(&format!("many/{i}")))
            .collect();
        let e = c
            .make_dirs(proto::MakeDirsRequest { dirs: many })
            .await
            .unwrap_err();
        assert_eq!(raw::reason(&e), Reason::Invalid, "{e:?}");
        assert!(e.message().contains("at most"), "{e:?}");
        assert!(!root.join("many").exists());
    });
}

/// The tree calls of `-a` and `--delete` stay beneath the root: MakeLink
/// refuses a target that is absolute or climbs out of the root, and a path
/// through a symlink; Remove refuses the root itself, an escape, a path
/// through a symlink, a directory that is not empty, and removes a link to
/// a directory as the link, never what it points at.
#[test]
fn make_link_and_remove_stay_beneath_the_root() {
    let (tmp, root, d) = setup(None);
    let outside = tmp.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("secret"), b"outside").unwrap();
    std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
    std::fs::create_dir_all(root.join("sub/full")).unwrap();
    std::fs::write(root.join("sub/full/f"), b"f").unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        for (path, target) in [
            ("l1", "../outside/secret"),
            ("sub/l2", "../../outside"),
            ("l3", "/etc/passwd"),
            ("l4", ""),
            ("../l5", "x"),
            ("link/l6", "secret"),
        ] {
            let e = c
                .make_link(proto::MakeLinkRequest {
                    path: path.into(),
                    target: target.into(),
                })
                .await
                .unwrap_err();
            assert!(
                matches!(raw::reason(&e), Reason::Invalid | Reason::PathRefused),
                "{path} -> {target}: {e:?}"
            );
        }
        for l in ["l1", "sub/l2", "l3", "l4"] {
            assert!(std::fs::symlink_metadata(root.join(l)).is_err(), "{l}");
        }
        assert!(std::fs::symlink_metadata(tmp.path().join("l5")).is_err());
        assert!(std::fs::symlink_metadata(outside.join("l6")).is_err());
        // Inside: made, with its text (a link to a sibling directory too).
        c.make_link(proto::MakeLinkRequest {
            path: "sub/ok".into(),
            target: "../sub/full/f".into(),
        })
        .await
        .unwrap();
        assert_eq!(
            std::fs::read_link(root.join("sub/ok")).unwrap(),
            Path::new("../sub/full/f")
        );

        for path in [
            "",
            "/",
            ".",
            "sub/..",
            "../outside/secret",
            "link/secret",
            "sub/full",
        ] {
            let r = c.remove(proto::RemoveRequest { path: path.into() }).await;
            assert!(r.is_err(), "{path}: removed");
        }
        assert!(root.is_dir() && root.join("sub/full/f").is_file());
        assert_eq!(std::fs::read(outside.join("secret")).unwrap(), b"outside");
        // The link goes, what it points at stays.
        c.remove(proto::RemoveRequest {
            path: "link".into(),
        })
        .await
        .unwrap();
        assert!(std::fs::symlink_metadata(root.join("link")).is_err());
        assert_eq!(std::fs::read(outside.join("secret")).unwrap(), b"outside");
    });
}

#[test]
fn wrong_or_missing_token_is_refused() {
    let (tmp, root, d) = setup(Some("good-token"));
    let bg = copy_in_flight(&d, tmp.path(), Some("good-token"));
    let f = tmp.path().join("small");
    std::fs::write(&f, b"hello").unwrap();
    let args = ["push", f.to_str().unwrap(), "127.0.0.1:/"];
    let r = rcp(d.port, T, Some("bad-token"), &args);
    assert_eq!(r.code, 6, "{}", r.stderr);
    assert!(r.stderr.contains("invalid token"), "{}", r.stderr);
    let r = rcp(d.port, T, None, &args);
    assert_eq!(r.code, 6, "{}", r.stderr);
    assert!(r.stderr.contains("missing authorization"), "{}", r.stderr);
    assert!(!root.join("small").exists());
    let r = rcp(d.port, T, Some("good-token"), &args);
    assert_eq!(r.code, 0, "{}", r.stderr);
    bg.finishes(&root);
    // The refusals were counted.
    let m = common::metrics::scrape(d.metrics.as_deref().unwrap());
    assert!(m.contains("rcpd_auth_failures_total 2"), "{m}");
}

const MIB: u64 = 1 << 20;
const BS4K: u64 = 4096;

/// A raw session over tcp with `bs`-byte blocks.
async fn tcp_session(c: &mut Client, bs: u64) -> Session {
    Session::open(c, ProviderKind::Tcp, bs).await
}

/// A fresh data connection of `s` presenting its own key.
fn own(s: &Session) -> Arc<dyn Channel> {
    s.tcp_channel(Some(s.key()))
}

/// Open a push of `len` bytes to `path` as file 1 on a new stream of `sid`;
/// the stream and the first grant (after Opened).
async fn push_granted(c: &mut Client, sid: u64, path: &str, len: u64) -> (Move, proto::Grant) {
    let mut m = Move::open(c, sid, vec![raw::push(1, path, len)]).await;
    let o = m.opened().await;
    assert_eq!((o.file, o.length), (1, len), "{o:?}");
    let g = m.grant().await;
    assert_eq!(g.round, 0, "{g:?}");
    assert!(g.extents.iter().all(|e| e.file == 1), "{g:?}");
    (m, g)
}

/// File 1's only block, `data`, written into grant `g` of `m` and told
/// (its window done and acknowledged whole, its end sent).
async fn push_one_block(s: &Arc<Session>, m: &mut Move, g: &proto::Grant, data: &[u8]) {
    let (s2, g2, d2) = (s.clone(), g.clone(), data.to_vec());
    let st = tokio::task::spawn_blocking(move || s2.write(g2.addr, g2.rkey, &d2))
        .await
        .unwrap();
    assert_eq!(st, WcStatus::Success);
    m.send_done(raw::pushed(g, vec![raw::sha256(data)]));
    assert!(m.ack().await.resend.is_empty());
    m.send_end(1, raw::file_digest(data, BS4K));
}

#[test]
fn forged_rkeys_are_refused() {
    let (tmp, root, d) = setup(None);
    make_file(&root.join("readonly"), 3 * MIB, 5);
    let data = std::fs::read(root.join("readonly")).unwrap();
    let before = sha256sum(&root.join("readonly"));
    let bg = copy_in_flight(&d, tmp.path(), None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let s = Arc::new(tcp_session(&mut c, MIB).await);
        // A real grant, for a pull: REMOTE_READ only, the three blocks of
        // the file in one window with their digests.
        let mut m = Move::open(&mut c, s.id(), vec![raw::pull(1, "readonly")]).await;
        assert_eq!(m.opened().await.length, 3 * MIB);
        let g = m.grant().await;
        assert_eq!(g.extents.len(), 3, "{g:?}");
        assert_eq!(g.digests.len(), 3, "{g:?}");
        let (s2, g2) = (s.clone(), g.clone());
        let (st, window) = tokio::task::spawn_blocking(move || {
            let st = (
                // WRITE into a window granted for READ: no access.
                s2.write_on(&*own(&s2), g2.addr, g2.rkey, &[0xee; 4096]),
                // An rkey nobody granted, for a WRITE and a READ.
                s2.write_on(&*own(&s2), g2.addr, g2.rkey ^ 0x5a5a_1234, &[0xee; 4096]),
                s2.read_on(&*own(&s2), g2.addr, g2.rkey ^ 0x5a5a_1234, 4096)
                    .0,
            );
            // The window as granted, read with its own rkey.
            let (ok, window) = s2.read(g2.addr, g2.rkey, g2.len as usize);
            assert_eq!(ok, WcStatus::Success);
            (st, window)
        })
        .await
        .unwrap();
        assert_eq!(st.0, WcStatus::RemoteAccess, "WRITE into a READ window");
        assert_eq!(st.1, WcStatus::RemoteAccess, "forged rkey, WRITE");
        assert_eq!(st.2, WcStatus::RemoteAccess, "forged rkey, READ");
        // The window holds the file's blocks, untouched: each matches the
        // grant's digest and the file's own bytes.
        for (e, dg) in g.extents.iter().zip(&g.digests) {
            let at = e.offset as usize;
            let got = &window[at..at + e.len as usize];
            let want = &data[(e.block * MIB) as usize..][..e.len as usize];
            assert!(got == want, "block {} changed in the window", e.block);
            assert_eq!(&raw::sha256(got), dg, "block {}", e.block);
        }
        m.send_done(raw::pulled(&g, vec![]));
        let end = m.end().await;
        assert_eq!(end.file, 1);
        assert_eq!(end.digest, raw::file_digest(&data, MIB), "the file digest");
        m.close();
        m.finish().await;
        assert!(m.inbox.is_empty(), "{:?}", m.inbox);
    });
    bg.finishes(&root);
    assert_eq!(
        sha256sum(&root.join("readonly")),
        before,
        "nothing stored changed"
    );
}

/// Protocol 1 (one Transfer stream per file) and anything newer than this
/// rcpd are refused at the handshake by version, naming both.
#[test]
fn another_protocol_major_is_refused_at_the_handshake() {
    let (_tmp, _root, d) = setup(None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        for (major, minor) in [(1, 0), (1, 3), (3, 0)] {
            let e = c
                .handshake(proto::HandshakeRequest {
                    version_major: major,
                    version_minor: minor,
                    ..raw::hello(ProviderKind::Tcp, MIB)
                })
                .await
                .unwrap_err();
            assert_eq!(e.code(), Code::FailedPrecondition, "{major}.{minor}: {e:?}");
            assert_eq!(raw::reason(&e), Reason::Version, "{e:?}");
            let theirs = format!("{major}.{minor}");
            let ours = format!(
                "{}.{}",
                rcp::control::VERSION_MAJOR,
                rcp::control::VERSION_MINOR
            );
            assert_eq!(ours, "2.12");
            assert!(
                e.message().contains(&theirs) && e.message().contains(&ours),
                "names both versions: {e:?}"
            );
        }
        // Refused, not half-open: a protocol-2 handshake still works.
        let s = tcp_session(&mut c, MIB).await;
        assert_ne!(s.id(), 0);
    });
}

/// The check negotiation against clients old and new, with the requests
/// they send: a client of 2.1 or older offers one check (or, before the
/// list, none: SHA-256) and gets it; one of 2.2 offers BLAKE3 then SHA-256
/// and gets BLAKE3; a value this rcpd does not know (a check from the
/// future) is passed over. An rcpd that allows only BLAKE3 refuses the old
/// client by name, as INVALID_ARGUMENT.
#[test]
fn check_negotiation_with_old_and_new_clients() {
    use proto::Check as C;
    let (_tmp, _root, d) = setup(None);
    let tmp = tempfile::tempdir().unwrap();
    let strict = Rcpd::start(tmp.path(), T, None, &["--verify", "blake3"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        for (minor, offer, want) in [
            (1, vec![], C::Sha256),
            (1, vec![C::Sha256 as i32], C::Sha256),
            (1, vec![C::Xxh3 as i32], C::Xxh3),
            (2, vec![C::Blake3 as i32, C::Sha256 as i32], C::Blake3),
            (2, vec![C::Sha256 as i32, C::Blake3 as i32], C::Sha256),
            (2, vec![99, C::Blake3 as i32], C::Blake3),
        ] {
            let hs = c
                .handshake(proto::HandshakeRequest {
                    version_minor: minor,
                    checks: offer.clone(),
                    ..raw::hello(ProviderKind::Tcp, MIB)
                })
                .await
                .unwrap_or_else(|e| panic!("2.{minor} {offer:?}: {e:?}"))
                .into_inner();
            assert_eq!(hs.check, want as i32, "2.{minor} offering {offer:?}");
            c.close_session(proto::CloseSessionRequest {
                session_id: hs.session_id,
            })
            .await
            .unwrap();
        }
        let mut c = grpc(strict.port).await;
        let e = c
            .handshake(proto::HandshakeRequest {
                version_minor: 1,
                ..raw::hello(ProviderKind::Tcp, MIB)
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert_eq!(raw::reason(&e), Reason::Invalid, "{e:?}");
        assert!(
            e.message().contains("accepts only the checks blake3")
                && e.message().contains("offered sha256"),
            "names both: {e:?}"
        );
    });
}

#[test]
fn garbage_and_malformed_frames_are_refused() {
    let (tmp, root, d) = setup(None);
    make_file(&root.join("src"), 8192, 7);
    let bg = copy_in_flight(&d, tmp.path(), None);
    // Random bytes, and an HTTP/2 preface followed by junk.
    for junk in [
        (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect::<Vec<u8>>(),
        [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".as_slice(), &[0xff; 300]].concat(),
    ] {
        let mut s = TcpStream::connect(("127.0.0.1", d.port)).unwrap();
        let _ = s.write_all(&junk);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut s, &mut sink);
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let hello = || raw::hello(ProviderKind::Tcp, MIB);
        // Handshakes rcpd cannot serve.
        let cases = [
            (
                // A provider the server does not run.
                proto::HandshakeRequest {
                    providers: vec![proto::Provider::Verbs as i32],
                    ..hello()
                },
                "tcp provider",
            ),
            (
                proto::HandshakeRequest {
                    block_size: 5000,
                    ..hello()
                },
                "block size",
            ),
            (
                proto::HandshakeRequest {
                    checks: vec![proto::Check::Unspecified as i32],
                    ..hello()
                },
                "no check",
            ),
        ];
        for (req, what) in cases {
            let e = c.handshake(req).await.unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
            assert_eq!(raw::reason(&e), Reason::Invalid, "{what}: {e:?}");
            assert!(e.message().contains(what), "{what}: {e:?}");
        }
        let s = tcp_session(&mut c, MIB).await;
        let s4 = Arc::new(tcp_session(&mut c, BS4K).await);
        let sid = s.id();
        let frame = |session_id, open: Vec<proto::OpenFile>| ClientFrame {
            session_id,
            open,
            ..Default::default()
        };
        let never = proto::WindowDone {
            window: 999_999,
            ..Default::default()
        };
        let bad_dir = |direction| proto::OpenFile {
            direction,
            ..raw::push(1, "x", 10)
        };
        // Frames refused outright: (first frame, code, reason, words of
        // the message).
        let cases: Vec<(ClientFrame, Code, Reason, &str)> = vec![
            (
                frame(12345, vec![raw::push(1, "x", 10)]),
                Code::InvalidArgument,
                Reason::Invalid,
                "unknown session",
            ),
            (
                ClientFrame::default(),
                Code::InvalidArgument,
                Reason::Invalid,
                "unknown session",
            ),
            (
                frame(sid, vec![bad_dir(proto::Direction::Unspecified as i32)]),
                Code::Aborted,
                Reason::Protocol,
                "OpenFile: file 1: direction 0 is neither push nor pull",
            ),
            (
                frame(sid, vec![bad_dir(77)]),
                Code::Aborted,
                Reason::Protocol,
                "neither push nor pull",
            ),
            (
                frame(sid, vec![raw::pull(1, "nope")]),
                Code::NotFound,
                Reason::FileNotFound,
                "nope",
            ),
            (
                ClientFrame {
                    done: vec![never.clone()],
                    ..frame(sid, vec![raw::push(1, "y", 10)])
                },
                Code::Aborted,
                Reason::Protocol,
                "WindowDone: window 999999 was never granted",
            ),
            (
                ClientFrame {
                    done: vec![never],
                    ..frame(sid, vec![])
                },
                Code::Aborted,
                Reason::Protocol,
                "never granted",
            ),
            // Window 0, with no file open or with one: never granted
            // either (window ids start at 1).
            (
                ClientFrame {
                    done: vec![proto::WindowDone::default()],
                    ..frame(sid, vec![])
                },
                Code::Aborted,
                Reason::Protocol,
                "the client broke the protocol: WindowDone: window 0 was never granted",
            ),
            (
                ClientFrame {
                    done: vec![proto::WindowDone::default()],
                    ..frame(sid, vec![raw::push(1, "y", 10)])
                },
                Code::Aborted,
                Reason::Protocol,
                "WindowDone: window 0 was never granted",
            ),
            // FileEnd for a file never opened: 0, 7, and 7 beside an open
            // file 1.
            (
                ClientFrame {
                    end: vec![proto::FileEnd {
                        file: 0,
                        digest: vec![0; 32],
                    }],
                    ..frame(sid, vec![])
                },
                Code::Aborted,
                Reason::Protocol,
                "FileEnd: file 0 was never opened",
            ),
            (
                ClientFrame {
                    end: vec![proto::FileEnd {
                        file: 7,
                        digest: vec![0; 32],
                    }],
                    ..frame(sid, vec![])
                },
                Code::Aborted,
                Reason::Protocol,
                "FileEnd: file 7 was never opened",
            ),
            (
                ClientFrame {
                    end: vec![proto::FileEnd {
                        file: 7,
                        digest: vec![0; 32],
                    }],
                    ..frame(sid, vec![raw::push(1, "y", 10)])
                },
                Code::Aborted,
                Reason::Protocol,
                "FileEnd: file 7 was never opened",
            ),
            (
                ClientFrame {
                    end: vec![proto::FileEnd {
                        file: 1,
                        digest: vec![0; 16],
                    }],
                    ..frame(sid, vec![raw::push(1, "y", 10)])
                },
                Code::Aborted,
                Reason::Protocol,
                // The file is not open yet when its FileEnd is read.
                "FileEnd: file 1 is not open yet",
            ),
            (
                ClientFrame {
                    end: vec![proto::FileEnd {
                        file: 1,
                        digest: vec![0; 32],
                    }],
                    ..frame(sid, vec![raw::pull(1, "src")])
                },
                Code::Aborted,
                Reason::Protocol,
                "FileEnd: FileEnd for pulled file 1",
            ),
        ];
        for (first, code, reason, what) in cases {
            let mut m = Move::start(&mut c, first).await;
            let e = m.status().await;
            assert_eq!(e.code(), code, "{what}: {e:?}");
            assert_eq!(raw::reason(&e), reason, "{what}: {e:?}");
            assert!(e.message().contains(what), "{what}: {e:?}");
            // A failure of one file is also reported as FileFailed.
            for f in &m.inbox.failed {
                assert_eq!((f.file, f.reason), (1, reason as i32), "{what}: {f:?}");
            }
            if code == Code::NotFound {
                assert_eq!(m.inbox.failed.len(), 1, "{what}: {:?}", m.inbox);
            }
            assert!(m.inbox.grants.is_empty(), "{what}: {:?}", m.inbox);
        }

        // Answers to a live push window (two 4 KiB extents) that do not fit
        // its grant.
        type Answer = fn(&proto::Grant) -> proto::WindowDone;
        let wrong: [(Answer, &str); 5] = [
            (
                |g| proto::WindowDone {
                    round: 1,
                    ..raw::pushed(g, vec![vec![0; 32]; 2])
                },
                "round 1 is not granted (current round 0)",
            ),
            (
                |g| raw::pushed(g, vec![vec![0; 32]]),
                "needs 2 block digests of 32 bytes, got 1",
            ),
            (
                |g| raw::pushed(g, vec![vec![0; 32]; 3]),
                "needs 2 block digests of 32 bytes, got 3",
            ),
            (
                |g| raw::pushed(g, vec![vec![0; 16]; 2]),
                "block digests of 32 bytes",
            ),
            (|g| raw::pulled(g, vec![]), "block digests of 32 bytes"),
        ];
        for (done, what) in wrong {
            let (mut m, g) = push_granted(&mut c, s4.id(), "forged", 8192).await;
            assert_eq!(g.extents.len(), 2, "{g:?}");
            m.send_done(done(&g));
            let e = m.status().await;
            assert_eq!(e.code(), Code::Aborted, "{what}: {e:?}");
            assert_eq!(raw::reason(&e), Reason::Protocol, "{what}: {e:?}");
            assert!(e.message().contains(what), "{what}: {e:?}");
            assert!(m.inbox.acks.is_empty(), "{what}: {:?}", m.inbox);
        }

        // Digests that never match: asked again 3 times, then DATA_LOSS.
        let (mut m, g) = push_granted(&mut c, sid, "forged", 8192).await;
        assert_eq!(g.extents.len(), 1, "{g:?}");
        let mut round = 0;
        m.send_done(raw::pushed(&g, vec![vec![0u8; 32]]));
        let e = loop {
            match m.frame_or_status().await {
                Ok(f) => {
                    for a in &f.acks {
                        assert_eq!((a.window, &a.resend[..]), (g.window, &[0][..]), "{a:?}");
                    }
                    for again in f.grants {
                        assert_eq!((again.window, again.round), (g.window, round + 1));
                        assert_eq!(again.extents, g.extents, "the same extent again");
                        round = again.round;
                        m.send_done(raw::pushed(&again, vec![vec![0u8; 32]]));
                    }
                    m.inbox.failed.extend(f.failed);
                }
                Err(e) => break e,
            }
        };
        assert_eq!(round, 3, "three resends before giving up");
        assert_eq!(e.code(), Code::DataLoss, "{e:?}");
        assert_eq!(raw::reason(&e), Reason::Integrity, "{e:?}");
        assert!(e.message().contains("after 3 resends"), "{e:?}");
        let f = m.inbox.failed.pop_front().expect("FileFailed");
        assert_eq!((f.file, f.reason), (1, Reason::Integrity as i32), "{f:?}");

        // Blocks that all match, then a file digest that does not: nothing
        // is committed.
        let data = vec![0x17u8; 4096];
        let (mut m, g) = push_granted(&mut c, s4.id(), "liar", 4096).await;
        let (s4c, g2, d2) = (s4.clone(), g.clone(), data.clone());
        let st = tokio::task::spawn_blocking(move || s4c.write(g2.addr, g2.rkey, &d2))
            .await
            .unwrap();
        assert_eq!(st, WcStatus::Success);
        m.send_done(raw::pushed(&g, vec![raw::sha256(&data)]));
        assert!(m.ack().await.resend.is_empty());
        m.send_end(1, raw::file_digest(&[0x18u8; 4096], BS4K));
        let e = m.status().await;
        assert_eq!(raw::reason(&e), Reason::Integrity, "{e:?}");
        assert!(m.inbox.committed.is_empty(), "{:?}", m.inbox);
    });
    for name in ["x", "y", "z", "forged", "liar", "nope"] {
        assert!(!root.join(name).exists(), "{name} is under its final name");
    }
    bg.finishes(&root);
    // Still serving.
    let f = tmp.path().join("after");
    std::fs::write(&f, b"still here").unwrap();
    let r = rcp(
        d.port,
        T,
        None,
        &["push", f.to_str().unwrap(), "127.0.0.1:/"],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(std::fs::read(root.join("after")).unwrap(), b"still here");
}

/// A frame larger than rcpd decodes (5 MiB of path; tonic's limit is 4 MiB)
/// fails the stream with an error status, as the first frame and later.
#[test]
fn an_oversized_frame_is_refused() {
    let (_tmp, root, d) = setup(None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let s = tcp_session(&mut c, MIB).await;
        let big = || ClientFrame {
            session_id: s.id(),
            open: vec![proto::OpenFile {
                path: "a".repeat(5 << 20),
                ..raw::push(1, "z", 10)
            }],
            ..Default::default()
        };
        let first = Move::start(&mut c, big()).await.status().await;
        let mut m = Move::open(&mut c, s.id(), vec![]).await;
        m.send(big());
        let later = m.status().await;
        for e in [first, later] {
            assert!(
                matches!(
                    e.code(),
                    Code::OutOfRange | Code::ResourceExhausted | Code::InvalidArgument
                ),
                "{e:?}"
            );
        }
    });
    assert!(!root.join("z").exists());
}

/// A second OpenFile with an id already taken is a duplicate the core
/// drops (`ServerCore::on_open`): while the file is open and after it was
/// committed. Nothing is opened for it, the stream goes on, and its path
/// never appears.
#[test]
fn a_second_open_of_a_file_id_is_ignored() {
    let (_tmp, root, d) = setup(None);
    let data: Vec<u8> = (0..4096u32).map(|i| (i % 253) as u8).collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let s = Arc::new(tcp_session(&mut c, BS4K).await);
        let (mut m, g) = push_granted(&mut c, s.id(), "dup", 4096).await;
        m.send_open(vec![raw::push(1, "dup2", 8192)]);
        push_one_block(&s, &mut m, &g, &data).await;
        let cm = m.committed().await;
        assert_eq!(
            (cm.file, cm.path.as_str(), cm.length),
            (1, "dup", 4096),
            "{cm:?}"
        );
        // The id of a committed file, again.
        m.send_open(vec![raw::push(1, "dup3", 4096)]);
        m.close();
        m.finish().await;
        assert!(
            m.inbox.is_empty(),
            "nothing for the duplicates: {:?}",
            m.inbox
        );
    });
    assert_eq!(std::fs::read(root.join("dup")).unwrap(), data);
    assert!(!root.join("dup2").exists());
    assert!(!root.join("dup3").exists());
}

/// Later in a stream, with a push open and its window written: a frame
/// outside the protocol ends the stream with a violation naming it, the
/// file is not committed (though the right answers follow), and rcpd logs
/// it once.
#[test]
fn a_frame_outside_the_protocol_later_in_a_stream_ends_it() {
    let (_tmp, root, d) = setup(None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let data = vec![9u8; 4096];
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let s = Arc::new(tcp_session(&mut c, BS4K).await);
        type Forged = fn(&proto::Grant) -> ClientFrame;
        let forged: [(&str, Forged, &str); 4] = [
            (
                "w0",
                |_| ClientFrame {
                    done: vec![proto::WindowDone::default()],
                    ..Default::default()
                },
                "WindowDone: window 0 was never granted",
            ),
            (
                "wnext",
                |g| ClientFrame {
                    done: vec![proto::WindowDone {
                        window: g.window + 1,
                        ..Default::default()
                    }],
                    ..Default::default()
                },
                "was never granted",
            ),
            (
                "f7",
                |_| ClientFrame {
                    end: vec![proto::FileEnd {
                        file: 7,
                        digest: vec![0; 32],
                    }],
                    ..Default::default()
                },
                "FileEnd: file 7 was never opened",
            ),
            (
                "f16",
                |_| ClientFrame {
                    end: vec![proto::FileEnd {
                        file: 1,
                        digest: vec![0; 16],
                    }],
                    ..Default::default()
                },
                "FileEnd: file 1: a file digest of 16 bytes, not 32",
            ),
        ];
        for (name, forge, what) in forged {
            let path = format!("later-{name}");
            let (mut m, g) = push_granted(&mut c, s.id(), &path, 4096).await;
            assert_eq!(s.write(g.addr, g.rkey, &data), WcStatus::Success);
            // The forged frame, then every right answer (rcpd may have
            // ended the stream before they go out).
            m.send(forge(&g));
            m.try_send(ClientFrame {
                done: vec![raw::pushed(&g, vec![raw::sha256(&data)])],
                end: vec![proto::FileEnd {
                    file: 1,
                    digest: raw::file_digest(&data, BS4K),
                }],
                ..Default::default()
            });
            let e = m.status().await;
            assert_eq!(e.code(), Code::Aborted, "{name}: {e:?}");
            assert_eq!(raw::reason(&e), Reason::Protocol, "{name}: {e:?}");
            assert!(e.message().contains(what), "{name}: {e:?}");
            assert!(m.inbox.committed.is_empty(), "{name}: {:?}", m.inbox);
            assert!(!root.join(&path).exists(), "{name}: committed");
        }
    });
    // One line each in rcpd's log.
    let log = d.log();
    for what in ["window 0 was never granted", "file 7 was never opened"] {
        let n = log.lines().filter(|l| l.contains(what)).count();
        assert_eq!(n, 1, "{what}: {n} lines in\n{log}");
    }
}

/// Abort is the client's last word: the stream ends with it (retryable,
/// naming it); rcpd reads nothing after it and commits nothing.
#[test]
fn a_frame_after_abort_changes_nothing() {
    let (_tmp, root, d) = setup(None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let data = vec![3u8; 4096];
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let s = Arc::new(tcp_session(&mut c, BS4K).await);
        let (mut m, g) = push_granted(&mut c, s.id(), "aborted", 4096).await;
        assert_eq!(s.write(g.addr, g.rkey, &data), WcStatus::Success);
        m.send(ClientFrame {
            abort: Some(proto::Abort {
                reason: "changed my mind".into(),
            }),
            ..Default::default()
        });
        m.try_send(ClientFrame {
            done: vec![raw::pushed(&g, vec![raw::sha256(&data)])],
            end: vec![proto::FileEnd {
                file: 1,
                digest: raw::file_digest(&data, BS4K),
            }],
            ..Default::default()
        });
        let e = m.status().await;
        assert_eq!(raw::reason(&e), Reason::Retryable, "{e:?}");
        assert!(e.message().contains("changed my mind"), "{e:?}");
        assert!(m.inbox.committed.is_empty(), "{:?}", m.inbox);
        assert!(!root.join("aborted").exists());
    });
}

/// A session runs one Move stream at a time: a second one while the first
/// runs is refused naming the rule, the first goes on and commits, and once
/// it is over the session serves the next.
#[test]
fn a_second_move_stream_on_a_session_is_refused() {
    let (_tmp, root, d) = setup(None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let data = vec![4u8; 4096];
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let s = Arc::new(tcp_session(&mut c, BS4K).await);
        let (mut first, g) = push_granted(&mut c, s.id(), "first", 4096).await;
        // The first stream holds a granted window: it is running.
        for open in [vec![raw::push(1, "second", 4096)], vec![]] {
            let mut second = Move::open(&mut c, s.id(), open).await;
            let e = second.status().await;
            assert_eq!(e.code(), Code::Aborted, "{e:?}");
            assert_eq!(raw::reason(&e), Reason::Protocol, "{e:?}");
            assert!(
                e.message()
                    .contains("already has a Move stream running (one at a time)"),
                "{e:?}"
            );
            assert!(second.inbox.is_empty(), "{:?}", second.inbox);
        }
        assert!(!root.join("second").exists());
        // The first is untouched by them.
        assert_eq!(s.write(g.addr, g.rkey, &data), WcStatus::Success);
        first.send_done(raw::pushed(&g, vec![raw::sha256(&data)]));
        first.send_end(1, raw::file_digest(&data, BS4K));
        assert_eq!(first.committed().await.path, "first");
        first.close();
        first.finish().await;
        assert_eq!(std::fs::read(root.join("first")).unwrap(), data);
        // Over: the session takes the next stream at once.
        let (mut next, g) = push_granted(&mut c, s.id(), "next", 4096).await;
        assert_eq!(s.write(g.addr, g.rkey, &data), WcStatus::Success);
        next.send_done(raw::pushed(&g, vec![raw::sha256(&data)]));
        next.send_end(1, raw::file_digest(&data, BS4K));
        assert_eq!(next.committed().await.path, "next");
        next.close();
        next.finish().await;
    });
    let log = d.log();
    assert_eq!(
        log.lines()
            .filter(|l| l.contains("second Move stream refused"))
            .count(),
        2,
        "{log}"
    );
}

/// A session belongs to the client that opened it: another client (here
/// from 127.0.0.2, with the same token) that names its id can neither run a
/// Move stream on it nor close it, and is told no such session exists;
/// the owner then uses and closes it as usual.
#[test]
fn another_clients_session_is_not_found() {
    let (_tmp, root, d) = setup(None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let hs = c
            .handshake(raw::hello(ProviderKind::Tcp, BS4K))
            .await
            .unwrap()
            .into_inner();
        let other = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{}", d.port))
            .unwrap()
            .local_address(Some("127.0.0.2".parse().unwrap()))
            .connect()
            .await
            .unwrap();
        let mut other = Client::new(other);
        let mut m = Move::open(
            &mut other,
            hs.session_id,
            vec![raw::push(1, "theirs", 4096)],
        )
        .await;
        let e = m.status().await;
        assert!(e.message().contains("unknown session"), "{e:?} {}", d.log());
        let e = other
            .close_session(proto::CloseSessionRequest {
                session_id: hs.session_id,
            })
            .await
            .unwrap_err();
        assert!(e.message().contains("unknown session"), "{e:?}");
        assert!(!root.join("theirs").exists());
        // Still the owner's: a Move stream runs on it, and it closes.
        let mut mine = Move::open(&mut c, hs.session_id, vec![raw::push(1, "mine", 4096)]).await;
        assert_eq!(mine.opened().await.file, 1);
        mine.close();
        c.close_session(proto::CloseSessionRequest {
            session_id: hs.session_id,
        })
        .await
        .expect("the owner closes its session");
    });
}

/// A client proposing a 1 ms timeout (and out-of-range windows) gets the
/// floors: rcpd clamps them in the handshake, and its keepalives on an
/// idle stream come at most four a second (it sent ~700 a second before).
#[test]
fn a_one_ms_timeout_does_not_make_rcpd_flood_keepalives() {
    let (_tmp, _root, d) = setup(None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let hs = c
            .handshake(proto::HandshakeRequest {
                timeout_ms: 1,
                window_count: 100_000,
                ..raw::hello(ProviderKind::Tcp, BS4K)
            })
            .await
            .unwrap()
            .into_inner();
        assert!((1..=64).contains(&hs.window_count), "{hs:?}");
        assert_eq!(hs.max_retries, 3, "{hs:?}");
        let mut m = Move::open(&mut c, hs.session_id, vec![]).await;
        let t = std::time::Instant::now();
        let mut keepalives = 0u32;
        while t.elapsed() < Duration::from_secs(2) {
            match tokio::time::timeout(Duration::from_millis(100), m.frame_or_status()).await {
                Err(_) => {}
                Ok(Ok(f)) => panic!("an idle stream sent {f:?}"),
                Ok(Err(s)) => panic!("the stream ended: {s:?}"),
            }
            keepalives = m.keepalives;
        }
        let secs = t.elapsed().as_secs_f64();
        assert!(keepalives >= 1, "no keepalive in {secs:.1} s");
        assert!(
            f64::from(keepalives) <= 4.0 * secs + 1.0,
            "{keepalives} keepalives in {secs:.1} s"
        );
    });
    // rcpd says what it agreed (the log may be coloured).
    let log = d.log();
    assert!(
        log.lines().any(|l| l.contains("session opened")
            && l.contains("keepalive_ms")
            && l.contains("333")),
        "{log}"
    );
}

/// Rcpd after a stream that broke the protocol with `what`: one line of
/// its log names it.
fn logged_once(d: &Rcpd, what: &str) {
    let log = d.log();
    let n = log.lines().filter(|l| l.contains(what)).count();
    assert_eq!(n, 1, "{what}: {n} lines in\n{log}");
}

/// File id 0 (a proto3 default: a client that forgot to set it) is a
/// protocol violation (docs/protocol.md, "Messages outside the
/// protocol"): the stream ends naming it, nothing is created.
#[test]
fn file_id_zero_is_a_protocol_violation() {
    let (_tmp, root, d) = setup(None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let s = tcp_session(&mut c, BS4K).await;
        let mut m = Move::open(&mut c, s.id(), vec![raw::push(0, "zero", 4096)]).await;
        let e = m.status().await;
        assert_eq!(e.code(), Code::Aborted, "{e:?}");
        assert_eq!(raw::reason(&e), Reason::Protocol, "{e:?}");
        assert!(
            e.message().contains("OpenFile: file id 0 is reserved"),
            "{e:?}"
        );
        assert!(
            m.inbox.opened.is_empty(),
            "file 0 was opened: {:?}",
            m.inbox
        );
    });
    assert_eq!(names(&root), Vec::<String>::new());
    logged_once(&d, "file id 0 is reserved");
}

/// A second FileEnd for a file with a different digest is a protocol
/// violation (docs/protocol.md): the stream ends naming it, though the
/// file's blocks and its first, right digest came; nothing is committed.
#[test]
fn a_second_different_file_digest_is_a_protocol_violation() {
    let (_tmp, root, d) = setup(None);
    let data = vec![5u8; 4096];
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let s = tcp_session(&mut c, BS4K).await;
        let (mut m, g) = push_granted(&mut c, s.id(), "twice", 4096).await;
        assert_eq!(s.write(g.addr, g.rkey, &data), WcStatus::Success);
        let right = raw::file_digest(&data, BS4K);
        let mut wrong = right.clone();
        wrong[0] ^= 1;
        // Both digests before the window's WindowDone: the file cannot be
        // committed before the second arrives.
        m.send_end(1, right);
        m.send_end(1, wrong);
        m.try_send(ClientFrame {
            done: vec![raw::pushed(&g, vec![raw::sha256(&data)])],
            ..Default::default()
        });
        let e = m.status().await;
        assert_eq!(e.code(), Code::Aborted, "{e:?}");
        assert_eq!(raw::reason(&e), Reason::Protocol, "{e:?}");
        assert!(
            e.message()
                .contains("FileEnd: file 1: two different file digests"),
            "{e:?}"
        );
        assert!(m.inbox.committed.is_empty(), "{:?}", m.inbox);
    });
    assert!(!root.join("twice").exists(), "{:?}", names(&root));
    logged_once(&d, "two different file digests");
}

/// rcpd's `--max-open-files` is what its handshake agrees; a client that
/// opens more files at once than agreed breaks the protocol
/// (docs/protocol.md): the stream ends naming the limit, and the files
/// opened within it are not committed.
#[test]
fn more_files_open_than_agreed_is_a_protocol_violation() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let d = Rcpd::start(&root, T, None, &["--max-open-files", "2"]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let s = tcp_session(&mut c, BS4K).await;
        assert_eq!(s.hs.max_open_files, 2, "{:?}", s.hs);
        let open = (1..=3).map(|f| raw::push(f, &format!("f{f}"), 4096));
        let mut m = Move::open(&mut c, s.id(), open.collect()).await;
        let e = m.status().await;
        assert_eq!(e.code(), Code::Aborted, "{e:?}");
        assert_eq!(raw::reason(&e), Reason::Protocol, "{e:?}");
        assert!(
            e.message()
                .contains("OpenFile: file 3: more than 2 files open at once"),
            "{e:?}"
        );
        assert!(m.inbox.committed.is_empty(), "{:?}", m.inbox);
    });
    assert!(!root.join("f3").exists(), "{:?}", names(&root));
    logged_once(&d, "more than 2 files open at once");
}

/// rcpd killed mid-push (a window of the 64 MiB file verified, the copy
/// held by `--bwlimit` to 16 MiB/s, 4 s at least, and seen running when
/// rcpd is killed): the copy fails retryably, part of the file was moved,
/// nothing is under the final name, and another rcpd resumes it.
#[test]
fn killed_daemon_leaves_no_file_under_the_final_name() {
    let (tmp, root, mut d) = setup(None);
    let src = tmp.path().join("big");
    make_file(&src, 64 << 20, 3);
    let bs = ["--block-size", "64K"];
    let held = ["--bwlimit", "16777216"];
    let p = src.to_str().unwrap();
    let mut child = rcp_cmd(
        d.port,
        T,
        None,
        &[&bs[..], &["push", "-q"], &held, &[p, "127.0.0.1:/"]].concat(),
    )
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    wait_verified_while(&root, "big", 64, &mut child, || d.log());
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    // The kill landed mid-copy: the copy was running, and the manifest
    // holds part of the file's 1024 blocks.
    let verified = verified_blocks(&root, "big").expect("a manifest");
    assert!(
        verified < 1024,
        "all {verified} blocks were verified before the kill"
    );
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(5),
        "a dead server is a retryable error: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!root.join("big").exists());
    // Another rcpd on the same root resumes it.
    let d2 = Rcpd::start(&root, T, None, &[]);
    let r = rcp(
        d2.port,
        T,
        None,
        &[&bs[..], &["push", "--resume", p, "127.0.0.1:/"]].concat(),
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(moved(&r.stdout) < 64 << 20, "{}", r.stdout);
    assert_eq!(sha256sum(&src), sha256sum(&root.join("big")));
}

/// SIGTERM while a push runs: rcpd stops taking requests but lets it
/// finish, then exits 0. The signal comes once a window of the copy is
/// verified, the copy held by `--bwlimit` (24 MiB at 6 MiB/s: 4 s at
/// least), and rcpd says it had the transfer running when the signal came.
#[test]
fn sigterm_lets_the_running_copy_finish() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    // A grace no loaded machine runs out of: the copy must finish.
    let d = Rcpd::start(&root, T, None, &["--shutdown-grace", "600"]);
    let src = tmp.path().join("inflight");
    make_file(&src, 24 << 20, 99);
    let p = src.to_str().unwrap();
    let args = ["push", "-q", "--bwlimit", "6291456", p, "127.0.0.1:/"];
    let mut child = rcp_cmd(d.port, T, None, &args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let window = rcp::control::WINDOW_SIZE as u64 / (1 << 20);
    wait_verified_while(&root, "inflight", window, &mut child, || d.log());
    nix_kill(d.child.id(), "TERM");
    Bg { child, src }.finishes(&root);
    let mut d = d;
    let st = d.child.wait().unwrap();
    assert!(st.success(), "rcpd exit {st:?}: {}", d.log());
    let log = d.log();
    assert!(
        log.lines()
            .any(|l| l.contains("shutting down") && l.contains("active=1")),
        "rcpd had no transfer running when SIGTERM came:\n{log}"
    );
}

#[test]
fn health_port_serves_without_auth() {
    let (_tmp, _root, d) = setup(Some("tok"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let addr = d.health.clone().unwrap();
    rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
        let r = h
            .check(tonic_health::pb::HealthCheckRequest {
                service: "rcp.v1.Rcp".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
    });
}

fn nix_kill(pid: u32, sig: &str) {
    let st = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

#[test]
fn a_damaged_block_is_sent_again() {
    let (_tmp, root, d) = setup(None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let good: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let s = Arc::new(tcp_session(&mut c, BS4K).await);
        let open = proto::OpenFile {
            flat_sha256: true,
            ..raw::push(1, "resent", 8192)
        };
        let mut m = Move::open(&mut c, s.id(), vec![open]).await;
        assert_eq!(m.opened().await.path, "resent");
        let g = m.grant().await;
        assert_eq!((g.len, g.round, g.extents.len()), (8192, 0, 2), "{g:?}");
        let (e0, e1) = (g.extents[0], g.extents[1]);
        assert_eq!((e0.block, e1.block), (0, 1), "{g:?}");
        // Block 0 intact, block 1 damaged on the way.
        let (b0, b1) = (good[..4096].to_vec(), good[4096..].to_vec());
        let (s2, g2) = (s.clone(), g.clone());
        let st = tokio::task::spawn_blocking(move || {
            (
                s2.write(g2.addr + e0.offset, g2.rkey, &b0),
                s2.write(g2.addr + e1.offset, g2.rkey, &[0u8; 4096]),
            )
        })
        .await
        .unwrap();
        assert_eq!(st, (WcStatus::Success, WcStatus::Success));
        let digests = vec![raw::sha256(&good[..4096]), raw::sha256(&good[4096..])];
        m.send_done(raw::pushed(&g, digests.clone()));
        let a = m.ack().await;
        assert_eq!((a.window, a.resend), (g.window, vec![1]));
        // Just the damaged extent, in the next round and a fresh rkey.
        let again = m.grant().await;
        assert_eq!((again.window, again.round), (g.window, 1));
        assert_eq!(again.extents, vec![e1], "only block 1, at its offset");
        assert_ne!(again.rkey, g.rkey, "a fresh rkey");
        let (old, again2) = (g.rkey, again.clone());
        let st = tokio::task::spawn_blocking(move || {
            (
                // The old rkey is revoked.
                s.write_on(&*own(&s), again2.addr + e1.offset, old, &[1u8; 4096]),
                s.write(again2.addr + e1.offset, again2.rkey, &b1),
            )
        })
        .await
        .unwrap();
        assert_eq!(st, (WcStatus::RemoteAccess, WcStatus::Success));
        m.send_done(raw::pushed(&again, vec![digests[1].clone()]));
        let a = m.ack().await;
        assert_eq!(a.window, g.window);
        assert!(a.resend.is_empty(), "{a:?}");
        let fd = raw::file_digest(&good, BS4K);
        m.send_end(1, fd.clone());
        let cm = m.committed().await;
        assert_eq!((cm.file, cm.length), (1, 8192), "{cm:?}");
        assert_eq!(cm.digest, fd, "the file digest");
        assert_eq!(cm.flat_sha256, raw::sha256(&good), "the flat SHA-256");
        m.close();
        m.finish().await;
        assert!(m.inbox.is_empty(), "{:?}", m.inbox);
    });
    assert_eq!(std::fs::read(root.join("resent")).unwrap(), good);
    // The damaged block counted once, the file once, as a good push.
    let t = common::metrics::scrape(d.metrics.as_deref().unwrap());
    assert_eq!(
        common::metrics::sample(&t, "rcpd_integrity_failures_total"),
        Some(1.0),
        "{t}"
    );
    let ok = r#"rcp_transfers_total{direction="push",outcome="ok"}"#;
    assert_eq!(common::metrics::sample(&t, ok), Some(1.0), "{t}");
    assert_eq!(
        common::metrics::sample(&t, r#"rcp_bytes_total{direction="push"}"#),
        Some(8192.0),
        "{t}"
    );
    assert_eq!(
        common::metrics::sample(&t, "rcp_active_transfers"),
        Some(0.0),
        "{t}"
    );
}

/// `OpenFile.absent` (a tree's file the client found free): rcpd does not
/// look at the name before it makes the file. A regular file that stands
/// there after all is replaced at commit with the source's mode (not kept
/// at its own, as a file rcpd looked at would be); a directory there is
/// refused then, untouched, with nothing left beside it.
#[test]
fn a_name_said_absent_is_not_looked_at_and_nothing_there_is_lost() {
    use std::os::unix::fs::PermissionsExt;
    let (_tmp, root, d) = setup(None);
    std::fs::create_dir_all(root.join("t/dir")).unwrap();
    std::fs::write(root.join("t/dir/inside"), b"kept").unwrap();
    std::fs::write(root.join("t/file"), b"old").unwrap();
    std::fs::set_permissions(root.join("t/file"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    let push = |name: &str| proto::OpenFile {
        create_parents: true,
        absent: true,
        mode: 0o100644,
        ..raw::push(1, name, 4096)
    };
    let results: Vec<(Option<proto::Committed>, Option<proto::FileFailed>)> = rt.block_on(async {
        let mut c = grpc(d.port).await;
        let mut out = Vec::new();
        for name in ["t/file", "t/dir"] {
            let s = Arc::new(tcp_session(&mut c, BS4K).await);
            let mut m = Move::open(&mut c, s.id(), vec![push(name)]).await;
            assert_eq!(m.opened().await.path, name);
            let g = m.grant().await;
            push_one_block(&s, &mut m, &g, &data).await;
            let r = m
                .wait("Committed or FileFailed", |i| {
                    match (i.committed.pop_front(), i.failed.pop_front()) {
                        (None, None) => None,
                        r => Some(r),
                    }
                })
                .await;
            m.close();
            match r.1 {
                // A failed file ends the stream.
                Some(_) => assert!(m.status().await.message().contains(name)),
                None => m.finish().await,
            }
            out.push(r);
        }
        out
    });
    assert!(results[0].0.is_some(), "{:?}", results[0]);
    assert_eq!(std::fs::read(root.join("t/file")).unwrap(), data);
    let mode = std::fs::metadata(root.join("t/file"))
        .unwrap()
        .permissions()
        .mode();
    let umask = rcp::files::mode::process_umask();
    assert_eq!(mode & 0o777, 0o644 & !umask, "the source's mode, not 0600");
    let failed = results[1]
        .1
        .as_ref()
        .expect("a directory at the name is refused");
    assert!(failed.message.contains("t/dir"), "{failed:?}");
    assert!(failed.message.contains("directory"), "{failed:?}");
    assert_eq!(std::fs::read(root.join("t/dir/inside")).unwrap(), b"kept");
    let mut left: Vec<_> = std::fs::read_dir(root.join("t"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left, ["dir", "file"], "nothing beside them");
}

/// Pull: a block the client reports damaged (WindowDone.bad) is read from
/// the file again and granted alone in the next round, with its digest
/// and a fresh rkey; the old rkey is revoked.
#[test]
fn a_damaged_pulled_block_is_granted_again() {
    let (_tmp, root, d) = setup(None);
    make_file(&root.join("src"), 2 * BS4K + 5, 11);
    let data = std::fs::read(root.join("src")).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let s = Arc::new(tcp_session(&mut c, BS4K).await);
        let mut m = Move::open(&mut c, s.id(), vec![raw::pull(1, "src")]).await;
        assert_eq!(m.opened().await.length, data.len() as u64);
        let g = m.grant().await;
        assert_eq!(
            (g.round, g.extents.len(), g.digests.len()),
            (0, 3, 3),
            "{g:?}"
        );
        let block = |b: u64| {
            &data[(b * BS4K) as usize..][..(data.len() - (b * BS4K) as usize).min(BS4K as usize)]
        };
        for (e, dg) in g.extents.iter().zip(&g.digests) {
            assert_eq!(dg, &raw::sha256(block(e.block)), "{e:?}");
        }
        // Block 1 "arrived damaged".
        m.send_done(raw::pulled(&g, vec![1]));
        let again = m.grant().await;
        assert_eq!((again.window, again.round), (g.window, 1));
        assert_eq!(
            again.extents,
            vec![g.extents[1]],
            "only block 1, at its offset"
        );
        assert_eq!(again.digests, vec![g.digests[1].clone()]);
        assert_ne!(again.rkey, g.rkey, "a fresh rkey");
        let (s2, g2, a2) = (s.clone(), g.clone(), again.clone());
        let e1 = again.extents[0];
        let (old, new) = tokio::task::spawn_blocking(move || {
            let at = a2.addr + e1.offset;
            (
                s2.read_on(&*own(&s2), at, g2.rkey, e1.len as usize).0,
                s2.read(at, a2.rkey, e1.len as usize),
            )
        })
        .await
        .unwrap();
        assert_eq!(old, WcStatus::RemoteAccess, "the old rkey is revoked");
        assert_eq!(new.0, WcStatus::Success);
        assert!(new.1 == block(1), "block 1 read again from the file");
        m.send_done(raw::pulled(&again, vec![]));
        let end = m.end().await;
        assert_eq!(end.digest, raw::file_digest(&data, BS4K));
        m.close();
        m.finish().await;
        assert!(m.inbox.is_empty(), "{:?}", m.inbox);
    });
}

/// Two sessions at once: session 2 uses session 1's currently valid window
/// rkey and address over its own data connection. The target refuses it
/// (each session has its own protection domain), session 1's bytes stay
/// as written and its copy commits with the right digest.
#[test]
fn an_rkey_works_only_in_its_own_session() {
    let (_tmp, root, d) = setup(None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let good: Vec<u8> = (0..8192u32).map(|i| (i % 249) as u8).collect();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let s1 = Arc::new(tcp_session(&mut c, BS4K).await);
        let s2 = Arc::new(tcp_session(&mut c, BS4K).await);
        assert_ne!(s1.hs.tcp_session_key, s2.hs.tcp_session_key);
        let open = proto::OpenFile {
            flat_sha256: true,
            ..raw::push(1, "victim", 8192)
        };
        let mut m = Move::open(&mut c, s1.id(), vec![open]).await;
        m.opened().await;
        let g = m.grant().await;
        assert_eq!(g.extents.len(), 2, "{g:?}");
        let (e0, e1) = (g.extents[0], g.extents[1]);
        let (b0, b1) = (good[..4096].to_vec(), good[4096..].to_vec());
        let (g2, s1b) = (g.clone(), s1.clone());
        let st = tokio::task::spawn_blocking(move || {
            let (lo, hi) = (g2.addr + e0.offset, g2.addr + e1.offset);
            let mine = (s1b.write(lo, g2.rkey, &b0), s1b.write(hi, g2.rkey, &b1));
            let junk = [0xee; 4096];
            // Session 1's window is live and its rkey valid: session 2
            // tries it over its own data connection...
            let other = s2.write(lo, g2.rkey, &junk);
            let other_hi = s2.write_on(&*own(&s2), hi, g2.rkey, &junk);
            // ...and so do a connection bound to no session and one naming
            // a key nobody was given.
            let unbound = s2.write_on(&*s2.tcp_channel(None), lo, g2.rkey, &junk);
            let unknown = s2.write_on(&*s2.tcp_channel(Some([0x42; 16])), lo, g2.rkey, &junk);
            (mine, other, other_hi, unbound, unknown)
        })
        .await
        .unwrap();
        assert_eq!(st.0, (WcStatus::Success, WcStatus::Success));
        assert_eq!(st.1, WcStatus::RemoteAccess, "cross-session rkey");
        assert_eq!(st.2, WcStatus::RemoteAccess, "cross-session rkey");
        assert_eq!(st.3, WcStatus::RemoteAccess, "no session");
        assert_eq!(st.4, WcStatus::RemoteAccess, "unknown session");
        // Session 1's bytes are intact: no block needs resending.
        m.send_done(raw::pushed(
            &g,
            vec![raw::sha256(&good[..4096]), raw::sha256(&good[4096..])],
        ));
        let a = m.ack().await;
        assert!(a.resend.is_empty(), "{a:?}");
        let fd = raw::file_digest(&good, BS4K);
        m.send_end(1, fd.clone());
        let cm = m.committed().await;
        assert_eq!(cm.digest, fd);
        assert_eq!(cm.flat_sha256, raw::sha256(&good));
        m.close();
        m.finish().await;
    });
    assert_eq!(std::fs::read(root.join("victim")).unwrap(), good);
    assert_eq!(
        sha256sum(&root.join("victim")),
        hex::encode(raw::sha256(&good)),
        "session 1's copy has the right digest"
    );
}

/// A path and an abort reason carrying a newline, a bell, an escape and a
/// right-to-left override go into rcpd's log escaped (src/escape.rs): no
/// line of the log starts with what followed the newline, none of those
/// characters is in the log as itself, and the escapes are there. The file
/// itself is stored under its name as given.
#[test]
fn paths_and_abort_reasons_are_escaped_in_the_log() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    // Paths are logged at debug.
    let d = Rcpd::start(&root, T, None, &["--log", "rcp=debug"]);
    let name = "evil\nFORGED-PATH-LINE \u{7}\u{1b}[2J\u{202e}txt";
    let reason = "bye\nFORGED-ABORT-LINE \u{7}\u{202e}";
    let data = vec![8u8; 4096];
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = grpc(d.port).await;
        let s = tcp_session(&mut c, BS4K).await;
        let (mut m, g) = push_granted(&mut c, s.id(), name, 4096).await;
        assert_eq!(s.write(g.addr, g.rkey, &data), WcStatus::Success);
        m.send_done(raw::pushed(&g, vec![raw::sha256(&data)]));
        m.send_end(1, raw::file_digest(&data, BS4K));
        assert_eq!(m.committed().await.file, 1);
        m.close();
        m.finish().await;
        let (mut m, _g) = push_granted(&mut c, s.id(), "aborted", 4096).await;
        m.send(ClientFrame {
            abort: Some(proto::Abort {
                reason: reason.into(),
            }),
            ..Default::default()
        });
        let e = m.status().await;
        assert!(e.message().contains(reason), "{e:?}");
    });
    assert_eq!(std::fs::read(root.join(name)).unwrap(), data);
    let log = d.log();
    for forged in ["FORGED-PATH-LINE", "FORGED-ABORT-LINE"] {
        let logged: Vec<&str> = log.lines().filter(|l| l.contains(forged)).collect();
        assert!(!logged.is_empty(), "{forged} not logged:\n{log}");
        for l in &logged {
            assert!(
                l.contains(&format!("\\n{forged}")),
                "{forged} not after an escaped newline: {l:?} in\n{log:?}"
            );
        }
    }
    for c in ['\u{7}', '\u{202e}'] {
        assert!(!log.contains(c), "{c:?} in the log as itself:\n{log:?}");
    }
    for e in ["\\u{7}", "\\u{1b}", "\\u{202e}"] {
        assert!(log.contains(e), "no {e} in the log:\n{log}");
    }
    // The path's escape (a colour code could bring its own ESC).
    assert!(!log.contains("\u{1b}[2J"), "{log:?}");
}

/// `/metrics` names no path, token or key: a copy with a token to paths of
/// distinctive names, and a raw session (its data-channel key known) are
/// running or done when it is scraped, and none of them is in the text.
#[test]
fn metrics_expose_no_path_token_or_key() {
    const TOKEN: &str = "tok-Zq81xMetricsSecret";
    let (tmp, root, d) = setup(Some(TOKEN));
    let dir = tmp.path().join("dir-Wq7Distinctive");
    std::fs::create_dir(&dir).unwrap();
    let src = dir.join("file-Kx3Distinctive");
    make_file(&src, 3 << 20, 21);
    let r = rcp(
        d.port,
        T,
        Some(TOKEN),
        &[
            "push",
            "-q",
            src.to_str().unwrap(),
            "127.0.0.1:/remote-Pv5Distinctive",
        ],
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(root.join("remote-Pv5Distinctive").exists());
    let text = common::metrics::scrape(d.metrics.as_deref().unwrap());
    // The scrape saw the copy (so it is the right rcpd).
    assert!(
        text.contains(r#"rcp_transfers_total{direction="push",outcome="ok"} 1"#),
        "{text}"
    );
    // A raw session (its key known) with a push open, on an rcpd without a
    // token (the raw rig speaks none), scraped while it is open.
    let (_tmp2, _root2, d2) = setup(None);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (text2, key) = rt.block_on(async {
        let mut c = grpc(d2.port).await;
        let s = tcp_session(&mut c, BS4K).await;
        let (_m, _g) = push_granted(&mut c, s.id(), "open-Hj2Distinctive", 4096).await;
        let key: String = s.key().iter().map(|b| format!("{b:02x}")).collect();
        let text = common::metrics::scrape(d2.metrics.as_deref().unwrap());
        (text, key)
    });
    assert!(text2.contains("rcp_active_transfers 1"), "{text2}");
    let text = text + &text2;
    let secrets = [
        TOKEN,
        "Zq81x",
        "Wq7Distinctive",
        "Kx3Distinctive",
        "Pv5Distinctive",
        "Hj2Distinctive",
        &key,
    ];
    for s in secrets {
        assert!(!text.contains(s), "/metrics shows {s:?}:\n{text}");
    }
}
