//! The mailbox: one page of shared memory (a memfd) through which the daemon reaches a process's
//! driver, as NVIDIA's driver reaches a CUDA process through /proc.
//!
//! The process's libcuda.so.1 creates the memfd at cuInit and maps it; its restore thread waits
//! on a futex in it. The daemon finds it as `/proc/<pid>/fd/<n>` → `/memfd:gpu-ckpt-simgpu
//! (deleted)`, maps it too, writes a command, bumps `cmd_seq` and wakes the futex; the restore
//! thread answers in `resp_code` and bumps `resp_seq`. Nothing here is a connection, so CRIU
//! dumps and restores it with the process (a memfd and a shared mapping of it), and a restored
//! process is reachable on any node.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The memfd's name (`/proc/<pid>/fd/<n>` shows `/memfd:<name> (deleted)`).
pub const MEMFD_NAME: &str = "gpu-ckpt-simgpu";
/// "SIMGPU01".
pub const MAGIC: u64 = 0x3130_5550_474d_4953;
pub const SIZE: usize = 4096;
/// Most GPUs one process can have checkpointed.
pub const MAX_GPUS: usize = 16;

/// Commands from the daemon to a process's restore thread.
pub mod cmd {
    pub const LOCK: u32 = 1;
    pub const CHECKPOINT: u32 = 2;
    pub const RESTORE: u32 = 3;
    pub const UNLOCK: u32 = 4;
    /// Custom storage: the caller finished its copies (CHECKPOINTING → CHECKPOINTED, RESTORING →
    /// LOCKED).
    pub const COMPLETE: u32 = 5;
}
/// `cmd_flags` bits.
pub mod flags {
    /// Lock: behave as if in-flight work never completes (fault injection).
    pub const STALL: u32 = 1;
    /// Checkpoint or restore: to custom storage (the caller copies the device memory; the
    /// process keeps only the layout of its allocations).
    pub const CUSTOM: u32 = 2;
}

/// One checkpointed GPU: its UUID, name and how many bytes the process held on it.
#[repr(C)]
pub struct GpuSlot {
    pub uuid: [u8; 16],
    pub bytes: u64,
    pub name: [u8; 64],
}

/// The page's layout. Plain fields are written before the sequence number that publishes them
/// (release) and read after it (acquire).
#[repr(C)]
pub struct Layout {
    pub magic: AtomicU64,
    /// CUprocessState, written by the process.
    pub state: AtomicU32,
    /// The restore thread's id in the process's own pid namespace.
    pub restore_tid: AtomicI32,
    /// Futex word: the daemon bumps it after writing a command.
    pub cmd_seq: AtomicU32,
    pub cmd: AtomicU32,
    pub cmd_arg: AtomicU32,
    pub cmd_flags: AtomicU32,
    /// Futex word: the process sets it to the command's sequence number when done.
    pub resp_seq: AtomicU32,
    pub resp_code: AtomicU32,
    pub ngpus: AtomicU32,
    /// 1 when the last checkpoint went to custom storage (the process holds no copy of its
    /// device memory; only a custom-storage restore can bring it back). Written by the process.
    pub custom: AtomicU32,
    pub gpus: [GpuSlot; MAX_GPUS],
    /// The daemon's socket as the daemon sees it (tried first at a restore).
    pub socket: [u8; 256],
}

const _: () = assert!(std::mem::size_of::<Layout>() <= SIZE);

/// A mapping of a mailbox page.
pub struct Mailbox {
    ptr: *mut Layout,
    _file: File,
}

// The page is shared memory accessed through atomics; the raw pointer is valid for the mapping's
// life, which is the Mailbox's.
unsafe impl Send for Mailbox {}
unsafe impl Sync for Mailbox {}

impl Drop for Mailbox {
    fn drop(&mut self) {
        // SAFETY: ptr is the start of a SIZE-byte mapping made in map().
        unsafe { libc::munmap(self.ptr.cast(), SIZE) };
    }
}

