//! ferry: a Triton-compatible model server.
//!
//! Request flow: `frontend` (HTTP, gRPC, Vertex AI, SageMaker) translates the wire format into one
//! protocol-neutral [`engine::InferRequest`] → `engine` resolves the model → `validate` checks it
//! → `scheduler` queues, batches and runs it on a model instance → `backend` (ONNX Runtime) → the
//! reply is split per request and encoded back by the front-end. `repository` turns model
//! repositories into loaded, ready model versions. Data types (`tensor`, `error`) depend on
//! nothing.
pub mod error;
pub mod proto;
pub mod repository;
pub mod tensor;
pub mod backend;
pub mod model;
pub mod request;
pub mod scheduler;
pub mod stats;
pub mod validate;
pub mod classify;
