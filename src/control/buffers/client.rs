//! The Rust client of the service protocol (docs/buffers.md).
