//! Starting a simulated node from tests: a private directory, the daemon as a child process,
//! and helpers to inject faults and read what the daemon saw.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};

use crate::client::Client;
use crate::node::{format_uuid, NodeConfig, NodeDesc};
use crate::proto::{FaultOp, ProcUse, Reply, Request, Role, ENV_SOCKET, SOCKET_NAME};

/// A node's configuration for [`SimNode::start`].
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub gpus: u32,
    pub model: String,
    pub memory_mib: u64,
    pub driver_version: String,
    pub cuda_version: i32,
    pub uuid_seed: String,
    /// Write a CDI spec into DIR/cdi.
    pub cdi: bool,
    /// Indices of the GPUs in MIG mode.
    pub mig_gpus: Vec<u32>,
}

impl Default for SimConfig {
    fn default() -> Self {
        let d = NodeConfig::default();
        SimConfig {
            gpus: d.gpus,
            model: d.model,
            memory_mib: d.memory_mib,
            driver_version: d.driver_version,
            cuda_version: d.cuda_version,
            uuid_seed: d.uuid_seed,
            cdi: false,
            mig_gpus: d.mig_gpus,
        }
    }
}

/// A running `gpu-ckpt-simgpu serve`; stopped when dropped.
pub struct SimNode {
    dir: tempfile::TempDir,
    child: Child,
    node: NodeDesc,
}

/// The daemon binary: `$GPU_CKPT_SIMGPU_BIN`, else [`workspace_binary`].
pub fn daemon_binary() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("GPU_CKPT_SIMGPU_BIN") {
        return Ok(PathBuf::from(p));
    }
    workspace_binary("gpu-ckpt-simgpu")
}

/// A binary of the workspace build, next to the running executable or one level up (cargo puts
/// test executables in target/<profile>/deps).
pub fn workspace_binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent();
    for _ in 0..2 {
        let Some(d) = dir else { break };
        let cand = d.join(name);
        if cand.is_file() {
            return Ok(cand);
        }
        dir = d.parent();
    }
    bail!(
        "{name} not found next to {}: build the workspace first",
        exe.display()
    )
}

impl SimNode {
    pub fn start(cfg: SimConfig) -> anyhow::Result<SimNode> {
        let dir = tempfile::Builder::new().prefix("simgpu-").tempdir()?;
        let mut cmd = Command::new(daemon_binary()?);
        cmd.arg("serve")
            .arg("--dir")
            .arg(dir.path())
            .args(["--gpus", &cfg.gpus.to_string()])
            .args(["--model", &cfg.model])
            .args(["--memory-mib", &cfg.memory_mib.to_string()])
            .args(["--driver-version", &cfg.driver_version])
            .args(["--cuda-version", &cfg.cuda_version.to_string()])
            .args(["--uuid-seed", &cfg.uuid_seed])
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if cfg.cdi {
            cmd.arg("--cdi-dir").arg(dir.path().join("cdi"));
        }
        if !cfg.mig_gpus.is_empty() {
            let mig: Vec<String> = cfg.mig_gpus.iter().map(u32::to_string).collect();
            cmd.args(["--mig-gpus", &mig.join(",")]);
        }
        let mut child = cmd.spawn().context("starting gpu-ckpt-simgpu")?;
        let socket = dir.path().join(SOCKET_NAME);
        let deadline = Instant::now() + Duration::from_secs(20);
        let node = loop {
            if let Some(status) = child.try_wait()? {
                bail!("gpu-ckpt-simgpu exited at start: {status}");
            }
            if socket.exists() {
                if let Ok(mut c) = Client::connect(&socket, Role::Control) {
                    match c.call(&Request::Node)? {
                        Reply::Node(n) => break n,
                        r => bail!("unexpected reply {r:?}"),
                    }
                }
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("gpu-ckpt-simgpu did not come up in 20 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Ok(SimNode { dir, child, node })
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join(SOCKET_NAME)
    }
    pub fn lib_dir(&self) -> PathBuf {
        self.dir.path().join("lib")
    }
    pub fn libcuda(&self) -> PathBuf {
        self.lib_dir().join("libcuda.so.1")
    }
    pub fn libnvml(&self) -> PathBuf {
        self.lib_dir().join("libnvidia-ml.so.1")
    }
    pub fn libnccl(&self) -> PathBuf {
        self.lib_dir().join("libnccl.so.2")
    }
    pub fn cdi_dir(&self) -> PathBuf {
        self.dir.path().join("cdi")
    }
    pub fn node(&self) -> &NodeDesc {
        &self.node
    }
    /// The GPUs' UUIDs in `GPU-…` form, by index.
    pub fn uuids(&self) -> Vec<String> {
        self.node
            .gpus
            .iter()
            .map(|g| format_uuid(&g.uuid))
            .collect()
    }

    /// The environment a process needs to use this node: its socket and its libraries.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            (ENV_SOCKET.to_string(), self.socket().display().to_string()),
            (
                "LD_LIBRARY_PATH".to_string(),
                self.lib_dir().display().to_string(),
            ),
        ]
    }

    fn control(&self) -> anyhow::Result<Client> {
        Ok(Client::connect(&self.socket(), Role::Control)?)
    }

    /// Sets (or clears) a fault for one process, or for every process (`pid` None).
    pub fn fault(&self, pid: Option<i32>, op: FaultOp, set: bool) -> anyhow::Result<()> {
        Ok(self.control()?.ok(&Request::Fault { pid, op, set })?)
    }

    /// The 64-byte argument struct the daemon last received for a checkpoint entry point.
    pub fn last_args(&self, call: &str) -> anyhow::Result<Vec<u8>> {
        match self.control()?.call(&Request::LastArgs {
            call: call.to_string(),
        })? {
            Reply::Args(a) => Ok(a),
            r => Err(anyhow!("unexpected reply {r:?}")),
        }
    }

    /// The processes that use this node's GPUs.
    pub fn processes(&self) -> anyhow::Result<Vec<ProcUse>> {
        match self.control()?.call(&Request::Processes)? {
            Reply::Processes(p) => Ok(p),
            r => Err(anyhow!("unexpected reply {r:?}")),
        }
    }

    /// Bytes free on GPU `index`.
    pub fn free_bytes(&self, index: usize) -> anyhow::Result<u64> {
        let gpu = self
            .node
            .gpus
            .get(index)
            .ok_or_else(|| anyhow!("no GPU {index}"))?
            .uuid;
        match self.control()?.call(&Request::MemInfo { gpu })? {
            Reply::MemInfo { free, .. } => Ok(free),
            r => Err(anyhow!("unexpected reply {r:?}")),
        }
    }
}

impl Drop for SimNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
