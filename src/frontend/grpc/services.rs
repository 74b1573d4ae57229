//! The gRPC services generated from proto/ (tonic's server traits and routers), over the message
//! types of `crate::proto`: the messages are data every layer may use, the services belong here.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod inference {
    include!(concat!(env!("OUT_DIR"), "/services/inference.rs"));
}

#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod health {
    include!(concat!(env!("OUT_DIR"), "/services/grpc.health.v1.rs"));
}
