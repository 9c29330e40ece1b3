//! The progress bar of long copies (verify, build, push, pull, extract), and sizes for people.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Progress on stderr when it is a terminal, at most ten updates a second; nothing otherwise.
pub struct Bar(ProgressBar);

impl Bar {
    pub fn new(label: &'static str) -> Bar {
        let target = if std::io::stderr().is_terminal() {
            ProgressDrawTarget::stderr_with_hz(10)
        } else {
            ProgressDrawTarget::hidden()
        };
        let style = ProgressStyle::with_template(
            "{prefix}: {binary_bytes}/{binary_total_bytes} {percent:>3}% {binary_bytes_per_sec} [{bar:30}] {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        Bar(ProgressBar::with_draw_target(None, target)
            .with_style(style)
            .with_prefix(label))
    }

    pub fn update(&mut self, done: u64, total: u64) {
        if total > 0 {
            self.0.set_length(total);
        }
        self.0.set_position(done);
    }

    pub fn finish(&self) {
        self.0.finish();
        // The last state stays on screen; what the command prints next starts a line of its own.
        if !self.0.is_hidden() {
            eprintln!();
        }
    }
}

/// `1.5 MiB`.
pub fn human(b: u64) -> String {
    const U: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let mut v = b as f64 / 1024.0;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", U[i])
}
