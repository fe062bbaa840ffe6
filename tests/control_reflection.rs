//! gRPC server reflection on rcpd's control port, in both versions clients
//! ask for: grpc.reflection.v1 (current grpcurl) and grpc.reflection.v1alpha
//! (older grpcurl, grpcui, Postman). A client of each lists the services and
//! resolves `rcp.v1.Rcp` to the file that defines it.

mod common;

use common::*;
use tokio_stream::StreamExt;
use tonic_reflection::pb::{v1, v1alpha};

/// rcpd over tcp with a token: reflection, like health, answers without it.
fn rcpd() -> (tempfile::TempDir, Rcpd) {
    let (tmp, root) = e2e::tmp_with_root();
    let d = Rcpd::start(&root, "tcp", Some("tok"), &[]);
    (tmp, d)
}

/// A plaintext channel to rcpd's gRPC port (tonic-reflection's generated
/// clients have no `connect` of their own).
async fn channel(d: &Rcpd) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{}", d.addr()))
        .unwrap()
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connect to rcpd: {e}\n{}", d.log()))
}

/// The leading field of a `google.protobuf.FileDescriptorProto`: its name
/// (decoding skips the rest).
#[derive(Clone, PartialEq, prost::Message)]
struct FileName {
    #[prost(string, tag = "1")]
    name: String,
}

fn file_names(files: &[Vec<u8>]) -> Vec<String> {
    use prost::Message;
    files
        .iter()
        .map(|b| {
            FileName::decode(b.as_slice())
                .expect("a FileDescriptorProto")
                .name
        })
        .collect()
}

#[test]
fn reflection_v1_lists_and_resolves_rcp() {
    use v1::server_reflection_client::ServerReflectionClient;
    use v1::server_reflection_request::MessageRequest;
    use v1::server_reflection_response::MessageResponse;
    let (_tmp, d) = rcpd();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = ServerReflectionClient::new(channel(&d).await);
        let reqs = [
            MessageRequest::ListServices(String::new()),
            MessageRequest::FileContainingSymbol("rcp.v1.Rcp".into()),
        ]
        .map(|m| v1::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(m),
        });
        let mut replies = c
            .server_reflection_info(tokio_stream::iter(reqs))
            .await
            .unwrap_or_else(|s| panic!("v1 reflection: {s}\n{}", d.log()))
            .into_inner();
        let Some(MessageResponse::ListServicesResponse(l)) =
            replies.next().await.unwrap().unwrap().message_response
        else {
            panic!("expected a ListServicesResponse");
        };
        let names: Vec<&str> = l.service.iter().map(|s| s.name.as_str()).collect();
        assert!(names.contains(&"rcp.v1.Rcp"), "v1 services: {names:?}");
        let Some(MessageResponse::FileDescriptorResponse(f)) =
            replies.next().await.unwrap().unwrap().message_response
        else {
            panic!("expected a FileDescriptorResponse");
        };
        let files = file_names(&f.file_descriptor_proto);
        assert!(files.contains(&"rcp/v1/rcp.proto".into()), "{files:?}");
    });
}

#[test]
fn reflection_v1alpha_lists_and_resolves_rcp() {
    use v1alpha::server_reflection_client::ServerReflectionClient;
    use v1alpha::server_reflection_request::MessageRequest;
    use v1alpha::server_reflection_response::MessageResponse;
    let (_tmp, d) = rcpd();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut c = ServerReflectionClient::new(channel(&d).await);
        let reqs = [
            MessageRequest::ListServices(String::new()),
            MessageRequest::FileContainingSymbol("rcp.v1.Rcp".into()),
        ]
        .map(|m| v1alpha::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(m),
        });
        let mut replies = c
            .server_reflection_info(tokio_stream::iter(reqs))
            .await
            .unwrap_or_else(|s| panic!("v1alpha reflection: {s}\n{}", d.log()))
            .into_inner();
        let Some(MessageResponse::ListServicesResponse(l)) =
            replies.next().await.unwrap().unwrap().message_response
        else {
            panic!("expected a ListServicesResponse");
        };
        let names: Vec<&str> = l.service.iter().map(|s| s.name.as_str()).collect();
        assert!(names.contains(&"rcp.v1.Rcp"), "v1alpha services: {names:?}");
        let Some(MessageResponse::FileDescriptorResponse(f)) =
            replies.next().await.unwrap().unwrap().message_response
        else {
            panic!("expected a FileDescriptorResponse");
        };
        let files = file_names(&f.file_descriptor_proto);
        assert!(files.contains(&"rcp/v1/rcp.proto".into()), "{files:?}");
    });
}
