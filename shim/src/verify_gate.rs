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

use std::{
    fs::{File, OpenOptions},
    io::Write,
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

use nix::{sys::stat::Mode, unistd::mkfifo};

use crate::error::{Error, Result};

/// The script and the FIFO, in the bundle (outside the container's reach).
const SCRIPT_FILE: &str = "gpu-ckpt-restore-gate.sh";
const FIFO_FILE: &str = "gpu-ckpt-restore-gate.fifo";
/// The one line that lets the restored tasks run.
const VERIFIED: &str = "verified";

/// One restore's gate; removes its files when dropped.
pub struct VerifyGate {
    script: PathBuf,
    fifo: PathBuf,
    /// Held open read-write: writing never blocks, and the script sees end-of-file only once
    /// the shim is gone.
    held: File,
}

impl VerifyGate {
    pub fn create(bundle: &Path) -> Result<Self> {
        let script = bundle.join(SCRIPT_FILE);
        let fifo = bundle.join(FIFO_FILE);
        let _ = std::fs::remove_file(&fifo);
        mkfifo(&fifo, Mode::S_IRUSR | Mode::S_IWUSR).map_err(|e| Error::Io {
            context: format!("create {}", fifo.display()),
            source: e.into(),
        })?;
        let held = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&fifo);
        let held = match held {
            Ok(f) => f,
            Err(e) => {
                let _ = std::fs::remove_file(&fifo);
                return Err(Error::io(format!("open {}", fifo.display()))(e));
            }
        };
        let gate = VerifyGate { script, fifo, held };
        let body = format!(
            "#!/bin/sh\n\
             # gpu-ckpt: CRIU action script. At post-restore (tasks restored, none resumed) it\n\
             # waits for the shim's verdict on the page images; anything but \"{VERIFIED}\" aborts.\n\
             [ \"$CRTOOLS_SCRIPT_ACTION\" = post-restore ] || exit 0\n\
             read -r verdict < {fifo} || exit 1\n\
             [ \"$verdict\" = {VERIFIED} ]\n",
            fifo = shell_quote(&gate.fifo.display().to_string()),
        );
        std::fs::write(&gate.script, body)
            .and_then(|_| {
                std::fs::set_permissions(&gate.script, std::fs::Permissions::from_mode(0o700))
            })
            .map_err(Error::io(format!("write {}", gate.script.display())))?;
        Ok(gate)
    }

    /// The action script to name in CRIU's configuration.
    pub fn script(&self) -> &Path {
        &self.script
    }

    /// Lets the restored tasks run (`true`) or makes CRIU abort the restore (`false`).
    pub fn open(&self, verified: bool) -> Result<()> {
        let line = if verified { VERIFIED } else { "refused" };
        (&self.held)
            .write_all(format!("{line}\n").as_bytes())
            .map_err(Error::io(format!("write {}", self.fifo.display())))
    }
}

impl Drop for VerifyGate {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.script);
        let _ = std::fs::remove_file(&self.fifo);
    }
}

/// `s` in single quotes for sh.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn run_script(gate: &VerifyGate, action: &str) -> bool {
        Command::new(gate.script())
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
        gate.open(false).unwrap();
        assert!(!run_script(&gate, "post-restore"));
        let (script, fifo) = (gate.script.clone(), gate.fifo.clone());
        drop(gate);
        assert!(!script.exists() && !fifo.exists());
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