impl Mailbox {
    fn map(file: File) -> std::io::Result<Mailbox> {
        // SAFETY: a shared mapping of a file we hold open; checked for MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mailbox {
            ptr: p.cast(),
            _file: file,
        })
    }

    /// Creates a process's own mailbox (at cuInit). The memfd stays open (CRIU keeps it) and is
    /// not inherited across exec.
    pub fn create() -> std::io::Result<Mailbox> {
        let name = std::ffi::CString::new(MEMFD_NAME).map_err(std::io::Error::other)?;
        // SAFETY: a valid C string; the returned fd is owned by the File below.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor we own.
        let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(SIZE as u64)?;
        let mb = Mailbox::map(file)?;
        mb.get().magic.store(MAGIC, Ordering::Release);
        Ok(mb)
    }

    /// Opens the mailbox of process `pid` through /proc (the daemon's side). `Ok(None)` when the
    /// process exists but has none (it never initialised the simulated driver).
    pub fn open_pid(pid: i32) -> std::io::Result<Option<Mailbox>> {
        let fd_dir = format!("/proc/{pid}/fd");
        let want = format!("/memfd:{MEMFD_NAME} (deleted)");
        for entry in std::fs::read_dir(&fd_dir)? {
            let entry = entry?;
            let Ok(target) = std::fs::read_link(entry.path()) else {
                continue;
            };
            if target.as_os_str() != want.as_str() {
                continue;
            }
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(entry.path())?;
            let mb = Mailbox::map(file)?;
            if mb.get().magic.load(Ordering::Acquire) == MAGIC {
                return Ok(Some(mb));
            }
        }
        Ok(None)
    }

    pub fn get(&self) -> &Layout {
        // SAFETY: the mapping is SIZE bytes, at least size_of::<Layout>(), and lives as long as self.
        unsafe { &*self.ptr }
    }

    /// Mutable access to the plain (non-atomic) fields. Only the side that owns them at the
    /// moment writes them (the daemon before posting a command; the process before answering).
    #[allow(clippy::mut_from_ref)]
    pub fn plain(&self) -> &mut Layout {
        // SAFETY: as in get(); concurrent writers are excluded by the command protocol.
        unsafe { &mut *self.ptr }
    }

    /// The socket path the daemon left in the page.
    pub fn socket(&self) -> Option<String> {
        let raw = &self.get().socket;
        let end = raw.iter().position(|b| *b == 0).unwrap_or(raw.len());
        let s = std::str::from_utf8(&raw[..end]).ok()?;
        (!s.is_empty()).then(|| s.to_string())
    }

    pub fn set_socket(&self, path: &Path) {
        let raw = &mut self.plain().socket;
        raw.fill(0);
        let bytes = path.as_os_str().as_encoded_bytes();
        if bytes.len() < raw.len() {
            raw[..bytes.len()].copy_from_slice(bytes);
        }
    }

    /// Posts a command and waits for its answer until `deadline` (None: for ever). Returns the
    /// process's CUresult, or None if it did not answer in time.
    pub fn call(
        &self,
        command: u32,
        arg: u32,
        flag_bits: u32,
        deadline: Option<Instant>,
    ) -> Option<u32> {
        let l = self.get();
        l.cmd.store(command, Ordering::Relaxed);
        l.cmd_arg.store(arg, Ordering::Relaxed);
        l.cmd_flags.store(flag_bits, Ordering::Relaxed);
        let seq = l.cmd_seq.fetch_add(1, Ordering::AcqRel).wrapping_add(1);
        futex_wake(&l.cmd_seq);
        loop {
            let seen = l.resp_seq.load(Ordering::Acquire);
            if seen == seq {
                return Some(l.resp_code.load(Ordering::Acquire));
            }
            let wait = match deadline {
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    (d - now).min(Duration::from_millis(200))
                }
                None => Duration::from_millis(200),
            };
            futex_wait(&l.resp_seq, seen, wait);
        }
    }

    /// The process's side: answers command `seq`.
    pub fn answer(&self, seq: u32, code: u32) {
        let l = self.get();
        l.resp_code.store(code, Ordering::Release);
        l.resp_seq.store(seq, Ordering::Release);
        futex_wake(&l.resp_seq);
    }

    /// The process's side: waits until a command newer than `seen` is posted; returns its
    /// sequence number.
    pub fn wait_command(&self, seen: u32) -> u32 {
        let l = self.get();
        loop {
            let now = l.cmd_seq.load(Ordering::Acquire);
            if now != seen {
                return now;
            }
            // A timeout keeps the loop alive across anything that loses a wake-up (a CRIU
            // restore puts the thread back into the wait).
            futex_wait(&l.cmd_seq, seen, Duration::from_secs(1));
        }
    }
}

/// FUTEX_WAIT on a shared (not process-private) word, so the daemon's wake reaches it.
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: word points into a live mapping; the kernel only reads it and the timespec.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

/// A C string field of a slot.
pub fn put_name(dst: &mut [u8; 64], name: &str) {
    dst.fill(0);
    let b = name.as_bytes();
    let n = b.len().min(63);
    dst[..n].copy_from_slice(&b[..n]);
}

pub fn get_name(src: &[u8; 64]) -> String {
    let end = src.iter().position(|b| *b == 0).unwrap_or(64);
    String::from_utf8_lossy(&src[..end]).into_owned()
}
