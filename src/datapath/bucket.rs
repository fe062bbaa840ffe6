//! The data path's rate limit (`rcp --bwlimit`, `RCPD_BWLIMIT`): a token
//! bucket the posting thread consults before it posts a chain.
//!
//! Tokens are bytes, earned at `bytes_per_sec`; a chain goes out only when
//! the bucket holds all of its bytes, which are then taken. The bucket
//! starts empty, so by any time `t` after the data path started at most
//! `bytes_per_sec * t` bytes have been posted: a limited copy never
//! finishes faster than its limit allows. It holds at most
//! `max(burst, the chain waiting)` bytes, so after an idle spell (nothing
//! to post) at most that much goes out at once; a chain larger than the
//! burst waits until the bucket has earned all of it. Time is passed in
//! (nanoseconds on the engine's clock), so the bucket is plain arithmetic,
//! tested without sleeping.

use std::time::Duration;

/// Fixed point: credit is kept in nanobytes (bytes * 1e9), so that
/// `rate (B/s) * elapsed (ns)` adds whole units and nothing is lost to
/// rounding however often the bucket is asked.
const NANO: u128 = 1_000_000_000;

/// A rate and its burst.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RateLimit {
    /// Bytes per second, at least 1.
    pub bytes_per_sec: u64,
    /// Most bytes the bucket keeps for later (what may go out at once
    /// after an idle spell), at least 1; a single chain larger than this
    /// still goes, once the bucket has earned all of it.
    pub burst: u64,
}

/// Default burst: this long at the rate.
pub const DEFAULT_BURST: Duration = Duration::from_millis(100);

impl RateLimit {
    /// `bytes_per_sec` with the default burst ([`DEFAULT_BURST`] worth of
    /// the rate, at least one 4 KiB block).
    pub fn new(bytes_per_sec: u64) -> RateLimit {
        let burst = (u128::from(bytes_per_sec) * DEFAULT_BURST.as_nanos() / NANO) as u64;
        RateLimit {
            bytes_per_sec,
            burst: burst.max(4096),
        }
    }
}

/// The bucket. See the module docs.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    rate: u128,
    burst: u128,
    /// Nanobytes held (at most `max(burst, need) * NANO`).
    credit: u128,
    /// When `credit` was last brought up to date.
    last_ns: u64,
}

impl TokenBucket {
    /// An empty bucket at `now_ns`.
    pub fn new(limit: RateLimit, now_ns: u64) -> TokenBucket {
        TokenBucket {
            rate: u128::from(limit.bytes_per_sec.max(1)),
            burst: u128::from(limit.burst.max(1)),
            credit: 0,
            last_ns: now_ns,
        }
    }

    /// Earn what the time since the last call is worth, keeping at most
    /// `max(burst, need)` bytes.
    fn refill(&mut self, need: u64, now_ns: u64) {
        let dt = u128::from(now_ns.saturating_sub(self.last_ns));
        self.last_ns = self.last_ns.max(now_ns);
        let cap = self.burst.max(u128::from(need)) * NANO;
        self.credit = self
            .credit
            .saturating_add(self.rate.saturating_mul(dt))
            .min(cap);
    }

    /// Take `bytes` if the bucket holds them now; otherwise how long until
    /// it will (nothing is taken).
    pub fn take(&mut self, bytes: u64, now_ns: u64) -> Result<(), Duration> {
        self.refill(bytes, now_ns);
        let need = u128::from(bytes) * NANO;
        if self.credit >= need {
            self.credit -= need;
            return Ok(());
        }
        let ns = (need - self.credit).div_ceil(self.rate);
        Err(Duration::from_nanos(ns.min(u128::from(u64::MAX)) as u64))
    }

    /// Give back bytes taken for requests the provider refused (they are
    /// posted again, and pay again then).
    pub fn give_back(&mut self, bytes: u64) {
        self.credit = self.credit.saturating_add(u128::from(bytes) * NANO);
    }

