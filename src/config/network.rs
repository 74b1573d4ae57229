//! Flags that bound what clients can hold: connections, header/body/idle timeouts, gRPC message
//! and stream limits, the admission budget, and the drain deadline at exit.
use std::time::Duration;

use clap::Args;

use crate::frontend::net::Network;

/// The longest stall timeout taken: past a day, it means "never" in practice (and the time
/// stays in range).
const MAX_STALL: Duration = Duration::from_secs(24 * 3600);

#[derive(Args, Debug, Clone)]
pub(super) struct NetworkArgs {
    /// Open connections per listener; more are closed as they arrive.
    #[arg(long, env = "FERRY_MAX_CONNECTIONS", default_value_t = 1024)]
    max_connections: usize,
    /// Seconds a client may take to send a request's headers once it started.
    #[arg(long, env = "FERRY_HTTP_HEADER_TIMEOUT_SECS", default_value_t = 30)]
    http_header_timeout_secs: u64,
    /// Seconds a client may take to send a request's body.
    #[arg(long, env = "FERRY_HTTP_BODY_TIMEOUT_SECS", default_value_t = 60)]
    http_body_timeout_secs: u64,
    /// Seconds an idle keep-alive connection stays open. Longer than the load balancers' own
    /// (Google Cloud's is 600 s), so that they, not ferry, close idle connections.
    #[arg(long, env = "FERRY_HTTP_IDLE_TIMEOUT_SECS", default_value_t = 650)]
    http_idle_timeout_secs: u64,
    /// Largest gRPC message, also after decompression (default: --http-max-input-size).
    #[arg(long, env = "FERRY_GRPC_MAX_INPUT_SIZE")]
    grpc_max_input_size: Option<usize>,
    /// Concurrent HTTP/2 streams per gRPC connection.
    #[arg(long, env = "FERRY_GRPC_MAX_CONCURRENT_STREAMS", default_value_t = 256)]
    grpc_max_concurrent_streams: u32,
    /// Requests of one ModelStreamInfer stream in flight at once; the stream reads no further
    /// message until one finishes.
    #[arg(long, env = "FERRY_GRPC_STREAM_MAX_INFLIGHT", default_value_t = 128)]
    grpc_stream_max_inflight: usize,
    /// Seconds a ModelStreamInfer stream's replies may wait for a client that takes none of them;
    /// then the stream ends with RESOURCE_EXHAUSTED and its waiting replies are dropped.
    #[arg(long, env = "FERRY_GRPC_STREAM_STALL_TIMEOUT_SECS", default_value_t = 60)]
    grpc_stream_stall_timeout_secs: u64,
    /// Bytes of requests in flight, server-wide; a request past it gets 503 + Retry-After (HTTP)
    /// or RESOURCE_EXHAUSTED (gRPC). Default: a quarter of the memory limit (the container's
    /// cgroup limit, else the machine's memory).
    #[arg(long, env = "FERRY_MAX_INFLIGHT_REQUEST_BYTES")]
    max_inflight_request_bytes: Option<u64>,
    /// Seconds to finish admitted requests after SIGTERM before the rest is cancelled and ferry
    /// exits (tritonserver's flag).
    #[arg(long, env = "FERRY_EXIT_TIMEOUT_SECS", default_value_t = 30)]
    exit_timeout_secs: u64,
}

impl NetworkArgs {
    pub(super) fn resolve(&self, http_max_input_size: usize) -> Result<Network, String> {
        let positive = |flag: &str, v: u64| {
            if v == 0 { Err(format!("--{flag} must be at least 1, got 0")) } else { Ok(Duration::from_secs(v)) }
        };
        if self.max_connections == 0 {
            return Err("--max-connections must be at least 1, got 0".into());
        }
        if self.grpc_stream_max_inflight == 0 || self.grpc_max_concurrent_streams == 0 {
            return Err("--grpc-stream-max-inflight and --grpc-max-concurrent-streams must be at least 1".into());
        }
        let grpc_max_input_size = self.grpc_max_input_size.unwrap_or(http_max_input_size);
        if grpc_max_input_size == 0 {
            return Err("--grpc-max-input-size must be at least 1 byte, got 0".into());
        }
        let admission_budget = match self.max_inflight_request_bytes {
            Some(0) => return Err("--max-inflight-request-bytes must be at least 1 byte, got 0".into()),
            Some(n) => n,
            None => crate::admission::default_budget(memory_limit()),
        };
        Ok(Network {
            max_connections: self.max_connections,
            header_timeout: positive("http-header-timeout-secs", self.http_header_timeout_secs)?,
            body_timeout: positive("http-body-timeout-secs", self.http_body_timeout_secs)?,
            idle_timeout: positive("http-idle-timeout-secs", self.http_idle_timeout_secs)?,
            grpc_max_input_size,
            grpc_max_concurrent_streams: self.grpc_max_concurrent_streams,
            grpc_stream_max_inflight: self.grpc_stream_max_inflight,
            grpc_stream_stall_timeout: positive("grpc-stream-stall-timeout-secs", self.grpc_stream_stall_timeout_secs)?
                .min(MAX_STALL),
            admission_budget,
            exit_timeout: Duration::from_secs(self.exit_timeout_secs),
        })
    }
}

/// The memory this process may use: the cgroup's limit (v2, then v1) when there is one, else
/// the machine's memory.
fn memory_limit() -> u64 {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let cgroup = read("/sys/fs/cgroup/memory.max")
        .or_else(|| read("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
        .and_then(|s| s.trim().parse::<u64>().ok())
        // v1 reports "no limit" as a huge number.
        .filter(|&n| n < 1 << 60);
    let machine = read("/proc/meminfo").and_then(|m| meminfo_total(&m)).unwrap_or(8 << 30);
    cgroup.map_or(machine, |c| c.min(machine))
}

fn meminfo_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo() {
        assert_eq!(meminfo_total("MemTotal:       24570000 kB\nMemFree: 1 kB\n"), Some(24570000 * 1024));
        assert_eq!(meminfo_total("nothing"), None);
        assert!(memory_limit() > 0);
    }
}
