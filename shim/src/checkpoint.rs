//! Checkpoint and restore: which CRIU options to use, and the files the shim keeps beside
//! runc's (the per-container CRIU configuration file and the failure logs).
//!
//! The operations that call these steps, with their undo, are the container's checkpoint
//! (`container/checkpoint.rs`) and restore (`container/restore.rs`).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use containerd_shim::protos::{
    protobuf::{well_known_types::any::Any, Message},
    shim::oci::CheckpointOptions,
};
use image_format::{
    digest::PageDigests,
    durable::Durability,
    manifest::{CriuOptions, Manifest},
};
use procfs::net::{DeviceStatus, TcpNetEntry, TcpState};

use crate::{
    annotations::{self, Annotations},
    bundle::Bundle,
    criu_exit::CriuExit,
    error::{Error, Result},
    options::RuntimeOptions,
};

const CHECKPOINT_OPTIONS_TYPE: &str = "containerd.runc.v1.CheckpointOptions";
/// The annotation runc reads to find a CRIU configuration file for the container.
pub const CRIU_CONFIG_ANNOTATION: &str = "org.criu.config";
/// The shim's CRIU configuration file in the bundle, named by [`CRIU_CONFIG_ANNOTATION`].
pub const CRIU_CONF_FILE: &str = "gpu-ckpt-criu.conf";
/// The directory containerd's CRI archives, below the container's CRI directory
/// ([`cri_container_dir`]).
pub const CRI_CHECKPOINT_DIR: &str = "ctrd-checkpoint";
/// Where a failed dump's or restore's CRIU log is kept, as containerd's runc shim does.
pub const DUMP_LOG_COPY: &str = "criu-dump.log";
pub const RESTORE_LOG_COPY: &str = "criu-restore.log";

/// What one checkpoint will do.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointPlan {
    pub image_path: PathBuf,
    /// CRIU's work directory; `None` for the default `<bundle>/criu-work`, removed afterwards.
    pub work_path: Option<PathBuf>,
    pub criu: CriuOptions,
    /// The digests the manifest records for CRIU's page images (runtime option
    /// `Sha256PageImages`).
    pub page_digests: PageDigests,
    /// Whether the manifest step syncs the checkpoint (`Sync` for a directory the caller named,
    /// with the runtime option `SyncCheckpoint` on; `None` for containerd's temporary directory,
    /// which containerd copies into its content store and removes).
    pub durability: Durability,
    /// Resume a paused task as soon as the dump and the signed copy of its rootfs changes are
    /// done, in a leave-running checkpoint (runtime option `ResumeAfterDump`, annotation
    /// `gpu-ckpt.io/resume-after-dump` over it).
    pub resume_after_dump: bool,
}

/// The manifest's step timing of a resume right after the dump ([`CheckpointPlan::
/// resume_after_dump`]): how long the thaw and the device resume took. A checkpoint that has
/// it was resumed before containerd took its copy and rootfs diff.
pub const RESUME_AFTER_DUMP_STEP: &str = "resume-after-dump";

/// Refuses containerd's own restore (`ctr container restore`, CRI's restore-via-create) of a
/// checkpoint whose container was resumed right after the dump: containerd lays its
/// rootfs-diff.tar over the rootfs, taken after the resume, so it can hold files the
/// checkpointed processes never saw.
pub fn refuse_containerd_restore(manifest: &Manifest, source: &str) -> Result<()> {
    if !manifest
        .timings
        .iter()
        .any(|t| t.step == RESUME_AFTER_DUMP_STEP)
    {
        return Ok(());
    }
    Err(Error::FailedPrecondition(format!(
        "restore of checkpoint {source} refused: its container was resumed right after the dump (resume-after-dump), so containerd's rootfs-diff.tar was taken while it ran on and may hold later changes; restore it through the restore handler (gpu-ckpt-restore), which applies the signed copy of the rootfs changes of the dump's moment, or checkpoint with resume-after-dump off"
    )))
}

