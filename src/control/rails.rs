//! Which of this side's rails talks to which of the peer's: the pairing
//! rule of a session over several rails, pure and unit-tested (the
//! handshake logs its outcome, a pair at a time, with the reason).
//!
//! A rail is addressed by its GID (RoCE v2: an IPv4-mapped or IPv6
//! address) and the prefix length of the IP subnet that address is on
//! (0: unknown, taken as /24 for IPv4 and /64 for IPv6).
//!
//! The rule, in order:
//! 1. **Same subnet first.** Each local rail, in the order given, takes
//!    the first peer rail not yet taken whose address is on the same
//!    subnet (the shorter of the two prefixes decides): two NICs cabled to
//!    the same switch plane meet.
//! 2. **Then order.** The local rails left take the peer rails left, in
//!    order. Such a pair crosses subnets, so it needs a route between
//!    them: it is refused when the two GIDs are of different families
//!    (IPv4-mapped against IPv6) or when either is link-local (`fe80::/10`,
//!    which no router forwards), with a message naming both GIDs.
//! 3. Rails left over on the side with more are not used (the session has
//!    as many rails as the side with fewer).

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::verbs::Gid;

/// The most QPs per rail a session takes (`--qps-per-rail`).
pub const MAX_QPS_PER_RAIL: u32 = 16;

/// A rail's address for pairing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RailAddr {
    pub gid: Gid,
    /// The prefix length of the GID's IP subnet; 0: unknown.
    pub prefix_len: u8,
}

/// Why two rails were paired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PairedBy {
    /// Both on one subnet.
    SameSubnet,
    /// Left over after the same-subnet pass, paired in order (routed).
    Order,
}

impl std::fmt::Display for PairedBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PairedBy::SameSubnet => "same subnet",
            PairedBy::Order => "in order (different subnets, routed)",
        })
    }
}

/// A local rail and the peer rail it talks to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RailPair {
    pub local: usize,
    pub remote: usize,
    pub by: PairedBy,
}

/// A pairing that cannot work.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PairError {
    #[error("no rails to pair ({local} here, {remote} on the peer)")]
    Empty { local: usize, remote: usize },
    #[error(
        "rail {local} (GID {local_gid}) cannot reach the peer's rail {remote} (GID {remote_gid}): \
         {why}"
    )]
    Unreachable {
        local: usize,
        local_gid: Gid,
        remote: usize,
        remote_gid: Gid,
        why: &'static str,
    },
}

/// The address of an IPv4-mapped GID.
fn ipv4(g: &Gid) -> Option<Ipv4Addr> {
    g.is_ipv4_mapped()
        .then(|| Ipv4Addr::new(g.0[12], g.0[13], g.0[14], g.0[15]))
}

fn link_local(g: &Gid) -> bool {
    !g.is_ipv4_mapped() && (g.as_ipv6().segments()[0] & 0xffc0) == 0xfe80
}

/// Whether `a` and `b` are on one subnet (the shorter known prefix; /24
/// for IPv4 and /64 for IPv6 when neither is known).
pub fn same_subnet(a: &RailAddr, b: &RailAddr) -> bool {
    let prefix = |default: u8, max: u8| -> u32 {
        let known = [a.prefix_len, b.prefix_len]
            .into_iter()
            .filter(|&p| p > 0)
            .map(|p| p.min(max));
        u32::from(known.min().unwrap_or(default))
    };
    match (ipv4(&a.gid), ipv4(&b.gid)) {
        (Some(x), Some(y)) => {
            let p = prefix(24, 32);
            let mask = u32::MAX.checked_shl(32 - p).unwrap_or(0);
            u32::from(x) & mask == u32::from(y) & mask
        }
        (None, None) => {
            let p = prefix(64, 128);
            let mask = u128::MAX.checked_shl(128 - p).unwrap_or(0);
            let (x, y): (u128, u128) = (
                Ipv6Addr::from(a.gid.0).into(),
                Ipv6Addr::from(b.gid.0).into(),
            );
            x & mask == y & mask
        }
        _ => false,
    }
}

