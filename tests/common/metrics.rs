//! Scraping rcpd's `/metrics` and the metrics-during-a-copy scenario shared by
//! the native (tcp) and the VM (verbs) test targets.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::{make_file, sha256sum, Rcpd};
use rcp::control::{Client, ClientOptions};
use rcp::proto::{CopyRequest, Direction};

/// `GET /metrics` from `url` (`http://host:port/metrics`): the body, after
/// checking the status line and that every sample line is `series value`.
pub fn scrape(url: &str) -> String {
    let hostport = url
        .trim_start_matches("http://")
        .trim_end_matches("/metrics");
    let mut s = TcpStream::connect(hostport).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(
        head.starts_with("HTTP/1.") && head.contains(" 200 "),
        "{head}"
    );
    for line in body
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (series, value) = line.rsplit_once(' ').expect("`series value`");
        assert!(series.starts_with("rcp"), "unexpected series in {line:?}");
        assert!(
            value.parse::<f64>().is_ok(),
            "value of {series} is not a number: {line:?}"
        );
    }
    body.to_string()
}

/// The value of the sample whose series (name plus labels, as rendered) is
/// exactly `series`.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let (s, v) = l.rsplit_once(' ')?;
        (s == series).then(|| v.parse().ok())?
    })
}

/// Every sample whose series starts with `prefix`.
pub fn samples<'a>(text: &'a str, prefix: &str) -> Vec<(&'a str, f64)> {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| {
            let (s, v) = l.rsplit_once(' ')?;
            Some((s, v.parse().ok()?))
        })
        .collect()
}

