//! Runtime options: what containerd sends in `CreateTaskRequest.options`, in either of the two
//! shapes it uses, normalised into [`RuntimeOptions`].
//!
//! - `containerd.runc.v1.Options`: task options from the containerd API (never from ctr, which
//!   sends runtime options only to the runc shim).
//! - `runtimeoptions.v1.Options`: what CRI sends for every runtime type but runc's. Its
//!   `config_body` is the handler's options table as TOML, or `config_path` names a TOML file.

use std::path::{Path, PathBuf};

use containerd_shim::protos::{
    protobuf::{well_known_types::any::Any, CodedInputStream, Message},
    shim::oci::Options as RuncOptions,
};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// File in the bundle where the options a container was created with are kept, so that the
/// `delete` action (a separate process) can rebuild runc's global flags.
pub const OPTIONS_FILE: &str = "gpu-ckpt-options.json";

/// runc's state root (before the namespace) for containerd's default state directory when the
/// options name none: our own, never runc-v2's.
pub const DEFAULT_RUNC_ROOT: &str = "/run/containerd/gpu-ckpt";

const RUNC_OPTIONS_TYPE: &str = "containerd.runc.v1.Options";
const RUNTIME_OPTIONS_TYPE: &str = "runtimeoptions.v1.Options";

/// The options this shim understands. In TOML (a containerd handler's `options` table) the keys
/// are the PascalCase names runc-v2 uses: `BinaryName`, `Root`, `SystemdCgroup`, …
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase", deny_unknown_fields, default)]
pub struct RuntimeOptions {
    /// The runc binary: a path, or a name looked up in PATH. Default `runc`, looked up in the
    /// PATH containerd gives the shim, as containerd's runc shim does (go-runc runs
    /// `exec.Command("runc", ...)` when `BinaryName` is empty); never a fixed path.
    pub binary_name: String,
    /// runc's state root; the namespace is appended. Default: see [`RuntimeOptions::runc_root`].
    pub root: String,
    /// Use systemd to manage cgroups (`runc --systemd-cgroup`).
    pub systemd_cgroup: bool,
    /// `runc create --no-pivot`.
    pub no_pivot_root: bool,
    /// `runc create --no-new-keyring`.
    pub no_new_keyring: bool,
    /// The cgroup the shim process itself is put in.
    pub shim_cgroup: String,
    /// Owner of the stdio pipes handed to the container (user namespaces).
    pub io_uid: u32,
    pub io_gid: u32,
    /// A CRIU image directory to restore the container from (the containerd API's way to
    /// restore from `ctr task checkpoint --image-path`), and CRIU's work directory for it.
    pub criu_image_path: String,
    pub criu_work_path: String,
    /// Checkpoint default for established TCP connections: "established" or "close".
    /// The pod annotation `gpu-ckpt.io/tcp` overrides it.
    pub tcp_mode: String,
    /// Checkpoint default: dump file locks (`--file-locks`).
    pub file_locks: bool,
    /// Checkpoint default: dump external unix sockets (`--ext-unix-sk`).
    pub external_unix_sockets: bool,
    /// Checkpoint default: CRIU's cgroups mode (soft, full, strict).
    pub cgroups_mode: String,
    /// Record sha256 of CRIU's page images in the manifest too (by default they get BLAKE3
    /// only, every other file both). For readers that know only sha256; it makes a checkpoint
    /// slower, since sha256 cannot keep up with CRIU's dump.
    pub sha256_page_images: bool,
    /// Make a checkpoint in a directory the caller named (`ctr task checkpoint --image-path`,
    /// the API's `CheckpointOptions.image_path`) durable before it is called complete: every
    /// file synced before the manifest, the directory after (default true). containerd's own
    /// temporary directories (ctr without `--image-path`, CRI) are never synced: containerd
    /// copies them and removes them (docs/architecture.md, "Crash safety").
    pub sync_checkpoint: Option<bool>,
    /// "restore" for the restore handler (`gpu-ckpt-restore`): containers whose pod names a
    /// checkpoint in `gpu-ckpt.io/restore-from` are restored from it at start.
    pub mode: String,
    /// The node's signing key (made on first use, root-only). Default: see
    /// [`RuntimeOptions::signing_key_path`].
    pub signing_key: String,
    /// A directory of more trusted public keys (`*.pub`, 64 hex digits each): checkpoints
    /// signed by them restore here as well as this node's own.
    pub trusted_keys_dir: String,
    /// The revoked-keys list (key ids or public keys, one a line; `gpu-ckpt key revoke` writes
    /// it): checkpoints signed by a key it names are refused, even where that key is trusted.
    /// Default: see [`RuntimeOptions::revoked_keys_path`].
    pub revoked_keys_file: String,
    /// Sign checkpoints with the node key (default true). Off only for measurement, or for
    /// checkpoints that will be restored elsewhere under `AllowUnsigned`.
    pub sign_checkpoints: Option<bool>,
    /// Restore unsigned checkpoints too (another runtime's, or for development); every such
    /// restore logs a warning.
    pub allow_unsigned: bool,
    /// Moves between namespaces that a restore may make, as `"from/to"` pairs. By default a
    /// checkpoint restores only into the namespace it was taken in.
    pub namespace_moves: Vec<String>,
    /// Where `gpu-ckpt.io/restore-from` may read: directories (absolute, `/` at the end or not)
    /// and registry prefixes. `None`: [`DEFAULT_RESTORE_SOURCES`].
    pub restore_sources: Option<Vec<String>>,
    /// Where the restore handler stages a checkpoint it restores (a fetched archive, the
    /// members its manifest lists): `<dir>/<namespace>/<container id>`, root-only, removed when
    /// the restore is done. Empty: [`DEFAULT_RESTORE_STAGING_DIR`], on the node's disk, not in
    /// /run (RAM on most nodes).
    pub restore_staging_dir: String,
    /// containerd's per-registry host directory (`certs.d` layout: `HOST[:PORT]/hosts.toml`,
    /// `ca.crt`) for the restore handler's registry pulls. Empty:
    /// [`registry::DEFAULT_HOSTS_DIR`], the directory a node's containerd
    /// usually reads (`config_path`).
    pub registry_hosts_dir: String,
    /// The docker-style auth file (`config.json`: `auths`, `credHelpers`, `credsStore`) for the
    /// restore handler's registry pulls. Empty: `$REGISTRY_AUTH_FILE`, `$DOCKER_CONFIG/config.json`
    /// or `~/.docker/config.json` of the shim's environment, else anonymous pulls.
    pub registry_auth_file: String,
    /// The directory holding the NVIDIA driver's `libcuda.so.1` and `libnvidia-ml.so.1`. Empty:
    /// the dynamic loader's search (where the driver installs them).
    pub driver_library_dir: String,
    /// How long a GPU checkpoint waits for a process's device lock (in-flight work to finish),
    /// e.g. "30s"; the pod annotation `gpu-ckpt.io/lock-timeout` may shorten it, never
    /// lengthen it. Empty: 30 s.
    pub device_lock_timeout: String,
    /// Where a GPU checkpoint or restore would stage more host memory than the container's own
    /// memory cgroup has room for: raise its limit by what is needed for the length of the
    /// device steps, instead of refusing (default false: refused, naming the limit, the use
    /// and the bytes needed). Never a cgroup above the container's (a short pod or QoS cgroup
    /// is refused either way), and at a restore only by the staged device memory. The limit
    /// goes back after the device steps once the use fits, or after 10 s regardless: the
    /// container is not frozen meanwhile, so what it then holds above the limit is its own
    /// (cgroup v2: the kernel reclaims or OOM-kills inside the container's cgroup; v1: the
    /// write fails, is logged as a warning and is retried at each later step and at exit).
    pub raise_memory_limit: bool,
    /// How long past the lock timeout the driver's lock may take before the shim gives up on
    /// it, e.g. "10s". Empty: [`DEFAULT_DEVICE_LOCK_MARGIN`].
    pub device_lock_margin: String,
    /// The bound on a device checkpoint or restore of one process (and on an unlock), before
    /// the per-GiB part, e.g. "1m". Empty: [`DEFAULT_DEVICE_CALL_TIMEOUT`].
    pub device_call_timeout: String,
    /// Added to `DeviceCallTimeout` for each GiB of device memory the process holds, e.g.
    /// "10s". Empty: [`DEFAULT_DEVICE_CALL_TIMEOUT_PER_GIB`].
    #[serde(rename = "DeviceCallTimeoutPerGiB")]
    pub device_call_timeout_per_gib: String,
    /// The bound on the driver's state and restore-thread reads, e.g. "10s". Empty:
    /// [`DEFAULT_DEVICE_READ_TIMEOUT`].
    pub device_read_timeout: String,
    /// The bound on a restore's waits (CRIU, the gate's verdicts, page verification), e.g.
    /// "5m". Empty: a minute plus 10 s per GiB of checkpoint. Past it the restore fails.
    pub restore_timeout: String,
    /// Resume a container as soon as its checkpoint is written (default false): in a
    /// leave-running checkpoint of a paused task (CRI CheckpointContainer, `ctr task
    /// checkpoint` without `--exit`), the shim thaws the container and puts its device state
    /// back on its GPUs, unlocked, once CRIU's dump and the signed copy of the rootfs changes
    /// are done, instead of waiting for containerd's Resume; containerd's copy of the
    /// checkpoint and its rootfs diff then run while the application works, and its Resume is
    /// answered as done. The pod annotation `gpu-ckpt.io/resume-after-dump: "false"` turns it
    /// off for a pod; `"true"` turns it on only where [`RuntimeOptions::pod_resume_after_dump`]
    /// lets pods choose. containerd's own restore (`ctr container restore`, CRI's restore-via-create) of such
    /// a checkpoint is refused: its rootfs-diff.tar was taken after the resume; the restore
    /// handler restores it from the signed copy.
    pub resume_after_dump: bool,
    /// Let a pod turn [`RuntimeOptions::resume_after_dump`] on with its annotation (default
    /// false: the annotation can only turn it off). While the container runs on, containerd
    /// takes its rootfs diff from the live upper directory and follows what it finds there by
    /// path, so a tenant that swaps a file for a symlink at that moment can get a host file
    /// into the checkpoint's rootfs-diff.tar: the node's operator, not the pod, decides.
    pub pod_resume_after_dump: bool,
    /// The device steps of a checkpoint (default true). `false` only for tests: a checkpoint
    /// then shows what happens without them (CRIU cannot dump a process that holds a GPU).
    pub device_steps: Option<bool>,
    /// Where a GPU checkpoint puts device memory: "auto" (default; empty is the same): into
    /// device-memory files of the checkpoint by the driver's custom storage where the driver
    /// offers it (CUDA 13.4 and later), else staged in each process's host memory (inside
    /// CRIU's page images); "staged": always staged.
    pub device_storage: String,
    /// The directory custom storage writes device-memory files to at Pause, before the
    /// checkpoint's image directory is known: `<dir>/<namespace>/<container id>`, root-only,
    /// on the node's disk (not /run, RAM on most nodes); the files move into the image
    /// directory at the checkpoint (a rename on the same file system). Empty:
    /// [`DEFAULT_DEVICE_STORAGE_DIR`].
    pub device_storage_dir: String,
    /// Whether GPU containers get gpu-ckpt's NCCL layer by default: "managed" (the layer
    /// injected, its communicators quiesced at a checkpoint and rebuilt after a restore) or
    /// "off" (default; empty is the same). The container annotation `gpu-ckpt.io/nccl` wins
    /// where present.
    pub nccl: String,
    /// The host path of the NCCL layer (`libgpu-ckpt-nccl.so`) bind-mounted into containers
    /// that opt in. Empty: [`DEFAULT_NCCL_LAYER`], where the node installer puts it.
    pub nccl_layer: String,
    /// The bound of an NCCL quiesce, of the wait for the layer's reconnects and of a rebuild,
    /// e.g. "30s". Empty: [`DEFAULT_NCCL_TIMEOUT`].
    pub nccl_timeout: String,
    /// What the NCCL layer does with a container's communicators before the device steps:
    /// "destroy" (default; empty is the same): destroyed, and rebuilt on fresh unique ids after
    /// the checkpoint, on this node too; "suspend": `ncclCommSuspend` where the application's
    /// NCCL has it (2.29.7 and later; else destroyed), and a same-node resume only resumes
    /// them. NCCL documents that suspend releases the communicator's dynamic GPU memory; its
    /// connections (bootstrap sockets, proxy, peer mappings) stay, which CRIU and the driver's
    /// checkpoint may not carry, so destroy is the default.
    pub nccl_release: String,
    /// The node's record of checkpoints and restores (the `journal` crate): one line per
    /// checkpoint, restore and refusal, root-only. Empty: [`journal::DEFAULT_DIR`]
    /// (`/var/lib/gpu-ckpt/events`).
    pub events_dir: String,
    /// The size at which the record's current file is rotated (the record keeps at most two
    /// files of about this size). 0: [`journal::DEFAULT_SEGMENT_BYTES`] (4 MiB).
    pub events_segment_bytes: u64,
    /// Where the shim exports its traces over OTLP (e.g. `http://collector:4318`). Empty: the
    /// environment's `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`;
    /// none of them: no export.
    pub otlp_endpoint: String,
    /// The OTLP protocol: "http/protobuf" (default; empty is the same) or "grpc".
    pub otlp_protocol: String,
}