impl CheckpointPlan {
    /// Layers the sources of checkpoint options: the runtime options' defaults, the pod's
    /// annotations over them, and a caller's `containerd.runc.v1.CheckpointOptions` (ctr, the
    /// containerd API) over both. CRI sends no options: the container keeps running.
    pub fn resolve(
        path: &str,
        options: Option<&Any>,
        runtime: &RuntimeOptions,
        ann: &Annotations,
        terminal: bool,
    ) -> Result<Self> {
        if path.is_empty() {
            return Err(Error::InvalidArgument("checkpoint path is empty".into()));
        }
        let mut criu = CriuOptions {
            leave_running: true,
            tcp: runtime.tcp_mode.clone(),
            external_unix_sockets: runtime.external_unix_sockets,
            shell_job: terminal,
            file_locks: runtime.file_locks,
            cgroups_mode: runtime.cgroups_mode.clone(),
            empty_namespaces: Vec::new(),
        };
        if let Some(tcp) = ann.get(annotations::TCP) {
            criu.tcp = tcp.to_string();
        }
        if let Some(v) = ann.flag(annotations::FILE_LOCKS)? {
            criu.file_locks = v;
        }
        if let Some(v) = ann.flag(annotations::EXT_UNIX_SK)? {
            criu.external_unix_sockets = v;
        }
        let mut image_path = PathBuf::from(path);
        let mut work_path = None;
        let mut caller_named = false;
        if let Some(any) = options.filter(|a| !a.type_url.is_empty() || !a.value.is_empty()) {
            let name = any.type_url.rsplit('/').next().unwrap_or_default();
            if name != CHECKPOINT_OPTIONS_TYPE {
                return Err(Error::InvalidArgument(format!(
                    "unsupported checkpoint options type {name:?}: expected {CHECKPOINT_OPTIONS_TYPE}"
                )));
            }
            let o = CheckpointOptions::parse_from_bytes(&any.value)?;
            criu.leave_running = !o.exit;
            if o.open_tcp {
                criu.tcp = "established".into();
            }
            criu.external_unix_sockets |= o.external_unix_sockets;
            criu.shell_job |= o.terminal;
            criu.file_locks |= o.file_locks;
            criu.empty_namespaces = o.empty_namespaces;
            if !o.cgroups_mode.is_empty() {
                criu.cgroups_mode = o.cgroups_mode;
            }
            if !o.image_path.is_empty() {
                image_path = PathBuf::from(o.image_path);
                caller_named = true;
            }
            if !o.work_path.is_empty() {
                work_path = Some(PathBuf::from(o.work_path));
            }
        }
        // The pod may turn it off; on only where the handler lets pods choose.
        let resume_after_dump = match ann.flag(annotations::RESUME_AFTER_DUMP)? {
            Some(true) if !runtime.pod_resume_after_dump => {
                if !runtime.resume_after_dump {
                    tracing::warn!(
                        "annotation {} ignored: the handler does not let pods turn it on (PodResumeAfterDump)",
                        annotations::RESUME_AFTER_DUMP
                    );
                }
                runtime.resume_after_dump
            }
            Some(on) => on,
            None => runtime.resume_after_dump,
        } && criu.leave_running;
        let page_digests = if runtime.sha256_page_images {
            PageDigests::Sha256AndBlake3
        } else {
            PageDigests::Blake3
        };
        Ok(Self {
            image_path,
            work_path,
            criu,
            page_digests,
            durability: Durability::from_flag(caller_named && runtime.sync_checkpoint()),
            resume_after_dump,
        })
    }

    /// `runc checkpoint` flags after the image and work paths.
    pub fn runc_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if self.criu.leave_running {
            args.push("--leave-running".into());
        }
        args.extend(common_args(&self.criu, false));
        for ns in &self.criu.empty_namespaces {
            args.push("--empty-ns".into());
            args.push(ns.clone());
        }
        args
    }
}

/// Flags runc's checkpoint and restore share. With `tcp_close` a restore does not try to bring
/// back established connections (a new address): the CRIU configuration file says so.
fn common_args(criu: &CriuOptions, tcp_close: bool) -> Vec<String> {
    let mut args = Vec::new();
    if criu.tcp == "established" && !tcp_close {
        args.push("--tcp-established".into());
    }
    if criu.external_unix_sockets {
        args.push("--ext-unix-sk".into());
    }
    if criu.shell_job {
        args.push("--shell-job".into());
    }
    if criu.file_locks {
        args.push("--file-locks".into());
    }
    if !criu.cgroups_mode.is_empty() {
        args.push("--manage-cgroups-mode".into());
        args.push(criu.cgroups_mode.clone());
    }
    args
}

