//! `memhog --mib N [--seed S] [--interval-ms 1000] [--status-file PATH]`
//!
//! Fills N MiB with a pattern derived from the seed and each 4 KiB page's index, prints
//! `filled <N> MiB seed <S> checksum <hex>`, then re-verifies every page forever, printing
//! `verified pass <k> pages <count> checksum <hex>`. A page that no longer holds its pattern
//! prints `CORRUPT page <i>` to stderr and exits 3.

use std::path::PathBuf;

use gpu_ckpt_workloads::{
    exit_usage, parse_or_exit, say, sleep_ms, terminate_on_signals_as_pid1, warn, write_file,
    PatternBuffer, PAGE_SIZE,
};

const USAGE: &str = "memhog --mib N [--seed S] [--interval-ms 1000] [--status-file PATH]";

fn main() {
    let flags = parse_or_exit(USAGE, &["mib", "seed", "interval-ms", "status-file"]);
    let mib = flags
        .u64_required("mib")
        .unwrap_or_else(|e| exit_usage(USAGE, e));
    let seed = flags
        .u64_or("seed", 1)
        .unwrap_or_else(|e| exit_usage(USAGE, e));
    let interval = flags
        .u64_or("interval-ms", 1000)
        .unwrap_or_else(|e| exit_usage(USAGE, e));
    let status = flags.get("status-file").map(PathBuf::from);
    terminate_on_signals_as_pid1();

    let pages = usize::try_from(mib)
        .ok()
        .and_then(|m| m.checked_mul(1024 * 1024 / PAGE_SIZE))
        .unwrap_or_else(|| {
            warn(&format!("memhog: --mib {mib} is too large"));
            std::process::exit(2)
        });
    let report = |line: String| {
        say(&line);
        if let Some(p) = &status {
            if let Err(e) = write_file(p, &format!("{line}\n")) {
                warn(&format!("memhog: write {}: {e}", p.display()));
            }
        }
    };

    let mut buf = PatternBuffer::new(pages, seed);
    let sum = buf.fill();
    report(format!(
        "filled {mib} MiB seed {seed} checksum {}",
        sum.hex()
    ));

    let mut pass: u64 = 0;
    loop {
        sleep_ms(interval);
        pass += 1;
        let r = buf.verify();
        if let Some(first) = r.corrupt.first() {
            for i in r.corrupt.iter().take(16) {
                warn(&format!("CORRUPT page {i}"));
            }
            if let Some(p) = &status {
                let _ = write_file(p, &format!("CORRUPT page {first}\n"));
            }
            std::process::exit(3);
        }
        report(format!(
            "verified pass {pass} pages {} checksum {}",
            r.pages,
            r.checksum.hex()
        ));
    }
}
