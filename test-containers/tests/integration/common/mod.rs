//! Shared setup of the integration tests: a private containerd node with the test images.

pub mod gpu;
pub mod soak;

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use k8s_cri::v1 as cri;
use test_containers::cri::{ContainerSpec, Cri};
use test_containers::stack::{
    read_images_json, Node, NodeBuilder, Registry, Stack, WORKLOADS_IMAGE,
};

pub const RUNTIME: &str = "io.containerd.gpu-ckpt.v1";

/// A started node whose `default` namespace has the test images (for ctr) and whose images are
/// in the registry (for CRI). Fails, never skips, when the stack is not installed.
pub fn node(name: &str) -> Result<Node> {
    node_with(Node::builder(name)?)
}

/// Whether the tests run with the oldest CRIU gpu-ckpt supports: `GPU_CKPT_TEST_CRIU=oldest`
/// (the test command runs the checkpoint tests a second time so).
pub fn oldest_criu() -> bool {
    std::env::var("GPU_CKPT_TEST_CRIU").is_ok_and(|v| v == "oldest")
}

/// Starts the node `builder` describes (with the oldest CRIU when [`oldest_criu`]), with the
/// test images imported and pushed.
pub fn node_with(builder: NodeBuilder) -> Result<Node> {
    let builder = if oldest_criu() {
        builder.oldest_criu()
    } else {
        builder
    };
    let stack = Stack::discover()?;
    let registry = Registry::ensure_running(&stack)?;
    let node = builder.start()?;
    registry.push_images(&node)?;
    for img in read_images_json(&stack.images_dir())? {
        node.import_image(&img.tar, "default")?;
    }
    Ok(node)
}

/// `ctr run` flags for this runtime, keeping fifos under the node.
pub fn run_flags(node: &Node) -> Vec<String> {
    vec![
        "--runtime".into(),
        RUNTIME.into(),
        "--fifo-dir".into(),
        node.paths().fifo_dir.display().to_string(),
    ]
}

/// Runs ctr with `args`, after `run <run_flags>` when `run` is set.
pub fn ctr_run(node: &Node, extra: &[&str]) -> Result<std::process::Output> {
    let flags = run_flags(node);
    let mut args: Vec<&str> = vec!["run"];
    args.extend(flags.iter().map(String::as_str));
    args.extend_from_slice(extra);
    node.ctr(&args)
}

pub fn workloads() -> &'static str {
    WORKLOADS_IMAGE
}

/// Polls `f` until it returns `Some`, or fails after `timeout` with `what`.
pub fn wait_until<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The counter value a counter workload wrote to its file, read through its rootfs. The counter
/// rewrites the file every tick, so a read can meet it empty: such reads are retried.
pub fn counter_value(pid: i32) -> Option<u64> {
    for _ in 0..50 {
        let text = std::fs::read_to_string(format!("/proc/{pid}/root/counter.txt")).ok()?;
        if let Ok(v) = text.trim().parse() {
            return Some(v);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

/// Lines of /proc/self/mountinfo that mention `needle`.
pub fn mounts_mentioning(needle: &str) -> Vec<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_string)
        .collect()
}

/// The shim processes serving `node`.
pub fn shims_of(node: &Node) -> Vec<i32> {
    node.shim_processes("containerd-shim-gpu-ckpt-v1")
}

/// Files below `dir` whose name contains `needle`.
pub fn files_named(dir: &Path, needle: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if e.file_name().to_string_lossy().contains(needle) {
                out.push(p.clone());
            }
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                stack.push(p);
            }
        }
    }
    out
}

/// The cgroup v1 memory directory of a process, or its v2 directory.
pub fn memory_cgroup_dir(pid: i32) -> Result<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    for line in text.lines() {
        let parts: Vec<&str> = line.splitn(3, ':').collect();
        if parts.len() == 3 && parts[1].split(',').any(|c| c == "memory") {
            return Ok(
                PathBuf::from("/sys/fs/cgroup/memory").join(parts[2].trim_start_matches('/'))
            );
        }
    }
    for line in text.lines() {
        if let Some(p) = line.strip_prefix("0::") {
            return Ok(PathBuf::from("/sys/fs/cgroup").join(p.trim_start_matches('/')));
        }
    }
    bail!("no memory cgroup for pid {pid}")
}

