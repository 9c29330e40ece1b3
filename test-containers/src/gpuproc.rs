//! GPU processes outside containers, on a simulated node: start a CUDA workload, drive the
//! driver's checkpoint steps with `gpu-ckpt device`, and dump and restore it with the stack's
//! CRIU. Used by the GPU-layer tests and `make bench-gpu`.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use crate::stack::Stack;

/// A workspace binary (`target/debug/<name>`, or `$GPU_CKPT_SHIM_DIR/<name>`).
pub fn binary(stack: &Stack, name: &str) -> Result<PathBuf> {
    let p = stack.shim_dir().join(name);
    ensure!(
        p.is_file(),
        "{} is not built: run `cargo build --workspace`",
        p.display()
    );
    Ok(p)
}

/// A workload started in its own session (so CRIU can dump it alone), its output in a file.
/// Killed when dropped, whether it is still the child or a restored copy.
pub struct Workload {
    pub pid: i32,
    child: Option<Child>,
    pub out: PathBuf,
}

impl Workload {
    /// Starts `bin args` with `env` added; stdout and stderr go to `out`.
    pub fn spawn(
        bin: &Path,
        args: &[&str],
        env: &[(String, String)],
        out: &Path,
    ) -> Result<Workload> {
        let file = File::create(out).with_context(|| format!("creating {}", out.display()))?;
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        // SAFETY: setsid is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        Ok(Workload {
            pid: child.id() as i32,
            child: Some(child),
            out: out.to_path_buf(),
        })
    }

    /// The output so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// Waits until the output has a line for which `pick` returns Some; fails early if the
    /// output shows a MISMATCH or the process is gone.
    pub fn wait_line<T>(
        &mut self,
        timeout: Duration,
        what: &str,
        pick: impl Fn(&str) -> Option<T>,
    ) -> Result<T> {
        let deadline = Instant::now() + timeout;
        loop {
            let out = self.output();
            if let Some(v) = out.lines().rev().find_map(&pick) {
                return Ok(v);
            }
            ensure!(
                !out.contains("MISMATCH"),
                "{what}: the workload found wrong data:\n{out}"
            );
            if !self.alive() {
                bail!(
                    "{what}: the workload (pid {}) is gone; its output:\n{out}",
                    self.pid
                );
            }
            if Instant::now() > deadline {
                bail!("timed out after {timeout:?} waiting for {what}; output:\n{out}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the process still runs (a zombie does not count).
    pub fn alive(&mut self) -> bool {
        if let Some(c) = self.child.as_mut() {
            if let Ok(Some(_)) = c.try_wait() {
                return false;
            }
        }
        procfs::process::Process::new(self.pid)
            .and_then(|p| p.stat())
            .is_ok_and(|s| s.state != 'Z')
    }

    /// Reaps the original child after CRIU killed it, so that its pid is free for the restore.
    pub fn reap(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            c.wait()?;
        }
        Ok(())
    }

    /// Sends a signal.
    pub fn signal(&self, sig: i32) -> Result<()> {
        // SAFETY: kill has no memory preconditions.
        ensure!(
            unsafe { libc::kill(self.pid, sig) } == 0,
            "kill({}, {sig}): {}",
            self.pid,
            std::io::Error::last_os_error()
        );
        Ok(())
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        // SAFETY: as above; the pid is ours (the child, or the copy CRIU restored in its place).
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }
}

/// The last `step <k> checksum <hex>` of gpu-train's output: k.
pub fn train_step(line: &str) -> Option<u64> {
    let mut it = line.split_whitespace();
    (it.next()? == "step").then_some(())?;
    let k = it.next()?.parse().ok()?;
    (it.next()? == "checksum").then_some(k)
}

/// `gpu-ckpt device --libcuda LIB args…`.
pub fn device(stack: &Stack, libcuda: &Path, args: &[&str]) -> Result<Output> {
    let bin = binary(stack, "gpu-ckpt")?;
    Command::new(&bin)
        .arg("device")
        .arg("--libcuda")
        .arg(libcuda)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", bin.display()))
}

/// Like [`device`], and fails with its stderr unless it exits 0; returns stdout.
pub fn device_ok(stack: &Stack, libcuda: &Path, args: &[&str]) -> Result<String> {
    let out = device(stack, libcuda, args)?;
    ensure!(
        out.status.success(),
        "gpu-ckpt device {} failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The driver state of `pid` as `gpu-ckpt device --get-state` names it.
pub fn device_state(stack: &Stack, libcuda: &Path, pid: i32) -> Result<String> {
    Ok(
        device_ok(stack, libcuda, &["--pid", &pid.to_string(), "--get-state"])?
            .trim()
            .to_string(),
    )
}

/// `criu dump -t PID -D DIR`; Err carries CRIU's error lines.
pub fn criu_dump(stack: &Stack, pid: i32, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    run_criu(stack, dir, "dump", &["-t", &pid.to_string()])
}

/// `criu restore -D DIR -d`; returns the restored pid.
pub fn criu_restore(stack: &Stack, dir: &Path) -> Result<i32> {
    let pidfile = dir.join("restored.pid");
    run_criu(
        stack,
        dir,
        "restore",
        &["-d", "--pidfile", &pidfile.display().to_string()],
    )?;
    let text = std::fs::read_to_string(&pidfile)?;
    text.trim()
        .parse()
        .with_context(|| format!("pid file {}: {text:?}", pidfile.display()))
}

fn run_criu(stack: &Stack, dir: &Path, action: &str, extra: &[&str]) -> Result<()> {
    let log = format!("{action}.log");
    let out = Command::new(stack.criu_bin())
        .arg(action)
        .arg("-D")
        .arg(dir)
        .args(["-o", &log, "-v4"])
        .args(extra)
        .stdin(Stdio::null())
        .output()
        .context("running criu")?;
    if !out.status.success() {
        let text = std::fs::read_to_string(dir.join(&log)).unwrap_or_default();
        let errors: Vec<&str> = text.lines().filter(|l| l.contains("Error")).collect();
        bail!(
            "criu {action} failed ({}): {}",
            out.status,
            errors.join("\n")
        );
    }
    Ok(())
}
