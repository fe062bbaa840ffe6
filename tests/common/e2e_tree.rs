//! End-to-end scenarios of what `-r` does with a tree beyond its files,
//! rsync's habits: `-a` recreates symlinks with their target text (never
//! following one) and leaves out, said and counted, those pointing outside
//! the tree (`--safe-links`); without `-a` every symlink is left out with
//! rsync's "skipping non-regular file"; `--delete` removes what the
//! destination holds and the source does not (listed; a dry run removes
//! nothing; excluded names kept); `--exclude`/`--include` follow rsync's
//! rules. Push and pull alike, over every transport ([`crate::e2e_tests!`]).

use std::collections::BTreeSet;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use super::e2e::tmp_with_root;
use super::e2e_sync::summary;
use super::*;

/// A tree to copy by push (local source, remote destination) or by pull
/// (remote source, local destination), and a directory outside of both.
pub struct Trees {
    _tmp: tempfile::TempDir,
    pub d: Rcpd,
    pub t: String,
    pub push: bool,
    pub src: PathBuf,
    pub dst: PathBuf,
    /// Outside the copied trees: holds `secret`.
    pub outside: PathBuf,
}

impl Trees {
    pub fn new(t: &str, push: bool) -> Trees {
        let (tmp, root) = tmp_with_root();
        let d = Rcpd::start(&root, t, None, &[]);
        let local = tmp.path().join("local");
        std::fs::create_dir(&local).unwrap();
        let (src, dst) = if push {
            (local.join("tree"), root.join("tree"))
        } else {
            (root.join("tree"), local.join("tree"))
        };
        std::fs::create_dir(&src).unwrap();
        let outside = tmp.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("secret"), b"outside").unwrap();
        Trees {
            _tmp: tmp,
            d,
            t: t.to_string(),
            push,
            src,
            dst,
            outside,
        }
    }

    /// A file of the source tree.
    pub fn file(&self, rel: &str, len: u64) {
        let p = self.src.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        make_file(&p, len, len);
    }

    /// `rcp push|pull ARGS` of the tree.
    pub fn run(&self, args: &[&str]) -> Run {
        let (sub, from, to) = if self.push {
            ("push", self.src.to_str().unwrap().to_string(), remote(""))
        } else {
            (
                "pull",
                remote("tree"),
                self.dst.parent().unwrap().to_str().unwrap().to_string(),
            )
        };
        let mut a = vec![sub];
        a.extend_from_slice(args);
        a.extend([from.as_str(), to.as_str()]);
        rcp(self.d.port, &self.t, None, &a)
    }

    /// `rcp push|pull ARGS SRCS... DST`: each source named beside the
    /// source tree (`tree` is the tree; a trailing `/` is kept), the
    /// destination beside the destination tree.
    pub fn copy(&self, args: &[&str], srcs: &[&str], dst: &str) -> Run {
        let beside = |top: &Path, n: &str| format!("{}/{n}", top.parent().unwrap().display());
        let (sub, from, to): (_, Vec<String>, _) = if self.push {
            let from = srcs.iter().map(|n| beside(&self.src, n)).collect();
            ("push", from, remote(dst))
        } else {
            let from = srcs.iter().map(|n| remote(n)).collect();
            ("pull", from, beside(&self.dst, dst))
        };
        let mut a = vec![sub];
        a.extend_from_slice(args);
        a.extend(from.iter().map(String::as_str));
        a.push(&to);
        rcp(self.d.port, &self.t, None, &a)
    }

    /// Beside the source tree (`src`'s directory).
    pub fn src_side(&self, rel: &str) -> PathBuf {
        self.src.parent().unwrap().join(rel)
    }

    /// Beside the destination tree (`dst`'s directory).
    pub fn dst_side(&self, rel: &str) -> PathBuf {
        self.dst.parent().unwrap().join(rel)
    }

    /// [`Trees::run`], which must succeed.
    pub fn ok(&self, args: &[&str]) -> Run {
        let r = self.run(args);
        assert_eq!(
            r.code,
            0,
            "{args:?}: {}{}\n{}",
            r.stdout,
            r.stderr,
            self.d.log()
        );
        r
    }

    /// The `--json` lines of `kind`, each one's `path` relative to the
    /// source or destination tree.
    pub fn paths(&self, stdout: &str, kind: &str) -> Vec<String> {
        json_lines(stdout, kind)
            .iter()
            .map(|v| self.rel(v["path"].as_str().unwrap()))
            .collect()
    }

    fn rel(&self, p: &str) -> String {
        for top in [&self.src, &self.dst] {
            if let Ok(r) = Path::new(p).strip_prefix(top) {
                return r.to_str().unwrap().to_string();
            }
        }
        // Remote paths: "tree/..." beneath rcpd's root.
        let p = p.trim_start_matches('/');
        p.strip_prefix("tree/").unwrap_or(p).to_string()
    }
}

