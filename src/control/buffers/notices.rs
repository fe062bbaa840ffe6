//! Notices of operations under standing grants, batched per session: at
//! most one `BufferNotify` of a session is in flight; the notices of the
//! operations that end their moves meanwhile queue, and go together in the
//! next call as soon as it returns. A lone operation's notice leaves at
//! once (nothing waits for company); 64 operations in flight share a few
//! calls instead of 64. Each operation gets its own notice's result.
//! A call goes on the data path where the session and the peer allow it
//! (a tcp session's connection, [`super::frames`]; a verbs session's
//! message QP, [`super::messages`]), else as a gRPC `BufferNotify`.

use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use super::frames::Frames;
use super::messages::VerbsNotices;
use super::standing::{self, MAX_NOTICES};
use super::Failure;
use crate::control::client::Client;
use crate::control::error::{status_reason, Reason};
use crate::proto;

type Reply = oneshot::Sender<Result<proto::BufferNoticeResult, Failure>>;

/// A session's queue of notices (one per session to a peer).
pub struct Notices {
    client: Client,
    /// Tcp sessions: the data path's way.
    pub(super) frames: Option<Arc<Frames>>,
    /// Verbs sessions: the message QP's way.
    verbs: Option<VerbsNotices>,
    session_id: u64,
    /// The peer, for errors.
    peer: String,
    q: Mutex<Queue>,
}

#[derive(Default)]
struct Queue {
    /// A call is in flight (its task sends the queue next).
    busy: bool,
    waiting: Vec<(proto::BufferNotice, Reply)>,
}

impl Notices {
    /// The notices of session `session_id` to `peer`, over `client`,
    /// `frames` (tcp) or a message QP on the path of `rail` (verbs).
    pub fn new(
        client: Client,
        frames: Option<Arc<Frames>>,
        rail: Option<Arc<crate::provider::verbs::VerbsChannel>>,
        session_id: u64,
        peer: String,
    ) -> Arc<Notices> {
        let verbs = rail.map(|r| VerbsNotices::new(r, client.clone(), session_id));
        Arc::new(Notices {
            client,
            frames,
            verbs,
            session_id,
            peer,
            q: Mutex::default(),
        })
    }

    /// The peer gave a standing grant that says `frames`: it takes
    /// notices on the data path.
    pub fn taken(&self) {
        if let Some(f) = &self.frames {
            f.taken();
        }
        if let Some(v) = &self.verbs {
            v.taken();
        }
    }

    /// Tell the peer of `n` (with whatever else is queued); its result.
    pub async fn notify(
        self: &Arc<Self>,
        n: proto::BufferNotice,
    ) -> Result<proto::BufferNoticeResult, Failure> {
        let (tx, rx) = oneshot::channel();
        let lead = {
            let mut q = self.q.lock().unwrap();
            q.waiting.push((n, tx));
            !std::mem::replace(&mut q.busy, true)
        };
        if lead {
            // Its own task: an operation that goes away does not strand
            // the others' notices.
            tokio::spawn(self.clone().send_queued());
        }
        rx.await.unwrap_or_else(|_| {
            Err(Failure::new(
                Reason::Retryable,
                "the session's notices were dropped",
            ))
        })
    }

    /// Send what is queued, call after call, until the queue is empty.
    async fn send_queued(self: Arc<Self>) {
        loop {
            let batch: Vec<(proto::BufferNotice, Reply)> = {
                let mut q = self.q.lock().unwrap();
                if q.waiting.is_empty() {
                    q.busy = false;
                    return;
                }
                let n = q.waiting.len().min(MAX_NOTICES);
                q.waiting.drain(..n).collect()
            };
            let (ops, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
            let sent = ops.len();
            let r = self
                .call(proto::BufferNotifyRequest {
                    session_id: self.session_id,
                    ops,
                    node: String::new(),
                })
                .await;
            match r.and_then(|resp| standing::results_of(resp, sent, &self.peer)) {
                Ok(results) => {
                    for (tx, res) in replies.into_iter().zip(results) {
                        let _ = tx.send(Ok(res));
                    }
                }
                Err(e) => fail_all(replies, e),
            }
        }
    }

    /// One call: a frame where it may go as one, else gRPC.
    async fn call(
        &self,
        req: proto::BufferNotifyRequest,
    ) -> Result<proto::BufferNotifyResponse, Failure> {
        if let Some(f) = &self.frames {
            if let Some(payload) = f.encode(&req) {
                return f.call(&payload, &self.peer).await;
            }
        }
        if let Some(v) = &self.verbs {
            if let Some(r) = v.call(&req, &self.peer).await {
                return r;
            }
        }
        self.client.buffer_notify(req).await.map_err(|s| {
            Failure::new(
                status_reason(&s),
                format!("peer {}: {}", self.peer, s.message()),
            )
        })
    }
}

fn fail_all(replies: Vec<Reply>, e: Failure) {
    for tx in replies {
        let _ = tx.send(Err(e.clone()));
    }
}
