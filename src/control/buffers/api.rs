//! The service protocol's messages (docs/buffers.md) as types: what a
//! service sends ([`Request`]), what rcpd answers ([`HelloReply`],
//! [`Registered`], [`Started`], [`OpStatus`], [`ErrorBody`]) and the
//! events it sends ([`Event`]). rcpd parses requests into them and builds
//! its replies and events from them; the Rust client
//! ([`super::client::ServiceClient`]) sends and reads the same types; the
//! Python package speaks the JSON they define and is tested against rcpd.
//! One source for the schema, and one table of reason names
//! ([`ServiceReason`]).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::control::error::Reason;
use crate::control::protocol::Failure;

/// The protocol version `hello` speaks.
pub const VERSION: u64 = 1;

/// A reason as services see it: rcp's reasons, in lower case, with the
/// ones a service cannot act on apart folded together. The one table both
/// ways.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServiceReason {
    Invalid,
    NotFound,
    Integrity,
    Unauthenticated,
    Permission,
    Exceeded,
    Retryable,
    /// A peer rcpd sent a message outside the protocol.
    Protocol,
    /// Anything else (and any name this side does not know).
    #[serde(other)]
    Other,
}

impl ServiceReason {
    /// rcp's `reason` as a service sees it.
    pub fn of(reason: Reason) -> ServiceReason {
        match reason {
            Reason::Usage | Reason::Invalid | Reason::PathRefused | Reason::Version => {
                ServiceReason::Invalid
            }
            Reason::DirNotFound | Reason::FileNotFound => ServiceReason::NotFound,
            Reason::Integrity => ServiceReason::Integrity,
            Reason::Unauthenticated => ServiceReason::Unauthenticated,
            Reason::Permission => ServiceReason::Permission,
            Reason::Exceeded => ServiceReason::Exceeded,
            Reason::Retryable => ServiceReason::Retryable,
            Reason::Protocol => ServiceReason::Protocol,
            Reason::Interrupted
            | Reason::FanoutIncomplete
            | Reason::Other
            | Reason::Unspecified => ServiceReason::Other,
        }
    }

    /// The rcp reason a service's error stands for (its exit code's).
    pub fn reason(self) -> Reason {
        match self {
            ServiceReason::Invalid => Reason::Invalid,
            ServiceReason::NotFound => Reason::FileNotFound,
            ServiceReason::Integrity => Reason::Integrity,
            ServiceReason::Unauthenticated => Reason::Unauthenticated,
            ServiceReason::Permission => Reason::Permission,
            ServiceReason::Exceeded => Reason::Exceeded,
            ServiceReason::Retryable => Reason::Retryable,
            ServiceReason::Protocol => Reason::Protocol,
            ServiceReason::Other => Reason::Other,
        }
    }

    /// Its name on the wire.
    pub fn name(self) -> &'static str {
        match self {
            ServiceReason::Invalid => "invalid",
            ServiceReason::NotFound => "not_found",
            ServiceReason::Integrity => "integrity",
            ServiceReason::Unauthenticated => "unauthenticated",
            ServiceReason::Permission => "permission",
            ServiceReason::Exceeded => "exceeded",
            ServiceReason::Retryable => "retryable",
            ServiceReason::Protocol => "protocol",
            ServiceReason::Other => "other",
        }
    }
}

/// An error reply's `error`, an operation's `failure`, an event's `error`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub reason: ServiceReason,
    #[serde(default)]
    pub message: String,
}

impl From<&Failure> for ErrorBody {
    fn from(f: &Failure) -> ErrorBody {
        ErrorBody {
            reason: ServiceReason::of(f.reason),
            message: f.message.clone(),
        }
    }
}

impl From<ErrorBody> for Failure {
    fn from(e: ErrorBody) -> Failure {
        Failure::new(e.reason.reason(), e.message)
    }
}

/// A request (`{"id": N, "op": ..., ...}`; the id is the frame's, not
/// part of the request).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Hello(Hello),
    /// The memfd rides on the frame as SCM_RIGHTS.
    Register {
        size: u64,
    },
    Release {
        buffer: u64,
    },
    Expose(Expose),
    Unexpose {
        name: String,
    },
    Write(OpRequest),
    Read(OpRequest),
    /// Several writes in one request: each checked before any starts (one
    /// that cannot start fails the request, naming it, and none starts);
    /// a handle each, in their order.
    WriteMany(ManyOps),
    /// [`Request::WriteMany`] of reads.
    ReadMany(ManyOps),
    /// Wait for each of `handles` (within one `timeout_ms` for all): a
    /// status each, in their order.
    WaitAll(WaitAll),
    Wait(Wait),
    Status {
        handle: u64,
    },
    Cancel {
        handle: u64,
    },
}