/// Where the node installer puts the NCCL layer, when the options name no `NcclLayer`.
pub const DEFAULT_NCCL_LAYER: &str = "/usr/local/lib/gpu-ckpt/libgpu-ckpt-nccl.so";

/// The smallest `EventsSegmentBytes` other than 0: the journal's own floor (two records of its
/// largest size; a smaller segment would be raised to it silently).
pub const MIN_EVENTS_SEGMENT_BYTES: u64 = journal::MIN_SEGMENT_BYTES;
/// The largest `EventsSegmentBytes`: the record is a node's recent history, not an archive, and
/// the agent and `gpu-ckpt events` read it on a small memory budget.
pub const MAX_EVENTS_SEGMENT_BYTES: u64 = 64 << 20;

/// `NcclTimeout` when the options name none.
pub const DEFAULT_NCCL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Where custom storage writes device-memory files when the options name no
/// `DeviceStorageDir`.
pub const DEFAULT_DEVICE_STORAGE_DIR: &str = "/var/lib/gpu-ckpt/device-memory";

/// The device lock timeout when neither the options nor the pod name one.
pub const DEFAULT_DEVICE_LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// `DeviceLockMargin` when the options name none.
pub const DEFAULT_DEVICE_LOCK_MARGIN: std::time::Duration = std::time::Duration::from_secs(10);
/// `DeviceCallTimeout` when the options name none.
pub const DEFAULT_DEVICE_CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);
/// `DeviceCallTimeoutPerGiB` when the options name none.
pub const DEFAULT_DEVICE_CALL_TIMEOUT_PER_GIB: std::time::Duration =
    std::time::Duration::from_secs(10);
