//! `gpu-ckpt-hook`: gpu-ckpt's OCI hooks (createRuntime, prestart) and the containerd base
//! runtime spec that installs them. Errors go to stderr as one line; the exit status is 1.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use oci_hooks::{base_spec, Created, Prestart, BIN_NAME};

#[derive(Parser)]
#[command(
    name = "gpu-ckpt-hook",
    version,
    about = "gpu-ckpt's OCI hooks: run by the runtime with the container's state on stdin"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// createRuntime hook: record the container's GPUs in its bundle (gpu-ckpt-gpus.json).
    CreateRuntime {
        /// libnvidia-ml.so.1 to load (default: the loader's search; a node without it is skipped).
        #[arg(long, value_name = "PATH")]
        libnvml: Option<PathBuf>,
    },
    /// prestart hook: during a restore, refuse GPUs that do not fit the checkpoint.
    Prestart {
        /// libnvidia-ml.so.1 to load (default: the loader's search).
        #[arg(long, value_name = "PATH")]
        libnvml: Option<PathBuf>,
    },
    /// Print a containerd base runtime spec with both hooks installed.
    BaseSpec {
        /// Where the hooks' binary is installed on the node (absolute).
        #[arg(long, value_name = "PATH")]
        hook_path: PathBuf,
        /// libnvidia-ml.so.1 the hooks load (absolute; default: the loader's search).
        #[arg(long, value_name = "PATH")]
        libnvml: Option<PathBuf>,
        /// Start from this OCI runtime spec (default: containerd's default spec).
        #[arg(long, value_name = "FILE")]
        from: Option<PathBuf>,
    },
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::CreateRuntime { libnvml } => {
            let state = oci_hooks::read_state(std::io::stdin().lock())?;
            // Nothing given, no driver, or recorded: all quiet.
            let _: Created = oci_hooks::create_runtime(&state, || {
                oci_hooks::inventory_if_driver(libnvml.as_deref())
            })?;
            Ok(())
        }
        Command::Prestart { libnvml } => {
            let state = oci_hooks::read_state(std::io::stdin().lock())?;
            // Not a restore, nothing to hold, or the GPUs fit: all quiet.
            let _: Prestart =
                oci_hooks::prestart(&state, || oci_hooks::inventory(libnvml.as_deref()))?;
            Ok(())
        }
        Command::BaseSpec {
            hook_path,
            libnvml,
            from,
        } => {
            let spec = match &from {
                Some(path) => {
                    let bytes = std::fs::read(path)
                        .with_context(|| format!("reading {}", path.display()))?;
                    serde_json::from_slice(&bytes)
                        .with_context(|| format!("{} is not valid JSON", path.display()))?
                }
                None => base_spec::default_spec()?,
            };
            let spec = base_spec::with_hooks(spec, &hook_path, libnvml.as_deref())?;
            let mut out = serde_json::to_string_pretty(&spec)?;
            out.push('\n');
            std::io::stdout()
                .lock()
                .write_all(out.as_bytes())
                .context("writing the spec to stdout")?;
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help, --version.
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let text = e.to_string();
            let line = text.lines().next().unwrap_or_default();
            let line = line.strip_prefix("error: ").unwrap_or(line);
            eprintln!("{BIN_NAME}: {line} (see {BIN_NAME} --help)");
            return ExitCode::FAILURE;
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{BIN_NAME}: {e:#}");
            ExitCode::FAILURE
        }
    }
}