    /// Whole bytes held now (without refilling).
    pub fn held(&self) -> u64 {
        (self.credit / NANO) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000_000_000;

    fn bucket(rate: u64, burst: u64) -> TokenBucket {
        TokenBucket::new(
            RateLimit {
                bytes_per_sec: rate,
                burst,
            },
            0,
        )
    }

    #[test]
    fn starts_empty_and_says_how_long_to_wait() {
        let mut b = bucket(1000, 500);
        // Nothing at t = 0: 100 bytes take 100 ms.
        assert_eq!(b.take(100, 0), Err(Duration::from_millis(100)));
        assert_eq!(b.take(100, 50 * MS), Err(Duration::from_millis(50)));
        assert_eq!(b.take(100, 100 * MS), Ok(()));
        assert_eq!(b.held(), 0);
        // A wait rounds up: never early.
        assert_eq!(b.take(1, 100 * MS), Err(Duration::from_millis(1)));
        let mut odd = bucket(3, 10);
        assert_eq!(odd.take(1, 0), Err(Duration::from_nanos(333_333_334)));
        assert_eq!(odd.take(1, 333_333_333), Err(Duration::from_nanos(1)));
        assert_eq!(odd.take(1, 333_333_334), Ok(()));
    }

    #[test]
    fn idle_time_is_kept_up_to_the_burst_only() {
        let mut b = bucket(1000, 500);
        // 10 s idle earns 10 000 bytes, of which 500 are kept.
        assert_eq!(b.take(400, 10 * S), Ok(()));
        assert_eq!(b.held(), 100);
        assert!(b.take(200, 10 * S).is_err());
        // A chain larger than the burst waits until all of it is earned,
        // and what it waits for is not cut to the burst meanwhile.
        let mut b = bucket(1000, 500);
        assert_eq!(b.take(2000, 0), Err(Duration::from_secs(2)));
        assert_eq!(b.take(2000, S), Err(Duration::from_secs(1)));
        assert_eq!(b.take(2000, 2 * S), Ok(()));
        // ... but after a long idle spell it still gets only itself.
        assert_eq!(b.take(2000, 100 * S), Ok(()));
        assert_eq!(b.held(), 0);
    }

    #[test]
    fn refused_bytes_come_back() {
        let mut b = bucket(1000, 1000);
        assert_eq!(b.take(1000, S), Ok(()));
        b.give_back(300);
        assert_eq!(b.take(300, S), Ok(()));
        assert!(b.take(1, S).is_err());
    }

    #[test]
    fn time_going_backwards_earns_nothing() {
        let mut b = bucket(1000, 1000);
        assert!(b.take(1000, S).is_ok());
        assert!(b.take(1, S / 2).is_err());
        assert_eq!(b.take(1, S + MS), Ok(()));
    }

    /// A poster that asks for chains as fast as the bucket allows posts at
    /// most `rate * t` by any `t`, and over 10 s within 1 % of it, whatever
    /// the chain sizes.
    #[test]
    fn a_greedy_poster_keeps_to_the_rate() {
        for (rate, chain) in [
            (16u64 << 20, 4u64 << 20),
            (16 << 20, 64 << 10),
            (4 << 20, 1 << 20),
            (1 << 30, 2048),
            (100_000, 4096),
        ] {
            let lim = RateLimit::new(rate);
            let mut b = TokenBucket::new(lim, 0);
            let (mut now, mut posted) = (0u64, 0u64);
            while now < 10 * S {
                match b.take(chain, now) {
                    Ok(()) => {
                        posted += chain;
                        let allowed = u128::from(rate) * u128::from(now) / NANO;
                        assert!(
                            u128::from(posted) <= allowed,
                            "rate {rate} chain {chain}: {posted} posted by {now} ns, {allowed} allowed"
                        );
                    }
                    Err(w) => now += w.as_nanos() as u64,
                }
            }
            let ideal = rate as f64 * 10.0;
            let err = (posted as f64 - ideal).abs() / ideal;
            assert!(
                err < 0.01 || (posted as f64) >= ideal - chain as f64,
                "rate {rate} chain {chain}: {posted} in 10 s, ideal {ideal}"
            );
        }
    }

    #[test]
    fn default_burst_is_a_tenth_of_a_second() {
        assert_eq!(RateLimit::new(16 << 20).burst, (16 << 20) / 10);
        assert_eq!(RateLimit::new(1000).burst, 4096);
        assert_eq!(RateLimit::new(u64::MAX).bytes_per_sec, u64::MAX);
    }
}
