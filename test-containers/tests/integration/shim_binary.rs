//! The shim binary's own flags: `-v` and containerd's `-info` action.

use anyhow::{ensure, Context, Result};
use containerd_shim_protos::{protobuf::Message, types::introspection::RuntimeInfo};
use test_containers::stack::Stack;

fn shim() -> Result<std::path::PathBuf> {
    let p = Stack::discover()?
        .shim_dir()
        .join("containerd-shim-gpu-ckpt-v1");
    ensure!(p.exists(), "{} is not built (cargo build)", p.display());
    Ok(p)
}

#[test]
fn version_flag() -> Result<()> {
    let out = std::process::Command::new(shim()?).arg("-v").output()?;
    ensure!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    ensure!(text.contains("containerd-shim-gpu-ckpt-v1"), "{text}");
    ensure!(
        text.contains(&format!("Version:  {}", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    Ok(())
}

#[test]
fn info_action_describes_the_runtime() -> Result<()> {
    let out = std::process::Command::new(shim()?)
        .arg("-info")
        .stdin(std::process::Stdio::null())
        .output()?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let info = RuntimeInfo::parse_from_bytes(&out.stdout).context("decode RuntimeInfo")?;
    ensure!(
        info.name == "io.containerd.gpu-ckpt.v1",
        "name {:?}",
        info.name
    );
    ensure!(
        info.annotations
            .get("org.opencontainers.runc.checkpoint.enabled")
            .map(String::as_str)
            == Some("true"),
        "annotations {:?}",
        info.annotations
    );
    ensure!(info.version.version == env!("CARGO_PKG_VERSION"));
    Ok(())
}
