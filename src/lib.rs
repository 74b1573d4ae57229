//! ferry: a Triton-compatible model server.
//!
//! Request flow: `frontend` (HTTP, gRPC, Vertex AI, SageMaker, OpenAI) translates the wire format
//! into one protocol-neutral [`engine::InferRequest`] → `engine` resolves the model → `validate`
//! checks it → `scheduler` queues, batches and runs it on a model instance → a backend → the reply
//! is split per request and encoded back by the front-end. `repository` turns model repositories
//! into loaded, ready model versions.
//!
//! The modules in four layers; an import points only to its own layer or a lower one, and never
//! in a circle (tests/architecture/ keeps it so):
//!
//! - **data**, plain types and rules everything may use: `tensor`, `schema` (a model's tensor
//!   schema), `request`, `error`, `names`, `device`, `proto` (the generated types and
//!   config.pbtxt), `stats`, `settings`, `classify`, `admission`.
//! - **core**, what serves a request: `engine`, `validate`, `scheduler`, `ensemble`, `model` (a
//!   loaded version), `cache`, `repository`, the backend contract (`backend`), `metrics`,
//!   `telemetry`, `shm`, `gpu`.
//! - **adapters**, the only modules that name a wire format or a framework: `frontend`, and the
//!   backends `backend::{onnx, python, pytorch, native, identity, accelerators, library, fil, openvino}`.
//! - **wiring**: `config` (flags and environment, read once), `server` (everything built and
//!   started), `tune`.
pub mod admission;
pub mod backend;
pub mod cache;
pub mod classify;
pub mod clock;
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
pub mod schema;
pub mod server;
pub mod settings;
pub mod shm;
pub mod stats;
pub mod telemetry;
pub mod tensor;
pub mod tune;
pub mod validate;
