//! Optional TLS (and mutual TLS) for the gRPC control plane.
//!
//! rcpd serves TLS on its gRPC port when given a certificate and key, and
//! requires client certificates signed by `client_ca` when one is set (mTLS).
//! The plaintext health and metrics ports are unchanged (kubelet probes and
//! Prometheus scrapes stay simple). The data plane is not encrypted: RDMA
//! WRITE/READ is not, and the TCP provider mirrors it; what the control plane
//! protects is who may open a session and obtain rkeys.

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use super::error::{ControlError, Result};

/// rcpd's side: `--tls-cert`, `--tls-key`, `--tls-client-ca`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Require client certificates signed by this CA (mTLS).
    pub client_ca: Option<PathBuf>,
}

/// The client's side: `--tls-ca`, `--tls-cert`, `--tls-key`, `--tls-domain`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientTls {
    /// CA that signed rcpd's certificate.
    pub ca: PathBuf,
    /// Client certificate and key (for an rcpd that requires mTLS).
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// Name to verify rcpd's certificate against (default: the host given).
    pub domain: Option<String>,
}

fn read(what: &str, p: &Path) -> Result<Vec<u8>> {
    let b = std::fs::read(p)
        .map_err(|e| ControlError::Usage(format!("reading the TLS {what} {}: {e}", p.display())))?;
    if !b.windows(10).any(|w| w == b"-----BEGIN") {
        return Err(ControlError::Usage(format!(
            "the TLS {what} {} is not PEM (no -----BEGIN line)",
            p.display()
        )));
    }
    Ok(b)
}

impl ServerTls {
    /// Both or neither of cert and key; a client CA needs them.
    pub fn from_flags(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        client_ca: Option<PathBuf>,
    ) -> Result<Option<ServerTls>> {
        match (cert, key, client_ca) {
            (None, None, None) => Ok(None),
            (Some(cert), Some(key), client_ca) => Ok(Some(ServerTls {
                cert,
                key,
                client_ca,
            })),
            (None, None, Some(_)) => Err(ControlError::Usage(
                "--tls-client-ca needs --tls-cert and --tls-key (mTLS runs over TLS)".into(),
            )),
            _ => Err(ControlError::Usage(
                "give both --tls-cert and --tls-key".into(),
            )),
        }
    }

    pub fn config(&self) -> Result<ServerTlsConfig> {
        let id = Identity::from_pem(read("certificate", &self.cert)?, read("key", &self.key)?);
        let mut c = ServerTlsConfig::new().identity(id);
        if let Some(ca) = &self.client_ca {
            c = c.client_ca_root(Certificate::from_pem(read("client CA", ca)?));
        }
        Ok(c)
    }

    /// The identity rcpd shows when it is the client (Copy API) of another
    /// rcpd, trusting `ca` (default: its own client CA).
    pub fn as_client(&self, ca: Option<PathBuf>) -> Option<ClientTls> {
        Some(ClientTls {
            ca: ca.or_else(|| self.client_ca.clone())?,
            cert: Some(self.cert.clone()),
            key: Some(self.key.clone()),
            domain: None,
        })
    }
}

impl ClientTls {
    pub fn config(&self, host: &str) -> Result<ClientTlsConfig> {
        let mut c = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read("CA", &self.ca)?))
            .domain_name(self.domain.clone().unwrap_or_else(|| {
                host.trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_string()
            }));
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                c = c.identity(Identity::from_pem(
                    read("certificate", cert)?,
                    read("key", key)?,
                ));
            }
            (None, None) => {}
            _ => {
                return Err(ControlError::Usage(
                    "give both --tls-cert and --tls-key (or neither)".into(),
                ))
            }
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_flags_must_pair() {
        assert_eq!(ServerTls::from_flags(None, None, None).unwrap(), None);
        let e = ServerTls::from_flags(Some("c".into()), None, None).unwrap_err();
        assert!(
            e.to_string().contains("both --tls-cert and --tls-key"),
            "{e}"
        );
        let e = ServerTls::from_flags(None, None, Some("ca".into())).unwrap_err();
        assert!(e.to_string().contains("--tls-client-ca needs"), "{e}");
        let t = ServerTls::from_flags(Some("c".into()), Some("k".into()), Some("ca".into()))
            .unwrap()
            .unwrap();
        assert_eq!(t.as_client(None).unwrap().ca, PathBuf::from("ca"));
    }

    #[test]
    fn unreadable_or_non_pem_files_are_named() {
        let d = tempfile::tempdir().unwrap();
        let junk = d.path().join("junk.pem");
        std::fs::write(&junk, b"not a certificate").unwrap();
        let t = ServerTls {
            cert: junk.clone(),
            key: junk.clone(),
            client_ca: None,
        };
        let e = t.config().unwrap_err().to_string();
        assert!(e.contains("junk.pem") && e.contains("not PEM"), "{e}");
        let t = ClientTls {
            ca: d.path().join("missing.pem"),
            cert: None,
            key: None,
            domain: None,
        };
        let e = t.config("h").unwrap_err().to_string();
        assert!(e.contains("missing.pem"), "{e}");
    }
}
