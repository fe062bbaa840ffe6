//! Async device events on soft-RoCE: the port of an rxe device goes down and
//! up with its netdev, and the [`PortWatcher`] must see `PORT_ERR` then
//! `PORT_ACTIVE`.
//!
//! `#[ignore]`d in a plain `cargo test` (no device, and they flip a link).
//! The VM suite runs them in the netns topology (target name ends in
//! `netns_fabric`): `rxeb` on `vb` in namespace `b`. Elsewhere:
//! `RCP_EVENTS_DEV` (device), `RCP_EVENTS_NETDEV` (its netdev),
//! `RCP_EVENTS_NETNS` (the netdev's namespace, empty for the current one).

use std::process::Command;
use std::time::{Duration, Instant};

use rcp::verbs::*;

/// How long a test waits for an event that must come (a hang guard).
const GUARD: Duration = Duration::from_secs(60);

fn env(var: &str, default: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| default.to_string())
}

fn link(state: &str) {
    let ns = env("RCP_EVENTS_NETNS", "b");
    let dev = env("RCP_EVENTS_NETDEV", "vb");
    let mut c = Command::new("ip");
    if !ns.is_empty() {
        c.args(["-n", &ns]);
    }
    let st = c
        .args(["link", "set", &dev, state])
        .status()
        .expect("run ip");
    assert!(st.success(), "ip link set {dev} {state}: {st}");
    eprintln!("link {dev} (netns {ns:?}) {state}");
}

fn open() -> std::sync::Arc<Context> {
    let name = env("RCP_EVENTS_DEV", "rxeb");
    Context::open(Some(&name)).expect("open the device")
}

#[test]
#[ignore = "needs an RDMA device (soft-RoCE VM)"]
fn async_fd_is_nonblocking_and_quiet_when_idle() {
    let ctx = open();
    let ev = AsyncEvents::new(&ctx).unwrap();
    assert!(ev.fd() >= 0);
    assert!(ev.is_nonblocking());
    // Nothing happened to the device since it was opened: the wait ends
    // with its timeout, and with no event.
    let got = ev.wait(Duration::from_millis(200)).unwrap();
    assert!(got.is_none(), "an event on an idle device: {got:?}");
}

#[test]
#[ignore = "needs an RDMA device (soft-RoCE VM) and flips its link"]
fn link_down_up_gives_port_err_then_port_active() {
    let ctx = open();
    let port = ctx.active_port().expect("an ACTIVE port").port;
    let w = PortWatcher::spawn(&ctx, port).unwrap();
    assert!(w.is_active());
    let t0 = Instant::now();
    link("down");
    let err = w.wait_event(AsyncEventKind::PortErr, t0, GUARD);
    let after_down = ctx.port(port).map(|p| p.state);
    eprintln!(
        "after down: event {err:?} in {:?}, port state {after_down:?}, watcher active {}",
        t0.elapsed(),
        w.is_active()
    );
    let t1 = Instant::now();
    link("up");
    let up = w.wait_event(AsyncEventKind::PortActive, t1, GUARD);
    let after_up = ctx.port(port).map(|p| p.state);
    eprintln!(
        "after up: event {up:?} in {:?}, port state {after_up:?}, watcher active {}",
        t1.elapsed(),
        w.is_active()
    );
    eprintln!("history: {:?}", w.history());
    let err = err.expect("PORT_ERR after the link went down");
    assert_eq!(err.port, Some(port));
    let up = up.expect("PORT_ACTIVE after the link came up");
    assert_eq!(up.port, Some(port));
    assert!(w.wait_active(GUARD));
    assert!(w.events_seen() >= 2);
}
