//! `rcp push` / `pull` over two rails, end to end through rcpd, in the VM's
//! rails topology (scripts/testbed.sh run rails): the test binary, and so
//! rcp, in namespace a (rxea0 on va0 192.168.77.1, rxea1 on va1
//! 192.168.78.1), rcpd in b (rxeb0 192.168.77.2, rxeb1 192.168.78.2).
//! scripts/vm/suite.sh runs it there with `RCP_TEST_HOST=192.168.77.2
//! RCP_TEST_RCPD_NETNS=b`. The control plane rides on the first veth pair,
//! so the cuts below cut it too where they cut va0; TCP rides that out.
//!
//! What is checked: both rails carry blocks (rcp -v's rail lines, the
//! engine's counters), rcpd registers no memory during a copy over rails,
//! nor across a rail cut
//! (its /metrics: registrations flat, window binds grow), digests equal
//! `sha256sum`'s, one rail cut for 5 s
//! is absorbed (its blocks posted on the other, the failover time printed;
//! it rejoins), both cut for 3 s survive through reconnect (each cut
//! triggered by the bytes rcp has confirmed, under --bwlimit, and checked
//! to have landed mid-copy), and a client rail whose GID cannot reach rcpd's is refused at
//! the handshake naming both GIDs. And buffers from services between two
//! rcpds (one in a, beside the test, one in b): a write and a read move
//! bytes over both rails of the initiating rcpd's session (its per-rail
//! byte counters in /metrics), bytes and the owner's digests checked; and,
//! with every rail cut mid-operation under `--transport auto`, a write and
//! a read that continue over tcp, said in their `done` state.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::e2e::tmp_with_root;
use common::metrics::{sample, samples, scrape};
use common::{make_file, rcp, rcp_cmd, remote, sha256sum, Rcpd, Run, Topology};
use rcp::control::buffers::api::OpStateName;
use rcp::control::buffers::client::ServiceClient;
use rcp::files::Check;

const RAILS_A: &str = "rxea0,rxea1";
const RAILS_B: &str = "rxeb0,rxeb1";

/// One `rail K (NAME): ...` line of rcp -v, parsed.
#[derive(Debug, Default)]
struct RailLine {
    name: String,
    blocks: u64,
    failures: u64,
    requeued: u64,
    reconnects: u64,
    failover: Vec<f64>,
}

fn rail_lines(stdout: &str) -> Vec<RailLine> {
    stdout
        .lines()
        .filter(|l| l.starts_with("rail "))
        .map(|l| {
            let name = l
                .split_once('(')
                .and_then(|(_, r)| r.split_once(')'))
                .map(|(n, _)| n.to_string())
                .unwrap_or_default();
            let num = |what: &str| -> u64 {
                let i = l.find(what).unwrap_or_else(|| panic!("{what:?} in {l:?}"));
                l[..i]
                    .rsplit([' ', ':'])
                    .find(|w| !w.is_empty())
                    .and_then(|w| w.parse().ok())
                    .unwrap_or_else(|| panic!("a number before {what:?} in {l:?}"))
            };
            let failover = l
                .split_once("failover ")
                .map(|(_, r)| {
                    r.trim_end_matches(" s")
                        .split_whitespace()
                        .filter_map(|w| w.parse().ok())
                        .collect()
                })
                .unwrap_or_default();
            RailLine {
                name,
                blocks: num(" blocks,"),
                failures: num(" failures"),
                requeued: num(" blocks requeued"),
                reconnects: num(" reconnects"),
                failover,
            }
        })
        .collect()
}

fn rcpd(root: &Path, devices: Option<&str>) -> Rcpd {
    let mut extra = vec!["--arena-mib", "128"];
    if let Some(d) = devices {
        extra.extend(["--device", d]);
    }
    Rcpd::start(root, "verbs", None, &extra)
}

fn ok(r: &Run, what: &str, d: &Rcpd) {
    assert_eq!(
        r.code,
        0,
        "{what}: {}{}\nrcpd: {}",
        r.stdout,
        r.stderr,
        d.log()
    );
}

/// rcpd's verbs registrations and window binds so far, from its /metrics.
fn registrations_and_binds(d: &Rcpd) -> (f64, f64) {
    let t = scrape(d.metrics.as_deref().expect("rcpd's metrics address"));
    let get = |s| sample(&t, s).unwrap_or_else(|| panic!("no {s} in\n{t}"));
    (
        get("rcp_verbs_registrations_total"),
        get("rcp_verbs_window_binds_total"),
    )
}

/// A copy across a rail cut: rcpd registered nothing while it ran, the
/// cut rail's grants included (a grant while that rail's QP could not send
/// reserves its window's rkey and binds it at the rail's reconnect: how
/// many, printed).
fn no_registration_across_cut(d: &Rcpd, before: (f64, f64), what: &str) {
    let t = scrape(d.metrics.as_deref().expect("rcpd's metrics address"));
    let deferred = sample(&t, "rcp_verbs_window_binds_deferred_total")
        .unwrap_or_else(|| panic!("no rcp_verbs_window_binds_deferred_total in\n{t}"));
    println!("{what}: {deferred} grant(s) bound at a reconnect");
    no_registration_during(d, 2.0, before, what);
}

