//! End-to-end scenarios of `rcp push --fanout` (docs/fanout.md): a chain
//! of rcpds, each forwarding to the next what it verified; a node killed
//! mid-copy, missing at the start, or refusing the token is routed
//! around and named in the `--json` lines.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use super::e2e::{signal, tmp_with_root};
use super::*;

const TOKEN: &str = "tok";

/// `n` rcpds, each allowed to dial the others; their roots.
pub struct Nodes {
    pub tmp: tempfile::TempDir,
    pub roots: Vec<PathBuf>,
    pub rcpds: Vec<Option<Rcpd>>,
}

impl Nodes {
    /// `n` rcpds over `t`; node `i`'s token is `tokens(i)`.
    pub fn start(t: &str, n: usize, tokens: impl Fn(usize) -> &'static str) -> Nodes {
        let (tmp, _) = tmp_with_root();
        let mut roots = Vec::new();
        let mut rcpds = Vec::new();
        for i in 0..n {
            let root = tmp.path().join(format!("node{i}"));
            std::fs::create_dir_all(&root).unwrap();
            rcpds.push(Some(Rcpd::start(
                &root,
                t,
                Some(tokens(i)),
                &["--copy-peers", &copy_peers()],
            )));
            roots.push(root);
        }
        Nodes { tmp, roots, rcpds }
    }

    pub fn addr(&self, i: usize) -> String {
        self.rcpds[i].as_ref().unwrap().addr()
    }

    pub fn port(&self, i: usize) -> u16 {
        self.rcpds[i].as_ref().unwrap().port
    }

    /// Every rcpd's log (for a failure's message).
    pub fn logs(&self) -> String {
        self.rcpds
            .iter()
            .enumerate()
            .filter_map(|(i, d)| d.as_ref().map(|d| format!("--- node {i}:\n{}", d.log())))
            .collect()
    }

    /// `--fanout` naming nodes `from..`, and `extra` after them.
    pub fn fanout(&self, from: usize, extra: &[String]) -> String {
        let mut v: Vec<String> = (from..self.roots.len())
            .filter(|&i| self.rcpds[i].is_some())
            .map(|i| self.addr(i))
            .collect();
        v.extend_from_slice(extra);
        v.join(",")
    }
}

