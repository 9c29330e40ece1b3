//! The node installer as its DaemonSet's pod runs it: the container's command, arguments and
//! readiness probe taken from the chart's rendering (runtime-class/chart/gpu-ckpt, Helm's own
//! engine), run with busybox's sh against a scratch node root, the real
//! gpu-ckpt-node-installer, and a stand-in for the API server (node_installer's `FakeApi`).
//!
//! - The GPU labels come from the node's driver root: the simulated driver's NVML library in a
//!   scratch driver root (`nodeInstaller.driverRoot`) at a directory only that root's
//!   `/etc/ld.so.cache` names (made by ldconfig), the simulator serving its GPUs.
//! - The readiness probe fails before the install, passes after it, fails while containerd's
//!   configuration has lost the imports.
//! - A pod stopped while its DaemonSet has a newer template (a rolling update) leaves the node
//!   installed, and the next pod, with the same payload, changes and restarts nothing; a
//!   DaemonSet with a deletionTimestamp, gone (404), or with this pod's own template (the node
//!   no longer selected), and the stopped pod uninstalls.
//! - The watch: config.toml rewritten without the imports while the pod waits gets them back,
//!   with one restart of containerd; rewritten again within minRestartIntervalSeconds, they are
//!   put back and the restart waits, reported in the log and by the probe.
//! - The uninstall action's probe passes only once nothing of gpu-ckpt is left on the node.
//! - A node with /dev/nvidia* and no driver answering gets no GPU labels, and the log says why.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use simgpu::testing::SimConfig;

use crate::common::gpu::sim_node;
use crate::k8s_manifests::{
    installer_container, is_installer_daemonset, path_str, render, strings, stub_payload,
    valid_documents, workspace_bin,
};
use crate::node_installer::FakeApi;

const NODE: &str = "node-a";
const RELEASE: [&str; 4] = ["--release", "gpu-ckpt", "--namespace", "gpu-ckpt-system"];
const DAEMONSET_PATH: &str =
    "/apis/apps/v1/namespaces/gpu-ckpt-system/daemonsets/gpu-ckpt-node-installer";

/// A scratch node: its root, a payload, the restart command's record.
struct Scratch {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    root: PathBuf,
    payload: PathBuf,
    restarts: PathBuf,
    ready: PathBuf,
    original_config: String,
}

impl Scratch {
    fn new() -> Result<Scratch> {
        let tmp = tempfile::tempdir()?;
        let dir = tmp.path().to_path_buf();
        let root = dir.join("node");
        for d in ["etc/containerd", "usr/local/bin", "var/lib", "dev"] {
            fs::create_dir_all(root.join(d))?;
        }
        let original_config = "# the node's own configuration\nversion = 3\n\n\
             [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]\n  \
             runtime_type = 'io.containerd.runc.v2'\n"
            .to_string();
        fs::write(root.join("etc/containerd/config.toml"), &original_config)?;
        let payload = dir.join("payload");
        stub_payload(&payload)?;
        Ok(Scratch {
            restarts: dir.join("restarts.log"),
            ready: dir.join("pod/run/ready"),
            _tmp: tmp,
            dir,
            root,
            payload,
            original_config,
        })
    }

    /// The chart rendered for this node, with `extra` node-installer values.
    fn render(&self, extra: Value) -> Result<Value> {
        let mut ni = json!({
            "payloadDir": path_str(&self.payload),
            "restartCommand": format!("echo restarted >> {}", self.restarts.display()),
            "readyFile": path_str(&self.ready),
        });
        for (k, v) in extra.as_object().context("extra values")? {
            ni[k] = v.clone();
        }
        let set = json!({"paths": {"hostRoot": path_str(&self.root)}, "nodeInstaller": ni});
        let mut args = RELEASE.to_vec();
        let set = set.to_string();
        args.extend(["--set-json", &set]);
        render(&args)
    }

