//! `rcp push --fanout` when nodes fail (docs/fanout.md), natively over the
//! tcp provider: a middle node killed mid-copy, a node missing at the
//! start, a node refusing the token; and the Copy API's fan-out. The chain
//! itself runs over every transport in the shared end-to-end scenarios
//! (`fanout_chain_of_three`, over verbs in the soft-RoCE VM).

mod common;

use common::e2e_fanout::{self, Nodes};
use common::*;
use rcp::control::{Client, ClientOptions};
use rcp::proto::{CopyRequest, Direction};

const T: &str = "tcp";

#[test]
fn middle_node_killed_mid_copy_is_routed_around() {
    e2e_fanout::middle_node_killed(T);
}

#[test]
fn node_missing_at_the_start_is_skipped() {
    e2e_fanout::node_missing_at_the_start(T);
}

#[test]
fn node_refusing_the_token_is_failed_and_routed_around() {
    e2e_fanout::node_refusing_the_token(T);
}

/// A service asks node 0 to push its file along the chain: the final
/// progress names every node done, and each holds the file.
#[test]
fn copy_api_fans_out_from_an_rcpd() {
    let nodes = Nodes::start(T, 3, |_| "tok");
    std::fs::create_dir_all(nodes.roots[0].join("data")).unwrap();
    let src = nodes.roots[0].join("data/x.bin");
    make_file(&src, (6 << 20) + 11, 31);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let last = rt.block_on(async {
        let opts = ClientOptions {
            token: Some("tok".into()),
            ..ClientOptions::default()
        };
        let c = Client::connect(&nodes.addr(0), opts).await.unwrap();
        let mut s = c
            .copy(CopyRequest {
                direction: Direction::Push as i32,
                local_path: "data/x.bin".into(),
                remote: nodes.addr(1),
                remote_path: "x.bin".into(),
                transport: T.into(),
                fanout: vec![nodes.addr(2)],
                ..Default::default()
            })
            .await
            .unwrap();
        let mut last = None;
        while let Some(p) = s.message().await.unwrap() {
            last = Some(p);
        }
        last.unwrap()
    });
    assert!(
        last.done && last.error.is_empty(),
        "{last:?}\n{}",
        nodes.logs()
    );
    let done: Vec<(String, bool)> = last
        .nodes
        .iter()
        .map(|n| (n.node.clone(), n.done))
        .collect();
    assert_eq!(done, vec![(nodes.addr(1), true), (nodes.addr(2), true)]);
    for i in [1, 2] {
        assert_eq!(sha256sum(&nodes.roots[i].join("x.bin")), sha256sum(&src));
    }
}