/// The `"type":"node"` lines of rcp's `--json` output: (node, result).
pub fn node_results(stdout: &str) -> Vec<(String, String)> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["type"] == "node")
        .map(|v| {
            (
                v["node"].as_str().unwrap().to_string(),
                v["result"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// `rcp push --json SRC HOST:NAME --fanout FAN` to node 0 of `nodes`, and
/// what it printed: its exit code checked against `code` and its `node`
/// lines against `want` ((node, result) in chain order).
pub fn push_fanout(
    t: &str,
    nodes: &Nodes,
    (src, name, fan): (&Path, &str, &str),
    (code, want): (i32, Vec<(String, &str)>),
) -> Run {
    let dst = remote(name);
    let args = [
        "push",
        "--json",
        src.to_str().unwrap(),
        &dst,
        "--fanout",
        fan,
    ];
    let r = rcp(nodes.port(0), t, Some(TOKEN), &args);
    assert_eq!(r.code, code, "{}{}\n{}", r.stdout, r.stderr, nodes.logs());
    let want: Vec<(String, String)> = want.into_iter().map(|(n, s)| (n, s.to_string())).collect();
    assert_eq!(node_results(&r.stdout), want, "{}", r.stdout);
    r
}

/// No `.rcp-*` temp file or manifest left under `dir`.
pub fn no_partials(dir: &Path) {
    for e in walkdir(dir) {
        let n = e.file_name().unwrap().to_string_lossy().into_owned();
        assert!(!n.starts_with(".rcp-"), "a partial left: {}", e.display());
    }
}

fn walkdir(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walkdir(&p));
        }
        out.push(p);
    }
    out
}

/// The regular files beneath `dir`, relative, with their digests.
fn tree_digests(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut v: Vec<(PathBuf, String)> = walkdir(dir)
        .into_iter()
        .filter(|p| p.is_file())
        .map(|p| (p.strip_prefix(dir).unwrap().to_path_buf(), sha256sum(&p)))
        .collect();
    v.sort();
    v
}

/// A file and then a tree pushed to a chain of three rcpds: every node
/// holds both, byte for byte, no partial left, a `done` line each.
pub fn chain_of_three(t: &str) {
    let nodes = Nodes::start(t, 3, |_| TOKEN);
    let src = nodes.tmp.path().join("src");
    std::fs::create_dir_all(src.join("tree/a/b")).unwrap();
    make_file(&src.join("big"), (9 << 20) + 3, 21);
    for i in 0..12u64 {
        make_file(&src.join(format!("tree/a/f{i}")), i * 7001, 30 + i);
    }
    make_file(&src.join("tree/a/b/g"), (3 << 20) + 1, 50);
    let fan = nodes.fanout(1, &[]);
    let r = rcp(
        nodes.port(0),
        t,
        Some(TOKEN),
        &[
            "push",
            "--json",
            src.join("big").to_str().unwrap(),
            &remote("big"),
            "--fanout",
            &fan,
        ],
    );
    assert_eq!(r.code, 0, "{}{}\n{}", r.stdout, r.stderr, nodes.logs());
    let want: Vec<(String, String)> = (0..3).map(|i| (nodes.addr(i), "done".into())).collect();
    assert_eq!(node_results(&r.stdout), want, "{}", r.stdout);
    for root in &nodes.roots {
        assert_eq!(sha256sum(&root.join("big")), sha256sum(&src.join("big")));
    }
    let r = rcp(
        nodes.port(0),
        t,
        Some(TOKEN),
        &[
            "push",
            "-r",
            "--json",
            src.join("tree").to_str().unwrap(),
            &remote("tree"),
            "--fanout",
            &fan,
        ],
    );
    assert_eq!(r.code, 0, "{}{}\n{}", r.stdout, r.stderr, nodes.logs());
    assert_eq!(node_results(&r.stdout), want, "{}", r.stdout);
    let src_tree = tree_digests(&src.join("tree"));
    assert_eq!(src_tree.len(), 13);
    for root in &nodes.roots {
        assert_eq!(
            tree_digests(&root.join("tree")),
            src_tree,
            "{}",
            root.display()
        );
        no_partials(root);
    }
}

/// The middle node of three is killed once the last node holds verified
/// blocks (the chain is forwarding: triggered by progress, the copy slowed
/// by --bwlimit): it is named unreachable, the last node is fed by the
/// first, and both others end with the whole file and no partial.
pub fn middle_node_killed(t: &str) {
    let mut nodes = Nodes::start(t, 3, |_| TOKEN);
    let src = nodes.tmp.path().join("big");
    let len = (24 << 20) + 5;
    make_file(&src, len, 22);
    let fan = nodes.fanout(1, &[]);
    let out = nodes.tmp.path().join("rcp.out");
    let mut child = rcp_cmd(
        nodes.port(0),
        t,
        Some(TOKEN),
        &[
            "push",
            "--json",
            "--bwlimit",
            "4M",
            src.to_str().unwrap(),
            &remote("big"),
            "--fanout",
            &fan,
        ],
    )
    .stdout(std::fs::File::create(&out).unwrap())
    .stderr(Stdio::inherit())
    .spawn()
    .unwrap();
    let last = nodes.roots[2].clone();
    wait_verified_while(&last, "big", 2, &mut child, || nodes.logs());
    let mut middle = nodes.rcpds[1].take().unwrap();
    let middle_addr = middle.addr();
    signal(middle.child.id(), "KILL");
    let _ = middle.child.wait();
    let st = child.wait().unwrap();
    let stdout = std::fs::read_to_string(&out).unwrap();
    assert_eq!(st.code(), Some(0), "{stdout}\n{}", nodes.logs());
    let res = node_results(&stdout);
    assert_eq!(
        res,
        vec![
            (nodes.addr(0), "done".to_string()),
            (middle_addr, "unreachable".to_string()),
            (nodes.addr(2), "done".to_string()),
        ],
        "the kill landed mid-copy: {stdout}"
    );
    for i in [0, 2] {
        assert_eq!(sha256sum(&nodes.roots[i].join("big")), sha256sum(&src));
        no_partials(&nodes.roots[i]);
    }
}

/// A node that is not there at the start (a port nothing listens on) is
/// skipped: named unreachable, the others get everything, exit 0.
pub fn node_missing_at_the_start(t: &str) {
    let nodes = Nodes::start(t, 2, |_| TOKEN);
    let gone = {
        let l = std::net::TcpListener::bind((host().as_str(), 0)).unwrap();
        format!("{}:{}", host(), l.local_addr().unwrap().port())
    };
    let src = nodes.tmp.path().join("f");
    make_file(&src, (5 << 20) + 9, 23);
    // node 0, the missing one, node 1.
    let fan = format!("{gone},{}", nodes.addr(1));
    let want = vec![
        (nodes.addr(0), "done"),
        (gone, "unreachable"),
        (nodes.addr(1), "done"),
    ];
    push_fanout(t, &nodes, (&src, "f", &fan), (0, want));
    for root in &nodes.roots {
        assert_eq!(sha256sum(&root.join("f")), sha256sum(&src));
    }
}

/// The middle node takes another token: it refuses the node before it
/// (and rcp's own request to forward), so it is named failed with the
/// reason; the last node is fed by the first; rcp exits 9 (a node that
/// answers lacks the files).
pub fn node_refusing_the_token(t: &str) {
    let nodes = Nodes::start(t, 3, |i| if i == 1 { "other" } else { TOKEN });
    let src = nodes.tmp.path().join("f");
    make_file(&src, (5 << 20) + 1, 24);
    let fan = nodes.fanout(1, &[]);
    let want = vec![
        (nodes.addr(0), "done"),
        (nodes.addr(1), "failed"),
        (nodes.addr(2), "done"),
    ];
    let r = push_fanout(t, &nodes, (&src, "f", &fan), (9, want));
    assert!(
        r.stdout.contains("invalid token"),
        "the reason: {}",
        r.stdout
    );
    assert!(!nodes.roots[1].join("f").exists());
    for i in [0, 2] {
        assert_eq!(sha256sum(&nodes.roots[i].join("f")), sha256sum(&src));
    }
}