/// `write_many` / `read_many`: the operations, each as `write` / `read`
/// takes it (`ops`), or one `write` / `read` whose descriptors are each an
/// operation of their own (`each`: one buffer, peer, exposure, message and
/// check for all, a prepared list of descriptors as NIXL's). With `wait`,
/// the reply comes once every one has ended (or `timeout_ms`, one bound
/// for all), with their `statuses` as `wait_all` gives them: a batch in
/// one request instead of two.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManyOps {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ops: Vec<OpRequest>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub each: Option<OpRequest>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub wait: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

impl ManyOps {
    /// The operations, at most `max` (`each` as one per descriptor).
    pub fn into_ops(self, max: usize) -> Result<Vec<OpRequest>, String> {
        let n = self.ops.len() + self.each.as_ref().map_or(0, |e| e.descs.len());
        if n > max {
            return Err(format!("{n} operations in one request (at most {max})"));
        }
        match self.each {
            None => Ok(self.ops),
            Some(_) if !self.ops.is_empty() => Err("give ops or each, not both".into()),
            Some(e) => Ok(e
                .descs
                .iter()
                .map(|d| OpRequest {
                    buffer: e.buffer,
                    peer: e.peer.clone(),
                    name: e.name.clone(),
                    descs: vec![*d],
                    message: e.message.clone(),
                    check: e.check.clone(),
                })
                .collect()),
        }
    }
}

/// `wait_all`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaitAll {
    pub handles: Vec<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// `wait`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wait {
    pub handle: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
}

/// A frame as rcpd reads it: the `id` its reply carries back, its `op`
/// (`""` when it names none), and its request, or why it is not one.
pub struct Frame {
    pub id: Value,
    pub op: String,
    pub request: Result<Request, serde_json::Error>,
}

impl Frame {
    /// Parse a frame's bytes; an error only when they are not JSON. The
    /// requests a busy service sends (its operations and waits) are parsed
    /// straight into their variant's type: serde reads an enum tagged
    /// inside the object by first copying the whole frame into a tree of
    /// its own, which cost the writer's rcpd a sixth of its time under
    /// 64 operations in flight (docs/benchmarks.md).
    pub fn parse(b: &[u8]) -> serde_json::Result<Frame> {
        #[derive(Deserialize)]
        struct Head {
            #[serde(default)]
            id: Value,
            #[serde(default)]
            op: Value,
        }
        let object = b.iter().find(|c| !c.is_ascii_whitespace()) == Some(&b'{');
        let head = object
            .then(|| serde_json::from_slice::<Head>(b).ok())
            .flatten();
        let Some(head) = head else {
            // Not an object of that shape (an array, a repeated key): as
            // a tree, if it is JSON at all.
            let v: Value = serde_json::from_slice(b)?;
            let id = v.get("id").cloned().unwrap_or(Value::Null);
            let op = v
                .get("op")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            let request = serde_json::from_value(v);
            return Ok(Frame { id, op, request });
        };
        let op = head.op.as_str().unwrap_or("").to_string();
        let request = match op.as_str() {
            "write" => serde_json::from_slice(b).map(Request::Write),
            "read" => serde_json::from_slice(b).map(Request::Read),
            "write_many" => serde_json::from_slice(b).map(Request::WriteMany),
            "read_many" => serde_json::from_slice(b).map(Request::ReadMany),
            "wait_all" => serde_json::from_slice(b).map(Request::WaitAll),
            "wait" => serde_json::from_slice(b).map(Request::Wait),
            _ => serde_json::from_slice(b),
        };
        Ok(Frame {
            id: head.id,
            op,
            request,
        })
    }
}

impl Request {
    /// Requests that may wait run on their own; the rest are answered in
    /// order.
    pub fn may_wait(op: &str) -> bool {
        matches!(
            op,
            "wait"
                | "cancel"
                | "release"
                | "write"
                | "read"
                | "write_many"
                | "read_many"
                | "wait_all"
        )
    }
}

