//! Protocol front-ends: each translates its wire format into one engine call and back.
pub mod encoding;
pub mod generate;
pub mod grpc;
pub mod guard;
pub mod http;
pub mod http_ext;
pub mod instances;
pub mod json;
pub mod metrics;
pub mod net;
pub mod openai;
pub mod platform;
pub mod restrict;
pub mod sagemaker;
pub mod tls;
pub mod vertex;
