//! Trusted Copy peers (`rcpd --copy-peers`, `RCPD_COPY_PEERS`): the other
//! rcpds this rcpd may dial as a client, for the Copy API and for buffer
//! operations, handing them its own token and TLS client certificate.
//!
//! The list is typed once ([`PeerEntry`]: a host name, an address, each
//! with an optional port, or a CIDR network) and every dial goes through
//! [`CopyPeers::admit`]: the caller's `HOST[:PORT]` is resolved once, only
//! the addresses the list allows are kept ([`Admitted`]), and the
//! connection goes to exactly those ([`Client::connect_admitted`]), so a
//! name that resolves elsewhere the second time reaches nothing. A peer
//! off the list is refused with [`ControlError::Permission`] naming the
//! flag, before anything is sent to it.
//!
//! A name entry matches a remote given by that name (case-insensitive, a
//! trailing dot ignored), whatever it resolves to; an address or network
//! entry matches the addresses a remote is or resolves to. Without a port
//! an entry matches any port.
//!
//! With no list, rcpd dials only itself: its own gRPC address, or, when it
//! listens on every address (`0.0.0.0`, `[::]`), a loopback address of that
//! family at its port (a port no other process can hold while rcpd does).
//!
//! [`Client::connect_admitted`]: super::client::Client::connect_admitted

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::time::Duration;

use super::error::ControlError;
use super::DEFAULT_PORT;

/// The flag and variable, as every refusal names them.
pub const FLAG: &str = "--copy-peers (RCPD_COPY_PEERS)";

/// How long resolving a peer's name may take.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(10);

/// A CIDR network: an address whose host bits are zero, and the prefix
/// length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    base: IpAddr,
    prefix: u8,
}

fn bits(ip: IpAddr) -> (u128, u8) {
    match ip {
        IpAddr::V4(a) => (u128::from(u32::from(a)), 32),
        IpAddr::V6(a) => (u128::from(a), 128),
    }
}

/// The mask of the first `prefix` of `width` bits.
fn mask(prefix: u8, width: u8) -> u128 {
    if prefix == 0 {
        0
    } else {
        (u128::MAX << (128 - u32::from(prefix))) >> (128 - u32::from(width))
    }
}

impl Cidr {
    /// Whether `ip` (an IPv4-mapped IPv6 address as its IPv4 address) lies
    /// in the network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        if ip.is_ipv4() != self.base.is_ipv4() {
            return false;
        }
        let (b, width) = bits(self.base);
        let (a, _) = bits(ip);
        let m = mask(self.prefix, width);
        a & m == b & m
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.base, self.prefix)
    }
}

/// One entry of the list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerEntry {
    /// A host name (lower case, no trailing dot), on one port or any.
    Name { name: String, port: Option<u16> },
    /// An address, on one port or any.
    Addr { ip: IpAddr, port: Option<u16> },
    /// Every address of a network, any port.
    Net(Cidr),
}

/// An entry rcpd cannot use: which, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("--copy-peers entry {entry:?}: {why}")]
pub struct PeerEntryError {
    pub entry: String,
    pub why: String,
}

fn bad(entry: &str, why: impl Into<String>) -> PeerEntryError {
    PeerEntryError {
        entry: entry.to_string(),
        why: why.into(),
    }
}

