//! Control-plane errors, typed end to end: every error has a [`Reason`],
//! the exit code and the gRPC status code come from it, and a status rcpd
//! sends carries it in its details (`google.rpc.ErrorInfo`, domain `rcp`)
//! so the client reads it back instead of guessing from the message text.

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

pub use crate::proto::Reason;

use super::protocol::Failure;
use crate::datapath::DataPathError;

/// The `domain` of the ErrorInfo in rcpd's statuses.
pub const ERROR_DOMAIN: &str = "rcp";

/// Exit codes of `rcp` (rclone's spirit). Documented in `rcp --help` and the
/// README.
pub mod exit {
    /// Everything copied and verified.
    pub const OK: i32 = 0;
    /// Usage or syntax error (bad flags, bad HOST:PATH, bad block size).
    pub const USAGE: i32 = 1;
    /// An error not otherwise classified.
    pub const OTHER: i32 = 2;
    /// A directory was not found (local or remote).
    pub const DIR_NOT_FOUND: i32 = 3;
    /// A file was not found (local or remote).
    pub const FILE_NOT_FOUND: i32 = 4;
    /// Temporary error (network, server unavailable, timeout): retrying may
    /// help; `--resume` continues where it stopped.
    pub const RETRYABLE: i32 = 5;
    /// Fatal error retrying will not fix (integrity mismatch, bad token,
    /// permission, refused request).
    pub const FATAL: i32 = 6;
    /// Transfer exceeded a limit (size or space on the destination).
    pub const TRANSFER_EXCEEDED: i32 = 7;
    /// A peer broke the protocol (a message outside it): a bug in rcp or
    /// rcpd, or a hostile peer; retrying will not help.
    pub const PROTOCOL: i32 = 8;
    /// A fan-out ended with a node that answers but does not hold every
    /// file (each node's result is in the summary and `--json`).
    pub const FANOUT_INCOMPLETE: i32 = 9;
    /// Interrupted by SIGINT (128 + 2, the shell's habit): the copy was
    /// aborted cleanly, what was verified kept; stderr says the `--resume`
    /// command that continues it.
    pub const INTERRUPTED: i32 = 130;
    /// Terminated by SIGTERM (128 + 15), as [`INTERRUPTED`].
    pub const TERMINATED: i32 = 143;
}

/// The exit code of `reason`.
pub fn exit_code(reason: Reason) -> i32 {
    match reason {
        Reason::Usage => exit::USAGE,
        Reason::DirNotFound => exit::DIR_NOT_FOUND,
        Reason::FileNotFound => exit::FILE_NOT_FOUND,
        Reason::Invalid
        | Reason::PathRefused
        | Reason::Integrity
        | Reason::Unauthenticated
        | Reason::Permission
        | Reason::Version => exit::FATAL,
        Reason::Exceeded => exit::TRANSFER_EXCEEDED,
        Reason::Retryable => exit::RETRYABLE,
        Reason::Protocol => exit::PROTOCOL,
        Reason::Interrupted => exit::INTERRUPTED,
        Reason::FanoutIncomplete => exit::FANOUT_INCOMPLETE,
        Reason::Other | Reason::Unspecified => exit::OTHER,
    }
}

/// The gRPC status code of `reason`.
pub fn status_code(reason: Reason) -> Code {
    match reason {
        Reason::Usage | Reason::Invalid => Code::InvalidArgument,
        Reason::DirNotFound | Reason::FileNotFound => Code::NotFound,
        Reason::PathRefused | Reason::Permission => Code::PermissionDenied,
        Reason::Integrity => Code::DataLoss,
        Reason::Unauthenticated => Code::Unauthenticated,
        Reason::Exceeded => Code::ResourceExhausted,
        Reason::Retryable => Code::Unavailable,
        Reason::Version => Code::FailedPrecondition,
        Reason::Protocol => Code::Aborted,
        Reason::Interrupted => Code::Cancelled,
        Reason::FanoutIncomplete => Code::Unavailable,
        Reason::Other | Reason::Unspecified => Code::Internal,
    }
}

/// The reason of a status: its ErrorInfo when rcpd sent one; otherwise
/// (a proxy, tonic's own transport errors, an older peer) its code.
pub fn status_reason(s: &Status) -> Reason {
    if let Some(info) = s.get_details_error_info() {
        if info.domain == ERROR_DOMAIN {
            if let Some(r) = Reason::from_str_name(&format!("REASON_{}", info.reason)) {
                return r;
            }
        }
    }
    match s.code() {
        Code::NotFound => Reason::FileNotFound,
        // UNKNOWN is tonic's word for a broken connection (h2 errors,
        // resets), which retrying may fix.
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown => {
            Reason::Retryable
        }
        // Only rcpd says ABORTED (tonic's transport never does): a
        // protocol violation.
        Code::Aborted => Reason::Protocol,
        Code::ResourceExhausted | Code::OutOfRange => Reason::Exceeded,
        Code::PermissionDenied => Reason::Permission,
        Code::Unauthenticated => Reason::Unauthenticated,
        Code::DataLoss => Reason::Integrity,
        Code::InvalidArgument
        | Code::FailedPrecondition
        | Code::AlreadyExists
        | Code::Unimplemented => Reason::Invalid,
        _ => Reason::Other,
    }
}

