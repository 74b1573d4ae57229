//! ferry: a Triton-compatible model server.
//!
//! Request flow: `frontend` (HTTP, gRPC, Vertex AI, SageMaker) translates the wire format into one
//! protocol-neutral [`engine::InferRequest`] → `engine` resolves the model → `validate` checks it
//! → `scheduler` queues, batches and runs it on a model instance → `backend` (ONNX Runtime) → the
//! reply is split per request and encoded back by the front-end. `repository` turns model
//! repositories into loaded, ready model versions. Data types (`tensor`, `device`: tensor bytes
//! left in GPU memory, `error`) depend on nothing else.
pub mod admission;
pub mod backend;
pub mod cache;
pub mod classify;
pub mod config;
pub mod device;
pub mod engine;
pub mod ensemble;
pub mod error;
pub mod frontend;
pub mod gpu;
pub mod metrics;
pub mod model;
pub mod names;
pub mod proto;
pub mod repository;
pub mod request;
pub mod scheduler;
pub mod server;
pub mod settings;
pub mod shm;
pub mod stats;
pub mod telemetry;
pub mod tensor;
pub mod tune;
pub mod validate;