fn version_1() -> u64 {
    VERSION
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    #[serde(default = "version_1")]
    pub version: u64,
    /// rcpd's bearer token, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// For logs.
    #[serde(default)]
    pub name: String,
    /// Whether this connection hears a `done` event for each operation it
    /// starts (default: yes). A service that learns how its operations
    /// ended from `wait` / `wait_all` says no, and rcpd sends none.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub done_events: bool,
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

fn rw() -> String {
    "rw".into()
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Expose {
    pub buffer: u64,
    pub name: String,
    #[serde(default)]
    pub offset: u64,
    /// Default: to the buffer's end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub len: Option<u64>,
    /// `len` as the Python package's `expose(length=)` names it; not both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length: Option<u64>,
    /// `read`, `write` or `rw`.
    #[serde(default = "rw")]
    pub access: String,
    /// IP addresses of the peer rcpds allowed (empty: any).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<String>,
    /// `per-op` (default): a grant per operation; `standing`: a peer's
    /// session is granted the whole exposure once, until it is withdrawn
    /// (docs/buffers.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant: Option<String>,
}

/// A `write` or a `read`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpRequest {
    pub buffer: u64,
    /// `HOST:PORT` of the other rcpd.
    pub peer: String,
    /// The exposure there.
    pub name: String,
    pub descs: Vec<Desc>,
    /// Delivered with the owner's event (at most 256 bytes).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// `blake3`, `sha256`, `xxh3` or `none`; absent: rcpd's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check: Option<String>,
}

/// One range of an operation, `[local_off, remote_off, len]` on the wire:
/// `local` in the service's own buffer, `remote` in the owner's whole
/// buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "[u64; 3]", into = "[u64; 3]")]
pub struct Desc {
    pub local: u64,
    pub remote: u64,
    pub len: u64,
}

impl From<[u64; 3]> for Desc {
    fn from([local, remote, len]: [u64; 3]) -> Desc {
        Desc { local, remote, len }
    }
}

impl From<Desc> for [u64; 3] {
    fn from(d: Desc) -> [u64; 3] {
        [d.local, d.remote, d.len]
    }
}

/// `hello`'s reply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloReply {
    pub session: u64,
    pub version: u64,
    /// The address peers dial this rcpd at (`HOST:PORT`).
    pub node: String,
    /// The default check.
    pub check: String,
}

/// `register`'s reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registered {
    pub buffer: u64,
}

/// `write`'s and `read`'s reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Started {
    pub handle: u64,
}

/// `write_many`'s and `read_many`'s reply (`statuses` with `wait`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartedMany {
    pub handles: Vec<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub statuses: Option<Vec<OpStatus>>,
}

/// `wait_all`'s reply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Statuses {
    pub statuses: Vec<OpStatus>,
}

/// Where an operation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpStateName {
    Running,
    Done,
    Failed,
    Cancelled,
}

/// `wait`'s, `status`'s and `cancel`'s reply, and the `done` event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpStatus {
    pub handle: u64,
    pub state: OpStateName,
    /// Bytes moved, when done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// `verbs` or `tcp`: the provider its bytes moved over, when done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<std::borrow::Cow<'static, str>>,
    /// Why it moved over tcp, when RDMA gave up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fell_back: Option<String>,
    /// When failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<ErrorBody>,
}

/// An event (`{"event": ..., ...}`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// To the owner of an exposure a peer wrote, once, after the bytes
    /// were verified.
    Written(OwnerEvent),
    /// To the owner of an exposure a peer read, once, after the reader
    /// verified them.
    Read(OwnerEvent),
    /// To the service that started the operation.
    Done(OpStatus),
}

