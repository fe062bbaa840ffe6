//! rcpd's unix socket (`--socket`, `RCPD_SOCKET`): one path for the gRPC
//! API and the service protocol, told apart by a connection's first four
//! bytes (`PRI ` starts the HTTP/2 preface, `RCPB` the service protocol).
//! The file is made with mode 0660; a stale socket at the path (nobody
//! listening) is replaced, anything else there is refused.

use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::Interest;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;

use super::wire::{FrameReader, MAGIC};
use super::Buffers;

/// The socket file's mode.
pub const MODE: u32 = 0o660;
/// How long a new connection may take to send its first bytes.
const FIRST_BYTES: Duration = Duration::from_secs(10);

/// The bound socket (whoever serves it removes the file when it stops).
pub struct Socket {
    pub listener: UnixListener,
    pub path: PathBuf,
}

/// Bind `path` (mode 0660), replacing a stale socket file.
pub fn bind(path: &Path) -> io::Result<Socket> {
    if let Ok(md) = std::fs::symlink_metadata(path) {
        if !md.file_type().is_socket() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{}: another rcpd is listening there", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(MODE))?;
    Ok(Socket {
        listener,
        path: path.to_path_buf(),
    })
}

/// The first four bytes of `s`, peeked (left in the socket).
async fn peek4(s: &UnixStream) -> io::Result<[u8; 4]> {
    let mut b = [0u8; 4];
    loop {
        let n = s
            .async_io(Interest::READABLE, || {
                rustix::net::recv(s, &mut b, rustix::net::RecvFlags::PEEK)
                    .map(|(n, _)| n)
                    .map_err(io::Error::from)
            })
            .await?;
        if n == 4 {
            return Ok(b);
        }
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        // Fewer than four bytes so far: wait for more.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Accept connections until the listener fails: gRPC ones go to `grpc`
/// (tonic serves them), service-protocol ones are served here.
pub async fn accept_loop(
    listener: UnixListener,
    grpc: mpsc::Sender<io::Result<UnixStream>>,
    bufs: Arc<Buffers>,
) {
    loop {
        let s = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "unix socket accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (g, b) = (grpc.clone(), bufs.clone());
        tokio::spawn(async move {
            match tokio::time::timeout(FIRST_BYTES, peek4(&s)).await {
                Ok(Ok(first)) if &first == MAGIC => {
                    let mut r = FrameReader::default();
                    if r.read_raw(&s, 4).await.is_ok() {
                        super::service::serve(b, s, r).await;
                    }
                }
                Ok(Ok(_)) => {
                    let _ = g.send(Ok(s)).await;
                }
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "unix socket connection closed before speaking")
                }
                Err(_) => tracing::debug!("unix socket connection said nothing for 10 s"),
            }
        });
    }
}