/// `runc restore` flags that match how the checkpoint was dumped.
pub fn restore_args(criu: &CriuOptions, tcp_close: bool) -> Vec<String> {
    common_args(criu, tcp_close)
}

/// The container's CRIU configuration file, which runc hands CRIU (`org.criu.config`) for
/// what runc has no flag for. Every such file names [`crate::criu::no_plugins_dir`] as CRIU's
/// plugin directory (`libdir`); the default value adds nothing else.
#[derive(Debug, Default)]
pub struct CriuConf<'a> {
    /// `tcp-close`: connections are closed rather than dumped or restored.
    pub tcp_close: bool,
    /// `network-lock skip` (a dump; a restore follows what its dump recorded): see
    /// [`nothing_to_lock`].
    pub skip_network_lock: bool,
    /// A restore's [`crate::verify_gate::VerifyGate`] script.
    pub action_script: Option<&'a Path>,
    /// `ext-mount-map <from>:<to>` lines, beside the spec mounts runc maps itself: at a dump
    /// a sub-mount's mountpoint and its key, at a restore the key and its host path
    /// (`sub_mounts.rs`).
    pub ext_mount_map: &'a [(String, String)],
}

impl CriuConf<'_> {
    pub fn write(&self, bundle: &Path) -> Result<()> {
        let path = bundle.join(CRIU_CONF_FILE);
        let body = self.body(crate::criu::no_plugins_dir()?)?;
        std::fs::write(&path, body).map_err(Error::io(format!("write {}", path.display())))
    }

    /// The file's text, with `plugins` as CRIU's plugin directory.
    fn body(&self, plugins: &Path) -> Result<String> {
        let mut body = format!("libdir {}\n", plugins.display());
        if self.tcp_close {
            body.push_str("tcp-close\n");
        }
        if self.skip_network_lock {
            body.push_str("network-lock skip\n");
        }
        if let Some(script) = self.action_script {
            let script = script.display().to_string();
            if script.contains(['"', '\\', '\n']) {
                return Err(Error::InvalidArgument(format!(
                    "bundle path {script:?} cannot be written into a CRIU configuration file"
                )));
            }
            body.push_str(&format!("action-script \"{script}\"\n"));
        }
        for (from, to) in self.ext_mount_map {
            // CRIU splits the value at its first ':', cuts a line at any '#', and (4.2's
            // parser) mangles values with white space even when quoted: such paths are refused.
            if from.contains(':')
                || [from, to].iter().any(|s| {
                    s.is_empty() || s.contains(['"', '\\', '#']) || s.contains(char::is_whitespace)
                })
            {
                return Err(Error::InvalidArgument(format!(
                    "external mount {from:?} -> {to:?} cannot be written into a CRIU configuration file"
                )));
            }
            body.push_str(&format!("ext-mount-map {from}:{to}\n"));
        }
        Ok(body)
    }
}

/// Whether the network namespace of process `pid` gives CRIU's network lock nothing to hold:
/// no interface but loopback (nothing from outside can reach it) and no TCP socket but
/// listening ones (no conversation to keep still). Anything unreadable counts as something.
pub fn nothing_to_lock(pid: i32) -> bool {
    let Ok(p) = procfs::process::Process::new(pid) else {
        return false;
    };
    match (p.dev_status(), p.tcp(), p.tcp6()) {
        (Ok(dev), Ok(tcp), Ok(tcp6)) => {
            only_loopback(&dev) && only_listeners(&tcp) && only_listeners(&tcp6)
        }
        _ => false,
    }
}

/// `/proc/<pid>/net/dev`: every interface is `lo`.
fn only_loopback(net_dev: &HashMap<String, DeviceStatus>) -> bool {
    net_dev.keys().all(|name| name == "lo")
}

/// `/proc/<pid>/net/tcp` or `tcp6`: every socket is in state LISTEN.
fn only_listeners(net_tcp: &[TcpNetEntry]) -> bool {
    net_tcp.iter().all(|s| s.state == TcpState::Listen)
}