fn json_lines(stdout: &str, kind: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["type"] == kind)
        .collect()
}

fn set(v: &[&str]) -> BTreeSet<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn link_of(p: &Path) -> Option<PathBuf> {
    let m = std::fs::symlink_metadata(p).ok()?;
    m.file_type()
        .is_symlink()
        .then(|| std::fs::read_link(p).unwrap())
}

/// `-a`: a relative link staying inside the tree (dangling or not) is
/// recreated with its target text; an absolute one and one climbing out
/// of the tree are left out, each named and counted. Without `-a` every
/// link is left out with rsync's warning, none silently.
pub fn archive_keeps_links_and_says_what_it_leaves_out(t: &str, push: bool) {
    let s = Trees::new(t, push);
    s.file("f", 1000);
    s.file("sub/g", 2000);
    symlink("../f", s.src.join("sub/rel")).unwrap();
    symlink("missing", s.src.join("dangling")).unwrap();
    symlink("../../outside/secret", s.src.join("esc")).unwrap();
    symlink(s.outside.join("secret"), s.src.join("abs")).unwrap();
    let all = set(&["sub/rel", "dangling", "esc", "abs"]);

    // Without -a: every link left out, said on stderr and in --json.
    let r = s.ok(&["-r"]);
    for l in &all {
        let line = r
            .stderr
            .lines()
            .find(|x| x.contains(&format!("{l}\"")))
            .unwrap_or_else(|| panic!("no warning names {l}: {}", r.stderr));
        assert!(line.contains("skipping non-regular file"), "{line}");
    }
    let r = s.ok(&["-r", "--json"]);
    assert_eq!(summary(&r.stdout)["left_out"], 4, "{}", r.stdout);
    assert_eq!(summary(&r.stdout)["links"], 0, "{}", r.stdout);
    let out: BTreeSet<String> = s.paths(&r.stdout, "left_out").into_iter().collect();
    assert_eq!(out, all, "{}", r.stdout);
    for l in &all {
        assert!(link_of(&s.dst.join(l)).is_none(), "{l} was made without -a");
    }
    assert_eq!(
        sha256sum(&s.dst.join("sub/g")),
        sha256sum(&s.src.join("sub/g"))
    );

    // -a: the two inside made, as links, with their text.
    let r = s.ok(&["-a", "--json"]);
    let sum = summary(&r.stdout);
    assert_eq!(sum["links"], 2, "{}", r.stdout);
    assert_eq!(sum["left_out"], 2, "{}", r.stdout);
    let out: BTreeSet<String> = s.paths(&r.stdout, "left_out").into_iter().collect();
    assert_eq!(out, set(&["esc", "abs"]), "{}", r.stdout);
    let made: BTreeSet<String> = s.paths(&r.stdout, "link").into_iter().collect();
    assert_eq!(made, set(&["sub/rel", "dangling"]), "{}", r.stdout);
    assert_eq!(link_of(&s.dst.join("sub/rel")), Some(PathBuf::from("../f")));
    assert_eq!(
        link_of(&s.dst.join("dangling")),
        Some(PathBuf::from("missing"))
    );
    for l in ["esc", "abs"] {
        assert!(std::fs::symlink_metadata(s.dst.join(l)).is_err(), "{l}");
    }
    assert_eq!(sha256sum(&s.dst.join("f")), sha256sum(&s.src.join("f")));
    // The human run names the ones left out, and why.
    let r = s.ok(&["-a"]);
    for l in ["esc", "abs"] {
        assert!(
            r.stderr
                .lines()
                .any(|x| x.contains(&format!("{l}\":")) && x.contains("--safe-links")),
            "{l}: {}",
            r.stderr
        );
    }
    assert!(
        r.stdout.contains("2 symlinks made, 2 entries left out"),
        "{}",
        r.stdout
    );
    assert_eq!(std::fs::read(s.outside.join("secret")).unwrap(), b"outside");
}

