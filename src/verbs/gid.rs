//! GIDs, the entries of a port's GID table, and the choice of the GID a QP
//! is addressed by (the table is read from the device in `device.rs`).
//!
//! On RoCE the GID decides the IP version and the RoCE version of every
//! packet. We prefer a RoCE v2 GID that is an IPv4-mapped address (it routes
//! like the host's IPv4 network and works on rxe and ConnectX alike), then any
//! RoCE v2 GID, then anything non-zero; an operator override by index always
//! wins. The choice is returned with the reason so callers can log it.

use std::fmt;
use std::net::Ipv6Addr;

/// A GID as 16 raw bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// `::ffff:a.b.c.d`.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.0[..10] == [0; 10] && self.0[10] == 0xff && self.0[11] == 0xff
    }

    pub fn as_ipv6(&self) -> Ipv6Addr {
        Ipv6Addr::from(self.0)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.as_ipv6())
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// The type of a GID table entry, as sysfs names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GidType {
    Ib,
    RoceV1,
    RoceV2,
    Unknown,
}

impl GidType {
    pub(super) fn parse(s: &str) -> GidType {
        let s = s.trim();
        if s.eq_ignore_ascii_case("RoCE v2") {
            GidType::RoceV2
        } else if s.eq_ignore_ascii_case("IB/RoCE v1") || s.eq_ignore_ascii_case("RoCE v1") {
            GidType::RoceV1
        } else if s.eq_ignore_ascii_case("IB") {
            GidType::Ib
        } else {
            GidType::Unknown
        }
    }
}

/// One entry of a port's GID table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidEntry {
    pub index: u32,
    pub gid: Gid,
    pub kind: GidType,
    /// The netdev the entry belongs to (RoCE), if sysfs says.
    pub netdev: Option<String>,
}

/// The chosen GID and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidChoice {
    pub entry: GidEntry,
    pub reason: String,
}

/// Pick the GID to use. Pure: unit-tested without a device.
pub fn choose_gid(entries: &[GidEntry], override_index: Option<u32>) -> Result<GidChoice, String> {
    if let Some(i) = override_index {
        return match entries.iter().find(|e| e.index == i) {
            Some(e) if !e.gid.is_zero() => Ok(GidChoice {
                entry: e.clone(),
                reason: format!(
                    "index {i} requested by the operator ({:?} {})",
                    e.kind, e.gid
                ),
            }),
            _ => Err(format!(
                "GID index {i} is empty or out of range (valid non-empty indexes: {})",
                valid_indexes(entries)
            )),
        };
    }
    let live = || entries.iter().filter(|e| !e.gid.is_zero());
    if let Some(e) = live().find(|e| e.kind == GidType::RoceV2 && e.gid.is_ipv4_mapped()) {
        return Ok(GidChoice {
            entry: e.clone(),
            reason: format!(
                "first RoCE v2 IPv4-mapped GID (index {}, {})",
                e.index, e.gid
            ),
        });
    }
    if let Some(e) = live().find(|e| e.kind == GidType::RoceV2) {
        return Ok(GidChoice {
            entry: e.clone(),
            reason: format!(
                "no IPv4-mapped RoCE v2 GID; first RoCE v2 GID (index {}, {})",
                e.index, e.gid
            ),
        });
    }
    if let Some(e) = live().next() {
        return Ok(GidChoice {
            entry: e.clone(),
            reason: format!(
                "no RoCE v2 GID; first non-empty GID (index {}, {:?} {})",
                e.index, e.kind, e.gid
            ),
        });
    }
    Err("the GID table is empty: give the netdev an IP address (RoCE) or check the port".into())
}

fn valid_indexes(entries: &[GidEntry]) -> String {
    let v: Vec<String> = entries
        .iter()
        .filter(|e| !e.gid.is_zero())
        .map(|e| e.index.to_string())
        .collect();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(index: u32, gid: &str, kind: GidType) -> GidEntry {
        GidEntry {
            index,
            gid: Gid(gid.parse::<Ipv6Addr>().unwrap().octets()),
            kind,
            netdev: Some("eth0".into()),
        }
    }

    #[test]
    fn prefers_rocev2_ipv4_mapped() {
        let t = vec![
            e(0, "fe80::1", GidType::RoceV1),
            e(1, "fe80::1", GidType::RoceV2),
            e(2, "::ffff:10.0.0.1", GidType::RoceV1),
            e(3, "::ffff:10.0.0.1", GidType::RoceV2),
        ];
        let c = choose_gid(&t, None).unwrap();
        assert_eq!(c.entry.index, 3);
        assert!(c.reason.contains("IPv4-mapped"), "{}", c.reason);
    }

    #[test]
    fn falls_back_to_any_rocev2_then_anything() {
        let t = vec![
            e(0, "fe80::1", GidType::RoceV1),
            e(1, "fe80::2", GidType::RoceV2),
        ];
        assert_eq!(choose_gid(&t, None).unwrap().entry.index, 1);
        let t = vec![e(0, "fe80::1", GidType::Ib)];
        let c = choose_gid(&t, None).unwrap();
        assert_eq!(c.entry.index, 0);
        assert!(c.reason.contains("no RoCE v2"));
    }

    #[test]
    fn override_wins_and_bad_override_is_named() {
        let t = vec![
            e(0, "fe80::1", GidType::RoceV1),
            e(1, "::ffff:1.2.3.4", GidType::RoceV2),
        ];
        assert_eq!(choose_gid(&t, Some(0)).unwrap().entry.index, 0);
        let err = choose_gid(&t, Some(7)).unwrap_err();
        assert!(err.contains("index 7") && err.contains("0, 1"), "{err}");
    }

    #[test]
    fn empty_table_is_an_error() {
        assert!(choose_gid(&[], None).unwrap_err().contains("empty"));
    }

    #[test]
    fn parses_sysfs_types() {
        assert_eq!(GidType::parse("RoCE v2\n"), GidType::RoceV2);
        assert_eq!(GidType::parse("IB/RoCE v1\n"), GidType::RoceV1);
        assert!(Gid("::ffff:127.0.0.1".parse::<Ipv6Addr>().unwrap().octets()).is_ipv4_mapped());
    }
}
