//! The message types generated from proto/ (packages `inference` and `grpc.health.v1`; the gRPC
//! services are generated apart, for `frontend::grpc`), the descriptor pool that reflection needs,
//! and config.pbtxt's text format.
use std::sync::LazyLock;

use prost_reflect::DescriptorPool;

pub mod pbtxt;

#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod inference {
    include!(concat!(env!("OUT_DIR"), "/inference.rs"));
}

#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod health {
    include!(concat!(env!("OUT_DIR"), "/grpc.health.v1.rs"));
}

/// Every message of proto/, for text-format parsing and JSON printing through prost-reflect.
pub static DESCRIPTORS: LazyLock<DescriptorPool> = LazyLock::new(|| {
    DescriptorPool::decode(&include_bytes!(concat!(env!("OUT_DIR"), "/ferry_descriptor.bin"))[..])
        .expect("the descriptor set built by build.rs decodes")
});
