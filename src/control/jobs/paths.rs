//! What the paths of `rcp push` / `rcp pull` name, by scp's rules: a
//! push's sources are local and its destination `HOST:PATH`; a pull's
//! sources are `HOST:PATH` on one host and its destination local.
//! ([`parse_remote`] decides which argument is remote.)

use std::path::PathBuf;

use super::{parse_remote, plan_pull, plan_push, Job, Plan};
use crate::control::client::Client;
use crate::control::error::{ControlError, Result};

/// The paths of a push or pull, checked against the rules: the rcpd to
/// talk to and what each side names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Paths {
    /// `rcp push LOCAL... HOST:REMOTE`.
    Push {
        /// `host:port` of rcpd.
        addr: String,
        sources: Vec<PathBuf>,
        /// Beneath rcpd's root.
        dest: String,
    },
    /// `rcp pull HOST:REMOTE... LOCAL`.
    Pull {
        /// `host:port` of rcpd (every source's).
        addr: String,
        /// Beneath rcpd's root.
        sources: Vec<String>,
        dest: PathBuf,
    },
}

impl Paths {
    /// A push's arguments (sources, then the destination; at least two),
    /// rcpd on `port`. A usage error names the argument that breaks a rule.
    pub fn push(args: &[String], port: u16) -> Result<Paths> {
        let (last, rest) = split(args)?;
        no_users(args, port)?;
        let r = parse_remote(last, port).ok_or_else(|| {
            ControlError::Usage(format!("the destination {last:?} is not HOST:PATH"))
        })?;
        if let Some(x) = rest.iter().find(|a| parse_remote(a, port).is_some()) {
            return Err(ControlError::Usage(format!(
                "push sources must be local; {x:?} looks remote (use pull)"
            )));
        }
        Ok(Paths::Push {
            addr: r.addr,
            sources: rest.iter().map(PathBuf::from).collect(),
            dest: r.path,
        })
    }

    /// A pull's arguments (sources, then the destination; at least two),
    /// rcpd on `port`. A usage error names the argument that breaks a rule.
    pub fn pull(args: &[String], port: u16) -> Result<Paths> {
        let (last, rest) = split(args)?;
        no_users(args, port)?;
        if parse_remote(last, port).is_some() {
            return Err(ControlError::Usage(format!(
                "the pull destination {last:?} must be local"
            )));
        }
        let mut addr: Option<String> = None;
        let mut sources = Vec::with_capacity(rest.len());
        for a in rest {
            let r = parse_remote(a, port)
                .ok_or_else(|| ControlError::Usage(format!("{a:?} is not HOST:PATH")))?;
            if addr.as_ref().is_some_and(|x| *x != r.addr) {
                return Err(ControlError::Usage(
                    "all pull sources must be on the same host".into(),
                ));
            }
            addr = Some(r.addr);
            sources.push(r.path);
        }
        Ok(Paths::Pull {
            addr: addr.expect("split leaves at least one source"),
            sources,
            dest: PathBuf::from(last),
        })
    }

    /// The rcpd to connect to.
    pub fn addr(&self) -> &str {
        match self {
            Paths::Push { addr, .. } | Paths::Pull { addr, .. } => addr,
        }
    }

    /// Resolve into a [`Plan`] ([`plan_push`] / [`plan_pull`]); creates
    /// nothing.
    pub async fn plan(&self, client: &Client, job: &Job) -> Result<Plan> {
        match self {
            Paths::Push { sources, dest, .. } => plan_push(client, sources, dest, job).await,
            Paths::Pull { sources, dest, .. } => plan_pull(client, sources, dest, job).await,
        }
    }
}

/// `user@host:path` is scp's and rsync's, not rcp's: rcpd has no users
/// (a token says who may copy), so a user name is refused rather than
/// silently ignored.
fn no_users(args: &[String], port: u16) -> Result<()> {
    match args
        .iter()
        .find(|a| parse_remote(a, port).is_some_and(|r| r.host.contains('@')))
    {
        Some(a) => Err(ControlError::Usage(format!(
            "{a:?}: rcp has no users (rcpd authenticates with its token: RCP_TOKEN or \
             --token-file); write HOST:PATH without the user@"
        ))),
        None => Ok(()),
    }
}

/// The destination and the sources before it (at least one).
fn split(args: &[String]) -> Result<(&String, &[String])> {
    match args.split_last() {
        Some((last, rest)) if !rest.is_empty() => Ok((last, rest)),
        _ => Err(ControlError::Usage(
            "a copy needs at least one source and a destination".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    fn usage(r: Result<Paths>) -> String {
        match r {
            Err(ControlError::Usage(m)) => m,
            other => panic!("expected a usage error, got {other:?}"),
        }
    }

    #[test]
    fn a_push_sends_local_sources_to_one_remote_destination() {
        let p = Paths::push(&args(&["a", "./b:c", "node:/d"]), 9).unwrap();
        assert_eq!(
            p,
            Paths::Push {
                addr: "node:9".into(),
                sources: vec!["a".into(), "./b:c".into()],
                dest: "/d".into(),
            }
        );
        assert_eq!(p.addr(), "node:9");
        let m = usage(Paths::push(&args(&["a", "b"]), 9));
        assert!(m.contains("\"b\" is not HOST:PATH"), "{m}");
        let m = usage(Paths::push(&args(&["a", "x:/s", "node:/d"]), 9));
        assert!(m.contains("\"x:/s\" looks remote"), "{m}");
    }

    #[test]
    fn a_pull_takes_remote_sources_on_one_host_to_a_local_destination() {
        let p = Paths::pull(&args(&["[fe80::1]:/a", "[fe80::1]:b", "out"]), 7).unwrap();
        assert_eq!(
            p,
            Paths::Pull {
                addr: "[fe80::1]:7".into(),
                sources: vec!["/a".into(), "b".into()],
                dest: "out".into(),
            }
        );
        let m = usage(Paths::pull(&args(&["node:/a", "node:/b"]), 7));
        assert!(m.contains("\"node:/b\" must be local"), "{m}");
        let m = usage(Paths::pull(&args(&["node:/a", "local", "out"]), 7));
        assert!(m.contains("\"local\" is not HOST:PATH"), "{m}");
        let m = usage(Paths::pull(&args(&["n1:/a", "n2:/b", "out"]), 7));
        assert!(m.contains("same host"), "{m}");
    }

    #[test]
    fn a_user_name_is_refused() {
        for a in [args(&["a", "me@node:/d"]), args(&["me@[fe80::1]:x", "out"])] {
            let r = if a[0] == "a" {
                Paths::push(&a, 9)
            } else {
                Paths::pull(&a, 9)
            };
            let m = usage(r);
            assert!(m.contains("rcp has no users"), "{m}");
            assert!(m.contains("@"), "{m}");
        }
        // A local name with an @ in it is a local name.
        assert!(Paths::push(&args(&["./me@x", "node:/d"]), 9).is_ok());
    }

    #[test]
    fn a_copy_needs_a_source_and_a_destination() {
        assert!(usage(Paths::push(&args(&["node:/d"]), 9)).contains("at least one source"));
        assert!(usage(Paths::pull(&[], 9)).contains("at least one source"));
    }
}
