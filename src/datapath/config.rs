//! Data-path configuration, set in code.
//!
//! [`DataPathConfig::default`] holds the defaults, the ones copies use
//! (chains of 32 signaled at the tail, inline up to 64 bytes, hybrid
//! polling on verbs, a 60 s request timeout);
//! [`DataPathConfig::stream_config`] turns it into the engine's
//! [`StreamConfig`] on a channel. The binaries read their flags (and the
//! `RCP_*` variables behind them) with clap and fill the fields; nothing
//! here reads the environment.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use super::cpus::node_cpus_allowed;
use crate::engine::{BatchPolicy, StreamConfig};
use crate::provider::{ChannelCaps, ProviderKind};

/// Default number of empty polls before hybrid mode arms and sleeps.
pub const DEFAULT_EMPTY_POLLS: u32 = 1024;

/// Default inline limit in bytes (clamped to the channel's).
pub const DEFAULT_MAX_INLINE: u32 = 64;

/// Default request timeout: a request outstanding this long means the
/// peer or the link is gone. A copy's is its progress timeout, rcp's
/// `--timeout`, whose default this is.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// How the completion thread waits for completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollMode {
    /// Busy poll: lowest latency, one core at 100 % (`rcp bench`'s
    /// default).
    Poll,
    /// Arm, poll once more (closes the race), then sleep on the event.
    Event,
    /// Busy poll; after `empty_polls` empty polls in a row, arm and sleep;
    /// on wake drain and go back to polling.
    Hybrid {
        /// Empty polls in a row before sleeping.
        empty_polls: u32,
    },
}

impl PollMode {
    /// The default on `kind`'s provider: hybrid on verbs (busy polling
    /// would cost a core per session; hybrid sleeps when idle), event on
    /// tcp (its completions are condvar-driven anyway).
    pub fn default_for(kind: ProviderKind) -> PollMode {
        match kind {
            ProviderKind::Verbs => PollMode::Hybrid {
                empty_polls: DEFAULT_EMPTY_POLLS,
            },
            ProviderKind::Tcp => PollMode::Event,
        }
    }
}

impl fmt::Display for PollMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PollMode::Poll => f.write_str("poll"),
            PollMode::Event => f.write_str("event"),
            PollMode::Hybrid { empty_polls } => write!(f, "hybrid:{empty_polls}"),
        }
    }
}

impl FromStr for PollMode {
    type Err = String;
    /// `poll`, `event`, `hybrid` (K = 1024) or `hybrid:K` (K >= 1).
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "poll" => Ok(PollMode::Poll),
            "event" => Ok(PollMode::Event),
            "hybrid" => Ok(PollMode::Hybrid {
                empty_polls: DEFAULT_EMPTY_POLLS,
            }),
            other => match other.strip_prefix("hybrid:").map(str::parse::<u32>) {
                Some(Ok(k)) if k >= 1 => Ok(PollMode::Hybrid { empty_polls: k }),
                _ => Err("expected poll, event, hybrid or hybrid:K (K >= 1)".into()),
            },
        }
    }
}

/// Exponential backoff between reconnect attempts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// Delay after the first failed attempt.
    pub initial: Duration,
    /// Multiplier per failed attempt.
    pub factor: u32,
    /// Largest delay.
    pub cap: Duration,
    /// Attempts before giving up (>= 1).
    pub max_attempts: u32,
}

impl Default for Backoff {
    /// 50 ms, x2, capped at 2 s, 8 attempts.
    fn default() -> Self {
        Backoff {
            initial: Duration::from_millis(50),
            factor: 2,
            cap: Duration::from_secs(2),
            max_attempts: 8,
        }
    }
}

impl Backoff {
    /// Delay after failed attempt `n` (0-based).
    pub fn delay(&self, n: u32) -> Duration {
        let mul = self.factor.max(1).saturating_pow(n);
        self.initial.saturating_mul(mul).min(self.cap)
    }
}

/// How long the requesting queue pair waits for an ACK, and how often it
/// retransmits, before a request fails with `RETRY_EXC_ERR` (the error
/// batch, then a reconnect). Set when the connection is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpRetry {
    /// Local ACK timeout exponent, `0..=31`: 4.096 us * 2^n (0: none).
    pub ack_timeout: u8,
    /// Retransmissions, `0..=7`. Soft-RoCE (rxe) never counts 7 down: a
    /// dead link is then retried until it comes back, and no error surfaces.
    pub retry_cnt: u8,
}

