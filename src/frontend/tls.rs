//! TLS for the listeners (rustls): the certificate chain and key of `--{http,grpc}-server-cert`
//! / `-key`, and with mutual TLS the roots client certificates must chain to.
use std::{path::PathBuf, sync::Arc};

use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};

/// One listener's TLS files (read at start-up).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tls {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Mutual TLS: client certificates must chain to these roots.
    pub client_roots: Option<PathBuf>,
}

fn read(what: &str, path: &std::path::Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read the {what} {}: {e}", path.display()))
}

/// The acceptor of the HTTP listeners.
pub fn http_acceptor(tls: &Tls) -> Result<tokio_rustls::TlsAcceptor, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&read("certificate", &tls.cert)?)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: {e}", tls.cert.display()))?;
    let key = PrivateKeyDer::from_pem_slice(&read("private key", &tls.key)?)
        .map_err(|e| format!("{}: {e}", tls.key.display()))?;
    let builder = rustls::ServerConfig::builder();
    let builder = match &tls.client_roots {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(&read("root certificate", path)?) {
                roots.add(c.map_err(|e| format!("{}: {e}", path.display()))?).map_err(|e| e.to_string())?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots))
                .build()
                .map_err(|e| format!("{}: {e}", path.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| format!("{}: {e}", tls.cert.display()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// tonic's TLS settings for the gRPC listener.
pub fn grpc_config(tls: &Tls) -> Result<tonic::transport::ServerTlsConfig, String> {
    let identity =
        tonic::transport::Identity::from_pem(read("certificate", &tls.cert)?, read("private key", &tls.key)?);
    let mut config = tonic::transport::ServerTlsConfig::new().identity(identity);
    if let Some(path) = &tls.client_roots {
        config = config.client_ca_root(tonic::transport::Certificate::from_pem(read("root certificate", path)?));
    }
    Ok(config)
}
