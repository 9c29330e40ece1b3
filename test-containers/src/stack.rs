//! The local test stack: a private containerd 2.x per test "node", the local registry, and
//! the test images.
//!
//! Layout (see `docs`/`shared/reference/stack.md`):
//! - `$STACK` = env `GPU_CKPT_STACK`, else `<repo>/.stack`;
//! - containerd, ctr, containerd-shim-runc-v2 in `$STACK/root/usr/bin`; criu and checkpointctl in
//!   `$STACK/bin`; CNI plugins in `$STACK/cni/usr/lib/cni`; test images in `$STACK/images`;
//! - per node: persistent files in `$STACK/nodes/<name>/` (config, containerd.log, pod logs, the
//!   content store under `root/`), runtime state in `/run/gpu-ckpt-test/<name>/` (socket, state,
//!   runc roots, fifos: short paths because of the unix socket path limit).
//!
//! Nothing here skips: when the stack is missing, [`Stack::discover`] fails.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use procfs::process::{FDTarget, Process};

/// Runtime handler name of the project's shim in the node config.
pub const GPU_CKPT_HANDLER: &str = "gpu-ckpt";
/// Runtime type of the project's shim.
pub const GPU_CKPT_RUNTIME_TYPE: &str = "io.containerd.gpu-ckpt.v1";
/// Runtime handler of the plain runc shim (the CRI default on test nodes).
pub const RUNC_HANDLER: &str = "runc";
/// The runc binary every handler uses.
pub const RUNC_BINARY: &str = "/usr/sbin/runc";
/// Registry address of the local registry.
pub const REGISTRY: &str = "localhost:5000";
/// The pinned sandbox (pause) image.
pub const PAUSE_IMAGE: &str = "localhost:5000/pause:1";
/// The workloads image (busybox + counter, memhog, echo-server, echo-client, oom-eater).
pub const WORKLOADS_IMAGE: &str = "localhost:5000/gpu-ckpt/workloads:1";
/// The GPU workloads image (gpu-train, gpu-fill and glibc; the CDI spec of the simulated driver
/// mounts libcuda.so.1 into it).
pub const GPU_WORKLOADS_IMAGE: &str = "localhost:5000/gpu-ckpt/gpu-workloads:1";
/// containerd namespace used by CRI.
pub const K8S_NAMESPACE: &str = "k8s.io";
/// Where per-node runtime state lives (short paths: unix socket limit).
pub const RUN_BASE: &str = "/run/gpu-ckpt-test";

/// The installed test stack.
#[derive(Debug, Clone)]
pub struct Stack {
    prefix: PathBuf,
    repo: PathBuf,
}

impl Stack {
    /// Finds the stack: env `GPU_CKPT_STACK`, else `<repo>/.stack`. Fails (never skips) when
    /// containerd is not installed there.
    pub fn discover() -> Result<Stack> {
        let stack = Stack {
            prefix: stack_prefix(),
            repo: repo_root(),
        };
        let containerd = stack.containerd_bin();
        if !containerd.is_file() {
            bail!(
                "test stack not installed at {}: run `make deps` (missing {})",
                stack.prefix.display(),
                containerd.display()
            );
        }
        Ok(stack)
    }

    /// The stack prefix (`$STACK`).
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    /// The repository root.
    pub fn repo(&self) -> &Path {
        &self.repo
    }

    /// `$STACK/root/usr/bin/containerd`.
    pub fn containerd_bin(&self) -> PathBuf {
        self.prefix.join("root/usr/bin/containerd")
    }

    /// `$STACK/root/usr/bin/ctr`.
    pub fn ctr_bin(&self) -> PathBuf {
        self.prefix.join("root/usr/bin/ctr")
    }

    /// `$STACK/bin` (criu, checkpointctl).
    pub fn bin_dir(&self) -> PathBuf {
        self.prefix.join("bin")
    }

    /// `$STACK/bin/criu`.
    pub fn criu_bin(&self) -> PathBuf {
        self.bin_dir().join("criu")
    }

    /// The directory of the oldest CRIU gpu-ckpt supports (4.1.1), built beside the newest by
    /// the install script; [`NodeBuilder::oldest_criu`] puts it first in a node's PATH.
    pub fn criu_oldest_dir(&self) -> PathBuf {
        self.prefix.join("criu-oldest/bin")
    }

    /// `$STACK/bin/checkpointctl`.
    pub fn checkpointctl_bin(&self) -> PathBuf {
        self.bin_dir().join("checkpointctl")
    }

    /// `$STACK/cni/usr/lib/cni`.
    pub fn cni_bin_dir(&self) -> PathBuf {
        self.prefix.join("cni/usr/lib/cni")
    }

    /// `$STACK/images` (OCI tarballs and `images.json`).
    pub fn images_dir(&self) -> PathBuf {
        self.prefix.join("images")
    }

    /// `$STACK/nodes/<name>`.
    pub fn node_dir(&self, name: &str) -> PathBuf {
        self.prefix.join("nodes").join(name)
    }

    /// Directory that holds `containerd-shim-gpu-ckpt-v1`: env `GPU_CKPT_SHIM_DIR`, else
    /// `$CARGO_TARGET_DIR/debug` when that is set, else `<repo>/target/debug`.
    pub fn shim_dir(&self) -> PathBuf {
        if let Some(d) = std::env::var_os("GPU_CKPT_SHIM_DIR").filter(|d| !d.is_empty()) {
            return PathBuf::from(d);
        }
        if let Some(d) = std::env::var_os("CARGO_TARGET_DIR").filter(|d| !d.is_empty()) {
            let d = PathBuf::from(d);
            let d = if d.is_absolute() {
                d
            } else {
                self.repo.join(d)
            };
            return d.join("debug");
        }
        self.repo.join("target/debug")
    }

    /// PATH for containerd (and therefore for its shims, runc and CRIU): the shim dir, `$STACK/bin`
    /// (CRIU before any system criu, P4), `$STACK/root/usr/bin`, then the system directories.
    pub fn path_env(&self) -> String {
        format!(
            "{}:{}:{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            self.shim_dir().display(),
            self.bin_dir().display(),
            self.prefix.join("root/usr/bin").display()
        )
    }
}

/// `<repo>` = the parent of this crate's manifest directory.
pub fn repo_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(Path::to_path_buf).unwrap_or(manifest)
}

/// The stack prefix (`$STACK`): env `GPU_CKPT_STACK`, else `<repo>/.stack`.
pub fn stack_prefix() -> PathBuf {
    match std::env::var_os("GPU_CKPT_STACK") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => repo_root().join(".stack"),
    }
}

/// The interpreter of the Python venv that `make deps` creates under the stack prefix
/// (`$STACK/py/bin/python`), with `packages` in it; an error naming it when it is missing.
pub fn venv_python(packages: &str) -> Result<PathBuf> {
    let py = stack_prefix().join("py/bin/python");
    ensure!(
        py.is_file(),
        "{} is missing: the Python venv with {packages} is not installed; run `make deps` \
         (test-containers/stack/install.sh creates it)",
        py.display()
    );
    Ok(py)
}

/// A value in a runtime's `options` table.
#[derive(Debug, Clone, PartialEq)]
pub enum OptValue {
    Str(String),
    Bool(bool),
    Int(i64),
    List(Vec<String>),
}

