//! `gpu-ckpt`: inspect, verify, check compatibility of, build and extract gpu-ckpt checkpoints.
//!
//! This is the dispatcher: the flags of each subcommand and what it does are in
//! `gpu_ckpt_cli::commands::<name>`, printing in `output` (`-o text|json|yaml`), the exit codes
//! and the map from an error to its code in `exit` (docs/usage.md, "Exit codes").

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

use gpu_ckpt_cli::commands::{
    build, compat, completion, device, events, extract, inspect, key, pull, verify,
};
use gpu_ckpt_cli::drain_plan;
use gpu_ckpt_cli::exit::{self, ExitClass};
use gpu_ckpt_cli::output::{self, Format, Report};

#[derive(Parser)]
#[command(
    name = "gpu-ckpt",
    version,
    about = "Inspect, verify, check and package gpu-ckpt checkpoints",
    after_help = "Exit codes: 0 ok, 1 no (not compatible, nowhere to go, a device step refused), \
                  2 usage, 3 I/O, 4 integrity, 5 trust, 6 registry."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Show what a checkpoint archive or image holds (like `checkpointctl inspect`), with the GPU
    /// section and the compatibility verdict for this node.
    Inspect(inspect::InspectArgs),
    /// Verify every digest: archive members against the manifest, image blobs against their digests,
    /// or a checkpoint directory against its manifest; and the signer, as a node would.
    Verify(verify::VerifyArgs),
    /// Can this checkpoint restore on this node? Exit 0 yes, 1 no (the differing fields are printed).
    Compat(compat::CompatArgs),
    /// Turn a checkpoint archive into an OCI image (layout directory and/or tarball), optionally pushed.
    Build(build::BuildArgs),
    /// Pull a checkpoint image from a registry and write its checkpoint archive (the image's
    /// layer, verified against its digest) to ARCHIVE (a new file, mode 0600).
    Pull(pull::PullArgs),
    /// Manage the node's signing key: rotate it, revoke a key.
    #[command(subcommand)]
    Key(key::KeyCmd),
    /// Drive the CUDA driver's checkpoint API for one process, like NVIDIA's cuda-checkpoint, or
    /// list the node's GPUs (--list). Exit 1 when the driver or the process fails, 2 on usage.
    Device(device::DeviceArgs),
    /// Plan a node's drain or a fleet's driver upgrade from `kubectl get pods/nodes -o json`:
    /// the ordered steps and kubelet checkpoint calls. Exit 1 when a workload has nowhere to go.
    DrainPlan(drain_plan::cli::DrainPlanArgs),
    /// Extract: an archive into a directory (checked, verified, root-only), or an image back to its
    /// archive (--archive).
    Extract(extract::ExtractArgs),
    /// The node's records of checkpoints and restores (the shims' journal), oldest first: one
    /// line each, or the records as JSON/YAML; filtered by operation, outcome, pod, time.
    Events(events::EventsArgs),
    /// Print the shell's completion script: `source <(gpu-ckpt completion bash)`.
    Completion(completion::CompletionArgs),
}

impl Cmd {
    fn format(&self) -> Format {
        match self {
            Cmd::Inspect(a) => a.out.format(),
            Cmd::Verify(a) => a.out.format(),
            Cmd::Compat(a) => a.out.format(),
            Cmd::Build(a) => a.out.format(),
            Cmd::Pull(a) => a.out.format(),
            Cmd::Key(k) => k.format(),
            Cmd::Device(a) => a.out.format(),
            Cmd::DrainPlan(a) => Format::from_args(&["-o".into(), a.output.clone()]),
            Cmd::Extract(a) => a.out.format(),
            Cmd::Events(a) => a.out.format(),
            Cmd::Completion(_) => Format::Text,
        }
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return clap_error(e),
    };
    let format = cli.cmd.format();
    // `device` says which step failed on one line of its own (cuda-checkpoint's style).
    let (prefix, one_line) = match cli.cmd {
        Cmd::Device(_) => ("gpu-ckpt device: ", true),
        _ => ("gpu-ckpt: error: ", false),
    };
    let done = run(cli.cmd, format).and_then(|o| match o {
        Outcome::Report(r) => {
            output::print(format, &r)?;
            Ok(r.class)
        }
        Outcome::Printed(class) => Ok(class),
    });
    match done {
        Ok(class) => class.exit_code(),
        Err(e) => {
            let class = exit::classify(&e);
            let mut text = output::error_text(&e);
            if one_line {
                text = text.replace('\n', " ");
            }
            output::print_error(format, prefix, &text, class);
            class.exit_code()
        }
    }
}

/// A usage error of clap's (exit 2), as JSON or YAML where the command line asked for them;
/// `--help` and `--version` as clap prints them.
fn clap_error(e: clap::Error) -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let format = Format::from_args(&args);
    if !e.use_stderr() || format == Format::Text {
        e.exit();
    }
    // The message, up to clap's usage lines, on one line.
    let text = e.to_string();
    let message: Vec<&str> = text
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    let message = message.join(" ");
    output::print_error(
        format,
        "",
        message.trim_start_matches("error: "),
        ExitClass::Usage,
    );
    ExitClass::Usage.exit_code()
}

/// What a command ended with: a report to print, or the class of one it printed itself.
enum Outcome {
    Report(Report),
    Printed(ExitClass),
}

fn run(cmd: Cmd, format: Format) -> anyhow::Result<Outcome> {
    let report = match cmd {
        Cmd::Inspect(a) => inspect::run(&a)?,
        Cmd::Verify(a) => verify::run(&a)?,
        Cmd::Compat(a) => compat::run(&a)?,
        Cmd::Build(a) => build::run(&a)?,
        Cmd::Pull(a) => pull::run(&a)?,
        Cmd::Extract(a) => extract::run(&a)?,
        Cmd::Key(k) => key::run(&k)?,
        Cmd::Device(a) => device::run(&a)?,
        Cmd::Events(a) => events::run(&a)?,
        Cmd::DrainPlan(a) if format == Format::Yaml => {
            let plan = drain_plan::cli::make_plan(&a)?;
            Report::new(String::new(), serde_json::to_value(&plan)?).yes_if(plan.complete)
        }
        Cmd::DrainPlan(a) => {
            let complete = drain_plan::cli::run(&a, &mut std::io::stdout().lock())?;
            let class = if complete {
                ExitClass::Ok
            } else {
                ExitClass::No
            };
            return Ok(Outcome::Printed(class));
        }
        Cmd::Completion(a) => {
            completion::write(&a, &mut Cli::command(), &mut std::io::stdout().lock());
            return Ok(Outcome::Printed(ExitClass::Ok));
        }
    };
    Ok(Outcome::Report(report))
}
