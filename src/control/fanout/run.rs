//! The driver of a [`Chain`]: hops started, cancelled and probed as it
//! says, their ends reported back to it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::chain::{Action, Chain, HopId, NodeState, Sender};
use crate::control::client::{Client, ClientOptions};
use crate::control::error::Result;
use crate::control::ControlError;
use crate::proto;

/// How long a probed node has to answer a Stat before it counts as gone.
const PROBE_WITHIN: Duration = Duration::from_secs(5);

/// The source's side of a fan-out: every file sent to one node (with the
/// fan-out's id on each), resuming what it holds when asked.
pub trait SourceSend: Send + Sync {
    fn send(self: Arc<Self>, node: String, resume: bool) -> Sending;
}

/// A [`SourceSend::send`] under way.
pub type Sending = BoxFuture<'static, Result<()>>;

/// What a fan-out is: its nodes and what each node's forwarding Copy
/// asks.
pub struct Fanout {
    /// The nodes, "host:port", node 0 (the source's) first.
    pub nodes: Vec<String>,
    /// Unique to this fan-out (`OpenFile.fanout`, `CopyRequest.follow`).
    pub id: String,
    /// Files the source sends: a node is done when it forwarded this many.
    pub files: u64,
    /// The path on every node (as `CopyRequest.remote_path`), and the
    /// Copy settings each forwarding node uses (transport, checks, block
    /// size, preserve, recursive).
    pub template: proto::CopyRequest,
    /// How the driver reaches the nodes (their Copy API, the probes).
    pub opts: ClientOptions,
    /// The source's first send resumes (`--resume`).
    pub resume: bool,
}

/// A fresh fan-out id: 128 random bits, hex.
pub fn new_id() -> String {
    let mut b = [0u8; 16];
    getrandom::getrandom(&mut b).expect("the OS random source");
    hex::encode(b)
}

enum Event {
    Done(HopId),
    /// Why, and whether the sender refused the hop.
    Failed(HopId, String, bool),
    Probed(HopId, Vec<usize>),
}

/// Run `f` with `source` sending from the source: every node's result,
/// in chain order.
pub async fn run(f: &Fanout, source: Arc<dyn SourceSend>) -> Vec<(String, NodeState)> {
    let mut chain = Chain::new(f.nodes.len(), f.resume);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut tasks: HashMap<HopId, JoinHandle<()>> = HashMap::new();
    loop {
        while let Some(a) = chain.poll_action() {
            match a {
                Action::Start {
                    hop,
                    from,
                    to,
                    resume,
                } => {
                    let work: BoxFuture<'static, Result<(), HopError>> = match from {
                        Sender::Source => {
                            let s = source.clone().send(f.nodes[to].clone(), resume);
                            Box::pin(async move { s.await.map_err(HopError::Failed) })
                        }
                        Sender::Node(u) => Box::pin(forward(
                            f.opts.clone(),
                            f.nodes[u].clone(),
                            follow_request(f, to),
                        )),
                    };
                    let tx = tx.clone();
                    tasks.insert(
                        hop,
                        tokio::spawn(async move {
                            let e = match work.await {
                                Ok(()) => Event::Done(hop),
                                Err(HopError::Refused(e)) => {
                                    Event::Failed(hop, e.to_string(), true)
                                }
                                Err(HopError::Failed(e)) => {
                                    Event::Failed(hop, e.to_string(), false)
                                }
                            };
                            let _ = tx.send(e);
                        }),
                    );
                }
                Action::Cancel { hop } => {
                    if let Some(t) = tasks.remove(&hop) {
                        t.abort();
                    }
                }
                Action::Probe { hop, nodes } => {
                    let (tx, opts) = (tx.clone(), f.opts.clone());
                    let addrs: Vec<(usize, String)> =
                        nodes.iter().map(|&n| (n, f.nodes[n].clone())).collect();
                    tokio::spawn(async move {
                        let answers = futures::future::join_all(addrs.into_iter().map(|(n, a)| {
                            let opts = opts.clone();
                            async move { probe(&a, opts).await.then_some(n) }
                        }))
                        .await;
                        let _ =
                            tx.send(Event::Probed(hop, answers.into_iter().flatten().collect()));
                    });
                }
            }
        }
        if chain.is_finished() {
            break;
        }
        let Some(e) = rx.recv().await else { break };
        match e {
            Event::Done(hop) => {
                tasks.remove(&hop);
                chain.hop_done(hop);
            }
            Event::Failed(hop, why, by_sender) => {
                tasks.remove(&hop);
                tracing::warn!(
                    hop,
                    by_sender,
                    "fan-out hop failed: {}",
                    crate::escape::esc(&why)
                );
                chain.hop_failed(hop, why, by_sender);
            }
            Event::Probed(hop, up) => chain.probed(hop, &up),
        }
    }
    f.nodes
        .iter()
        .cloned()
        .zip(chain.states().iter().cloned())
        .collect()
}

