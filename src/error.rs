//! The one error type of the core, and the one table that maps each kind to an HTTP status and a
//! gRPC code. Messages name what is wrong (model, tensor, field, expected vs got).
use std::fmt;

/// What the caller can do about an error; each kind has exactly one HTTP status and gRPC code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidArgument,
    NotFound,
    Unavailable,
    Unsupported,
    Internal,
    AlreadyExists,
    Cancelled,
    PayloadTooLarge,
    /// The server's admission budget is spent: retry later (503 with Retry-After).
    Overloaded,
    /// The request took longer than the server allows (a body read deadline).
    Timeout,
    /// What a model reported as TRITONSERVER_ERROR_UNKNOWN.
    Unknown,
}

/// gRPC status codes, by number (front-ends convert them to their framework's type).
pub mod grpc_code {
    pub const CANCELLED: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const INVALID_ARGUMENT: i32 = 3;
    pub const NOT_FOUND: i32 = 5;
    pub const ALREADY_EXISTS: i32 = 6;
    pub const DEADLINE_EXCEEDED: i32 = 4;
    pub const RESOURCE_EXHAUSTED: i32 = 8;
    pub const UNIMPLEMENTED: i32 = 12;
    pub const INTERNAL: i32 = 13;
    pub const UNAVAILABLE: i32 = 14;
}

impl ErrorKind {
    /// The single table: (HTTP status, gRPC code). Triton's own mapping, plus 413 for bodies over
    /// the size limit.
    pub const fn codes(self) -> (u16, i32) {
        match self {
            ErrorKind::InvalidArgument => (400, grpc_code::INVALID_ARGUMENT),
            ErrorKind::NotFound => (404, grpc_code::NOT_FOUND),
            ErrorKind::Unavailable => (503, grpc_code::UNAVAILABLE),
            ErrorKind::Unsupported => (501, grpc_code::UNIMPLEMENTED),
            ErrorKind::Internal => (500, grpc_code::INTERNAL),
            ErrorKind::AlreadyExists => (400, grpc_code::ALREADY_EXISTS),
            ErrorKind::Cancelled => (400, grpc_code::CANCELLED),
            ErrorKind::PayloadTooLarge => (413, grpc_code::RESOURCE_EXHAUSTED),
            ErrorKind::Overloaded => (503, grpc_code::RESOURCE_EXHAUSTED),
            ErrorKind::Timeout => (408, grpc_code::DEADLINE_EXCEEDED),
            ErrorKind::Unknown => (400, grpc_code::UNKNOWN),
        }
    }
}

/// Where a failed request failed, as Triton's failure metrics count it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Origin {
    #[default]
    Other,
    /// Timed out in the scheduler queue (REJECT policy).
    Rejected,
    Cancelled,
    /// Failed in the model runtime.
    Backend,
}

impl Origin {
    pub const ALL: [Origin; 4] = [Origin::Backend, Origin::Cancelled, Origin::Other, Origin::Rejected];

    /// The `reason` label of `nv_inference_request_failure`.
    pub fn label(self) -> &'static str {
        match self {
            Origin::Other => "OTHER",
            Origin::Rejected => "REJECTED",
            Origin::Cancelled => "CANCELED",
            Origin::Backend => "BACKEND",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    origin: Origin,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into(), origin: Origin::Other }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message)
    }
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Internal, message)
    }
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::PayloadTooLarge, message)
    }
    pub fn with_origin(mut self, origin: Origin) -> Self {
        self.origin = origin;
        self
    }
    pub fn origin(&self) -> Origin {
        self.origin
    }
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
    pub fn message(&self) -> &str {
        &self.message
    }
    pub fn http_status(&self) -> u16 {
        self.kind.codes().0
    }
    pub fn grpc_code(&self) -> i32 {
        self.kind.codes().1
    }
    /// Prefixes the message with context, keeping the kind.
    pub fn context(self, prefix: impl fmt::Display) -> Self {
        Error { kind: self.kind, message: format!("{prefix}: {}", self.message), origin: self.origin }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

/// What a caught panic said (its `&str` or `String` payload; empty for any other payload).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_matches_triton() {
        assert_eq!(Error::invalid("x").http_status(), 400);
        assert_eq!(Error::not_found("x").http_status(), 404);
        assert_eq!(Error::unavailable("x").http_status(), 503);
        assert_eq!(Error::unsupported("x").http_status(), 501);
        assert_eq!(Error::internal("x").grpc_code(), grpc_code::INTERNAL);
        assert_eq!(Error::too_large("x").http_status(), 413);
        assert_eq!(Error::unavailable("x").grpc_code(), grpc_code::UNAVAILABLE);
    }

    #[test]
    fn context_keeps_kind() {
        let e = Error::invalid("bad").context("model 'm'");
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert_eq!(e.message(), "model 'm': bad");
    }
}
