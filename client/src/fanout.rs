//! `rcp push --fanout`: the CLI as a fan-out's source (docs/fanout.md).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use rcp::control::fanout::{self, Fanout, Sending, SourceSend};
use rcp::control::jobs::{self, Job, Paths, Plan};
use rcp::control::{Client, ClientOptions, ControlError};
use rcp::escape::esc;
use rcp::json::{self, line};
use rcp::proto::{self, NodeResult};

use crate::{Cli, Watch};

/// The CLI's sends: the plan made against node 0 first, a fresh one
/// against any other node (a re-route).
struct CliSource {
    opts: ClientOptions,
    first: Mutex<Option<(String, Plan)>>,
    sources: Vec<PathBuf>,
    dest: String,
    job: Job,
    watch: Arc<Watch>,
    /// The last send that finished.
    outcome: Mutex<Option<jobs::Outcome>>,
}

impl SourceSend for CliSource {
    fn send(self: Arc<Self>, node: String, resume: bool) -> Sending {
        Box::pin(async move {
            let client = Client::connect(&node, self.opts.clone()).await?;
            let first = {
                let mut f = self.first.lock().unwrap();
                match f.as_ref() {
                    Some((n, _)) if *n == node && !resume => f.take().map(|(_, p)| p),
                    _ => None,
                }
            };
            let plan = match first {
                Some(p) => p,
                None => {
                    let mut job = self.job.clone();
                    job.resume |= resume;
                    jobs::plan_push(&client, &self.sources, &self.dest, &job).await?
                }
            };
            let o = jobs::run(&client, plan, &*self.watch).await?;
            *self.outcome.lock().unwrap() = Some(o);
            Ok(())
        })
    }
}

/// Each `--fanout` node as `host:port`.
fn nodes(list: &[String], port: u16) -> Result<Vec<String>, ControlError> {
    list.iter()
        .map(|n| {
            let (h, p) = rcp::parse::host_port(n, port)
                .map_err(|e| ControlError::Usage(format!("--fanout {n:?}: {e}")))?;
            Ok(format!("{h}:{p}"))
        })
        .collect()
}

/// Push `plan` (made against the destination's rcpd) there and along
/// `more`: the source's outcome (its last send's) and every node's result.
pub async fn push(
    c: &Cli,
    more: &[String],
    paths: &Paths,
    job: &Job,
    opts: ClientOptions,
    plan: Plan,
    watch: Arc<Watch>,
) -> Result<(Result<jobs::Outcome, ControlError>, Vec<NodeResult>), ControlError> {
    let Paths::Push {
        addr,
        sources,
        dest,
    } = paths
    else {
        return Err(ControlError::Usage("--fanout is for push".into()));
    };
    let mut all = vec![addr.clone()];
    all.extend(nodes(more, c.port)?);
    let f = Fanout {
        nodes: all,
        id: job.fanout.clone(),
        files: plan.files.len() as u64,
        template: proto::CopyRequest {
            remote_path: dest.clone(),
            recursive: job.recursive,
            preserve: job.preserve,
            transport: opts.transport.as_str().into(),
            block_size: opts.block_size,
            checks: opts
                .verify
                .iter()
                .map(|&k| rcp::control::protocol::check_to_wire(k) as i32)
                .collect(),
            bwlimit: opts.bwlimit.unwrap_or(0),
            ..Default::default()
        },
        opts: opts.clone(),
        resume: job.resume,
    };
    let mut opts = opts;
    opts.windows = opts.windows.min(fanout::WINDOWS);
    let src = Arc::new(CliSource {
        opts,
        first: Mutex::new(Some((addr.clone(), plan))),
        sources: sources.clone(),
        dest: dest.clone(),
        job: job.clone(),
        watch,
        outcome: Mutex::new(None),
    });
    let states = fanout::run(&f, src.clone()).await;
    let nodes = fanout::results(&states);
    let outcome = src.outcome.lock().unwrap().take();
    let outcome = outcome.ok_or_else(|| ControlError::FanoutIncomplete(fanout::summary(&states)));
    Ok((outcome, nodes))
}

/// A line per node: JSON, or on stderr (the failed ones even with -q).
pub fn print_nodes(nodes: &[NodeResult], json: bool, quiet: bool) {
    for n in nodes {
        let (result, error) = match (n.done, n.unreachable) {
            (true, _) => ("done", None),
            (_, true) => ("unreachable", Some(n.error.clone())),
            _ => ("failed", Some(n.error.clone())),
        };
        if json {
            let l = json::NodeLine {
                node: n.node.clone(),
                result,
                error,
            };
            println!("{}", line("node", &l));
        } else if !quiet || !n.done {
            match error {
                None => eprintln!("rcp: node {}: done", esc(&n.node)),
                Some(e) => eprintln!("rcp: node {}: {result}: {}", esc(&n.node), esc(&e)),
            }
        }
    }
}
