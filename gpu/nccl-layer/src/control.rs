//! The control thread: connects to the shim's socket, says Hello, and serves the shim's
//! requests; after a Disconnect (or a lost connection) it connects again every 50 ms.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nccl_control::{Connection, ControlError, LayerMsg, ShimMsg};

use crate::backend::Backend;
use crate::layer::{Layer, SEND_TIMEOUT};

/// Between two tries to connect.
pub const RECONNECT: Duration = Duration::from_millis(50);

/// How long the layer waits for the shim's Welcome before it drops the connection and tries
/// again (a shim that accepted and never answered, a connection left over from before a
/// restore, must not keep the layer from ever reconnecting).
pub const WELCOME_TIMEOUT: Duration = Duration::from_secs(10);

/// What ends a session with the shim.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error("the shim answered Hello with {0:?}, not Welcome")]
    NoWelcome(Box<ShimMsg>),
}

/// Starts the control thread once per process, where `$GPU_CKPT_NCCL_SOCKET` names a socket
/// (unset: the layer only forwards). Called when a communicator is made, never from a
/// constructor: a preloaded library must not start threads before `main`.
pub fn ensure<B: Backend>(layer: &'static Layer<B>) {
    let Some(path) = std::env::var_os(nccl_control::ENV_SOCKET) else {
        return;
    };
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    let mut started = layer.control_pid.lock().unwrap_or_else(|e| e.into_inner());
    if *started == pid {
        return;
    }
    let path = PathBuf::from(path);
    let spawned = std::thread::Builder::new()
        .name("gpu-ckpt-nccl".into())
        .spawn(move || run(layer, &path));
    match spawned {
        Ok(_) => *started = pid,
        Err(e) => tracing::error!(error = %e, "cannot start the NCCL control thread"),
    }
}

/// Serves the shim forever, connecting again after each session.
pub fn run<B: Backend>(layer: &Layer<B>, path: &Path) {
    let mut token = None;
    loop {
        match session(layer, path, &mut token) {
            Ok(()) => tracing::info!("disconnected by the shim"),
            Err(e) => tracing::debug!(error = %e, "control session ended"),
        }
        std::thread::sleep(RECONNECT);
    }
}

/// One connection: Hello, Welcome (within [`WELCOME_TIMEOUT`]), then requests until
/// Disconnect (Ok) or an error. The connection is closed at the end: every descriptor of it,
/// before the shim can see its end (so that once the shim has seen a Disconnect's connection
/// end, the process holds nothing of it that a checkpoint would have to dump).
pub fn session<B: Backend>(
    layer: &Layer<B>,
    path: &Path,
    token: &mut Option<String>,
) -> Result<(), SessionError> {
    session_within(layer, path, token, WELCOME_TIMEOUT)
}

/// [`session`] with another bound on the wait for Welcome.
pub fn session_within<B: Backend>(
    layer: &Layer<B>,
    path: &Path,
    token: &mut Option<String>,
    welcome: Duration,
) -> Result<(), SessionError> {
    let r = serve(layer, path, token, welcome);
    layer.disconnected();
    r
}

fn serve<B: Backend>(
    layer: &Layer<B>,
    path: &Path,
    token: &mut Option<String>,
    welcome: Duration,
) -> Result<(), SessionError> {
    let mut conn = Connection::connect(path)?;
    conn.send(&layer.hello(token.clone()), Some(SEND_TIMEOUT))?;
    match conn.recv::<ShimMsg>(Some(welcome))? {
        ShimMsg::Welcome { token: t } => *token = Some(t),
        other => return Err(SessionError::NoWelcome(Box::new(other))),
    }
    layer.connected(conn.try_clone()?);
    loop {
        let msg = conn.recv::<ShimMsg>(None)?;
        let _span = tracing::info_span!("nccl control", request = ?msg).entered();
        let reply = match msg {
            ShimMsg::Disconnect => return Ok(()),
            ShimMsg::Go => {
                layer.go();
                continue;
            }
            ShimMsg::Quiesce { deadline_ms } => layer.quiesce(Duration::from_millis(deadline_ms)),
            ShimMsg::Drain {
                targets,
                deadline_ms,
            } => layer.drain(targets, Duration::from_millis(deadline_ms)),
            ShimMsg::Release => layer.release(),
            ShimMsg::Resume => layer.resume(),
            ShimMsg::Rebuild { ids } => layer.rebuild(ids),
            ShimMsg::NewUniqueId { key } => layer.new_unique_id(key),
            ShimMsg::Welcome { .. } => LayerMsg::Failed {
                comm: None,
                rank: None,
                message: "Welcome outside Hello".into(),
            },
        };
        layer.reply(&reply);
    }
}