/// `--delete`: a dry run lists what would go and removes nothing; the run
/// removes it (deepest first, each said with -v), keeps excluded names,
/// removes a link to a directory outside without following it, and
/// touches nothing beside the destination tree.
pub fn delete_removes_what_the_source_lacks(t: &str, push: bool) {
    let s = Trees::new(t, push);
    s.file("f", 1000);
    s.file("sub/g", 3000);
    s.ok(&["-r"]);
    let beside = s.dst.parent().unwrap().join("beside");
    std::fs::write(&beside, b"beside").unwrap();
    std::fs::write(s.dst.join("extra"), b"x").unwrap();
    std::fs::create_dir_all(s.dst.join("gone/x")).unwrap();
    std::fs::write(s.dst.join("gone/x/y"), b"y").unwrap();
    std::fs::write(s.dst.join("sub/old"), b"o").unwrap();
    std::fs::write(s.dst.join("note.log"), b"kept").unwrap();
    symlink(&s.outside, s.dst.join("lnk")).unwrap();
    let extras = ["extra", "gone/x/y", "gone/x", "gone", "sub/old", "lnk"];

    // --delete acts on directories only.
    if push {
        let r = s.run(&["--delete", s.src.join("f").to_str().unwrap()]);
        assert_eq!(r.code, 1, "{}{}", r.stdout, r.stderr);
    }

    let r = s.ok(&[
        "-r",
        "--delete",
        "--dry-run",
        "--json",
        "--exclude",
        "*.log",
    ]);
    let listed = s.paths(&r.stdout, "delete");
    assert_eq!(
        listed.iter().cloned().collect::<BTreeSet<_>>(),
        set(&extras),
        "{}",
        r.stdout
    );
    let at = |n: &str| listed.iter().position(|p| p == n).unwrap();
    assert!(at("gone/x/y") < at("gone/x") && at("gone/x") < at("gone"));
    assert_eq!(summary(&r.stdout)["deleted"], extras.len(), "{}", r.stdout);
    for e in extras {
        assert!(
            std::fs::symlink_metadata(s.dst.join(e)).is_ok(),
            "the dry run removed {e}"
        );
    }

    let r = s.ok(&["-r", "--delete", "-v", "--exclude", "*.log"]);
    for e in extras {
        assert!(
            r.stderr
                .lines()
                .any(|l| l.starts_with("deleting ") && l.ends_with(&format!("tree/{e}"))),
            "{e} not said: {}",
            r.stderr
        );
        assert!(
            std::fs::symlink_metadata(s.dst.join(e)).is_err(),
            "{e} is still there"
        );
    }
    assert_eq!(std::fs::read(s.dst.join("note.log")).unwrap(), b"kept");
    assert_eq!(std::fs::read(s.outside.join("secret")).unwrap(), b"outside");
    assert_eq!(std::fs::read(&beside).unwrap(), b"beside");
    assert_eq!(
        sha256sum(&s.dst.join("sub/g")),
        sha256sum(&s.src.join("sub/g"))
    );
    // Nothing left to delete.
    let r = s.ok(&["-r", "--delete", "--json", "--exclude", "*.log"]);
    assert_eq!(summary(&r.stdout)["deleted"], 0, "{}", r.stdout);
}