/// `DeviceReadTimeout` when the options name none.
pub const DEFAULT_DEVICE_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The duration option `value` (named `key`), else `default` when it is empty.
pub fn duration_or(
    value: &str,
    key: &str,
    default: std::time::Duration,
) -> Result<std::time::Duration> {
    if value.is_empty() {
        Ok(default)
    } else {
        parse_timeout(value, key)
    }
}

/// Each of `paths` (key, value) empty or absolute.
fn absolute_paths(paths: &[(&str, &String)]) -> Result<()> {
    for (key, value) in paths {
        if !value.is_empty() && !value.starts_with('/') {
            return Err(Error::InvalidArgument(format!(
                "invalid {key} {value:?}: expected an absolute path"
            )));
        }
    }
    Ok(())
}

/// Parses a lock timeout: a humantime duration ("30s", "1m30s", "500ms") or whole seconds.
pub fn parse_timeout(v: &str, origin: &str) -> Result<std::time::Duration> {
    let v = v.trim();
    if let Ok(secs) = v.parse::<u64>() {
        return Ok(std::time::Duration::from_secs(secs));
    }
    humantime::parse_duration(v).map_err(|e| {
        Error::InvalidArgument(format!(
            "{origin} is {v:?}: expected a duration such as \"30s\" or \"500ms\" ({e})"
        ))
    })
}

/// Environment: the handler options file, as the shim's `start` passes it on to the server it
/// starts (which runs as the resolved binary, not by the path containerd used).
pub const HANDLER_CONFIG_ENV: &str = "GPU_CKPT_HANDLER_CONFIG";

/// The handler options file of this shim process: `$GPU_CKPT_HANDLER_CONFIG`, else
/// `<the path containerd started this binary by>.toml` when that file exists. One binary serves
/// several runc-typed handlers by several paths (links), each with its own file, for example
/// `containerd-shim-gpu-ckpt-restore-v1` and `containerd-shim-gpu-ckpt-restore-v1.toml` holding
/// `Mode = "restore"`.
pub fn handler_config_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(HANDLER_CONFIG_ENV).filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let argv0 = PathBuf::from(std::env::args_os().next()?);
    if !argv0.is_absolute() {
        return None;
    }
    let mut file = argv0.into_os_string();
    file.push(".toml");
    let file = PathBuf::from(file);
    file.is_file().then_some(file)
}

/// The restore sources when the options name none: the kubelet's checkpoint directory.
pub const DEFAULT_RESTORE_SOURCES: [&str; 1] = ["/var/lib/kubelet/checkpoints/"];
/// Where the restore handler stages checkpoints when the options name no `RestoreStagingDir`.
pub const DEFAULT_RESTORE_STAGING_DIR: &str = "/var/lib/gpu-ckpt/restore";
/// The node key's directory for a containerd with the default state directory.
pub const DEFAULT_KEY_DIR: &str = image_format::sign::DEFAULT_KEY_DIR;

impl RuntimeOptions {
    /// Decodes the options Any of a Create request (or of `-info`). `None` or an empty Any gives
    /// the defaults, or the handler options file of a runc-typed registration when there is one
    /// ([`handler_config_path`]).
    pub fn from_any(any: Option<&Any>) -> Result<Self> {
        Self::from_any_with(any, handler_config_path().as_deref())
    }

    /// [`RuntimeOptions::from_any`] with an explicit handler options file. The file applies where
    /// containerd sends no options table of ours: no options at all (ctr), or
    /// `containerd.runc.v1.Options` (a handler registered as `io.containerd.runc.v2` with our
    /// binary as `runtime_path`, the registration under which containerd's CRI reads a
    /// runtime's features). The runc keys containerd sends go over the file's.
    pub fn from_any_with(any: Option<&Any>, handler_file: Option<&Path>) -> Result<Self> {
        let base = || -> Result<Self> {
            let Some(path) = handler_file else {
                return Ok(Self::default());
            };
            let body = std::fs::read_to_string(path).map_err(Error::io(format!(
                "read handler options file {}",
                path.display()
            )))?;
            Self::from_toml(&body, &format!("handler options file {}", path.display()))
        };
        let Some(any) = any.filter(|a| !a.type_url.is_empty() || !a.value.is_empty()) else {
            return base();
        };
        let type_name = any.type_url.rsplit('/').next().unwrap_or_default();
        match type_name {
            RUNC_OPTIONS_TYPE => {
                let o = RuncOptions::parse_from_bytes(&any.value)?;
                let mut s = base()?;
                let set = |to: &mut String, from: String| {
                    if !from.is_empty() {
                        *to = from;
                    }
                };
                set(&mut s.binary_name, o.binary_name);
                set(&mut s.root, o.root);
                set(&mut s.shim_cgroup, o.shim_cgroup);
                set(&mut s.criu_image_path, o.criu_image_path);
                set(&mut s.criu_work_path, o.criu_work_path);
                s.systemd_cgroup |= o.systemd_cgroup;
                s.no_pivot_root |= o.no_pivot_root;
                s.no_new_keyring |= o.no_new_keyring;
                if o.io_uid != 0 {
                    s.io_uid = o.io_uid;
                }
                if o.io_gid != 0 {
                    s.io_gid = o.io_gid;
                }
                Ok(s)
            }
            RUNTIME_OPTIONS_TYPE => {
                let ro = decode_runtime_options(&any.value)?;
                if !ro.config_body.trim().is_empty() {
                    Self::from_toml(&ro.config_body, "runtime options config_body")
                } else if !ro.config_path.is_empty() {
                    let body = std::fs::read_to_string(&ro.config_path).map_err(Error::io(
                        format!("read runtime options file {}", ro.config_path),
                    ))?;
                    Self::from_toml(&body, &ro.config_path)
                } else {
                    Ok(Self::default())
                }
            }
            other => Err(Error::InvalidArgument(format!(
                "unsupported runtime options type {other:?}: expected {RUNC_OPTIONS_TYPE} or {RUNTIME_OPTIONS_TYPE}"
            ))),
        }
    }

