//! Helpers shared by the control-plane tests: spawn rcpd, run rcp, compare
//! digests with the `sha256sum` command.
#![allow(dead_code)]

pub mod e2e;
pub mod e2e_fanout;
pub mod e2e_sync;
pub mod e2e_tree;
pub mod metrics;
pub mod pattern;
pub mod raw;
pub mod verbs_rig;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// target/debug/<name>, next to the test executable's deps/ directory, or
/// in `RCP_TEST_BIN_DIR` when that is set (the VM suite copies the binaries
/// to the guest's tmpfs: paged in from its 9p root every exec costs about a
/// second under TCG).
pub fn bin(name: &str) -> PathBuf {
    let dir = match std::env::var_os("RCP_TEST_BIN_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            let exe = std::env::current_exe().expect("current_exe");
            exe.parent()
                .and_then(Path::parent)
                .expect("target dir")
                .to_path_buf()
        }
    };
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} is missing: build it first with `cargo build --workspace`",
        p.display()
    );
    p
}

pub struct Rcpd {
    pub child: Child,
    pub port: u16,
    pub health: Option<String>,
    pub metrics: Option<String>,
    pub root: PathBuf,
    pub stderr_path: PathBuf,
}

impl Rcpd {
    /// Start rcpd on [`host`] with ephemeral ports (in the network
    /// namespace and on the device [`Topology`] names, if any).
    pub fn start(root: &Path, transport: &str, token: Option<&str>, extra: &[&str]) -> Rcpd {
        Rcpd::start_in(&Topology::from_env(), root, transport, token, extra)
    }

    /// [`Rcpd::start`] where `topo` says (its host, namespace and device).
    pub fn start_in(
        topo: &Topology,
        root: &Path,
        transport: &str,
        token: Option<&str>,
        extra: &[&str],
    ) -> Rcpd {
        Rcpd::start_umask(topo, root, transport, token, extra, None)
    }

    /// [`Rcpd::start_in`], rcpd running under `umask` when given.
    pub fn start_umask(
        topo: &Topology,
        root: &Path,
        transport: &str,
        token: Option<&str>,
        extra: &[&str],
        umask: Option<u32>,
    ) -> Rcpd {
        Rcpd::start_full(topo, root, transport, token, extra, umask, &[])
    }

    /// [`Rcpd::start`] with `env` set for rcpd alone (the test faults of
    /// `rcp::faults`, read from its environment).
    pub fn start_env(root: &Path, transport: &str, env: &[(&str, &str)]) -> Rcpd {
        Rcpd::start_full(&Topology::from_env(), root, transport, None, &[], None, env)
    }

    fn start_full(
        topo: &Topology,
        root: &Path,
        transport: &str,
        token: Option<&str>,
        extra: &[&str],
        umask: Option<u32>,
        env: &[(&str, &str)],
    ) -> Rcpd {
        let stderr_path = root.with_extension("rcpd.log");
        let log = std::fs::File::create(&stderr_path).expect("log file");
        let mut cmd = match &topo.rcpd_netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                // ip netns exec execs the program: the child is rcpd itself.
                c.args(["netns", "exec", ns]).args(umask_prefix(umask));
                c.arg(bin("rcpd"));
                c
            }
            None if umask.is_some() => {
                let mut c = Command::new("sh");
                c.args(&umask_prefix(umask)[1..]).arg(bin("rcpd"));
                c
            }
            None => Command::new(bin("rcpd")),
        };
        let any = format!("{}:0", topo.host);
        cmd.arg("--root")
            .arg(root)
            .args(["--listen", &any, "--health-listen", &any])
            .args(["--metrics-listen", &any])
            .args(["--transport", transport])
            // 64 MiB unless the test sizes the arena itself.
            .args(
                (!extra.contains(&"--arena-mib"))
                    .then_some(["--arena-mib", "64"])
                    .into_iter()
                    .flatten(),
            )
            .args(
                topo.rcpd_device
                    .iter()
                    .flat_map(|d| ["--device", d.as_str()]),
            )
            .args(extra)
            .env_remove("RCPD_TOKEN")
            .env_remove("RCPD_TOKEN_FILE")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(log);
        if let Some(t) = token {
            cmd.env("RCPD_TOKEN", t);
        }
        let mut child = cmd.spawn().expect("spawn rcpd");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("rcpd stdout");
        assert!(
            line.starts_with("rcpd listening on "),
            "rcpd did not start: {line:?}; log: {}",
            std::fs::read_to_string(&stderr_path).unwrap_or_default()
        );
        let words: Vec<&str> = line.split_whitespace().collect();
        let port = words[3].rsplit(':').next().unwrap().parse().unwrap();
        let after = |k: &str| {
            words
                .iter()
                .position(|w| *w == k)
                .map(|i| words[i + 1].to_string())
        };
        Rcpd {
            child,
            port,
            health: after("health"),
            metrics: after("metrics"),
            root: root.to_path_buf(),
            stderr_path,
        }
    }

    pub fn addr(&self) -> String {
        format!("{}:{}", host(), self.port)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }
}

