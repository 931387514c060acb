//! The client side of the Unix socket: connecting a generated `HostDev` client to a
//! running agent, for the CLI, integration tests and benches.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::transport::{Channel, Endpoint, Uri};

use crate::api::proto::host_dev_client::HostDevClient;

/// The socket the packaged daemon listens on (the config's `api.socket` default).
pub const DEFAULT_SOCKET_PATH: &str = "/run/hostdevd/hostdevd.sock";

/// The environment variable clients read for the socket path when none is given.
pub const SOCKET_ENV: &str = "HOSTDEVD_SOCKET";

/// How long a connection attempt may take before it counts as "cannot connect".
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why no connection to the agent could be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The socket is missing, refuses connections, or the handshake failed.
    #[error("cannot connect to hostdevd at {path}: {source}")]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
}

impl ConnectError {
    /// The socket the connection was attempted on.
    pub fn path(&self) -> &Path {
        match self {
            ConnectError::Connect { path, .. } => path,
        }
    }
}

/// Connects to the agent listening on the Unix socket `path`. The connection is made
/// eagerly, so a missing daemon is reported here rather than on the first call.
pub async fn connect(path: &Path) -> Result<HostDevClient<Channel>, ConnectError> {
    let channel = connect_channel(path).await?;
    Ok(HostDevClient::new(channel))
}

/// A raw channel to the agent's socket, for the other services it serves (health,
/// reflection).
pub async fn connect_channel(path: &Path) -> Result<Channel, ConnectError> {
    let err = |source| ConnectError::Connect {
        path: path.to_path_buf(),
        source,
    };
    // The URI is required by the HTTP/2 layer but never resolved: the connector below
    // ignores it and dials the socket.
    let endpoint = Endpoint::from_static("http://[::]:50051").connect_timeout(CONNECT_TIMEOUT);
    let socket = path.to_path_buf();
    endpoint
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = socket.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(p).await?,
                ))
            }
        }))
        .await
        .map_err(err)
}
