//! Logging: `tracing` events (and the shim crate's `log` records) into containerd's log fifo.

use std::{fs::OpenOptions, sync::Mutex};

use tracing_subscriber::{fmt::format::FmtSpan, EnvFilter};

/// Sends logs to the `log` fifo containerd opened in the bundle (the server's working directory),
/// or to stderr when there is none (a shim run by hand). `RUST_LOG` overrides the level. With
/// `debug` (containerd runs with debug logging), every span logs its duration when it closes:
/// each RPC, and each step of a checkpoint and a restore.
pub fn init(debug: bool) {
    let default = if debug { "debug" } else { "info" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let spans = if debug { FmtSpan::CLOSE } else { FmtSpan::NONE };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_target(false)
        .with_span_events(spans);
    let result = match OpenOptions::new().write(true).open("log") {
        Ok(fifo) => builder.with_writer(Mutex::new(fifo)).try_init(),
        Err(_) => builder.with_writer(std::io::stderr).try_init(),
    };
    if let Err(e) = result {
        eprintln!("gpu-ckpt shim: logging setup failed: {e}");
    }
}
