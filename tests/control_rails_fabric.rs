//! `rcp push` / `pull` over two rails, end to end through rcpd, in the VM's
//! rails topology (scripts/testbed.sh run rails): the test binary, and so
//! rcp, in namespace a (rxea0 on va0 192.168.77.1, rxea1 on va1
//! 192.168.78.1), rcpd in b (rxeb0 192.168.77.2, rxeb1 192.168.78.2).
//! scripts/vm/suite.sh runs it there with `RCP_TEST_HOST=192.168.77.2
//! RCP_TEST_RCPD_NETNS=b`. The control plane rides on the first veth pair,
//! so the cuts below cut it too where they cut va0; TCP rides that out.
//!
//! What is checked: both rails carry blocks (rcp -v's rail lines, the
//! engine's counters), digests equal `sha256sum`'s, one rail cut for 5 s
//! is absorbed (its blocks posted on the other within a second of its
//! failure, the time printed; it rejoins), both cut for 3 s survive through
//! reconnect, and a client rail whose GID cannot reach rcpd's is refused at
//! the handshake naming both GIDs.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::e2e::tmp_with_root;
use common::{make_file, rcp, rcp_cmd, remote, sha256sum, Rcpd, Run};

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
    let r = rcp(
        d.port,
        "verbs",
        None,
        &["push", "-v", src.to_str().unwrap(), &remote("/")],
    );
    ok(&r, "push", &d);
    println!("push: {}", r.stdout.trim());
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

/// Push `src` over both rails; `cut` runs from the moment the session's
/// rails are connected (rcp logs `session rail`: the cut lands mid-copy,
/// not in the seconds rcp takes to start under TCG). rcp's output.
fn push_with(
    d: &Rcpd,
    src: &Path,
    extra: &[&str],
    cut: impl FnOnce(Instant) + Send + 'static,
) -> Run {
    push_over(d, "verbs", src, extra, cut)
}

/// [`push_with`] with `--transport transport`.
fn push_over(
    d: &Rcpd,
    transport: &str,
    src: &Path,
    extra: &[&str],
    cut: impl FnOnce(Instant) + Send + 'static,
) -> Run {
    use std::io::{BufRead, BufReader, Read};
    let dst = remote("/");
    let mut args = vec!["--device", RAILS_A, "push", "-v"];
    args.extend(extra);
    args.extend([src.to_str().unwrap(), dst.as_str()]);
    let mut child = rcp_cmd(d.port, transport, None, &args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn rcp");
    let (tx, rx) = std::sync::mpsc::channel();
    let err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for l in BufReader::new(err).lines() {
            let l = l.unwrap_or_default();
            if l.contains("session rail") {
                let _ = tx.send(());
            }
            all.push_str(&l);
            all.push('\n');
        }
        all
    });
    let mut out = child.stdout.take().unwrap();
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let cutter = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => {
            let t0 = Instant::now();
            println!("session up; cutting from now");
            Some(std::thread::spawn(move || cut(t0)))
        }
        Err(_) => None,
    };
    let t0 = Instant::now();
    let status = child.wait().expect("rcp");
    println!(
        "copy took {:.2} s after the session",
        t0.elapsed().as_secs_f64()
    );
    if let Some(c) = cutter {
        c.join().expect("the cutter");
    }
    Run {
        code: status.code().unwrap_or(-1),
        stdout: out_reader.join().unwrap(),
        stderr: reader.join().unwrap(),
    }
}

#[test]
#[ignore = "needs the rails topology: scripts/testbed.sh run rails"]
fn one_rail_cut_for_5s_is_absorbed_and_rejoins() {
    let (tmp, root) = tmp_with_root();
    let d = rcpd(&root, Some(RAILS_B));
    let src = tmp.path().join("big");
    // Long enough that rail 1 is back before the end.
    make_file(&src, 96 << 20, 11);
    let want = sha256sum(&src);
    // Rail 1 slower than rail 0 (20 ms more on va1): it holds its blocks
    // longer, so it has some in flight when it is cut, whatever else
    // bounds the copy under TCG.
    let _slow = Netem::delay("va1", "20ms");
    let r = push_with(&d, &src, &[], |t0| {
        std::thread::sleep(Duration::from_millis(2000));
        link("va1", "down");
        println!("va1 down at {:.2} s", t0.elapsed().as_secs_f64());
        std::thread::sleep(Duration::from_secs(5));
        link("va1", "up");
        println!("va1 up at {:.2} s", t0.elapsed().as_secs_f64());
    });
    ok(&r, "push across a 5 s cut of rail 1", &d);
    println!("{}", r.stdout.trim());
    assert_eq!(sha256sum(&root.join("big")), want);
    let lines = rail_lines(&r.stdout);
    // Rail 1's confirmed blocks depend on timing (those in flight at the
    // cut are requeued, not counted); that it carried some is below.
    assert_eq!(lines.len(), 2, "two rail lines: {}", r.stdout);
    let x = &lines[1];
    assert!(x.failures >= 1, "rail 1 failed: {}", r.stdout);
    assert!(
        x.requeued > 0,
        "rail 1 had blocks outstanding at the cut, moved to rail 0: {}",
        r.stdout
    );
    assert!(
        !x.failover.is_empty() && x.failover.iter().all(|&s| s < 1.0),
        "rail 1's blocks posted on rail 0 within a second of its failure: {}",
        r.stdout
    );
    println!(
        "rails figure: rail 1 requeued {} blocks, failover {:?} s, reconnects {}",
        x.requeued, x.failover, x.reconnects
    );
    assert!(x.reconnects >= 1, "rail 1 rejoined: {}", r.stdout);
}

#[test]
#[ignore = "needs the rails topology: scripts/testbed.sh run rails"]
fn both_rails_cut_for_3s_survive_through_reconnect() {
    let (tmp, root) = tmp_with_root();
    let d = rcpd(&root, Some(RAILS_B));
    let src = tmp.path().join("big");
    make_file(&src, 48 << 20, 13);
    let want = sha256sum(&src);
    let r = push_with(&d, &src, &[], |t0| {
        std::thread::sleep(Duration::from_millis(1000));
        link("va0", "down");
        link("va1", "down");
        println!("va0, va1 down at {:.2} s", t0.elapsed().as_secs_f64());
        std::thread::sleep(Duration::from_secs(3));
        link("va0", "up");
        link("va1", "up");
        println!("va0, va1 up at {:.2} s", t0.elapsed().as_secs_f64());
    });
    ok(&r, "push across a 3 s cut of both rails", &d);
    println!("{}", r.stdout.trim());
    assert_eq!(sha256sum(&root.join("big")), want);
    let lines = rail_lines(&r.stdout);
    assert_eq!(lines.len(), 2, "{}", r.stdout);
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
    let r = push_over(
        &d,
        "auto",
        &src,
        // A short limit, and QPs that give up after 2 retries (rxe at 7
        // retries forever) so the black-holed rail fails rather than hangs.
        &["--tcp-fallback-after", "3", "--qp-retry-cnt", "2"],
        move |t0| {
            // Early and RoCE first: process starts take ~1 s each under TCG.
            std::thread::sleep(Duration::from_millis(300));
            *held.lock().unwrap() = Some(DropRoce::start());
            link("va1", "down");
            println!(
                "va1 down, RoCE dropped on va0 at {:.2} s",
                t0.elapsed().as_secs_f64()
            );
        },
    );
    drop(drop_roce.lock().unwrap().take());
    link("va1", "up");
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