/// What the owner of an exposure hears of a peer's operation on it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnerEvent {
    pub name: String,
    /// The peer rcpd, `HOST:PORT` as it is dialed.
    pub peer: String,
    /// `[offset, len, digest hex]` in the owner's buffer.
    pub ranges: Vec<(u64, u64, String)>,
    pub message: String,
    pub check: String,
    /// Ranges granted again because they did not match, over all rounds.
    pub resent: u32,
    /// When a range still did not match after the retries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `each`: one operation per descriptor, everything else shared; not
    /// with `ops`; the bound counts the operations either way.
    #[test]
    fn each_is_an_operation_per_descriptor() {
        let m = |v: Value| serde_json::from_value::<ManyOps>(v).unwrap();
        let each = json!({"buffer": 2, "peer": "b:1", "name": "kv", "descs": [[0, 8, 4], [4, 0, 4]], "check": "none"});
        let ops = m(json!({ "each": each })).into_ops(2).unwrap();
        assert_eq!(ops.len(), 2);
        assert_eq!(
            ops[1].descs,
            vec![Desc {
                local: 4,
                remote: 0,
                len: 4
            }]
        );
        assert_eq!(
            (ops[1].buffer, ops[1].name.as_str(), ops[1].check.as_deref()),
            (2, "kv", Some("none"))
        );
        let e = m(json!({ "each": each })).into_ops(1).unwrap_err();
        assert!(e.contains("2 operations in one request (at most 1)"), "{e}");
        let both = json!({"each": each, "ops": [each]});
        assert!(m(both).into_ops(10).unwrap_err().contains("not both"));
        assert!(m(json!({})).into_ops(10).unwrap().is_empty());
    }

    /// The frames docs/buffers.md shows and the Python package sends
    /// parse as the types; what the types write reads back the same.
    #[test]
    fn documented_frames_parse_and_round_trip() {
        let frames = [
            json!({"id": 1, "op": "hello", "version": 1, "token": "t", "name": "py"}),
            json!({"id": 1, "op": "hello", "version": 1, "name": "quiet", "done_events": false}),
            json!({"id": 2, "op": "register", "size": 4194304}),
            json!({"id": 3, "op": "expose", "buffer": 1, "name": "kv0", "offset": 0, "length": 4096, "access": "read", "peers": ["10.0.0.2"]}),
            json!({"id": 4, "op": "write", "buffer": 1, "peer": "b:7471", "name": "kv0", "descs": [[0, 4096, 4096]], "message": "hi"}),
            json!({"id": 5, "op": "write_many", "ops": [{"buffer": 1, "peer": "b:7471", "name": "kv0", "descs": [[0, 0, 4096]]}, {"buffer": 1, "peer": "b:7471", "name": "kv0", "descs": [[4096, 4096, 4096]], "check": "xxh3"}]}),
            json!({"id": 6, "op": "read_many", "ops": [{"buffer": 1, "peer": "b:7471", "name": "kv0", "descs": [[0, 0, 4096]]}]}),
            json!({"id": 6, "op": "write_many", "each": {"buffer": 1, "peer": "b:7471", "name": "kv0", "descs": [[0, 0, 4096], [4096, 8192, 4096]], "message": "m"}}),
            json!({"id": 7, "op": "wait_all", "handles": [1, 2], "timeout_ms": 1000}),
            json!({"id": 5, "op": "read", "buffer": 1, "peer": "b:7471", "name": "kv0", "descs": [[0, 0, 8192], [8192, 8192, 4096]], "check": "xxh3"}),
            json!({"id": 6, "op": "wait", "handle": 3, "timeout_ms": 10}),
            json!({"id": 7, "op": "unexpose", "name": "kv0"}),
            json!({"id": 8, "op": "release", "buffer": 1}),
            json!({"id": 9, "op": "status", "handle": 3}),
            json!({"id": 10, "op": "cancel", "handle": 3}),
        ];
        for f in frames {
            let r: Request =
                serde_json::from_value(f.clone()).unwrap_or_else(|e| panic!("{f}: {e}"));
            let back: Request = serde_json::from_value(serde_json::to_value(&r).unwrap()).unwrap();
            assert_eq!(back, r, "{f}");
            // rcpd's parse of the frame's bytes: the same request, its id
            // and op.
            let p = Frame::parse(f.to_string().as_bytes()).unwrap();
            assert_eq!(p.request.unwrap(), r, "{f}");
            assert_eq!(p.id, f["id"], "{f}");
            assert_eq!(p.op, f["op"].as_str().unwrap(), "{f}");
        }
        let r: Request = serde_json::from_value(
            json!({"op": "read", "buffer": 1, "peer": "p", "name": "n", "descs": [[1, 2, 3]]}),
        )
        .unwrap();
        let Request::Read(o) = r else { panic!("{r:?}") };
        assert_eq!(
            o.descs,
            [Desc {
                local: 1,
                remote: 2,
                len: 3
            }]
        );
        assert_eq!(serde_json::to_value(o.descs[0]).unwrap(), json!([1, 2, 3]));
    }

    /// Frames outside the schema as rcpd parses them: JSON that is no
    /// request is answered (its id kept where it has one), bytes that are
    /// not JSON are not.
    #[test]
    fn frames_outside_the_schema() {
        let p = |s: &str| Frame::parse(s.as_bytes());
        let f = p(r#"{"id": 4, "op": "write_many", "ops": [{"buffer": 1}]}"#).unwrap();
        assert_eq!((f.id, f.op.as_str()), (json!(4), "write_many"));
        assert!(f
            .request
            .unwrap_err()
            .to_string()
            .contains("missing field `peer`"));
        let f = p(r#"{"id": 5, "op": "wait", "handle": -1}"#).unwrap();
        assert!(f.request.unwrap_err().to_string().contains("invalid value"));
        let f = p(r#"{"id": 6}"#).unwrap();
        assert_eq!((f.id, f.op.as_str()), (json!(6), ""));
        assert!(f.request.is_err());
        // Not an object of the frame's shape: parsed as a tree, refused.
        let f = p(r#"{"id": 7, "id": 8, "op": "status", "handle": 1}"#).unwrap();
        assert_eq!((f.id, f.op.as_str()), (json!(8), "status"));
        let f = p("[1, 2]").unwrap();
        assert_eq!((f.id, f.op.as_str()), (Value::Null, ""));
        assert!(f.request.is_err());
        assert!(p("{\"id\": 1, \"op\"").is_err());
        assert!(p("not json").is_err());
    }

    /// A request outside the schema is refused, naming what is wrong.
    #[test]
    fn malformed_requests_name_the_field() {
        let e = |v| {
            serde_json::from_value::<Request>(v)
                .unwrap_err()
                .to_string()
        };
        assert!(e(json!({"op": "frob"})).contains("unknown variant `frob`"));
        assert!(e(json!({"op": "expose", "buffer": 1})).contains("missing field `name`"));
        assert!(e(
            json!({"op": "write", "buffer": 1, "peer": "p", "name": "n", "descs": [[1, 2]]})
        )
        .contains("array of length 3"));
        assert!(e(json!({"op": "wait", "handle": -1})).contains("invalid value"));
    }

    /// Every reason name goes both ways; `protocol` is kept (it was once
    /// read back as `other`) and an unknown name is `other`.
    #[test]
    fn reason_names_go_both_ways() {
        for r in [
            ServiceReason::Invalid,
            ServiceReason::NotFound,
            ServiceReason::Integrity,
            ServiceReason::Unauthenticated,
            ServiceReason::Permission,
            ServiceReason::Exceeded,
            ServiceReason::Retryable,
            ServiceReason::Protocol,
            ServiceReason::Other,
        ] {
            assert_eq!(ServiceReason::of(r.reason()), r);
            assert_eq!(serde_json::to_value(r).unwrap(), json!(r.name()));
            assert_eq!(
                serde_json::from_value::<ServiceReason>(json!(r.name())).unwrap(),
                r
            );
        }
        assert_eq!(
            serde_json::from_value::<ServiceReason>(json!("new_one")).unwrap(),
            ServiceReason::Other
        );
    }

    /// Events and statuses as docs/buffers.md shows them.
    #[test]
    fn events_have_the_documented_shape() {
        let ev = Event::Written(OwnerEvent {
            name: "kv0".into(),
            peer: "a:7471".into(),
            ranges: vec![(4096, 4096, "ab".into())],
            message: String::new(),
            check: "blake3".into(),
            resent: 0,
            error: None,
        });
        assert_eq!(
            serde_json::to_value(&ev).unwrap(),
            json!({"event": "written", "name": "kv0", "peer": "a:7471", "ranges": [[4096, 4096, "ab"]], "message": "", "check": "blake3", "resent": 0})
        );
        let done = Event::Done(OpStatus {
            handle: 2,
            state: OpStateName::Failed,
            bytes: None,
            transport: None,
            fell_back: None,
            failure: Some(ErrorBody {
                reason: ServiceReason::Retryable,
                message: "m".into(),
            }),
        });
        assert_eq!(
            serde_json::to_value(&done).unwrap(),
            json!({"event": "done", "handle": 2, "state": "failed", "failure": {"reason": "retryable", "message": "m"}})
        );
    }
}
