//! The restore's verification gate: lets CRIU read the page images while the shim is still
//! hashing them, and holds the restored tasks until the verdict is in.
//!
//! CRIU runs its action scripts at `post-restore`, once every task is restored into memory and
//! before any of them runs again; a script that fails there makes CRIU kill the tasks and fail
//! the restore ("Aborting restore due to post-restore script"). The gate is such a script, named
//! in the container's CRIU configuration file: at `post-restore` it reads one line from a FIFO
//! and succeeds only if that line is `verified`. The shim holds the FIFO open and writes the
//! verdict when the page images have been hashed, so the hashing overlaps CRIU's restore and
//! unverified memory never runs. If the shim dies first, the script reads end-of-file and the
//! restore is aborted.
//!
//! The same script holds the restored tree to the new container's spec (`spec_check.rs`). At
//! `pre-resume` CRIU has restored every task's credentials and seccomp filters and holds every
//! thread ptrace-stopped before its final `rt_sigreturn`: no restored instruction has run. The
//! script hands the tree's root (`CRTOOLS_INIT_PID`, a host pid) to the shim through a second
//! FIFO and waits on a third for `allowed`. CRIU ignores a failed `pre-resume` script, so a
//! refusal is enforced by killing: the shim SIGKILLs every process of the tree before it writes
//! the refusal, the script kills the root again (also when the shim is gone), and CRIU, which
//! cannot detach from dead tasks, fails the restore.

use std::{
    fs::{File, OpenOptions},
    io::{Read, Write},
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
};

use nix::{sys::stat::Mode, unistd::mkfifo};

use crate::error::{Error, Result};

/// The script and the FIFO, in the bundle (outside the container's reach).
const SCRIPT_FILE: &str = "gpu-ckpt-restore-gate.sh";
const FIFO_FILE: &str = "gpu-ckpt-restore-gate.fifo";
const ROOT_FIFO_FILE: &str = "gpu-ckpt-restore-gate-root.fifo";
const SPEC_FIFO_FILE: &str = "gpu-ckpt-restore-gate-spec.fifo";
/// The one line that lets the restored tasks run.
const VERIFIED: &str = "verified";
/// The one line that lets the restored tree, held to the spec, resume.
const ALLOWED: &str = "allowed";
/// What the shim writes to its own root FIFO to stop waiting for a root that will not come.
const NO_ROOT: &str = "none";

/// One restore's gate; removes its files when dropped.
pub struct VerifyGate {
    script: PathBuf,
    fifo: PathBuf,
    /// Held open read-write: writing never blocks, and the script sees end-of-file only once
    /// the shim is gone.
    held: File,
    root_fifo: PathBuf,
    /// The script writes the restored tree's root pid here; held open read-write likewise.
    root: File,
    spec_fifo: PathBuf,
    /// The verdict on the restored tree's credentials.
    spec: File,
    /// Whether the page verification's verdict has been written.
    verdict: AtomicBool,
}

/// Makes a FIFO in the bundle and opens it read-write; removes it again on failure.
fn open_fifo(path: &Path) -> Result<File> {
    let _ = std::fs::remove_file(path);
    mkfifo(path, Mode::S_IRUSR | Mode::S_IWUSR).map_err(|e| Error::Io {
        context: format!("create {}", path.display()),
        source: e.into(),
    })?;
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| {
            let _ = std::fs::remove_file(path);
            Error::io(format!("open {}", path.display()))(e)
        })
}

/// Removes the FIFOs made before one that failed.
fn remove_made(paths: &[&Path]) {
    for path in paths {
        let _ = std::fs::remove_file(path);
    }
}

/// Removes the answers a script recorded ([`done_file`]).
fn remove_answers(script: &Path) {
    for action in ["post-restore", "pre-resume"] {
        let _ = std::fs::remove_file(done_file(script, action));
    }
}

impl VerifyGate {
    pub fn create(bundle: &Path) -> Result<Self> {
        let script = bundle.join(SCRIPT_FILE);
        // A previous restore's answers (a shim that died) must not answer this one.
        remove_answers(&script);
        let fifo = bundle.join(FIFO_FILE);
        let root_fifo = bundle.join(ROOT_FIFO_FILE);
        let spec_fifo = bundle.join(SPEC_FIFO_FILE);
        let held = open_fifo(&fifo)?;
        let root = open_fifo(&root_fifo).inspect_err(|_| remove_made(&[&fifo]))?;
        let spec = open_fifo(&spec_fifo).inspect_err(|_| remove_made(&[&fifo, &root_fifo]))?;
        let gate = VerifyGate {
            script,
            fifo,
            held,
            root_fifo,
            root,
            spec_fifo,
            spec,
            verdict: AtomicBool::new(false),
        };
        std::fs::write(&gate.script, gate.script_body())
            .and_then(|_| {
                std::fs::set_permissions(&gate.script, std::fs::Permissions::from_mode(0o700))
            })
            .map_err(Error::io(format!("write {}", gate.script.display())))?;
        Ok(gate)
    }