    /// Parses a handler's options table. An unknown key is an error that names it.
    pub fn from_toml(body: &str, origin: &str) -> Result<Self> {
        toml::from_str::<Self>(body)
            .map_err(|e| Error::InvalidArgument(format!("invalid {origin}: {}", e.message())))?
            .validate()
    }

    /// The runc binary to run.
    pub fn runc_binary(&self) -> &str {
        if self.binary_name.is_empty() {
            "runc"
        } else {
            &self.binary_name
        }
    }

    /// runc's state root for `namespace`, as containerd's runc shim forms it: `Root` (or the
    /// default) joined with the namespace. The default lives in the state directory of the
    /// containerd that made `bundle` (`<state>/io.containerd.runtime.v2.task/<ns>/<id>`), so that
    /// two containerd instances on one host never share runc state; for containerd's default
    /// state directory that is [`DEFAULT_RUNC_ROOT`].
    pub fn runc_root(&self, namespace: &str, bundle: &Path) -> String {
        let base = if !self.root.is_empty() {
            PathBuf::from(&self.root)
        } else {
            bundle
                .parent()
                .and_then(Path::parent)
                .filter(|d| {
                    d.file_name()
                        .is_some_and(|n| n == "io.containerd.runtime.v2.task")
                })
                .and_then(Path::parent)
                .map(|state| state.join("gpu-ckpt"))
                .unwrap_or_else(|| PathBuf::from(DEFAULT_RUNC_ROOT))
        };
        base.join(namespace).display().to_string()
    }

    /// Checks the values of the keys that take a fixed set.
    fn validate(self) -> Result<Self> {
        self.check_modes()?;
        self.check_namespace_moves()?;
        self.check_restore_sources()?;
        absolute_paths(&[
            ("SigningKey", &self.signing_key),
            ("TrustedKeysDir", &self.trusted_keys_dir),
            ("RevokedKeysFile", &self.revoked_keys_file),
            ("RegistryHostsDir", &self.registry_hosts_dir),
            ("RegistryAuthFile", &self.registry_auth_file),
            ("RestoreStagingDir", &self.restore_staging_dir),
            ("DeviceStorageDir", &self.device_storage_dir),
            ("NcclLayer", &self.nccl_layer),
        ])?;
        if !matches!(self.nccl.as_str(), "" | "managed" | "off") {
            return Err(Error::InvalidArgument(format!(
                "invalid Nccl {:?}: expected \"managed\" or \"off\"",
                self.nccl
            )));
        }
        if !matches!(self.nccl_release.as_str(), "" | "destroy" | "suspend") {
            return Err(Error::InvalidArgument(format!(
                "invalid NcclRelease {:?}: expected \"destroy\" or \"suspend\"",
                self.nccl_release
            )));
        }
        if !matches!(self.device_storage.as_str(), "" | "auto" | "staged") {
            return Err(Error::InvalidArgument(format!(
                "invalid DeviceStorage {:?}: expected \"auto\" or \"staged\"",
                self.device_storage
            )));
        }
        if !self.restore_timeout.is_empty() {
            parse_timeout(&self.restore_timeout, "RestoreTimeout")?;
        }
        if !self.device_lock_timeout.is_empty() {
            parse_timeout(&self.device_lock_timeout, "DeviceLockTimeout")?;
        }
        for (key, value) in [
            ("DeviceLockMargin", &self.device_lock_margin),
            ("DeviceCallTimeout", &self.device_call_timeout),
            ("DeviceCallTimeoutPerGiB", &self.device_call_timeout_per_gib),
            ("DeviceReadTimeout", &self.device_read_timeout),
            ("NcclTimeout", &self.nccl_timeout),
        ] {
            duration_or(value, key, std::time::Duration::ZERO)?;
        }
        absolute_paths(&[("DriverLibraryDir", &self.driver_library_dir)])?;
        self.check_telemetry()?;
        if !matches!(self.mode.as_str(), "" | "run" | "restore") {
            return Err(Error::InvalidArgument(format!(
                "invalid Mode {:?}: expected \"run\" or \"restore\"",
                self.mode
            )));
        }
        Ok(self)
    }

    /// `TcpMode` and `CgroupsMode`, each one of its values or empty.
    fn check_modes(&self) -> Result<()> {
        if !matches!(self.tcp_mode.as_str(), "" | "established" | "close") {
            return Err(Error::InvalidArgument(format!(
                "invalid TcpMode {:?}: expected \"established\" or \"close\"",
                self.tcp_mode
            )));
        }
        if !matches!(
            self.cgroups_mode.as_str(),
            "" | "soft" | "full" | "strict" | "ignore"
        ) {
            return Err(Error::InvalidArgument(format!(
                "invalid CgroupsMode {:?}: expected soft, full, strict or ignore",
                self.cgroups_mode
            )));
        }
        Ok(())
    }

    /// `EventsDir` absolute, `EventsSegmentBytes` within its bounds, `OtlpProtocol` one of its
    /// values, `OtlpEndpoint` a URL.
    fn check_telemetry(&self) -> Result<()> {
        absolute_paths(&[("EventsDir", &self.events_dir)])?;
        let segment = self.events_segment_bytes;
        if segment != 0 && !(MIN_EVENTS_SEGMENT_BYTES..=MAX_EVENTS_SEGMENT_BYTES).contains(&segment)
        {
            return Err(Error::InvalidArgument(format!(
                "invalid EventsSegmentBytes {segment}: expected 0 (the default, 4 MiB) or {MIN_EVENTS_SEGMENT_BYTES} to {MAX_EVENTS_SEGMENT_BYTES}"
            )));
        }
        if !matches!(self.otlp_protocol.as_str(), "" | "http/protobuf" | "grpc") {
            return Err(Error::InvalidArgument(format!(
                "invalid OtlpProtocol {:?}: expected \"http/protobuf\" or \"grpc\"",
                self.otlp_protocol
            )));
        }
        let endpoint = &self.otlp_endpoint;
        if self.otlp_protocol == "grpc" && endpoint.starts_with("https://") {
            return Err(Error::InvalidArgument(format!(
                "invalid OtlpEndpoint {endpoint:?} with OtlpProtocol \"grpc\": the shim speaks gRPC without TLS (an http:// endpoint); use \"http/protobuf\" for an https:// collector"
            )));
        }
        let url = endpoint
            .strip_prefix("http://")
            .or_else(|| endpoint.strip_prefix("https://"));
        if !endpoint.is_empty()
            && url.is_none_or(|rest| rest.is_empty() || rest.contains(char::is_whitespace))
        {
            return Err(Error::InvalidArgument(format!(
                "invalid OtlpEndpoint {endpoint:?}: expected an http:// or https:// URL"
            )));
        }
        Ok(())
    }

