//! TLS for the listeners, for VMs where no platform terminates TLS: tritonserver's gRPC flags
//! (`--grpc-use-ssl`, `--grpc-server-cert`, `--grpc-server-key`, `--grpc-root-cert`,
//! `--grpc-use-ssl-mutual`) and the same for HTTP (`--http-use-ssl`, ...).
use std::path::PathBuf;

use clap::{ArgAction, Args};

use crate::frontend::tls::Tls;

#[derive(Args, Debug, Clone)]
pub(super) struct TlsArgs {
    /// Serve gRPC over TLS (needs --grpc-server-cert and --grpc-server-key).
    #[arg(long, env = "FERRY_GRPC_USE_SSL", default_value = "false", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    grpc_use_ssl: bool,
    /// Require client certificates signed by --grpc-root-cert (mutual TLS).
    #[arg(long, env = "FERRY_GRPC_USE_SSL_MUTUAL", default_value = "false", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    grpc_use_ssl_mutual: bool,
    /// PEM certificate chain of the gRPC listener.
    #[arg(long, env = "FERRY_GRPC_SERVER_CERT")]
    grpc_server_cert: Option<PathBuf>,
    /// PEM private key of the gRPC listener.
    #[arg(long, env = "FERRY_GRPC_SERVER_KEY")]
    grpc_server_key: Option<PathBuf>,
    /// PEM certificates that sign accepted client certificates (mutual TLS).
    #[arg(long, env = "FERRY_GRPC_ROOT_CERT")]
    grpc_root_cert: Option<PathBuf>,
    /// Serve the HTTP listeners (KServe, Vertex AI, SageMaker, metrics) over TLS.
    #[arg(long, env = "FERRY_HTTP_USE_SSL", default_value = "false", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    http_use_ssl: bool,
    /// Require client certificates signed by --http-root-cert (mutual TLS).
    #[arg(long, env = "FERRY_HTTP_USE_SSL_MUTUAL", default_value = "false", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    http_use_ssl_mutual: bool,
    /// PEM certificate chain of the HTTP listeners.
    #[arg(long, env = "FERRY_HTTP_SERVER_CERT")]
    http_server_cert: Option<PathBuf>,
    /// PEM private key of the HTTP listeners.
    #[arg(long, env = "FERRY_HTTP_SERVER_KEY")]
    http_server_key: Option<PathBuf>,
    /// PEM certificates that sign accepted client certificates (mutual TLS).
    #[arg(long, env = "FERRY_HTTP_ROOT_CERT")]
    http_root_cert: Option<PathBuf>,
}

fn one(
    proto: &str,
    on: bool,
    mutual: bool,
    files: (&Option<PathBuf>, &Option<PathBuf>, &Option<PathBuf>),
) -> Result<Option<Tls>, String> {
    let (cert, key, root) = files;
    if !on {
        if mutual || cert.is_some() || key.is_some() {
            return Err(format!(
                "--{proto}-server-cert, --{proto}-server-key and --{proto}-use-ssl-mutual need --{proto}-use-ssl"
            ));
        }
        return Ok(None);
    }
    let (Some(cert), Some(key)) = (cert, key) else {
        return Err(format!("--{proto}-use-ssl needs --{proto}-server-cert and --{proto}-server-key"));
    };
    let client_roots = match (mutual, root) {
        (true, Some(r)) => Some(r.clone()),
        (true, None) => return Err(format!("--{proto}-use-ssl-mutual needs --{proto}-root-cert")),
        (false, _) => None,
    };
    Ok(Some(Tls { cert: cert.clone(), key: key.clone(), client_roots }))
}

impl TlsArgs {
    /// (HTTP, gRPC).
    pub(super) fn resolve(&self) -> Result<(Option<Tls>, Option<Tls>), String> {
        let http = one(
            "http",
            self.http_use_ssl,
            self.http_use_ssl_mutual,
            (&self.http_server_cert, &self.http_server_key, &self.http_root_cert),
        )?;
        let grpc = one(
            "grpc",
            self.grpc_use_ssl,
            self.grpc_use_ssl_mutual,
            (&self.grpc_server_cert, &self.grpc_server_key, &self.grpc_root_cert),
        )?;
        Ok((http, grpc))
    }
}
