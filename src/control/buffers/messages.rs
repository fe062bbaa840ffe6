//! Notices over verbs (protocol 2.7): on a verbs session whose peer said
//! in a standing grant that it takes notices off gRPC
//! (`StandingGrant.frames`), the session gets a QP of its own for them
//! ([`crate::verbs::messages`]), opened with one `BufferMessages` call at
//! the first notice: each batch then goes as a `BufferNotifyRequest` in a
//! SEND and its `BufferNotifyFrame` comes back the same way, with no gRPC
//! call, HTTP/2 stream or task on the owner's side between its completion
//! queue and the check. Sent after the ranges completed, so ordered after
//! the data as the tcp frames are.
//!
//! Where the QP cannot be had (an rcpd before 2.7, a device that refuses
//! it) the session's notices stay gRPC calls; where it breaks or an
//! answer does not come within the client's timeout, the call fails
//! (retryable: its notices may or may not have been told, as when a tcp
//! frame's connection breaks) and the session's later notices go over
//! gRPC.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use prost::Message;

use super::Failure;
use crate::control::client::Client;
use crate::control::error::Reason;
use crate::control::link::connect_params;
use crate::proto;
use crate::provider::verbs::VerbsChannel;
use crate::verbs::messages::{MessageError, Messenger, MAX_MESSAGE};

enum State {
    /// Not opened yet.
    Closed,
    Open(Arc<Messenger>),
    /// Not to be had, or broke: gRPC from now on.
    Failed,
}

/// A verbs session's way for its notices.
pub struct VerbsNotices {
    /// The session's first rail: the message QP goes on its path.
    rail: Arc<VerbsChannel>,
    client: Client,
    session_id: u64,
    /// A standing grant of the peer's said it takes them.
    taken: AtomicBool,
    state: Mutex<State>,
}

impl VerbsNotices {
    pub fn new(rail: Arc<VerbsChannel>, client: Client, session_id: u64) -> VerbsNotices {
        VerbsNotices {
            rail,
            client,
            session_id,
            taken: AtomicBool::new(false),
            state: Mutex::new(State::Closed),
        }
    }

    /// The peer gave a standing grant that says `frames`.
    pub fn taken(&self) {
        self.taken.store(true, Ordering::Relaxed);
    }

    /// `req` on the session's message QP (opened now if it is not yet):
    /// its answer, or `None` when it goes as a gRPC call instead.
    pub async fn call(
        &self,
        req: &proto::BufferNotifyRequest,
        peer: &str,
    ) -> Option<Result<proto::BufferNotifyResponse, Failure>> {
        if !self.taken.load(Ordering::Relaxed) {
            return None;
        }
        let payload = req.encode_to_vec();
        if payload.len() > MAX_MESSAGE {
            return None;
        }
        let m = self.messenger(peer).await?;
        let timeout = self.client.options().timeout;
        let answer = match tokio::time::timeout(timeout, m.call(payload)).await {
            Ok(Ok(a)) => a,
            Ok(Err(_)) => Err(MessageError::Broken("the message QP's thread ended".into())),
            Err(_) => Err(MessageError::Broken(format!("no answer in {timeout:?}"))),
        };
        match answer {
            Ok(bytes) => Some(super::frames::frame_response(&bytes, peer)),
            // Not taken: nothing of it was told; gRPC tells it.
            Err(MessageError::Refused) => {
                self.give_up(peer, "it refused a notice");
                None
            }
            Err(e) => {
                self.give_up(peer, &e.to_string());
                Some(Err(Failure::new(
                    Reason::Retryable,
                    format!("peer {peer}: the notices' message QP: {e}"),
                )))
            }
        }
    }

    /// The open message QP, opened now if it was not; `None`: gRPC.
    async fn messenger(&self, peer: &str) -> Option<Arc<Messenger>> {
        match &*self.state.lock().unwrap() {
            State::Open(m) => return Some(m.clone()),
            State::Failed => return None,
            State::Closed => {}
        }
        // One call at a time per session (`Notices`): nothing else opens
        // it meanwhile.
        match self.open().await {
            Ok(m) => {
                let m = Arc::new(m);
                *self.state.lock().unwrap() = State::Open(m.clone());
                tracing::debug!(peer = %crate::escape::esc(peer), session = format_args!("{:#x}", self.session_id), "notices on a message QP");
                Some(m)
            }
            Err(e) => {
                self.give_up(peer, &e);
                None
            }
        }
    }

    async fn open(&self) -> Result<Messenger, String> {
        let prep = crate::blocking::in_place(|| self.rail.prepare_messages())
            .map_err(|e| e.to_string())?;
        let theirs = self
            .client
            .buffer_messages(self.session_id, &prep.endpoint())
            .await
            .map_err(|s| format!("BufferMessages: {}", s.message()))?;
        let o = self.client.options();
        let p = connect_params(1, 1, o.qp_retry);
        crate::blocking::in_place(|| {
            prep.connect(
                &theirs,
                &p,
                None,
                &format!("rcp-msg-{:x}", self.session_id & 0xffff),
            )
        })
        .map_err(|e| e.to_string())
    }

    /// From now on the session's notices go as gRPC calls.
    fn give_up(&self, peer: &str, why: &str) {
        let old = std::mem::replace(&mut *self.state.lock().unwrap(), State::Failed);
        tracing::info!(peer = %crate::escape::esc(peer), session = format_args!("{:#x}", self.session_id), why = %crate::escape::esc(why), "notices over gRPC: no message QP");
        // Its thread is stopped and joined: not on a runtime worker's time.
        crate::blocking::in_place(|| drop(old));
    }
}

impl Drop for VerbsNotices {
    fn drop(&mut self) {
        let state = std::mem::replace(self.state.get_mut().unwrap(), State::Failed);
        crate::blocking::in_place(|| drop(state));
    }
}
