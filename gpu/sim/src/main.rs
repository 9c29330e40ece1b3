//! `gpu-ckpt-simgpu`: the simulated NVIDIA driver's node daemon and its control commands.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{anyhow, Context};
use clap::{Parser, Subcommand, ValueEnum};

use simgpu::client::Client;
use simgpu::daemon::{self, Daemon};
use simgpu::node::NodeConfig;
use simgpu::proto::{FaultOp, Reply, Request, Role, SOCKET_NAME};

#[derive(Parser)]
#[command(
    name = "gpu-ckpt-simgpu",
    version,
    about = "A simulated NVIDIA driver for machines without a GPU"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Be the node's GPUs: lay out DIR (socket, lib/, dev/) and serve until killed.
    Serve {
        #[arg(long)]
        dir: PathBuf,
        #[command(flatten)]
        node: NodeConfig,
        /// Write the CDI spec (kind sim.gpu-ckpt.io/gpu) here.
        #[arg(long)]
        cdi_dir: Option<PathBuf>,
        /// Where the built libcuda.so, libnvidia_ml.so and libnccl.so are (default: next to this binary).
        #[arg(long)]
        lib_src: Option<PathBuf>,
    },
    /// Inject a fault into checkpoint steps (of one process, or of all).
    Fault {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, value_enum)]
        op: FaultArg,
        #[arg(long)]
        pid: Option<i32>,
        /// Remove the fault instead.
        #[arg(long)]
        clear: bool,
    },
    /// Print the node and the processes using it, as JSON.
    Status {
        #[arg(long)]
        dir: PathBuf,
    },
    /// An OCI hook the CDI spec names (the container's state on stdin), as `nvidia-ctk hook`.
    Hook {
        #[command(subcommand)]
        hook: HookCmd,
    },
}

#[derive(Subcommand)]
enum HookCmd {
    /// Make each `--link TARGET::LINK` in the container's root (simgpu::cdi::create_symlinks).
    CreateSymlinks {
        #[arg(long = "link")]
        links: Vec<String>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum FaultArg {
    LockTimeout,
    CheckpointFail,
    RestoreFail,
    RestoreHang,
    LockHang,
    CheckpointHang,
    StateHang,
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu-ckpt-simgpu: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Serve {
            dir,
            node: cfg,
            cdi_dir,
            lib_src,
        } => {
            let node = cfg.describe();
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let dir = std::fs::canonicalize(&dir)?;
            let lib_src = match lib_src {
                Some(p) => p,
                None => std::env::current_exe()?
                    .parent()
                    .ok_or_else(|| anyhow!("no directory for this binary"))?
                    .to_path_buf(),
            };
            daemon::prepare_dir(&dir, &lib_src, &node, cdi_dir.as_deref())?;
            let d = Arc::new(Daemon::new(node, dir.join(SOCKET_NAME)));
            println!(
                "gpu-ckpt-simgpu: serving {} GPU(s) on {}",
                cfg.gpus,
                dir.join(SOCKET_NAME).display()
            );
            d.serve().context("serving")
        }
        Cmd::Fault {
            dir,
            op,
            pid,
            clear,
        } => {
            let op = match op {
                FaultArg::LockTimeout => FaultOp::LockTimeout,
                FaultArg::CheckpointFail => FaultOp::CheckpointFail,
                FaultArg::RestoreFail => FaultOp::RestoreFail,
                FaultArg::RestoreHang => FaultOp::RestoreHang,
                FaultArg::LockHang => FaultOp::LockHang,
                FaultArg::CheckpointHang => FaultOp::CheckpointHang,
                FaultArg::StateHang => FaultOp::StateHang,
            };
            let mut c = Client::connect(&dir.join(SOCKET_NAME), Role::Control)?;
            c.ok(&Request::Fault {
                pid,
                op,
                set: !clear,
            })?;
            Ok(())
        }
        Cmd::Hook {
            hook: HookCmd::CreateSymlinks { links },
        } => simgpu::cdi::create_symlinks(std::io::stdin().lock(), &links)
            .context("hook create-symlinks"),
        Cmd::Status { dir } => {
            let mut c = Client::connect(&dir.join(SOCKET_NAME), Role::Control)?;
            let node = c.call(&Request::Node)?;
            let procs = c.call(&Request::Processes)?;
            let (Reply::Node(node), Reply::Processes(procs)) = (node, procs) else {
                return Err(anyhow!("unexpected reply"));
            };
            let out = serde_json::json!({ "node": node, "processes": procs });
            println!("{}", serde_json::to_string_pretty(&out)?);
            Ok(())
        }
    }
}