/// A host name as DNS writes one: letters, digits, `-`, `_` and dots, at
/// most 253 characters, no empty label, no label starting with `-`.
fn valid_name(n: &str) -> bool {
    n.len() <= 253
        && n.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// A name as it is compared: lower case, without the root's dot.
fn name_key(n: &str) -> String {
    n.strip_suffix('.').unwrap_or(n).to_ascii_lowercase()
}

/// `[v6]` or `v4`/name as `host_port` returns it, as an address if it is one.
fn host_ip(host: &str) -> Option<IpAddr> {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    bare.parse::<IpAddr>().ok().map(|ip| ip.to_canonical())
}

impl FromStr for PeerEntry {
    type Err = PeerEntryError;

    fn from_str(s: &str) -> Result<PeerEntry, PeerEntryError> {
        let t = s.trim();
        if t.is_empty() {
            return Err(bad(s, "empty (a stray comma?)"));
        }
        if let Some((a, p)) = t.split_once('/') {
            let base: IpAddr = a.parse().map_err(|_| {
                bad(
                    s,
                    "a network is ADDRESS/PREFIX (10.0.0.0/16, fd00::/64), without a port",
                )
            })?;
            let (b, width) = bits(base);
            let prefix: u8 = p
                .parse()
                .ok()
                .filter(|&n| n <= width)
                .ok_or_else(|| bad(s, format!("the prefix length must be 0 to {width}")))?;
            if b & !mask(prefix, width) != 0 {
                let net = Cidr {
                    base: match base {
                        IpAddr::V4(_) => {
                            IpAddr::V4(Ipv4Addr::from((b & mask(prefix, width)) as u32))
                        }
                        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::from(b & mask(prefix, width))),
                    },
                    prefix,
                };
                return Err(bad(
                    s,
                    format!("host bits set: the network is {net} (or give the address alone)"),
                ));
            }
            return Ok(PeerEntry::Net(Cidr {
                base: base.to_canonical(),
                prefix,
            }));
        }
        let (host, port) = crate::parse::host_port(t, 0).map_err(|e| bad(s, e.why))?;
        let port = match port {
            // 0 both when none is given and for an explicit ":0".
            0 if crate::parse::host_port(t, 1).map(|x| x.1) == Ok(0) => {
                return Err(bad(s, "port 0"))
            }
            0 => None,
            p => Some(p),
        };
        if let Some(ip) = host_ip(&host) {
            return Ok(PeerEntry::Addr { ip, port });
        }
        if !valid_name(host.strip_suffix('.').unwrap_or(&host)) {
            return Err(bad(
                s,
                "not a host name, an address with an optional :PORT, or a network ADDRESS/PREFIX",
            ));
        }
        Ok(PeerEntry::Name {
            name: name_key(&host),
            port,
        })
    }
}

impl fmt::Display for PeerEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerEntry::Name { name, port: None } => f.write_str(name),
            PeerEntry::Name {
                name,
                port: Some(p),
            } => write!(f, "{name}:{p}"),
            PeerEntry::Addr { ip, port: None } => write!(f, "{ip}"),
            PeerEntry::Addr { ip, port: Some(p) } => write!(f, "{}", SocketAddr::new(*ip, *p)),
            PeerEntry::Net(n) => write!(f, "{n}"),
        }
    }
}

impl PeerEntry {
    /// Whether the entry allows `addr`, which the remote `name` (a name
    /// the caller gave, if it gave one) is or resolved to.
    fn allows(&self, name: Option<&str>, addr: SocketAddr) -> bool {
        let port_ok = |p: &Option<u16>| p.is_none_or(|p| p == addr.port());
        match self {
            PeerEntry::Name { name: n, port } => name == Some(n.as_str()) && port_ok(port),
            PeerEntry::Addr { ip, port } => *ip == addr.ip().to_canonical() && port_ok(port),
            PeerEntry::Net(net) => net.contains(addr.ip()),
        }
    }
}

/// A peer [`CopyPeers::admit`] let through: the remote as the caller gave
/// it (what TLS checks the certificate against) and the addresses checked,
/// the only ones a connection to it may use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admitted {
    remote: String,
    addrs: Vec<SocketAddr>,
}

impl Admitted {
    /// The remote, `HOST[:PORT]` as the caller gave it.
    pub fn remote(&self) -> &str {
        &self.remote
    }

    /// The addresses a connection may use (never empty).
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }
}

/// The list, and this rcpd's own gRPC address.
#[derive(Clone, Debug, Default)]
pub struct CopyPeers {
    entries: Vec<PeerEntry>,
    own: Option<SocketAddr>,
}

impl CopyPeers {
    pub fn new(entries: Vec<PeerEntry>) -> CopyPeers {
        CopyPeers { entries, own: None }
    }

