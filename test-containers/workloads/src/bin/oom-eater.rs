//! `oom-eater [--step-mib 16] [--interval-ms 50]`
//!
//! Allocates and touches memory forever, printing `allocated <total> MiB` after each step, until
//! the kernel's OOM killer (or a failed allocation) ends it.

use gpu_ckpt_workloads::{exit_usage, parse_or_exit, say, sleep_ms, terminate_on_signals_as_pid1};

const USAGE: &str = "oom-eater [--step-mib 16] [--interval-ms 50]";

fn main() {
    let flags = parse_or_exit(USAGE, &["step-mib", "interval-ms"]);
    let step = flags
        .u64_or("step-mib", 16)
        .unwrap_or_else(|e| exit_usage(USAGE, e));
    let interval = flags
        .u64_or("interval-ms", 50)
        .unwrap_or_else(|e| exit_usage(USAGE, e));
    if step == 0 {
        exit_usage(
            USAGE,
            gpu_ckpt_workloads::UsageError {
                message: "--step-mib must be at least 1".into(),
            },
        );
    }
    terminate_on_signals_as_pid1();

    let step_bytes = (step as usize) * 1024 * 1024;
    let mut held: Vec<Vec<u8>> = Vec::new();
    let mut total: u64 = 0;
    loop {
        let mut chunk = vec![0u8; step_bytes];
        // Touch every page so that the memory is really charged to the cgroup.
        for (i, b) in chunk.iter_mut().step_by(4096).enumerate() {
            *b = (i as u8) | 1;
        }
        std::hint::black_box(&chunk);
        held.push(chunk);
        total += step;
        say(&format!("allocated {total} MiB"));
        if interval > 0 {
            sleep_ms(interval);
        }
    }
}