/// What a forwarding Copy names as its local path: an rcpd of 2.4 reads
/// the fan-out's files instead; an older one, which knows no `follow`,
/// refuses a path that leaves its root (instead of pushing its root).
pub const FOLLOW_LOCAL_PATH: &str = "../a-fan-out-needs-rcpd-2.4";

/// The Copy a node runs to forward the fan-out to node `to`.
fn follow_request(f: &Fanout, to: usize) -> proto::CopyRequest {
    proto::CopyRequest {
        direction: proto::Direction::Push as i32,
        local_path: FOLLOW_LOCAL_PATH.into(),
        remote: f.nodes[to].clone(),
        follow: f.id.clone(),
        follow_files: f.files,
        resume: true,
        fanout: Vec::new(),
        ..f.template.clone()
    }
}

/// How a hop failed.
enum HopError {
    /// The sender did not take the hop: not reached, or its Copy API
    /// refused the request before it began.
    Refused(ControlError),
    /// Under way.
    Failed(ControlError),
}

/// Ask the rcpd at `node` for the Copy `req`; its end.
async fn forward(
    opts: ClientOptions,
    node: String,
    req: proto::CopyRequest,
) -> Result<(), HopError> {
    let c = Client::connect(&node, opts)
        .await
        .map_err(HopError::Refused)?;
    let mut s = c.copy(req).await.map_err(HopError::Refused)?;
    let mut last = None;
    while let Some(p) = s.message().await.map_err(|e| HopError::Failed(e.into()))? {
        last = Some(p);
    }
    match last {
        Some(p) if p.done && p.error.is_empty() => Ok(()),
        Some(p) if !p.error.is_empty() => Err(HopError::Failed(ControlError::Other(p.error))),
        _ => Err(HopError::Failed(ControlError::Other(format!(
            "{node} ended its forwarding copy without a result"
        )))),
    }
}

/// Whether the rcpd at `node` answers in time: it takes a connection and
/// answers a Stat, even with a refusal (a token it does not take).
async fn probe(node: &str, opts: ClientOptions) -> bool {
    let ask = async {
        let c = Client::connect(node, opts).await?;
        match c.stat(".").await {
            Err(e) if e.reason() == crate::control::error::Reason::Retryable => Err(e),
            _ => Ok(()),
        }
    };
    matches!(tokio::time::timeout(PROBE_WITHIN, ask).await, Ok(Ok(())))
}

/// The fan-out's files, counted by a plan against the first node that
/// answers (`count`); the error of the last if none does.
pub async fn count_files<F, Fut>(nodes: &[String], count: F) -> Result<u64>
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = Result<u64>>,
{
    let mut err = None;
    for n in nodes {
        match count(n.clone()).await {
            Ok(files) => return Ok(files),
            Err(e) => {
                tracing::warn!(node = %crate::escape::esc(n), "fan-out: cannot plan against it: {}", crate::escape::esc(&e));
                err = Some(e);
            }
        }
    }
    Err(err.unwrap_or_else(|| crate::control::ControlError::Usage("a fan-out needs a node".into())))
}

/// Every node's result, as the Copy API says it.
pub fn results(states: &[(String, NodeState)]) -> Vec<proto::NodeResult> {
    states
        .iter()
        .map(|(n, s)| proto::NodeResult {
            node: n.clone(),
            done: *s == NodeState::Done,
            unreachable: matches!(s, NodeState::Unreachable(_)),
            error: match s {
                NodeState::Failed(e) | NodeState::Unreachable(e) => e.clone(),
                NodeState::Waiting => "never finished".into(),
                NodeState::Done => String::new(),
            },
        })
        .collect()
}

/// The error of a fan-out where a node that answers lacks files: every
/// node still in reach must hold everything (an unreachable one is cut
/// out and named, docs/fanout.md). Nothing done at all is an error too.
pub fn incomplete(nodes: &[proto::NodeResult]) -> Option<crate::control::ControlError> {
    let bad: Vec<String> = nodes
        .iter()
        .filter(|n| !n.done && !n.unreachable)
        .map(|n| format!("{}: {}", n.node, n.error))
        .collect();
    if !bad.is_empty() {
        return Some(crate::control::ControlError::FanoutIncomplete(
            bad.join("; "),
        ));
    }
    if !nodes.is_empty() && nodes.iter().all(|n| !n.done) {
        return Some(crate::control::ControlError::FanoutIncomplete(
            "no node could be reached".into(),
        ));
    }
    None
}

/// One line naming each node's result.
pub fn summary(states: &[(String, NodeState)]) -> String {
    results(states)
        .iter()
        .map(|n| match (n.done, n.unreachable) {
            (true, _) => format!("{}: done", n.node),
            (_, true) => format!("{}: unreachable ({})", n.node, n.error),
            _ => format!("{}: failed ({})", n.node, n.error),
        })
        .collect::<Vec<_>>()
        .join("; ")
}
