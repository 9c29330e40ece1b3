//! Logging: `tracing` events (and the shim crate's `log` records) into containerd's log fifo, and
//! the spans of checkpoints and restores to the trace exporter ([`crate::telemetry`]).

use std::{fs::OpenOptions, sync::Mutex};

use tracing_subscriber::{
    fmt::format::FmtSpan, layer::SubscriberExt, util::SubscriberInitExt, EnvFilter, Layer,
};

use crate::telemetry;

/// Sends logs to the `log` fifo containerd opened in the bundle (the server's working directory),
/// or to stderr when there is none (a shim run by hand). `RUST_LOG` overrides the level. With
/// `debug` (containerd runs with debug logging), every span logs its duration when it closes:
/// each RPC, and each step of a checkpoint and a restore. The log level filters the logs only:
/// the trace exporter's own filter takes the operations' and steps' spans at any level.
pub fn init(debug: bool) {
    let default = if debug { "debug" } else { "info" };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let spans = if debug { FmtSpan::CLOSE } else { FmtSpan::NONE };
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(false)
        .with_target(false)
        .with_span_events(spans);
    let fmt = match OpenOptions::new().write(true).open("log") {
        Ok(fifo) => fmt.with_writer(Mutex::new(fifo)).boxed(),
        Err(_) => fmt.with_writer(std::io::stderr).boxed(),
    };
    let result = tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(telemetry::layer())
        .try_init();
    if let Err(e) = result {
        eprintln!("gpu-ckpt shim: logging setup failed: {e}");
    }
}