pub fn read_u64(path: &Path) -> Result<u64> {
    let s = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let s = s.trim();
    if s == "max" {
        return Ok(u64::MAX);
    }
    s.parse()
        .with_context(|| format!("parse {} ({s:?})", path.display()))
}

/// A status file a workload writes, read through its rootfs.
pub fn rootfs_file(pid: i32, path: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/root{path}")).ok()
}

/// Runs memhog detached as container `id` with `args` (`--mib`, `--interval-ms`, …) and its
/// status in /status.txt; returns its pid.
pub fn run_memhog(node: &Node, id: &str, args: &[&str]) -> Result<i32> {
    let mut all = vec![workloads(), id, "/bin/memhog"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--status-file", "/status.txt"]);
    run_detached(node, &all)
}

/// Waits up to `timeout` until memhog `pid` has verified its memory once; returns its status.
pub fn memhog_verified(pid: i32, timeout: Duration, what: &str) -> Result<String> {
    wait_until(timeout, what, || {
        rootfs_file(pid, "/status.txt").filter(|s| s.contains("verified pass"))
    })
}

/// The stack's CRIU bundled into `dir` as `make payload` bundles it for the node installer's
/// payload (`runtime-class/installer/payload.sh criu`): `dir/criu` with every library it needs
/// and glibc's loader in `dir/lib`, its RPATH `$ORIGIN/lib`, its interpreter a placeholder the
/// installer replaces.
pub fn bundle_criu(stack: &Stack, dir: &Path) -> Result<()> {
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../runtime-class/installer/payload.sh");
    run_ok(
        Command::new(script)
            .arg("criu")
            .arg(stack.criu_bin())
            .arg(dir),
    )
    .map(|_| ())
}

/// Runs a command and returns its output, failing with its stderr when it fails.
pub fn run_ok(cmd: &mut std::process::Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `ctr run -d` of the workloads image's counter as container `id` (a tick every
/// `interval_ms`); returns its pid once it has counted to 5.
pub fn start_counter(node: &Node, id: &str, interval_ms: &str) -> Result<i32> {
    let pid = run_detached(
        node,
        &[
            workloads(),
            id,
            "/bin/counter",
            "--interval-ms",
            interval_ms,
        ],
    )?;
    wait_until(Duration::from_secs(10), "the counter to reach 5", || {
        counter_value(pid).filter(|v| *v >= 5)
    })?;
    Ok(pid)
}

/// Waits until the counter of process `pid` passes `from` (it goes on counting).
pub fn counter_goes_on(pid: i32, from: u64) -> Result<u64> {
    wait_until(Duration::from_secs(10), "the counter to go on", || {
        counter_value(pid).filter(|v| *v > from)
    })
}

/// Restores task `id` from the CRIU image directory `dir` through the containerd API
/// (Tasks.Create with `CriuImagePath`, then Start); returns the restored pid.
pub fn restore_from_dir(node: &Node, id: &str, dir: &Path) -> Result<i32> {
    rt().block_on(async {
        let api =
            test_containers::containerd::Containerd::connect(node.socket(), "default").await?;
        Ok(api.restore_from_image_path(id, dir).await? as i32)
    })
}

/// A single-threaded runtime for a test's async part.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// `ctr run -d` on this runtime with `extra` (flags, image, id, command); returns the task's pid.
pub fn run_detached(node: &Node, extra: &[&str]) -> Result<i32> {
    let mut args = vec!["-d"];
    args.extend_from_slice(extra);
    let out = ctr_run(node, &args)?;
    if !out.status.success() {
        bail!(
            "ctr run -d {}: {}",
            extra.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let id = extra
        .iter()
        .skip_while(|a| **a != workloads())
        .nth(1)
        .context("no container id after the image")?;
    node.task_pid(id)
}

/// CRIU's network lock method as its dump recorded it in `inventory.img` (CRIU's own values:
/// 0 iptables, 1 nftables, 2 skip); the restore uses the same.
pub fn inventory_network_lock(dir: &Path) -> Result<u64> {
    let path = dir.join("inventory.img");
    let b = std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
    // The inventory carries its own magic only, not CRIU's common one.
    let entry = image_format::criu_stats::first_entry(&b, 1)
        .map_err(|why| anyhow::anyhow!("{}: {why}", path.display()))?;
    let fields = image_format::protowire::fields(entry).context("inventory entry")?;
    // InventoryEntry.network_lock_method = 11.
    image_format::protowire::varint_field(&fields, 11)
        .context("inventory.img records no network lock method")
}

/// The counter workload's value, read in the container through CRI exec from `file` (the
/// counter's `--file`, which it replaces whole each tick).
pub async fn cri_counter(cri: &test_containers::cri::Cri, id: &str, file: &str) -> Result<u64> {
    let r = cri.exec_sync(id, &["cat", file], 10).await?;
    let text = r.stdout_str();
    text.trim()
        .parse()
        .with_context(|| format!("counter of {id} in {file}: {text:?}"))
}

/// Waits (20 s at most) until the counter read from `file` has passed `above`.
pub async fn cri_counter_above(
    cri: &test_containers::cri::Cri,
    id: &str,
    file: &str,
    above: u64,
) -> Result<u64> {
    for _ in 0..200 {
        if let Ok(v) = cri_counter(cri, id, file).await {
            if v > above {
                return Ok(v);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("the counter of {id} did not pass {above}")
}

/// The handler registered as containerd's CRI can introspect it: runtime type
/// `io.containerd.runc.v2` with `runtime_path` naming the gpu-ckpt shim. containerd 2.1's CRI
/// asks only runtimes of that type for their features.
pub const RUNC_TYPED: &str = "gpu-ckpt-rt";

pub fn runc_typed_handler(
    builder: test_containers::stack::NodeBuilder,
    node: &str,
) -> Result<test_containers::stack::NodeBuilder> {
    let stack = test_containers::stack::Stack::discover()?;
    let shim = stack.shim_dir().join("containerd-shim-gpu-ckpt-v1");
    let table = format!("plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{RUNC_TYPED}");
    Ok(builder.extra_config(&format!(
        "[{table}]\n  runtime_type = \"io.containerd.runc.v2\"\n  runtime_path = \"{}\"\n  pod_annotations = [\"gpu-ckpt.io/*\"]\n  container_annotations = [\"gpu-ckpt.io/*\"]\n[{table}.options]\n  BinaryName = \"/usr/sbin/runc\"\n  Root = \"/run/gpu-ckpt-test/{node}/{RUNC_TYPED}-runc\"\n",
        shim.display()
    )))
}

/// A host directory with a tmpfs mounted below it (`sub`), so that "read-only all the way down"
/// can be told from a plain read-only bind; unmounted when dropped.
pub struct NestedMount {
    dir: tempfile::TempDir,
}

impl NestedMount {
    pub fn new() -> Result<NestedMount> {
        let dir = tempfile::Builder::new().prefix("rro-").tempdir()?;
        std::fs::create_dir(dir.path().join("sub"))?;
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "rro-sub"])
            .arg(dir.path().join("sub"))
            .status()?;
        ensure!(
            st.success(),
            "mounting a tmpfs below {}",
            dir.path().display()
        );
        Ok(NestedMount { dir })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for NestedMount {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path().join("sub"))
            .status();
    }
}

pub fn mount(
    host: &Path,
    readonly: bool,
    recursive: bool,
    propagation: cri::MountPropagation,
) -> cri::Mount {
    cri::Mount {
        container_path: "/data".into(),
        host_path: host.display().to_string(),
        readonly,
        recursive_read_only: recursive,
        propagation: propagation as i32,
        ..Default::default()
    }
}

pub fn counter_with(m: cri::Mount) -> ContainerSpec {
    let mut spec = ContainerSpec::new("counter", workloads()).command(&[
        "/bin/counter",
        "--interval-ms",
        "100",
    ]);
    spec.mounts.push(m);
    spec
}

/// Tries to write a file at `path` in the container: Ok(true) when it could.
pub async fn can_write(cri: &Cri, id: &str, path: &str) -> Result<bool> {
    let r = cri
        .exec_sync(id, &["sh", "-c", &format!("echo x > {path}")], 10)
        .await?;
    let err = r.stderr_str();
    if r.exit_code == 0 {
        return Ok(true);
    }
    ensure!(
        err.contains("Read-only file system"),
        "writing {path}: {err}"
    );
    Ok(false)
}

/// Recursive read-only all the way down; a plain read-only bind leaves the sub-mount writable,
/// which shows the test can tell them apart.
pub async fn expect_rro(cri: &Cri, id: &str) -> Result<()> {
    ensure!(!can_write(cri, id, "/data/top").await?, "/data is writable");
    ensure!(
        !can_write(cri, id, "/data/sub/below").await?,
        "/data/sub is writable: not recursive"
    );
    Ok(())
}

/// The restore RuntimeClass's handler `handler` for node `node`: `Mode = "restore"`, a runc
/// root of its own, a staging directory under the node ([`restore_staging_dir`]), and the test
/// nodes' archives and the test registry's checkpoint images as its restore sources. Callers add options (keys, trust) to `options` as they need.
pub fn restore_handler(node: &str, handler: &str) -> Result<test_containers::stack::ExtraRuntime> {
    use test_containers::stack::OptValue;
    let mut options = std::collections::BTreeMap::new();
    options.insert("Mode".to_string(), OptValue::from("restore"));
    options.insert(
        "Root".to_string(),
        OptValue::from(format!("/run/gpu-ckpt-test/{node}/{handler}-runc")),
    );
    options.insert(
        "RestoreSources".to_string(),
        OptValue::from(vec![
            format!("{}/", Stack::discover()?.prefix().join("nodes").display()),
            "localhost:5000/ckpt/".to_string(),
        ]),
    );
    options.insert(
        "RestoreStagingDir".to_string(),
        OptValue::from(restore_staging_dir(node)?.as_path()),
    );
    Ok(test_containers::stack::ExtraRuntime {
        name: handler.into(),
        runtime_type: test_containers::stack::GPU_CKPT_RUNTIME_TYPE.into(),
        pod_annotations: vec!["gpu-ckpt.io/*".into()],
        container_annotations: vec!["gpu-ckpt.io/*".into()],
        options,
    })
}

/// The restore handler's staging directory on node `node` (`RestoreStagingDir`): under the
/// node, so that the tests never write into the host's /var/lib.
pub fn restore_staging_dir(node: &str) -> Result<PathBuf> {
    Ok(Stack::discover()?.node_dir(node).join("restore-staging"))
}

/// A non-root checkpoint that failed with `err` because this host's root lacks
/// CAP_SYS_RESOURCE (CRIU reads every task's rlimits with prlimit(2), which for another uid's
/// task needs it; stack.md P5): fails unless CRIU said so, and says on stderr that `what` did
/// not run. Not a silent pass: written to stderr directly, which the test harness does not
/// capture (it captures the print macros), so it shows in the test output on every run.
pub fn not_run_without_cap_sys_resource(err: &anyhow::Error, what: &str) -> Result<()> {
    use std::io::Write;
    let msg = format!("{err:#}");
    ensure!(
        msg.contains("rlimit") && msg.contains("Operation not permitted"),
        "{msg}"
    );
    // tonic writes the status message with Debug escapes.
    let said = msg
        .split("\\n")
        .flat_map(str::lines)
        .find(|l| l.contains("rlimit"))
        .unwrap_or_default();
    let _ = writeln!(
        std::io::stderr().lock(),
        "NOT RUN: {what}: this host's root lacks CAP_SYS_RESOURCE, so CRIU cannot checkpoint \
         a non-root task (its prlimit of the task fails; stack.md P5). CRIU said: {said}"
    );
    Ok(())
}

/// Whether root here has CAP_SYS_RESOURCE (bit 24), which CRIU needs to read the rlimits of
/// another uid's task: without it no non-root container can be checkpointed (stack.md P5).
pub fn root_has_cap_sys_resource() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << 24) != 0)
}

/// The handler name of the restore RuntimeClass.
pub const RESTORE_HANDLER: &str = "gpu-ckpt-restore";

/// A node with the restore RuntimeClass's handler ([`restore_handler`]) next to gpu-ckpt's.
pub fn restore_node(name: &str) -> Result<Node> {
    restore_node_with(Node::builder(name)?, name)
}

/// [`restore_node`] on a builder the caller has set up.
pub fn restore_node_with(builder: NodeBuilder, name: &str) -> Result<Node> {
    node_with(builder.extra_runtime(restore_handler(name, RESTORE_HANDLER)?))
}

/// The handler features CRI reports, by handler name: (recursive read-only mounts, user
/// namespaces).
pub async fn handler_features(
    cri: &Cri,
) -> Result<std::collections::BTreeMap<String, (bool, bool)>> {
    let status = cri.status().await?;
    Ok(status
        .runtime_handlers
        .into_iter()
        .map(|h| {
            let f = h.features.unwrap_or_default();
            (h.name, (f.recursive_read_only_mounts, f.user_namespaces))
        })
        .collect())
}

/// CRI on `cri`'s node reports for each of `handlers` runc's features, and runc's include
/// recursive read-only mounts (so the comparison means something).
pub async fn expect_runc_features(cri: &Cri, handlers: &[&str]) -> Result<()> {
    let features = handler_features(cri).await?;
    let runc = *features
        .get(test_containers::stack::RUNC_HANDLER)
        .context("no runc handler in CRI's status")?;
    ensure!(
        runc.0,
        "runc supports recursive read-only mounts here: {features:?}"
    );
    for h in handlers {
        let f = features
            .get(*h)
            .with_context(|| format!("no {h} handler: {features:?}"))?;
        ensure!(*f == runc, "{h} reports {f:?}, runc {runc:?}");
    }
    Ok(())
}

/// A counter in a pod on `handler` with `host` bound recursively read-only at `/data` runs under
/// the gpu-ckpt shim, read-only all the way down ([`expect_rro`]); the pod is removed.
pub async fn expect_rro_counter(cri: &Cri, node: &Node, handler: &str, host: &Path) -> Result<()> {
    cri.pull_image(workloads()).await?;
    let pod = cri
        .run_pod(&test_containers::cri::PodSpec::new("rro", node.pod_log_root()).handler(handler))
        .await?;
    let private = cri::MountPropagation::PropagationPrivate;
    let id = cri
        .run_container(&pod, &counter_with(mount(host, true, true, private)))
        .await
        .with_context(|| format!("a pod with a recursive read-only mount on handler {handler}"))?;
    ensure!(
        !node
            .shim_processes("containerd-shim-gpu-ckpt-v1")
            .is_empty(),
        "the pod runs under the gpu-ckpt shim"
    );
    expect_rro(cri, &id).await?;
    cri.remove_pod(&pod).await
}

/// The counter workload as CRI container `counter`: a tick every 100 ms, its count in
/// `/counter.txt`.
pub fn counter_spec() -> ContainerSpec {
    ContainerSpec::new("counter", workloads()).command(&["/bin/counter", "--interval-ms", "100"])
}

/// Pulls the workloads image through CRI (so that it has a RepoDigest: a restore pulls the base
/// image by the digest the checkpoint recorded) and runs [`counter_spec`] in a pod `pod` of
/// `node` on the gpu-ckpt handler: the pod and the container's id.
pub async fn cri_counter_pod(
    cri: &Cri,
    node: &Node,
    pod: &str,
) -> Result<(test_containers::cri::Pod, String)> {
    cri.pull_image(workloads()).await?;
    let pod = cri
        .run_pod(
            &test_containers::cri::PodSpec::new(pod, node.pod_log_root())
                .handler(test_containers::stack::GPU_CKPT_HANDLER),
        )
        .await?;
    let id = cri.run_container(&pod, &counter_spec()).await?;
    Ok((pod, id))
}

/// A pod `name` on `node` for the restore RuntimeClass's handler ([`RESTORE_HANDLER`]),
/// restoring `source` (the annotation `gpu-ckpt.io/restore-from`).
pub fn restore_pod(name: &str, node: &Node, source: &str) -> test_containers::cri::PodSpec {
    test_containers::cri::PodSpec::new(name, node.pod_log_root())
        .handler(RESTORE_HANDLER)
        .annotation("gpu-ckpt.io/restore-from", source)
}

/// A restore of `source` (`gpu-ckpt.io/restore-from`) into a counter ([`counter_spec`]) in a
/// pod `worker` of `namespace` through `handler` on `node`: `Ok(first counter value)` when it
/// runs and counts on, `Err` with the error text when it is refused. The pod is removed.
pub async fn try_restore(
    cri: &Cri,
    node: &Node,
    handler: &str,
    namespace: &str,
    source: &str,
) -> Result<std::result::Result<u64, String>> {
    let pod = cri
        .run_pod(
            &test_containers::cri::PodSpec::new("worker", node.pod_log_root())
                .namespace(namespace)
                .handler(handler)
                .annotation("gpu-ckpt.io/restore-from", source),
        )
        .await?;
    let result = match cri.run_container(&pod, &counter_spec()).await {
        Ok(id) => {
            let first = cri_counter(cri, &id, "/counter.txt").await?;
            cri_counter_above(cri, &id, "/counter.txt", first).await?;
            Ok(first)
        }
        // tonic writes the status message with Debug escapes.
        Err(e) => Err(format!("{e:#}").replace("\\\"", "\"")),
    };
    cri.remove_pod(&pod).await?;
    Ok(result)
}

/// The `gpu-ckpt` CLI: in the stack's shim directory, else the workspace's target/debug.
pub fn gpu_ckpt_cli() -> PathBuf {
    let dir = Stack::discover()
        .map(|s| s.shim_dir())
        .unwrap_or_else(|_| PathBuf::from("target/debug"));
    let p = dir.join("gpu-ckpt");
    if p.exists() {
        p
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/gpu-ckpt")
    }
}

/// Copies the archive `src` to `dst`, passing every member through `edit` (name, bytes) -> new
/// bytes, or `None` to leave the member out.
pub fn rewrite_archive(
    src: &Path,
    dst: &Path,
    mut edit: impl FnMut(&str, Vec<u8>) -> Result<Option<Vec<u8>>>,
) -> Result<()> {
    use std::io::Read;
    let mut ar = tar::Archive::new(std::fs::File::open(src)?);
    let mut out = tar::Builder::new(std::fs::File::create(dst)?);
    for e in ar.entries()? {
        let mut e = e?;
        let path = e.path()?.into_owned();
        let mut header = e.header().clone();
        let mut data = Vec::new();
        e.read_to_end(&mut data)?;
        let Some(data) = edit(&path.to_string_lossy(), data)? else {
            continue;
        };
        header.set_size(data.len() as u64);
        header.set_cksum();
        out.append_data(&mut header, &path, &data[..])?;
    }
    out.finish()?;
    Ok(())
}

/// `ctr task checkpoint --image-path DIR ID` on `node`, in a thread of its own (the caller
/// interferes with the dump meanwhile); join it for ctr's output.
pub fn ctr_checkpoint_in_background(
    node: &Node,
    id: &str,
    dir: &Path,
) -> Result<std::thread::JoinHandle<std::io::Result<std::process::Output>>> {
    let (dir, id) = (dir.display().to_string(), id.to_string());
    let socket = node.socket().to_path_buf();
    let ctr = Stack::discover()?.ctr_bin();
    Ok(std::thread::spawn(move || {
        std::process::Command::new(ctr)
            .arg("--address")
            .arg(socket)
            .args([
                "-n",
                "default",
                "task",
                "checkpoint",
                "--image-path",
                &dir,
                &id,
            ])
            .output()
    }))
}

/// The pid of the CRIU dumping the container whose init is `pid` into `dir`, once it writes
/// pages (runc runs it as `criu swrk 3`, and CRIU retitles itself `criu: dump --rpc -t <pid>`).
pub fn criu_dumping_pages(pid: i32, dir: &Path, timeout: Duration) -> Result<i32> {
    let target = format!("-t {pid}");
    wait_until(timeout, "CRIU to dump pages", || {
        let p = *test_containers::stack::processes_matching(&["criu: dump", &target]).first()?;
        let pages: u64 = std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("pages-"))
            .filter_map(|e| e.metadata().ok().map(|m| m.len()))
            .sum();
        (pages > 0).then_some(p)
    })
}

/// The key directory of test node `node` (its `SigningKey` is `node.key` in it): under the
/// node's own run directory, never the machine's `/var/lib/gpu-ckpt`.
pub fn node_key_dir(node: &str) -> PathBuf {
    Path::new(test_containers::stack::RUN_BASE).join(format!("{node}-keys"))
}

/// A node that checkpoints with a key of its own ([`node_key_dir`], made afresh).
pub fn signing_node(name: &str) -> Result<Node> {
    let keys = node_key_dir(name);
    let _ = std::fs::remove_dir_all(&keys);
    node_with(
        Node::builder(name)?
            .runtime_option("SigningKey", keys.join("node.key").display().to_string()),
    )
}

/// The manifest without its signature (and, with `drop_copy`, without the rootfs changes'
/// copy): a checkpoint as an unsigning tool would write it.
pub fn unsigned_manifest(data: Vec<u8>, drop_copy: bool) -> Vec<u8> {
    let mut v: serde_json::Value = serde_json::from_slice(&data).unwrap_or_default();
    if let Some(o) = v.as_object_mut() {
        o.remove("signature");
        if drop_copy {
            if let Some(files) = o.get_mut("files").and_then(|f| f.as_object_mut()) {
                files.remove("gpu-ckpt-rootfs-changes.tar");
            }
        }
    }
    serde_json::to_vec_pretty(&v).unwrap_or_default()
}

/// The words of the one text a pod sees for every checkpoint it may not use (missing, outside
/// `RestoreSources`, unsigned, untrusted or revoked signer, another namespace).
pub const REFUSED: &str = "cannot be used by this pod";

/// The pod-visible refusal in `msg` (a CRI error: its status message, what the kubelet puts in
/// the pod's events) of the checkpoint `source`, with the source replaced by `SOURCE`: the same
/// for every reason. Fails when `msg` is not that refusal.
pub fn refusal_text(msg: &str, source: &str) -> Result<String> {
    ensure!(
        msg.contains(&format!("checkpoint {source:?} {REFUSED}")),
        "not the refusal of {source}: {msg}"
    );
    let status = msg.split_once("message: ").map_or(msg, |(_, m)| m);
    Ok(status.replace(source, "SOURCE"))
}

/// How many of the shim's refusals of `source` (any source for "") in the node's log give a
/// reason naming every one of `reason` (on one line; quotes unescaped).
pub fn refusals_logged(node: &Node, source: &str, reason: &[&str]) -> usize {
    node.log()
        .lines()
        .filter(|l| {
            let l = l.replace("\\\"", "\"");
            l.contains("checkpoint refused")
                && l.contains(source)
                && reason.iter().all(|r| l.contains(r))
        })
        .count()
}

/// Whether the node's log holds a refusal of `source` naming `reason` ([`refusals_logged`]).
pub fn refusal_logged(node: &Node, source: &str, reason: &[&str]) -> bool {
    refusals_logged(node, source, reason) > 0
}
