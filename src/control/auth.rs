//! Bearer-token authentication of gRPC requests.

use std::sync::Arc;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::{Request, Status};

use crate::metrics::Metrics;

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
/// token is configured. Each refusal is counted once
/// (`rcpd_auth_failures_total`).
#[derive(Clone)]
pub struct CheckBearer {
    token: Option<Arc<Vec<u8>>>,
    metrics: Arc<Metrics>,
}

impl CheckBearer {
    pub fn new(token: Option<String>, metrics: Arc<Metrics>) -> Self {
        CheckBearer {
            token: token.map(|t| Arc::new(t.into_bytes())),
            metrics,
        }
    }
}

impl Interceptor for CheckBearer {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(want) = &self.token else {
            return Ok(req);
        };
        let fail = |m: &str| {
            self.metrics.auth_failure();
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
    use super::*;

    fn refusals(m: &Metrics) -> String {
        m.render()
            .lines()
            .find(|l| l.starts_with("rcpd_auth_failures_total "))
            .unwrap_or_default()
            .to_string()
    }

    /// Each refused request is counted once, an accepted one not at all.
    #[test]
    fn each_refusal_counted_once() {
        let m = Arc::new(Metrics::new());
        let mut c = CheckBearer::new(Some("tok".into()), m.clone());
        let with = |v: Option<&str>| {
            let mut r = Request::new(());
            if let Some(v) = v {
                r.metadata_mut().insert("authorization", v.parse().unwrap());
            }
            r
        };
        assert_eq!(refusals(&m), "rcpd_auth_failures_total 0");
        assert!(c.call(with(Some("Bearer nope"))).is_err());
        assert_eq!(refusals(&m), "rcpd_auth_failures_total 1");
        assert!(c.call(with(None)).is_err());
        assert!(c.call(with(Some("Basic tok"))).is_err());
        assert_eq!(refusals(&m), "rcpd_auth_failures_total 3");
        assert!(c.call(with(Some("Bearer tok"))).is_ok());
        // Rendering again counts nothing.
        assert_eq!(refusals(&m), "rcpd_auth_failures_total 3");
        // Without a token nothing is refused or counted.
        let mut open = CheckBearer::new(None, m.clone());
        assert!(open.call(with(None)).is_ok());
        assert_eq!(refusals(&m), "rcpd_auth_failures_total 3");
    }

    #[test]
    fn ct_eq() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"", b"a"));
        assert!(constant_time_eq(b"", b""));
    }
}
