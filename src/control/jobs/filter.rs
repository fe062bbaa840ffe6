//! `--exclude` / `--include`: rsync's filter rules, pure (no I/O).
//!
//! Rules are kept in the order given; the first rule whose pattern matches
//! an entry decides (include or exclude); an entry no rule matches is
//! included. Paths are relative to the transfer root (the copied
//! directory itself, as rsync's `SRC/`), `/`-separated. Patterns:
//! - `*` matches anything but `/`; `**` anything, `/` included; `?` one
//!   character but `/`; `[...]` a class (`[!...]`/`[^...]` negated, `a-z`
//!   ranges); `\` quotes the next character;
//! - a leading `/` anchors the pattern at the transfer root;
//! - a trailing `/` matches directories only;
//! - a pattern with a `/` inside (or a `**`) is matched against the whole
//!   path when anchored, else against any trailing run of its components;
//!   without, against the last component only;
//! - `dir/***` matches `dir` and everything beneath it;
//! - an unanchored leading `**/` matches zero or more directories (`**/x`
//!   is `x` at the top too); a `/**/` further in matches one or more.
//!
//! [`Filter::excludes`] also says an entry is out when a directory above it
//! is excluded: an excluded directory is not descended into.

/// A pattern that cannot be a rule.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("bad filter pattern {pattern:?}: {why}")]
pub struct FilterError {
    pub pattern: String,
    pub why: &'static str,
}

#[derive(Clone, Debug)]
struct Rule {
    include: bool,
    anchored: bool,
    dir_only: bool,
    /// Matched against the whole path (else the last component).
    whole: bool,
    /// `dir/***`: the directory itself, or anything beneath it.
    and_below: bool,
    pattern: Vec<u8>,
}

impl Rule {
    fn parse(include: bool, raw: &str) -> Result<Rule, FilterError> {
        let bad = |why| FilterError {
            pattern: raw.to_string(),
            why,
        };
        let mut p = raw.as_bytes();
        if p.is_empty() {
            return Err(bad("empty: it names no file (rsync ignores such a rule)"));
        }
        let anchored = p.starts_with(b"/");
        if anchored {
            p = &p[1..];
        }
        let mut and_below = false;
        if p == b"***" || p.ends_with(b"/***") {
            and_below = true;
            p = &p[..p.len().saturating_sub(4)];
        }
        let dir_only = p.ends_with(b"/");
        if dir_only {
            p = &p[..p.len() - 1];
        }
        if p.is_empty() && !and_below {
            return Err(bad(
                "slashes alone name no file, so it would match nothing (rsync ignores such a \
                 rule; \"/*\" is every entry at the top of the tree, \"/***\" everything)",
            ));
        }
        let whole = anchored || and_below || p.contains(&b'/') || contains(p, b"**");
        Ok(Rule {
            include,
            anchored,
            dir_only,
            whole,
            and_below,
            pattern: p.to_vec(),
        })
    }

    fn matches(&self, path: &[u8], is_dir: bool) -> bool {
        if self.and_below {
            // `dir/***`: `dir` itself (a directory), or `dir/**`.
            let mut below = self.pattern.clone();
            if !below.is_empty() {
                below.push(b'/');
            }
            below.extend_from_slice(b"**");
            return (is_dir && self.whole_match(&self.pattern, path))
                || self.whole_match(&below, path);
        }
        if self.dir_only && !is_dir {
            return false;
        }
        if self.whole {
            self.whole_match(&self.pattern, path)
        } else {
            let last = path.rsplit(|&c| c == b'/').next().unwrap_or(path);
            glob(&self.pattern, last)
        }
    }