    /// The action script: the gate's side of the FIFOs.
    fn script_body(&self) -> String {
        let quoted = |p: &Path| shell_quote(&p.display().to_string());
        format!(
            "#!/bin/sh\n\
             # gpu-ckpt: CRIU action script. At post-restore (tasks restored, none resumed) it\n\
             # waits for the shim's verdict on the page images; anything but \"{VERIFIED}\" aborts.\n\
             # At pre-resume (credentials and seccomp restored, every thread still stopped) it\n\
             # hands the tree's root to the shim and waits for \"{ALLOWED}\"; else it kills it.\n\
             # CRIU 4.1 parses the configuration file runc names twice in RPC mode, and so runs\n\
             # this script twice per action, one run after the other (criu #2727, fixed in 4.2\n\
             # by #2728): a second run answers what the first did, without a second verdict.\n\
             case \"$CRTOOLS_SCRIPT_ACTION\" in\n\
             post-restore) done={post_done} ;;\n\
             pre-resume) done={pre_done} ;;\n\
             *) exit 0 ;;\n\
             esac\n\
             if [ -f \"$done\" ]; then exit \"$(cat \"$done\")\"; fi\n\
             gate() {{\n\
             case \"$CRTOOLS_SCRIPT_ACTION\" in\n\
             post-restore)\n\
             \tread -r verdict < {fifo} || return 1\n\
             \t[ \"$verdict\" = {VERIFIED} ] ;;\n\
             pre-resume)\n\
             \tif [ -p {root} ] && [ -p {spec} ] && printf '%s\\n' \"${{CRTOOLS_INIT_PID:-}}\" > {root} &&\n\
             \t\tread -r verdict < {spec} && [ \"$verdict\" = {ALLOWED} ]; then\n\
             \t\treturn 0\n\
             \tfi\n\
             \t[ -n \"${{CRTOOLS_INIT_PID:-}}\" ] && kill -KILL \"$CRTOOLS_INIT_PID\" 2>/dev/null\n\
             \treturn 1 ;;\n\
             esac\n\
             }}\n\
             gate\n\
             status=$?\n\
             printf '%s\\n' \"$status\" > \"$done\"\n\
             exit \"$status\"\n",
            fifo = quoted(&self.fifo),
            root = quoted(&self.root_fifo),
            spec = quoted(&self.spec_fifo),
            post_done = quoted(&done_file(&self.script, "post-restore")),
            pre_done = quoted(&done_file(&self.script, "pre-resume")),
        )
    }

    /// The action script to name in CRIU's configuration.
    pub fn script(&self) -> &Path {
        &self.script
    }

    /// Lets the restored tasks run (`true`) or makes CRIU abort the restore (`false`).
    pub fn open(&self, verified: bool) -> Result<()> {
        let line = if verified { VERIFIED } else { "refused" };
        self.verdict.store(true, Ordering::SeqCst);
        (&self.held)
            .write_all(format!("{line}\n").as_bytes())
            .map_err(Error::io(format!("write {}", self.fifo.display())))
    }

    /// Whether [`VerifyGate::open`] has given the page verification's verdict.
    pub fn has_verdict(&self) -> bool {
        self.verdict.load(Ordering::SeqCst)
    }

    /// Blocks until the script hands over the restored tree's root pid (`Some`) or
    /// [`VerifyGate::no_root`] is called (`None`).
    pub fn wait_root(&self) -> Result<Option<i32>> {
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        // Byte by byte: nothing after the line is consumed.
        loop {
            let n = (&self.root)
                .read(&mut byte)
                .map_err(Error::io(format!("read {}", self.root_fifo.display())))?;
            if n == 0 || byte[0] == b'\n' || line.len() > 64 {
                break;
            }
            line.push(byte[0]);
        }
        let line = String::from_utf8_lossy(&line).trim().to_string();
        if line == NO_ROOT {
            return Ok(None);
        }
        match line.parse::<i32>() {
            Ok(pid) if pid > 0 => Ok(Some(pid)),
            _ => Err(Error::FailedPrecondition(format!(
                "restore refused: CRIU named no restored root task ({line:?})"
            ))),
        }
    }

    /// Ends a [`VerifyGate::wait_root`] that no script will answer (the restore is over).
    pub fn no_root(&self) -> Result<()> {
        (&self.root)
            .write_all(format!("{NO_ROOT}\n").as_bytes())
            .map_err(Error::io(format!("write {}", self.root_fifo.display())))
    }

    /// Lets the restored tree resume (`true`) or has the script kill it (`false`).
    pub fn allow(&self, allowed: bool) -> Result<()> {
        let line = if allowed { ALLOWED } else { "refused" };
        (&self.spec)
            .write_all(format!("{line}\n").as_bytes())
            .map_err(Error::io(format!("write {}", self.spec_fifo.display())))
    }
}

impl Drop for VerifyGate {
    fn drop(&mut self) {
        remove_answers(&self.script);
        let _ = std::fs::remove_file(&self.script);
        let _ = std::fs::remove_file(&self.fifo);
        let _ = std::fs::remove_file(&self.root_fifo);
        let _ = std::fs::remove_file(&self.spec_fifo);
    }
}