    /// The record's directory: `EventsDir`, or [`journal::DEFAULT_DIR`].
    pub fn events_dir(&self) -> PathBuf {
        if self.events_dir.is_empty() {
            PathBuf::from(journal::DEFAULT_DIR)
        } else {
            PathBuf::from(&self.events_dir)
        }
    }

    /// The record's segment size: `EventsSegmentBytes`, or [`journal::DEFAULT_SEGMENT_BYTES`].
    pub fn events_segment_bytes(&self) -> u64 {
        match self.events_segment_bytes {
            0 => journal::DEFAULT_SEGMENT_BYTES,
            n => n,
        }
    }

    /// `OtlpEndpoint`, when set.
    pub fn otlp_endpoint(&self) -> Option<&str> {
        (!self.otlp_endpoint.is_empty()).then_some(self.otlp_endpoint.as_str())
    }

    /// `OtlpProtocol` as set: empty leaves it to `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, then
    /// `OTEL_EXPORTER_OTLP_PROTOCOL`, then "http/protobuf" (`telemetry::resolve`).
    pub fn otlp_protocol(&self) -> &str {
        &self.otlp_protocol
    }

    /// Each `NamespaceMoves` entry `from/to`, two namespaces.
    fn check_namespace_moves(&self) -> Result<()> {
        for pair in &self.namespace_moves {
            let ok = pair
                .split_once('/')
                .is_some_and(|(from, to)| !from.is_empty() && !to.is_empty() && !to.contains('/'));
            if !ok {
                return Err(Error::InvalidArgument(format!(
                    "invalid NamespaceMoves entry {pair:?}: expected \"from/to\", two namespaces"
                )));
            }
        }
        Ok(())
    }

    /// Each `RestoreSources` entry an absolute directory or a registry prefix, without `..`.
    fn check_restore_sources(&self) -> Result<()> {
        for source in self.restore_sources.iter().flatten() {
            let dir = source.starts_with('/');
            if source.is_empty()
                || source.split('/').any(|c| c == "..")
                || (!dir && !source.contains('/'))
                || (!dir && image_format::reference::RegistryPrefix::parse(source).is_err())
            {
                return Err(Error::InvalidArgument(format!(
                    "invalid RestoreSources entry {source:?}: expected an absolute directory or a registry prefix (host/path/)"
                )));
            }
        }
        Ok(())
    }

    /// The node's signing key: `SigningKey`, else `/var/lib/gpu-ckpt/keys/node.key`, one key
    /// for the machine, whichever containerd (or ctr, which sends no options) took the
    /// checkpoint, so that one machine restores its own checkpoints with no configuration.
    pub fn signing_key_path(&self) -> PathBuf {
        if !self.signing_key.is_empty() {
            return PathBuf::from(&self.signing_key);
        }
        Path::new(DEFAULT_KEY_DIR).join(image_format::sign::NODE_KEY_FILE)
    }

    /// The configured revoked-keys list: `RevokedKeysFile`, else `revoked` beside the signing
    /// key (`/var/lib/gpu-ckpt/keys/revoked`), where `gpu-ckpt key revoke` writes by default.
    pub fn revoked_keys_path(&self) -> PathBuf {
        if !self.revoked_keys_file.is_empty() {
            return PathBuf::from(&self.revoked_keys_file);
        }
        self.default_revoked_keys_path()
    }

    /// `revoked` beside the signing key: the node's own list (`gpu-ckpt key revoke`'s default).
    fn default_revoked_keys_path(&self) -> PathBuf {
        self.signing_key_path()
            .with_file_name(image_format::sign::REVOKED_FILE)
    }

    /// Every revoked-keys list the node reads: `RevokedKeysFile` (an installer-managed list),
    /// always the list beside the signing key, and always the node's default list
    /// (`/var/lib/gpu-ckpt/keys/revoked`, where `gpu-ckpt key revoke` writes without flags, also
    /// when `SigningKey` names a cluster key elsewhere). Revocation only adds: a key revoked on
    /// the node stays revoked whatever `RevokedKeysFile` or `SigningKey` name.
    pub fn revoked_keys_paths(&self) -> Vec<PathBuf> {
        let mut paths = vec![self.revoked_keys_path()];
        for own in [
            self.default_revoked_keys_path(),
            Path::new(DEFAULT_KEY_DIR).join(image_format::sign::REVOKED_FILE),
        ] {
            if !paths.contains(&own) {
                paths.push(own);
            }
        }
        paths
    }

    /// Whether checkpoints are signed (`SignCheckpoints`, default true).
    pub fn sign_checkpoints(&self) -> bool {
        self.sign_checkpoints.unwrap_or(true)
    }

    /// Whether caller-named checkpoint directories are synced (`SyncCheckpoint`, default true).
    pub fn sync_checkpoint(&self) -> bool {
        self.sync_checkpoint.unwrap_or(true)
    }

    /// `RestoreSources`, or its default.
    pub fn restore_sources(&self) -> Vec<String> {
        self.restore_sources.clone().unwrap_or_else(|| {
            DEFAULT_RESTORE_SOURCES
                .iter()
                .map(|s| s.to_string())
                .collect()
        })
    }

    /// `RestoreStagingDir`, or its default.
    pub fn restore_staging_dir(&self) -> PathBuf {
        if self.restore_staging_dir.is_empty() {
            PathBuf::from(DEFAULT_RESTORE_STAGING_DIR)
        } else {
            PathBuf::from(&self.restore_staging_dir)
        }
    }

    /// Where the restore handler's registry pulls find TLS settings and logins
    /// (`RegistryHostsDir`, `RegistryAuthFile`).
    pub fn registry_options(&self) -> registry::RegistryOptions {
        let hosts_dir = if self.registry_hosts_dir.is_empty() {
            registry::DEFAULT_HOSTS_DIR
        } else {
            &self.registry_hosts_dir
        };
        registry::RegistryOptions {
            hosts_dir: Some(PathBuf::from(hosts_dir)),
            auth_file: (!self.registry_auth_file.is_empty())
                .then(|| PathBuf::from(&self.registry_auth_file)),
            ..Default::default()
        }
    }

    /// Whether `NamespaceMoves` allows a checkpoint of namespace `from` into namespace `to`.
    pub fn namespace_move_allowed(&self, from: &str, to: &str) -> bool {
        from == to
            || self
                .namespace_moves
                .iter()
                .any(|p| p.split_once('/') == Some((from, to)))
    }

    /// Whether checkpoints run their device steps (`DeviceSteps`, default true).
    pub fn device_steps(&self) -> bool {
        self.device_steps.unwrap_or(true)
    }

    /// Whether a checkpoint may use the driver's custom storage (`DeviceStorage` not
    /// "staged").
    pub fn custom_device_storage(&self) -> bool {
        self.device_storage != "staged"
    }