    fn restarts(&self) -> usize {
        fs::read_to_string(&self.restarts)
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    fn config(&self) -> Result<String> {
        Ok(fs::read_to_string(
            self.root.join("etc/containerd/config.toml"),
        )?)
    }

    /// The drop-ins are there and containerd's configuration imports them.
    fn installed(&self) -> Result<bool> {
        let config = self.config()?;
        Ok(["gpu-ckpt.toml", "gpu-ckpt-restore.toml"].iter().all(|d| {
            self.root.join("etc/containerd/conf.d").join(d).is_file()
                && config.contains(&format!("/etc/containerd/conf.d/{d}"))
        }) && self
            .root
            .join("usr/local/bin/containerd-shim-gpu-ckpt-v1")
            .is_file())
    }

    /// Nothing of gpu-ckpt is left, and containerd's configuration has its bytes back.
    fn uninstalled(&self) -> Result<()> {
        ensure!(
            self.config()? == self.original_config,
            "config.toml: {}",
            self.config()?
        );
        ensure!(!self.root.join("etc/containerd/conf.d").exists());
        ensure!(!self.root.join("usr/local/bin/gpu-ckpt").exists());
        ensure!(!self.root.join("var/lib/gpu-ckpt").exists());
        Ok(())
    }
}

/// The installer pod's container, run as the kubelet runs it from the rendering: busybox's sh
/// with the command and the arguments (`$(NODE_NAME)` expanded), the pod's environment (the
/// API server's address when `api` is given) and the service account directory.
struct Pod {
    child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
}

fn bin_dir() -> Result<PathBuf> {
    workspace_bin("gpu-ckpt-node-installer")
}

fn path_env() -> Result<String> {
    Ok(format!(
        "{}:/usr/sbin:/usr/bin:/sbin:/bin",
        bin_dir()?.display()
    ))
}

fn daemonset(rendered: &Value) -> Result<Value> {
    valid_documents(rendered)?
        .into_iter()
        .find(is_installer_daemonset)
        .context("no DaemonSet")
}

impl Pod {
    fn start(
        s: &Scratch,
        rendered: &Value,
        name: &str,
        generation: u64,
        api: Option<&FakeApi>,
        env: &[(&str, String)],
    ) -> Result<Pod> {
        use std::os::unix::process::CommandExt;
        ensure!(
            Path::new("/bin/busybox").is_file(),
            "/bin/busybox is missing: run `make deps` (busybox-static)"
        );
        let ds = daemonset(rendered)?;
        let c = installer_container(&ds)?;
        let command = strings(&c["command"]);
        ensure!(command.first().map(String::as_str) == Some("/bin/sh"));
        let mut args: Vec<String> = strings(&c["args"])
            .into_iter()
            .map(|a| a.replace("$(NODE_NAME)", NODE))
            .collect();
        let stdout = s.dir.join(format!("{name}.stdout"));
        let stderr = s.dir.join(format!("{name}.stderr"));
        let mut cmd = Command::new("/bin/busybox");
        cmd.arg("sh")
            .args(&command[1..])
            .env_clear()
            .env("PATH", path_env()?)
            .env("NODE_NAME", NODE);
        if let Some(api) = api {
            args.extend([
                "--service-account-dir".to_string(),
                path_str(api.sa_dir()).to_string(),
            ]);
            cmd.envs(api.env());
        }
        // The container's environment as the kubelet fills it in: the downward API's node name
        // and this pod's label pod-template-generation (`generation`).
        for e in c["env"].as_array().into_iter().flatten() {
            let var = e["name"].as_str().context("an env entry without a name")?;
            let value = match (
                e["value"].as_str(),
                e["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
            ) {
                (Some(v), _) => v.to_string(),
                (None, Some("spec.nodeName")) => NODE.to_string(),
                (None, Some("metadata.labels['pod-template-generation']")) => {
                    generation.to_string()
                }
                _ => bail!("the container's env {e}: not one this test fills in"),
            };
            cmd.env(var, value);
        }
        cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
        let child = cmd
            .args(&args)
            .stdout(fs::File::create(&stdout)?)
            .stderr(fs::File::create(&stderr)?)
            .process_group(0)
            .spawn()?;
        let mut pod = Pod {
            child,
            stdout,
            stderr,
        };
        pod.wait_for(&format!("done on node {NODE}; waiting"))?;
        Ok(pod)
    }

    fn stdout(&self) -> String {
        fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    fn stderr(&self) -> String {
        fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Waits until the pod's output has `what`.
    fn wait_for(&mut self, what: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.stdout().contains(what) {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "the pod exited ({status}) before it printed {what:?}; stdout:\n{}\nstderr:\n{}",
                    self.stdout(),
                    self.stderr()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "the pod did not print {what:?} in 60 s; stdout:\n{}\nstderr:\n{}",
                    self.stdout(),
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// The installer's summary lines (JSON) so far.
    fn summaries(&self) -> Vec<Value> {
        self.stdout()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// SIGTERM, as the kubelet stops the container; its exit status.
    fn stop(mut self) -> Result<i32> {
        use nix::sys::signal::{kill, killpg, Signal};
        use nix::unistd::Pid;
        let pid = Pid::from_raw(i32::try_from(self.child.id())?);
        kill(pid, Signal::SIGTERM)?;
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = self.child.try_wait()? {
                break s;
            }
            if Instant::now() > deadline {
                let _ = killpg(pid, Signal::SIGKILL);
                bail!("the pod did not stop in 60 s; stderr:\n{}", self.stderr());
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        // The shell's `sleep` is left over once it exited.
        let _ = killpg(pid, Signal::SIGKILL);
        Ok(status.code().unwrap_or(-1))
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = self.child.wait();
    }
}

/// Runs the DaemonSet's readiness probe (its exec command, as rendered); whether it passed,
/// and its output.
fn probe(rendered: &Value) -> Result<(bool, String)> {
    let ds = daemonset(rendered)?;
    let c = installer_container(&ds)?;
    let cmd = strings(&c["readinessProbe"]["exec"]["command"]);
    ensure!(!cmd.is_empty(), "no readiness probe: {c}");
    let out = Command::new(bin_dir()?.join(&cmd[0]))
        .args(&cmd[1..])
        .env_clear()
        .env("PATH", path_env()?)
        .output()?;
    Ok(passed(&out))
}

/// The label patches the API server received, as maps of labels.
fn label_patches(api: &FakeApi) -> Vec<serde_json::Map<String, Value>> {
    api.requests()
        .iter()
        .filter(|r| r.line.starts_with(&format!("PATCH /api/v1/nodes/{NODE} ")))
        .filter_map(|r| r.body["metadata"]["labels"].as_object().cloned())
        .collect()
}

/// The installer's DaemonSet as the API server answers a GET, with `metadata` added to its
/// metadata (a generation, a deletionTimestamp).
fn daemonset_object(metadata: Value) -> Value {
    let mut ds = json!({
        "kind": "DaemonSet", "apiVersion": "apps/v1",
        "metadata": {"name": "gpu-ckpt-node-installer", "namespace": "gpu-ckpt-system"},
    });
    if let (Some(m), Some(extra)) = (ds["metadata"].as_object_mut(), metadata.as_object()) {
        m.extend(extra.clone());
    }
    ds
}

/// Stops `pod`, which asks for its DaemonSet (the `gets`th GET) and uninstalls: nothing of
/// gpu-ckpt is left, and containerd was restarted `restarts` times in all.
fn stop_uninstalls(
    pod: Pod,
    s: &Scratch,
    api: &FakeApi,
    gets: usize,
    restarts: usize,
) -> Result<()> {
    let code = pod.stop()?;
    ensure!(code == 0, "the stopped pod exited {code}");
    ensure!(daemonset_gets(api) == gets, "{:#?}", api.requests());
    s.uninstalled()?;
    ensure!(s.restarts() == restarts, "restarts: {}", s.restarts());
    Ok(())
}

fn daemonset_gets(api: &FakeApi) -> usize {
    api.requests()
        .iter()
        .filter(|r| {
            r.line == format!("GET {DAEMONSET_PATH} HTTP/1.1")
                && r.authorization == format!("Bearer {}", api.token)
        })
        .count()
}

#[test]
fn the_pod_labels_the_simulators_gpus_through_the_driver_root_and_an_upgrade_restarts_nothing(
) -> Result<()> {
    let s = Scratch::new()?;
    let sim = sim_node(SimConfig {
        gpus: 2,
        model: "NVIDIA A100-SXM4-40GB".into(),
        memory_mib: 256,
        driver_version: "570.86.15".into(),
        cuda_version: 12080,
        uuid_seed: "installer-pod".into(),
        ..SimConfig::default()
    })?;
    // The GPU operator's driver root, its NVML at a directory only its loader cache names.
    let driver = s.root.join("run/nvidia/driver");
    fs::create_dir_all(driver.join("opt/nvidia/lib64"))?;
    fs::create_dir_all(driver.join("etc"))?;
    fs::copy(
        sim.libnvml(),
        driver.join("opt/nvidia/lib64/libnvidia-ml.so.1"),
    )?;
    fs::write(driver.join("etc/ld.so.conf"), "/opt/nvidia/lib64\n")?;
    let out = Command::new("ldconfig").arg("-r").arg(&driver).output()?;
    ensure!(
        out.status.success() && driver.join("etc/ld.so.cache").is_file(),
        "ldconfig -r: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The node's own device nodes: a driver that does not answer would be "unknown".
    fs::write(s.root.join("dev/nvidiactl"), "")?;
    let api = FakeApi::start(&s.dir.join("api"))?;
    let rendered = s.render(json!({"driverRoot": "/run/nvidia/driver"}))?;
    // The simulated driver's socket, as its device nodes are for a real one.
    let sim_env = [("GPU_CKPT_SIM_SOCKET", sim.socket().display().to_string())];

    // Not ready before the install.
    let (ready, said) = probe(&rendered)?;
    ensure!(!ready, "ready before the install: {said}");
    ensure!(said.contains("no ready marker"), "{said}");

    let pod = Pod::start(&s, &rendered, "pod1", 1, Some(&api), &sim_env)?;
    let patches = label_patches(&api);
    ensure!(patches.len() == 1, "{patches:?}\n{}", pod.stderr());
    let want = json!({
        "node-restriction.kubernetes.io/gpu-ckpt-runtime": "installed",
        "node-restriction.kubernetes.io/gpu-ckpt-gpu-model": "NVIDIA-A100-SXM4-40GB",
        "node-restriction.kubernetes.io/gpu-ckpt-driver-version": "570.86.15",
        "node-restriction.kubernetes.io/gpu-ckpt-cuda-version": "12.8",
    });
    ensure!(
        Value::Object(patches[0].clone()) == want,
        "labels {:?}; the installer's log:\n{}",
        patches[0],
        pod.stderr()
    );
    ensure!(s.installed()?, "not installed: {}", s.config()?);
    ensure!(s.restarts() == 1, "restarts: {}", s.restarts());
    let (ready, said) = probe(&rendered)?;
    ensure!(ready, "not ready after the install: {said}");

    // Readiness follows the node: containerd's configuration without the imports is not ready.
    let installed_config = s.config()?;
    fs::write(
        s.root.join("etc/containerd/config.toml"),
        &s.original_config,
    )?;
    let (ready, said) = probe(&rendered)?;
    ensure!(
        !ready && said.contains("does not import /etc/containerd/conf.d/gpu-ckpt.toml"),
        "ready without the imports: {said}"
    );
    fs::write(s.root.join("etc/containerd/config.toml"), &installed_config)?;
    ensure!(probe(&rendered)?.0, "not ready with the imports back");

    // A rolling update: the DaemonSet has a newer template (generation 2) than the pod's (1).
    // The stop leaves the node installed.
    fs::write(&s.restarts, "")?;
    api.set_daemonset(Some(daemonset_object(json!({"generation": 2}))));
    let code = pod.stop()?;
    ensure!(code == 0, "the stopped pod exited {code}");
    ensure!(daemonset_gets(&api) == 1, "{:#?}", api.requests());
    ensure!(
        s.installed()?,
        "the update's stop uninstalled: {}",
        s.config()?
    );
    ensure!(label_patches(&api).len() == 1, "the labels were touched");
    ensure!(!s.ready.exists(), "the stopped pod left its ready marker");

    // The new pod, with the same payload: nothing changes, containerd is not restarted.
    let pod = Pod::start(&s, &rendered, "pod2", 2, Some(&api), &sim_env)?;
    let summary = pod.summaries().first().cloned().unwrap_or_default();
    ensure!(
        summary["action"] == "install"
            && summary["files_changed"] == json!([])
            && summary["config_changed"] == false
            && summary["restarted"] == false,
        "the second pod's install: {summary}"
    );
    ensure!(
        fs::read_to_string(&s.restarts)?.is_empty(),
        "the upgrade restarted containerd"
    );
    ensure!(probe(&rendered)?.0, "the new pod is not ready");

    // helm uninstall with foreground deletion: the DaemonSet has a deletionTimestamp.
    api.set_daemonset(Some(daemonset_object(
        json!({"deletionTimestamp": "2026-12-05T18:00:00Z"}),
    )));
    stop_uninstalls(pod, &s, &api, 2, 1)?;
    let last = label_patches(&api).pop().unwrap_or_default();
    ensure!(
        last.len() == 4 && last.values().all(Value::is_null),
        "the labels were not removed: {last:?}"
    );
    ensure!(!probe(&rendered)?.0, "ready after the uninstall");

    // kubectl delete (background): the DaemonSet is gone (404).
    let pod = Pod::start(&s, &rendered, "pod3", 2, Some(&api), &sim_env)?;
    ensure!(s.installed()? && s.restarts() == 2);
    api.set_daemonset(None);
    stop_uninstalls(pod, &s, &api, 3, 3)?;

    // The DaemonSet exists with this pod's template (generation 2): the pod stopped because the
    // node no longer matches it (a node label, its nodeSelector), and no pod will manage the
    // node any more. It uninstalls, labels included.
    let pod = Pod::start(&s, &rendered, "pod4", 2, Some(&api), &sim_env)?;
    ensure!(s.installed()? && s.restarts() == 4);
    api.set_daemonset(Some(daemonset_object(json!({"generation": 2}))));
    stop_uninstalls(pod, &s, &api, 4, 5)?;
    let last = label_patches(&api).pop().unwrap_or_default();
    ensure!(
        last.values().all(Value::is_null)
            && last.contains_key("node-restriction.kubernetes.io/gpu-ckpt-runtime"),
        "the labels were not removed: {last:?}"
    );
    Ok(())
}

#[test]
fn the_uninstall_action_is_ready_only_once_the_node_is_uninstalled() -> Result<()> {
    let s = Scratch::new()?;
    let api = FakeApi::start(&s.dir.join("api"))?;
    let rendered = s.render(json!({}))?;
    // Installed by an install pod, left so by a rolling update (a newer template).
    let pod = Pod::start(&s, &rendered, "install", 1, Some(&api), &[])?;
    ensure!(s.installed()?, "not installed: {}", s.config()?);
    api.set_daemonset(Some(daemonset_object(json!({"generation": 2}))));
    ensure!(pod.stop()? == 0);
    ensure!(s.installed()?, "the update's stop uninstalled");

    // `helm upgrade --set nodeInstaller.action=uninstall`: its probe fails until the
    // uninstall finished, so that `kubectl rollout status` waits for it.
    let rendered = s.render(json!({"action": "uninstall"}))?;
    let (ready, said) = probe(&rendered)?;
    ensure!(
        !ready,
        "the uninstall action is ready before its uninstall: {said}"
    );
    ensure!(
        said.contains("still installed") && said.contains("still imports"),
        "{said}"
    );
    let pod = Pod::start(&s, &rendered, "uninstall", 2, Some(&api), &[])?;
    s.uninstalled()?;
    let (ready, said) = probe(&rendered)?;
    ensure!(ready, "not ready after the uninstall: {said}");
    // Readiness follows the node: gpu-ckpt put back (another install) is not uninstalled.
    let install = s.render(json!({}))?;
    let again = Pod::start(&s, &install, "again", 2, Some(&api), &[])?;
    drop(again);
    let (ready, said) = probe(&rendered)?;
    ensure!(
        !ready && said.contains("still"),
        "ready while installed: {said}"
    );
    drop(pod);
    Ok(())
}

#[test]
fn the_watch_puts_back_the_imports_another_agent_removed_and_unknown_gpus_get_no_labels(
) -> Result<()> {
    let s = Scratch::new()?;
    // Device nodes of an NVIDIA driver, but none in the driver root: the GPUs are unknown.
    fs::write(s.root.join("dev/nvidia0"), "")?;
    fs::write(s.root.join("dev/nvidiactl"), "")?;
    let api = FakeApi::start(&s.dir.join("api"))?;
    let rendered = s.render(json!({"checkIntervalSeconds": 1}))?;
    let mut pod = Pod::start(&s, &rendered, "pod", 1, Some(&api), &[])?;
    let patches = label_patches(&api);
    ensure!(
        patches.len() == 1
            && Value::Object(patches[0].clone())
                == json!({"node-restriction.kubernetes.io/gpu-ckpt-runtime": "installed"}),
        "{patches:?}"
    );
    let log = pod.stderr();
    ensure!(
        log.contains("the node's GPUs are unknown")
            && log.contains("the node has /dev/nvidia0, /dev/nvidiactl, but no libnvidia-ml.so.1 under the driver root /"),
        "the log does not say why the GPUs are unknown:\n{log}"
    );
    ensure!(s.installed()? && s.restarts() == 1);

    // Another agent rewrites config.toml without the imports (as the GPU operator's toolkit
    // does): the watch adds them back and restarts containerd once.
    fs::write(
        s.root.join("etc/containerd/config.toml"),
        &s.original_config,
    )?;
    pod.wait_for(r#""action":"repair""#)?;
    ensure!(s.installed()?, "the imports are not back: {}", s.config()?);
    ensure!(s.restarts() == 2, "restarts: {}", s.restarts());
    let repair = pod
        .summaries()
        .into_iter()
        .find(|v| v["action"] == "repair")
        .context("no repair summary")?;
    ensure!(
        repair["restarted"] == true
            && repair["found"].as_array().is_some_and(|f| f
                .iter()
                .any(|x| x.as_str().is_some_and(|x| x.contains("does not import")))),
        "{repair}"
    );
    // The next checks find nothing to do.
    std::thread::sleep(Duration::from_secs(3));
    ensure!(s.restarts() == 2, "restarts: {}", s.restarts());
    ensure!(
        pod.summaries()
            .iter()
            .filter(|v| v["action"] == "repair")
            .count()
            == 1,
        "{}",
        pod.stdout()
    );
    ensure!(probe(&rendered)?.0, "not ready after the repair");

    // The agent does it again within minRestartIntervalSeconds (300): the imports are put
    // back, the restart waits, and the log and the probe say so.
    fs::write(
        s.root.join("etc/containerd/config.toml"),
        &s.original_config,
    )?;
    pod.wait_for("restart_deferred")?;
    ensure!(s.installed()?, "the imports are not back: {}", s.config()?);
    ensure!(s.restarts() == 2, "restarts: {}", s.restarts());
    let deferred = pod
        .summaries()
        .into_iter()
        .find(|v| v.get("restart_deferred").is_some())
        .context("no deferred restart")?;
    ensure!(
        deferred["restarted"] == false
            && deferred["restart_deferred"]
                .as_str()
                .is_some_and(|w| w.contains("the least interval between restarts is 300 s")),
        "{deferred}"
    );
    let (ready, said) = probe(&rendered)?;
    ensure!(
        !ready && said.contains("containerd has not been restarted"),
        "ready with a restart pending: {said}"
    );

    // The DaemonSet is gone: uninstall.
    api.set_daemonset(None);
    ensure!(pod.stop()? == 0);
    s.uninstalled()?;
    ensure!(s.restarts() == 3, "restarts: {}", s.restarts());
    Ok(())
}

/// Whether a probe's run passed, and what it printed (stdout, then stderr).
pub(crate) fn passed(out: &std::process::Output) -> (bool, String) {
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}