/// Pair `local` rails with the peer's `remote` rails by the module's rule;
/// the pairs in the order of the local rails.
pub fn pair(local: &[RailAddr], remote: &[RailAddr]) -> Result<Vec<RailPair>, PairError> {
    if local.is_empty() || remote.is_empty() {
        return Err(PairError::Empty {
            local: local.len(),
            remote: remote.len(),
        });
    }
    let mut taken = vec![false; remote.len()];
    let mut of_local: Vec<Option<RailPair>> = vec![None; local.len()];
    for (i, l) in local.iter().enumerate() {
        if let Some(j) = (0..remote.len()).find(|&j| !taken[j] && same_subnet(l, &remote[j])) {
            taken[j] = true;
            of_local[i] = Some(RailPair {
                local: i,
                remote: j,
                by: PairedBy::SameSubnet,
            });
        }
    }
    let mut left = (0..remote.len()).filter(|&j| !taken[j]);
    for (i, slot) in of_local.iter_mut().enumerate() {
        if slot.is_some() {
            continue;
        }
        let Some(j) = left.next() else { break };
        let (l, r) = (&local[i].gid, &remote[j].gid);
        let why = if l.is_ipv4_mapped() != r.is_ipv4_mapped() {
            Some("one GID is IPv4-mapped, the other IPv6 (RoCE v2 routes neither into the other)")
        } else if link_local(l) || link_local(r) {
            Some("a link-local GID (fe80::/10) reaches only its own subnet, and these are on different subnets")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(PairError::Unreachable {
                local: i,
                local_gid: *l,
                remote: j,
                remote_gid: *r,
                why,
            });
        }
        *slot = Some(RailPair {
            local: i,
            remote: j,
            by: PairedBy::Order,
        });
    }
    Ok(of_local.into_iter().flatten().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(a: [u8; 4], prefix_len: u8) -> RailAddr {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&a);
        RailAddr {
            gid: Gid(g),
            prefix_len,
        }
    }

    fn v6(s: &str, prefix_len: u8) -> RailAddr {
        RailAddr {
            gid: Gid(s.parse::<Ipv6Addr>().unwrap().octets()),
            prefix_len,
        }
    }

    fn pairs(p: &[RailPair]) -> Vec<(usize, usize, PairedBy)> {
        p.iter().map(|p| (p.local, p.remote, p.by)).collect()
    }

    #[test]
    fn same_subnet_wins_over_order() {
        // The test bed's rails topology, the peer listing its rails the
        // other way round: subnet decides, not position.
        let a = [v4([192, 168, 77, 1], 24), v4([192, 168, 78, 1], 24)];
        let b = [v4([192, 168, 78, 2], 24), v4([192, 168, 77, 2], 24)];
        use PairedBy::*;
        assert_eq!(
            pairs(&pair(&a, &b).unwrap()),
            vec![(0, 1, SameSubnet), (1, 0, SameSubnet)]
        );
        assert_eq!(
            pairs(&pair(&b, &a).unwrap()),
            vec![(0, 1, SameSubnet), (1, 0, SameSubnet)]
        );
    }

    #[test]
    fn then_order_and_extras_unused() {
        use PairedBy::*;
        // Rail 1 of each side on its own subnet: routed, in order.
        let a = [
            v4([10, 0, 0, 1], 24),
            v4([10, 1, 0, 1], 24),
            v4([10, 9, 0, 1], 24),
        ];
        let b = [v4([10, 2, 0, 2], 24), v4([10, 0, 0, 2], 24)];
        assert_eq!(
            pairs(&pair(&a, &b).unwrap()),
            vec![(0, 1, SameSubnet), (1, 0, Order)]
        );
        // One rail here, two there: one pair.
        assert_eq!(pairs(&pair(&a[..1], &b).unwrap()), vec![(0, 1, SameSubnet)]);
        assert_eq!(
            pair(&[], &b),
            Err(PairError::Empty {
                local: 0,
                remote: 2
            })
        );
    }

    #[test]
    fn the_shorter_prefix_decides() {
        // 10.0.1.1/16 and 10.0.2.2/24: one /16.
        assert!(same_subnet(&v4([10, 0, 1, 1], 16), &v4([10, 0, 2, 2], 24)));
        assert!(!same_subnet(&v4([10, 0, 1, 1], 24), &v4([10, 0, 2, 2], 24)));
        // Unknown prefixes: /24.
        assert!(same_subnet(&v4([10, 0, 1, 1], 0), &v4([10, 0, 1, 9], 0)));
        assert!(!same_subnet(&v4([10, 0, 1, 1], 0), &v4([10, 0, 2, 1], 0)));
        // /32: only the same address.
        assert!(!same_subnet(&v4([10, 0, 1, 1], 32), &v4([10, 0, 1, 2], 32)));
        assert!(same_subnet(&v6("fd00:1::1", 0), &v6("fd00:1::2", 64)));
        assert!(!same_subnet(&v6("fd00:1::1", 64), &v6("fd00:2::1", 64)));
        assert!(same_subnet(&v6("fd00:1::1", 16), &v6("fd00:2::1", 64)));
        assert!(!same_subnet(&v4([10, 0, 1, 1], 8), &v6("::a00:101", 8)));
    }

    #[test]
    fn unreachable_pairs_name_both_gids() {
        let a = [v4([10, 0, 0, 1], 24)];
        let b = [v6("fd00::2", 64)];
        let e = pair(&a, &b).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("::ffff:10.0.0.1"), "{msg}");
        assert!(msg.contains("fd00::2"), "{msg}");
        assert!(matches!(
            e,
            PairError::Unreachable {
                local: 0,
                remote: 0,
                ..
            }
        ));
        // Link-local GIDs on two subnets: refused; on one: paired.
        let e = pair(&[v6("fe80::1", 64)], &[v6("fe80:0:0:1::2", 64)]).unwrap_err();
        assert!(e.to_string().contains("fe80::1") && e.to_string().contains("fe80:0:0:1::2"));
        assert!(pair(&[v6("fe80::1", 64)], &[v6("fe80::2", 64)]).is_ok());
    }
}