impl From<&str> for OptValue {
    fn from(v: &str) -> Self {
        OptValue::Str(v.to_string())
    }
}
impl From<String> for OptValue {
    fn from(v: String) -> Self {
        OptValue::Str(v)
    }
}
impl From<&Path> for OptValue {
    fn from(v: &Path) -> Self {
        OptValue::Str(v.display().to_string())
    }
}
impl From<bool> for OptValue {
    fn from(v: bool) -> Self {
        OptValue::Bool(v)
    }
}
impl From<i64> for OptValue {
    fn from(v: i64) -> Self {
        OptValue::Int(v)
    }
}
impl From<Vec<String>> for OptValue {
    fn from(v: Vec<String>) -> Self {
        OptValue::List(v)
    }
}

impl OptValue {
    fn to_toml(&self) -> String {
        match self {
            OptValue::Str(s) => toml_str(s),
            OptValue::Bool(b) => b.to_string(),
            OptValue::Int(i) => i.to_string(),
            OptValue::List(l) => toml_list(l),
        }
    }
}

/// A TOML basic string (JSON string escapes are valid TOML escapes).
fn toml_str(s: &str) -> String {
    serde_json::to_string(s).expect("string serializes")
}

fn toml_list(items: &[String]) -> String {
    let parts: Vec<String> = items.iter().map(|s| toml_str(s)).collect();
    format!("[{}]", parts.join(", "))
}

/// An additional CRI runtime handler in the node config.
#[derive(Debug, Clone)]
pub struct ExtraRuntime {
    pub name: String,
    pub runtime_type: String,
    pub pod_annotations: Vec<String>,
    pub container_annotations: Vec<String>,
    pub options: BTreeMap<String, OptValue>,
}

/// Options for [`Node`]; start with [`Node::builder`].
#[derive(Debug, Clone)]
pub struct NodeBuilder {
    stack: Stack,
    name: String,
    cni: bool,
    log_level: String,
    gpu_ckpt_options: BTreeMap<String, OptValue>,
    extra_runtimes: Vec<ExtraRuntime>,
    extra_config: Vec<String>,
    env: Vec<(String, String)>,
    start_timeout: Duration,
    cdi_spec_dirs: Option<Vec<PathBuf>>,
    base_runtime_spec: Option<PathBuf>,
    gpu_ckpt_handler: bool,
    config_file: Option<PathBuf>,
}

impl NodeBuilder {
    /// Turns on CDI with these spec directories: CRI injects the devices that a container asks
    /// for (`cdi.k8s.io/*` annotations, `CDI_devices`) from them (`enable_cdi = true`,
    /// `cdi_spec_dirs = [...]` in `[plugins.'io.containerd.cri.v1.runtime']`), and
    /// [`Node::ctr_cdi`] shows them to ctr, whose `run --device <kind>=<name>` reads only
    /// /etc/cdi and /var/run/cdi. Without this call the node keeps containerd's defaults.
    pub fn cdi<P: AsRef<Path>>(mut self, spec_dirs: &[P]) -> Self {
        self.cdi_spec_dirs = Some(spec_dirs.iter().map(|d| d.as_ref().to_path_buf()).collect());
        self
    }

    /// containerd's `base_runtime_spec` for the gpu-ckpt handler and every extra runtime of
    /// gpu-ckpt's type: the OCI spec every container of theirs starts from (its hooks kept).
    pub fn base_runtime_spec(mut self, spec: &Path) -> Self {
        self.base_runtime_spec = Some(spec.to_path_buf());
        self
    }

    /// Write a CNI bridge config for this node (default: on). Without it, only hostNetwork
    /// (NODE network namespace) pods work.
    pub fn cni(mut self, on: bool) -> Self {
        self.cni = on;
        self
    }

    /// containerd log level (default "debug").
    pub fn log_level(mut self, level: &str) -> Self {
        self.log_level = level.to_string();
        self
    }

    /// Adds or replaces a key in the `gpu-ckpt` runtime's `options` table (it reaches the shim as
    /// `runtimeoptions.v1.Options.config_body`). Defaults: `BinaryName`, `Root`.
    pub fn runtime_option(mut self, key: &str, value: impl Into<OptValue>) -> Self {
        self.gpu_ckpt_options.insert(key.to_string(), value.into());
        self
    }

    /// Adds another CRI runtime handler (for example a restore class with different options).
    pub fn extra_runtime(mut self, runtime: ExtraRuntime) -> Self {
        self.extra_runtimes.push(runtime);
        self
    }

    /// Appends raw TOML to the generated config (new tables only: keys of tables the generator
    /// already wrote cannot be repeated in TOML).
    pub fn extra_config(mut self, toml: &str) -> Self {
        self.extra_config.push(toml.to_string());
        self
    }

    /// Runs the node's checkpoints and restores with the oldest CRIU gpu-ckpt supports
    /// ([`Stack::criu_oldest_dir`] first in containerd's PATH, and so in its shims' and runc's).
    pub fn oldest_criu(self) -> Self {
        let path = format!(
            "{}:{}",
            self.stack.criu_oldest_dir().display(),
            self.stack.path_env()
        );
        self.env("PATH", &path)
    }

    /// Sets an extra environment variable for containerd (and so for its shims).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// How long `start` waits for the socket (default 20 s).
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.start_timeout = timeout;
        self
    }

    /// Leaves the `gpu-ckpt` handler out of the generated config (for a node that gets its
    /// handlers from elsewhere, such as the node installer's drop-ins).
    pub fn without_gpu_ckpt_handler(mut self) -> Self {
        self.gpu_ckpt_handler = false;
        self
    }

    /// Runs containerd on this config file as it is, instead of writing one
    /// (`$STACK/nodes/<name>/config.toml`); [`NodeBuilder::render_config`] gives what would have
    /// been written.
    pub fn config_file(mut self, path: &Path) -> Self {
        self.config_file = Some(path.to_path_buf());
        self
    }

    /// The config this builder would write for its node.
    pub fn render_config(&self) -> Result<String> {
        let paths = NodePaths::new(&self.stack, &self.name);
        render_config(&self.stack, self, &paths, self.cni)
    }

    /// Starts the node.
    pub fn start(self) -> Result<Node> {
        Node::start_with(self)
    }
}

/// containerd on the node's config, in a session of its own (a terminal's ^C reaches it only
/// through us), its output to `log`.
fn spawn_containerd(
    stack: &Stack,
    paths: &NodePaths,
    env: &[(String, String)],
    log: fs::File,
    log2: fs::File,
) -> Result<std::process::Child> {
    fs::create_dir_all(&paths.tmp).with_context(|| format!("create {}", paths.tmp.display()))?;
    let mut cmd = Command::new(stack.containerd_bin());
    cmd.arg("--config")
        .arg(&paths.config)
        .env("PATH", stack.path_env())
        .env("TMPDIR", &paths.tmp)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log2));
    for (k, v) in env {
        cmd.env(k, v);
    }
    unsafe_setsid(&mut cmd);
    let child = cmd
        .spawn()
        .with_context(|| format!("spawn {}", stack.containerd_bin().display()))?;
    let _ = fs::write(&paths.pid_file, child.id().to_string());
    Ok(child)
}