impl Default for QpRetry {
    /// 14 (~67 ms) and 7, as [`crate::verbs::ConnectParams::default`].
    fn default() -> Self {
        QpRetry {
            ack_timeout: 14,
            retry_cnt: 7,
        }
    }
}

impl QpRetry {
    /// Refuse values the verbs attributes cannot hold.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.ack_timeout > 31 {
            return Err(ConfigError::Field {
                field: "qp_retry.ack_timeout",
                value: self.ack_timeout.to_string(),
                reason: "out of range 0..=31".into(),
            });
        }
        if self.retry_cnt > 7 {
            return Err(ConfigError::Field {
                field: "qp_retry.retry_cnt",
                value: self.retry_cnt.to_string(),
                reason: "out of range 0..=7".into(),
            });
        }
        Ok(())
    }
}

/// A configuration value that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A field out of range.
    #[error("{field} = {value}: {reason}")]
    Field {
        /// The field.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        reason: String,
    },
}

/// How the data path runs a transfer over a channel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataPathConfig {
    /// Chain length per doorbell, `1..=64`.
    pub batch: usize,
    /// Signal every n-th request of a chain (the last one always), `1..=batch`.
    pub signal_every: usize,
    /// Inline writes up to this many bytes; `None`:
    /// min([`DEFAULT_MAX_INLINE`], channel caps);
    /// `Some(0)` disables. Always clamped to the channel's caps.
    pub max_inline: Option<u32>,
    /// How the completion thread waits.
    pub poll_mode: PollMode,
    /// Pin the completion thread to this CPU (`None`: unpinned).
    pub cq_cpu: Option<usize>,
    /// A request outstanding this long fails the epoch (zero disables).
    pub request_timeout: Duration,
    /// How long the error path waits for the failed epoch's flushes before
    /// reconnecting anyway (providers that do not flush unsignaled requests).
    pub flush_timeout: Duration,
    /// Between reconnect attempts.
    pub backoff: Backoff,
    /// Reconnects in a row without progress before the transfer fails.
    pub max_reconnects: u32,
    /// ACK timeout and retry count of the requesting queue pair (applied by
    /// whoever connects it, e.g. the client's link).
    pub qp_retry: QpRetry,
    /// Most requests outstanding on the queue pair (perftest's `--tx-depth`);
    /// `None`: the send-queue depth. Clamped to the send-queue depth.
    pub tx_depth: Option<usize>,
    /// Post at most this many bytes per second (`None`: as fast as the
    /// channel goes): the posting thread takes a chain's bytes from a
    /// [`TokenBucket`](super::TokenBucket) before it posts it.
    pub rate_limit: Option<super::RateLimit>,
    /// How a rail that fails repeatedly is paused (data paths of several
    /// rails).
    pub rail_pause: RailPause,
}

/// How a data path of several rails pauses a rail that fails repeatedly:
/// a failure within `flap_window` of the rail's previous one pauses it for
/// `initial`, doubling with each further repeat up to `cap`
/// ([`crate::engine::stream::RailPolicy`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RailPause {
    /// Failures this close together are repeats.
    pub flap_window: Duration,
    /// The first cool-down (zero: never pause).
    pub initial: Duration,
    /// The longest.
    pub cap: Duration,
}

impl Default for RailPause {
    /// Repeats within 60 s; 1 s, 2 s, 4 s, ... up to 32 s.
    fn default() -> Self {
        RailPause {
            flap_window: Duration::from_secs(60),
            initial: Duration::from_secs(1),
            cap: Duration::from_secs(32),
        }
    }
}

impl RailPause {
    /// The engine's policy, in nanoseconds.
    pub fn policy(&self) -> crate::engine::stream::RailPolicy {
        let ns = |d: Duration| d.as_nanos().min(u64::MAX as u128) as u64;
        crate::engine::stream::RailPolicy {
            flap_window_ns: ns(self.flap_window),
            cooldown_ns: ns(self.initial),
            cooldown_cap_ns: ns(self.cap),
        }
    }
}