/// `--exclude`/`--include`: first match wins, `*` within a name, `**`
/// across `/`, a leading `/` anchored at the tree, a trailing `/` for
/// directories only, a leading `**/` matching at the top as well; a dry
/// run plans the same.
pub fn exclude_and_include_follow_rsyncs_rules(t: &str, push: bool) {
    let s = Trees::new(t, push);
    for f in [
        "a.txt",
        "b.log",
        "keep.log",
        "sub/c.txt",
        "sub/d.log",
        "build/out.o",
        "sub/build",
        "deep/x/tmp/z",
        "deep/z",
        "x.txt",
        "sub/x.txt",
    ] {
        s.file(f, 100 + f.len() as u64);
    }
    let rules = [
        "--include",
        "keep.log",
        "--exclude",
        "*.log",
        "--exclude",
        "/build/",
        "--exclude",
        "deep/**/z",
        // A leading `**/` matches zero directories too: the top `x.txt`.
        "--exclude",
        "**/x.txt",
    ];
    let copied = set(&["a.txt", "keep.log", "sub/c.txt", "sub/build", "deep/z"]);
    let dry = s.ok(&[&["-r", "--dry-run", "--json"], &rules[..]].concat());
    let planned: BTreeSet<String> = s.paths(&dry.stdout, "plan").into_iter().collect();
    assert_eq!(planned, copied, "{}", dry.stdout);
    assert_eq!(summary(&dry.stdout)["excluded"], 6, "{}", dry.stdout);
    assert!(!s.dst.exists(), "the dry run made the destination");

    let r = s.ok(&[&["-r", "--json"], &rules[..]].concat());
    assert_eq!(summary(&r.stdout)["files"], copied.len(), "{}", r.stdout);
    assert_eq!(summary(&r.stdout)["excluded"], 6, "{}", r.stdout);
    for f in &copied {
        assert_eq!(sha256sum(&s.dst.join(f)), sha256sum(&s.src.join(f)), "{f}");
    }
    for f in [
        "b.log",
        "sub/d.log",
        "build",
        "deep/x/tmp/z",
        "x.txt",
        "sub/x.txt",
    ] {
        assert!(!s.dst.join(f).exists(), "{f} was copied");
    }
}

/// `-r` into a destination tree where a source FILE's name is an existing
/// DIRECTORY: refused for that file (exit 2, the path beneath the root
/// named), the directory and what it holds untouched, never written into
/// (scp's "inside an existing directory" is the top-level destination's
/// rule only). Push and pull alike.
pub fn a_file_over_a_directory_in_the_tree_is_refused(t: &str, push: bool) {
    let s = Trees::new(t, push);
    s.file("f1", 1000);
    s.file("sub/g", 2000);
    std::fs::create_dir_all(s.dst.join("f1")).unwrap();
    std::fs::write(s.dst.join("f1/keep"), b"keep").unwrap();
    let r = s.run(&["-r"]);
    assert_eq!(r.code, 2, "{}{}\n{}", r.stdout, r.stderr, s.d.log());
    let line = r
        .stderr
        .lines()
        .find(|l| l.contains("is a directory, refusing to replace it with a file"))
        .unwrap_or_else(|| panic!("no refusal: {}", r.stderr));
    assert!(line.contains("tree/f1"), "{line}");
    assert!(
        !s.dst.join("f1/f1").exists(),
        "written inside the directory"
    );
    assert!(s.dst.join("f1").is_dir());
    assert_eq!(std::fs::read(s.dst.join("f1/keep")).unwrap(), b"keep");
}

/// A source entry whose name is not valid UTF-8 (a file, a directory) is
/// left out, named escaped and counted; the other files copy. `--delete`
/// removes neither a destination entry whose name is not UTF-8 nor one
/// named as the lossy form of a left-out source (what an older rcp made
/// of it), and says so: every rerun keeps them.
pub fn names_not_utf8_are_left_out_and_never_deleted(t: &str, push: bool) {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let s = Trees::new(t, push);
    s.file("good", 1000);
    let bad = OsStr::from_bytes(b"bad\xff\xfeutf");
    make_file(&s.src.join(bad), 500, 3);
    let bad_dir = OsStr::from_bytes(b"dir\xff");
    std::fs::create_dir(s.src.join(bad_dir)).unwrap();
    make_file(&s.src.join(bad_dir).join("inner"), 300, 4);
    let lossy = "bad\u{FFFD}\u{FFFD}utf";

    let r = s.ok(&["-r", "--json"]);
    assert_eq!(summary(&r.stdout)["left_out"], 2, "{}", r.stdout);
    assert_eq!(summary(&r.stdout)["files"], 1, "{}", r.stdout);
    assert_eq!(
        sha256sum(&s.dst.join("good")),
        sha256sum(&s.src.join("good"))
    );
    let r = s.ok(&["-r"]);
    // Named escaped (a quoted path's backslashes doubled).
    let said = r.stderr.replace(r"\\", r"\");
    assert!(
        said.contains(r"bad\xFF\xFEutf") && said.contains(r"dir\xFF"),
        "not named: {}",
        r.stderr
    );
    let made: Vec<_> = std::fs::read_dir(&s.dst)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(made, vec![std::ffi::OsString::from("good")], "{made:?}");

    // The destination's own entry by that name, and the lossy one.
    std::fs::write(s.dst.join(bad), b"its own").unwrap();
    std::fs::write(s.dst.join(lossy), b"old").unwrap();
    std::fs::write(s.dst.join("extra"), b"x").unwrap();
    for run in 0..3 {
        let r = s.ok(&["-a", "--delete"]);
        assert!(
            r.stderr.contains("--delete: keeping"),
            "run {run}: {}",
            r.stderr
        );
        assert_eq!(
            std::fs::read(s.dst.join(bad)).unwrap(),
            b"its own",
            "run {run}"
        );
        assert_eq!(
            std::fs::read(s.dst.join(lossy)).unwrap(),
            b"old",
            "run {run}"
        );
        assert!(!s.dst.join("extra").exists(), "run {run}: extra kept");
        assert!(s.src.join(bad).exists() && s.src.join(bad_dir).join("inner").exists());
    }
}

/// What `p` is, not following a symlink: "link", "dir", "file" or "none".
fn kind_of(p: &Path) -> &'static str {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_symlink() => "link",
        Ok(m) if m.is_dir() => "dir",
        Ok(_) => "file",
        Err(_) => "none",
    }
}