    /// The whole path, or (unanchored) any trailing run of its components.
    fn whole_match(&self, pattern: &[u8], path: &[u8]) -> bool {
        if glob(pattern, path) {
            return true;
        }
        if self.anchored {
            return false;
        }
        // rsync: a leading `**/` also matches zero directories, so
        // `**/x` is `x` at the top too (a `/**/` further in still wants one).
        if pattern.starts_with(b"**/") && glob(&pattern[3..], path) {
            return true;
        }
        path.iter()
            .enumerate()
            .filter(|(_, &c)| c == b'/')
            .any(|(i, _)| glob(pattern, &path[i + 1..]))
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// rsync's wildcard match of all of `s` against `p`.
fn glob(p: &[u8], s: &[u8]) -> bool {
    match p.first() {
        None => s.is_empty(),
        Some(b'*') => {
            let stars = p.iter().take_while(|&&c| c == b'*').count();
            let rest = &p[stars..];
            for i in 0..=s.len() {
                if glob(rest, &s[i..]) {
                    return true;
                }
                if stars == 1 && i < s.len() && s[i] == b'/' {
                    return false;
                }
            }
            false
        }
        Some(b'?') => !s.is_empty() && s[0] != b'/' && glob(&p[1..], &s[1..]),
        Some(b'[') => match class(&p[1..], s.first().copied()) {
            Some((true, used)) => glob(&p[1 + used..], &s[1..]),
            Some((false, _)) => false,
            // No closing `]`: a literal `[`.
            None => s.first() == Some(&b'[') && glob(&p[1..], &s[1..]),
        },
        Some(b'\\') if p.len() > 1 => s.first() == Some(&p[1]) && glob(&p[2..], &s[1..]),
        Some(&c) => s.first() == Some(&c) && glob(&p[1..], &s[1..]),
    }
}

/// A `[...]` class after its `[`: whether `c` is in it and the bytes it
/// took (its `]` included); `None` when it never closes.
fn class(p: &[u8], c: Option<u8>) -> Option<(bool, usize)> {
    let mut i = 0;
    let negated = matches!(p.first(), Some(b'!' | b'^'));
    if negated {
        i += 1;
    }
    let mut hit = false;
    let mut first = true;
    loop {
        let &x = p.get(i)?;
        if x == b']' && !first {
            break;
        }
        first = false;
        if p.get(i + 1) == Some(&b'-') && p.get(i + 2).is_some_and(|&y| y != b']') {
            let y = p[i + 2];
            hit |= c.is_some_and(|c| x <= c && c <= y);
            i += 3;
        } else {
            hit |= c == Some(x);
            i += 1;
        }
    }
    let ok = c.is_some_and(|c| c != b'/') && (hit != negated);
    Some((ok, i + 1))
}

/// `--exclude`/`--include` rules, in order.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    rules: Vec<Rule>,
}

impl Filter {
    /// Add a rule at the end: `include` for `--include`.
    pub fn push(&mut self, include: bool, pattern: &str) -> Result<(), FilterError> {
        self.rules.push(Rule::parse(include, pattern)?);
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// What the first matching rule says of this entry alone: `Some(true)`
    /// included, `Some(false)` excluded, `None` no rule matched.
    pub fn decide(&self, rel: &str, is_dir: bool) -> Option<bool> {
        let path = rel.trim_matches('/').as_bytes();
        self.rules
            .iter()
            .find(|r| r.matches(path, is_dir))
            .map(|r| r.include)
    }

    /// Whether `rel` is left out: excluded itself, or beneath an excluded
    /// directory (not descended into).
    pub fn excludes(&self, rel: &str, is_dir: bool) -> bool {
        if self.rules.is_empty() {
            return false;
        }
        let rel = rel.trim_matches('/');
        let ancestors = rel
            .char_indices()
            .filter(|&(_, c)| c == '/')
            .map(|(i, _)| &rel[..i]);
        for a in ancestors {
            if self.decide(a, true) == Some(false) {
                return true;
            }
        }
        self.decide(rel, is_dir) == Some(false)
    }
}

/// A line of an `--exclude-from` / `--include-from` file that counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FileRule {
    /// A rule: `include` for an include.
    Rule { include: bool, pattern: String },
    /// `!`: the rules given before it (on the command line too) are
    /// dropped.
    Clear,
}

/// The rules of a rules file as rsync reads one (`--exclude-from`: its
/// lines are excludes, `--include-from`: `include`): a line ends at `\n`
/// or `\r` (so CRLF files read alike); blank lines and lines starting with
/// `;` or `#` are ignored; `- ` and `+ ` in front say exclude and include
/// whatever the file's kind; a line that is just `!` clears the rules so
/// far. Whitespace is part of a pattern, as in rsync (`tr ` is a name
/// ending in a space).
pub fn rules_file(text: &str, include: bool) -> Vec<FileRule> {
    text.split(['\n', '\r'])
        .filter(|l| !l.is_empty() && !l.starts_with([';', '#']))
        .map(|l| match l {
            "!" => FileRule::Clear,
            _ => {
                let (include, pattern) = match (l.strip_prefix("- "), l.strip_prefix("+ ")) {
                    (Some(p), _) => (false, p),
                    (_, Some(p)) => (true, p),
                    _ => (include, l),
                };
                FileRule::Rule {
                    include,
                    pattern: pattern.to_string(),
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rules file read as rsync reads one: comments and blank lines
    /// out, CR ends a line, `- `/`+ ` prefixes, `!`, whitespace kept
    /// (checked against rsync 3.2 by hand: the same names copied).
    #[test]
    fn a_rules_file_reads_as_rsyncs() {
        let r = |include, p: &str| FileRule::Rule {
            include,
            pattern: p.to_string(),
        };
        let text = "# comment\n; also\n\n+ keep.log\n*.log\r\n- c.txt\n#x\ntr \n!\n+x\n";
        assert_eq!(
            rules_file(text, false),
            vec![
                r(true, "keep.log"),
                r(false, "*.log"),
                r(false, "c.txt"),
                r(false, "tr "),
                FileRule::Clear,
                r(false, "+x"),
            ]
        );
        // An include file's plain lines include; its `- ` lines exclude.
        assert_eq!(
            rules_file("keep.log\n- *.log", true),
            vec![r(true, "keep.log"), r(false, "*.log")]
        );
        assert!(rules_file("", false).is_empty());
    }

    fn f(rules: &[&str]) -> Filter {
        let mut f = Filter::default();
        for r in rules {
            let (inc, p) = match r.split_once(' ') {
                Some(("+", p)) => (true, p),
                Some(("-", p)) => (false, p),
                _ => panic!("{r}"),
            };
            f.push(inc, p).unwrap();
        }
        f
    }

    const FILE: bool = false;
    const DIR: bool = true;

    #[test]
    fn star_does_not_cross_slash_and_unanchored_matches_the_name_at_any_depth() {
        // rsync(1): "- *.o" would exclude all names matching *.o
        let x = f(&["- *.o"]);
        assert!(x.excludes("a.o", FILE));
        assert!(x.excludes("sub/deep/a.o", FILE));
        assert!(!x.excludes("a.c", FILE));
        assert!(!x.excludes("a.o.c", FILE));
        // `*` never crosses `/`.
        assert!(!f(&["- a*c"]).excludes("ab/c", FILE));
        assert!(f(&["- a*c"]).excludes("abbc", FILE));
        assert!(f(&["- a?c"]).excludes("x/abc", FILE));
        assert!(!f(&["- a?c"]).excludes("a/c", FILE));
    }

    #[test]
    fn a_leading_slash_anchors_at_the_transfer_root() {
        // "- /foo" would exclude a file (or directory) named foo in the
        // transfer-root directory
        let x = f(&["- /foo"]);
        assert!(x.excludes("foo", FILE));
        assert!(x.excludes("foo", DIR));
        assert!(!x.excludes("sub/foo", FILE));
        assert!(x.excludes("foo/inside", FILE), "not descended into");
    }

    #[test]
    fn a_trailing_slash_matches_directories_only() {
        // "- foo/" would exclude any directory named foo
        let x = f(&["- foo/"]);
        assert!(x.excludes("foo", DIR));
        assert!(x.excludes("a/b/foo", DIR));
        assert!(x.excludes("a/foo/file", FILE), "beneath it");
        assert!(!x.excludes("foo", FILE));
        assert!(!x.excludes("a/foo", FILE));
    }

    #[test]
    fn single_and_double_stars_across_levels() {
        // "- /foo/*/bar" would exclude any file named bar which is at two
        // levels below a directory named foo in the transfer-root
        let x = f(&["- /foo/*/bar"]);
        assert!(x.excludes("foo/x/bar", FILE));
        assert!(!x.excludes("foo/x/y/bar", FILE));
        assert!(!x.excludes("foo/bar", FILE));
        assert!(!x.excludes("z/foo/x/bar", FILE));
        // "- /foo/**/bar" ... two or more levels below
        let x = f(&["- /foo/**/bar"]);
        assert!(x.excludes("foo/x/bar", FILE));
        assert!(x.excludes("foo/x/y/bar", FILE));
        assert!(!x.excludes("foo/bar", FILE));
    }

    #[test]
    fn a_leading_double_star_slash_matches_zero_directories_too() {
        // As rsync 3.x: `**/x.txt` excludes `x.txt` at the top and below.
        let x = f(&["- **/x.txt"]);
        assert!(x.excludes("x.txt", FILE));
        assert!(x.excludes("c/x.txt", FILE));
        assert!(x.excludes("c/d/x.txt", FILE));
        assert!(!x.excludes("x.txty", FILE));
        let x = f(&["- **/b/"]);
        assert!(x.excludes("b", DIR));
        assert!(x.excludes("b/f", FILE), "beneath it");
        assert!(!x.excludes("b", FILE));
        let x = f(&["- **/d/***"]);
        assert!(x.excludes("d", DIR));
        assert!(x.excludes("d/f", FILE));
        // Anchored, `/**/x.txt` still wants a directory (as rsync).
        let x = f(&["- /**/x.txt"]);
        assert!(!x.excludes("x.txt", FILE));
        assert!(x.excludes("c/x.txt", FILE));
        // A `/**/` inside matches one or more directories, not zero: rsync
        // leaves `a/b` and excludes `a/x/b`, `a/x/y/b` and `z/a/q/b`.
        let x = f(&["- a/**/b"]);
        assert!(!x.excludes("a/b", DIR));
        assert!(x.excludes("a/x/b", DIR));
        assert!(x.excludes("a/x/y/b", DIR));
        assert!(x.excludes("z/a/q/b", FILE));
        assert!(!x.excludes("z/a/b", FILE));
        let x = f(&["- c/**/x.txt"]);
        assert!(!x.excludes("c/x.txt", FILE));
        assert!(x.excludes("c/d/x.txt", FILE));
    }

    #[test]
    fn a_slash_inside_matches_trailing_components_at_any_depth() {
        let x = f(&["- sub/*.tmp"]);
        assert!(x.excludes("sub/a.tmp", FILE));
        assert!(x.excludes("top/sub/a.tmp", FILE));
        assert!(!x.excludes("xsub/a.tmp", FILE));
        assert!(!x.excludes("sub/deeper/a.tmp", FILE));
    }

    #[test]
    fn first_match_wins_include_before_exclude() {
        // "+ */", "+ *.c", "- *" would include all directories and C source
        // files but nothing else
        let x = f(&["+ */", "+ *.c", "- *"]);
        assert!(!x.excludes("src", DIR));
        assert!(!x.excludes("src/a.c", FILE));
        assert!(x.excludes("src/a.h", FILE));
        assert!(x.excludes("README", FILE));
        // "+ foo/", "+ foo/bar.c", "- *" would include only the foo
        // directory and foo/bar.c
        let x = f(&["+ foo/", "+ foo/bar.c", "- *"]);
        assert!(!x.excludes("foo", DIR));
        assert!(!x.excludes("foo/bar.c", FILE));
        assert!(x.excludes("foo/baz.c", FILE));
        assert!(x.excludes("other", DIR));
        // The other order: the exclude comes first and wins.
        let x = f(&["- *.c", "+ keep.c"]);
        assert!(x.excludes("keep.c", FILE));
    }

    #[test]
    fn an_excluded_directory_is_not_descended_into() {
        // rsync(1): "- some/path/" then "+ some/path/this-file-will-not-be-found"
        // finds nothing: the directory is excluded first.
        let x = f(&["- /some/path/", "+ some/path/keep"]);
        assert!(x.excludes("some/path/keep", FILE));
        assert!(!x.excludes("some/other", FILE));
    }

    #[test]
    fn triple_star_matches_the_directory_and_below() {
        let x = f(&["+ /dir/***", "- *"]);
        assert!(!x.excludes("dir", DIR));
        assert!(!x.excludes("dir/a/b", FILE));
        assert!(x.excludes("other", FILE));
    }

    #[test]
    fn classes_and_escapes() {
        let x = f(&["- [ab]*.log"]);
        assert!(x.excludes("a1.log", FILE));
        assert!(!x.excludes("c1.log", FILE));
        assert!(f(&["- [!a]"]).excludes("b", FILE));
        assert!(!f(&["- [!a]"]).excludes("a", FILE));
        assert!(f(&["- [0-9]x"]).excludes("5x", FILE));
        assert!(f(&[r"- \*"]).excludes("*", FILE));
        assert!(!f(&[r"- \*"]).excludes("a", FILE));
    }

    #[test]
    fn no_rule_includes_and_bad_patterns_are_refused() {
        assert!(!Filter::default().excludes("anything", FILE));
        let mut x = Filter::default();
        for p in ["", "/", "//"] {
            let e = x.push(false, p).unwrap_err().to_string();
            assert!(e.contains(&format!("bad filter pattern {p:?}")), "{e}");
            assert!(e.contains("rsync ignores such a rule"), "{e}");
        }
        assert!(x
            .push(false, "/")
            .unwrap_err()
            .to_string()
            .contains("\"/*\""));
        // What the message offers instead does what it says.
        assert!(f(&["- /*"]).excludes("top", FILE));
        assert!(f(&["- /***"]).excludes("dir/below", FILE));
    }
}