impl Default for DataPathConfig {
    /// What a copy over verbs uses when nothing is set (rcp's and rcpd's
    /// flag defaults come from here): chains of 32 signaled at the tail,
    /// inline up to [`DEFAULT_MAX_INLINE`], hybrid polling, unpinned,
    /// [`DEFAULT_REQUEST_TIMEOUT`].
    fn default() -> Self {
        DataPathConfig {
            batch: 32,
            signal_every: 32,
            max_inline: None,
            poll_mode: PollMode::default_for(ProviderKind::Verbs),
            cq_cpu: None,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            flush_timeout: Duration::from_secs(2),
            backoff: Backoff::default(),
            max_reconnects: 3,
            qp_retry: QpRetry::default(),
            tx_depth: None,
            rate_limit: None,
            rail_pause: RailPause::default(),
        }
    }
}

impl DataPathConfig {
    /// Check the fields that have ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        BatchPolicy::new(self.batch, self.signal_every).map_err(|e| ConfigError::Field {
            field: "batch/signal_every",
            value: format!("{}/{}", self.batch, self.signal_every),
            reason: e.to_string(),
        })?;
        if self.backoff.max_attempts == 0 {
            return Err(ConfigError::Field {
                field: "backoff.max_attempts",
                value: "0".into(),
                reason: "at least one reconnect attempt".into(),
            });
        }
        self.qp_retry.validate()?;
        if let Some(r) = self.rate_limit {
            if r.bytes_per_sec == 0 || r.burst == 0 {
                return Err(ConfigError::Field {
                    field: "rate_limit",
                    value: format!("{}/{}", r.bytes_per_sec, r.burst),
                    reason: "rate and burst must be at least 1 byte".into(),
                });
            }
        }
        if self.tx_depth == Some(0) {
            return Err(ConfigError::Field {
                field: "tx_depth",
                value: "0".into(),
                reason: "at least one request outstanding".into(),
            });
        }
        Ok(())
    }

    /// The inline limit on a channel with `caps`.
    pub fn inline_for(&self, caps: &ChannelCaps) -> u32 {
        self.max_inline
            .unwrap_or(DEFAULT_MAX_INLINE)
            .min(caps.max_inline)
    }

    /// The stream configuration over a channel with `caps`: the send-queue
    /// depth (capped by `tx_depth`), the batch policy, the inline limit
    /// (decided here, once), the request timeout and the retry budget.
    pub fn stream_config(&self, caps: &ChannelCaps) -> Result<StreamConfig, ConfigError> {
        self.validate()?;
        let sq = caps.sq_depth as usize;
        let depth = self.tx_depth.map_or(sq, |d| d.min(sq));
        let mut c = StreamConfig::new(depth);
        c.batch = BatchPolicy::new(self.batch, self.signal_every).expect("validated");
        c.max_inline = self.inline_for(caps);
        c.request_timeout_ns = self.request_timeout.as_nanos().min(u64::MAX as u128) as u64;
        c.max_reconnects = self.max_reconnects;
        c.rail_policy = self.rail_pause.policy();
        c.validate().map_err(|e| ConfigError::Field {
            field: "sq_depth",
            value: depth.to_string(),
            reason: e.to_string(),
        })?;
        Ok(c)
    }
}

/// Where completion threads run (`--cq-cpu auto|none|N`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CqCpu {
    /// Pinned to a CPU of the device's NUMA node that this process may use,
    /// the node's last first (CPU 0 of a node tends to take the most
    /// interrupts); without NUMA information (rxe, some VMs), the last CPU
    /// the process may use. Unpinned when the process may use one CPU only:
    /// a spinning completion thread would then starve the poster.
    Auto,
    /// Wherever the scheduler puts it.
    #[default]
    Unpinned,
    /// This CPU.
    Cpu(usize),
}

impl CqCpu {
    /// The CPUs to pin completion threads to, in order of use (thread `i`
    /// takes entry `i % len`); empty: unpinned.
    pub fn cpus(self, numa_node: Option<u32>) -> Vec<usize> {
        match self {
            CqCpu::Unpinned => Vec::new(),
            CqCpu::Cpu(c) => vec![c],
            CqCpu::Auto => {
                let allowed = super::cpus::allowed_cpus();
                let node = numa_node.map(crate::mem::numa::node_cpus);
                auto_cpus(&allowed, node.as_deref())
            }
        }
    }