    /// `DeviceStorageDir`, or its default.
    pub fn device_storage_dir(&self) -> PathBuf {
        if self.device_storage_dir.is_empty() {
            PathBuf::from(DEFAULT_DEVICE_STORAGE_DIR)
        } else {
            PathBuf::from(&self.device_storage_dir)
        }
    }

    /// Whether containers get the NCCL layer where no annotation says (`Nccl = "managed"`).
    pub fn nccl_managed(&self) -> bool {
        self.nccl == "managed"
    }

    /// `NcclLayer`, or its default.
    pub fn nccl_layer(&self) -> PathBuf {
        if self.nccl_layer.is_empty() {
            PathBuf::from(DEFAULT_NCCL_LAYER)
        } else {
            PathBuf::from(&self.nccl_layer)
        }
    }

    /// `NcclRelease`: "destroy" (also for empty) or "suspend", as the layer reads it.
    pub fn nccl_release(&self) -> &'static str {
        if self.nccl_release == "suspend" {
            "suspend"
        } else {
            "destroy"
        }
    }

    /// `NcclTimeout`, or its default.
    pub fn nccl_timeout(&self) -> Result<std::time::Duration> {
        duration_or(&self.nccl_timeout, "NcclTimeout", DEFAULT_NCCL_TIMEOUT)
    }

    /// Whether this is the restore handler.
    pub fn restore_mode(&self) -> bool {
        self.mode == "restore"
    }

    pub fn write_to_bundle(&self, bundle: &Path) -> Result<()> {
        let path = bundle.join(OPTIONS_FILE);
        let json = serde_json::to_vec(self).map_err(Error::json("encode runtime options"))?;
        std::fs::write(&path, json).map_err(Error::io(format!("write {}", path.display())))
    }

    /// The options a container in `bundle` was created with; defaults when none were saved.
    pub fn read_from_bundle(bundle: &Path) -> Result<Self> {
        let path = bundle.join(OPTIONS_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(Error::json(format!("decode {}", path.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(Error::io(format!("read {}", path.display()))(e)),
        }
    }
}

/// `runtimeoptions.v1.Options` (containerd's `pkg/runtimeoptions/v1/api.proto`): not vendored in
/// containerd-shim-protos, so decoded by hand. Fields: 1 type_url, 2 config_path, 3 config_body.
#[derive(Debug, Default, PartialEq, Eq)]
struct RuntimeOptionsMessage {
    type_url: String,
    config_path: String,
    config_body: String,
}

fn decode_runtime_options(bytes: &[u8]) -> Result<RuntimeOptionsMessage> {
    let mut msg = RuntimeOptionsMessage::default();
    let mut input = CodedInputStream::from_bytes(bytes);
    while let Some(tag) = input.read_raw_tag_or_eof()? {
        match tag {
            10 => msg.type_url = input.read_string()?,
            18 => msg.config_path = input.read_string()?,
            26 => msg.config_body = input.read_string()?,
            other => input.skip_field(wire_type(other)?)?,
        }
    }
    Ok(msg)
}

fn wire_type(tag: u32) -> Result<containerd_shim::protos::protobuf::rt::WireType> {
    containerd_shim::protos::protobuf::rt::WireType::new(tag & 7).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "runtimeoptions.v1.Options: bad wire type in tag {tag}"
        ))
    })
}

