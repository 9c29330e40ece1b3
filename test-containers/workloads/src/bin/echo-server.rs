//! `echo-server [--listen 0.0.0.0:7777]`
//!
//! Line-based TCP echo, one thread per connection. Prints `listening <addr>`, then
//! `accepted <peer>` and `closed <peer> lines <n>` for each connection.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};

use gpu_ckpt_workloads::{parse_or_exit, say, terminate_on_signals_as_pid1, warn};

const USAGE: &str = "echo-server [--listen 0.0.0.0:7777]";

fn serve(stream: TcpStream) {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    say(&format!("accepted {peer}"));
    let mut writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            warn(&format!("echo-server: {peer}: {e}"));
            return;
        }
    };
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    let mut lines: u64 = 0;
    let reason = loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => break "eof".to_string(),
            Ok(_) => {}
            Err(e) => break e.to_string(),
        }
        if let Err(e) = writer.write_all(&line).and_then(|()| writer.flush()) {
            break e.to_string();
        }
        lines += 1;
    };
    say(&format!("closed {peer} lines {lines} ({reason})"));
}

fn main() {
    let flags = parse_or_exit(USAGE, &["listen"]);
    let addr = flags.string("listen", "0.0.0.0:7777");
    terminate_on_signals_as_pid1();
    let listener = match TcpListener::bind(&addr) {
        Ok(l) => l,
        Err(e) => {
            warn(&format!("echo-server: listen on {addr}: {e}"));
            std::process::exit(1);
        }
    };
    let local = listener.local_addr().map(|a| a.to_string()).unwrap_or(addr);
    say(&format!("listening {local}"));
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                std::thread::spawn(move || serve(stream));
            }
            Err(e) => {
                warn(&format!("echo-server: accept: {e}"));
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
    }
}