    /// The CPU of completion thread `i` (see [`cpus`](Self::cpus)).
    pub fn for_thread(self, numa_node: Option<u32>, i: usize) -> Option<usize> {
        let cpus = self.cpus(numa_node);
        (!cpus.is_empty()).then(|| cpus[i % cpus.len()])
    }
}

/// The node CPUs at which a dedicated completion core pays by default: one
/// core polling, one posting, the rest hashing and doing file I/O.
pub const DEDICATED_CQ_FROM_CPUS: usize = 4;

impl CqCpu {
    /// What `--cq-cpu` means when not given, for a copy: a dedicated,
    /// pinned completion core ([`CqCpu::Auto`]) when the device's node
    /// offers the process at least [`DEDICATED_CQ_FROM_CPUS`] CPUs,
    /// unpinned below that (on 2 vCPUs pinning measured worse). Also the
    /// sentence that says which, for `-v`.
    pub fn default_for_copies(numa_node: Option<u32>) -> (CqCpu, String) {
        Self::default_for_cpus(node_cpus_allowed(numa_node).len())
    }

    /// [`default_for_copies`](Self::default_for_copies) for a node that
    /// offers the process `n` CPUs.
    pub fn default_for_cpus(n: usize) -> (CqCpu, String) {
        if n >= DEDICATED_CQ_FROM_CPUS {
            (
                CqCpu::Auto,
                format!("completion thread on a dedicated core: the device's node offers {n} CPUs"),
            )
        } else {
            (
                CqCpu::Unpinned,
                format!(
                    "completion thread unpinned: the device's node offers {n} CPUs, fewer than {DEDICATED_CQ_FROM_CPUS}"
                ),
            )
        }
    }
}

/// [`CqCpu::Auto`]'s choice from the CPUs the process may use and those of
/// the device's node (when known), last first.
fn auto_cpus(allowed: &[usize], node: Option<&[usize]>) -> Vec<usize> {
    if allowed.len() < 2 {
        return Vec::new();
    }
    let on_node: Vec<usize> = node
        .unwrap_or(&[])
        .iter()
        .copied()
        .filter(|c| allowed.contains(c))
        .collect();
    let mut out = if on_node.is_empty() {
        allowed.to_vec()
    } else {
        on_node
    };
    out.sort_unstable();
    out.reverse();
    out
}

impl fmt::Display for CqCpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CqCpu::Auto => f.write_str("auto"),
            CqCpu::Unpinned => f.write_str("none"),
            CqCpu::Cpu(c) => write!(f, "{c}"),
        }
    }
}

