//! The optional TCP listener: mutual TLS only. A client must present a certificate
//! signed by the configured CA, or the handshake fails before any RPC runs; a handshake
//! not finished within `[api.tcp] handshake_timeout_ms` closes the connection; one peer
//! address holds at most `[api.tcp] max_connections_per_peer` connections.

use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use futures_util::Stream;
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::api::connections::{Held, Quiet, Slot};
use crate::api::per_uid::PerUid;
use crate::api::HostDevService;
use crate::config::TcpConfig;
use crate::daemon::DaemonError;
use crate::metrics::Metrics;

/// A TCP peer as its connections are counted: its address, an IPv4 peer reached through
/// an IPv4-mapped IPv6 address counted as itself.
pub type Peer = IpAddr;

fn read(path: &Path) -> Result<Vec<u8>, DaemonError> {
    std::fs::read(path).map_err(|source| DaemonError::Tls {
        detail: format!("cannot read {}", path.display()),
        source: Some(source),
    })
}

/// The TLS settings for a TCP listener: server identity, client certificates required
/// and checked against the CA, and the time a handshake may take (without it, a
/// connection that never sends its first TLS message would be held for ever).
pub fn tls_config(cfg: &TcpConfig) -> Result<ServerTlsConfig, DaemonError> {
    let identity = Identity::from_pem(read(&cfg.cert)?, read(&cfg.key)?);
    Ok(ServerTlsConfig::new()
        .identity(identity)
        .client_ca_root(Certificate::from_pem(read(&cfg.client_ca)?))
        .client_auth_optional(false)
        .timeout(std::time::Duration::from_millis(cfg.handshake_timeout_ms)))
}

/// The TCP listener's server with its TLS set up from `cfg`: the certificate, key and
/// CA are parsed here, so that files that do not make a TLS server (a CA file with no
/// certificate, a key that does not parse) fail the start, before the agent says it is
/// ready, rather than end the listener unseen once it serves.
pub fn tls_server(cfg: &TcpConfig) -> Result<tonic::transport::Server, DaemonError> {
    tonic::transport::Server::builder()
        .tls_config(tls_config(cfg)?)
        .map_err(|e| DaemonError::Tls {
            detail: format!(
                "invalid TLS configuration (cert {}, key {}, client_ca {}): {e}",
                cfg.cert.display(),
                cfg.key.display(),
                cfg.client_ca.display()
            ),
            source: None,
        })
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

/// Serves the API over mutual TLS on `listener` until `shutdown` completes, each peer
/// address holding at most `per_peer` connections.
pub async fn serve_tls(
    listener: TcpListener,
    server: tonic::transport::Server,
    per_peer: usize,
    service: HostDevService,
    shutdown: impl Future<Output = ()>,
) -> Result<(), DaemonError> {
    let metrics = service.connections().metrics().clone();
    let incoming = crate::api::connections::pausing(
        incoming(listener, PerUid::new(per_peer), Arc::clone(&metrics)),
        metrics,
        "the TCP listener",
    );
    crate::daemon::serve_draining(server, service, incoming, shutdown).await
}

/// The peer a connection from `addr` counts against (see [`Peer`]).
pub fn peer_of(addr: std::net::SocketAddr) -> Peer {
    addr.ip().to_canonical()
}

/// The connections accepted on `listener`, each holding one of its peer's places in
/// `per_peer` until it closes. A connection whose peer holds as many as it may is closed
/// at once, before the TLS handshake (a client can be told nothing before it): counted in
/// `hostdevd_tcp_connections_refused_total` and logged at most every 10 s. Failed accepts
/// go to the caller (see `connections::pausing`).
pub fn incoming(
    listener: TcpListener,
    per_peer: Arc<PerUid<Peer>>,
    metrics: Arc<Metrics>,
) -> impl Stream<Item = io::Result<TcpConn>> {
    let state = (listener, per_peer, metrics, Quiet::default());
    futures_util::stream::unfold(state, |mut s| async move {
        let (listener, per_peer, metrics, refused) = &mut s;
        loop {
            let (stream, addr) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => return Some((Err(e), s)),
            };
            let peer = peer_of(addr);
            let Some(place) = per_peer.take(peer) else {
                metrics.tcp_connection_refused();
                if let Some(n) = refused.due() {
                    tracing::warn!(
                        peer = %addr.ip(),
                        limit = per_peer.limit(),
                        refused = n,
                        "TCP connection closed: its peer address holds as many open connections as [api.tcp] max_connections_per_peer allows (a client that opens a connection per call and keeps them, or never finishes its handshake?)"
                    );
                }
                drop(stream);
                continue;
            };
            // As tonic's own listener does: gRPC's small frames must not wait for
            // Nagle's algorithm.
            let _ = stream.set_nodelay(true);
            let slot = Slot::new(
                place,
                Arc::clone(metrics),
                Metrics::tcp_connection_opened,
                Metrics::tcp_connection_closed,
            );
            return Some((Ok(Held::new(stream, slot)), s));
        }
    })
}

/// An accepted TCP connection, holding its peer's place until it closes.
pub type TcpConn = Held<TcpStream, Slot<Peer>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_is_its_address_whatever_the_port_or_the_socket_family() {
        let v4: std::net::SocketAddr = "10.1.2.3:40000".parse().expect("v4");
        let mapped: std::net::SocketAddr = "[::ffff:10.1.2.3]:40001".parse().expect("mapped");
        let v6: std::net::SocketAddr = "[2001:db8::7]:40002".parse().expect("v6");
        assert_eq!(peer_of(v4), peer_of(mapped));
        assert_eq!(peer_of(mapped).to_string(), "10.1.2.3");
        assert_ne!(peer_of(v4), peer_of(v6));
        let other: std::net::SocketAddr = "10.1.2.4:40000".parse().expect("other");
        assert_ne!(peer_of(v4), peer_of(other));
    }
}
