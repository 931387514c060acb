//! The real agent served inside the test process on a temp Unix socket.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use hostdevd::api::proto::host_dev_client::HostDevClient;
use hostdevd::api::Access;
use hostdevd::client::Client;
use hostdevd::config::Config;
use hostdevd::daemon::{bind_socket, serve, Agent};
use hostdevd::simhost::FakeTree;

/// A running agent; `stop` shuts it down gracefully.
pub struct TestServer {
    pub socket: PathBuf,
    /// The agent's counters, read in place.
    pub metrics: std::sync::Arc<hostdevd::metrics::Metrics>,
    /// The agent's rescanner, whose turn a test may hold (a rescan that takes long).
    pub rescanner: std::sync::Arc<hostdevd::rescan::Rescanner>,
    /// The agent's writer, for a test that calls it as the service does.
    pub writer: hostdevd::writer::Writer,
    _state: tempfile::TempDir,
    _tree: Option<FakeTree>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl TestServer {
    /// Starts the agent with `cfg`, its state dir and socket moved into a fresh temp dir
    /// (mode 0755, so a test may reach the socket as another uid). `tree` is kept alive
    /// as long as the server.
    pub async fn start(
        mut cfg: Config,
        socket_mode: u32,
        writer_uids: Vec<u32>,
        tree: Option<FakeTree>,
    ) -> TestServer {
        let state = tempfile::tempdir().expect("state dir");
        std::fs::set_permissions(state.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod state dir");
        let socket = state.path().join("hostdevd.sock");
        cfg.state_dir = state.path().join("state");
        cfg.api.socket = socket.clone();
        let (agent, _closing) = Agent::start(&cfg).await.expect("agent start");
        let metrics = agent.writer.metrics().clone();
        let rescanner = agent.rescanner.clone();
        let writer = agent.writer.clone();
        let listener = bind_socket(&socket, socket_mode, None).expect("bind");
        let service = agent.service(Access {
            writer_uids,
            writer_gids: vec![],
        });
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            serve(listener, service, async {
                let _ = rx.await;
            })
            .await
            .expect("serve");
            // The agent (and its libvirt poller) lives until the server stops.
            drop(agent);
        });
        TestServer {
            socket,
            metrics,
            rescanner,
            writer,
            _state: state,
            _tree: tree,
            stop: Some(tx),
            task: Some(task),
        }
    }

    pub async fn client(&self) -> Client {
        hostdevd::client::connect(&self.socket)
            .await
            .expect("connect to the test server")
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            t.await.expect("server task");
        }
    }
}