impl Drop for Rcpd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where the end-to-end tests run. By default rcpd and rcp share 127.0.0.1.
/// scripts/vm/suite.sh runs the verbs scenarios again in the two-namespace
/// topology: the test binary (and so rcp) in namespace a, rcpd in b, each on
/// its own rxe device, through these variables.
pub struct Topology {
    /// `RCP_TEST_HOST`: the address rcpd listens on and rcp dials.
    pub host: String,
    /// `RCP_TEST_RCPD_NETNS`: the namespace rcpd runs in.
    pub rcpd_netns: Option<String>,
    /// `RCP_TEST_RCPD_DEVICE` / `RCP_TEST_RCP_DEVICE`: `--device` of each.
    pub rcpd_device: Option<String>,
    pub rcp_device: Option<String>,
}

impl Topology {
    pub fn from_env() -> Topology {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Topology {
            host: var("RCP_TEST_HOST").unwrap_or_else(|| "127.0.0.1".into()),
            rcpd_netns: var("RCP_TEST_RCPD_NETNS"),
            rcpd_device: var("RCP_TEST_RCPD_DEVICE"),
            rcp_device: var("RCP_TEST_RCP_DEVICE"),
        }
    }
}

/// The address rcpd listens on (see [`Topology`]).
pub fn host() -> String {
    Topology::from_env().host
}

/// `--copy-peers` of an rcpd whose Copies (or buffer operations) go to the
/// other rcpds of its test: they all listen on [`host`], on any port.
pub fn copy_peers() -> String {
    host()
}

/// What runs a program under `umask` (the shell sets it and execs the
/// program, so the child is the program itself): `sh -c ... sh`, or nothing.
pub fn umask_prefix(umask: Option<u32>) -> Vec<String> {
    match umask {
        Some(u) => vec![
            "sh".into(),
            "-c".into(),
            format!("umask {u:03o}; exec \"$0\" \"$@\""),
        ],
        None => Vec::new(),
    }
}

/// [`rcp_cmd`] under `umask`.
pub fn rcp_cmd_umask(
    port: u16,
    transport: &str,
    token: Option<&str>,
    args: &[&str],
    umask: u32,
) -> Command {
    let inner = rcp_cmd(port, transport, token, args);
    let pre = umask_prefix(Some(umask));
    let mut cmd = Command::new(&pre[0]);
    cmd.args(&pre[1..])
        .arg(inner.get_program())
        .args(inner.get_args())
        .stdin(Stdio::null());
    for (k, v) in inner.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    cmd
}

/// `HOST:path` for rcp's command line.
pub fn remote(path: &str) -> String {
    format!("{}:{path}", host())
}

pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// `rcp ARGS` with `-P port`, the transport and optional token.
pub fn rcp_cmd(port: u16, transport: &str, token: Option<&str>, args: &[&str]) -> Command {
    let mut cmd = Command::new(bin("rcp"));
    let topo = Topology::from_env();
    cmd.args(["-P", &port.to_string(), "--transport", transport])
        .args(
            topo.rcp_device
                .iter()
                .flat_map(|d| ["--device", d.as_str()]),
        )
        .args(args)
        .env_remove("RCP_TOKEN")
        .stdin(Stdio::null());
    for (k, _) in std::env::vars() {
        if k.starts_with("RCP_") {
            cmd.env_remove(k);
        }
    }
    if let Some(t) = token {
        cmd.env("RCP_TOKEN", t);
    }
    cmd
}

