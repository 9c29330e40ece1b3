//! `containerd-shim-gpu-ckpt-v1`: the binary containerd starts for runtime `io.containerd.gpu-ckpt.v1`.
//! Started as `containerd-shim-gpu-ckpt-v1 device-worker DIR` by the shim itself, it is the
//! worker that runs the driver's checkpoint calls (`device_worker.rs`).

use gpu_ckpt_shim::device_worker;
use gpu_ckpt_shim::service::{Service, RUNTIME_ID};

fn main() {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() == Some(device_worker::WORKER_ARG) {
        std::process::exit(device_worker::serve(&args.next().unwrap_or_default()));
    }
    shim();
}

// One thread: a shim serves one pod, waits on runc and CRIU most of the time, and hands the
// heavy work (hashing, unpacking) to the blocking pool. It keeps the shim's memory small.
#[tokio::main(flavor = "current_thread")]
async fn shim() {
    if std::env::args()
        .skip(1)
        .any(|a| a == "-v" || a == "--version")
    {
        println!("{}:", env!("CARGO_BIN_NAME"));
        println!("  Version:  {}", env!("CARGO_PKG_VERSION"));
        println!(
            "  Revision: {}",
            option_env!("GPU_CKPT_REVISION").unwrap_or("unknown")
        );
        println!("  Runtime:  {RUNTIME_ID}");
        return;
    }
    containerd_shim::asynchronous::run::<Service>(RUNTIME_ID, None).await;
    // The spans that ended and are not sent yet, bounded: the shim exits next.
    gpu_ckpt_shim::telemetry::shutdown(std::time::Duration::from_secs(2));
}