/// rcpd A copies a file of `len` bytes to rcpd B (the service API) over
/// `transport` (held by A's `--bwlimit`); while it runs, A's /metrics shows its data path's queue
/// gauges and B's an active transfer; afterwards B counts the transfer and
/// its bytes, A the post-to-completion latency, and the gauges are gone;
/// B registered no memory meanwhile (over verbs it bound memory windows).
pub fn metrics_during_copy(transport: &str, dir: &std::path::Path, len: u64) {
    let (ra, rb) = (dir.join("a"), dir.join("b"));
    std::fs::create_dir_all(&ra).unwrap();
    std::fs::create_dir_all(&rb).unwrap();
    make_file(&ra.join("big"), len, 77);
    // A's copies held to a quarter of the file a second: the copy lasts 4 s
    // at least however fast the machine, and the scrapes below see it busy.
    let rate = (len / 4).to_string();
    // No warm sessions: the Copy's session closes at its end, which files
    // its data path's latency and takes its gauges away.
    let a = Rcpd::start(
        &ra,
        transport,
        Some("tok"),
        &[
            "--bwlimit",
            &rate,
            "--copy-session-idle",
            "0",
            "--copy-peers",
            &super::copy_peers(),
        ],
    );
    let b = Rcpd::start(&rb, transport, Some("tok"), &[]);
    let (ma, mb) = (a.metrics.clone().unwrap(), b.metrics.clone().unwrap());
    let before = scrape(&mb);
    assert_eq!(
        sample(&before, "rcp_active_transfers"),
        Some(0.0),
        "{before}"
    );

    let (a_addr, b_addr, t) = (a.addr(), b.addr(), transport.to_string());
    let copy = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let opts = ClientOptions {
                token: Some("tok".into()),
                ..ClientOptions::default()
            };
            let c = Client::connect(&a_addr, opts).await.unwrap();
            let req = CopyRequest {
                direction: Direction::Push as i32,
                local_path: "big".into(),
                remote: b_addr,
                remote_path: "big".into(),
                transport: t,
                remote_token: "tok".into(),
                ..Default::default()
            };
            let mut s = c.copy(req).await.unwrap();
            let mut last = None;
            while let Some(p) = s.message().await.unwrap() {
                last = Some(p);
            }
            last.expect("a final progress message")
        })
    });

    // During the copy: A drives a data path, B serves a transfer.
    let device = if transport == "tcp" { "tcp" } else { "" };
    let t0 = Instant::now();
    let (mut seen_a, mut seen_b) = (None, false);
    while seen_a.is_none() || !seen_b {
        assert!(
            !copy.is_finished(),
            "the copy ended before both endpoints were seen busy (A: {seen_a:?}, B: {seen_b})"
        );
        assert!(t0.elapsed() < Duration::from_secs(120), "no busy scrape");
        let ta = scrape(&ma);
        let gauges = samples(&ta, "rcp_sq_free_slots{");
        if let Some((series, free)) = gauges.first() {
            let depth_series = series.replace("rcp_sq_free_slots", "rcp_sq_depth");
            let depth = sample(&ta, &depth_series).expect("sq depth beside free slots");
            assert!(*free >= 0.0 && *free <= depth && depth > 0.0, "{ta}");
            assert!(
                series.contains(&format!("device=\"{device}")),
                "{series} (want device {device:?})"
            );
            let fill = series.replace("rcp_sq_free_slots", "rcp_cq_fill_ratio");
            let fill = sample(&ta, &fill).expect("cq fill beside free slots");
            assert!((0.0..=1.0).contains(&fill), "{ta}");
            seen_a = Some(series.to_string());
        }
        let tb = scrape(&mb);
        if sample(&tb, "rcp_active_transfers") == Some(1.0) {
            seen_b = true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let last = copy.join().unwrap();
    assert!(last.done && last.error.is_empty(), "{last:?}");
    assert_eq!(last.sha256, sha256sum(&ra.join("big")));
    assert_eq!(sha256sum(&rb.join("big")), last.sha256);

    // After: B counted one good push of `len` bytes; A its WR latencies.
    let tb = scrape(&mb);
    let verbs = |t: &str, what: &str| {
        sample(t, &format!("rcp_verbs_{what}_total")).unwrap_or_else(|| panic!("{what}: {t}"))
    };
    assert_eq!(
        verbs(&tb, "registrations"),
        verbs(&before, "registrations"),
        "B registered memory during the copy: {tb}"
    );
    let binds = verbs(&tb, "window_binds") - verbs(&before, "window_binds");
    if transport == "tcp" {
        assert_eq!(binds, 0.0, "{tb}");
    } else {
        assert!(
            binds >= 1.0,
            "B bound no memory window for its grants: {tb}"
        );
    }
    let ok = r#"rcp_transfers_total{direction="push",outcome="ok"}"#;
    assert_eq!(sample(&tb, ok), Some(1.0), "{tb}");
    assert_eq!(
        sample(&tb, r#"rcp_bytes_total{direction="push"}"#),
        Some(len as f64),
        "{tb}"
    );
    let thr = r#"rcp_transfer_throughput_bytes_per_second_count{direction="push"}"#;
    assert_eq!(sample(&tb, thr), Some(1.0), "{tb}");
    assert_eq!(sample(&tb, "rcp_active_transfers"), Some(0.0), "{tb}");
    let ta = scrape(&ma);
    let lat = sample(&ta, r#"rcp_wr_latency_seconds_count{direction="push"}"#)
        .unwrap_or_else(|| panic!("no latency histogram: {ta}"));
    assert!(lat >= 1.0, "{ta}");
    // The +Inf bucket holds every observation (p99 is computable).
    let inf = sample(
        &ta,
        r#"rcp_wr_latency_seconds_bucket{le="+Inf",direction="push"}"#,
    )
    .or_else(|| {
        sample(
            &ta,
            r#"rcp_wr_latency_seconds_bucket{direction="push",le="+Inf"}"#,
        )
    });
    assert_eq!(inf, Some(lat), "{ta}");
    // The session closed: its queue gauges are gone.
    assert!(samples(&ta, "rcp_sq_free_slots{").is_empty(), "{ta}");
    // A clean copy has no error completions.
    assert!(samples(&ta, "rcp_error_cqes_total{").is_empty(), "{ta}");
}
