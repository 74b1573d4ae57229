//! The KServe v2 JSON codec for infer requests and replies, with the binary tensor data
//! extension.
mod data;
mod decode;
mod encode;

pub use data::decode as decode_data;
pub use decode::{Listed, OutputFormat, decode, decode_raw, parameters};
pub use encode::{Encoded, encode};

#[cfg(test)]
mod tests;