/// Where the script records its answer for `action`, so that a second run for the same action
/// (CRIU 4.1) gives the same answer.
fn done_file(script: &Path, action: &str) -> PathBuf {
    let mut name = script.as_os_str().to_owned();
    name.push(format!(".{action}.status"));
    PathBuf::from(name)
}

/// `s` in single quotes for sh.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    // Through sh rather than exec'd: a script just written can be busy (ETXTBSY) while another
    // test thread forks.
    fn run_script(gate: &VerifyGate, action: &str) -> bool {
        Command::new("sh")
            .arg(gate.script())
            .env("CRTOOLS_SCRIPT_ACTION", action)
            .status()
            .unwrap()
            .success()
    }

    #[test]
    fn the_script_passes_only_a_verified_restore() {
        let dir = tempfile::tempdir().unwrap();
        let bundle = dir.path().join("it's a bundle");
        std::fs::create_dir(&bundle).unwrap();
        let gate = VerifyGate::create(&bundle).unwrap();
        // Other actions pass at once, without a verdict.
        assert!(run_script(&gate, "pre-restore"));
        gate.open(true).unwrap();
        assert!(run_script(&gate, "post-restore"));
        // CRIU 4.1 runs the script a second time: it answers the same, with no second verdict
        // (it would wait forever for one).
        assert!(run_script(&gate, "post-restore"));
        let (script, fifo) = (gate.script.clone(), gate.fifo.clone());
        drop(gate);
        assert!(!script.exists() && !fifo.exists());
        assert!(!done_file(&script, "post-restore").exists());
        let gate = VerifyGate::create(&bundle).unwrap();
        gate.open(false).unwrap();
        assert!(!run_script(&gate, "post-restore"));
        assert!(
            !run_script(&gate, "post-restore"),
            "a second run must refuse too"
        );
    }

    /// Runs the script at pre-resume for the tree rooted at `root` in a thread.
    fn pre_resume(gate: &VerifyGate, root: u32) -> std::thread::JoinHandle<bool> {
        let script = gate.script().to_path_buf();
        std::thread::spawn(move || {
            Command::new("sh")
                .arg(script)
                .env("CRTOOLS_SCRIPT_ACTION", "pre-resume")
                .env("CRTOOLS_INIT_PID", root.to_string())
                .status()
                .unwrap()
                .success()
        })
    }

    #[test]
    fn pre_resume_hands_over_the_root_and_kills_it_when_refused() {
        let dir = tempfile::tempdir().unwrap();
        let gate = VerifyGate::create(dir.path()).unwrap();
        let mut tree = Command::new("sleep").arg("30").spawn().unwrap();
        // Allowed: the script passes, the tree lives.
        let script = pre_resume(&gate, tree.id());
        assert_eq!(gate.wait_root().unwrap(), Some(tree.id() as i32));
        gate.allow(true).unwrap();
        assert!(script.join().unwrap());
        assert!(tree.try_wait().unwrap().is_none());
        // A second run (CRIU 4.1) answers the same at once.
        assert!(pre_resume(&gate, tree.id()).join().unwrap());
        // Refused, on the next restore: the script fails and kills the root.
        drop(gate);
        let gate = VerifyGate::create(dir.path()).unwrap();
        let script = pre_resume(&gate, tree.id());
        assert_eq!(gate.wait_root().unwrap(), Some(tree.id() as i32));
        gate.allow(false).unwrap();
        assert!(!script.join().unwrap());
        let status = tree.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        // A restore that ends without pre-resume releases the waiter.
        gate.no_root().unwrap();
        assert_eq!(gate.wait_root().unwrap(), None);
    }

    #[test]
    fn pre_resume_without_the_shim_kills_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let gate = VerifyGate::create(dir.path()).unwrap();
        let body = std::fs::read_to_string(gate.script()).unwrap();
        drop(gate);
        let mut tree = Command::new("sleep").arg("30").spawn().unwrap();
        let ok = Command::new("sh")
            .arg("-c")
            .arg(body)
            .env("CRTOOLS_SCRIPT_ACTION", "pre-resume")
            .env("CRTOOLS_INIT_PID", tree.id().to_string())
            .status()
            .unwrap()
            .success();
        assert!(!ok);
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(tree.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert!(!dir.path().join(ROOT_FIFO_FILE).exists());
    }

    #[test]
    fn a_gone_shim_aborts_the_restore() {
        let dir = tempfile::tempdir().unwrap();
        let gate = VerifyGate::create(dir.path()).unwrap();
        let body = std::fs::read_to_string(gate.script()).unwrap();
        let child = std::thread::spawn(move || {
            Command::new("sh")
                .arg("-c")
                .arg(body)
                .env("CRTOOLS_SCRIPT_ACTION", "post-restore")
                .status()
                .unwrap()
                .success()
        });
        // Whether the script is already blocked in its read (end-of-file once the shim's end
        // closes) or not yet at the FIFO (gone), it must fail.
        std::thread::sleep(std::time::Duration::from_millis(100));
        drop(gate);
        assert!(!child.join().unwrap());
    }
}
