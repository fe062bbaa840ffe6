//! TLS and mutual TLS on rcpd's gRPC port (tcp provider, natively): a client
//! with a certificate the server's CA signed copies; one without a
//! certificate, with a certificate from another CA, trusting the wrong CA, or
//! speaking plaintext is refused and nothing is written.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

const T: &str = "tcp";

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("openssl (apt-get install openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA named `ca` and a leaf `name` it signs, with `ext` (subjectAltName,
/// extendedKeyUsage). Files: ca.pem, ca.key, name.pem, name.key.
fn ca(dir: &Path, ca: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={ca}"),
            "-keyout",
            &format!("{ca}.key"),
            "-out",
            &format!("{ca}.pem"),
        ],
    );
}

fn leaf(dir: &Path, ca: &str, name: &str, ext: &str) {
    std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
            "-out",
            &format!("{name}.pem"),
        ],
    );
}

struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn new(dir: &Path) -> Pki {
        let dir = dir.join("pki");
        std::fs::create_dir(&dir).unwrap();
        ca(&dir, "ca");
        ca(&dir, "other-ca");
        let server = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n";
        let client = "extendedKeyUsage=clientAuth\n";
        leaf(&dir, "ca", "server", server);
        leaf(&dir, "ca", "client", client);
        leaf(&dir, "other-ca", "stranger", client);
        Pki { dir }
    }

    fn p(&self, f: &str) -> String {
        self.dir.join(f).display().to_string()
    }
}

#[test]
fn mutual_tls_admits_only_clients_the_ca_signed() {
    let tmp = tempfile::tempdir().unwrap();
    let pki = Pki::new(tmp.path());
    let root = tmp.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let (cert, key, ca) = (pki.p("server.pem"), pki.p("server.key"), pki.p("ca.pem"));
    let d = Rcpd::start(
        &root,
        T,
        Some("tok"),
        &[
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-client-ca",
            &ca,
        ],
    );
    let src = tmp.path().join("f.bin");
    make_file(&src, (3 << 20) + 5, 9);
    let want = sha256sum(&src);
    let push = |name: &str, tls: &[String]| {
        let mut args: Vec<String> = tls.to_vec();
        args.extend([
            "push".into(),
            src.display().to_string(),
            format!("127.0.0.1:{name}"),
        ]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        rcp(d.port, T, Some("tok"), &args)
    };
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();

    // The client the CA signed: push and pull back, digests equal.
    let good = s(&[
        "--tls-ca",
        &ca,
        "--tls-cert",
        &pki.p("client.pem"),
        "--tls-key",
        &pki.p("client.key"),
    ]);
    let r = push("ok.bin", &good);
    assert_eq!(r.code, 0, "{}{}\n{}", r.stdout, r.stderr, d.log());
    assert_eq!(sha256sum(&root.join("ok.bin")), want);
    let back = tmp.path().join("back.bin");
    let mut args = good.clone();
    args.extend(s(&[
        "pull",
        "127.0.0.1:ok.bin",
        &back.display().to_string(),
    ]));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let r = rcp(d.port, T, Some("tok"), &args);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert_eq!(sha256sum(&back), want);

    // Refused: no client certificate, one from another CA, plaintext, and
    // a client that does not trust the server's CA. Nothing is written.
    let cases: Vec<(&str, Vec<String>)> = vec![
        ("no client certificate", s(&["--tls-ca", &ca])),
        (
            "certificate of another CA",
            s(&[
                "--tls-ca",
                &ca,
                "--tls-cert",
                &pki.p("stranger.pem"),
                "--tls-key",
                &pki.p("stranger.key"),
            ]),
        ),
        ("plaintext", Vec::new()),
        (
            "server not trusted",
            s(&[
                "--tls-ca",
                &pki.p("other-ca.pem"),
                "--tls-cert",
                &pki.p("client.pem"),
                "--tls-key",
                &pki.p("client.key"),
            ]),
        ),
    ];
    for (i, (what, tls)) in cases.iter().enumerate() {
        let name = format!("refused{i}.bin");
        let r = push(&name, tls);
        eprintln!("{what}: exit {}: {}", r.code, r.stderr.trim());
        assert_ne!(r.code, 0, "{what}: accepted\n{}{}", r.stdout, r.stderr);
        assert!(
            r.stderr.starts_with("rcp: ") && r.stderr.len() > 10,
            "{what}: no clear error: {:?}",
            r.stderr
        );
        assert!(!root.join(&name).exists(), "{what}: a file was written");
    }
    // Each is named for what it is. A refused certificate is not worth
    // retrying (6); plaintext against TLS cannot be told from a dropped
    // connection for sure, so it stays retryable (5) but names TLS.
    let named = [
        ("give --tls-cert and --tls-key", 6),
        ("stranger.pem was refused", 6),
        ("if it requires TLS, give --tls-ca", 5),
        ("invalid peer certificate", 6),
    ];
    for ((what, tls), (want, code)) in cases.iter().zip(named) {
        let r = push("x.bin", tls);
        assert!(r.stderr.contains(want), "{what}: {}", r.stderr);
        assert_eq!(r.code, code, "{what}: {}", r.stderr);
    }

    // The daemon kept serving: the good client still copies.
    let r = push("again.bin", &good);
    assert_eq!(r.code, 0, "{}{}", r.stdout, r.stderr);
    assert_eq!(sha256sum(&root.join("again.bin")), want);
}

#[test]
fn tls_flags_are_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(bin("rcpd"))
        .args([
            "--root",
            tmp.path().to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--tls-client-ca", "/nonexistent/ca.pem"])
        .env_remove("RCPD_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("--tls-client-ca needs --tls-cert"), "{e}");
    let junk = tmp.path().join("junk.pem");
    std::fs::write(&junk, "junk").unwrap();
    let j = junk.to_str().unwrap();
    let out = Command::new(bin("rcpd"))
        .args([
            "--root",
            tmp.path().to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
        ])
        .args([
            "--health-listen",
            "none",
            "--transport",
            "tcp",
            "--arena-mib",
            "8",
        ])
        .args(["--tls-cert", j, "--tls-key", j])
        .env_remove("RCPD_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("junk.pem") && e.contains("not PEM"), "{e}");
}
