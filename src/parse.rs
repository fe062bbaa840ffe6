//! The small parsers of what users type, written once: `HOST[:PORT]`
//! addresses and byte sizes with K/M/G suffixes. The binaries' flags, the
//! client library and `rcp bench` all go through these.

use std::net::Ipv6Addr;

/// Why a value was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{value:?}: {why}")]
pub struct ParseError {
    pub value: String,
    pub why: &'static str,
}

fn err(value: &str, why: &'static str) -> ParseError {
    ParseError {
        value: value.to_string(),
        why,
    }
}

/// `HOST`, `HOST:PORT`, `[V6]`, `[V6]:PORT` or a bare IPv6 address, split
/// into the host (an IPv6 address in brackets, ready to join with a port)
/// and the port (`default_port` when none is given).
pub fn host_port(addr: &str, default_port: u16) -> Result<(String, u16), ParseError> {
    let s = addr.trim();
    if s.parse::<Ipv6Addr>().is_ok() {
        return Ok((format!("[{s}]"), default_port));
    }
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest
            .split_once(']')
            .ok_or_else(|| err(addr, "unclosed ["))?;
        if h.parse::<Ipv6Addr>().is_err() {
            return Err(err(addr, "not an IPv6 address inside [ ]"));
        }
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse::<u16>().map_err(|_| err(addr, "bad port"))?,
            None if after.is_empty() => default_port,
            None => return Err(err(addr, "junk after ]")),
        };
        (format!("[{h}]"), port)
    } else {
        match s.rsplit_once(':') {
            Some((h, _)) if h.contains(':') => {
                return Err(err(
                    addr,
                    "an IPv6 address with a port needs brackets: [ADDR]:PORT",
                ))
            }
            Some((h, p)) => (
                h.to_string(),
                p.parse::<u16>().map_err(|_| err(addr, "bad port"))?,
            ),
            None => (s.to_string(), default_port),
        }
    };
    if host.is_empty() {
        return Err(err(addr, "empty host"));
    }
    Ok((host, port))
}

/// Bytes with an optional K/M/G suffix (powers of 1024, either case).
pub fn bytes(s: &str) -> Result<u64, ParseError> {
    let t = s.trim();
    let (num, mul) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1u64 << 10),
        Some((i, 'm' | 'M')) => (&t[..i], 1 << 20),
        Some((i, 'g' | 'G')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    let n: u64 = num.trim().parse().map_err(|_| err(s, "not a size"))?;
    n.checked_mul(mul).ok_or_else(|| err(s, "too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        let hp = |s| host_port(s, 7471);
        assert_eq!(hp("node").unwrap(), ("node".into(), 7471));
        assert_eq!(hp("node:9").unwrap(), ("node".into(), 9));
        assert_eq!(hp("10.0.0.1:7").unwrap(), ("10.0.0.1".into(), 7));
        assert_eq!(hp("fe80::1").unwrap(), ("[fe80::1]".into(), 7471));
        assert_eq!(hp("[fe80::1]").unwrap(), ("[fe80::1]".into(), 7471));
        assert_eq!(hp("[fe80::1]:5").unwrap(), ("[fe80::1]".into(), 5));
        for bad in ["", ":1", "node:x", "[::1", "[::1]x", "[::1]:x", "[node]:1"] {
            assert!(hp(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(bytes("4096").unwrap(), 4096);
        assert_eq!(bytes("4k").unwrap(), 4096);
        assert_eq!(bytes("1M").unwrap(), 1 << 20);
        assert_eq!(bytes("2G").unwrap(), 2 << 30);
        assert_eq!(bytes(" 16K ").unwrap(), 16 << 10);
        assert!(bytes("x").is_err());
        assert!(bytes("1T").is_err());
        assert!(bytes("99999999999999G").is_err());
    }
}