impl FromStr for CqCpu {
    type Err = String;
    /// `auto`, `none` (or `-1`) or a CPU number.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(CqCpu::Auto),
            "none" | "-1" => Ok(CqCpu::Unpinned),
            n => match n.parse::<usize>() {
                Ok(c) if c < libc::CPU_SETSIZE as usize => Ok(CqCpu::Cpu(c)),
                Ok(c) => Err(format!(
                    "CPU {c} is beyond CPU_SETSIZE {}",
                    libc::CPU_SETSIZE
                )),
                Err(_) => Err(format!("{n:?}: expected auto, none or a CPU number")),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_dedicated_completion_core_by_default_from_4_cpus() {
        for n in 0..4 {
            assert_eq!(CqCpu::default_for_cpus(n).0, CqCpu::Unpinned, "{n} CPUs");
        }
        for n in [4, 8, 64] {
            let (c, why) = CqCpu::default_for_cpus(n);
            assert_eq!(c, CqCpu::Auto, "{n} CPUs");
            assert!(
                why.contains("dedicated") && why.contains(&n.to_string()),
                "{why}"
            );
        }
    }

    use super::*;

    #[test]
    fn defaults() {
        let c = DataPathConfig::default();
        assert_eq!((c.batch, c.signal_every), (32, 32));
        assert_eq!(
            c.poll_mode,
            PollMode::Hybrid {
                empty_polls: DEFAULT_EMPTY_POLLS
            }
        );
        assert_eq!(c.request_timeout, DEFAULT_REQUEST_TIMEOUT);
        assert_eq!(c.max_inline, None);
        let caps = ChannelCaps {
            sq_depth: 128,
            max_inline: 220,
            max_sge: 1,
        };
        assert_eq!(c.inline_for(&caps), 64);
        let small = ChannelCaps {
            max_inline: 28,
            ..caps
        };
        assert_eq!(c.inline_for(&small), 28);
        // A tx depth caps the engine's credits, never above the SQ.
        for (want, got) in [(Some(1), 1), (Some(16), 16), (Some(4096), 128)] {
            let sc = DataPathConfig {
                tx_depth: want,
                ..c.clone()
            }
            .stream_config(&caps)
            .unwrap();
            assert_eq!(sc.sq_depth, got, "{want:?}");
        }
        let sc = c.stream_config(&caps).unwrap();
        assert_eq!((sc.sq_depth, sc.max_inline, sc.batch.batch), (128, 64, 32));
        assert_eq!(
            sc.request_timeout_ns,
            DEFAULT_REQUEST_TIMEOUT.as_nanos() as u64
        );
        let sc = DataPathConfig {
            tx_depth: Some(16),
            max_inline: Some(0),
            ..c.clone()
        }
        .stream_config(&caps)
        .unwrap();
        assert_eq!((sc.sq_depth, sc.max_inline), (16, 0));
        let no_sq = ChannelCaps {
            sq_depth: 0,
            ..caps
        };
        assert!(c.stream_config(&no_sq).is_err());
        let e = DataPathConfig {
            tx_depth: Some(0),
            ..c.clone()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("tx_depth = 0"), "{e}");
    }

    #[test]
    fn poll_mode_parses_and_prints_back() {
        assert_eq!("poll".parse::<PollMode>(), Ok(PollMode::Poll));
        assert_eq!(" event ".parse::<PollMode>(), Ok(PollMode::Event));
        assert_eq!(
            "hybrid".parse::<PollMode>(),
            Ok(PollMode::Hybrid {
                empty_polls: DEFAULT_EMPTY_POLLS
            })
        );
        assert_eq!(
            "hybrid:10".parse::<PollMode>(),
            Ok(PollMode::Hybrid { empty_polls: 10 })
        );
        for bad in ["spin", "hybrid:0", "hybrid:x", ""] {
            assert!(bad.parse::<PollMode>().is_err(), "{bad:?}");
        }
        for m in [
            PollMode::Poll,
            PollMode::Event,
            PollMode::Hybrid { empty_polls: 7 },
        ] {
            assert_eq!(m.to_string().parse::<PollMode>(), Ok(m));
        }
    }

    #[test]
    fn cq_cpu_parses_and_auto_prefers_the_device_node() {
        assert_eq!("auto".parse::<CqCpu>(), Ok(CqCpu::Auto));
        assert_eq!("none".parse::<CqCpu>(), Ok(CqCpu::Unpinned));
        assert_eq!(" 3 ".parse::<CqCpu>(), Ok(CqCpu::Cpu(3)));
        let e = "fast".parse::<CqCpu>().unwrap_err();
        assert!(e.contains("\"fast\"") && e.contains("auto"), "{e}");
        assert!("99999"
            .parse::<CqCpu>()
            .unwrap_err()
            .contains("CPU_SETSIZE"));
        for c in [CqCpu::Auto, CqCpu::Unpinned, CqCpu::Cpu(7)] {
            assert_eq!(c.to_string().parse::<CqCpu>(), Ok(c));
        }
        // Last CPU of the device's node that the process may use.
        assert_eq!(auto_cpus(&[0, 1, 2, 3], Some(&[0, 1])), vec![1, 0]);
        assert_eq!(auto_cpus(&[0, 2], Some(&[0, 1])), vec![0]);
        // No NUMA information, or the node's CPUs all outside the cpuset:
        // the process's own CPUs, last first.
        assert_eq!(auto_cpus(&[0, 1], None), vec![1, 0]);
        assert_eq!(auto_cpus(&[4, 5], Some(&[0, 1])), vec![5, 4]);
        // One CPU: a pinned spinning thread would starve the poster.
        assert!(auto_cpus(&[3], Some(&[3])).is_empty());
        assert_eq!(CqCpu::Unpinned.for_thread(None, 0), None);
        assert_eq!(CqCpu::Cpu(5).for_thread(None, 3), Some(5));
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let b = Backoff::default();
        let d: Vec<u64> = (0..8).map(|n| b.delay(n).as_millis() as u64).collect();
        assert_eq!(d, [50, 100, 200, 400, 800, 1600, 2000, 2000]);
        assert_eq!(b.delay(40), Duration::from_secs(2));
    }
}
