//! `--json`: the lines `rcp push`, `pull`, `bench` and `doctor` print on
//! stdout, one JSON object per line, written once here (the schema is
//! `docs/json.md`).
//!
//! Every line carries `"type"` (which of the structs below) and
//! `"version"` ([`VERSION`]). Within a version, fields are only ever
//! added; a field renamed, removed or changed in meaning is a new version.
//! Optional values are `null`, never missing.

use serde::Serialize;

use crate::control::FileResult;
use crate::doctor::{Finding, Level};

/// The schema version every line carries.
pub const VERSION: u32 = 1;

#[derive(Serialize)]
struct Tagged<'a, T: Serialize> {
    #[serde(rename = "type")]
    kind: &'a str,
    version: u32,
    #[serde(flatten)]
    body: &'a T,
}

/// `body` as one line of type `kind` (no newline).
pub fn line<T: Serialize>(kind: &str, body: &T) -> String {
    serde_json::to_string(&Tagged {
        kind,
        version: VERSION,
        body,
    })
    .expect("plain structs serialize")
}

/// `"type": "file"`: one file copied and verified.
#[derive(Clone, Debug, Serialize)]
pub struct FileLine {
    /// `push` or `pull`.
    pub direction: &'static str,
    /// Push: the local path; pull: the remote path (beneath rcpd's root).
    pub source: String,
    /// Where it is now: push, the remote path (beneath rcpd's root);
    /// pull, the local path.
    pub path: String,
    /// The file's length.
    pub bytes: u64,
    /// Bytes that crossed the wire (less than `bytes` after `--resume`).
    pub moved: u64,
    /// From its open to its commit.
    pub seconds: f64,
    /// The block check (`blake3`, `sha256`, `xxh3`, `none`).
    pub check: &'static str,
    /// How `digest` is derived from the block digests
    /// ([`crate::files::Check::digest_format`]).
    pub digest_format: &'static str,
    /// The file digest, hex.
    pub digest: String,
    /// The flat SHA-256 (the `sha256sum` value), hex, with `--sha256`.
    pub sha256: Option<String>,
    /// Continued from an interrupted copy's manifest.
    pub resumed: bool,
    /// `verbs` or `tcp`.
    pub transport: String,
    /// Times this file's blocks moved again; `null`: not counted per file
    /// (the summary counts the session's reconnects).
    pub retries: Option<u64>,
}

impl FileLine {
    pub fn new(
        r: &FileResult,
        direction: &'static str,
        transport: &str,
        check: crate::files::Check,
    ) -> Self {
        FileLine {
            direction,
            source: r.source.clone(),
            path: r.path.clone(),
            bytes: r.length,
            moved: r.moved,
            seconds: r.seconds,
            check: check.name(),
            digest_format: check.digest_format(),
            digest: hex::encode(&r.digest),
            sha256: r.flat_sha256.as_ref().map(hex::encode),
            resumed: r.resumed,
            transport: transport.to_string(),
            retries: None,
        }
    }
}

/// `"type": "plan"`: one file `--dry-run` would copy.
#[derive(Clone, Debug, Serialize)]
pub struct PlanLine {
    pub direction: &'static str,
    pub source: String,
    /// Where it would go (push to a path that does not exist yet: as
    /// given).
    pub path: String,
    pub bytes: u64,
}

/// `"type": "progress"`: every `--stats` interval while files move.
#[derive(Clone, Debug, Serialize)]
pub struct ProgressLine {
    pub direction: &'static str,
    /// Bytes moved and confirmed so far.
    pub bytes: u64,
    /// Bytes of every file of the job.
    pub bytes_total: u64,
    pub files_done: u64,
    pub files_total: u64,
    /// Since the transfer started.
    pub seconds: f64,
    /// Over the last interval.
    pub bytes_per_second: f64,
}

/// `"type": "summary"`: the last line of a push or pull (or a dry run).
#[derive(Clone, Debug, Serialize)]
pub struct SummaryLine {
    pub direction: &'static str,
    /// Nothing was moved or created: `files`/`bytes` are what would be.
    pub dry_run: bool,
    pub files: u64,
    /// Directories made (`-r`; a dry run: would be made).
    pub dirs: u64,
    pub bytes: u64,
    pub moved: u64,
    /// Files left as they were at the destination (the quick check, `-c`,
    /// `-u`, `--ignore-existing`); not counted in `files`.
    pub skipped: u64,
    pub seconds: f64,
    /// Moved bits per second / 1e9.
    pub gbps: f64,
    /// `verbs` or `tcp`; `null` for a dry run or when nothing moved (no
    /// session).
    pub transport: Option<String>,
    pub check: Option<&'static str>,
    pub digest_format: Option<&'static str>,
    /// The file digest when exactly one file was copied.
    pub digest: Option<String>,
    /// Its flat SHA-256 with `--sha256`.
    pub sha256: Option<String>,
    /// Data-path reconnects of the session (verbs, after a link error);
    /// `null` when unknown.
    pub reconnects: Option<u64>,
    /// `--transport auto`: why the copy left verbs for tcp midway (every
    /// RDMA rail down past `--tcp-fallback-after`); `null`: it did not.
    pub fallback: Option<String>,
    /// `-r`: `links` (symlinks made, `-a`), `left_out` (entries left out
    /// with a warning: symlinks without `-a`, links outside the tree,
    /// FIFOs...), `excluded` (`--exclude`), `deleted` (`--delete`).
    #[serde(flatten)]
    pub tree: crate::control::jobs::tree::TreeCounts,
}