/// Paths of one node.
#[derive(Debug, Clone)]
pub struct NodePaths {
    /// `$STACK/nodes/<name>`.
    pub dir: PathBuf,
    /// `$STACK/nodes/<name>/root` (containerd root; deleted on stop).
    pub root: PathBuf,
    /// `$STACK/nodes/<name>/config.toml`.
    pub config: PathBuf,
    /// `$STACK/nodes/<name>/containerd.log` (kept after stop).
    pub log: PathBuf,
    /// `$STACK/nodes/<name>/logs` (pod log directories).
    pub pod_logs: PathBuf,
    /// `$STACK/nodes/<name>/certs.d`.
    pub certs_d: PathBuf,
    /// `$STACK/nodes/<name>/net.d`.
    pub cni_conf_dir: PathBuf,
    /// `$STACK/nodes/<name>/cni-ipam` (host-local IPAM data).
    pub cni_ipam_dir: PathBuf,
    /// `$STACK/nodes/<name>/tmp`, containerd's `TMPDIR` (deleted on stop): `ctr container
    /// restore` extracts each checkpoint into a `ctrd-checkpoint*` directory there and never
    /// removes it.
    pub tmp: PathBuf,
    /// `/run/gpu-ckpt-test/<name>`.
    pub run: PathBuf,
    /// `/run/gpu-ckpt-test/<name>/state`.
    pub state: PathBuf,
    /// `/run/gpu-ckpt-test/<name>/containerd.sock`.
    pub socket: PathBuf,
    /// `/run/gpu-ckpt-test/<name>/runc` (runc root of the `runc` handler and of `ctr run`).
    pub runc_root: PathBuf,
    /// `/run/gpu-ckpt-test/<name>/gpu-ckpt-runc` (runc root of the `gpu-ckpt` handler).
    pub gpu_ckpt_runc_root: PathBuf,
    /// `/run/gpu-ckpt-test/<name>/fifo` (ctr fifos).
    pub fifo_dir: PathBuf,
    /// `/run/gpu-ckpt-test/<name>/containerd.pid`.
    pub pid_file: PathBuf,
}

impl NodePaths {
    fn new(stack: &Stack, name: &str) -> NodePaths {
        let dir = stack.node_dir(name);
        let run = Path::new(RUN_BASE).join(name);
        NodePaths {
            root: dir.join("root"),
            config: dir.join("config.toml"),
            log: dir.join("containerd.log"),
            pod_logs: dir.join("logs"),
            certs_d: dir.join("certs.d"),
            cni_conf_dir: dir.join("net.d"),
            cni_ipam_dir: dir.join("cni-ipam"),
            tmp: dir.join("tmp"),
            dir,
            state: run.join("state"),
            socket: run.join("containerd.sock"),
            runc_root: run.join("runc"),
            gpu_ckpt_runc_root: run.join("gpu-ckpt-runc"),
            fifo_dir: run.join("fifo"),
            pid_file: run.join("containerd.pid"),
            run,
        }
    }
}

/// CNI settings of a node: a bridge and a /24 derived from the node name.
#[derive(Debug, Clone)]
pub struct CniNet {
    pub network: String,
    pub bridge: String,
    pub subnet: String,
    pub gateway: String,
}

impl CniNet {
    fn for_node(name: &str) -> CniNet {
        let h = fnv1a(name.as_bytes());
        let second = 100 + (h % 100) as u8;
        let third = ((h >> 8) % 256) as u8;
        CniNet {
            network: format!("gpu-ckpt-{name}"),
            bridge: format!("gck{:08x}", h as u32),
            subnet: format!("10.{second}.{third}.0/24"),
            gateway: format!("10.{second}.{third}.1"),
        }
    }
}