/// A status for `reason` carrying it as ErrorInfo.
pub fn status(reason: Reason, message: impl Into<String>) -> Status {
    let name = reason.as_str_name().trim_start_matches("REASON_");
    Status::with_error_details(
        status_code(reason),
        message,
        ErrorDetails::with_error_info(name, ERROR_DOMAIN, std::collections::HashMap::new()),
    )
}

/// gRPC metadata key of a `BufferGrant` answer saying this rcpd holds no
/// such session (closed idle, or restarted): the peer gives its session up
/// and asks again on a new one. Any other `retryable` (a range busy for a
/// moment) leaves the session alone.
pub const SESSION_GONE: &str = "rcp-session-gone";

/// The answer to a request on a session this rcpd no longer holds
/// (`retryable`, marked [`SESSION_GONE`]).
pub fn session_gone(message: impl std::fmt::Display) -> Status {
    let mut s = status(Reason::Retryable, message.to_string());
    s.metadata_mut().insert(
        SESSION_GONE,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    s
}

/// What went wrong, classified so the CLI can pick an exit code and the
/// server a gRPC status.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("usage: {0}")]
    Usage(String),
    #[error("directory not found: {0}")]
    DirNotFound(String),
    #[error("file not found: {0}")]
    FileNotFound(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("path refused: {0}")]
    PathRefused(String),
    #[error("integrity check failed: {0}")]
    Integrity(String),
    #[error("not authenticated: {0}")]
    Unauthenticated(String),
    #[error("permission denied: {0}")]
    Permission(String),
    #[error("limit exceeded: {0}")]
    Exceeded(String),
    #[error("temporarily unavailable: {0}")]
    Retryable(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("provider: {0}")]
    Provider(#[from] crate::provider::ProviderError),
    #[error("data path: {0}")]
    DataPath(#[from] DataPathError),
    /// What the peer (or a protocol core) said, with its reason.
    #[error("{}", .0.message)]
    Failed(Failure),
    /// A message outside the protocol (the handshake's answer, a frame).
    #[error(transparent)]
    Protocol(#[from] super::protocol::Violation),
    #[error("{0}")]
    Other(String),
    /// What the user named on rcpd's side is not there: `remote
    /// HOST:PATH: no such file` (or directory).
    #[error("remote {host}:{path}: no such {}", if *.dir { "directory" } else { "file" })]
    RemoteNotFound {
        host: String,
        path: String,
        dir: bool,
    },
    /// A name that does not resolve: retrying the same name will not help.
    #[error("unknown host {host:?}: {source}")]
    UnknownHost {
        host: String,
        #[source]
        source: std::io::Error,
    },
    /// Something answers at the address, but not rcpd (its health port,
    /// an HTTP server, another service): a wrong host or port.
    #[error("{addr} answers but is not rcpd ({why})")]
    NotRcpd { addr: String, why: String },
    /// Something took the connection at the address but sent nothing back
    /// within the wait (a stalled rcpd, or a program that says nothing):
    /// not an answer, so not known to be anything but silent.
    #[error(
        "{addr} took the connection but did not answer within {secs} s (a stalled rcpd, or \
         another program on that port)"
    )]
    NoAnswer { addr: String, secs: u64 },
    /// Fatal, with the message as is.
    #[error("{0}")]
    Fatal(String),
    /// A fan-out's nodes that answer but lack files, with why.
    #[error("fan-out incomplete: {0}")]
    FanoutIncomplete(String),
}

impl ControlError {
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ControlError {
        let context = context.into();
        move |source| ControlError::Io { context, source }
    }

    /// Why, machine-readable.
    pub fn reason(&self) -> Reason {
        use ControlError::*;
        match self {
            Usage(_) => Reason::Usage,
            DirNotFound(_) => Reason::DirNotFound,
            FileNotFound(_) => Reason::FileNotFound,
            Invalid(_) => Reason::Invalid,
            PathRefused(_) => Reason::PathRefused,
            Integrity(_) => Reason::Integrity,
            Unauthenticated(_) => Reason::Unauthenticated,
            Permission(_) => Reason::Permission,
            Exceeded(_) => Reason::Exceeded,
            Retryable(_) => Reason::Retryable,
            Provider(p) => provider_reason(p),
            Io { source, .. } => io_reason(source),
            DataPath(e) => datapath_reason(e),
            Failed(f) => f.reason,
            Protocol(_) => Reason::Protocol,
            Other(_) => Reason::Other,
            RemoteNotFound { dir: true, .. } => Reason::DirNotFound,
            RemoteNotFound { dir: false, .. } => Reason::FileNotFound,
            UnknownHost { .. } | NotRcpd { .. } => Reason::Invalid,
            NoAnswer { .. } => Reason::Retryable,
            Fatal(_) => Reason::Invalid,
            FanoutIncomplete(_) => Reason::FanoutIncomplete,
        }
    }

    /// The `rcp` exit code for this error.
    pub fn exit_code(&self) -> i32 {
        exit_code(self.reason())
    }

    /// As a protocol failure (what a core or a FileFailed carries).
    pub fn failure(&self) -> Failure {
        match self {
            ControlError::Failed(f) => f.clone(),
            e => Failure::new(e.reason(), e.to_string()),
        }
    }
}

/// The reason of an I/O error, by its kind.
pub fn io_reason(e: &std::io::Error) -> Reason {
    match e.kind() {
        std::io::ErrorKind::NotFound => Reason::FileNotFound,
        std::io::ErrorKind::PermissionDenied => Reason::Permission,
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded => Reason::Exceeded,
        std::io::ErrorKind::InvalidData => Reason::Integrity,
        _ => Reason::Other,
    }
}

/// The reason of a provider error: a device (or its provider library)
/// that is not there will not appear on a retry (exit 6: `--transport
/// verbs` on a host without RDMA); the rest may pass.
pub fn provider_reason(e: &crate::provider::ProviderError) -> Reason {
    match e {
        crate::provider::ProviderError::Verbs(v) if v.hint == crate::verbs::Hint::Device => {
            Reason::Invalid
        }
        _ => Reason::Retryable,
    }
}

/// The reason of a data-path error: it keeps its class. A remote access or
/// protection error will fail again however often it is retried; a link
/// that stayed down or a peer that stopped answering may come back.
pub fn datapath_reason(e: &DataPathError) -> Reason {
    match e {
        DataPathError::Config(_) => Reason::Usage,
        _ if e.is_retryable() => Reason::Retryable,
        DataPathError::Failed { .. } => Reason::Permission,
        _ => Reason::Other,
    }
}

impl From<Failure> for ControlError {
    fn from(f: Failure) -> Self {
        ControlError::Failed(f)
    }
}

impl From<ControlError> for Failure {
    fn from(e: ControlError) -> Self {
        match e {
            ControlError::Failed(f) => f,
            e => Failure::new(e.reason(), e.to_string()),
        }
    }
}

impl From<Status> for ControlError {
    fn from(s: Status) -> Self {
        ControlError::Failed(Failure::new(status_reason(&s), s.message().to_string()))
    }
}

impl From<ControlError> for Status {
    fn from(e: ControlError) -> Status {
        status(e.reason(), e.to_string())
    }
}

impl From<Failure> for Status {
    fn from(f: Failure) -> Status {
        status(f.reason, f.message)
    }
}

pub type Result<T, E = ControlError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_travel_in_status_details() {
        for r in [
            Reason::DirNotFound,
            Reason::FileNotFound,
            Reason::Integrity,
            Reason::Retryable,
            Reason::Exceeded,
            Reason::Version,
            Reason::Protocol,
        ] {
            // The message says nothing the reason could be read from.
            let s = status(r, "something happened");
            assert_eq!(status_reason(&s), r);
            let e = ControlError::from(s);
            assert_eq!(e.reason(), r);
            assert_eq!(e.exit_code(), exit_code(r));
        }
        // Not found, both kinds, are told apart by the details alone.
        assert_eq!(
            ControlError::from(status(Reason::DirNotFound, "x")).exit_code(),
            exit::DIR_NOT_FOUND
        );
        assert_eq!(
            ControlError::from(status(Reason::FileNotFound, "x")).exit_code(),
            exit::FILE_NOT_FOUND
        );
        // A status without details falls back to its code.
        assert_eq!(
            status_reason(&Status::unavailable("directory not found: x")),
            Reason::Retryable
        );
        assert_eq!(status_reason(&Status::not_found("x")), Reason::FileNotFound);
        // A protocol violation has a code, a reason and an exit code of its
        // own, without details too.
        let v = super::super::protocol::Violation::new(
            super::super::protocol::Side::Client,
            super::super::protocol::FrameKind::WindowDone,
            "window 0 was never granted",
        );
        let s = Status::from(ControlError::from(v));
        assert_eq!(s.code(), Code::Aborted);
        assert!(
            s.message()
                .contains("the client broke the protocol: WindowDone: window 0"),
            "{s:?}"
        );
        assert_eq!(status_reason(&s), Reason::Protocol);
        assert_eq!(
            status_reason(&Status::aborted("x")),
            Reason::Protocol,
            "by its code alone"
        );
        assert_eq!(exit_code(Reason::Protocol), exit::PROTOCOL);
        assert_eq!(exit::PROTOCOL, 8);
    }
}
