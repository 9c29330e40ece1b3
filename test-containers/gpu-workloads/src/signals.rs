//! Signal flags: handlers only store to an atomic; main loops poll them.

use std::sync::atomic::{AtomicBool, Ordering};

static VERIFY: AtomicBool = AtomicBool::new(false);
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    if sig == libc::SIGUSR1 {
        VERIFY.store(true, Ordering::SeqCst);
    } else {
        STOP.store(true, Ordering::SeqCst);
    }
}

/// SIGUSR1 sets the verify flag; SIGTERM and SIGINT set the stop flag.
pub fn install() -> std::io::Result<()> {
    for sig in [libc::SIGUSR1, libc::SIGTERM, libc::SIGINT] {
        // SAFETY: a zeroed sigaction is valid; the handler only stores to atomics, which is
        // async-signal-safe.
        let rc = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// True once per SIGUSR1 received since the last call.
pub fn take_verify() -> bool {
    VERIFY.swap(false, Ordering::SeqCst)
}

pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}