fn fnv1a(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// A private containerd instance. Stopped (and its state removed) on drop.
#[derive(Debug)]
pub struct Node {
    stack: Stack,
    name: String,
    paths: NodePaths,
    cni: Option<CniNet>,
    child: Option<Child>,
    extra_runc_roots: Vec<PathBuf>,
    cdi_spec_dirs: Vec<PathBuf>,
    /// containerd's extra environment, for a restart.
    env: Vec<(String, String)>,
    stopped: bool,
}

impl Node {
    /// A builder for a node called `name` on the discovered stack.
    pub fn builder(name: &str) -> Result<NodeBuilder> {
        Ok(Node::builder_on(&Stack::discover()?, name))
    }

    /// A builder for a node called `name` on `stack`.
    pub fn builder_on(stack: &Stack, name: &str) -> NodeBuilder {
        NodeBuilder {
            stack: stack.clone(),
            name: name.to_string(),
            cni: true,
            log_level: "debug".to_string(),
            gpu_ckpt_options: BTreeMap::new(),
            extra_runtimes: Vec::new(),
            extra_config: Vec::new(),
            env: Vec::new(),
            start_timeout: Duration::from_secs(20),
            cdi_spec_dirs: None,
            base_runtime_spec: None,
            gpu_ckpt_handler: true,
            config_file: None,
        }
    }

    /// Starts a node with default options.
    pub fn start(name: &str) -> Result<Node> {
        Node::builder(name)?.start()
    }

    fn start_with(b: NodeBuilder) -> Result<Node> {
        validate_name(&b.name)?;
        let stack = b.stack.clone();
        let mut paths = NodePaths::new(&stack, &b.name);
        if let Some(file) = &b.config_file {
            paths.config = file.clone();
        }
        let cni = b.cni.then(|| CniNet::for_node(&b.name));

        // Leftovers of an earlier instance of this node (crashed test, killed cargo).
        let extra_roots: Vec<PathBuf> = b
            .extra_runtimes
            .iter()
            .filter_map(|r| match r.options.get("Root") {
                Some(OptValue::Str(s)) => Some(PathBuf::from(s)),
                _ => None,
            })
            .collect();
        cleanup_node(&paths, cni.as_ref(), &extra_roots, None);

        for d in [
            &paths.dir,
            &paths.root,
            &paths.pod_logs,
            &paths.run,
            &paths.state,
            &paths.runc_root,
            &paths.gpu_ckpt_runc_root,
            &paths.fifo_dir,
        ] {
            fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
        }

        // Registry hosts.toml (P6: CRI does not fall back to plain HTTP by itself).
        let hosts_dir = paths.certs_d.join(REGISTRY);
        fs::create_dir_all(&hosts_dir)?;
        fs::write(
            hosts_dir.join("hosts.toml"),
            format!(
                "server = \"http://{REGISTRY}\"\n\n[host.\"http://{REGISTRY}\"]\n  capabilities = [\"pull\", \"resolve\", \"push\"]\n"
            ),
        )?;

        if let Some(net) = &cni {
            write_cni_conf(&stack, &paths, net)?;
        } else {
            let _ = fs::remove_dir_all(&paths.cni_conf_dir);
        }

        if b.config_file.is_none() {
            let config = render_config(&stack, &b, &paths, cni.is_some())?;
            fs::write(&paths.config, config)
                .with_context(|| format!("write {}", paths.config.display()))?;
        }

        if paths.log.exists() {
            let _ = fs::rename(&paths.log, paths.dir.join("containerd.log.prev"));
        }
        let log = fs::File::create(&paths.log)
            .with_context(|| format!("create {}", paths.log.display()))?;
        let log2 = log.try_clone()?;

        let child = spawn_containerd(&stack, &paths, &b.env, log, log2)?;

        let mut node = Node {
            stack,
            name: b.name.clone(),
            paths,
            cni,
            child: Some(child),
            extra_runc_roots: extra_roots,
            cdi_spec_dirs: b.cdi_spec_dirs.clone().unwrap_or_default(),
            env: b.env.clone(),
            stopped: false,
        };
        node.wait_ready(b.start_timeout)?;
        Ok(node)
    }

    /// Restarts the node's containerd as an administrator would (SIGTERM, then the same
    /// command), leaving the shims and their containers running; the new containerd loads its
    /// tasks from its state and reconnects to their shims. Its log goes on in the same file.
    pub fn restart_containerd(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(20);
            while child.try_wait()?.is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let log = fs::OpenOptions::new()
            .append(true)
            .open(&self.paths.log)
            .with_context(|| format!("open {}", self.paths.log.display()))?;
        let log2 = log.try_clone()?;
        self.child = Some(spawn_containerd(
            &self.stack,
            &self.paths,
            &self.env,
            log,
            log2,
        )?);
        self.wait_ready(Duration::from_secs(20))
    }

    fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    self.child = None;
                    bail!(
                        "containerd for node {} exited during start ({status}); log {}:\n{}",
                        self.name,
                        self.paths.log.display(),
                        self.log_tail(60)
                    );
                }
            }
            if UnixStream::connect(&self.paths.socket).is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "containerd for node {} did not open {} within {:?}; log {}:\n{}",
                    self.name,
                    self.paths.socket.display(),
                    timeout,
                    self.paths.log.display(),
                    self.log_tail(60)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The stack it runs on.
    pub fn stack(&self) -> &Stack {
        &self.stack
    }

    /// All paths of this node.
    pub fn paths(&self) -> &NodePaths {
        &self.paths
    }

    /// The containerd gRPC socket.
    pub fn socket(&self) -> &Path {
        &self.paths.socket
    }

    /// containerd's PID while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// CNI settings, when CNI is on.
    pub fn cni(&self) -> Option<&CniNet> {
        self.cni.as_ref()
    }

    /// Directory for pod logs (`log_directory` of CRI pods goes below it).
    pub fn pod_log_root(&self) -> &Path {
        &self.paths.pod_logs
    }

    /// Flags for `ctr run` that keep runc state and fifos private (P7) and pick the runc binary (P1).
    pub fn ctr_run_flags(&self) -> Vec<String> {
        vec![
            "--runc-binary".into(),
            RUNC_BINARY.into(),
            "--runc-root".into(),
            self.paths.runc_root.display().to_string(),
            "--fifo-dir".into(),
            self.paths.fifo_dir.display().to_string(),
        ]
    }

    /// Runs `ctr --address <sock> -n default <args>`.
    pub fn ctr(&self, args: &[&str]) -> Result<Output> {
        self.ctr_ns("default", args)
    }

    /// Runs `ctr --address <sock> -n <ns> <args>`.
    pub fn ctr_ns(&self, ns: &str, args: &[&str]) -> Result<Output> {
        let ctr = self.stack.ctr_bin();
        let mut cmd = Command::new(&ctr);
        self.ctr_args(&mut cmd, ns, args)
            .output()
            .with_context(|| format!("run {} {}", ctr.display(), args.join(" ")))
    }

    /// ctr's arguments for this node (`--address <sock> -n <ns> <args>`), its PATH and no
    /// standard input, added to `cmd`.
    fn ctr_args<'c>(&self, cmd: &'c mut Command, ns: &str, args: &[&str]) -> &'c mut Command {
        cmd.arg("--address")
            .arg(&self.paths.socket)
            .arg("-n")
            .arg(ns)
            .args(args)
            .env("PATH", self.stack.path_env())
            .stdin(Stdio::null())
    }

    /// Like [`Node::ctr`], but fails unless ctr exits 0; returns stdout.
    pub fn ctr_ok(&self, args: &[&str]) -> Result<String> {
        self.ctr_ns_ok("default", args)
    }

    /// The pid of task `id` (namespace "default"), from `ctr task ls`.
    pub fn task_pid(&self, id: &str) -> Result<i32> {
        self.task_row(id)?
            .1
            .parse()
            .with_context(|| format!("pid of task {id}"))
    }

    /// The status of task `id` (RUNNING, PAUSED, STOPPED, …), from `ctr task ls`.
    pub fn task_status(&self, id: &str) -> Result<String> {
        Ok(self.task_row(id)?.2)
    }

    fn task_row(&self, id: &str) -> Result<(String, String, String)> {
        let out = self.ctr_ok(&["task", "ls"])?;
        for line in out.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.len() >= 3 && cols[0] == id {
                return Ok((cols[0].into(), cols[1].into(), cols[2].into()));
            }
        }
        bail!("task {id} not in `ctr task ls`:\n{out}")
    }

    /// `ctr task checkpoint --exit` of task `id` (namespace "default") into `dir`, which is
    /// removed first so that the checkpoint is the only thing in it.
    ///
    /// Even with `--image-path`, ctr records an image named
    /// `containerd.io/checkpoint/<id>:<time to the second>`, and refuses a second checkpoint of
    /// the same container within that second ("already exists"). The CRIU images are in `dir`,
    /// so that record is removed again.
    pub fn checkpoint_task_exit(&self, id: &str, dir: &Path) -> Result<()> {
        let _ = fs::remove_dir_all(dir);
        let dir = dir.display().to_string();
        self.ctr_ok(&["task", "checkpoint", "--exit", "--image-path", &dir, id])?;
        let prefix = format!("containerd.io/checkpoint/{id}:");
        let records = self.ctr_ok(&["image", "ls", "-q"])?;
        let ours: Vec<&str> = records
            .lines()
            .map(str::trim)
            .filter(|name| name.starts_with(&prefix))
            .collect();
        if !ours.is_empty() {
            self.ctr_ok(&[&["image", "rm"][..], &ours].concat())?;
        }
        Ok(())
    }

    /// The serving processes of shim `binary` for this node (not the short-lived `start`
    /// invocations that spawn them).
    pub fn shim_processes(&self, binary: &str) -> Vec<i32> {
        let socket = self.socket().display().to_string();
        processes_matching(&[binary, "-address", &socket])
            .into_iter()
            .filter(|pid| !cmdline(*pid).is_some_and(|c| c.ends_with(" start ")))
            .collect()
    }

    /// Like [`Node::ctr_ns`], but fails unless ctr exits 0; returns stdout.
    pub fn ctr_ns_ok(&self, ns: &str, args: &[&str]) -> Result<String> {
        let out = self.ctr_ns(ns, args)?;
        if !out.status.success() {
            bail!(
                "ctr -n {ns} {} failed ({}): {}{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                String::from_utf8_lossy(&out.stdout).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The CDI spec directories of this node ([`NodeBuilder::cdi`]); empty without CDI.
    pub fn cdi_spec_dirs(&self) -> &[PathBuf] {
        &self.cdi_spec_dirs
    }

    /// Runs `ctr --address <sock> -n <ns> <args>` so that it sees this node's CDI spec
    /// directories ([`NodeBuilder::cdi`]) as /etc/cdi. ctr 2.x resolves `run --device
    /// <vendor>/<class>=<name>` itself, from /etc/cdi and /var/run/cdi only (containerd 2.1's ctr
    /// has no flag for other directories), so ctr runs in a mount namespace of its own (`unshare
    /// --mount`, private propagation): /etc is an overlay of itself with a tmpfs on top, /etc/cdi
    /// shows copies of the spec files, and a host /var/run/cdi is hidden. Nothing changes outside
    /// that namespace, and the container itself is made by containerd as usual. The spec files
    /// (`*.json`, `*.yaml`) are copied on each call into `/run/gpu-ckpt-test/<node>/cdi`; a later
    /// directory's file replaces an earlier one's of the same name.
    pub fn ctr_cdi(&self, ns: &str, args: &[&str]) -> Result<Output> {
        if self.cdi_spec_dirs.is_empty() {
            bail!(
                "node {} has no CDI spec directories: start it with NodeBuilder::cdi",
                self.name
            );
        }
        let specs = self.paths.run.join("cdi");
        let _ = fs::remove_dir_all(&specs);
        fs::create_dir_all(&specs).with_context(|| format!("create {}", specs.display()))?;
        for dir in &self.cdi_spec_dirs {
            let entries =
                fs::read_dir(dir).with_context(|| format!("read CDI dir {}", dir.display()))?;
            for e in entries {
                let e = e?;
                let path = e.path();
                let is_spec = matches!(
                    path.extension().and_then(|x| x.to_str()),
                    Some("json" | "yaml" | "yml")
                );
                if is_spec && path.is_file() {
                    fs::copy(&path, specs.join(e.file_name()))
                        .with_context(|| format!("copy CDI spec {}", path.display()))?;
                }
            }
        }
        let scratch = self.paths.run.join("cdi-ns");
        fs::create_dir_all(&scratch).with_context(|| format!("create {}", scratch.display()))?;
        const SCRIPT: &str = r#"set -e
t=$1 s=$2
shift 2
mount -t tmpfs -o mode=0700 gpu-ckpt-cdi "$t"
mkdir "$t/upper" "$t/work"
mount -t overlay -o "lowerdir=/etc,upperdir=$t/upper,workdir=$t/work" gpu-ckpt-cdi /etc
mkdir -p /etc/cdi
mount --bind "$s" /etc/cdi
if [ -d /var/run/cdi ]; then mount -t tmpfs -o mode=0755 gpu-ckpt-cdi /var/run/cdi; fi
exec "$@"
"#;
        let ctr = self.stack.ctr_bin();
        let mut cmd = Command::new("unshare");
        cmd.args(["--mount", "--propagation", "private", "--"])
            .args(["sh", "-c", SCRIPT, "sh"])
            .arg(&scratch)
            .arg(&specs)
            .arg(&ctr);
        self.ctr_args(&mut cmd, ns, args)
            .output()
            .with_context(|| format!("run {} {} with CDI", ctr.display(), args.join(" ")))
    }

    /// The whole containerd log (lossy UTF-8).
    pub fn log(&self) -> String {
        fs::read(&self.paths.log)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Whether containerd's log contains `needle`.
    pub fn log_contains(&self, needle: &str) -> bool {
        self.log().contains(needle)
    }

    /// The last `lines` lines of containerd's log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log(), lines)
    }

    /// Imports an OCI tarball into namespace `ns` (`ctr images import`); returns ctr's output.
    pub fn import_image(&self, tar: &Path, ns: &str) -> Result<String> {
        let tar_s = tar.display().to_string();
        self.ctr_ns_ok(
            ns,
            &["images", "import", "--snapshotter", "overlayfs", &tar_s],
        )
        .with_context(|| format!("import {tar_s} into node {}", self.name))
    }

    /// Stops containerd (SIGTERM, SIGKILL after 5 s), kills the shims it started and the
    /// containers in its runc roots, unmounts everything below its root and state, deletes
    /// `/run/gpu-ckpt-test/<name>` and `$STACK/nodes/<name>/root`. Keeps `containerd.log`.
    pub fn stop(&mut self) -> Result<()> {
        if self.stopped {
            return Ok(());
        }
        self.stopped = true;
        let child = self.child.take();
        let errors = cleanup_node(
            &self.paths,
            self.cni.as_ref(),
            &self.extra_runc_roots,
            child,
        );
        if errors.is_empty() {
            Ok(())
        } else {
            Err(anyhow!(
                "stopping node {}: {}",
                self.name,
                errors.join("; ")
            ))
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("gpu-ckpt test stack: {e:#}");
        }
    }
}

fn validate_name(name: &str) -> Result<()> {
    if name.is_empty()
        || name.len() > 40
        || !name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
    {
        bail!("bad node name {name:?}: use 1-40 of [A-Za-z0-9_-]");
    }
    Ok(())
}

fn unsafe_setsid(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: setsid is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            let _ = nix::unistd::setsid();
            Ok(())
        });
    }
}