/// A copy over rails: rcpd registered nothing while it ran (its arena is
/// registered once per rail at start) and bound a memory window per grant
/// on each of the session's QPs, so at least one per QP.
fn no_registration_during(d: &Rcpd, qps: f64, before: (f64, f64), what: &str) -> (f64, f64) {
    let after = registrations_and_binds(d);
    println!("{what}: rcpd (registrations, window binds) {before:?} -> {after:?}");
    assert_eq!(
        after.0, before.0,
        "{what}: rcpd registered memory during the copy"
    );
    assert!(
        after.1 >= before.1 + qps,
        "{what}: fewer window binds than QPs: {before:?} -> {after:?}"
    );
    after
}

/// `ip link set DEV STATE` in namespace a (where this test runs).
fn link(dev: &str, state: &str) {
    let st = Command::new("ip")
        .args(["link", "set", dev, state])
        .status()
        .expect("run ip");
    assert!(st.success(), "ip link set {dev} {state}: {st}");
}

/// A `tc netem` delay on a netdev of namespace a, removed on drop.
struct Netem(&'static str);

impl Netem {
    fn delay(dev: &'static str, by: &str) -> Netem {
        let st = Command::new("tc")
            .args(["qdisc", "add", "dev", dev, "root", "netem", "delay", by])
            .status()
            .expect("run tc");
        assert!(
            st.success(),
            "tc qdisc add dev {dev} root netem delay {by}: {st}"
        );
        Netem(dev)
    }
}

impl Drop for Netem {
    fn drop(&mut self) {
        let _ = Command::new("tc")
            .args(["qdisc", "del", "dev", self.0, "root"])
            .status();
    }
}

fn both_carried(lines: &[RailLine], out: &str) {
    assert_eq!(lines.len(), 2, "two rail lines: {out}");
    assert!(
        lines.iter().all(|l| l.blocks > 0),
        "both rails carried blocks: {out}"
    );
}

#[test]
#[ignore = "needs the rails topology: scripts/testbed.sh run rails"]
fn push_and_pull_over_two_rails_by_default() {
    // No --device on either side: every ACTIVE port of the namespace.
    let (tmp, root) = tmp_with_root();
    let d = rcpd(&root, None);
    let src = tmp.path().join("f");
    make_file(&src, 32 << 20, 7);
    let want = sha256sum(&src);
    let started = registrations_and_binds(&d);
    let r = rcp(
        d.port,
        "verbs",
        None,
        &["push", "-v", src.to_str().unwrap(), &remote("/")],
    );
    ok(&r, "push", &d);
    println!("push: {}", r.stdout.trim());
    let pushed = no_registration_during(&d, 2.0, started, "push over 2 rails");
    assert_eq!(sha256sum(&root.join("f")), want);
    let lines = rail_lines(&r.stdout);
    both_carried(&lines, &r.stdout);
    let names: Vec<&str> = lines.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["rxea0:1", "rxea1:1"], "{}", r.stdout);
    assert!(
        d.log().contains("rail paired"),
        "rcpd logs each pair: {}",
        d.log()
    );
    let back = tmp.path().join("back");
    std::fs::create_dir(&back).unwrap();
    // Two QPs on each rail: four rails in the data path, rcpd gives each
    // of its rails two QPs as well.
    let r = rcp(
        d.port,
        "verbs",
        None,
        &[
            "--qps-per-rail",
            "2",
            "pull",
            "-v",
            &remote("f"),
            back.to_str().unwrap(),
        ],
    );
    ok(&r, "pull", &d);
    println!("pull: {}", r.stdout.trim());
    no_registration_during(&d, 4.0, pushed, "pull over 4 QPs");
    assert_eq!(sha256sum(&back.join("f")), want);
    let lines = rail_lines(&r.stdout);
    let names: Vec<&str> = lines.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(
        names,
        ["rxea0:1", "rxea0:1", "rxea1:1", "rxea1:1"],
        "{}",
        r.stdout
    );
    assert!(
        lines.iter().all(|l| l.blocks > 0),
        "every QP carried blocks: {}",
        r.stdout
    );
}

/// What a running rcp has confirmed, live: the bytes of its last `--stats`
/// line on stderr, and whether it has ended (its stderr closed).
#[derive(Clone, Default)]
struct Progress {
    bytes: Arc<AtomicU64>,
    ended: Arc<AtomicBool>,
}

impl Progress {
    fn now(&self) -> u64 {
        self.bytes.load(Relaxed)
    }

    fn running(&self) -> bool {
        !self.ended.load(Relaxed)
    }

