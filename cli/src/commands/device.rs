//! `gpu-ckpt device`: cuda-checkpoint's options over the gpu crate's backends: one step of
//! the CUDA driver's checkpoint API for one process, or the node's GPUs (`--list`).
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::{ArgGroup, ValueEnum};
use gpu::{
    CudaDriver, DeviceCheckpoint, GpuError, GpuPair, Inventory, NodeInventory, NvmlInventory,
    ProcessState,
};

use crate::exit::CliError;
use crate::output::{Format, OutputArgs, Report, Text};

#[derive(clap::Args, Debug)]
#[command(group(
    ArgGroup::new("op")
        .required(true)
        .args(["get_state", "get_restore_tid", "action", "toggle", "list"])
))]
pub struct DeviceArgs {
    /// The process to act on.
    #[arg(short = 'p', long, value_name = "PID",
          value_parser = clap::value_parser!(i32).range(1..),
          required_unless_present = "list")]
    pid: Option<i32>,
    /// Print the process's state (running, locked, checkpointed, failed, ...).
    #[arg(long)]
    get_state: bool,
    /// Print the tid of the driver's restore thread in the process.
    #[arg(long)]
    get_restore_tid: bool,
    /// One step of the checkpoint API.
    #[arg(long, value_enum, value_name = "ACTION")]
    action: Option<Action>,
    /// running → lock + checkpoint; checkpointed → restore + unlock.
    #[arg(long)]
    toggle: bool,
    /// Lock timeout in milliseconds (0: none). With --action lock or --toggle.
    #[arg(short = 't', long, value_name = "MS")]
    timeout: Option<u32>,
    /// Restore onto other GPUs: OLD=NEW,... (GPU-… UUIDs). With --action restore or --toggle.
    #[arg(long, value_name = "OLD=NEW,...")]
    device_map: Option<String>,
    /// List the node's GPUs and driver versions (NVML).
    #[arg(long)]
    list: bool,
    #[command(flatten)]
    pub out: OutputArgs,
    /// The CUDA driver library (default: libcuda.so.1 from the loader's search path).
    #[arg(long, value_name = "PATH")]
    libcuda: Option<PathBuf>,
    /// The NVML library (default: libnvidia-ml.so.1 from the loader's search path).
    #[arg(long, value_name = "PATH")]
    libnvml: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Action {
    Lock,
    Checkpoint,
    Restore,
    Unlock,
}

/// A failed step: printed as one line, exit 1.
struct Failure {
    step: &'static str,
    pid: Option<i32>,
    error: String,
}

impl From<Failure> for CliError {
    fn from(f: Failure) -> CliError {
        let what = match f.pid {
            Some(pid) => format!("{} pid {pid}", f.step),
            None => f.step.to_string(),
        };
        CliError::Device {
            what,
            error: f.error,
        }
    }
}

fn fail(step: &'static str, pid: Option<i32>) -> impl FnOnce(GpuError) -> Failure {
    move |e| Failure {
        step,
        pid,
        error: e.to_string(),
    }
}

fn usage(msg: &str) -> anyhow::Error {
    CliError::Usage(msg.to_string()).into()
}

pub fn run(args: &DeviceArgs) -> Result<Report> {
    let toggles = args.toggle;
    let action = args.action;
    if args.out.format() != Format::Text && !args.list {
        return Err(usage("--json (-o json|yaml) applies to --list"));
    }
    if args.timeout.is_some() && !(toggles || action == Some(Action::Lock)) {
        return Err(usage("--timeout applies to --action lock and --toggle"));
    }
    let pairs = match &args.device_map {
        None => Vec::new(),
        Some(_) if !(toggles || action == Some(Action::Restore)) => {
            return Err(usage(
                "--device-map applies to --action restore and --toggle",
            ))
        }
        Some(m) => GpuPair::parse_map(m).map_err(|e| usage(&format!("--device-map: {e}")))?,
    };
    let done = if args.list {
        list(args)
    } else {
        match args.pid {
            Some(pid) => on_process(args, pid, &pairs),
            None => return Err(usage("--pid is required")),
        }
    };
    done.map_err(|f| CliError::from(f).into())
}

