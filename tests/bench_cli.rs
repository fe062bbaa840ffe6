//! `rcp bench` refuses bad input with exit code 1 and a message naming the
//! option, before it touches a device (so this runs natively).

mod common;

use std::process::Command;

fn bench(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let mut c = Command::new(common::bin("rcp"));
    c.arg("bench").args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("run rcp");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Arguments, environment, what stderr must say.
type Case = (
    &'static [&'static str],
    &'static [(&'static str, &'static str)],
    &'static str,
);

#[test]
fn bad_options_exit_1_with_a_clear_message() {
    let cases: &[Case] = &[
        (&["--size", "0"], &[], "--size 0"),
        (&["--size", "1G"], &[], "--size 1073741824"),
        (&["--batch", "0"], &[], "--batch 0: must be in 1..=64"),
        (&["--batch", "65", "--signal-every", "1"], &[], "--batch 65"),
        (
            &["--batch", "8", "--signal-every", "16"],
            &[],
            "--signal-every 16",
        ),
        (&["--op", "send"], &[], "unknown op \"send\""),
        (&["--mode", "spin"], &[], "expected poll, event, hybrid"),
        (
            &["--cq-cpu", "fast"],
            &[],
            "expected auto, none or a CPU number",
        ),
        (&[], &[("RCP_CQ_CPU", "99999")], "beyond CPU_SETSIZE"),
        (&["--iters", "0"], &[], "--iters 0"),
        (
            &["--iters", "5", "--seconds", "1"],
            &[],
            "cannot be used with",
        ),
        (&["--qps", "0"], &[], "--qps 0"),
        (
            &["--tx-depth", "0"],
            &[],
            "--tx-depth 0: must be in 1..=128",
        ),
        (&["-t", "129"], &[], "--tx-depth 129"),
        (&[], &[("RCP_BENCH_TX_DEPTH", "500")], "--tx-depth 500"),
        (&["--qp-retry-cnt", "8"], &[], "--qp-retry-cnt"),
        (&[], &[("RCP_QP_TIMEOUT", "32")], "--qp-timeout"),
        (&["--server", "somehost"], &[], "cannot be used with"),
        (&["somehost:notaport"], &[], "is not HOST[:PORT]"),
        (&[], &[("RCP_BENCH_QPS", "9")], "--qps 9"),
        (&[], &[("RCP_BATCH", "100")], "--batch 100"),
        (&[], &[("RCP_BENCH_OP", "atomic")], "unknown op"),
        (
            &["--device", "rxe0,rxe1"],
            &[],
            "--device rxe0,rxe1: rcp bench measures one device",
        ),
        (&["--device", "rxe0:0"], &[], "a port is a number 1..=255"),
        (&[], &[("RCP_DEVICE", "rxe0,,rxe1")], "an empty rail name"),
        (&["--device", "rxe0,rxe0"], &[], "a rail named twice"),
        (&["--qps-per-rail", "0"], &[], "--qps-per-rail"),
        (&[], &[("RCP_QPS_PER_RAIL", "17")], "17"),
    ];
    for (args, env, want) in cases {
        let (code, err) = bench(args, env);
        assert_eq!(
            code, 1,
            "rcp bench {args:?} {env:?}: exit {code}, stderr {err}"
        );
        assert!(
            err.contains(want),
            "rcp bench {args:?} {env:?}: {err:?} lacks {want:?}"
        );
    }
}

/// `rcp bench --transport tcp`: loopback through the TCP provider on a
/// host without RDMA, the same bench line (messages counted, the
/// transport named); the modes that need a peer's device are refused.
#[test]
fn bench_runs_over_tcp() {
    let out = Command::new(common::bin("rcp"))
        .args([
            "bench",
            "--transport",
            "tcp",
            "--iters",
            "300",
            "--size",
            "8K",
        ])
        .output()
        .expect("run rcp");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    let line = stdout.lines().next().unwrap_or_default();
    assert!(line.starts_with("bench op=write size=8192 "), "{line}");
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k}= in {line}"))
            .to_string()
    };
    assert_eq!(field("msgs"), "300", "{line}");
    assert!(field("gbps").parse::<f64>().unwrap() > 0.0, "{line}");
    assert_eq!(field("transport"), "tcp", "{line}");
    assert!(stderr.contains("rcp bench: write 8192 B x 300"), "{stderr}");
    let (code, err) = bench(&["--transport", "tcp", "--server"], &[]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("over tcp rcp bench runs loopback only"),
        "{err}"
    );
}