pub fn rcp(port: u16, transport: &str, token: Option<&str>, args: &[&str]) -> Run {
    let out: Output = rcp_cmd(port, transport, token, args)
        .output()
        .expect("run rcp");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The digest `sha256sum` prints for `p`.
pub fn sha256sum(p: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(p)
        .output()
        .expect("sha256sum");
    assert!(out.status.success(), "sha256sum {}", p.display());
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// The digests `sha256sum` prints for each of `rels` beneath `base`, from
/// one run of it (a process per file is slow in the VM).
pub fn sha256sums(base: &Path, rels: &[PathBuf]) -> Vec<String> {
    let out = Command::new("sha256sum")
        .current_dir(base)
        .args(rels)
        .output()
        .expect("sha256sum");
    assert!(out.status.success(), "sha256sum in {}", base.display());
    let digests: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split_whitespace().next().unwrap().to_string())
        .collect();
    assert_eq!(digests.len(), rels.len(), "sha256sum in {}", base.display());
    digests
}

/// A file of `len` pseudo-random bytes (seeded).
pub fn make_file(p: &Path, len: u64, seed: u64) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(p).unwrap());
    let mut pat = pattern::Pattern::new(seed);
    let mut left = len;
    let mut buf = vec![0u8; 1 << 16];
    while left > 0 {
        pat.fill(&mut buf);
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n]).unwrap();
        left -= n as u64;
    }
    f.flush().unwrap();
}

/// "N moved)" from a summary line (`... (B bytes, N moved) ...`).
pub fn moved(summary: &str) -> u64 {
    let i = summary.find(" moved)").expect("summary has moved bytes");
    let head = &summary[..i];
    head.rsplit([' ', '('])
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

pub fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The resume manifest rcp keeps beside the temp file of `name` in `dir`.
pub fn find_manifest(dir: &Path, name: &str) -> Option<PathBuf> {
    let prefix = format!(".rcp-{name}.");
    std::fs::read_dir(dir).ok()?.flatten().find_map(|e| {
        let n = e.file_name().to_string_lossy().into_owned();
        (n.starts_with(&prefix) && n.ends_with(".part.manifest")).then(|| e.path())
    })
}

/// How many verified blocks the resume manifest of `name` in `dir` records
/// (None: no manifest yet, or one caught mid-write). It is decoded, not
/// measured: what a block adds to its length depends on the format and the
/// check (32 bytes of SHA-256, 16 of xxh3, none without a check).
pub fn verified_blocks(dir: &Path, name: &str) -> Option<u64> {
    let m = find_manifest(dir, name)?;
    let b = std::fs::read(m).ok()?;
    let man = rcp::files::Manifest::decode(&b).ok()?;
    Some(man.blocks.len() as u64)
}

/// Wait until the manifest of the copy of `name` (a fresh one: the copy
/// started with none) records at least `blocks` verified blocks.
pub fn wait_verified(dir: &Path, name: &str, blocks: u64) {
    wait_for(
        "verified blocks in the manifest",
        Duration::from_secs(120),
        || verified_blocks(dir, name).is_some_and(|n| n >= blocks),
    );
}

/// [`wait_verified`] while `child` (the copy) runs: if it ends first, fail
/// at once with what `why` says (its stderr, rcpd's log).
pub fn wait_verified_while(
    dir: &Path,
    name: &str,
    blocks: u64,
    child: &mut Child,
    why: impl Fn() -> String,
) {
    wait_for(
        "verified blocks in the manifest",
        Duration::from_secs(120),
        || {
            if let Ok(Some(st)) = child.try_wait() {
                panic!(
                    "the copy ended ({st}) before the manifest showed {blocks} blocks: {}",
                    why()
                );
            }
            verified_blocks(dir, name).is_some_and(|n| n >= blocks)
        },
    );
}

/// Names in `dir`.
pub fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}
