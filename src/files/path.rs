//! The remote-path normalizer: a pure function from the string a peer sent to a
//! list of plain components, refusing anything that could leave the root lexically.
//!
//! Rules (see [`normalize`]):
//! - empty string, NUL bytes, more than [`MAX_PATH`] bytes, a component of more than
//!   255 bytes: refused;
//! - absolute paths (leading `/`): refused ([`PathError::Absolute`]);
//! - empty components (`a//b`) and `.` are dropped;
//! - `..` is resolved *lexically* (`a/b/../c` is `a/c`); a `..` that would climb above
//!   the root is refused ([`PathError::Escapes`]), even if a later component would
//!   come back down (`a/../../root/x`);
//! - a trailing `/` is remembered ([`RelPath::trailing_slash`]) for scp-style
//!   destination semantics.
//!
//! `.` (or `./`) is the root itself: zero components.
//!
//! Lexical `..` means `link/..` is the directory holding `link`, not the parent of the
//! link's target. That is the safe reading (it can never climb out) and the one most
//! file servers use. Symlinks met while *resolving* the normalized path are handled
//! by [`crate::files::root::Root`].

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::error::PathError;

/// Longest remote path accepted, in bytes (Linux `PATH_MAX`).
pub const MAX_PATH: usize = 4096;
/// Longest single component, in bytes (Linux `NAME_MAX`).
pub const MAX_NAME: usize = 255;

/// A normalized path relative to a root: only plain components (no `.`, `..`, empty).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RelPath {
    components: Vec<String>,
    trailing_slash: bool,
}

impl RelPath {
    /// The root itself (`.`).
    pub fn root() -> Self {
        Self::default()
    }
    pub fn components(&self) -> &[String] {
        &self.components
    }
    /// The components, taken without a copy.
    pub fn into_components(self) -> Vec<String> {
        self.components
    }
    /// True for the root itself.
    pub fn is_root(&self) -> bool {
        self.components.is_empty()
    }
    /// Did the original string end in `/` (the peer insists it is a directory)?
    pub fn trailing_slash(&self) -> bool {
        self.trailing_slash
    }
    /// The path to hand to `openat`-style calls: `.` for the root.
    pub fn to_path(&self) -> PathBuf {
        if self.components.is_empty() {
            PathBuf::from(".")
        } else {
            PathBuf::from(self.components.join("/"))
        }
    }
    /// Last component, `None` for the root.
    pub fn file_name(&self) -> Option<&str> {
        self.components.last().map(String::as_str)
    }
    /// Everything but the last component (the root for a one-component path).
    pub fn parent(&self) -> RelPath {
        let mut c = self.components.clone();
        c.pop();
        RelPath {
            components: c,
            trailing_slash: false,
        }
    }
    /// Append one already-valid component.
    pub fn join(&self, name: &str) -> Result<RelPath, PathError> {
        check_name(name)?;
        let mut c = self.components.clone();
        c.push(name.to_owned());
        Ok(RelPath {
            components: c,
            trailing_slash: false,
        })
    }
}

impl std::fmt::Display for RelPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_path().to_string_lossy())
    }
}

/// Normalize a remote path string; see the module doc for the rules.
pub fn normalize(path: &str) -> Result<RelPath, PathError> {
    let owned = || path.to_owned();
    if path.is_empty() {
        return Err(PathError::Empty);
    }
    if path.as_bytes().contains(&0) {
        return Err(PathError::Nul { path: owned() });
    }
    if path.len() > MAX_PATH {
        return Err(PathError::TooLong {
            path: owned(),
            len: path.len(),
            max: MAX_PATH,
        });
    }
    if path.starts_with('/') {
        return Err(PathError::Absolute { path: owned() });
    }
    let mut components: Vec<String> = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                if components.pop().is_none() {
                    return Err(PathError::Escapes { path: owned() });
                }
            }
            c if c.len() > MAX_NAME => return Err(PathError::ComponentTooLong { path: owned() }),
            c => components.push(c.to_owned()),
        }
    }
    Ok(RelPath {
        components,
        trailing_slash: path.ends_with('/'),
    })
}

/// A relative path that [`normalize`] leaves as written (plain names
/// joined by single `/`s: nothing to drop, resolve or refuse), split into
/// its parent in normal form (`.` for a bare name) and its last name,
/// without building a [`RelPath`]; `None` for any other path, which takes
/// [`normalize`].
pub fn plain_parent_and_name(path: &str) -> Option<(&str, &str)> {
    if path.is_empty() || path.len() > MAX_PATH || path.as_bytes().contains(&0) {
        return None;
    }
    let plain = |c: &str| !matches!(c, "" | "." | "..") && c.len() <= MAX_NAME;
    if !path.split('/').all(plain) {
        return None;
    }
    Some(path.rsplit_once('/').unwrap_or((".", path)))
}

/// Check that `name` is a single, plain file name (for temp/final names, link names).
pub fn check_name(name: &str) -> Result<(), PathError> {
    check_name_os(OsStr::new(name))
}

/// [`check_name`] for names that may not be UTF-8 (local files).
pub fn check_name_os(name: &OsStr) -> Result<(), PathError> {
    let b = name.as_bytes();
    let bad = |why| PathError::BadName {
        name: name.to_string_lossy().into_owned(),
        why,
    };
    if b.is_empty() {
        return Err(bad("empty"));
    }
    if b == b"." || b == b".." {
        return Err(bad("\".\" and \"..\" are not file names"));
    }
    if b.contains(&b'/') {
        return Err(bad("contains '/'"));
    }
    if b.contains(&0) {
        return Err(bad("contains a NUL byte"));
    }
    if b.len() > MAX_NAME {
        return Err(bad("longer than 255 bytes"));
    }
    Ok(())
}