#[cfg(test)]
pub(crate) fn encode_runtime_options(config_path: &str, config_body: &str) -> Any {
    use containerd_shim::protos::protobuf::CodedOutputStream;
    let mut value = Vec::new();
    {
        let mut out = CodedOutputStream::vec(&mut value);
        out.write_string(1, "runtimeoptions.v1.Options").unwrap();
        out.write_string(2, config_path).unwrap();
        out.write_string(3, config_body).unwrap();
        out.flush().unwrap();
    }
    Any {
        type_url: format!("type.googleapis.com/{RUNTIME_OPTIONS_TYPE}"),
        value,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error says every one of `parts`.
    fn assert_mentions(err: Error, parts: &[&str]) {
        let err = err.to_string();
        for part in parts {
            assert!(err.contains(part), "{part:?} not in: {err}");
        }
    }

    #[test]
    fn no_options_gives_defaults() {
        let o = RuntimeOptions::from_any(None).unwrap();
        assert_eq!(o.runc_binary(), "runc");
        assert_eq!(
            o.runc_root("k8s.io", Path::new("/elsewhere/b")),
            "/run/containerd/gpu-ckpt/k8s.io"
        );
        assert_eq!(
            o.runc_root(
                "default",
                Path::new("/run/ctd-a/io.containerd.runtime.v2.task/default/c1")
            ),
            "/run/ctd-a/gpu-ckpt/default"
        );
    }

    #[test]
    fn a_handler_file_carries_our_options_under_runc_typed_registration() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("containerd-shim-gpu-ckpt-restore-v1.toml");
        std::fs::write(
            &file,
            "Mode = \"restore\"\nBinaryName = \"/opt/runc\"\nRestoreSources = [\"/srv/ckpt/\"]\n",
        )
        .unwrap();
        let runc = RuncOptions {
            binary_name: "/usr/sbin/runc".into(),
            root: "/run/x".into(),
            ..Default::default()
        };
        let any = Any {
            type_url: "containerd.runc.v1.Options".into(),
            value: runc.write_to_bytes().unwrap(),
            ..Default::default()
        };
        // CRI's runc options go over the file's runc keys; the file gives the rest.
        let o = RuntimeOptions::from_any_with(Some(&any), Some(&file)).unwrap();
        assert!(o.restore_mode());
        assert_eq!(o.binary_name, "/usr/sbin/runc");
        assert_eq!(o.root, "/run/x");
        assert_eq!(o.restore_sources, Some(vec!["/srv/ckpt/".to_string()]));
        // No options at all (ctr): the file alone.
        let o = RuntimeOptions::from_any_with(None, Some(&file)).unwrap();
        assert_eq!(o.binary_name, "/opt/runc");
        assert!(o.restore_mode());
        // A handler's own options table (runtimeoptions) is the whole configuration.
        let table = encode_runtime_options("", "BinaryName = \"/usr/sbin/runc\"\n");
        let o = RuntimeOptions::from_any_with(Some(&table), Some(&file)).unwrap();
        assert!(!o.restore_mode());
        // An unknown key in the file is named, with the file.
        std::fs::write(&file, "Frobnicate = 1\n").unwrap();
        let err = RuntimeOptions::from_any_with(Some(&any), Some(&file)).unwrap_err();
        assert_mentions(err, &["Frobnicate", "handler options file"]);
    }

    #[test]
    fn runc_options_are_decoded() {
        let runc = RuncOptions {
            binary_name: "/usr/sbin/runc".into(),
            root: "/run/x".into(),
            systemd_cgroup: true,
            ..Default::default()
        };
        let any = Any {
            type_url: "containerd.runc.v1.Options".into(),
            value: runc.write_to_bytes().unwrap(),
            ..Default::default()
        };
        let o = RuntimeOptions::from_any(Some(&any)).unwrap();
        assert_eq!(o.runc_binary(), "/usr/sbin/runc");
        assert_eq!(o.runc_root("default", Path::new("/b")), "/run/x/default");
        assert!(o.systemd_cgroup);
    }

    #[test]
    fn toml_body_is_decoded() {
        let any =
            encode_runtime_options("", "BinaryName = \"/usr/sbin/runc\"\nRoot = \"/run/r\"\n");
        let o = RuntimeOptions::from_any(Some(&any)).unwrap();
        assert_eq!(o.binary_name, "/usr/sbin/runc");
        assert_eq!(o.root, "/run/r");
    }

    #[test]
    fn config_path_is_read_when_body_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpu-ckpt.toml");
        std::fs::write(&path, "SystemdCgroup = true\n").unwrap();
        let any = encode_runtime_options(path.to_str().unwrap(), "");
        assert!(RuntimeOptions::from_any(Some(&any)).unwrap().systemd_cgroup);
    }

    #[test]
    fn unknown_key_is_named() {
        let any = encode_runtime_options("", "BinaryName = \"runc\"\nFrobnicate = 1\n");
        let err = RuntimeOptions::from_any(Some(&any))
            .unwrap_err()
            .to_string();
        assert!(err.contains("Frobnicate"), "{err}");
        assert!(matches!(
            RuntimeOptions::from_any(Some(&any)),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn events_and_otlp_options_are_decoded_and_checked() {
        let d = RuntimeOptions::default();
        assert_eq!(d.events_dir(), PathBuf::from(journal::DEFAULT_DIR));
        assert_eq!(d.events_segment_bytes(), journal::DEFAULT_SEGMENT_BYTES);
        // Empty: the environment's protocol, else http/protobuf, decided by telemetry::resolve.
        assert_eq!((d.otlp_endpoint(), d.otlp_protocol()), (None, ""));
        let o = RuntimeOptions::from_toml(
            "EventsDir = \"/var/lib/x/events\"\nEventsSegmentBytes = 1048576\nOtlpEndpoint = \"http://collector:4318\"\nOtlpProtocol = \"grpc\"\n",
            "t",
        )
        .unwrap();
        assert_eq!(o.events_dir(), PathBuf::from("/var/lib/x/events"));
        assert_eq!(o.events_segment_bytes(), 1 << 20);
        assert_eq!(o.otlp_endpoint(), Some("http://collector:4318"));
        assert_eq!(o.otlp_protocol(), "grpc");
        for (bad, key) in [
            ("EventsDir = \"events\"", "EventsDir"),
            ("EventsSegmentBytes = 100", "EventsSegmentBytes"),
            ("EventsSegmentBytes = 65536", "EventsSegmentBytes"),
            ("EventsSegmentBytes = 134217728", "EventsSegmentBytes"),
            (
                "OtlpEndpoint = \"https://c:4317\"\nOtlpProtocol = \"grpc\"",
                "OtlpEndpoint",
            ),
            ("OtlpProtocol = \"http/json\"", "OtlpProtocol"),
            ("OtlpEndpoint = \"collector:4318\"", "OtlpEndpoint"),
        ] {
            let err = RuntimeOptions::from_toml(bad, "t").unwrap_err().to_string();
            assert!(err.contains(key), "{bad}: {err}");
        }
    }

    #[test]
    fn bad_values_are_named() {
        let err = RuntimeOptions::from_toml("TcpMode = \"sometimes\"", "t").unwrap_err();
        assert!(err.to_string().contains("TcpMode"), "{err}");
        let err = RuntimeOptions::from_toml("Mode = \"x\"", "t").unwrap_err();
        assert!(err.to_string().contains("Mode"), "{err}");
        assert!(RuntimeOptions::from_toml("Mode = \"restore\"", "t")
            .unwrap()
            .restore_mode());
    }

    #[test]
    fn registry_options_are_decoded_and_checked() {
        let o = RuntimeOptions::from_toml(
            "RegistryHostsDir = \"/etc/gpu-ckpt/certs.d\"\nRegistryAuthFile = \"/etc/gpu-ckpt/auth.json\"\n",
            "t",
        )
        .unwrap();
        let r = o.registry_options();
        assert_eq!(
            r.hosts_dir.as_deref(),
            Some(Path::new("/etc/gpu-ckpt/certs.d"))
        );
        assert_eq!(
            r.auth_file.as_deref(),
            Some(Path::new("/etc/gpu-ckpt/auth.json"))
        );
        let d = RuntimeOptions::default().registry_options();
        assert_eq!(
            d.hosts_dir.as_deref(),
            Some(Path::new(registry::DEFAULT_HOSTS_DIR))
        );
        assert_eq!(d.auth_file, None);
        for bad in [
            "RegistryHostsDir = \"certs.d\"",
            "RegistryAuthFile = \"auth.json\"",
        ] {
            let err = RuntimeOptions::from_toml(bad, "t").unwrap_err().to_string();
            let key = bad.split(' ').next().unwrap_or_default();
            assert!(err.contains(key) && err.contains("absolute"), "{err}");
        }
    }

    #[test]
    fn device_storage_is_auto_or_staged_and_its_directory_absolute() {
        let o = RuntimeOptions::default();
        assert!(o.custom_device_storage());
        assert_eq!(
            o.device_storage_dir(),
            Path::new("/var/lib/gpu-ckpt/device-memory")
        );
        let o = RuntimeOptions::from_toml(
            "DeviceStorage = \"staged\"\nDeviceStorageDir = \"/srv/dev\"",
            "t",
        )
        .unwrap();
        assert!(!o.custom_device_storage());
        assert_eq!(o.device_storage_dir(), Path::new("/srv/dev"));
        assert!(RuntimeOptions::from_toml("DeviceStorage = \"auto\"", "t")
            .unwrap()
            .custom_device_storage());
        let err = RuntimeOptions::from_toml("DeviceStorage = \"fast\"", "t").unwrap_err();
        assert_mentions(err, &["DeviceStorage", "auto", "staged"]);
        let err = RuntimeOptions::from_toml("DeviceStorageDir = \"dev\"", "t").unwrap_err();
        assert_mentions(err, &["DeviceStorageDir", "absolute"]);
    }

    #[test]
    fn nccl_is_off_by_default_and_its_layer_and_timeout_are_checked() {
        let d = RuntimeOptions::default();
        assert!(!d.nccl_managed());
        assert_eq!(
            d.nccl_layer(),
            Path::new("/usr/local/lib/gpu-ckpt/libgpu-ckpt-nccl.so")
        );
        assert_eq!(
            d.nccl_timeout().unwrap(),
            std::time::Duration::from_secs(30)
        );
        let o = RuntimeOptions::from_toml(
            "Nccl = \"managed\"\nNcclLayer = \"/opt/gpu-ckpt/libgpu-ckpt-nccl.so\"\nNcclTimeout = \"1m30s\"",
            "t",
        )
        .unwrap();
        assert!(o.nccl_managed());
        assert_eq!(
            o.nccl_layer(),
            Path::new("/opt/gpu-ckpt/libgpu-ckpt-nccl.so")
        );
        assert_eq!(
            o.nccl_timeout().unwrap(),
            std::time::Duration::from_secs(90)
        );
        assert!(!RuntimeOptions::from_toml("Nccl = \"off\"", "t")
            .unwrap()
            .nccl_managed());
        assert_eq!(
            RuntimeOptions::from_toml("NcclTimeout = \"45\"", "t")
                .unwrap()
                .nccl_timeout()
                .unwrap(),
            std::time::Duration::from_secs(45)
        );
        assert_eq!(d.nccl_release(), "destroy");
        assert_eq!(
            RuntimeOptions::from_toml("NcclRelease = \"suspend\"", "t")
                .unwrap()
                .nccl_release(),
            "suspend"
        );
        let err = RuntimeOptions::from_toml("NcclRelease = \"keep\"", "t").unwrap_err();
        assert_mentions(err, &["NcclRelease", "\"keep\"", "destroy", "suspend"]);
        let err = RuntimeOptions::from_toml("Nccl = \"on\"", "t").unwrap_err();
        assert_mentions(err, &["Nccl", "\"on\"", "managed", "off"]);
        let err =
            RuntimeOptions::from_toml("NcclLayer = \"libgpu-ckpt-nccl.so\"", "t").unwrap_err();
        assert_mentions(err, &["NcclLayer", "absolute"]);
        let err = RuntimeOptions::from_toml("NcclTimeout = \"soon\"", "t").unwrap_err();
        assert_mentions(err, &["NcclTimeout", "soon", "duration"]);
    }

    #[test]
    fn the_restore_staging_dir_is_absolute_and_not_in_run_by_default() {
        let o = RuntimeOptions::from_toml("RestoreStagingDir = \"/srv/staging\"", "t").unwrap();
        assert_eq!(o.restore_staging_dir(), Path::new("/srv/staging"));
        let d = RuntimeOptions::default().restore_staging_dir();
        assert_eq!(d, Path::new("/var/lib/gpu-ckpt/restore"));
        let err = RuntimeOptions::from_toml("RestoreStagingDir = \"staging\"", "t").unwrap_err();
        assert_mentions(err, &["RestoreStagingDir", "absolute"]);
    }

    #[test]
    fn trust_options_are_decoded_and_checked() {
        let o = RuntimeOptions::from_toml(
            "AllowUnsigned = true\nNamespaceMoves = [\"default/tenant-b\"]\nRestoreSources = [\"/ckpt/\", \"registry.example.com/ckpt/\"]\nTrustedKeysDir = \"/etc/gpu-ckpt/trusted\"\nSigningKey = \"/k/node.key\"\n",
            "t",
        )
        .unwrap();
        assert!(o.allow_unsigned);
        assert!(o.namespace_move_allowed("default", "tenant-b"));
        assert!(!o.namespace_move_allowed("tenant-b", "default"));
        assert!(o.namespace_move_allowed("x", "x"));
        assert_eq!(o.restore_sources().len(), 2);
        assert_eq!(o.signing_key_path(), Path::new("/k/node.key"));
        assert_eq!(o.revoked_keys_path(), Path::new("/k/revoked"));
        let r = RuntimeOptions::from_toml("RevokedKeysFile = \"/etc/gpu-ckpt/revoked\"\n", "t")
            .unwrap();
        assert_eq!(r.revoked_keys_path(), Path::new("/etc/gpu-ckpt/revoked"));
        // Both lists are read: the configured one and the node's own beside the signing key.
        assert_eq!(
            r.revoked_keys_paths(),
            vec![
                PathBuf::from("/etc/gpu-ckpt/revoked"),
                PathBuf::from("/var/lib/gpu-ckpt/keys/revoked")
            ]
        );
        assert_eq!(
            o.revoked_keys_paths(),
            vec![
                PathBuf::from("/k/revoked"),
                PathBuf::from("/var/lib/gpu-ckpt/keys/revoked")
            ]
        );
        // A cluster signing key elsewhere: its list, and the node's default list still.
        let c = RuntimeOptions::from_toml(
            "SigningKey = \"/etc/gpu-ckpt/cluster-key/node.key\"\nRevokedKeysFile = \"/etc/gpu-ckpt/revoked\"\n",
            "t",
        )
        .unwrap();
        assert_eq!(
            c.revoked_keys_paths(),
            vec![
                PathBuf::from("/etc/gpu-ckpt/revoked"),
                PathBuf::from("/etc/gpu-ckpt/cluster-key/revoked"),
                PathBuf::from("/var/lib/gpu-ckpt/keys/revoked")
            ]
        );
        assert!(RuntimeOptions::from_toml("RevokedKeysFile = \"revoked\"\n", "t").is_err());
        let d = RuntimeOptions::default();
        assert_eq!(d.restore_sources(), vec!["/var/lib/kubelet/checkpoints/"]);
        assert_eq!(
            d.signing_key_path(),
            Path::new("/var/lib/gpu-ckpt/keys/node.key")
        );
        for bad in [
            "NamespaceMoves = [\"default\"]",
            "NamespaceMoves = [\"a/b/c\"]",
            "RestoreSources = [\"/a/../b\"]",
            "RestoreSources = [\"relative\"]",
            "RestoreSources = [\"registry.example.com/ckpt/%2e%2e/\"]",
            "RestoreSources = [\"registry.example.com@evil/\"]",
            "SigningKey = \"key\"",
        ] {
            let err = RuntimeOptions::from_toml(bad, "t").unwrap_err().to_string();
            let key = bad.split(' ').next().unwrap();
            assert!(err.contains(key), "{bad}: {err}");
        }
    }

    #[test]
    fn resume_after_dump_is_off_unless_the_handler_turns_it_on() {
        assert!(!RuntimeOptions::default().resume_after_dump);
        assert!(
            RuntimeOptions::from_toml("ResumeAfterDump = true", "t")
                .unwrap()
                .resume_after_dump
        );
        assert!(RuntimeOptions::from_toml("ResumeAfterDump = \"yes\"", "t").is_err());
        assert!(!RuntimeOptions::default().pod_resume_after_dump);
        assert!(
            RuntimeOptions::from_toml("PodResumeAfterDump = true", "t")
                .unwrap()
                .pod_resume_after_dump
        );
    }

    #[test]
    fn unknown_type_is_refused() {
        let any = Any {
            type_url: "example.com/Other".into(),
            value: vec![1, 2],
            ..Default::default()
        };
        let err = RuntimeOptions::from_any(Some(&any))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("example.com/Other") || err.contains("Other"),
            "{err}"
        );
    }

    #[test]
    fn bundle_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let o = RuntimeOptions {
            root: "/run/r".into(),
            ..Default::default()
        };
        o.write_to_bundle(dir.path()).unwrap();
        assert_eq!(RuntimeOptions::read_from_bundle(dir.path()).unwrap(), o);
    }
}
