//! Checkpoint and restore: which CRIU options to use, and the files the shim keeps beside
//! runc's (the per-container CRIU configuration file and the failure logs).
//!
//! The steps themselves, with their undo, are [`crate::container::Container::checkpoint`] and
//! the restore branch of [`crate::container::Container::start_init`].

use std::path::{Path, PathBuf};

use containerd_shim::protos::{
    protobuf::{well_known_types::any::Any, Message},
    shim::oci::CheckpointOptions,
};
use image_format::{digest::PageDigests, manifest::CriuOptions};

use crate::{
    annotations::{self, Annotations},
    error::{Error, Result},
    options::RuntimeOptions,
};

const CHECKPOINT_OPTIONS_TYPE: &str = "containerd.runc.v1.CheckpointOptions";
/// The annotation runc reads to find a CRIU configuration file for the container.
pub const CRIU_CONFIG_ANNOTATION: &str = "org.criu.config";
/// The shim's CRIU configuration file in the bundle, named by [`CRIU_CONFIG_ANNOTATION`].
pub const CRIU_CONF_FILE: &str = "gpu-ckpt-criu.conf";
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
            }
            if !o.work_path.is_empty() {
                work_path = Some(PathBuf::from(o.work_path));
            }
        }
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

/// Writes the container's CRIU configuration file: `tcp-close` when connections are to be
/// closed rather than dumped (runc has no flag for it), and for a restore the action script
/// of its [`crate::verify_gate::VerifyGate`].
pub fn write_criu_conf(bundle: &Path, tcp_close: bool, action_script: Option<&Path>) -> Result<()> {
    let path = bundle.join(CRIU_CONF_FILE);
    let mut body = String::new();
    if tcp_close {
        body.push_str("tcp-close\n");
    }
    if let Some(script) = action_script {
        let script = script.display().to_string();
        if script.contains(['"', '\\', '\n']) {
            return Err(Error::InvalidArgument(format!(
                "bundle path {script:?} cannot be written into a CRIU configuration file"
            )));
        }
        body.push_str(&format!("action-script \"{script}\"\n"));
    }
    std::fs::write(&path, body).map_err(Error::io(format!("write {}", path.display())))
}

/// Points runc at the shim's CRIU configuration file through `org.criu.config` in the bundle's
/// config.json, unless the user set that annotation already. Edits the JSON as a tree so that
/// nothing of the spec is lost. Must run before `runc create` or `runc restore`. Returns whether
/// runc will read the shim's file (false: the spec names another one).
pub fn point_runc_at_criu_conf(bundle: &Path) -> Result<bool> {
    let path = bundle.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(Error::io(format!("read {}", path.display())))?;
    let mut spec: serde_json::Value =
        serde_json::from_str(&text).map_err(Error::json(format!("decode {}", path.display())))?;
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
    let out = serde_json::to_vec(&spec).map_err(Error::json("encode bundle config"))?;
    std::fs::write(&path, out).map_err(Error::io(format!("write {}", path.display())))?;
    Ok(true)
}

/// What an error message should carry of a CRIU log: its error lines (the cause is usually the
/// first of them, well before the end of the log) and its last `tail` lines.
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

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(point_runc_at_criu_conf(dir.path()).unwrap());
        // Idempotent: the second call finds its own file named.
        assert!(point_runc_at_criu_conf(dir.path()).unwrap());
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join("config.json")).unwrap())
                .unwrap();
        assert_eq!(v["x-unknown"]["keep"], 1);
        assert_eq!(v["annotations"]["a"], "b");
        assert!(v["annotations"][CRIU_CONFIG_ANNOTATION]
            .as_str()
            .unwrap()
            .ends_with(CRIU_CONF_FILE));
        write_criu_conf(dir.path(), true, None).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join(CRIU_CONF_FILE)).unwrap(),
            "tcp-close\n"
        );
        write_criu_conf(dir.path(), false, Some(Path::new("/b/gate.sh"))).unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.path().join(CRIU_CONF_FILE)).unwrap(),
            "action-script \"/b/gate.sh\"\n"
        );
        let e = write_criu_conf(dir.path(), false, Some(Path::new("/b/\"x"))).unwrap_err();
        assert!(e.to_string().contains("cannot be written"), "{e}");
    }

    #[test]
    fn a_criu_config_named_by_the_user_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let spec = r#"{"ociVersion":"1.0.2","annotations":{"org.criu.config":"/etc/mine.conf"}}"#;
        std::fs::write(dir.path().join("config.json"), spec).unwrap();
        assert!(!point_runc_at_criu_conf(dir.path()).unwrap());
        assert_eq!(
            std::fs::read_to_string(dir.path().join("config.json")).unwrap(),
            spec
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
