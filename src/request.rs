//! The protocol-neutral inference request and response that every front-end translates to and
//! from. Plain data: no framework types, no validation (see `validate`).
use std::{collections::BTreeMap, sync::Arc};

use bytes::Bytes;

use crate::{
    admission::Ticket,
    device::DeviceBytes,
    tensor::{DataType, Tensor},
};

/// A request parameter value (the union of what HTTP JSON and gRPC InferParameter can carry).
#[derive(Debug, Clone, PartialEq)]
pub enum ParamValue {
    Bool(bool),
    Int(i64),
    Uint(u64),
    Double(f64),
    String(String),
}

impl ParamValue {
    /// The value as an unsigned integer, when it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            ParamValue::Uint(v) => Some(v),
            ParamValue::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
}

pub type Parameters = BTreeMap<String, ParamValue>;

#[derive(Debug, Clone, PartialEq)]
pub struct InputTensor {
    pub name: String,
    pub datatype: DataType,
    pub shape: Vec<i64>,
    pub data: Bytes,
    /// An input in a CUDA shared-memory region: its bytes, left on the GPU (`data` is then
    /// empty until the engine copies them to the host for a model that needs them there).
    pub device: Option<DeviceBytes>,
}

impl InputTensor {
    /// An input whose bytes are in host memory.
    pub fn host(name: impl Into<String>, datatype: DataType, shape: Vec<i64>, data: Bytes) -> Self {
        InputTensor { name: name.into(), datatype, shape, data, device: None }
    }

    /// Its size in bytes, wherever they are.
    pub fn byte_len(&self) -> usize {
        self.device.as_ref().map_or(self.data.len(), DeviceBytes::len)
    }
}

/// A place in a registered shared memory region (the shared-memory extension).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ShmRef {
    pub region: String,
    pub offset: u64,
    pub byte_size: u64,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct RequestedOutput {
    pub name: String,
    /// Top-K classification instead of the raw tensor (`classification` parameter).
    pub classification: Option<u32>,
    /// Write the output into this shared memory instead of the reply.
    pub shm: Option<ShmRef>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct InferRequest {
    pub model_name: String,
    /// None: the highest-numbered ready version.
    pub model_version: Option<u64>,
    pub id: String,
    pub parameters: Parameters,
    pub inputs: Vec<InputTensor>,
    /// Empty: every output of the model, in config order.
    pub outputs: Vec<RequestedOutput>,
    /// The caller's W3C `traceparent`, to continue its trace.
    pub trace_parent: Option<String>,
    pub context: Context,
}

/// How many ensemble steps or BLS calls deep a request may be: deeper is a cycle, or a pipeline
/// no one writes, and each level holds a task's stack.
pub const MAX_NESTING: u32 = 16;

/// What travels with a request besides what its client sent.
#[derive(Clone, Default)]
pub struct Context {
    /// Ensemble steps and BLS calls between this request and its client's (0: the client's own).
    pub nesting: u32,
    /// The client request's admission ticket: its bytes count against the server's budget for
    /// as long as any part of the request exists (queued, batched or running), whoever holds it.
    pub ticket: Option<Arc<Ticket>>,
}

impl Context {
    /// The context of a request made on behalf of this one (an ensemble step, a BLS call).
    pub fn nested(&self) -> Context {
        Context { nesting: self.nesting + 1, ticket: self.ticket.clone() }
    }

    /// Counts `bytes` the request makes the server allocate (beyond its own bytes) against the
    /// admission budget, before they are allocated: refused (Overloaded) past the budget.
    pub fn charge(&self, bytes: u64) -> crate::error::Result<()> {
        self.ticket.as_ref().map_or(Ok(()), |t| t.grow(bytes))
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("nesting", &self.nesting).field("ticket", &self.ticket.is_some()).finish()
    }
}

impl PartialEq for Context {
    fn eq(&self, other: &Self) -> bool {
        let same_ticket = match (&self.ticket, &other.ticket) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (a, b) => a.is_none() && b.is_none(),
        };
        self.nesting == other.nesting && same_ticket
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct InferResponse {
    pub model_name: String,
    pub model_version: u64,
    pub id: String,
    pub parameters: Parameters,
    pub outputs: Vec<Tensor>,
}

/// One response of a stream: a decoupled model sends 0..n per request, the last one marked (it
/// may hold no outputs: only the mark).
#[derive(Debug, Clone, PartialEq)]
pub struct Streamed {
    pub outputs: Vec<Tensor>,
    /// The response parameters the model set on this response.
    pub parameters: Parameters,
    pub last: bool,
}

/// Where a decoupled model's responses for one request go.
#[derive(Clone)]
pub struct StreamTx(pub tokio::sync::mpsc::UnboundedSender<crate::error::Result<Streamed>>);

impl StreamTx {
    /// Whether the client stopped listening (its stream or connection closed).
    pub fn cancelled(&self) -> bool {
        self.0.is_closed()
    }
}

impl std::fmt::Debug for StreamTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StreamTx")
    }
}

impl PartialEq for StreamTx {
    fn eq(&self, other: &Self) -> bool {
        self.0.same_channel(&other.0)
    }
}

/// Parses a version string from a URL or a gRPC field: empty means "let the server choose".
pub fn parse_version(model: &str, version: &str) -> crate::error::Result<Option<u64>> {
    if version.is_empty() {
        return Ok(None);
    }
    version.parse::<u64>().map(Some).map_err(|_| {
        crate::error::Error::invalid(format!(
            "invalid model version '{version}' for model '{model}': expected a non-negative integer"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions() {
        assert_eq!(parse_version("m", "").unwrap(), None);
        assert_eq!(parse_version("m", "3").unwrap(), Some(3));
        let err = parse_version("m", "-1").unwrap_err();
        assert!(err.message().contains("'-1'") && err.message().contains("'m'"));
    }

    #[test]
    fn param_as_u64() {
        assert_eq!(ParamValue::Int(5).as_u64(), Some(5));
        assert_eq!(ParamValue::Int(-5).as_u64(), None);
        assert_eq!(ParamValue::String("5".into()).as_u64(), None);
    }
}
