//! The client side of the Unix socket: connecting a generated `HostDev` client to a
//! running agent, for the CLI, integration tests and benches.
//!
//! Why not tonic's `Channel`: under it, hyper sends a unary request's headers and its
//! message in two writes (the message from a task spawned per call, once the new stream
//! has send capacity), behind a buffer task of its own, so every call cost the client
//! two wake-ups more and the agent a second read. [`Direct`] hands the whole request to
//! one HTTP/2 connection at once, as gRPC's C core does, and tonic's generated clients
//! run on it unchanged. It serves unary and server-streaming calls, all that the API
//! has, and makes its connection again once it is gone (the agent restarted): the call
//! under way fails, and the next one goes out on a new connection.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::api::proto::host_dev_client::HostDevClient;

mod direct;
pub use direct::{Direct, DirectError, Received};

/// A generated `HostDev` client on its own connection to the agent.
pub type Client = HostDevClient<Direct>;

/// The socket the packaged daemon listens on (the config's `api.socket` default).
pub const DEFAULT_SOCKET_PATH: &str = "/run/hostdevd/hostdevd.sock";

/// The environment variable clients read for the socket path when none is given.
pub const SOCKET_ENV: &str = "HOSTDEVD_SOCKET";

/// How long a connection attempt may take before it counts as "cannot connect".
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why no connection to the agent could be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The socket is missing or refuses connections, or the agent closed the connection
    /// before its HTTP/2 handshake was made.
    #[error("cannot connect to hostdevd at {path}: {source}")]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl ConnectError {
    /// The socket the connection was attempted on.
    pub fn path(&self) -> &Path {
        match self {
            ConnectError::Connect { path, .. } => path,
        }
    }

    /// What kind of failure it was: `NotFound`, `ConnectionRefused` or
    /// `PermissionDenied` never reached an agent, `TimedOut` reached one that did not
    /// answer, any other an agent that closed the connection.
    pub fn kind(&self) -> std::io::ErrorKind {
        match self {
            ConnectError::Connect { source, .. } => source.kind(),
        }
    }
}

/// Connects to the agent listening on the Unix socket `path`. The connection is made
/// eagerly, so a missing daemon is reported here rather than on the first call.
pub async fn connect(path: &Path) -> Result<Client, ConnectError> {
    Ok(HostDevClient::new(connect_transport(path).await?))
}

/// [`connect`], with the process id of the agent listening on the socket, as the kernel
/// gives it to this client (`None` where it cannot: an agent in a PID namespace that this
/// process does not see into).
pub async fn connect_with_pid(path: &Path) -> Result<(Client, Option<i32>), ConnectError> {
    let (transport, pid) = connect_within(path, CONNECT_TIMEOUT).await?;
    Ok((HostDevClient::new(transport), pid))
}

/// A connection to the agent's socket for any generated client (health included).
pub async fn connect_transport(path: &Path) -> Result<Direct, ConnectError> {
    Ok(connect_within(path, CONNECT_TIMEOUT).await?.0)
}

/// [`connect_transport`], giving up after `limit`; with the listening process's id.
async fn connect_within(
    path: &Path,
    limit: Duration,
) -> Result<(Direct, Option<i32>), ConnectError> {
    let err = |source| ConnectError::Connect {
        path: path.to_path_buf(),
        source,
    };
    let attempt = async {
        let io = tokio::net::UnixStream::connect(path).await?;
        // The credentials of the process that made the listening socket, read at connect.
        let pid = io.peer_cred().ok().and_then(|c| c.pid()).filter(|p| *p > 0);
        let direct = Direct::handshake(io).await?;
        Ok::<_, std::io::Error>((direct.again_on(path.to_path_buf(), limit), pid))
    };
    match tokio::time::timeout(limit, attempt).await {
        Ok(made) => made.map_err(err),
        Err(_) => Err(err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "no answer to the HTTP/2 handshake within {} ms",
                limit.as_millis()
            ),
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener that accepts and then keeps each connection open in silence
    /// (`silent`) or closes it at once.
    fn listener(dir: &Path, silent: bool) -> PathBuf {
        let path = dir.join(if silent {
            "silent.sock"
        } else {
            "closing.sock"
        });
        let l = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        std::thread::spawn(move || {
            let mut kept = Vec::new();
            for s in l.incoming().flatten() {
                if silent {
                    kept.push(s);
                }
            }
        });
        path
    }

    #[tokio::test]
    async fn a_peer_that_never_answers_the_handshake_is_given_up_on() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = listener(dir.path(), true);
        let t = std::time::Instant::now();
        let attempt = connect_within(&path, Duration::from_millis(300));
        let e = tokio::time::timeout(Duration::from_secs(10), attempt)
            .await
            .expect("the connect gives up on its own")
            .expect_err("a silent peer");
        let ConnectError::Connect { source, .. } = &e;
        assert_eq!(source.kind(), std::io::ErrorKind::TimedOut, "{e}");
        assert!(
            e.to_string().contains("no answer to the HTTP/2 handshake"),
            "{e}"
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[tokio::test]
    async fn a_peer_that_closes_at_once_fails_the_connect_not_the_first_call() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = listener(dir.path(), false);
        let e = connect_within(&path, Duration::from_secs(30))
            .await
            .expect_err("a closed connection");
        let ConnectError::Connect { source, .. } = &e;
        assert_ne!(source.kind(), std::io::ErrorKind::TimedOut, "{e}");
    }

    #[tokio::test]
    async fn no_socket_is_an_io_error_of_its_kind() {
        let dir = tempfile::tempdir().expect("tempdir");
        let e = connect(&dir.path().join("none.sock"))
            .await
            .expect_err("no socket");
        let ConnectError::Connect { source, path } = &e;
        assert_eq!(source.kind(), std::io::ErrorKind::NotFound, "{e}");
        assert_eq!(path, &dir.path().join("none.sock"));
    }
}
