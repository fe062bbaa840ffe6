//! SIGINT and SIGTERM during `rcp push/pull`: the first one is raised for
//! the library's copy ([`rcp::control::interrupt`]), which aborts cleanly;
//! a second one ends the process at once. After the abort, [`report`] says
//! on stderr what was done and the command line that continues the copy.

use std::ffi::OsString;

use rcp::control::interrupt::{self, Signal};
use tokio::signal::unix::{signal, SignalKind};

/// Catch SIGINT and SIGTERM from now on (inside the runtime).
pub fn catch() {
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        tracing::warn!("cannot catch SIGINT/SIGTERM: an interrupt will not clean up");
        return;
    };
    tokio::spawn(async move {
        let mut first = true;
        loop {
            let sig = tokio::select! {
                _ = int.recv() => Signal::Int,
                _ = term.recv() => Signal::Term,
            };
            if !first {
                eprintln!("rcp: {} again: exiting now", sig.name());
                std::process::exit(sig.exit_code());
            }
            first = false;
            interrupt::raise(sig);
        }
    });
}

/// What an interrupted copy did, and how to continue it.
pub struct Done {
    pub files: u64,
    pub files_total: u64,
    /// Bytes of the files committed.
    pub bytes: u64,
    pub bytes_total: u64,
    /// Bytes moved (over the data path, files not committed included).
    pub moved: u64,
    /// The lone source to name with a trailing `/` in the command that
    /// continues the copy, and the destination after it: a directory
    /// that became the destination (which was not a directory), whose
    /// contents must land there again now that it is one.
    pub contents: Option<(String, String)>,
}

/// Say on stderr that `sig` ended the copy, what was committed and moved,
/// and the `--resume` command line that continues it.
pub fn report(sig: Signal, d: &Done) {
    eprintln!(
        "rcp: interrupted by {}: {} of {} files committed ({} of {} bytes), \
         {} of {} bytes moved; the verified blocks of the others are kept",
        sig.name(),
        d.files,
        d.files_total,
        d.bytes,
        d.bytes_total,
        d.moved,
        d.bytes_total
    );
    let args: Vec<OsString> = std::env::args_os().collect();
    let contents = d.contents.as_ref().map(|(s, t)| (s.as_str(), t.as_str()));
    eprintln!("rcp: to continue: {}", resume_command(&args, contents));
}

/// `args` (argv) with `--resume` after the `push`/`pull` subcommand (once),
/// quoted for a POSIX shell; with `contents` (a source and the
/// destination after it), that source's last mention before the
/// destination gets a trailing `/` (rsync's "the directory's contents").
pub fn resume_command(args: &[OsString], contents: Option<(&str, &str)>) -> String {
    let slash = contents.and_then(|(src, dst)| {
        let d = args.iter().rposition(|a| a == dst)?;
        args[..d].iter().rposition(|a| a == src)
    });
    let mut out: Vec<String> = Vec::with_capacity(args.len() + 1);
    let has = args.iter().any(|a| a == "--resume");
    let mut added = has;
    for (i, a) in args.iter().enumerate() {
        let mut a = a.to_string_lossy().into_owned();
        if Some(i) == slash {
            a.push('/');
        }
        out.push(quote(&a));
        if !added && i > 0 && (a == "push" || a == "pull") {
            out.push("--resume".into());
            added = true;
        }
    }
    out.join(" ")
}

fn quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_@%+=:,./-[]".contains(c));
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(a: &[&str]) -> Vec<OsString> {
        a.iter().map(OsString::from).collect()
    }

    #[test]
    fn resume_goes_after_the_subcommand_once() {
        let a = v(&["rcp", "-P", "7471", "push", "-r", "a b", "h:/x"]);
        assert_eq!(
            resume_command(&a, None),
            "rcp -P 7471 push --resume -r 'a b' h:/x"
        );
        let a = v(&["rcp", "pull", "--resume", "h:it's", "."]);
        assert_eq!(resume_command(&a, None), r"rcp pull --resume 'h:it'\''s' .");
    }

    #[test]
    fn a_source_that_became_the_destination_is_named_by_its_contents() {
        // The source named again as an option's value before it, and
        // the destination's own name among the options: only the source
        // right before the destination gets its slash.
        let a = v(&[
            "rcp",
            "push",
            "--exclude",
            "src",
            "-r",
            "src",
            "h:new",
            "-q",
        ]);
        assert_eq!(
            resume_command(&a, Some(("src", "h:new"))),
            "rcp push --resume --exclude src -r src/ h:new -q"
        );
        let a = v(&["rcp", "pull", "-r", "h:a b", "new"]);
        assert_eq!(
            resume_command(&a, Some(("h:a b", "new"))),
            "rcp pull --resume -r 'h:a b/' new"
        );
    }
}
