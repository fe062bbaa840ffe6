//! rcp: bulk transfer over RDMA.
pub mod proto {
    tonic::include_proto!("rcp.v1");
}
pub mod engine;
