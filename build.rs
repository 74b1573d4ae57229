//! Compiles proto/ with protox (no system protoc): Rust types through tonic-prost-build, and the
//! file descriptor set that prost-reflect needs at run time to parse config.pbtxt text format.
use std::{env, fs, path::PathBuf};

use prost::Message;

const PROTOS: &[&str] = &["proto/model_config.proto"];

fn main() {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let fds = protox::compile(PROTOS, ["proto"]).expect("compile proto/ with protox");
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    fs::write(out.join("ferry_descriptor.bin"), fds.encode_to_vec()).expect("write descriptor set");
    tonic_prost_build::configure()
        .build_client(false)
        .compile_fds(fds)
        .expect("generate Rust from proto/");
}
