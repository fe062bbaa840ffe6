//! The service API: ask your node's rcpd to copy one of its paths to (or
//! from) another node's rcpd. The local rcpd acts as the other one's client;
//! this program only watches the progress stream.
//!
//! ```text
//! RCP_TOKEN=... cargo run --example service_copy -- \
//!     LOCAL_RCPD push|pull LOCAL_PATH REMOTE_RCPD REMOTE_PATH [--recursive]
//! # e.g. 127.0.0.1:7471 push datasets/a.bin node-b:7471 incoming/
//! ```
//! LOCAL_PATH is beneath the local rcpd's root, REMOTE_PATH beneath the
//! remote one's. The token (RCP_TOKEN) is sent to the local rcpd, which
//! uses its own token for the remote one unless REMOTE_RCP_TOKEN is set.
//! The local rcpd dials only the peers of its `--copy-peers`: list
//! REMOTE_RCPD there (or a network holding it).

use rcp::control::{Client, ClientOptions};
use rcp::proto::{CopyRequest, Direction};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 5 {
        eprintln!("usage: service_copy LOCAL_RCPD push|pull LOCAL_PATH REMOTE_RCPD REMOTE_PATH [--recursive]");
        std::process::exit(1);
    }
    let direction = match args[1].as_str() {
        "push" => Direction::Push,
        "pull" => Direction::Pull,
        o => return Err(format!("direction {o:?}: push or pull").into()),
    };
    let opts = ClientOptions {
        token: std::env::var("RCP_TOKEN").ok(),
        ..ClientOptions::default()
    };
    let client = Client::connect(&args[0], opts).await?;
    let mut progress = client
        .copy(CopyRequest {
            direction: direction as i32,
            local_path: args[2].clone(),
            remote: args[3].clone(),
            remote_path: args[4].clone(),
            recursive: args.iter().any(|a| a == "--recursive"),
            remote_token: std::env::var("REMOTE_RCP_TOKEN").unwrap_or_default(),
            ..Default::default()
        })
        .await?;
    while let Some(p) = progress.message().await? {
        if p.done {
            if !p.error.is_empty() {
                return Err(p.error.into());
            }
            println!(
                "done: {} files, {} bytes{}",
                p.files_done,
                p.bytes_done,
                if p.sha256.is_empty() {
                    String::new()
                } else {
                    format!(", sha256 {}", p.sha256)
                }
            );
            return Ok(());
        }
        eprintln!(
            "{}/{} bytes, {}/{} files",
            p.bytes_done, p.bytes_total, p.files_done, p.files_total
        );
    }
    Err("the progress stream ended without a final message".into())
}
