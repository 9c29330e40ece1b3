//! `containerd-shim-gpu-ckpt-v1`: the binary containerd starts for runtime `io.containerd.gpu-ckpt.v1`.

use gpu_ckpt_shim::service::{Service, RUNTIME_ID};

#[tokio::main]
async fn main() {
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
}
