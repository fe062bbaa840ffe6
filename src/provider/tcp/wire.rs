//! The wire format: fixed little-endian headers, payloads follow raw.
//!
//! Request (32 bytes), initiator -> target, then `len` payload bytes for a
//! WRITE:
//! ```text
//!  0..4   magic "RCPT"        4  version (1)     5  op (1 WRITE, 2 READ, 3 MESSAGE)
//!  6      flags (bit 0 prompt)  7  reserved (0)
//!  8..16  tag (the channel's post sequence number)
//! 16..24  remote addr        24..28  rkey      28..32  len
//! ```
//! Response (24 bytes), target -> initiator, in request order per connection,
//! then `len` payload bytes for a successful READ or MESSAGE:
//! ```text
//!  0..4   magic "RCPR"        4  status (0 ok, 1 remote access error,
//!                                        2 no messages taken)
//!  5..8   reserved (0)        8..16  tag (echoed)   16..20 len   20..24 reserved
//! ```
//! A prompt request is one the initiator waits on (a signaled work request,
//! a MESSAGE): the target sends its answer, with every one before it,
//! before it would wait on the socket for the next request. The answers of
//! other requests may wait for a prompt one or for a pause in the stream
//! (fewer sends and fewer wake-ups on the initiator). A target that ignores
//! the flag (before it existed) answers at pauses only.
//! A MESSAGE (a SEND, two-sided) carries `len` bytes for whoever takes the
//! messages of the connection's session (addr and rkey 0); its response
//! carries the answer (`TcpDomain::take_messages`). A target with no one
//! taking them answers status 2 and goes on serving the connection.
//! Hello (32 bytes), optional, initiator -> target, only as the first bytes of
//! a connection: binds it to the session whose key it carries (the target then
//! honours only that session's rkeys on it):
//! ```text
//!  0..4   magic "RCPH"        4  version (1)     5..8  reserved (0)
//!  8..24  session key        24..32  reserved (0)
//! ```

/// Largest payload of one request; anything larger is garbage.
pub const MAX_LEN: u32 = 64 << 20;

/// Largest MESSAGE payload or answer.
pub const MAX_MESSAGE: u32 = 16 << 20;

pub const REQ_MAGIC: [u8; 4] = *b"RCPT";
pub const RESP_MAGIC: [u8; 4] = *b"RCPR";
pub const HELLO_MAGIC: [u8; 4] = *b"RCPH";
/// Length of a session key (a [`Hello`]'s payload).
pub const KEY_LEN: usize = 16;
pub const VERSION: u8 = 1;
pub const REQ_LEN: usize = 32;
pub const RESP_LEN: usize = 24;

/// A malformed header: the stream cannot be trusted any further.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    #[error("unsupported protocol version {0}")]
    BadVersion(u8),
    #[error("unknown op {0}")]
    UnknownOp(u8),
    #[error("unknown response status {0}")]
    UnknownStatus(u8),
    #[error("length {0} exceeds the {MAX_LEN}-byte limit")]
    TooLong(u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Write = 1,
    Read = 2,
    /// Two-sided: `len` bytes for the session's [`Messages`](super::Messages),
    /// answered with theirs.
    Message = 3,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub op: Op,
    pub tag: u64,
    pub addr: u64,
    pub rkey: u32,
    pub len: u32,
    /// The initiator waits on the answer (see the module's docs).
    pub prompt: bool,
}

/// Bit of a request's flags byte: [`Request::prompt`].
const PROMPT: u8 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok = 0,
    RemoteAccess = 1,
    /// A MESSAGE that nothing takes on this connection's session.
    NoMessages = 2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Response {
    pub status: Status,
    pub tag: u64,
    pub len: u32,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

impl Request {
    pub fn encode(&self) -> [u8; REQ_LEN] {
        let mut b = [0u8; REQ_LEN];
        b[0..4].copy_from_slice(&REQ_MAGIC);
        b[4] = VERSION;
        b[5] = self.op as u8;
        b[6] = if self.prompt { PROMPT } else { 0 };
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..28].copy_from_slice(&self.rkey.to_le_bytes());
        b[28..32].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; REQ_LEN]) -> Result<Request, WireError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != REQ_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        if b[4] != VERSION {
            return Err(WireError::BadVersion(b[4]));
        }
        let op = match b[5] {
            1 => Op::Write,
            2 => Op::Read,
            3 => Op::Message,
            o => return Err(WireError::UnknownOp(o)),
        };
        let len = u32_at(b, 28);
        if len > MAX_LEN {
            return Err(WireError::TooLong(len));
        }
        Ok(Request {
            op,
            tag: u64_at(b, 8),
            addr: u64_at(b, 16),
            rkey: u32_at(b, 24),
            len,
            prompt: b[6] & PROMPT != 0,
        })
    }
}