fn on_process(args: &DeviceArgs, pid: i32, pairs: &[GpuPair]) -> Result<Report, Failure> {
    let driver = CudaDriver::open(args.libcuda.as_deref()).map_err(fail("load", Some(pid)))?;
    let timeout = args
        .timeout
        .filter(|&ms| ms > 0)
        .map(|ms| Duration::from_millis(u64::from(ms)));
    let mut t = Text::default();
    let mut data = serde_json::json!({"pid": pid});
    if args.get_state {
        let s = driver.state(pid).map_err(fail("get-state", Some(pid)))?;
        t.line(s.to_string());
        data["state"] = s.to_string().into();
    } else if args.get_restore_tid {
        let tid = driver
            .restore_thread_id(pid)
            .map_err(fail("get-restore-tid", Some(pid)))?;
        t.line(tid.to_string());
        data["restore_tid"] = tid.into();
    } else if let Some(a) = args.action {
        match a {
            Action::Lock => driver.lock(pid, timeout).map_err(fail("lock", Some(pid)))?,
            Action::Checkpoint => driver
                .checkpoint(pid)
                .map_err(fail("checkpoint", Some(pid)))?,
            Action::Restore => driver
                .restore(pid, pairs)
                .map_err(fail("restore", Some(pid)))?,
            Action::Unlock => driver.unlock(pid).map_err(fail("unlock", Some(pid)))?,
        }
    } else if args.toggle {
        toggle(&driver, pid, timeout, pairs)?;
    }
    Ok(Report::new(t.0, data))
}

/// running → lock + checkpoint (unlocked again if the checkpoint fails); checkpointed →
/// restore + unlock; anything else is an error.
fn toggle(
    driver: &dyn DeviceCheckpoint,
    pid: i32,
    timeout: Option<Duration>,
    pairs: &[GpuPair],
) -> Result<(), Failure> {
    let state = driver.state(pid).map_err(fail("get-state", Some(pid)))?;
    match state {
        ProcessState::RUNNING => {
            driver.lock(pid, timeout).map_err(fail("lock", Some(pid)))?;
            if let Err(e) = driver.checkpoint(pid) {
                let undo = match driver.unlock(pid) {
                    Ok(()) => "the process was unlocked again".to_string(),
                    Err(u) => format!("unlocking it again failed too: {u}"),
                };
                return Err(Failure {
                    step: "checkpoint",
                    pid: Some(pid),
                    error: format!("{e}; {undo}"),
                });
            }
            Ok(())
        }
        ProcessState::CHECKPOINTED => {
            driver
                .restore(pid, pairs)
                .map_err(fail("restore", Some(pid)))?;
            driver.unlock(pid).map_err(fail("unlock", Some(pid)))
        }
        other => Err(Failure {
            step: "toggle",
            pid: Some(pid),
            error: format!(
                "the process is {other}; --toggle acts on running or checkpointed processes \
                 (use --action)"
            ),
        }),
    }
}

fn list(args: &DeviceArgs) -> Result<Report, Failure> {
    let nvml = NvmlInventory::open(args.libnvml.as_deref()).map_err(fail("list", None))?;
    let node = nvml.node().map_err(fail("list", None))?;
    // The inventory as `compat --node FILE` reads it back.
    let data = serde_json::to_value(&node).map_err(|e| Failure {
        step: "list",
        pid: None,
        error: e.to_string(),
    })?;
    Ok(Report::new(list_text(&node), data))
}

fn list_text(node: &NodeInventory) -> String {
    let v = node.cuda_driver_version;
    let mut out = format!(
        "driver {}  CUDA {}.{}  GPU remapping: {}\n",
        node.driver_version,
        v / 1000,
        (v % 1000) / 10,
        if v >= gpu::cuda::REMAP_MIN_VERSION {
            "yes"
        } else {
            "no"
        }
    );
    for g in &node.gpus {
        let cc = g
            .compute_capability
            .map(|(a, b)| format!("sm_{a}{b}"))
            .unwrap_or_else(|| "sm_?".into());
        let persistence = match g.persistence_mode {
            Some(true) => "persistence on",
            Some(false) => "persistence off",
            None => "persistence ?",
        };
        out.push_str(&format!(
            "{}  {}  {}  {}  {}  {:.1} GiB  {}  {}\n",
            g.index,
            g.uuid,
            g.name,
            g.architecture.as_deref().unwrap_or("?"),
            cc,
            g.memory_total_bytes as f64 / (1u64 << 30) as f64,
            g.pci_bus_id,
            persistence
        ));
    }
    out
}
