//! The optional TCP listener: mutual TLS only. A client must present a certificate
//! signed by the configured CA, or the handshake fails before any RPC runs.

use std::future::Future;
use std::path::Path;

use tokio::net::TcpListener;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::api::HostDevService;
use crate::config::TcpConfig;
use crate::daemon::{routes, DaemonError};

fn read(path: &Path) -> Result<Vec<u8>, DaemonError> {
    std::fs::read(path).map_err(|source| DaemonError::Tls {
        detail: format!("cannot read {}", path.display()),
        source: Some(source),
    })
}

/// The TLS settings for a TCP listener: server identity, and client certificates
/// required and checked against the CA.
pub fn tls_config(cfg: &TcpConfig) -> Result<ServerTlsConfig, DaemonError> {
    let identity = Identity::from_pem(read(&cfg.cert)?, read(&cfg.key)?);
    Ok(ServerTlsConfig::new()
        .identity(identity)
        .client_ca_root(Certificate::from_pem(read(&cfg.client_ca)?))
        .client_auth_optional(false))
}

/// Binds the TCP listener.
pub async fn bind(cfg: &TcpConfig) -> Result<TcpListener, DaemonError> {
    TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| DaemonError::Tls {
            detail: format!("cannot listen on {}", cfg.listen),
            source: Some(source),
        })
}

/// Serves the API over mutual TLS on `listener` until `shutdown` completes.
pub async fn serve_tls(
    listener: TcpListener,
    tls: ServerTlsConfig,
    service: HostDevService,
    shutdown: impl Future<Output = ()>,
) -> Result<(), DaemonError> {
    let builder = tonic::transport::Server::builder()
        .tls_config(tls)
        .map_err(|e| DaemonError::Tls {
            detail: format!("invalid TLS configuration: {e}"),
            source: None,
        })?;
    let streams = service.clone();
    let shutdown = async move {
        shutdown.await;
        streams.stop_streams();
    };
    let incoming = crate::api::connections::pausing(
        tonic::transport::server::TcpIncoming::from(listener),
        service.connections().metrics().clone(),
        "the TCP listener",
    );
    routes(builder, service)
        .await?
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}
