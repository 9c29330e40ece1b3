//! gpu-ckpt-cuda-checkpoint: the part of NVIDIA's `cuda-checkpoint` command line that CRIU's
//! cuda plugin (`plugins/cuda/cuda_plugin.c`, CRIU 4.1 and 4.2) runs, over the CUDA driver's
//! checkpoint API in the `libcuda.so.1` the loader finds. Tests install it as `cuda-checkpoint`
//! where NVIDIA's own tool cannot be downloaded.
//!
//! The plugin reads `-h` for the `--action` flag, `--get-restore-tid --pid P` (a thread id,
//! read with `atoi`), `--get-state --pid P` (`running`, `locked`, `checkpointed`, `failed`) and
//! runs `--action lock|checkpoint|restore|unlock --pid P [--timeout MS]`; a nonzero exit status
//! is a failure, whose output it logs.

use std::time::Duration;

use gpu::{CudaDriver, DeviceCheckpoint, GpuError};
use gpu_ckpt_gpu_workloads::{cli, emit, Fail};

const USAGE: &str = "CUDA checkpoint and restore utility (the subset CRIU's cuda plugin uses).

Usage: cuda-checkpoint --action <action> --pid <pid> [--timeout <ms>]
       cuda-checkpoint --get-state --pid <pid>
       cuda-checkpoint --get-restore-tid --pid <pid>

    --action <action>  lock, checkpoint, restore or unlock the CUDA state of the process
    --pid <pid>        the process (a thread id names its process)
    --timeout <ms>     how long lock waits for work in flight (0: no bound)
    --get-state        prints running, locked, checkpointed or failed
    --get-restore-tid  prints the id of the process's restore thread
    -h, --help         this text";

fn main() {
    gpu_ckpt_gpu_workloads::main("cuda-checkpoint", USAGE, run);
}

/// What one invocation asks for.
enum Ask {
    State,
    RestoreTid,
    Action(String),
}

fn run(args: &[String]) -> Result<i32, Fail> {
    let flags = cli::pairs(
        args,
        &["--get-state", "--get-restore-tid"],
        &["--action", "--pid", "--timeout"],
    )
    .map_err(Fail::Usage)?;
    let (mut ask, mut pid, mut timeout) = (Vec::new(), None, None);
    for (flag, v) in &flags {
        match flag.as_str() {
            "--get-state" => ask.push(Ask::State),
            "--get-restore-tid" => ask.push(Ask::RestoreTid),
            "--action" => ask.push(Ask::Action(
                cli::value(flag, v).map_err(Fail::Usage)?.to_string(),
            )),
            "--pid" => pid = Some(cli::number::<i32>(flag, v).map_err(Fail::Usage)?),
            _ => timeout = Some(cli::number::<u64>(flag, v).map_err(Fail::Usage)?),
        }
    }
    let (Some(ask), true) = (ask.pop(), ask.is_empty()) else {
        return Err(Fail::Usage(
            "give one of --action, --get-state and --get-restore-tid".into(),
        ));
    };
    let pid = pid.ok_or_else(|| Fail::Usage("--pid is required".into()))?;
    if timeout.is_some() && !matches!(&ask, Ask::Action(a) if a == "lock") {
        return Err(Fail::Usage("--timeout applies to --action lock".into()));
    }
    let driver = CudaDriver::load().map_err(|e| Fail::Other(e.to_string()))?;
    let failed = |what: &'static str| {
        move |e: GpuError| Fail::Other(format!("{what} of pid {pid} failed: {e}"))
    };
    match ask {
        Ask::State => emit(&driver.state(pid).map_err(failed("get-state"))?.to_string()),
        Ask::RestoreTid => emit(
            &driver
                .restore_thread_id(pid)
                .map_err(failed("get-restore-tid"))?
                .to_string(),
        ),
        Ask::Action(a) => match a.as_str() {
            "lock" => {
                let bound = timeout.filter(|&ms| ms > 0).map(Duration::from_millis);
                driver.lock(pid, bound).map_err(failed("lock"))?
            }
            "checkpoint" => driver.checkpoint(pid).map_err(failed("checkpoint"))?,
            "restore" => driver.restore(pid, &[]).map_err(failed("restore"))?,
            "unlock" => driver.unlock(pid).map_err(failed("unlock"))?,
            other => return Err(Fail::Usage(format!("unknown action {other:?}"))),
        },
    }
    Ok(0)
}