/// Points runc at the shim's CRIU configuration file through `org.criu.config` in the bundle's
/// config.json, unless the user set that annotation already. Edits the JSON as a tree so that
/// nothing of the spec is lost. Must run before `runc create` or `runc restore`. Returns whether
/// runc will read the shim's file (false: the spec names another one).
pub fn point_runc_at_criu_conf(bundle: &mut Bundle) -> Result<bool> {
    let path = bundle.config_path();
    let mut spec = bundle.json().clone();
    let Some(obj) = spec.as_object_mut() else {
        return Err(Error::InvalidArgument(format!(
            "malformed bundle config {}: not an object",
            path.display()
        )));
    };
    let annotations = obj
        .entry("annotations")
        .or_insert_with(|| serde_json::Value::Object(Default::default()));
    let Some(annotations) = annotations.as_object_mut() else {
        return Err(Error::InvalidArgument(format!(
            "malformed bundle config {}: annotations is not an object",
            path.display()
        )));
    };
    let ours = bundle.join(CRIU_CONF_FILE).display().to_string();
    if let Some(named) = annotations.get(CRIU_CONFIG_ANNOTATION) {
        return Ok(named.as_str() == Some(ours.as_str()));
    }
    annotations.insert(CRIU_CONFIG_ANNOTATION.into(), ours.into());
    bundle.rewrite(spec)?;
    Ok(true)
}

/// What an error message should carry of a CRIU log: its error lines (the cause is usually the
/// first of them, well before the end of the log) and its last `tail` lines.
/// The error of a failed `runc checkpoint` or `runc restore` (`runc_error`), with CRIU's log:
/// `log` as CRIU wrote it, `kept` where the shim keeps a copy. When runc lost its connection
/// to CRIU (end of file on the RPC socket) and CRIU's log ends without CRIU's own failure, CRIU
/// died (a crash, a kill, an early exit): the message says so first, with the log's last line,
/// rather than runc's bare `read unixpacket …: EOF`.
pub fn criu_failure(runc_error: &str, log: &Path, kept: &Path, ended: &[CriuExit]) -> String {
    let tail = log_summary(log, 8);
    let text = std::fs::read(log)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let last = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    let lost = ["EOF", "unixpacket", "connection reset", "broken pipe"]
        .iter()
        .any(|p| runc_error.contains(p));
    if let Some(why) = crate::criu::known_limit(crate::criu::found(), &text) {
        return format!("{why}; CRIU log {}:\n{tail}", kept.display());
    }
    let failed_itself = last.contains("FAILED") || last.contains("Error (");
    if lost && !failed_itself {
        let last = if last.is_empty() {
            "(the log is empty)".to_string()
        } else {
            format!("{:?}", last.trim())
        };
        let how = ended.last().map_or_else(
            || "its exit status is unknown".to_string(),
            |e| format!("CRIU (pid {}) {}", e.pid, e.describe()),
        );
        return format!(
            "CRIU died before it answered runc: {how} (runc: {runc_error}); its log ends without an error, at {last}; CRIU log {}:\n{tail}",
            kept.display()
        );
    }
    match ended.last() {
        Some(e) if libc::WIFSIGNALED(e.status) => format!(
            "{runc_error}; CRIU (pid {}) {}; CRIU log {}:\n{tail}",
            e.pid,
            e.describe(),
            kept.display()
        ),
        _ => format!("{runc_error}; CRIU log {}:\n{tail}", kept.display()),
    }
}

pub fn log_summary(path: &Path, tail: usize) -> String {
    let text = std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    let start = all.len().saturating_sub(tail);
    let mut out: Vec<&str> = all[..start]
        .iter()
        .copied()
        .filter(|l| l.contains("Error (") || l.contains("Error:"))
        .take(10)
        .collect();
    if !out.is_empty() && start > 0 {
        out.push("...");
    }
    out.extend_from_slice(&all[start..]);
    out.join("\n")
}

