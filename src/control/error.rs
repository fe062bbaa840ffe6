//! Control-plane errors and how they map to gRPC statuses and exit codes.

use tonic::{Code, Status};

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
    DataPath(String),
    #[error("remote: {0}")]
    Status(#[from] Status),
    #[error("{0}")]
    Other(String),
    /// Fatal, with the message as is.
    #[error("{0}")]
    Fatal(String),
}

impl ControlError {
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ControlError {
        let context = context.into();
        move |source| ControlError::Io { context, source }
    }

    /// The `rcp` exit code for this error.
    pub fn exit_code(&self) -> i32 {
        use ControlError::*;
        match self {
            Usage(_) => exit::USAGE,
            DirNotFound(_) => exit::DIR_NOT_FOUND,
            FileNotFound(_) => exit::FILE_NOT_FOUND,
            Invalid(_) | PathRefused(_) | Integrity(_) | Unauthenticated(_) | Permission(_) => {
                exit::FATAL
            }
            Exceeded(_) => exit::TRANSFER_EXCEEDED,
            Retryable(_) | DataPath(_) => exit::RETRYABLE,
            Provider(_) => exit::RETRYABLE,
            Io { source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound => exit::FILE_NOT_FOUND,
                std::io::ErrorKind::PermissionDenied => exit::FATAL,
                std::io::ErrorKind::StorageFull => exit::TRANSFER_EXCEEDED,
                _ => exit::OTHER,
            },
            Status(s) => status_exit_code(s),
            Other(_) => exit::OTHER,
            Fatal(_) => exit::FATAL,
        }
    }
}

/// Exit code for a gRPC status from a server.
pub fn status_exit_code(s: &Status) -> i32 {
    match s.code() {
        Code::NotFound => {
            if s.message().starts_with("directory not found") {
                exit::DIR_NOT_FOUND
            } else {
                exit::FILE_NOT_FOUND
            }
        }
        Code::Unavailable | Code::DeadlineExceeded | Code::Aborted | Code::Cancelled => {
            exit::RETRYABLE
        }
        // rcpd never sends UNKNOWN itself: it is tonic's word for a broken
        // connection (h2 errors, resets), which retrying may fix.
        Code::Unknown => exit::RETRYABLE,
        Code::ResourceExhausted | Code::OutOfRange => exit::TRANSFER_EXCEEDED,
        Code::InvalidArgument
        | Code::FailedPrecondition
        | Code::PermissionDenied
        | Code::Unauthenticated
        | Code::DataLoss
        | Code::AlreadyExists
        | Code::Unimplemented => exit::FATAL,
        _ => exit::OTHER,
    }
}

impl From<ControlError> for Status {
    fn from(e: ControlError) -> Status {
        use ControlError::*;
        let msg = e.to_string();
        match e {
            Usage(_) | Invalid(_) => tonic::Status::invalid_argument(msg),
            DirNotFound(_) | FileNotFound(_) => tonic::Status::not_found(msg),
            PathRefused(_) | Permission(_) => tonic::Status::permission_denied(msg),
            Integrity(_) => tonic::Status::data_loss(msg),
            Unauthenticated(_) => tonic::Status::unauthenticated(msg),
            Exceeded(_) => tonic::Status::resource_exhausted(msg),
            Retryable(_) | DataPath(_) | Provider(_) => tonic::Status::unavailable(msg),
            Io { ref source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound => tonic::Status::not_found(msg),
                std::io::ErrorKind::PermissionDenied => tonic::Status::permission_denied(msg),
                std::io::ErrorKind::StorageFull => tonic::Status::resource_exhausted(msg),
                _ => tonic::Status::internal(msg),
            },
            Status(s) => s,
            Other(_) => tonic::Status::internal(msg),
            Fatal(_) => tonic::Status::failed_precondition(msg),
        }
    }
}

pub type Result<T, E = ControlError> = std::result::Result<T, E>;
