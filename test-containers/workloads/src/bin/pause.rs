//! `pause`: blocks until SIGINT or SIGTERM (then exits 0) and reaps zombie children on
//! SIGCHLD, like the Kubernetes pause container that runs as a pod's PID 1.
//!
//! The three signals are blocked and taken with `sigwaitinfo`: a blocked signal is queued even
//! for a namespace's init process, which would otherwise ignore signals it has no handler for.

use gpu_ckpt_workloads::{parse_or_exit, say, warn};

const USAGE: &str = "pause";

fn reap() {
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid status pointer.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return;
        }
    }
}

fn main() {
    parse_or_exit(USAGE, &[]);
    // SAFETY: plain signal-mask manipulation on a zeroed sigset_t.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGCHLD] {
            libc::sigaddset(&mut set, sig);
        }
        if libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            warn(&format!(
                "pause: sigprocmask: {}",
                std::io::Error::last_os_error()
            ));
            std::process::exit(1);
        }
        set
    };
    say("pause: waiting for SIGINT or SIGTERM");
    // Children that died before the mask was set.
    reap();
    loop {
        // SAFETY: sigwaitinfo with a valid set and a null info pointer.
        let sig = unsafe { libc::sigwaitinfo(&set, std::ptr::null_mut()) };
        match sig {
            libc::SIGCHLD => reap(),
            libc::SIGINT | libc::SIGTERM => {
                let name = if sig == libc::SIGINT {
                    "SIGINT"
                } else {
                    "SIGTERM"
                };
                say(&format!("pause: {name}, exiting"));
                reap();
                std::process::exit(0);
            }
            _ => {
                // EINTR (for example after a CRIU restore) or a spurious wakeup: wait again.
            }
        }
    }
}
