//! Human units, one system for everything rcp prints for people: IEC
//! bytes (KiB, MiB, GiB: powers of 1024, as `--bwlimit` and the progress
//! bar count) and rates in the same units per second. Machine output
//! (`--json`, the bench line) keeps exact numbers.

const PREFIXES: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];

/// `512 B`, `1.50 KiB`, `3.00 MiB`, ...
pub fn bytes(n: u64) -> String {
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < PREFIXES.len() {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.2} {}", PREFIXES[i])
}

/// `bytes(n)` per second, for a rate that need not be whole.
pub fn rate(bytes_per_second: f64) -> String {
    let b = if bytes_per_second.is_finite() && bytes_per_second > 0.0 {
        bytes_per_second.round() as u64
    } else {
        0
    };
    format!("{}/s", bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iec_throughout() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1024), "1.00 KiB");
        assert_eq!(bytes(3 << 20), "3.00 MiB");
        assert_eq!(bytes((3 << 30) / 2), "1.50 GiB");
        assert_eq!(rate(25.0 * 1048576.0), "25.00 MiB/s");
        assert_eq!(rate(f64::NAN), "0 B/s");
    }
}
