//! `counter [--interval-ms 200] [--file /counter.txt] [--start 0]`
//!
//! Each tick increments n, prints `tick <n>` and overwrites the file with `<n>\n`. All state is
//! in memory, so a CRIU restore resumes the count where the checkpoint left it.

use std::path::PathBuf;

use gpu_ckpt_workloads::{
    exit_usage, parse_or_exit, say, sleep_ms, terminate_on_signals_as_pid1, warn, write_file,
};

const USAGE: &str = "counter [--interval-ms 200] [--file /counter.txt] [--start 0]";

fn main() {
    let flags = parse_or_exit(USAGE, &["interval-ms", "file", "start"]);
    let interval = flags
        .u64_or("interval-ms", 200)
        .unwrap_or_else(|e| exit_usage(USAGE, e));
    let mut n = flags
        .u64_or("start", 0)
        .unwrap_or_else(|e| exit_usage(USAGE, e));
    let file = PathBuf::from(flags.string("file", "/counter.txt"));
    terminate_on_signals_as_pid1();

    let mut file_ok = true;
    loop {
        n += 1;
        say(&format!("tick {n}"));
        match write_file(&file, &format!("{n}\n")) {
            Ok(()) => file_ok = true,
            Err(e) => {
                // Say it once per run of failures, and keep counting.
                if file_ok {
                    warn(&format!("counter: write {}: {e}", file.display()));
                }
                file_ok = false;
            }
        }
        sleep_ms(interval);
    }
}