/// The first header of a connection that belongs to a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub key: [u8; KEY_LEN],
}

impl Hello {
    pub fn encode(&self) -> [u8; REQ_LEN] {
        let mut b = [0u8; REQ_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC);
        b[4] = VERSION;
        b[8..24].copy_from_slice(&self.key);
        b
    }

    /// `None` if `b` is not a hello (it may then be a request).
    pub fn decode(b: &[u8; REQ_LEN]) -> Option<Result<Hello, WireError>> {
        if b[0..4] != HELLO_MAGIC {
            return None;
        }
        if b[4] != VERSION {
            return Some(Err(WireError::BadVersion(b[4])));
        }
        let mut key = [0u8; KEY_LEN];
        key.copy_from_slice(&b[8..24]);
        Some(Ok(Hello { key }))
    }
}

impl Response {
    pub fn encode(&self) -> [u8; RESP_LEN] {
        let mut b = [0u8; RESP_LEN];
        b[0..4].copy_from_slice(&RESP_MAGIC);
        b[4] = self.status as u8;
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..20].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; RESP_LEN]) -> Result<Response, WireError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != RESP_MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let status = match b[4] {
            0 => Status::Ok,
            1 => Status::RemoteAccess,
            2 => Status::NoMessages,
            s => return Err(WireError::UnknownStatus(s)),
        };
        let len = u32_at(b, 16);
        if len > MAX_LEN {
            return Err(WireError::TooLong(len));
        }
        Ok(Response {
            status,
            tag: u64_at(b, 8),
            len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_and_rejects_garbage() {
        let r = Request {
            op: Op::Read,
            tag: 0x0102_0304_0506_0708,
            addr: 0xdead_beef_0000,
            rkey: 0x1234_5678,
            len: 4096,
            prompt: true,
        };
        assert_eq!(Request::decode(&r.encode()), Ok(r));
        let mut b = r.encode();
        b[0] = b'X';
        assert!(matches!(Request::decode(&b), Err(WireError::BadMagic(_))));
        let mut b = r.encode();
        b[4] = 9;
        assert_eq!(Request::decode(&b), Err(WireError::BadVersion(9)));
        let mut b = r.encode();
        b[5] = 7;
        assert_eq!(Request::decode(&b), Err(WireError::UnknownOp(7)));
        let m = Request {
            op: Op::Message,
            tag: 5,
            addr: 0,
            rkey: 0,
            len: 300,
            prompt: false,
        };
        assert_eq!(Request::decode(&m.encode()), Ok(m));
        let mut b = r.encode();
        b[28..32].copy_from_slice(&(MAX_LEN + 1).to_le_bytes());
        assert_eq!(Request::decode(&b), Err(WireError::TooLong(MAX_LEN + 1)));
    }

    #[test]
    fn hello_round_trips_and_is_not_a_request() {
        let h = Hello { key: [7; KEY_LEN] };
        let b = h.encode();
        assert_eq!(Hello::decode(&b), Some(Ok(h)));
        assert!(matches!(Request::decode(&b), Err(WireError::BadMagic(_))));
        let r = Request {
            op: Op::Write,
            tag: 1,
            addr: 2,
            rkey: 3,
            len: 4,
            prompt: false,
        };
        assert_eq!(Hello::decode(&r.encode()), None);
    }

    #[test]
    fn response_round_trips() {
        let r = Response {
            status: Status::RemoteAccess,
            tag: 42,
            len: 0,
        };
        assert_eq!(Response::decode(&r.encode()), Ok(r));
        let mut b = r.encode();
        b[4] = 3;
        assert_eq!(Response::decode(&b), Err(WireError::UnknownStatus(3)));
        b[4] = 2;
        assert_eq!(
            Response::decode(&b).map(|r| r.status),
            Ok(Status::NoMessages)
        );
    }
}
