//! The bench handshake over TCP: one line per message, words separated by
//! spaces, no serde.
//!
//! ```text
//! client: rcp-bench 1 qps N
//! server: qp QPN PSN GID LID MTU RD_ATOM INIT_RD_ATOM ADDR RKEY LEN   (N lines)
//! client: qp QPN PSN GID LID MTU RD_ATOM INIT_RD_ATOM                 (N lines)
//! server: ready            (its QPs are RTS; the client may post)
//! client: done             (the server may free its regions)
//! server: bye
//! ```
//! The server's region (ADDR, RKEY, LEN) is registered for remote WRITE and
//! READ; every QP has its own.

use std::io::{BufRead, Write};

use super::BenchError;
use crate::verbs::{Gid, QpEndpoint};

/// Protocol version in the client's hello.
pub const VERSION: u32 = 1;

/// One side's QP as the peer needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpInfo {
    pub ep: QpEndpoint,
    /// `max_qp_rd_atom`: READs this side accepts as a responder.
    pub rd_atom: u32,
    /// `max_qp_init_rd_atom`: READs this side may issue.
    pub init_rd_atom: u32,
}

/// A registered region of the server's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub addr: u64,
    pub rkey: u32,
    pub len: u64,
}

fn proto(m: impl Into<String>) -> BenchError {
    BenchError::Protocol(m.into())
}

/// Read one line as words; EOF is an error.
pub fn read_words(r: &mut impl BufRead) -> Result<Vec<String>, BenchError> {
    let mut s = String::new();
    let n = r.read_line(&mut s).map_err(|e| BenchError::Io {
        context: "reading from the peer".into(),
        source: e,
    })?;
    if n == 0 {
        return Err(proto("the peer closed the connection"));
    }
    if s.len() > 4096 {
        return Err(proto("line too long"));
    }
    Ok(s.split_whitespace().map(str::to_string).collect())
}

/// Write one line.
pub fn write_line(w: &mut impl Write, line: &str) -> Result<(), BenchError> {
    writeln!(w, "{line}")
        .and_then(|_| w.flush())
        .map_err(|e| BenchError::Io {
            context: "writing to the peer".into(),
            source: e,
        })
}

/// `rcp-bench 1 qps N`.
pub fn hello(qps: usize) -> String {
    format!("rcp-bench {VERSION} qps {qps}")
}

/// The QP count of a hello, refusing other versions and counts over `max`.
pub fn parse_hello(w: &[String], max: usize) -> Result<usize, BenchError> {
    match w {
        [magic, v, k, n] if magic == "rcp-bench" && k == "qps" => {
            if v.parse::<u32>() != Ok(VERSION) {
                return Err(proto(format!("protocol version {v}, expected {VERSION}")));
            }
            match n.parse::<usize>() {
                Ok(n) if (1..=max).contains(&n) => Ok(n),
                _ => Err(proto(format!("qps {n}: must be in 1..={max}"))),
            }
        }
        _ => Err(proto(format!("not a bench hello: {:?}", w.join(" ")))),
    }
}

/// `qp ...` for a QP, with the server's region when given.
pub fn qp_line(q: &QpInfo, region: Option<&Region>) -> String {
    let e = &q.ep;
    let mut s = format!(
        "qp {} {} {} {} {} {} {}",
        e.qpn,
        e.psn,
        hex::encode(e.gid.0),
        e.lid,
        e.mtu,
        q.rd_atom,
        q.init_rd_atom
    );
    if let Some(r) = region {
        s.push_str(&format!(" {} {} {}", r.addr, r.rkey, r.len));
    }
    s
}

fn num<T: std::str::FromStr>(w: &str, what: &str) -> Result<T, BenchError> {
    w.parse().map_err(|_| proto(format!("bad {what} {w:?}")))
}

/// Parse a `qp` line; `with_region` for the server's lines.
pub fn parse_qp(w: &[String], with_region: bool) -> Result<(QpInfo, Option<Region>), BenchError> {
    let want = if with_region { 11 } else { 8 };
    if w.len() != want || w[0] != "qp" {
        return Err(proto(format!(
            "expected a qp line of {want} words, got {:?}",
            w.join(" ")
        )));
    }
    let gid: [u8; 16] = hex::decode(&w[3])
        .ok()
        .and_then(|g| g.try_into().ok())
        .ok_or_else(|| proto(format!("bad gid {:?}", w[3])))?;
    let mtu: u32 = num(&w[5], "mtu")?;
    if !matches!(mtu, 256 | 512 | 1024 | 2048 | 4096) {
        return Err(proto(format!("mtu {mtu} is not one of 256..4096")));
    }
    let q = QpInfo {
        ep: QpEndpoint {
            qpn: num(&w[1], "qpn")?,
            psn: num::<u32>(&w[2], "psn")? & 0x00ff_ffff,
            gid: Gid(gid),
            lid: num(&w[4], "lid")?,
            mtu,
        },
        rd_atom: num(&w[6], "rd_atom")?,
        init_rd_atom: num(&w[7], "init_rd_atom")?,
    };
    let region = if with_region {
        Some(Region {
            addr: num(&w[8], "addr")?,
            rkey: num(&w[9], "rkey")?,
            len: num(&w[10], "len")?,
        })
    } else {
        None
    };
    Ok((q, region))
}

/// Expect a one-word line.
pub fn expect(r: &mut impl BufRead, word: &str) -> Result<(), BenchError> {
    let w = read_words(r)?;
    if w.len() == 1 && w[0] == word {
        Ok(())
    } else {
        Err(proto(format!("expected {word:?}, got {:?}", w.join(" "))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn round_trips() {
        let q = QpInfo {
            ep: QpEndpoint {
                qpn: 17,
                psn: 0xabcdef,
                gid: Gid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 168, 77, 2]),
                lid: 0,
                mtu: 1024,
            },
            rd_atom: 128,
            init_rd_atom: 128,
        };
        let r = Region {
            addr: 0x7f00_0000_0000,
            rkey: 0x1234,
            len: 32 << 20,
        };
        assert_eq!(
            parse_qp(&words(&qp_line(&q, Some(&r))), true).unwrap(),
            (q, Some(r))
        );
        assert_eq!(
            parse_qp(&words(&qp_line(&q, None)), false).unwrap(),
            (q, None)
        );
        assert!(parse_qp(&words(&qp_line(&q, None)), true).is_err());
        assert_eq!(parse_hello(&words(&hello(3)), 8).unwrap(), 3);
    }

    #[test]
    fn garbage_is_refused() {
        assert!(parse_hello(&words("rcp-bench 2 qps 1"), 8).is_err());
        assert!(parse_hello(&words("rcp-bench 1 qps 0"), 8).is_err());
        assert!(parse_hello(&words("rcp-bench 1 qps 9"), 8).is_err());
        assert!(parse_hello(&words("GET / HTTP/1.1"), 8).is_err());
        assert!(parse_qp(&words("qp 1 2 zz 0 1024 1 1"), false).is_err());
        assert!(parse_qp(&words("qp 1 2 00 0 1024 1 1"), false).is_err());
        let g = "0".repeat(32);
        assert!(parse_qp(&words(&format!("qp 1 2 {g} 0 1000 1 1")), false).is_err());
        assert!(parse_qp(&words(&format!("qp 1 2 {g} 0 1024 1 1")), false).is_ok());
        let mut r = std::io::Cursor::new(b"ready\nnope\n".to_vec());
        expect(&mut r, "ready").unwrap();
        assert!(expect(&mut r, "ready").is_err());
        assert!(read_words(&mut r).is_err(), "EOF");
    }
}