/// Lexically resolve a symlink `target` found at `link` (a path relative to some tree
/// top), returning the components it points at relative to the same top, or `None` if
/// it is absolute or climbs above the top. Pure.
pub fn symlink_target_within(link: &Path, target: &Path) -> Option<Vec<Vec<u8>>> {
    let t = target.as_os_str().as_bytes();
    if t.is_empty() || t.starts_with(b"/") {
        return None;
    }
    let mut stack: Vec<Vec<u8>> = link
        .parent()
        .map(|p| {
            p.as_os_str()
                .as_bytes()
                .split(|&c| c == b'/')
                .filter(|c| !c.is_empty() && *c != b".")
                .map(<[u8]>::to_vec)
                .collect()
        })
        .unwrap_or_default();
    for c in t.split(|&c| c == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                stack.pop()?;
            }
            c => stack.push(c.to_vec()),
        }
    }
    Some(stack)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn comps(p: &str) -> Vec<String> {
        normalize(p).unwrap().components().to_vec()
    }

    #[test]
    fn plain_and_nested() {
        assert_eq!(comps("a"), ["a"]);
        assert_eq!(comps("a/b/c.txt"), ["a", "b", "c.txt"]);
        assert_eq!(comps("a//b/./c/"), ["a", "b", "c"]);
        assert!(normalize("a/b/").unwrap().trailing_slash());
        assert!(!normalize("a/b").unwrap().trailing_slash());
        assert_eq!(normalize("a/b").unwrap().to_path(), PathBuf::from("a/b"));
    }

    /// A plain path is split as its normal form is; any other is left to
    /// `normalize` (to drop, resolve or refuse).
    #[test]
    fn plain_paths_split_as_their_normal_form() {
        let long = "n".repeat(MAX_NAME + 1);
        for p in ["a", "a/b", "tree/d05/e3/f000123", "a b/.c/..d"] {
            let (parent, name) = plain_parent_and_name(p).unwrap_or_else(|| panic!("{p}"));
            let r = normalize(p).unwrap();
            assert_eq!(r.file_name(), Some(name), "{p}");
            let want = r.parent().to_string();
            assert_eq!(parent, if want.is_empty() { "." } else { &want }, "{p}");
            assert_eq!(r.to_string(), p, "{p}");
        }
        for p in [
            "", ".", "..", "/a", "a/", "a//b", "./a", "a/./b", "a/../b", "a/..", "a\0b", &long,
        ] {
            assert_eq!(plain_parent_and_name(p), None, "{p:?}");
        }
    }

    #[test]
    fn root_forms() {
        for p in [".", "./", ".//.", "a/.."] {
            let r = normalize(p).unwrap();
            assert!(r.is_root(), "{p}");
            assert_eq!(r.to_path(), PathBuf::from("."));
        }
    }

    #[test]
    fn dotdot_inside_is_fine() {
        assert_eq!(comps("a/b/../c"), ["a", "c"]);
        assert_eq!(comps("a/./b/.."), ["a"]);
    }

    #[test]
    fn escapes_refused() {
        for p in ["..", "../x", "a/../../x", "./..", "a/b/../../../root/x"] {
            assert!(
                matches!(normalize(p), Err(PathError::Escapes { ref path }) if path == p),
                "{p}: {:?}",
                normalize(p)
            );
        }
    }

    #[test]
    fn absolute_refused() {
        for p in ["/etc/passwd", "/", "//x"] {
            assert!(
                matches!(normalize(p), Err(PathError::Absolute { .. })),
                "{p}"
            );
        }
        let msg = normalize("/etc/passwd").unwrap_err().to_string();
        assert!(
            msg.contains("/etc/passwd") && msg.contains("absolute"),
            "{msg}"
        );
    }

    #[test]
    fn bad_strings() {
        assert!(matches!(normalize(""), Err(PathError::Empty)));
        assert!(matches!(normalize("a\0b"), Err(PathError::Nul { .. })));
        let long = "a/".repeat(2049);
        assert!(matches!(
            normalize(&long),
            Err(PathError::TooLong { len: 4098, .. })
        ));
        let ok = "a/".repeat(2048);
        assert_eq!(normalize(&ok).unwrap().components().len(), 2048);
        let comp = "x".repeat(256);
        assert!(matches!(
            normalize(&comp),
            Err(PathError::ComponentTooLong { .. })
        ));
        assert!(normalize(&"x".repeat(255)).is_ok());
    }

    #[test]
    fn names() {
        assert!(check_name("f.txt").is_ok());
        for n in ["", ".", "..", "a/b", "a\0"] {
            assert!(check_name(n).is_err(), "{n:?}");
        }
    }

    #[test]
    fn symlink_targets() {
        let w = |l: &str, t: &str| symlink_target_within(Path::new(l), Path::new(t));
        assert_eq!(w("a/link", "b"), Some(vec![b"a".to_vec(), b"b".to_vec()]));
        assert_eq!(w("a/link", "../b"), Some(vec![b"b".to_vec()]));
        assert_eq!(w("a/link", "../../b"), None);
        assert_eq!(w("link", "/etc"), None);
        assert_eq!(w("link", "."), Some(vec![]));
        assert_eq!(w("link", ""), None);
    }
}