/// `"type": "left_out"`: a source entry not copied, and why (also a
/// warning on stderr without `--json`). Not the quick check's skips.
#[derive(Clone, Debug, Serialize)]
pub struct LeftOutLine {
    pub path: String,
    pub reason: String,
}

/// `"type": "link"`: a symlink `-a` made at the destination (`dry_run`:
/// would make).
#[derive(Clone, Debug, Serialize)]
pub struct LinkLine {
    pub path: String,
    pub target: String,
    pub dry_run: bool,
}

/// `"type": "delete"`: an entry `--delete` removed at the destination
/// (`dry_run`: would remove).
#[derive(Clone, Debug, Serialize)]
pub struct DeleteLine {
    pub path: String,
    pub dir: bool,
    pub dry_run: bool,
}

/// `"type": "check"`: one finding of `rcp doctor`.
#[derive(Clone, Debug, Serialize)]
pub struct CheckLine {
    pub name: &'static str,
    /// `ok`, `warn` or `fail`.
    pub level: &'static str,
    pub detail: String,
    /// What to do about it; `null` when nothing is to be done.
    pub fix: Option<String>,
}

/// A doctor level's name.
pub fn level_name(l: Level) -> &'static str {
    match l {
        Level::Ok => "ok",
        Level::Warn => "warn",
        Level::Fail => "fail",
    }
}

impl CheckLine {
    pub fn new(c: &Finding) -> Self {
        CheckLine {
            name: c.name,
            level: level_name(c.level),
            detail: c.detail.clone(),
            fix: (!c.fix.is_empty()).then(|| c.fix.clone()),
        }
    }
}

/// `"type": "doctor"`: after every check.
#[derive(Clone, Debug, Serialize)]
pub struct DoctorLine {
    /// No check failed (exit 0).
    pub ok: bool,
    pub checks: u64,
    pub warnings: u64,
    pub failures: u64,
}

/// `"type": "error"`: the run failed; the process exits with `code`.
#[derive(Clone, Debug, Serialize)]
pub struct ErrorLine {
    /// The exit code (README, "Exit codes").
    pub code: i32,
    /// The typed reason (`USAGE`, `FILE_NOT_FOUND`, `RETRYABLE`, ...).
    pub reason: String,
    pub message: String,
}

/// `"type": "bench"`: one `rcp bench` run, the fields of its
/// `bench op=...` line.
#[derive(Clone, Debug, Serialize)]
pub struct BenchLine {
    /// The `--compare` row (`null` for a plain run).
    pub label: Option<String>,
    pub op: &'static str,
    pub size: u64,
    pub batch: usize,
    pub signal: usize,
    pub inline: u32,
    pub mode: String,
    pub qps: usize,
    pub msgs: u64,
    pub seconds: f64,
    pub gbps: f64,
    pub mb_per_s: f64,
    pub msg_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub doorbells: u64,
    pub signaled: u64,
    pub inline_posted: u64,
    pub completions: u64,
    pub cpu_ns_per_msg: f64,
    pub polls: u64,
    pub empty_polls: u64,
    pub arms: u64,
    pub wakeups: u64,
    pub tx_depth: u32,
    pub cq_cpu: String,
    /// `verbs`, or `tcp` (`rcp bench --transport tcp`: loopback over the
    /// TCP provider).
    pub transport: &'static str,
}

/// `"type": "listening"`: `rcp bench --server` is ready.
#[derive(Clone, Debug, Serialize)]
pub struct ListeningLine {
    pub addr: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_carry_type_and_version_and_nulls() {
        let r = FileResult {
            path: "d/x".into(),
            source: "/tmp/x".into(),
            length: 5,
            moved: 5,
            digest: vec![0xab, 0x01],
            seconds: 0.5,
            ..FileResult::default()
        };
        let l = line(
            "file",
            &FileLine::new(&r, "push", "tcp", crate::files::Check::Blake3),
        );
        let v: serde_json::Value = serde_json::from_str(&l).unwrap();
        assert_eq!(v["type"], "file");
        assert_eq!(v["version"], VERSION);
        assert_eq!(v["digest"], "ab01");
        assert_eq!(v["check"], "blake3");
        assert_eq!(v["digest_format"], "rcp-file-digest-blake3-v1");
        assert!(v["sha256"].is_null() && v["retries"].is_null());
        assert!(v.as_object().unwrap().contains_key("sha256"));
        assert!(!l.contains('\n'));
        let c = Finding {
            name: "memlock",
            level: Level::Warn,
            detail: "low".into(),
            fix: String::new(),
        };
        let v: serde_json::Value =
            serde_json::from_str(&line("check", &CheckLine::new(&c))).unwrap();
        assert_eq!(
            (v["level"].as_str(), v["fix"].is_null()),
            (Some("warn"), true)
        );
    }
}

/// `"type": "node"`: one node of a fan-out and what it got (docs/fanout.md).
#[derive(Clone, Debug, Serialize)]
pub struct NodeLine {
    /// `host:port`.
    pub node: String,
    /// `done` (every file, verified), `failed` (it answers but lacks
    /// files) or `unreachable` (cut out of the chain).
    pub result: &'static str,
    /// Why, unless done.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}
