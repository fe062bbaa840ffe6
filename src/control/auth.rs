//! Bearer-token authentication of gRPC requests.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::{Request, Status};

use super::Stats;

/// Compare without an early exit on the first differing byte.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0xff);
        diff |= u64::from(x ^ y);
    }
    diff == 0
}

/// Server side: requests must carry `authorization: Bearer <token>` when a
/// token is configured.
#[derive(Clone)]
pub struct CheckBearer {
    token: Option<Arc<Vec<u8>>>,
    stats: Arc<Stats>,
}

impl CheckBearer {
    pub fn new(token: Option<String>, stats: Arc<Stats>) -> Self {
        CheckBearer {
            token: token.map(|t| Arc::new(t.into_bytes())),
            stats,
        }
    }
}

impl Interceptor for CheckBearer {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(want) = &self.token else {
            return Ok(req);
        };
        let fail = |m: &str| {
            self.stats.auth_failures.fetch_add(1, Relaxed);
            Err(Status::unauthenticated(m.to_string()))
        };
        let Some(v) = req.metadata().get("authorization") else {
            return fail("missing authorization metadata (set RCP_TOKEN)");
        };
        let got = v.as_bytes();
        let Some(tok) = got.strip_prefix(b"Bearer ") else {
            return fail("authorization metadata is not `Bearer <token>`");
        };
        if !constant_time_eq(tok, want) {
            return fail("invalid token");
        }
        Ok(req)
    }
}

/// Client side: adds the bearer token to every request.
#[derive(Clone, Default)]
pub struct AddBearer(Option<MetadataValue<Ascii>>);

impl AddBearer {
    pub fn new(token: Option<&str>) -> Result<Self, String> {
        match token {
            None | Some("") => Ok(AddBearer(None)),
            Some(t) => format!("Bearer {t}")
                .parse()
                .map(|v| AddBearer(Some(v)))
                .map_err(|_| "the token contains characters not allowed in metadata".into()),
        }
    }
}

impl Interceptor for AddBearer {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn ct_eq() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"", b"a"));
        assert!(constant_time_eq(b"", b""));
    }
}
