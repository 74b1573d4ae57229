//! tritonserver's flags that ferry takes in another form or has no use for, so that a Triton
//! command line runs unchanged: aliases become ferry's flags, tuning knobs of Triton's own
//! machinery are accepted and named once at start-up, and the few whose meaning ferry does not
//! have stop start-up with the reason (a silent difference would serve something else).
use std::ffi::OsString;

/// Flags that change nothing in ferry, with why.
const NO_EFFECT: &[(&str, &str)] = &[
    ("buffer-manager-thread-count", "ferry has no buffer manager threads"),
    ("cache-directory", "Triton's cache plugins are not used; see --cache-config"),
    ("cuda-memory-pool-byte-size", "ONNX Runtime's CUDA provider manages GPU memory"),
    ("cuda-virtual-address-size", "ONNX Runtime's CUDA provider manages GPU memory"),
    ("enable-peer-access", "GPU memory is copied by the CUDA provider"),
    ("grpc-infer-thread-count", "requests run on the server's async runtime"),
    ("grpc-keepalive-time", "HTTP/2 keep-alive follows the client"),
    ("grpc-keepalive-timeout", "HTTP/2 keep-alive follows the client"),
    ("grpc-keepalive-permit-without-calls", "HTTP/2 keep-alive follows the client"),
    ("grpc-http2-max-pings-without-data", "HTTP/2 keep-alive follows the client"),
    ("grpc-http2-min-recv-ping-interval-without-data", "HTTP/2 keep-alive follows the client"),
    ("grpc-http2-max-ping-strikes", "HTTP/2 keep-alive follows the client"),
    ("grpc-max-connection-age", "connections live until their client closes them"),
    ("grpc-max-connection-age-grace", "connections live until their client closes them"),
    ("grpc-max-response-pool-size", "responses are not pooled"),
    ("grpc-infer-allocation-pool-size", "responses are not pooled"),
    ("host-policy", "NUMA host policies are not applied"),
    ("http-thread-count", "requests run on the server's async runtime"),
    ("log-error", "errors are always logged"),
    ("log-info", "use --log-verbose to change what is logged"),
    ("log-warning", "warnings are always logged"),
    ("log-file", "logs go to standard output, where the platforms collect them"),
    ("min-supported-compute-capability", "the CUDA provider decides which GPUs it runs on"),
    ("model-load-gpu-limit", "GPU memory at load is not limited"),
    ("model-load-retry-count", "a failed load is not retried"),
    ("model-load-thread-count", "versions load on the blocking thread pool"),
    ("pinned-memory-pool-byte-size", "host memory is not pinned"),
    ("repoagent-directory", "only the checksum agent runs, built in"),
    ("reuse-grpc-port", "each listener binds its own port"),
    ("reuse-http-port", "each listener binds its own port"),
    ("sagemaker-thread-count", "requests run on the server's async runtime"),
    ("vertex-ai-thread-count", "requests run on the server's async runtime"),
    ("trace-count", "see --trace-config"),
    ("trace-file", "see --trace-config"),
    ("trace-level", "see --trace-config"),
    ("trace-log-frequency", "see --trace-config"),
    ("trace-rate", "see --trace-config"),
];

/// The command line with tritonserver's aliases made ferry's, and a note per flag dropped.
#[derive(Debug, Default, PartialEq)]
pub struct Translated {
    pub args: Vec<OsString>,
    pub notes: Vec<String>,
}

fn truthy(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "on" | "yes" => Some(true),
        "false" | "0" | "off" | "no" => Some(false),
        _ => None,
    }
}

pub fn translate(args: Vec<OsString>) -> Result<Translated, String> {
    let mut out = Translated::default();
    let mut it = args.into_iter().peekable();
    while let Some(arg) = it.next() {
        let Some(flag) = arg.to_str().and_then(|s| s.strip_prefix("--")).map(str::to_string) else {
            out.args.push(arg);
            continue;
        };
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n.to_string(), Some(v.to_string())),
            None => (flag.clone(), None),
        };
        let known = NO_EFFECT.iter().find(|(n, _)| *n == name).map(|(_, why)| *why);
        let special = matches!(name.as_str(), "allow-sagemaker" | "allow-vertex-ai");
        if known.is_none() && !special && name != "model-config-name" {
            // `--model-store` is tritonserver's older name of `--model-repository`.
            let alias = flag.strip_prefix("model-store").filter(|rest| rest.is_empty() || rest.starts_with('='));
            out.args.push(alias.map_or(arg, |rest| OsString::from(format!("--model-repository{rest}"))));
            continue;
        }
        // Every one of these takes a value: `--flag=value` or `--flag value`.
        let value = match inline {
            Some(v) => v,
            None => match it.peek().and_then(|v| v.to_str()).filter(|v| !v.starts_with("--")) {
                Some(v) => {
                    let v = v.to_string();
                    it.next();
                    v
                }
                None => "true".to_string(),
            },
        };
        match (name.as_str(), known) {
            (_, Some(why)) => out.notes.push(format!("--{name}={value}: no effect in ferry ({why})")),
            ("allow-sagemaker" | "allow-vertex-ai", _) => match truthy(&value) {
                Some(true) => {
                    let mode = if name == "allow-sagemaker" { "sagemaker" } else { "vertex" };
                    out.args.push(OsString::from(format!("--mode={mode}")));
                }
                Some(false) => {}
                None => return Err(format!("--{name} takes true or false, got '{value}'")),
            },
            _ => {
                return Err(format!(
                    "--model-config-name={value} is not supported by ferry: it reads each model's config.pbtxt"
                ));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &[&str]) -> Result<Translated, String> {
        translate(args.iter().map(OsString::from).collect())
    }

    #[test]
    fn tritons_command_lines_run() {
        let t = run(&[
            "ferry",
            "--model-store=/models",
            "--pinned-memory-pool-byte-size",
            "0",
            "--log-file=/tmp/x",
            "--allow-sagemaker=true",
            "--model-namespacing=true",
            "--http-port=9000",
        ])
        .unwrap();
        let args: Vec<&str> = t.args.iter().map(|a| a.to_str().unwrap()).collect();
        assert_eq!(
            args,
            ["ferry", "--model-repository=/models", "--mode=sagemaker", "--model-namespacing=true", "--http-port=9000"]
        );
        assert_eq!(t.notes.len(), 2);
        assert!(t.notes[0].starts_with("--pinned-memory-pool-byte-size=0: no effect in ferry"), "{:?}", t.notes);
        let spaced = run(&["ferry", "--model-store", "/m"]).unwrap();
        assert_eq!(
            spaced.args,
            vec![OsString::from("ferry"), OsString::from("--model-repository"), OsString::from("/m")]
        );
    }

    #[test]
    fn what_ferry_cannot_mean_stops_start_up() {
        assert!(run(&["ferry", "--model-config-name", "h100"]).unwrap_err().contains("config.pbtxt"));
        assert!(run(&["ferry", "--allow-vertex-ai=maybe"]).unwrap_err().contains("true or false"));
    }
}
