//! The protocol-neutral inference request and response that every front-end translates to and
//! from. Plain data: no framework types, no validation (see `validate`).
use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

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

/// Parameter names Triton keeps for itself (besides every name starting `triton_`): a header
/// forwarded as a parameter may not take one.
pub const RESERVED_PARAMETERS: [&str; 7] =
    ["sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "headers", "binary_data_output"];

/// A header forwarded as a request parameter (--http/grpc-header-forward-pattern), unless its
/// name is reserved: then Triton's error.
pub fn forwarded_header(name: &str, value: &[u8]) -> crate::error::Result<(String, ParamValue)> {
    if RESERVED_PARAMETERS.contains(&name) || name.starts_with("triton_") {
        return Err(crate::error::Error::invalid(format!(
            "Header '{name}' is reserved for Triton usage and cannot be forwarded."
        )));
    }
    Ok((name.to_string(), ParamValue::String(String::from_utf8_lossy(value).into_owned())))
}

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
    /// With model namespacing, the repository whose model of the requested name is preferred
    /// (an ensemble step's: its ensemble's repository).
    pub namespace: Option<usize>,
}

impl Context {
    /// The context of a request made on behalf of this one (an ensemble step, a BLS call).
    pub fn nested(&self) -> Context {
        Context { nesting: self.nesting + 1, ticket: self.ticket.clone(), namespace: None }
    }

    /// Counts `bytes` the request makes the server allocate (beyond its own bytes) against the
    /// admission budget, before they are allocated: refused (Overloaded) past the budget. They
    /// stay counted as long as the request lives (its outputs).
    pub fn charge(&self, bytes: u64) -> crate::error::Result<()> {
        self.ticket.as_ref().map_or(Ok(()), |t| t.grow(bytes))
    }

    /// As `charge`, for memory used for a while (working buffers): counted until the returned
    /// charge is dropped.
    pub fn hold(&self, bytes: u64) -> crate::error::Result<Charge> {
        let mut c = Charge { ticket: self.ticket.clone(), bytes: 0 };
        c.grow(bytes)?;
        Ok(c)
    }
}

/// Bytes counted against a request's admission ticket for as long as this lives: working
/// buffers, or a streamed response until a front-end has handed it to its connection.
#[derive(Default)]
pub struct Charge {
    ticket: Option<Arc<Ticket>>,
    bytes: u64,
}

impl Charge {
    /// Counts `n` more bytes, or refuses (Overloaded) past the budget.
    pub fn grow(&mut self, n: u64) -> crate::error::Result<()> {
        if let Some(t) = &self.ticket {
            t.grow(n)?;
            self.bytes += n;
        }
        Ok(())
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// `n` bytes already made (a reply waiting for its connection) on `holder`, counted even
    /// past the budget: what comes after is refused until they are given back.
    pub fn held(holder: &Arc<crate::admission::Ticket>, n: u64) -> Charge {
        holder.hold(n);
        Charge { ticket: Some(Arc::clone(holder)), bytes: n }
    }

    /// A separate charge of `n` bytes on the same ticket (a while's work on what this holds).
    pub fn more(&self, n: u64) -> crate::error::Result<Charge> {
        let mut c = Charge { ticket: self.ticket.clone(), bytes: 0 };
        c.grow(n)?;
        Ok(c)
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if let Some(t) = &self.ticket {
            t.shrink(self.bytes);
        }
    }
}

impl std::fmt::Debug for Charge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Charge({} bytes)", self.bytes)
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

impl Streamed {
    /// Only the mark of the last response.
    pub fn end() -> Self {
        Streamed { outputs: Vec::new(), parameters: Parameters::new(), last: true }
    }
}

/// Most responses, and bytes of them, a stream holds for a client that does not read; each
/// response's bytes also count against the request's admission ticket while they wait.
pub const STREAM_BACKLOG: usize = 64;
pub const STREAM_BACKLOG_BYTES: u64 = 64 << 20;

/// What a stream's two ends share: the bytes waiting, whether the client fell too far behind,
/// and the request's ticket.
struct Backlog {
    bytes: AtomicU64,
    behind: AtomicBool,
    /// Given up once the receiving end is gone: a model that keeps a sender of a request whose
    /// client left holds no admission budget with it.
    ticket: arc_swap::ArcSwapOption<Ticket>,
}

/// Where a decoupled model's responses for one request go: a bounded backlog. A client that
/// falls behind by [`STREAM_BACKLOG`] responses or [`STREAM_BACKLOG_BYTES`] (or past the
/// admission budget) has its stream ended with an error; the model sees the request cancelled
/// and what it sends after is dropped.
#[derive(Clone)]
pub struct StreamTx {
    tx: tokio::sync::mpsc::Sender<crate::error::Result<Streamed>>,
    backlog: Arc<Backlog>,
}

/// The receiving end (the engine's forwarding task).
pub struct StreamRx {
    rx: tokio::sync::mpsc::Receiver<crate::error::Result<Streamed>>,
    backlog: Arc<Backlog>,
}

fn streamed_bytes(item: &crate::error::Result<Streamed>) -> u64 {
    item.as_ref().map_or(0, |s| s.outputs.iter().map(|t| t.data.len() as u64).sum())
}

impl StreamTx {
    pub fn channel(ticket: Option<Arc<Ticket>>) -> (StreamTx, StreamRx) {
        let (tx, rx) = tokio::sync::mpsc::channel(STREAM_BACKLOG);
        let backlog = Arc::new(Backlog {
            bytes: AtomicU64::new(0),
            behind: AtomicBool::new(false),
            ticket: arc_swap::ArcSwapOption::new(ticket),
        });
        (StreamTx { tx, backlog: Arc::clone(&backlog) }, StreamRx { rx, backlog })
    }