/// `-r` into a destination tree where a directory of the source stands
/// as a symlink (to a directory beside the tree, to one outside rcpd's
/// root, the tree's top itself): as rsync without `--keep-dirlinks`, the
/// link is replaced by a real directory and the files land in it; what
/// the links pointed to is untouched. A file whose name is a symlink to a
/// directory replaces the link. A second run changes nothing. Push and
/// pull alike.
pub fn a_symlinked_directory_at_the_destination_is_replaced(t: &str, push: bool) {
    let s = Trees::new(t, push);
    s.file("sub/f", 1000);
    s.file("sub/deep/g", 2000);
    s.file("out/h", 3000);
    s.file("lf", 4000);
    // Beside the destination tree (beneath rcpd's root on a push): what
    // a link points to, with what it holds.
    let beside = s.dst_side("beside");
    std::fs::create_dir_all(beside.join("deep")).unwrap();
    std::fs::write(beside.join("keep"), b"keep").unwrap();
    // Same size and mtime as the source's: the quick check must not
    // find it through the link and leave the real one out.
    std::fs::copy(s.src.join("sub/deep/g"), beside.join("deep/g")).unwrap();
    let t0 = std::fs::metadata(s.src.join("sub/deep/g"))
        .unwrap()
        .modified()
        .unwrap();
    std::fs::File::options()
        .write(true)
        .open(beside.join("deep/g"))
        .unwrap()
        .set_modified(t0)
        .unwrap();
    std::fs::create_dir(&s.dst).unwrap();
    symlink("../beside", s.dst.join("sub")).unwrap();
    symlink(&s.outside, s.dst.join("out")).unwrap();
    symlink("../beside", s.dst.join("lf")).unwrap();
    let untouched = |when: &str| {
        assert_eq!(names(&s.outside), vec!["secret"], "{when}: outside");
        assert_eq!(std::fs::read(s.outside.join("secret")).unwrap(), b"outside");
        assert_eq!(names(&beside), vec!["deep", "keep"], "{when}: beside");
        assert_eq!(
            names(&beside.join("deep")),
            vec!["g"],
            "{when}: beside/deep"
        );
    };
    let landed = |when: &str| {
        for d in ["sub", "sub/deep", "out"] {
            assert_eq!(kind_of(&s.dst.join(d)), "dir", "{when}: {d}");
        }
        assert_eq!(kind_of(&s.dst.join("lf")), "file", "{when}: lf");
        for f in ["sub/f", "sub/deep/g", "out/h", "lf"] {
            assert_eq!(
                sha256sum(&s.dst.join(f)),
                sha256sum(&s.src.join(f)),
                "{when}: {f}"
            );
        }
        untouched(when);
    };
    s.ok(&["-a"]);
    landed("first run");
    let r = s.ok(&["-a", "--json"]);
    assert_eq!(summary(&r.stdout)["files"], 0, "{}", r.stdout);
    landed("second run");

    // The tree's top itself a link (to the directory beside it).
    std::fs::remove_dir_all(&s.dst).unwrap();
    symlink("beside", &s.dst).unwrap();
    s.ok(&["-r", "--delete"]);
    landed("top");
}

