//! `echo-client --connect HOST:PORT [--interval-ms 200] [--count N] [--read-timeout-ms 30000]`
//!
//! Sends `seq <n>` lines (n from 1), reads each echo and prints `echo <n>`. A wrong echo prints
//! `MISMATCH sent <..> got <..>` to stderr and exits 2. On EOF or an error it prints
//! `reconnect <reason>`, retries connecting every 200 ms, prints `connected <addr>` and goes on
//! with the next sequence number (the one without an echo is not sent again). With `--count N`
//! it exits 0 after N echoes.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use gpu_ckpt_workloads::{
    exit_usage, parse_or_exit, say, sleep_ms, terminate_on_signals_as_pid1, warn,
};

const USAGE: &str =
    "echo-client --connect HOST:PORT [--interval-ms 200] [--count N] [--read-timeout-ms 30000]";

enum Step {
    Echoed,
    Broken(String),
}

fn exchange(reader: &mut BufReader<TcpStream>, n: u64) -> Step {
    let sent = format!("seq {n}\n");
    if let Err(e) = reader
        .get_mut()
        .write_all(sent.as_bytes())
        .and_then(|()| reader.get_mut().flush())
    {
        return Step::Broken(format!("write: {e}"));
    }
    let mut got = String::new();
    match reader.read_line(&mut got) {
        Ok(0) => Step::Broken("eof".into()),
        Ok(_) if got == sent => Step::Echoed,
        Ok(_) if !got.ends_with('\n') => Step::Broken("eof in the middle of a line".into()),
        Ok(_) => {
            warn(&format!(
                "MISMATCH sent {:?} got {:?}",
                sent.trim_end(),
                got.trim_end()
            ));
            std::process::exit(2);
        }
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Step::Broken("read timeout".into())
        }
        Err(e) => Step::Broken(format!("read: {e}")),
    }
}

fn connect(addr: &str, timeout: Option<Duration>) -> BufReader<TcpStream> {
    let mut failures: u32 = 0;
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                let _ = s.set_read_timeout(timeout);
                let peer = s
                    .peer_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_else(|_| addr.to_string());
                say(&format!("connected {peer}"));
                return BufReader::new(s);
            }
            Err(e) => {
                // Say why now and then, not on every 200 ms retry.
                if failures == 0 {
                    warn(&format!("echo-client: connect {addr}: {e}"));
                }
                failures = (failures + 1) % 25;
                sleep_ms(200);
            }
        }
    }
}

fn main() {
    let flags = parse_or_exit(
        USAGE,
        &["connect", "interval-ms", "count", "read-timeout-ms"],
    );
    let Some(addr) = flags.get("connect").map(str::to_string) else {
        exit_usage(
            USAGE,
            gpu_ckpt_workloads::UsageError {
                message: "flag --connect is required".into(),
            },
        );
    };
    let interval = flags
        .u64_or("interval-ms", 200)
        .unwrap_or_else(|e| exit_usage(USAGE, e));
    let count = flags
        .u64_or("count", 0)
        .unwrap_or_else(|e| exit_usage(USAGE, e));
    let timeout_ms = flags
        .u64_or("read-timeout-ms", 30_000)
        .unwrap_or_else(|e| exit_usage(USAGE, e));
    let timeout = (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms));
    terminate_on_signals_as_pid1();

    let mut conn = connect(&addr, timeout);
    let mut n: u64 = 1;
    let mut echoed: u64 = 0;
    loop {
        match exchange(&mut conn, n) {
            Step::Echoed => {
                say(&format!("echo {n}"));
                echoed += 1;
                if count > 0 && echoed >= count {
                    return;
                }
            }
            Step::Broken(reason) => {
                say(&format!("reconnect {reason}"));
                n += 1;
                conn = connect(&addr, timeout);
                continue;
            }
        }
        n += 1;
        sleep_ms(interval);
    }
}