    /// Queues a response; false when the stream is over (the client left, or fell too far
    /// behind: then this response is dropped and the stream ends with an error).
    pub fn send(&self, item: crate::error::Result<Streamed>) -> bool {
        if self.cancelled() {
            return false;
        }
        let n = streamed_bytes(&item);
        let before = self.backlog.bytes.fetch_add(n, Ordering::AcqRel);
        // One response bigger than the backlog goes when nothing else waits (the budget and the
        // message limit bound it).
        let fits = before == 0 || before + n <= STREAM_BACKLOG_BYTES;
        let ticket = self.backlog.ticket.load_full();
        let charged = ticket.as_ref().is_none_or(|t| t.grow(n).is_ok());
        if fits && charged && self.tx.try_send(item).is_ok() {
            return true;
        }
        self.backlog.bytes.fetch_sub(n, Ordering::AcqRel);
        if charged && let Some(t) = &ticket {
            t.shrink(n);
        }
        if !self.tx.is_closed() {
            self.backlog.behind.store(true, Ordering::Release);
        }
        false
    }

    /// Whether the stream is over for the model: the client stopped listening (its stream or
    /// connection closed), or fell too far behind.
    pub fn cancelled(&self) -> bool {
        self.tx.is_closed() || self.backlog.behind.load(Ordering::Acquire)
    }
}

impl StreamRx {
    /// The next response, with the charge of its bytes (they no longer wait in the backlog,
    /// but stay counted against the ticket until whoever holds the charge drops it: a front-end,
    /// once it has handed the response to its connection); None once every sender is gone.
    pub async fn recv(&mut self) -> Option<(crate::error::Result<Streamed>, Charge)> {
        let item = self.rx.recv().await?;
        let n = streamed_bytes(&item);
        self.backlog.bytes.fetch_sub(n, Ordering::AcqRel);
        let charge = Charge { ticket: self.backlog.ticket.load_full(), bytes: n };
        Some((item, charge))
    }

    /// The client fell too far behind: the stream was cut short.
    pub fn fell_behind(&self) -> bool {
        self.backlog.behind.load(Ordering::Acquire)
    }
}

impl Drop for StreamRx {
    fn drop(&mut self) {
        self.backlog.ticket.store(None);
    }
}

impl std::fmt::Debug for StreamTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StreamTx")
    }
}

impl PartialEq for StreamTx {
    fn eq(&self, other: &Self) -> bool {
        self.tx.same_channel(&other.tx)
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

/// One response of a stream.
#[derive(Debug)]
pub struct StreamItem {
    pub response: InferResponse,
    /// The request's last response (it may carry no outputs: only the mark).
    pub last: bool,
    /// Its bytes, counted against the request's admission ticket until the front-end drops
    /// this (once it has handed the response to its connection).
    pub charge: Charge,
}

/// The responses of one request, as the engine streams them.
pub type ResponseStream = tokio::sync::mpsc::Receiver<crate::error::Result<StreamItem>>;