/// Where containerd's CRI keeps a container's own files: `<cri root>/containers/<id>`. Its
/// CheckpointContainer archives [`CRI_CHECKPOINT_DIR`] below it (2.1.9, 2.2.5, 2.3.2 and later,
/// which create it afresh just before the runtime's checkpoint), or copies `stats-dump` from the
/// directory itself (2.1.0 to 2.1.8, which fail the checkpoint without it), to the archive's top
/// level, where checkpointctl's `inspect --stats` reads it. containerd names that directory
/// only to runc-typed runtimes, as the checkpoint's work path; for the shim's own type it is
/// found from the spec: CRI mounts the sandbox's `hostname`, `resolv.conf` and `hosts` from
/// `<cri root>/sandboxes/<sandbox id>/`. None outside CRI, or when the directory is not
/// containerd's (no `status` file of its own in it).
pub fn cri_container_dir(
    spec: &oci_spec::runtime::Spec,
    sandbox_id: &str,
    id: &str,
) -> Option<PathBuf> {
    let plain = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if !plain(sandbox_id) || !plain(id) {
        return None;
    }
    let mounts = spec.mounts().as_deref().unwrap_or_default();
    let root = mounts.iter().find_map(|m| {
        let file = match m.destination().to_str()? {
            "/etc/hostname" => "hostname",
            "/etc/resolv.conf" => "resolv.conf",
            "/etc/hosts" => "hosts",
            _ => return None,
        };
        let src = m.source().as_deref()?;
        let sandbox = src.parent()?;
        let sandboxes = sandbox.parent()?;
        let cri_root = sandboxes.parent()?;
        let from_cri = src.file_name()? == file
            && sandbox.file_name()? == sandbox_id
            && sandboxes.file_name()? == "sandboxes"
            && src.is_absolute();
        from_cri.then(|| cri_root.to_path_buf())
    })?;
    let dir = root.join("containers").join(id);
    let is = |p: &Path, dir: bool| {
        std::fs::symlink_metadata(p).is_ok_and(|m| if dir { m.is_dir() } else { m.is_file() })
    };
    (is(&dir, true) && is(&dir.join("status"), false)).then_some(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pod's annotation over the handler's option; `--exit` (no task left to resume)
    /// never resumes; only a manifest with the resume's timing is refused to containerd.
    #[test]
    fn resume_after_dump_comes_from_the_handler_a_pod_turns_it_off_or_on_where_allowed() {
        let ann = |v: Option<&str>| {
            let mut all = HashMap::new();
            if let Some(v) = v {
                all.insert(annotations::RESUME_AFTER_DUMP.to_string(), v.to_string());
            }
            Annotations::from_spec(&all).unwrap()
        };
        let on = RuntimeOptions {
            resume_after_dump: true,
            ..Default::default()
        };
        let off = RuntimeOptions::default();
        let pods = RuntimeOptions {
            pod_resume_after_dump: true,
            ..Default::default()
        };
        let plan = |o: &RuntimeOptions, a: &Annotations, options: Option<&Any>| {
            CheckpointPlan::resolve("/ck", options, o, a, false)
                .unwrap()
                .resume_after_dump
        };
        assert!(!plan(&off, &ann(None), None));
        assert!(plan(&on, &ann(None), None));
        // A pod turns it on only where the handler lets pods choose.
        assert!(!plan(&off, &ann(Some("true")), None));
        assert!(plan(&pods, &ann(Some("true")), None));
        assert!(!plan(&pods, &ann(None), None));
        assert!(!plan(&on, &ann(Some("false")), None));
        let exit = CheckpointOptions {
            exit: true,
            ..Default::default()
        };
        let exit = Any {
            type_url: format!("type.googleapis.com/{CHECKPOINT_OPTIONS_TYPE}"),
            value: exit.write_to_bytes().unwrap(),
            ..Default::default()
        };
        assert!(!plan(&on, &ann(Some("true")), Some(&exit)));

        let mut m = Manifest::new(
            "",
            Default::default(),
            Default::default(),
            Default::default(),
            Default::default(),
        );
        m.add_timing("criu-dump", 10.0);
        assert!(refuse_containerd_restore(&m, "/ck").is_ok());
        m.add_timing(RESUME_AFTER_DUMP_STEP, 5.0);
        let err = refuse_containerd_restore(&m, "/ck")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("resumed right after the dump") && err.contains("gpu-ckpt-restore"),
            "{err}"
        );
    }

    #[test]
    fn the_cri_container_directory_is_found_from_the_sandbox_mounts() {
        let root = tempfile::tempdir().unwrap();
        let cri = root.path().join("io.containerd.grpc.v1.cri");
        let dir = cri.join("containers").join("c1");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::create_dir_all(cri.join("sandboxes").join("s1")).unwrap();
        let spec = |dest: &str, src: &Path| -> oci_spec::runtime::Spec {
            serde_json::from_value(serde_json::json!({
                "ociVersion": "1.0.2",
                "mounts": [{"destination": dest, "source": src, "type": "bind"}]
            }))
            .unwrap()
        };
        let hostname = cri.join("sandboxes/s1/hostname");
        // Without containerd's own status file the directory is not taken for containerd's.
        assert_eq!(
            cri_container_dir(&spec("/etc/hostname", &hostname), "s1", "c1"),
            None
        );
        std::fs::write(dir.join("status"), b"{}").unwrap();
        assert_eq!(
            cri_container_dir(&spec("/etc/hostname", &hostname), "s1", "c1"),
            Some(dir.clone())
        );
        // Another sandbox's file, another file, a hostile id, another destination: no.
        assert_eq!(
            cri_container_dir(&spec("/etc/hostname", &hostname), "s2", "c1"),
            None
        );
        assert_eq!(
            cri_container_dir(
                &spec("/etc/hostname", &cri.join("sandboxes/s1/hosts")),
                "s1",
                "c1"
            ),
            None
        );
        assert_eq!(
            cri_container_dir(&spec("/etc/hostname", &hostname), "s1", "../c1"),
            None
        );
        assert_eq!(
            cri_container_dir(&spec("/etc/motd", &hostname), "s1", "c1"),
            None
        );
    }

    fn ann(pairs: &[(&str, &str)]) -> Annotations {
        Annotations::from_spec(
            &pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
        .unwrap()
    }

    #[test]
    fn cri_checkpoints_leave_the_container_running() {
        let plan =
            CheckpointPlan::resolve("/tmp/x", None, &RuntimeOptions::default(), &ann(&[]), false)
                .unwrap();
        assert!(plan.criu.leave_running);
        assert_eq!(plan.runc_args(), ["--leave-running"]);
        assert_eq!(plan.image_path, PathBuf::from("/tmp/x"));
    }

    #[test]
    fn runc_checkpoint_options_win() {
        let o = CheckpointOptions {
            exit: true,
            open_tcp: true,
            file_locks: true,
            terminal: true,
            work_path: "/w".into(),
            ..Default::default()
        };
        let any = Any {
            type_url: "containerd.runc.v1.CheckpointOptions".into(),
            value: o.write_to_bytes().unwrap(),
            ..Default::default()
        };
        let plan = CheckpointPlan::resolve(
            "/i",
            Some(&any),
            &RuntimeOptions::default(),
            &ann(&[]),
            false,
        )
        .unwrap();
        assert!(!plan.criu.leave_running);
        assert_eq!(
            plan.runc_args(),
            ["--tcp-established", "--shell-job", "--file-locks"]
        );
        assert_eq!(plan.work_path, Some(PathBuf::from("/w")));
    }

    #[test]
    fn only_a_directory_the_caller_named_is_synced() {
        let with_path = |p: &str| Any {
            type_url: "containerd.runc.v1.CheckpointOptions".into(),
            value: CheckpointOptions {
                image_path: p.into(),
                ..Default::default()
            }
            .write_to_bytes()
            .unwrap(),
            ..Default::default()
        };
        let plan = |any: Option<&Any>, runtime: &RuntimeOptions| {
            CheckpointPlan::resolve("/run/ctrd-checkpoint1", any, runtime, &ann(&[]), false)
                .unwrap()
        };
        let on = RuntimeOptions::default();
        let off = RuntimeOptions {
            sync_checkpoint: Some(false),
            ..Default::default()
        };
        // ctr --image-path, the API's CheckpointOptions.image_path.
        let named = plan(Some(&with_path("/ckpt/a")), &on);
        assert_eq!(named.image_path, PathBuf::from("/ckpt/a"));
        assert_eq!(named.durability, Durability::Sync);
        assert_eq!(
            plan(Some(&with_path("/ckpt/a")), &off).durability,
            Durability::None
        );
        // containerd's temporary directory: CRI (no options) and ctr without --image-path.
        assert_eq!(plan(None, &on).durability, Durability::None);
        assert_eq!(plan(Some(&with_path("")), &on).durability, Durability::None);
    }

    #[test]
    fn annotations_override_runtime_defaults() {
        let runtime = RuntimeOptions {
            tcp_mode: "established".into(),
            file_locks: true,
            ..Default::default()
        };
        let a = ann(&[
            (annotations::TCP, "close"),
            (annotations::FILE_LOCKS, "false"),
        ]);
        let plan = CheckpointPlan::resolve("/i", None, &runtime, &a, true).unwrap();
        assert_eq!(plan.criu.tcp, "close");
        assert!(!plan.criu.file_locks);
        assert_eq!(plan.runc_args(), ["--leave-running", "--shell-job"]);
        assert_eq!(restore_args(&plan.criu, true), ["--shell-job"]);
    }

    #[test]
    fn criu_conf_annotation_keeps_the_spec() {
        let dir = tempfile::tempdir().unwrap();
        let spec = r#"{"ociVersion":"1.0.2","x-unknown":{"keep":1},"annotations":{"a":"b"}}"#;
        std::fs::write(dir.path().join("config.json"), spec).unwrap();
        let mut bundle = Bundle::load(dir.path()).unwrap();
        assert!(point_runc_at_criu_conf(&mut bundle).unwrap());
        // Idempotent: the second call finds its own file named.
        assert!(point_runc_at_criu_conf(&mut Bundle::load(dir.path()).unwrap()).unwrap());
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join("config.json")).unwrap())
                .unwrap();
        assert_eq!(v["x-unknown"]["keep"], 1);
        assert_eq!(v["annotations"]["a"], "b");
        assert!(v["annotations"][CRIU_CONFIG_ANNOTATION]
            .as_str()
            .unwrap()
            .ends_with(CRIU_CONF_FILE));
        let written = |conf: CriuConf<'_>| {
            let body = conf.body(Path::new("/none")).unwrap();
            body.strip_prefix("libdir /none\n")
                .unwrap_or_else(|| panic!("{body:?} does not name the plugin directory first"))
                .to_string()
        };
        assert_eq!(written(CriuConf::default()), "");
        let tcp_close = CriuConf {
            tcp_close: true,
            ..Default::default()
        };
        assert_eq!(written(tcp_close), "tcp-close\n");
        let skip = CriuConf {
            skip_network_lock: true,
            ..Default::default()
        };
        assert_eq!(written(skip), "network-lock skip\n");
        let gate = CriuConf {
            action_script: Some(Path::new("/b/gate.sh")),
            ..Default::default()
        };
        assert_eq!(written(gate), "action-script \"/b/gate.sh\"\n");
        let map = [
            ("/data/sub".to_string(), "gpu-ckpt-sub-0".to_string()),
            ("gpu-ckpt-sub-1".to_string(), "/host/d:1/sub".to_string()),
        ];
        let ext = CriuConf {
            tcp_close: true,
            ext_mount_map: &map,
            ..Default::default()
        };
        assert_eq!(
            written(ext),
            "tcp-close\next-mount-map /data/sub:gpu-ckpt-sub-0\next-mount-map gpu-ckpt-sub-1:/host/d:1/sub\n"
        );
        for bad in [
            ("/a:b", "k"),
            ("/a#b", "k"),
            ("/a b", "k"),
            ("k", "/x\ty"),
            ("/a", "/x\"y"),
            ("/a", ""),
        ] {
            let map = [(bad.0.to_string(), bad.1.to_string())];
            let conf = CriuConf {
                ext_mount_map: &map,
                ..Default::default()
            };
            let e = conf.body(Path::new("/none")).unwrap_err();
            assert!(e.to_string().contains("cannot be written"), "{bad:?}: {e}");
        }
        let bad = CriuConf {
            action_script: Some(Path::new("/b/\"x")),
            ..Default::default()
        };
        let e = bad.body(Path::new("/none")).unwrap_err();
        assert!(e.to_string().contains("cannot be written"), "{e}");
    }

    #[test]
    fn the_network_lock_is_skipped_only_with_nothing_to_hold() {
        use procfs::{net::InterfaceDeviceStatus, net::TcpNetEntries, FromBufRead, FromBufReadSI};
        let only_loopback = |t: &str| {
            only_loopback(
                &InterfaceDeviceStatus::from_buf_read(t.as_bytes())
                    .unwrap()
                    .0,
            )
        };
        let only_listeners = |t: &str| {
            let si = procfs::current_system_info();
            only_listeners(&TcpNetEntries::from_buf_read(t.as_bytes(), si).unwrap().0)
        };
        let counters = "0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0";
        let dev = format!(
            "Inter-|   Receive                            |  Transmit\n \
             face |bytes    packets errs drop fifo frame compressed multicast|bytes\n    \
             lo: {counters}\n"
        );
        assert!(only_loopback(&dev));
        let veth = format!("{dev}  eth0: {counters}\n");
        assert!(!only_loopback(&veth));
        let header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n";
        let listen = "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000 100 0 0 10 0\n";
        let established = "   1: 0100007F:1F90 0100007F:A1B2 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0000 20 4 30 10 -1\n";
        assert!(only_listeners(header));
        assert!(only_listeners(&format!("{header}{listen}")));
        assert!(!only_listeners(&format!("{header}{listen}{established}")));
        // The test process's own namespace: unreadable files or not, a pid that does not
        // exist never skips the lock.
        assert!(!nothing_to_lock(i32::MAX));
    }

    #[test]
    fn a_criu_config_named_by_the_user_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let spec = r#"{"ociVersion":"1.0.2","annotations":{"org.criu.config":"/etc/mine.conf"}}"#;
        std::fs::write(dir.path().join("config.json"), spec).unwrap();
        assert!(!point_runc_at_criu_conf(&mut Bundle::load(dir.path()).unwrap()).unwrap());
        assert_eq!(
            std::fs::read_to_string(dir.path().join("config.json")).unwrap(),
            spec
        );
    }

    #[test]
    fn a_criu_that_died_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let (log, kept) = (dir.path().join("dump.log"), dir.path().join("kept.log"));
        std::fs::write(&log, "(00.1) Dumping pages\n(00.2) Writing image\n").unwrap();
        let m = criu_failure("criu failed: read unixpacket @->@: EOF", &log, &kept, &[]);
        assert!(m.starts_with("CRIU died before it answered runc"), "{m}");
        assert!(m.contains("Writing image") && m.contains("kept.log"), "{m}");
        // A CRIU that failed by itself says so in its log: runc's message stands.
        std::fs::write(
            &log,
            "(00.1) Error (criu/sk-unix.c:874): unix: x\n(00.2) Dumping FAILED.\n",
        )
        .unwrap();
        let m = criu_failure("criu failed: type NOTIFY errno 0", &log, &kept, &[]);
        assert!(m.starts_with("criu failed: type NOTIFY"), "{m}");
        let m = criu_failure(
            "read unixpacket @->@: EOF",
            &dir.path().join("none"),
            &kept,
            &[CriuExit {
                pid: 7,
                status: libc::SIGSEGV,
            }],
        );
        assert!(
            m.contains(
                "CRIU died before it answered runc: CRIU (pid 7) was killed by signal 11 (SIGSEGV)"
            ) && m.contains("the log is empty"),
            "{m}"
        );
    }

    #[test]
    fn log_summary_keeps_the_cause() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("dump.log");
        let mut text = String::from("(0.1) start\n(0.2) Error (criu/sk-inet.c:1): inet: Connected TCP socket, consider using --tcp-established option.\n");
        for i in 0..50 {
            text.push_str(&format!("(1.{i}) unwinding\n"));
        }
        std::fs::write(&log, text).unwrap();
        let s = log_summary(&log, 5);
        assert!(s.contains("--tcp-established"), "{s}");
        assert!(s.ends_with("(1.49) unwinding"), "{s}");
        assert_eq!(s.lines().count(), 7, "{s}");
    }

    #[test]
    fn wrong_options_type_is_refused() {
        let any = Any {
            type_url: "containerd.runc.v1.Options".into(),
            value: vec![],
            ..Default::default()
        };
        assert!(CheckpointPlan::resolve(
            "/i",
            Some(&any),
            &RuntimeOptions::default(),
            &ann(&[]),
            false
        )
        .is_err());
    }
}