    /// Wait until `n` bytes are confirmed (false: rcp ended first).
    fn wait_for(&self, n: u64) -> bool {
        let guard = Instant::now() + Duration::from_secs(600);
        while self.now() < n {
            if !self.running() || Instant::now() > guard {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    /// Take one stderr line: `rcp: push 4.00 MiB/48.00 MiB (8.3%), ...`
    /// (`--stats`, IEC units with two decimals: exact enough here, where
    /// progress moves by chains of MiBs).
    fn line(&self, l: &str) {
        let b = l
            .strip_prefix("rcp: push ")
            .or_else(|| l.strip_prefix("rcp: pull "))
            .and_then(|r| r.split_once('/'))
            .and_then(|(b, _)| iec_bytes(b));
        if let Some(b) = b {
            self.bytes.fetch_max(b, Relaxed);
        }
    }
}

/// `0 B`, `4.00 MiB`, ... (rcp's `units::bytes`) as bytes.
fn iec_bytes(s: &str) -> Option<u64> {
    let (v, unit) = s.split_once(' ')?;
    let v: f64 = v.parse().ok()?;
    let shift = match unit {
        "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        "TiB" => 40,
        _ => return None,
    };
    Some((v * (1u64 << shift) as f64) as u64)
}

#[test]
fn progress_lines_are_read_in_iec_units() {
    let p = Progress::default();
    p.line("rcp: push 0 B/48.00 MiB (0.0%), 0/1 files, 0 B/s, 0.1 s");
    assert_eq!(p.now(), 0);
    p.line("rcp: push 4.00 MiB/48.00 MiB (8.3%), 0/1 files, 40.02 MiB/s, 1.0 s");
    assert_eq!(p.now(), 4 << 20);
    p.line("rcp: pull 1.50 GiB/2.00 GiB (75.0%), 0/1 files, 40.02 MiB/s, 9.0 s");
    assert_eq!(p.now(), 3 << 29);
}

/// What a cut saw: bytes confirmed when the link went down and when it
/// came back, and whether rcp was still copying then.
#[derive(Debug, Default)]
struct CutSeen {
    triggered: bool,
    down: u64,
    up: u64,
    running_down: bool,
    running_up: bool,
}

impl CutSeen {
    /// The cut landed mid-copy: triggered by progress, with rcp still
    /// copying and fewer than `total` bytes confirmed both when the link
    /// went down and when it came back. A copy that finished first FAILS.
    fn assert_mid_copy(&self, total: u64, out: &str) {
        println!("cut: {self:?} of {total} bytes");
        assert!(self.triggered, "rcp ended before the trigger: {out}");
        assert!(
            self.running_down && self.down < total,
            "the copy was over when the link went down: {self:?}: {out}"
        );
        assert!(
            self.running_up && self.up < total,
            "the copy was over before the link came back: {self:?}: {out}"
        );
    }
}

/// Once `trigger` bytes are confirmed: `down`, `hold`, `up`; what was
/// confirmed around it.
fn cut_at(
    p: &Progress,
    trigger: u64,
    down: impl FnOnce(),
    hold: Duration,
    up: impl FnOnce(),
) -> CutSeen {
    let mut seen = CutSeen {
        triggered: p.wait_for(trigger),
        ..CutSeen::default()
    };
    if !seen.triggered {
        return seen;
    }
    seen.running_down = p.running();
    down();
    seen.down = p.now();
    std::thread::sleep(hold);
    seen.up = p.now();
    seen.running_up = p.running();
    up();
    seen
}

/// Push `src` over both rails with `--stats` progress on stderr; `cut`
/// runs meanwhile on a thread of its own, given the live progress, so it
/// can cut when bytes are confirmed (not after a guessed time). rcp's
/// output and what `cut` returned.
fn push_with<T: Send + 'static>(
    d: &Rcpd,
    src: &Path,
    extra: &[&str],
    cut: impl FnOnce(&Progress) -> T + Send + 'static,
) -> (Run, T) {
    push_over(d, "verbs", src, extra, cut)
}

/// [`push_with`] with `--transport transport`.
fn push_over<T: Send + 'static>(
    d: &Rcpd,
    transport: &str,
    src: &Path,
    extra: &[&str],
    cut: impl FnOnce(&Progress) -> T + Send + 'static,
) -> (Run, T) {
    use std::io::{BufRead, BufReader, Read};
    let dst = remote("/");
    let mut args = vec!["--device", RAILS_A, "push", "-v", "--stats", "100ms"];
    args.extend(extra);
    args.extend([src.to_str().unwrap(), dst.as_str()]);
    let mut child = rcp_cmd(d.port, transport, None, &args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn rcp");
    let progress = Progress::default();
    let err = child.stderr.take().unwrap();
    let reader = {
        let p = progress.clone();
        std::thread::spawn(move || {
            let mut all = String::new();
            for l in BufReader::new(err).lines() {
                let l = l.unwrap_or_default();
                p.line(&l);
                all.push_str(&l);
                all.push('\n');
            }
            p.ended.store(true, Relaxed);
            all
        })
    };
    let mut out = child.stdout.take().unwrap();
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let cutter = {
        let p = progress.clone();
        std::thread::spawn(move || cut(&p))
    };
    let t0 = Instant::now();
    let status = child.wait().expect("rcp");
    println!("copy took {:.2} s", t0.elapsed().as_secs_f64());
    let seen = cutter.join().expect("the cutter");
    (
        Run {
            code: status.code().unwrap_or(-1),
            stdout: out_reader.join().unwrap(),
            stderr: reader.join().unwrap(),
        },
        seen,
    )
}

#[test]
#[ignore = "needs the rails topology: scripts/testbed.sh run rails"]
fn one_rail_cut_for_5s_is_absorbed_and_rejoins() {
    let (tmp, root) = tmp_with_root();
    let d = rcpd(&root, Some(RAILS_B));
    let src = tmp.path().join("big");
    // Held by --bwlimit: 96 MiB at 8 MiB/s take 12 s at least on any
    // machine; cut after 8 MiB, 11 s of copy are left for the 5 s cut and
    // rail 1's rejoin.
    let total = 96u64 << 20;
    make_file(&src, total, 11);
    let want = sha256sum(&src);
    // Rail 1 slower than rail 0 (20 ms more on va1): it holds its blocks
    // longer, so it is likelier to have some in flight at the cut.
    let _slow = Netem::delay("va1", "20ms");
    let started = registrations_and_binds(&d);
    let (r, cut) = push_with(&d, &src, &["--bwlimit", "8M"], |p| {
        cut_at(
            p,
            8 << 20,
            || link("va1", "down"),
            Duration::from_secs(5),
            || link("va1", "up"),
        )
    });
    ok(&r, "push across a 5 s cut of rail 1", &d);
    no_registration_across_cut(&d, started, "push across a cut of rail 1");
    println!("{}", r.stdout.trim());
    cut.assert_mid_copy(total, &r.stderr);
    assert_eq!(sha256sum(&root.join("big")), want);
    let lines = rail_lines(&r.stdout);
    assert_eq!(lines.len(), 2, "two rail lines: {}", r.stdout);
    let x = &lines[1];
    assert!(x.failures >= 1, "rail 1 failed: {}", r.stdout);
    // Its blocks outstanding at the cut were posted on rail 0, and timed.
    // Under the rate limit the rail may have had none in flight at that
    // instant (then nothing is requeued and there is no failover to time;
    // the data path's unit tests and rails_fabric check the requeue
    // itself): a failover is reported exactly when blocks were requeued.
    assert_eq!(
        x.failover.is_empty(),
        x.requeued == 0,
        "rail 1's failover is timed when it requeued blocks: {}",
        r.stdout
    );
    println!(
        "rails figure: rail 1 requeued {} blocks, failover {:?} s, reconnects {}",
        x.requeued, x.failover, x.reconnects
    );
    assert!(x.reconnects >= 1, "rail 1 rejoined: {}", r.stdout);
    assert!(lines[0].blocks > 0, "rail 0 carried the copy: {}", r.stdout);
}

#[test]
#[ignore = "needs the rails topology: scripts/testbed.sh run rails"]
fn both_rails_cut_for_3s_survive_through_reconnect() {
    let (tmp, root) = tmp_with_root();
    let d = rcpd(&root, Some(RAILS_B));
    let src = tmp.path().join("big");
    // 48 MiB at 8 MiB/s at most: 6 s at least; cut after 8 MiB.
    let total = 48u64 << 20;
    make_file(&src, total, 13);
    let want = sha256sum(&src);
    let started = registrations_and_binds(&d);
    let (r, cut) = push_with(&d, &src, &["--bwlimit", "8M"], |p| {
        cut_at(
            p,
            8 << 20,
            || {
                link("va0", "down");
                link("va1", "down");
            },
            Duration::from_secs(3),
            || {
                link("va0", "up");
                link("va1", "up");
            },
        )
    });
    ok(&r, "push across a 3 s cut of both rails", &d);
    no_registration_across_cut(&d, started, "push across a cut of both rails");
    println!("{}", r.stdout.trim());
    cut.assert_mid_copy(total, &r.stderr);
    assert_eq!(sha256sum(&root.join("big")), want);
    let lines = rail_lines(&r.stdout);
    assert_eq!(lines.len(), 2, "{}", r.stdout);
    assert!(
        lines.iter().all(|l| l.failures >= 1),
        "both rails failed: {}",
        r.stdout
    );
    assert!(
        lines.iter().map(|l| l.reconnects).sum::<u64>() >= 1,
        "the copy went through a reconnect: {}",
        r.stdout
    );
}

/// RoCE v2 (UDP 4791) leaving namespace a dropped while IP still flows:
/// rail 0's QP gets no answers though its port stays ACTIVE, and the
/// control plane and the tcp provider still reach rcpd over va0. Undone on
/// drop.
struct DropRoce;

impl DropRoce {
    fn start() -> DropRoce {
        iptables("-A");
        DropRoce
    }
}

impl Drop for DropRoce {
    fn drop(&mut self) {
        iptables("-D");
    }
}

fn iptables(op: &str) {
    let st = Command::new("iptables")
        .args([op, "OUTPUT", "-p", "udp", "--dport", "4791", "-j", "DROP"])
        .status()
        .expect("run iptables");
    assert!(st.success(), "iptables {op} OUTPUT ... udp 4791 DROP: {st}");
}

#[test]
#[ignore = "needs the rails topology: scripts/testbed.sh run rails"]
fn every_rail_down_past_the_limit_continues_over_tcp() {
    let (tmp, root) = tmp_with_root();
    // --transport auto: rcpd serves verbs and, for this, tcp.
    let d = Rcpd::start(
        &root,
        "auto",
        None,
        &["--arena-mib", "128", "--device", RAILS_B],
    );
    let src = tmp.path().join("big");
    make_file(&src, 96 << 20, 17);
    let want = sha256sum(&src);
    let drop_roce = std::sync::Arc::new(std::sync::Mutex::new(None));
    let held = drop_roce.clone();
    let (r, cut) = push_over(
        &d,
        "auto",
        &src,
        // A short limit, and QPs that give up after 2 retries (rxe at 7
        // retries forever) so the black-holed rail fails rather than hangs;
        // held by --bwlimit (12 s at least) so the cut after the first
        // 4 MiB lands mid-copy.
        &[
            "--tcp-fallback-after",
            "3",
            "--qp-retry-cnt",
            "2",
            "--bwlimit",
            "8M",
        ],
        move |p| {
            let ok = p.wait_for(4 << 20);
            let running = p.running();
            // RoCE first, then the rail.
            *held.lock().unwrap() = Some(DropRoce::start());
            link("va1", "down");
            println!("va1 down, RoCE dropped on va0 at {} bytes", p.now());
            (ok, running, p.now())
        },
    );
    drop(drop_roce.lock().unwrap().take());
    link("va1", "up");
    let (triggered, running, at) = cut;
    assert!(
        triggered && running && at < 96 << 20,
        "the cut landed mid-copy ({at} bytes confirmed): {}",
        r.stderr
    );
    ok(&r, "push with every rail down", &d);
    println!(
        "{}\n{}",
        r.stdout.trim(),
        r.stderr
            .lines()
            .filter(|l| l.contains("WARNING"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(sha256sum(&root.join("big")), want);
    assert!(
        r.stderr
            .contains("rcp: WARNING: every RDMA rail has been down")
            || r.stderr
                .contains("rcp: WARNING: the RDMA data path gave up"),
        "said loudly on stderr: {}",
        r.stderr
    );
    assert!(
        r.stdout.contains("over tcp (FELL BACK from verbs"),
        "and in the summary: {}",
        r.stdout
    );
}

#[test]
#[ignore = "needs the rails topology: scripts/testbed.sh run rails"]
fn a_rail_that_cannot_reach_the_peer_is_refused_naming_both_gids() {
    let (tmp, root) = tmp_with_root();
    let d = rcpd(&root, Some(RAILS_B));
    let src = tmp.path().join("f");
    make_file(&src, 1 << 20, 3);
    // GID index 0 on rxe is the port's link-local IPv6 GID (fe80::); rcpd
    // addresses its QPs by IPv4-mapped GIDs: no route between the two.
    let r = rcp(
        d.port,
        "verbs",
        None,
        &[
            "--device",
            "rxea0",
            "--gid-index",
            "0",
            "push",
            src.to_str().unwrap(),
            &remote("/"),
        ],
    );
    println!("{}{}", r.stdout, r.stderr);
    assert_ne!(r.code, 0, "refused: {}{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("GID fe80:") && r.stderr.contains("GID ::ffff:192.168.77.2"),
        "the refusal names both GIDs: {}",
        r.stderr
    );
    assert!(!root.join("f").exists(), "nothing was copied");
}

/// Namespace a's address on the first veth pair: where this test, and the
/// rcpd whose services initiate buffer operations, run.
const HOST_A: &str = "192.168.77.1";

/// The payload bytes each rail of rcpd `metrics`' data paths confirmed
/// (`rcp_rail_bytes_total`, summed by its `rail` label), rail 0 first.
fn rail_bytes(metrics: &str) -> Vec<u64> {
    let text = scrape(metrics);
    let mut by: Vec<u64> = Vec::new();
    for (series, v) in samples(&text, "rcp_rail_bytes_total{") {
        let rail: usize = series
            .split_once("rail=\"")
            .and_then(|(_, r)| r.split_once('"'))
            .and_then(|(k, _)| k.parse().ok())
            .unwrap_or_else(|| panic!("a rail label in {series}"));
        if by.len() <= rail {
            by.resize(rail + 1, 0);
        }
        by[rail] += v as u64;
    }
    by
}

/// [`rail_bytes`] once `done` holds of them (the data path publishes its
/// counters just after the windows' ends), or after 60 s as they are.
fn rail_bytes_when(metrics: &str, done: impl Fn(&[u64]) -> bool) -> Vec<u64> {
    let t0 = Instant::now();
    loop {
        let by = rail_bytes(metrics);
        if done(&by) || t0.elapsed() > Duration::from_secs(60) {
            return by;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Bound a wait so that a failure fails, never hangs.
async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(600), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within 600 s"))
}

/// Wait (bounded) for rcpd's unix socket to be there.
fn socket_up(sock: &Path, d: &Rcpd) {
    let t0 = Instant::now();
    while !sock.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no socket {}: {}",
            sock.display(),
            d.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The owner's event for an operation that ended: `kind`, no error, each
/// range's digest that of `data`'s MiB at its offset under the default
/// check (blake3).
fn owner_event_matches(ev: &serde_json::Value, kind: &str, data: &[u8]) {
    owner_event_under(ev, kind, data, Check::Blake3);
}

/// [`owner_event_matches`] under `check`, `data` in ranges of 1 MiB.
fn owner_event_under(ev: &serde_json::Value, kind: &str, data: &[u8], check: Check) {
    assert_eq!(ev["event"], kind, "{ev}");
    assert!(ev.get("error").is_none(), "{ev}");
    assert_eq!(ev["check"], check.name(), "{ev}");
    let ranges = ev["ranges"].as_array().expect("ranges");
    assert_eq!(ranges.len() as u64, data.len() as u64 / MIB, "{ev}");
    for r in ranges {
        let (off, len) = (r[0].as_u64().unwrap(), r[1].as_u64().unwrap());
        let want = check.wire(&check.block(&data[off as usize..(off + len) as usize]));
        let hex: String = want.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(r[2], hex, "range [{off}, +{len}) digest: {ev}");
    }
}

const MIB: u64 = 1 << 20;
/// The exposed buffer: written in ranges of 1 MiB, then read back.
const BUF: u64 = 8 * MIB;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the rails topology: scripts/testbed.sh run rails"]
async fn buffer_write_and_read_between_rcpds_move_over_both_rails() {
    // rcpd b (the topology's namespace) exposes, rcpd a (here) initiates;
    // each on its two rails, each with its unix socket off the 9p mount.
    let (_ta, root_a) = tmp_with_root();
    let (_tb, root_b) = tmp_with_root();
    let socks = tempfile::tempdir().unwrap();
    let (sa, sb) = (socks.path().join("a.sock"), socks.path().join("b.sock"));
    let b = Rcpd::start(
        &root_b,
        "verbs",
        None,
        &["--device", RAILS_B, "--socket", sb.to_str().unwrap()],
    );
    let here = Topology {
        host: HOST_A.into(),
        rcpd_netns: None,
        rcpd_device: None,
        rcp_device: None,
    };
    let a = Rcpd::start_in(
        &here,
        &root_a,
        "verbs",
        None,
        &[
            "--device",
            RAILS_A,
            "--socket",
            sa.to_str().unwrap(),
            "--copy-peers",
            &common::copy_peers(),
        ],
    );
    socket_up(&sa, &a);
    socket_up(&sb, &b);
    let metrics = a.metrics.clone().expect("rcpd a's metrics");
    let logs = || format!("\nrcpd a: {}\nrcpd b: {}", a.log(), b.log());

    let owner = bounded("connect b", ServiceClient::connect(Some(&sb), None))
        .await
        .unwrap();
    let dst = bounded("buffer b", owner.create_buffer(BUF)).await.unwrap();
    bounded("expose", owner.expose(&dst, "kv", 0, BUF, "rw", &[]))
        .await
        .unwrap();
    let svc = bounded("connect a", ServiceClient::connect(Some(&sa), None))
        .await
        .unwrap();
    let src = bounded("buffer a", svc.create_buffer(2 * BUF))
        .await
        .unwrap();
    let data: Vec<u8> = (0..BUF).map(|i| (i * 13 + i / 4099) as u8).collect();
    assert!(src.local.write_at(0, &data));
    let peer = b.addr();

    // Write: a's first half into b's kv, a window per MiB.
    let descs: Vec<(u64, u64, u64)> = (0..BUF / MIB).map(|i| (i * MIB, i * MIB, MIB)).collect();
    let h = bounded("write", svc.write(&src, &peer, "kv", &descs, Some("rails")))
        .await
        .unwrap();
    let moved = bounded("write wait", svc.wait(h)).await;
    assert_eq!(
        moved.as_ref().ok(),
        Some(&BUF),
        "write: {moved:?}{}",
        logs()
    );
    let mut landed = vec![0u8; BUF as usize];
    assert!(dst.local.read_at(0, &mut landed));
    assert!(landed == data, "b's buffer holds what a wrote");
    let ev = bounded("written event", owner.next_event())
        .await
        .expect("an event");
    owner_event_matches(&ev, "written", &data);
    let wrote =
        tokio::task::block_in_place(|| rail_bytes_when(&metrics, |b| b.iter().sum::<u64>() >= BUF));
    println!("write: bytes per rail {wrote:?}");
    assert!(
        wrote.len() == 2 && wrote.iter().all(|&n| n > 0),
        "the write moved bytes over both rails: {wrote:?}{}",
        logs()
    );

    // Read: b's kv back into a's second half.
    let descs: Vec<(u64, u64, u64)> = (0..BUF / MIB)
        .map(|i| (BUF + i * MIB, i * MIB, MIB))
        .collect();
    let h = bounded("read", svc.read(&src, &peer, "kv", &descs))
        .await
        .unwrap();
    let moved = bounded("read wait", svc.wait(h)).await;
    assert_eq!(moved.as_ref().ok(), Some(&BUF), "read: {moved:?}{}", logs());
    let mut back = vec![0u8; BUF as usize];
    assert!(src.local.read_at(BUF, &mut back));
    assert!(back == data, "a's buffer holds what it read from b");
    let ev = bounded("read event", owner.next_event())
        .await
        .expect("an event");
    owner_event_matches(&ev, "read", &data);
    let now = tokio::task::block_in_place(|| {
        rail_bytes_when(&metrics, |b| b.iter().sum::<u64>() >= 2 * BUF)
    });
    let read: Vec<u64> = now.iter().zip(&wrote).map(|(n, w)| n - w).collect();
    println!("read: bytes per rail {read:?}");
    assert!(
        now.len() == 2 && read.iter().all(|&n| n > 0),
        "the read moved bytes over both rails: {read:?}{}",
        logs()
    );
}

/// The fallback test's buffer: 64 MiB, held by rcpd a's `--bwlimit 4M` to
/// 16 s at least per pass, so that a cut after 8 MiB lands mid-operation.
const FB_BUF: u64 = 64 * MIB;

/// Wait until rcpd `metrics`' rails have confirmed `n` payload bytes in
/// all (false after 600 s).
fn rail_bytes_reach(metrics: &str, n: u64) -> bool {
    let guard = Instant::now() + Duration::from_secs(600);
    while rail_bytes(metrics).iter().sum::<u64>() < n {
        if Instant::now() > guard {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

/// Every rail of namespace a down, as the files' fallback test cuts them:
/// RoCE dropped on rail 0 (its port stays ACTIVE, IP still flows, so the
/// control plane and the tcp provider reach rcpd b), rail 1's link down.
/// Undone on drop.
struct RailsDown(Option<DropRoce>);

impl RailsDown {
    fn start() -> RailsDown {
        let roce = DropRoce::start();
        link("va1", "down");
        RailsDown(Some(roce))
    }
}

impl Drop for RailsDown {
    fn drop(&mut self) {
        drop(self.0.take());
        link("va1", "up");
    }
}

/// Start `op` (a handle), cut every rail once rcpd a's rails have
/// confirmed 8 MiB more than before it, and wait for it with the rails
/// down: its `done` state, checked to have landed mid-operation.
async fn cut_mid_op(
    svc: &ServiceClient,
    metrics: &str,
    h: u64,
    logs: &dyn Fn() -> String,
    base: u64,
) -> serde_json::Value {
    let m = metrics.to_string();
    let reached = tokio::task::block_in_place(|| rail_bytes_reach(&m, base + 8 * MIB));
    let cut = RailsDown::start();
    // After the cut took (iptables and ip are slow in the VM): what had
    // moved, and whether the operation still runs.
    let at = rail_bytes(metrics).iter().sum::<u64>() - base;
    let st = bounded("status at the cut", svc.status(h)).await.unwrap();
    println!("every rail cut at {at} bytes of {FB_BUF}: {st:?}");
    assert!(
        reached && st.state == OpStateName::Running && at < FB_BUF,
        "the cut landed mid-operation ({at} bytes confirmed once it took): {st:?}{}",
        logs()
    );
    let done = bounded("wait", svc.wait(h)).await;
    drop(cut);
    assert_eq!(done.as_ref().ok(), Some(&FB_BUF), "{done:?}{}", logs());
    let ev = bounded("done event", svc.next_event()).await.expect("done");
    assert_eq!(ev["event"], "done", "{ev}");
    assert_eq!(ev["handle"], h, "{ev}");
    ev
}

/// Wait (bounded) until both of namespace a's rails are ACTIVE again.
fn rails_active() {
    let t0 = Instant::now();
    loop {
        let out = Command::new("rdma")
            .args(["link", "show"])
            .output()
            .expect("run rdma");
        let text = String::from_utf8_lossy(&out.stdout);
        let active = |dev: &str| {
            text.lines()
                .any(|l| l.contains(&format!("link {dev}/")) && l.contains("state ACTIVE"))
        };
        if active("rxea0") && active("rxea1") {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "rails not ACTIVE again: {text}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The operation's `done` says it moved over tcp after falling back.
fn fell_back_over_tcp(done: &serde_json::Value) {
    assert_eq!(done["state"], "done", "{done}");
    assert_eq!(done["transport"], "tcp", "{done}");
    let why = done["fell_back"].as_str().unwrap_or_default();
    assert!(
        (why.contains("every RDMA rail has been down")
            || why.contains("the RDMA data path gave up"))
            && why.contains("continuing over the tcp provider"),
        "fell_back says why: {done}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the rails topology: scripts/testbed.sh run rails"]
async fn buffer_write_and_read_with_every_rail_down_continue_over_tcp() {
    // Both rcpds --transport auto (b serves tcp beside verbs); a, the
    // initiator, held by --bwlimit, with a short request timeout so that
    // rail 0's black-holed requests fail (rxe retries forever) rather than
    // wait 60 s. The fallback limit is the default (10 s).
    let (_ta, root_a) = tmp_with_root();
    let (_tb, root_b) = tmp_with_root();
    let socks = tempfile::tempdir().unwrap();
    let (sa, sb) = (socks.path().join("a.sock"), socks.path().join("b.sock"));
    let b = Rcpd::start(
        &root_b,
        "auto",
        None,
        &["--device", RAILS_B, "--socket", sb.to_str().unwrap()],
    );
    let here = Topology {
        host: HOST_A.into(),
        rcpd_netns: None,
        rcpd_device: None,
        rcp_device: None,
    };
    let a = Rcpd::start_in(
        &here,
        &root_a,
        "auto",
        None,
        &[
            "--device",
            RAILS_A,
            "--socket",
            sa.to_str().unwrap(),
            "--copy-peers",
            &common::copy_peers(),
            "--bwlimit",
            "4M",
            "--timeout",
            "5",
        ],
    );
    socket_up(&sa, &a);
    socket_up(&sb, &b);
    // iptables' first run loads its modules: not mid-operation.
    let st = Command::new("iptables")
        .args(["-n", "-L", "OUTPUT"])
        .status()
        .expect("run iptables");
    assert!(st.success(), "iptables -n -L OUTPUT: {st}");
    let metrics = a.metrics.clone().expect("rcpd a's metrics");
    let logs = || format!("\nrcpd a: {}\nrcpd b: {}", a.log(), b.log());

    let owner = bounded("connect b", ServiceClient::connect(Some(&sb), None))
        .await
        .unwrap();
    let dst = bounded("buffer b", owner.create_buffer(FB_BUF))
        .await
        .unwrap();
    bounded("expose", owner.expose(&dst, "kv", 0, FB_BUF, "rw", &[]))
        .await
        .unwrap();
    let svc = bounded("connect a", ServiceClient::connect(Some(&sa), None))
        .await
        .unwrap();
    let src = bounded("buffer a", svc.create_buffer(2 * FB_BUF))
        .await
        .unwrap();
    // Every MiB its own rotation of one pattern (cheap in a debug build).
    let mibs = (FB_BUF / MIB) as usize;
    let pat: Vec<u8> = (0..MIB + 7 * mibs as u64)
        .map(|i| (i * 29 + i / 8191) as u8)
        .collect();
    let mut data = Vec::with_capacity(FB_BUF as usize);
    for i in 0..mibs {
        data.extend_from_slice(&pat[i * 7..i * 7 + MIB as usize]);
    }
    assert!(src.local.write_at(0, &data));
    let peer = b.addr();

    // Write: a's first half into b's kv, every rail cut mid-write.
    let descs: Vec<(u64, u64, u64)> = (0..FB_BUF / MIB).map(|i| (i * MIB, i * MIB, MIB)).collect();
    let h = bounded("write", svc.write(&src, &peer, "kv", &descs, Some("fb")))
        .await
        .unwrap();
    let done = cut_mid_op(&svc, &metrics, h, &logs, 0).await;
    println!("write: {done}");
    fell_back_over_tcp(&done);
    let mut landed = vec![0u8; FB_BUF as usize];
    assert!(dst.local.read_at(0, &mut landed));
    assert!(landed == data, "b's buffer holds what a wrote");
    // One event for the operation: the grant given up on verbs sent none.
    let ev = bounded("written event", owner.next_event())
        .await
        .expect("an event");
    owner_event_matches(&ev, "written", &data);
    assert_eq!(ev["message"], "fb", "{ev}");
    let log_a = a.log();
    assert_eq!(
        log_a
            .lines()
            .filter(|l| l.contains("WARN")
                && l.contains("buffer session: ")
                && l.contains("continuing over the tcp provider"))
            .count(),
        1,
        "said once, at warn, in rcpd a's log{}",
        logs()
    );

    // Read: b's kv back into a's second half under sha256, a session of
    // its own (one per peer and check), over verbs again once the rails
    // are back; every rail cut mid-read.
    tokio::task::block_in_place(rails_active);
    let descs: Vec<(u64, u64, u64)> = (0..FB_BUF / MIB)
        .map(|i| (FB_BUF + i * MIB, i * MIB, MIB))
        .collect();
    let base = rail_bytes(&metrics).iter().sum::<u64>();
    let opts = rcp::control::buffers::client::OpOptions {
        message: None,
        check: Some("sha256"),
    };
    let h = bounded("read", svc.read_with(&src, &peer, "kv", &descs, opts))
        .await
        .unwrap();
    let done = cut_mid_op(&svc, &metrics, h, &logs, base).await;
    println!("read: {done}");
    fell_back_over_tcp(&done);
    let mut back = vec![0u8; FB_BUF as usize];
    assert!(src.local.read_at(FB_BUF, &mut back));
    assert!(back == data, "a's buffer holds what it read from b");
    let ev = bounded("read event", owner.next_event())
        .await
        .expect("an event");
    owner_event_under(&ev, "read", &data, Check::Sha256);
}
