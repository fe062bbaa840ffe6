//! The small parsers of what users type, written once: `HOST[:PORT]`
//! addresses, byte sizes (and rates) with K/M/G suffixes, durations, lists
//! of RDMA rails (`--device mlx5_0,mlx5_1:2`). The binaries' flags, the
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

/// Bytes with an optional K/M/G suffix (powers of 1024, either case). With
/// a suffix the number may have a fraction (`1.5M`, as rsync and rclone
/// take rates), rounded down to a whole byte.
pub fn bytes(s: &str) -> Result<u64, ParseError> {
    let t = s.trim();
    let (num, mul) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1u64 << 10),
        Some((i, 'm' | 'M')) => (&t[..i], 1 << 20),
        Some((i, 'g' | 'G')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    let num = num.trim();
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mul).ok_or_else(|| err(s, "too large"));
    }
    // A fraction: digits, one dot, digits (no sign, no exponent), and only
    // with a suffix (a fraction of a byte means nothing).
    let (whole, frac) = num.split_once('.').ok_or_else(|| err(s, "not a size"))?;
    let digits = |x: &str| x.bytes().all(|b| b.is_ascii_digit());
    if mul == 1 || (whole.is_empty() && frac.is_empty()) || !digits(whole) || !digits(frac) {
        return Err(err(s, "not a size"));
    }
    let v: f64 = num.parse().map_err(|_| err(s, "not a size"))?;
    let b = v * mul as f64;
    if b >= u64::MAX as f64 {
        return Err(err(s, "too large"));
    }
    Ok(b as u64)
}

/// A duration as rclone writes one: `1.5`, `2s`, `500ms`, `1m` (a bare
/// number is seconds; `s`, `ms`, `m`, `h`, `d` suffixes; fractions allowed).
pub fn duration(s: &str) -> Result<std::time::Duration, ParseError> {
    let t = s.trim();
    let (num, unit) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = t.strip_suffix('h') {
        (n, 3600.0)
    } else if let Some(n) = t.strip_suffix('d') {
        (n, 86_400.0)
    } else {
        (t, 1.0)
    };
    let num = num.trim();
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(err(s, "not a duration (e.g. 1, 2.5s, 500ms, 1m)"));
    }
    let v: f64 = num
        .parse()
        .map_err(|_| err(s, "not a duration (e.g. 1, 2.5s, 500ms, 1m)"))?;
    std::time::Duration::try_from_secs_f64(v * unit).map_err(|_| err(s, "too large"))
}

/// One rail named on the command line: an RDMA device and, for a device
/// with several ports, which one (`None`: its first ACTIVE port).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RailName {
    pub device: String,
    pub port: Option<u8>,
}

impl std::fmt::Display for RailName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.port {
            Some(p) => write!(f, "{}:{p}", self.device),
            None => f.write_str(&self.device),
        }
    }
}

/// The most rails a list may name (the engine's limit, 64).
pub const MAX_RAIL_NAMES: usize = crate::engine::stream::MAX_RAILS;

/// A comma-separated list of rails, `NAME[:PORT],...` (`mlx5_0,mlx5_1`,
/// `mlx5_0:1,mlx5_0:2`): in order, at least one, none twice. A device name
/// is what `ibv_devices` prints (letters, digits, `_`, `-`, `.`); a port is
/// 1..=255. Spaces around the commas are ignored.
pub fn rails(s: &str) -> Result<Vec<RailName>, ParseError> {
    let mut out: Vec<RailName> = Vec::new();
    for item in s.split(',') {
        let item = item.trim();
        if item.is_empty() {
            return Err(err(s, "an empty rail name (NAME[:PORT],...)"));
        }
        let (device, port) = match item.split_once(':') {
            Some((d, p)) => {
                let port = p
                    .parse::<u8>()
                    .ok()
                    .filter(|&p| p > 0)
                    .ok_or_else(|| err(s, "a port is a number 1..=255 (NAME:PORT)"))?;
                (d, Some(port))
            }
            None => (item, None),
        };
        if device.is_empty()
            || !device
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        {
            return Err(err(
                s,
                "a device name has only letters, digits, _ - and . (NAME[:PORT],...)",
            ));
        }
        let r = RailName {
            device: device.to_string(),
            port,
        };
        // The same port twice, or a whole device and one of its ports.
        if out.iter().any(|o| {
            o.device == r.device && (o.port == r.port || o.port.is_none() || r.port.is_none())
        }) {
            return Err(err(s, "a rail named twice"));
        }
        out.push(r);
    }
    if out.len() > MAX_RAIL_NAMES {
        return Err(err(s, "more rails than a session takes (64)"));
    }
    Ok(out)
}

