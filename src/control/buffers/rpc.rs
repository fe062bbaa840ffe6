//! The buffers' side of rcpd's `BufferGrant`, `BufferDone` and
//! `BufferNotify`, plugged into the gRPC service by the daemon as its
//! [`BufferGrants`] (the way `control::copy` serves `Copy`): a grant per
//! operation ([`super::grant`]) or, for an exposure that stands and a peer
//! that takes it, the session's standing grant ([`super::standing`]).

use std::net::IpAddr;
use std::sync::Arc;

use prost::Message;

use super::{grant, standing, Buffers, Failure};
use crate::control::error::Reason;
use crate::control::server::conns::ConnKey;
use crate::control::server::{BufferGrants, SessionState};
use crate::proto;
use crate::provider::tcp::Answer;

pub struct GrantService(pub Arc<Buffers>);

impl BufferGrants for GrantService {
    fn grant(
        &self,
        session: &SessionState,
        session_id: u64,
        req: proto::BufferGrantRequest,
        peer: Option<IpAddr>,
        conn: Option<ConnKey>,
    ) -> Result<proto::BufferGrantResponse, tonic::Status> {
        let (write, exp) = grant::admit(&self.0, &req, peer)?;
        if req.standing_ok && exp.standing {
            let peer = grant::event_peer(&req.node, peer);
            return Ok(standing::grant(
                &self.0, session, session_id, &req.name, exp, write, peer,
            )?);
        }
        Ok(grant::grant(
            &self.0,
            session,
            session_id,
            req,
            (peer, conn),
            (write, exp),
        )?)
    }

    fn done(
        &self,
        session: Option<&SessionState>,
        session_id: u64,
        req: proto::BufferDoneRequest,
    ) -> Result<proto::BufferDoneResponse, tonic::Status> {
        Ok(grant::done(&self.0, session, session_id, req)?)
    }

    fn notify(
        &self,
        session: Option<&SessionState>,
        session_id: u64,
        req: proto::BufferNotifyRequest,
    ) -> Result<proto::BufferNotifyResponse, tonic::Status> {
        let (resp, events) = standing::notify(&self.0, session, session_id, req, false)?;
        events.send();
        Ok(resp)
    }

    fn notify_frame(
        &self,
        session: Option<&SessionState>,
        session_id: u64,
        payload: &[u8],
    ) -> Answer {
        let answer = proto::BufferNotifyRequest::decode(payload)
            .map_err(|e| Failure::new(Reason::Protocol, format!("a malformed notice frame: {e}")))
            .and_then(|req| standing::notify(&self.0, session, session_id, req, true));
        let (frame, then) = match answer {
            Ok((r, events)) => (
                proto::BufferNotifyFrame {
                    response: Some(r),
                    ..Default::default()
                },
                events.after_answer(),
            ),
            Err(e) => (
                proto::BufferNotifyFrame {
                    response: None,
                    error: e.message,
                    reason: e.reason as i32,
                },
                None,
            ),
        };
        Answer {
            bytes: frame.encode_to_vec(),
            then,
        }
    }

    fn session_closed(&self, id: u64) {
        self.0.session_closed(id);
    }
}