fn tail(s: &str, lines: usize) -> String {
    let all: Vec<&str> = s.lines().collect();
    let start = all.len().saturating_sub(lines);
    all[start..].join("\n")
}

fn write_cni_conf(stack: &Stack, paths: &NodePaths, net: &CniNet) -> Result<()> {
    let _ = fs::remove_dir_all(&paths.cni_conf_dir);
    fs::create_dir_all(&paths.cni_conf_dir)?;
    fs::create_dir_all(&paths.cni_ipam_dir)?;
    let conf = serde_json::json!({
        "cniVersion": "1.0.0",
        "name": net.network,
        "plugins": [
            {
                "type": "bridge",
                "bridge": net.bridge,
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "dataDir": paths.cni_ipam_dir,
                    "ranges": [[{ "subnet": net.subnet, "gateway": net.gateway }]],
                    "routes": [{ "dst": "0.0.0.0/0" }]
                }
            }
        ]
    });
    let _ = stack;
    fs::write(
        paths.cni_conf_dir.join("10-gpu-ckpt.conflist"),
        serde_json::to_string_pretty(&conf)?,
    )?;
    Ok(())
}

/// Which `containerd config default` keys exist in the installed containerd (cached).
fn containerd_default_config(stack: &Stack) -> String {
    static CACHE: Mutex<Option<(PathBuf, String)>> = Mutex::new(None);
    let mut g = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((p, s)) = g.as_ref() {
        if p == &stack.containerd_bin() {
            return s.clone();
        }
    }
    let out = Command::new(stack.containerd_bin())
        .args(["config", "default"])
        .stdin(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    *g = Some((stack.containerd_bin(), out.clone()));
    out
}

fn render_config(stack: &Stack, b: &NodeBuilder, p: &NodePaths, cni: bool) -> Result<String> {
    let defaults = containerd_default_config(stack);
    let has_key = |k: &str| defaults.contains(&format!("{k} ="));
    let mut c = String::new();
    let s = |p: &Path| toml_str(&p.display().to_string());

    writeln!(c, "version = 3")?;
    writeln!(c, "root = {}", s(&p.root))?;
    writeln!(c, "state = {}", s(&p.state))?;
    // containerd's temp dir (checkpoint dumps pass through it): private, removed with the root.
    writeln!(c, "temp = {}", s(&p.root.join("tmp")))?;
    // NRI listens on a fixed host path (/var/run/nri/nri.sock): two nodes would clash.
    writeln!(c, "disabled_plugins = [\"io.containerd.nri.v1.nri\"]")?;
    writeln!(c)?;
    writeln!(c, "[grpc]\n  address = {}", s(&p.socket))?;
    writeln!(c, "[ttrpc]\n  address = \"\"")?;
    writeln!(
        c,
        "[debug]\n  address = \"\"\n  level = {}",
        toml_str(&b.log_level)
    )?;
    writeln!(c, "[metrics]\n  address = \"\"")?;
    writeln!(c)?;

    writeln!(c, "[plugins.'io.containerd.cri.v1.images']")?;
    writeln!(c, "  snapshotter = \"overlayfs\"")?;
    writeln!(c, "[plugins.'io.containerd.cri.v1.images'.pinned_images]")?;
    writeln!(c, "  sandbox = {}", toml_str(PAUSE_IMAGE))?;
    writeln!(c, "[plugins.'io.containerd.cri.v1.images'.registry]")?;
    writeln!(c, "  config_path = {}", s(&p.certs_d))?;
    writeln!(c)?;

    writeln!(c, "[plugins.'io.containerd.cri.v1.runtime']")?;
    writeln!(c, "  restrict_oom_score_adj = true")?;
    if let Some(dirs) = &b.cdi_spec_dirs {
        let dirs: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        writeln!(c, "  enable_cdi = true")?;
        writeln!(c, "  cdi_spec_dirs = {}", toml_list(&dirs))?;
    }
    if has_key("enable_criu") {
        writeln!(c, "  enable_criu = true")?;
    }
    if has_key("netns_mounts_under_state_dir") {
        // Keeps pod network namespaces out of the shared /var/run/netns.
        writeln!(c, "  netns_mounts_under_state_dir = true")?;
    }
    writeln!(c, "[plugins.'io.containerd.cri.v1.runtime'.containerd]")?;
    writeln!(c, "  default_runtime_name = {}", toml_str(RUNC_HANDLER))?;

    let rt = "plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes";
    writeln!(c, "[{rt}.runc]")?;
    writeln!(c, "  runtime_type = \"io.containerd.runc.v2\"")?;
    writeln!(c, "[{rt}.runc.options]")?;
    writeln!(c, "  BinaryName = {}", toml_str(RUNC_BINARY))?;
    writeln!(c, "  SystemdCgroup = false")?;
    writeln!(c, "  Root = {}", s(&p.runc_root))?;

    let ann = vec!["gpu-ckpt.io/*".to_string()];
    if b.gpu_ckpt_handler {
        writeln!(c, "[{rt}.{GPU_CKPT_HANDLER}]")?;
        writeln!(c, "  runtime_type = {}", toml_str(GPU_CKPT_RUNTIME_TYPE))?;
        writeln!(c, "  pod_annotations = {}", toml_list(&ann))?;
        writeln!(c, "  container_annotations = {}", toml_list(&ann))?;
        if let Some(spec) = &b.base_runtime_spec {
            writeln!(c, "  base_runtime_spec = {}", s(spec))?;
        }
        let mut opts: BTreeMap<String, OptValue> = BTreeMap::new();
        opts.insert("BinaryName".into(), RUNC_BINARY.into());
        opts.insert("Root".into(), p.gpu_ckpt_runc_root.as_path().into());
        opts.extend(b.gpu_ckpt_options.clone());
        writeln!(c, "[{rt}.{GPU_CKPT_HANDLER}.options]")?;
        for (k, v) in &opts {
            writeln!(c, "  {k} = {}", v.to_toml())?;
        }
    }

    for r in &b.extra_runtimes {
        writeln!(c, "[{rt}.{}]", toml_str(&r.name))?;
        writeln!(c, "  runtime_type = {}", toml_str(&r.runtime_type))?;
        if !r.pod_annotations.is_empty() {
            writeln!(c, "  pod_annotations = {}", toml_list(&r.pod_annotations))?;
        }
        if !r.container_annotations.is_empty() {
            writeln!(
                c,
                "  container_annotations = {}",
                toml_list(&r.container_annotations)
            )?;
        }
        if let Some(spec) = b
            .base_runtime_spec
            .as_ref()
            .filter(|_| r.runtime_type == GPU_CKPT_RUNTIME_TYPE)
        {
            writeln!(c, "  base_runtime_spec = {}", s(spec))?;
        }
        if !r.options.is_empty() {
            writeln!(c, "[{rt}.{}.options]", toml_str(&r.name))?;
            for (k, v) in &r.options {
                writeln!(c, "  {k} = {}", v.to_toml())?;
            }
        }
    }

    writeln!(c, "[plugins.'io.containerd.cri.v1.runtime'.cni]")?;
    let cni_bins = vec![stack.cni_bin_dir().display().to_string()];
    if has_key("bin_dirs") || !has_key("bin_dir") {
        writeln!(c, "  bin_dirs = {}", toml_list(&cni_bins))?;
    } else {
        writeln!(c, "  bin_dir = {}", toml_str(&cni_bins[0]))?;
    }
    // Without CNI the conf dir is simply empty: hostNetwork pods only.
    let _ = cni;
    writeln!(c, "  conf_dir = {}", s(&p.cni_conf_dir))?;
    writeln!(c)?;

    writeln!(c, "[plugins.'io.containerd.grpc.v1.cri']")?;
    writeln!(c, "  disable_tcp_service = true")?;
    writeln!(c, "  stream_server_address = \"127.0.0.1\"")?;
    writeln!(c, "  stream_server_port = \"0\"")?;

    for extra in &b.extra_config {
        writeln!(c)?;
        writeln!(c, "{extra}")?;
    }
    Ok(c)
}

/// Tears a node down (also used before a start, to clean what a previous instance left).
/// Returns the problems it met; never panics.
fn cleanup_node(
    paths: &NodePaths,
    cni: Option<&CniNet>,
    extra_runc_roots: &[PathBuf],
    child: Option<Child>,
) -> Vec<String> {
    let mut errors = Vec::new();

    // 1. containerd: SIGTERM, then SIGKILL after 5 s.
    match child {
        Some(mut child) => {
            if let Err(e) = terminate(&mut child) {
                errors.push(format!("stop containerd: {e:#}"));
            }
        }
        None => {
            // A previous instance that was not stopped: its pid file, if it still is containerd.
            if let Some(pid) = fs::read_to_string(&paths.pid_file)
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok())
            {
                let cmdline = read_cmdline(pid);
                let cfg = paths.config.display().to_string();
                if cmdline.iter().any(|a| a == &cfg) {
                    terminate_pid(pid);
                }
            }
        }
    }

    // 2. Containers in the private runc roots (they would keep mounts busy and leak processes).
    // gpu-ckpt's default root (no options, as under ctr) is in containerd's state directory.
    let mut roots = vec![
        paths.runc_root.clone(),
        paths.gpu_ckpt_runc_root.clone(),
        paths.state.join("gpu-ckpt"),
    ];
    roots.extend(extra_runc_roots.iter().cloned());
    for root in &roots {
        kill_runc_containers(root);
    }

    // 3. Shims that talk to this containerd.
    // Their listening sockets (/run/containerd/s/<hash>) would outlive a SIGKILL: note them first.
    let sock = paths.socket.display().to_string();
    let pids = shim_pids(&sock);
    let shim_sockets = listening_socket_paths(&pids);
    for pid in &pids {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    for s in shim_sockets {
        if s.starts_with("/run/containerd/s/") {
            let _ = fs::remove_file(&s);
        }
    }

    // 4. Mounts below the root, the state and the run dir, deepest first, lazily.
    let prefixes = [paths.root.clone(), paths.state.clone(), paths.run.clone()];
    for _ in 0..3 {
        let mounts = mounts_under(&prefixes);
        if mounts.is_empty() {
            break;
        }
        for m in mounts {
            if let Err(e) = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH) {
                if e != nix::errno::Errno::EINVAL && e != nix::errno::Errno::ENOENT {
                    errors.push(format!("umount {}: {e}", m.display()));
                }
            }
        }
    }

    // 5. The CNI bridge.
    if let Some(net) = cni {
        if Path::new("/sys/class/net").join(&net.bridge).exists() {
            let _ = Command::new("ip")
                .args(["link", "del", &net.bridge])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        let _ = fs::remove_dir_all(&paths.cni_ipam_dir);
    }

    // 6. Directories.
    for d in [&paths.run, &paths.root, &paths.tmp] {
        if d.exists() {
            if let Err(e) = remove_dir_all_retry(d) {
                errors.push(format!("remove {}: {e:#}", d.display()));
            }
        }
    }
    errors
}

fn remove_dir_all_retry(d: &Path) -> Result<()> {
    let mut last = None;
    for _ in 0..5 {
        match fs::remove_dir_all(d) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => last = Some(e),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Err(last
        .map(anyhow::Error::from)
        .unwrap_or_else(|| anyhow!("unknown")))
}

fn terminate(child: &mut Child) -> Result<()> {
    if child.try_wait()?.is_some() {
        return Ok(());
    }
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if child.try_wait()?.is_some() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    child.wait()?;
    Ok(())
}

fn terminate_pid(pid: i32) {
    let p = nix::unistd::Pid::from_raw(pid);
    if nix::sys::signal::kill(p, nix::sys::signal::Signal::SIGTERM).is_err() {
        return;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if gone_or_zombie(pid) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = nix::sys::signal::kill(p, nix::sys::signal::Signal::SIGKILL);
}

fn gone_or_zombie(pid: i32) -> bool {
    Process::new(pid)
        .and_then(|p| p.stat())
        .map_or(true, |s| s.state == 'Z')
}

fn read_cmdline(pid: i32) -> Vec<String> {
    Process::new(pid)
        .and_then(|p| p.cmdline())
        .unwrap_or_default()
}

/// Processes whose command line has `-address <sock>` (runc v2 shim and our shim both do).
fn shim_pids(sock: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    let mut out = Vec::new();
    let Ok(all) = procfs::process::all_processes() else {
        return out;
    };
    for pid in all.flatten().map(|p| p.pid) {
        if pid == me {
            continue;
        }
        let args = read_cmdline(pid);
        let hit = args
            .windows(2)
            .any(|w| (w[0] == "-address" || w[0] == "--address") && w[1] == sock)
            || args.iter().any(|a| a == &format!("-address={sock}"));
        let is_shim = args
            .first()
            .map(|a| {
                Path::new(a)
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("containerd-shim"))
            })
            .unwrap_or(false);
        if hit && is_shim {
            out.push(pid);
        }
    }
    out
}

/// Paths of the unix sockets that `pids` hold open (from their fds and /proc/net/unix).
fn listening_socket_paths(pids: &[i32]) -> Vec<PathBuf> {
    let mut inodes = std::collections::HashSet::new();
    for pid in pids {
        let Ok(fds) = Process::new(*pid).and_then(|p| p.fd()) else {
            continue;
        };
        for fd in fds.flatten() {
            if let FDTarget::Socket(ino) = fd.target {
                inodes.insert(ino);
            }
        }
    }
    let Ok(table) = procfs::net::unix() else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = table
        .into_iter()
        .filter(|s| inodes.contains(&s.inode))
        .filter_map(|s| s.path)
        .filter(|p| p.is_absolute())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Kills and deletes every container in a runc root (`<root>/<namespace>/<id>/state.json`).
fn kill_runc_containers(root: &Path) {
    let Ok(namespaces) = fs::read_dir(root) else {
        return;
    };
    for ns in namespaces.flatten() {
        let ns_root = ns.path();
        let Ok(containers) = fs::read_dir(&ns_root) else {
            continue;
        };
        for c in containers.flatten() {
            let state = c.path().join("state.json");
            if !state.is_file() {
                continue;
            }
            let id = c.file_name().to_string_lossy().into_owned();
            let pod_cgroups = pod_cgroup_parents(&state);
            let deleted = Path::new(RUNC_BINARY).exists()
                && Command::new(RUNC_BINARY)
                    .arg("--root")
                    .arg(&ns_root)
                    .args(["delete", "--force", &id])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .map(|s| s.success())
                    .unwrap_or(false);
            if !deleted {
                kill_from_state(&state);
            }
            // What kubelet would remove: the pod's cgroup (empty once its containers are gone;
            // rmdir fails harmlessly while another container of the pod still uses it).
            for dir in pod_cgroups {
                let _ = fs::remove_dir(&dir);
            }
        }
    }
}

/// Parents named `pod<uid>` of the container's cgroups (from runc's `cgroup_paths`).
fn pod_cgroup_parents(state: &Path) -> Vec<PathBuf> {
    let Some(v) = fs::read_to_string(state)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
    else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut paths: Vec<&str> = Vec::new();
    if let Some(map) = v.get("cgroup_paths").and_then(|m| m.as_object()) {
        paths.extend(map.values().filter_map(|p| p.as_str()));
    }
    for p in paths {
        if let Some(parent) = Path::new(p).parent() {
            let is_pod = parent
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("pod"));
            if is_pod && parent.starts_with("/sys/fs/cgroup") {
                out.push(parent.to_path_buf());
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

fn kill_from_state(state: &Path) {
    let Ok(text) = fs::read_to_string(state) else {
        return;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return;
    };
    let Some(pid) = v.get("init_process_pid").and_then(|p| p.as_i64()) else {
        return;
    };
    let start = v.get("init_process_start").and_then(|p| p.as_u64());
    let pid = pid as i32;
    if pid <= 1 {
        return;
    }
    // Guard against a reused PID: compare the start time (field 22 of /proc/<pid>/stat).
    let actual = Process::new(pid)
        .and_then(|p| p.stat())
        .ok()
        .map(|s| s.starttime);
    if start.is_some() && actual != start {
        return;
    }
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// Mount points below any of `prefixes`, deepest first.
fn mounts_under(prefixes: &[PathBuf]) -> Vec<PathBuf> {
    let path = "/proc/self/mountinfo";
    let table = fs::read_to_string(path)
        .ok()
        .and_then(|t| image_format::mountinfo::parse(&t, path).ok())
        .unwrap_or_default();
    let mut out: Vec<PathBuf> = table
        .into_iter()
        .map(|m| PathBuf::from(m.mountpoint))
        .filter(|m| prefixes.iter().any(|p| m.starts_with(p)))
        .collect();
    out.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    out.dedup();
    out
}

/// One image from `$STACK/images/images.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageEntry {
    /// Reference, for example `localhost:5000/gpu-ckpt/workloads:1`.
    pub name: String,
    /// The OCI-layout tarball.
    pub tar: PathBuf,
}

/// Reads `images.json` in `dir`. Accepts a list of objects, or an object with an `images` list,
/// or an object mapping reference to tarball; a reference is found under `name`/`ref`/
/// `reference`/`image`, a tarball under `tar`/`path`/`file`/`archive`/`tarball`; relative
/// paths are relative to `dir`.
pub fn read_images_json(dir: &Path) -> Result<Vec<ImageEntry>> {
    let file = dir.join("images.json");
    let text = fs::read_to_string(&file).with_context(|| {
        format!(
            "test images missing ({}): build them with `gpu-ckpt-images --out {}` (`make deps`)",
            file.display(),
            dir.display()
        )
    })?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parse {}", file.display()))?;
    let resolve = |p: &str| {
        let p = PathBuf::from(p);
        if p.is_absolute() {
            p
        } else {
            dir.join(p)
        }
    };
    let pick = |o: &serde_json::Map<String, serde_json::Value>, keys: &[&str]| {
        keys.iter()
            .find_map(|k| o.get(*k).and_then(|v| v.as_str()).map(str::to_string))
    };
    let from_obj = |o: &serde_json::Map<String, serde_json::Value>| -> Option<ImageEntry> {
        let name = pick(o, &["name", "ref", "reference", "image"])?;
        let tar = pick(o, &["tar", "path", "file", "archive", "tarball"])?;
        Some(ImageEntry {
            name,
            tar: resolve(&tar),
        })
    };
    let list = match &v {
        serde_json::Value::Array(a) => a.clone(),
        serde_json::Value::Object(o) => match o.get("images") {
            Some(serde_json::Value::Array(a)) => a.clone(),
            _ => {
                let mut out = Vec::new();
                for (k, val) in o {
                    if let Some(t) = val.as_str() {
                        out.push(ImageEntry {
                            name: k.clone(),
                            tar: resolve(t),
                        });
                    } else if let Some(obj) = val.as_object() {
                        let mut obj = obj.clone();
                        obj.entry("name".to_string())
                            .or_insert_with(|| serde_json::Value::String(k.clone()));
                        if let Some(e) = from_obj(&obj) {
                            out.push(e);
                        }
                    }
                }
                if out.is_empty() {
                    bail!("{}: no images found", file.display());
                }
                return Ok(out);
            }
        },
        _ => bail!("{}: expected a list or an object", file.display()),
    };
    let mut out = Vec::new();
    for item in &list {
        let o = item
            .as_object()
            .ok_or_else(|| anyhow!("{}: entry is not an object: {item}", file.display()))?;
        out.push(
            from_obj(o)
                .ok_or_else(|| anyhow!("{}: entry without name or tar: {item}", file.display()))?,
        );
    }
    if out.is_empty() {
        bail!("{}: no images listed", file.display());
    }
    Ok(out)
}

/// The local registry on 127.0.0.1:5000 (started once, never stopped by tests).
#[derive(Debug, Clone)]
pub struct Registry {
    stack: Stack,
}

impl Registry {
    /// Starts the registry with `test-containers/stack/registry.sh start` unless it answers
    /// already; waits until `/v2/` answers.
    pub fn ensure_running(stack: &Stack) -> Result<Registry> {
        static LOCK: Mutex<()> = Mutex::new(());
        let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        if registry_answers() {
            return Ok(Registry {
                stack: stack.clone(),
            });
        }
        // Serialise with other test processes too.
        let _flock = lock_exclusive(&stack.prefix().join("registry.lock"))?;
        if !registry_answers() {
            let script = stack.repo().join("test-containers/stack/registry.sh");
            let out = Command::new("bash")
                .arg(&script)
                .arg("start")
                .env("GPU_CKPT_STACK", stack.prefix())
                .stdin(Stdio::null())
                .output()
                .with_context(|| format!("run {} start", script.display()))?;
            if !out.status.success() {
                bail!(
                    "{} start failed ({}): {}{}",
                    script.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let deadline = Instant::now() + Duration::from_secs(15);
            while !registry_answers() {
                if Instant::now() > deadline {
                    bail!(
                        "registry on {REGISTRY} does not answer after `{} start`: {}{}",
                        script.display(),
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Ok(Registry {
            stack: stack.clone(),
        })
    }

    /// Imports every tarball of `$STACK/images/images.json` into `node` (namespace k8s.io) and
    /// pushes it to the registry (`ctr images push --plain-http`), so that CRI can pull it and the
    /// image gets a RepoDigest (P8b). Returns the pushed references.
    pub fn push_images(&self, node: &Node) -> Result<Vec<String>> {
        // One push at a time, across test threads and processes: two concurrent pushes of the
        // same image to an empty registry race ("blob unknown to registry").
        let _flock = lock_exclusive(&self.stack.prefix().join("registry-push.lock"))?;
        let images = read_images_json(&self.stack.images_dir())?;
        let mut refs = Vec::new();
        for img in images {
            if !img.tar.is_file() {
                bail!(
                    "image tarball {} (for {}) is missing",
                    img.tar.display(),
                    img.name
                );
            }
            node.import_image(&img.tar, K8S_NAMESPACE)?;
            node.ctr_ns_ok(
                K8S_NAMESPACE,
                &["images", "push", "--plain-http", &img.name],
            )
            .with_context(|| format!("push {} to {REGISTRY}", img.name))?;
            refs.push(img.name);
        }
        Ok(refs)
    }
}

/// Whether something on 127.0.0.1:5000 answers `GET /v2/` like a registry.
pub fn registry_answers() -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(
        &"127.0.0.1:5000".parse().expect("valid address"),
        Duration::from_millis(500),
    ) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /v2/ HTTP/1.1\r\nHost: localhost:5000\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).unwrap_or(0);
    let head = String::from_utf8_lossy(&buf[..n]);
    head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200")
}

/// Takes an exclusive `flock` on `path` (created with its directory if missing), held until
/// the returned guard is dropped: serialises work across test threads and processes.
fn lock_exclusive(path: &Path) -> Result<nix::fcntl::Flock<fs::File>> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("open {}", path.display()))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| anyhow!("flock {}: {e}", path.display()))
}

/// A process's command line, each argument followed by a space (None once it is gone).
fn cmdline(pid: i32) -> Option<String> {
    let args = Process::new(pid).and_then(|p| p.cmdline()).ok()?;
    Some(args.iter().map(|a| format!("{a} ")).collect())
}

/// Processes whose command line contains every one of `needles`.
pub fn processes_matching(needles: &[&str]) -> Vec<i32> {
    let Ok(all) = procfs::process::all_processes() else {
        return Vec::new();
    };
    all.flatten()
        .map(|p| p.pid)
        .filter(|pid| cmdline(*pid).is_some_and(|c| needles.iter().all(|n| c.contains(n))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cni_net_differs_per_node() {
        let a = CniNet::for_node("a");
        let b = CniNet::for_node("b");
        assert_ne!(a.bridge, b.bridge);
        assert_ne!(a.subnet, b.subnet);
        assert!(a.bridge.len() <= 15);
    }

    #[test]
    fn images_json_shapes() {
        let d = tempfile::tempdir().unwrap();
        fs::write(
            d.path().join("images.json"),
            r#"[{"name":"localhost:5000/pause:1","tar":"pause.tar"}]"#,
        )
        .unwrap();
        let v = read_images_json(d.path()).unwrap();
        assert_eq!(v[0].name, "localhost:5000/pause:1");
        assert_eq!(v[0].tar, d.path().join("pause.tar"));
        fs::write(
            d.path().join("images.json"),
            r#"{"images":[{"reference":"x:1","path":"/abs/x.tar"}]}"#,
        )
        .unwrap();
        let v = read_images_json(d.path()).unwrap();
        assert_eq!(v[0].tar, PathBuf::from("/abs/x.tar"));
    }

    #[test]
    fn toml_strings_escape() {
        assert_eq!(toml_str("a\"b"), "\"a\\\"b\"");
        assert_eq!(OptValue::from(true).to_toml(), "true");
    }

    #[test]
    fn cdi_keys_in_the_cri_runtime_table() {
        let stack = Stack {
            prefix: PathBuf::from("/nonexistent/gpu-ckpt-stack"),
            repo: repo_root(),
        };
        let p = NodePaths::new(&stack, "cfg");
        let b = Node::builder_on(&stack, "cfg").cdi(&["/x/cdi", "/y/cdi"]);
        let c = render_config(&stack, &b, &p, false).unwrap();
        let table = "[plugins.'io.containerd.cri.v1.runtime']\n";
        let start = c.find(table).expect("runtime table") + table.len();
        let end = start + c[start..].find("\n[").expect("next table") + 1;
        let body = &c[start..end];
        assert!(body.contains("  enable_cdi = true\n"), "{body}");
        assert!(
            body.contains("  cdi_spec_dirs = [\"/x/cdi\", \"/y/cdi\"]\n"),
            "{body}"
        );
        let plain = render_config(&stack, &Node::builder_on(&stack, "cfg"), &p, false).unwrap();
        assert!(!plain.contains("cdi"), "{plain}");
    }
}