/// A source named on the command line that is a symlink: with `-a` it is
/// copied as a symlink, its target text kept (one pointing out of its
/// directory is left out, said, as --safe-links); `LINK/` follows it into
/// the directory (its contents land in the destination, existing or not);
/// without `-a` it is followed (a tree by the link's name, a file's
/// bytes). Push and pull alike.
pub fn a_symlink_named_as_source(t: &str, push: bool) {
    let s = Trees::new(t, push);
    s.file("f", 1000);
    symlink("tree", s.src_side("tl")).unwrap();
    symlink("tree/f", s.src_side("fl")).unwrap();
    symlink("../outside/secret", s.src_side("esc")).unwrap();
    for d in ["a", "plain"] {
        std::fs::create_dir(s.dst_side(d)).unwrap();
    }
    let same = |p: &Path| assert_eq!(sha256sum(p), sha256sum(&s.src.join("f")), "{p:?}");

    let r = s.copy(&["-a"], &["tl", "fl", "esc"], "a");
    assert_eq!(r.code, 0, "{}{}\n{}", r.stdout, r.stderr, s.d.log());
    assert_eq!(link_of(&s.dst_side("a/tl")), Some(PathBuf::from("tree")));
    assert_eq!(link_of(&s.dst_side("a/fl")), Some(PathBuf::from("tree/f")));
    assert_eq!(kind_of(&s.dst_side("a/esc")), "none");
    assert!(
        r.stderr
            .lines()
            .any(|l| l.contains("esc") && l.contains("--safe-links")),
        "{}",
        r.stderr
    );
    assert!(
        r.stdout.contains("2 symlinks made, 1 entry left out"),
        "{}",
        r.stdout
    );

    // LINK/: the directory's contents, into a new destination, then into
    // the same one, existing.
    for run in 0..2 {
        let r = s.copy(&["-a"], &["tl/"], "contents");
        assert_eq!(r.code, 0, "run {run}: {}{}", r.stdout, r.stderr);
        assert_eq!(names(&s.dst_side("contents")), vec!["f"], "run {run}");
        same(&s.dst_side("contents/f"));
    }

    // Without -a: followed.
    let r = s.copy(&["-r"], &["tl", "fl"], "plain");
    assert_eq!(r.code, 0, "{}{}\n{}", r.stdout, r.stderr, s.d.log());
    assert_eq!(kind_of(&s.dst_side("plain/tl")), "dir");
    same(&s.dst_side("plain/tl/f"));
    assert_eq!(kind_of(&s.dst_side("plain/fl")), "file");
    same(&s.dst_side("plain/fl"));
}

/// `-r` into a destination tree where a directory of the source (or the
/// tree's top) is a file: refused for it (exit 2, as a file over a
/// directory), the path named, the file untouched. Push and pull alike.
pub fn a_directory_over_a_file_in_the_tree_is_refused(t: &str, push: bool) {
    let s = Trees::new(t, push);
    s.file("sub/g", 2000);
    std::fs::create_dir(&s.dst).unwrap();
    std::fs::write(s.dst.join("sub"), b"keep").unwrap();
    let check = |r: Run, name: &str| {
        assert_eq!(r.code, 2, "{}{}\n{}", r.stdout, r.stderr, s.d.log());
        let line = r
            .stderr
            .lines()
            .find(|l| l.contains("is not a directory, refusing to replace it with one"))
            .unwrap_or_else(|| panic!("no refusal: {}", r.stderr));
        assert!(line.contains(name), "{line}");
    };
    check(s.run(&["-r"]), "tree/sub");
    assert_eq!(std::fs::read(s.dst.join("sub")).unwrap(), b"keep");
    // The tree's top: a file where the destination tree goes.
    std::fs::remove_dir_all(&s.dst).unwrap();
    std::fs::write(&s.dst, b"top").unwrap();
    check(s.run(&["-r"]), "tree");
    assert_eq!(std::fs::read(&s.dst).unwrap(), b"top");
}