/// A `--device` value: [`rails`] parsed once, for clap.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct RailList(pub Vec<RailName>);

impl std::str::FromStr for RailList {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, ParseError> {
        rails(s).map(RailList)
    }
}

impl std::fmt::Display for RailList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (k, r) in self.0.iter().enumerate() {
            if k > 0 {
                f.write_str(",")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
    }
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
        // Fractions with a suffix (rates), rounded down; never without one.
        assert_eq!(bytes("1.5M").unwrap(), 3 << 19);
        assert_eq!(bytes("0.5k").unwrap(), 512);
        assert_eq!(bytes(".25K").unwrap(), 256);
        assert_eq!(bytes("2.M").unwrap(), 2 << 20);
        for bad in ["1.5", "1.5.5M", "-1M", "1e3K", ".K", "1,5M", "NaNM", "infK"] {
            assert!(bytes(bad).is_err(), "{bad}");
        }
        assert!(bytes("99999999999999.5G").is_err());
    }

    #[test]
    fn durations() {
        use std::time::Duration;
        assert_eq!(duration("1").unwrap(), Duration::from_secs(1));
        assert_eq!(duration("2.5s").unwrap(), Duration::from_millis(2500));
        assert_eq!(duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(duration("1m").unwrap(), Duration::from_secs(60));
        assert_eq!(duration("1d").unwrap(), Duration::from_secs(86_400));
        assert_eq!(duration("0").unwrap(), Duration::ZERO);
        for bad in ["", "s", "-1", "1x", "1e3", "fast"] {
            assert!(duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn rail_lists() {
        let r = |d: &str, p| RailName {
            device: d.into(),
            port: p,
        };
        assert_eq!(rails("mlx5_0").unwrap(), vec![r("mlx5_0", None)]);
        assert_eq!(
            rails("mlx5_0,mlx5_1").unwrap(),
            vec![r("mlx5_0", None), r("mlx5_1", None)]
        );
        assert_eq!(
            rails("mlx5_0:1, mlx5_0:2 ,rxe-b.1").unwrap(),
            vec![
                r("mlx5_0", Some(1)),
                r("mlx5_0", Some(2)),
                r("rxe-b.1", None)
            ]
        );
        assert_eq!(rails("mlx5_0:2").unwrap()[0].to_string(), "mlx5_0:2");
        assert_eq!(rails("rxea0").unwrap()[0].to_string(), "rxea0");
        for bad in [
            "", ",", "a,,b", "a,", "a:0", "a:256", "a:x", ":1", "a b", "a/b", "a,a", "a:1,a:1",
            "a,a:1",
        ] {
            assert!(rails(bad).is_err(), "{bad}");
        }
        assert_eq!(MAX_RAIL_NAMES, 64, "the refusal says 64");
        let names = |n: usize| {
            (0..n)
                .map(|i| format!("d{i}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        assert_eq!(rails(&names(MAX_RAIL_NAMES)).unwrap().len(), MAX_RAIL_NAMES);
        assert!(rails(&names(MAX_RAIL_NAMES + 1)).is_err());
    }
}
