//! Compiles proto/ with protox (no system protoc): Rust types through tonic-prost-build, and the
//! file descriptor set that prost-reflect needs at run time to parse config.pbtxt text format.
use std::{env, fs, path::PathBuf};

use prost::Message;

const PROTOS: &[&str] = &["proto/model_config.proto", "proto/grpc_service.proto", "proto/health.proto"];

fn main() {
    embed_examples();
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let fds = protox::compile(PROTOS, ["proto"]).expect("compile proto/ with protox");
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    fs::write(out.join("ferry_descriptor.bin"), fds.encode_to_vec()).expect("write descriptor set");
    // The messages (plain data, `crate::proto`), then the gRPC services alone (tonic, for
    // `frontend::grpc`), which name the messages where they live.
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(false)
        // Tensor bytes stay `Bytes`: decoded without a copy, sliced into tensors as they are.
        .bytes(".inference.ModelInferRequest.raw_input_contents")
        .bytes(".inference.ModelInferResponse.raw_output_contents")
        .compile_fds(fds.clone())
        .expect("generate Rust from proto/");
    let services = out.join("services");
    fs::create_dir_all(&services).expect("create the services folder");
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .out_dir(&services)
        .extern_path(".inference", "crate::proto::inference")
        .extern_path(".grpc.health.v1", "crate::proto::health")
        .compile_fds(fds)
        .expect("generate the gRPC services from proto/");
}

/// Lists every file of the example model folders in examples/ so the binary can serve them with no
/// repository on disk (top-level files of examples/, such as scripts, are not models).
fn embed_examples() {
    println!("cargo:rerun-if-changed=examples");
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("manifest dir")).join("examples");
    let mut files = Vec::new();
    if let Ok(entries) = fs::read_dir(&root) {
        for entry in entries.flatten().filter(|e| e.path().is_dir()) {
            collect(&entry.path(), &mut files);
        }
    }
    files.sort();
    let mut code = String::from("pub static FILES: &[(&str, &[u8])] = &[\n");
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
        let rel = file.strip_prefix(&root).expect("under examples/").to_string_lossy().replace('\\', "/");
        code.push_str(&format!("    ({rel:?}, include_bytes!({:?})),\n", file.display().to_string()));
    }
    code.push_str("];\n");
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    fs::write(out.join("embedded_examples.rs"), code).expect("write embedded_examples.rs");
}

fn collect(dir: &std::path::Path, files: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(&path, files);
        } else {
            files.push(path);
        }
    }
}