    /// The list, with `own` the address rcpd's gRPC listener bound (a
    /// dial there is to itself, listed or not).
    pub fn with_own(mut self, own: SocketAddr) -> CopyPeers {
        self.own = Some(own);
        self
    }

    pub fn entries(&self) -> &[PeerEntry] {
        &self.entries
    }

    /// Whether `a` is this rcpd's own gRPC listener.
    fn is_own(&self, a: SocketAddr) -> bool {
        let Some(own) = self.own else { return false };
        let ip = a.ip().to_canonical();
        a.port() == own.port()
            && if own.ip().is_unspecified() {
                ip.is_loopback() && ip.is_ipv4() == own.ip().is_ipv4()
            } else {
                ip == own.ip().to_canonical()
            }
    }

    /// Of `resolved`, the addresses of the remote (given by `name`, if a
    /// name) this rcpd may dial.
    fn allowed(&self, name: Option<&str>, resolved: &[SocketAddr]) -> Vec<SocketAddr> {
        resolved
            .iter()
            .copied()
            .filter(|&a| self.is_own(a) || self.entries.iter().any(|e| e.allows(name, a)))
            .collect()
    }

    /// Whether this rcpd may dial `remote` (`HOST[:PORT]`, the default port
    /// without one): its addresses the list allows, or a refusal naming
    /// the flag. A name is resolved here, once.
    pub async fn admit(&self, remote: &str) -> Result<Admitted, ControlError> {
        let (host, port) = crate::parse::host_port(remote, DEFAULT_PORT)
            .map_err(|e| ControlError::Usage(e.to_string()))?;
        let (name, resolved) = match host_ip(&host) {
            Some(ip) => (None, vec![SocketAddr::new(ip, port)]),
            None => {
                let name = name_key(&host);
                let found = tokio::time::timeout(
                    RESOLVE_TIMEOUT,
                    tokio::net::lookup_host((name.as_str(), port)),
                )
                .await
                .map_err(|_| {
                    ControlError::Retryable(format!(
                        "resolving {host}: no answer in {RESOLVE_TIMEOUT:?}"
                    ))
                })?
                .map_err(|e| ControlError::Retryable(format!("resolving {host}: {e}")))?;
                let mut v: Vec<SocketAddr> = found
                    .map(|a| SocketAddr::new(a.ip().to_canonical(), a.port()))
                    .collect();
                v.dedup();
                (Some(name), v)
            }
        };
        let addrs = self.allowed(name.as_deref(), &resolved);
        if !addrs.is_empty() {
            return Ok(Admitted {
                remote: remote.to_string(),
                addrs,
            });
        }
        let what = match &name {
            Some(_) => format!(
                "{} ({})",
                crate::escape::esc(remote),
                resolved
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            None => crate::escape::esc(remote).to_string(),
        };
        Err(ControlError::Permission(if self.entries.is_empty() {
            format!(
                "{what} is not this rcpd: rcpd dials other rcpds (Copy, buffer operations) only \
                 when they are listed in its {FLAG}, and none are"
            )
        } else {
            format!("{what} is not listed in this rcpd's {FLAG}: rcpd dials only the peers listed there")
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(s: &str) -> PeerEntry {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn peers(list: &[&str]) -> CopyPeers {
        CopyPeers::new(list.iter().map(|s| e(s)).collect())
    }

    #[test]
    fn entries_parse_into_names_addresses_and_networks() {
        assert_eq!(
            e("Node-B."),
            PeerEntry::Name {
                name: "node-b".into(),
                port: None
            }
        );
        assert_eq!(
            e(" node-b:7471 "),
            PeerEntry::Name {
                name: "node-b".into(),
                port: Some(7471)
            }
        );
        assert_eq!(
            e("10.0.0.5"),
            PeerEntry::Addr {
                ip: "10.0.0.5".parse().unwrap(),
                port: None
            }
        );
        assert_eq!(
            e("[fd00::5]:9"),
            PeerEntry::Addr {
                ip: "fd00::5".parse().unwrap(),
                port: Some(9)
            }
        );
        // A bare IPv6 address has no port (its last group is not one).
        assert_eq!(
            e("fd00::1:0"),
            PeerEntry::Addr {
                ip: "fd00::1:0".parse().unwrap(),
                port: None
            }
        );
        assert_eq!(e("10.0.0.0/16").to_string(), "10.0.0.0/16");
        assert_eq!(e("fd00::/64").to_string(), "fd00::/64");
        assert_eq!(e("0.0.0.0/0").to_string(), "0.0.0.0/0");
        assert_eq!(e("[fd00::5]:9").to_string(), "[fd00::5]:9");
    }

    #[test]
    fn bad_entries_say_what_is_wrong() {
        for (s, why) in [
            ("", "empty"),
            ("10.0.0.5/16", "host bits set: the network is 10.0.0.0/16"),
            ("fd00::5/64", "the network is fd00::/64"),
            ("10.0.0.0/33", "0 to 32"),
            ("fd00::/129", "0 to 128"),
            ("10.0.0.0/x", "0 to 32"),
            ("node/16", "ADDRESS/PREFIX"),
            ("10.0.0.0:7471/16", "ADDRESS/PREFIX"),
            ("node:0", "port 0"),
            ("node:99999", "bad port"),
            ("fd00::1:7471x", "needs brackets"),
            ("*.cluster", "not a host name"),
            ("http://node", "ADDRESS/PREFIX"),
            ("-node", "not a host name"),
            ("a..b", "not a host name"),
        ] {
            let err = s.parse::<PeerEntry>().expect_err(s).to_string();
            assert!(err.contains("--copy-peers entry"), "{s}: {err}");
            assert!(err.contains(why), "{s}: {err} lacks {why:?}");
        }
    }

    #[test]
    fn networks_contain_their_addresses_only() {
        let PeerEntry::Net(n) = e("10.1.0.0/16") else {
            panic!()
        };
        assert!(n.contains("10.1.0.0".parse().unwrap()));
        assert!(n.contains("10.1.255.255".parse().unwrap()));
        assert!(!n.contains("10.2.0.1".parse().unwrap()));
        assert!(!n.contains("10.0.255.255".parse().unwrap()));
        // IPv4-mapped IPv6 is its IPv4 address; plain IPv6 is another family.
        assert!(n.contains("::ffff:10.1.2.3".parse().unwrap()));
        assert!(!n.contains("::a01:203".parse().unwrap()));
        let PeerEntry::Net(n6) = e("fd00:1::/32") else {
            panic!()
        };
        assert!(n6.contains("fd00:1:ffff::9".parse().unwrap()));
        assert!(!n6.contains("fd00:2::9".parse().unwrap()));
        assert!(!n6.contains("10.1.2.3".parse().unwrap()));
        let PeerEntry::Net(host) = e("10.1.2.3/32") else {
            panic!()
        };
        assert!(host.contains("10.1.2.3".parse().unwrap()));
        assert!(!host.contains("10.1.2.4".parse().unwrap()));
        let PeerEntry::Net(all) = e("0.0.0.0/0") else {
            panic!()
        };
        assert!(all.contains("203.0.113.9".parse().unwrap()));
        assert!(!all.contains("::1".parse().unwrap()));
    }

    #[test]
    fn ports_names_and_addresses_match_as_listed() {
        let p = peers(&[
            "node-a",
            "node-b:7471",
            "10.0.0.5:9000",
            "10.0.0.6",
            "10.2.0.0/16",
        ]);
        // A name with any port, or only its own.
        assert_eq!(p.allowed(Some("node-a"), &[sa("192.0.2.1:1")]).len(), 1);
        assert_eq!(p.allowed(Some("node-b"), &[sa("192.0.2.2:7471")]).len(), 1);
        assert!(p
            .allowed(Some("node-b"), &[sa("192.0.2.2:7472")])
            .is_empty());
        // An address with its port only, or any; a network any port.
        assert_eq!(p.allowed(None, &[sa("10.0.0.5:9000")]).len(), 1);
        assert!(p.allowed(None, &[sa("10.0.0.5:7471")]).is_empty());
        assert_eq!(p.allowed(None, &[sa("10.0.0.6:1")]).len(), 1);
        assert_eq!(p.allowed(None, &[sa("10.2.9.9:7471")]).len(), 1);
        assert!(p.allowed(None, &[sa("10.3.0.1:7471")]).is_empty());
        // A name off the list is let through only at the addresses the list
        // allows: a name resolving into a listed network reaches only that.
        assert_eq!(
            p.allowed(
                Some("other"),
                &[sa("203.0.113.1:7471"), sa("10.2.0.7:7471")]
            ),
            vec![sa("10.2.0.7:7471")]
        );
        assert!(p
            .allowed(Some("other"), &[sa("203.0.113.1:7471")])
            .is_empty());
        // An address is not a name: 192.0.2.1 is node-a only by name.
        assert!(p.allowed(None, &[sa("192.0.2.1:7471")]).is_empty());
    }

    #[test]
    fn own_address_is_allowed_without_a_list_and_nothing_else() {
        let any = CopyPeers::default().with_own(sa("0.0.0.0:7471"));
        assert_eq!(any.allowed(None, &[sa("127.0.0.1:7471")]).len(), 1);
        assert_eq!(any.allowed(None, &[sa("127.0.0.2:7471")]).len(), 1);
        assert!(any.allowed(None, &[sa("127.0.0.1:7472")]).is_empty());
        assert!(any.allowed(None, &[sa("[::1]:7471")]).is_empty());
        assert!(any.allowed(None, &[sa("10.0.0.5:7471")]).is_empty());
        let one = CopyPeers::default().with_own(sa("127.0.0.1:7000"));
        assert_eq!(one.allowed(None, &[sa("127.0.0.1:7000")]).len(), 1);
        // Another loopback address is not the one rcpd holds.
        assert!(one.allowed(None, &[sa("127.0.0.2:7000")]).is_empty());
        let v6 = CopyPeers::default().with_own(sa("[::]:7471"));
        assert_eq!(v6.allowed(None, &[sa("[::1]:7471")]).len(), 1);
        assert!(CopyPeers::default()
            .allowed(None, &[sa("127.0.0.1:7471")])
            .is_empty());
    }

    #[tokio::test]
    async fn admit_refuses_naming_the_flag_and_keeps_only_checked_addresses() {
        let none = CopyPeers::default().with_own(sa("127.0.0.1:7000"));
        let err = none.admit("127.0.0.1:7001").await.unwrap_err();
        assert!(matches!(err, ControlError::Permission(_)), "{err}");
        let msg = err.to_string();
        assert!(msg.contains(FLAG) && msg.contains("none are"), "{msg}");
        assert_eq!(
            none.admit("127.0.0.1:7000").await.unwrap().addrs(),
            [sa("127.0.0.1:7000")]
        );
        let listed = peers(&["127.0.0.1:7001"]);
        let ok = listed.admit("127.0.0.1:7001").await.unwrap();
        assert_eq!(ok.remote(), "127.0.0.1:7001");
        assert_eq!(ok.addrs(), [sa("127.0.0.1:7001")]);
        let msg = listed.admit("[::1]:7001").await.unwrap_err().to_string();
        assert!(msg.contains("is not listed") && msg.contains(FLAG), "{msg}");
        // A name resolves once and only the listed addresses stay.
        let ok = listed.admit("localhost:7001").await.unwrap();
        assert_eq!(ok.addrs(), [sa("127.0.0.1:7001")]);
        let msg = peers(&["10.9.0.0/16"])
            .admit("localhost:7001")
            .await
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("\"localhost:7001\" (127.0.0.1:7001)") && msg.contains("not listed"),
            "{msg}"
        );
        assert!(matches!(
            listed.admit("a:b:c").await.unwrap_err(),
            ControlError::Usage(_)
        ));
    }
}
