//! A container this shim runs: its bundle, runc driver, init process and execs, and the steps
//! that create, start and delete it, each with its undo.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    ffi::OsString,
    os::unix::fs::PermissionsExt,
    panic::AssertUnwindSafe,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use containerd_shim::{
    asynchronous::io::Stdio,
    mount::umount_recursive,
    protos::api::CreateTaskRequest,
    util::{mount_rootfs, read_pid_from_file},
};
use oci_spec::runtime::{LinuxNamespaceType, Spec};
use tracing::{info, info_span, warn, Instrument};

use image_format::{
    digest::no_progress,
    manifest::{self, Manifest},
};

use crate::{
    annotations::{self, Annotations},
    checkpoint::{self, CheckpointPlan},
    criu_exit::{CriuExit, ExitWatch},
    device::ContainerDevices,
    error::{Error, Result},
    events::EventSender,
    mount_check,
    oom::{MemoryCgroup, OomMonitor},
    options::RuntimeOptions,
    process::{Process, Status},
    restore,
    runc::{CreateOpts, Runc},
    spec_check,
    stdio::{self, Absent},
    sub_mounts,
    verify_gate::VerifyGate,
    watchdog::{self, Watchdog},
};

const INIT_PID_FILE: &str = "init.pid";

pub struct Container {
    pub id: String,
    pub bundle: PathBuf,
    pub runc: Runc,
    pub options: RuntimeOptions,
    pub init: Process,
    pub execs: HashMap<String, Process>,
    oom: Option<Arc<OomMonitor>>,
    /// The container has no PID namespace of its own: when init dies, its other processes
    /// do not die with it and must be killed.
    shares_pid_namespace: bool,
    /// runc creates the container's network namespace, and CRIU dumps and restores it with
    /// the processes (a pod's containers join the sandbox's instead).
    own_network_namespace: bool,
    mounted_rootfs: bool,
    /// The spec's annotations (identity for the manifest) and the checked gpu-ckpt ones.
    spec_annotations: HashMap<String, String>,
    pub annotations: Annotations,
    /// Set when the container is to be restored from a checkpoint directory at start.
    restore_from: Option<PathBuf>,
    /// The checkpoint directory was unpacked by this shim with every digest verified (the
    /// restore handler): at Start its listing and sizes are checked again, not its digests.
    restore_unpacked: bool,
    /// The restore handler's staging directory of this container (`restore::staging_dir`),
    /// removed once Start's restore is done, or at Delete.
    restore_staging: Option<PathBuf>,
    /// runc hands CRIU the shim's configuration file (not one the spec names).
    own_criu_conf: bool,
    /// The overlay upper directory of the rootfs: the container's changes, of which a
    /// checkpoint keeps a signed copy (`rootfs_changes`).
    upperdir: Option<PathBuf>,
    /// The device layer's view of this container: its GPU processes, quiesced by Pause or a
    /// checkpoint until Resume or the checkpoint's end puts them back (`device.rs`).
    devices: ContainerDevices,
}

/// How long the follower of the dump's page images waits for new bytes before it looks again
/// (the end of the dump wakes it at once).
const FOLLOW_INTERVAL: Duration = Duration::from_millis(10);
/// Where the shim keeps CRIU's work files by default; removed after a checkpoint.
const CRIU_WORK: &str = "criu-work";

/// Reads and checks a bundle's config.json, with an error that names the file.
pub fn load_spec(bundle: &Path) -> Result<Spec> {
    let path = bundle.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        Error::InvalidArgument(format!("cannot read bundle config {}: {e}", path.display()))
    })?;
    serde_json::from_str::<Spec>(&text).map_err(|e| {
        Error::InvalidArgument(format!("malformed bundle config {}: {e}", path.display()))
    })
}

impl Container {
    /// Creates the container: options, rootfs, stdio, `runc create`. On failure every step
    /// already taken is undone, in reverse order, and the error says which step failed.
    pub async fn create(
        req: &CreateTaskRequest,
        namespace: &str,
        events: &EventSender,
    ) -> Result<Self> {
        let bundle = PathBuf::from(&req.bundle);
        let spec = load_spec(&bundle)?;
        let options = RuntimeOptions::from_any(req.options.as_ref())?;
        options.write_to_bundle(&bundle)?;
        let runc = Runc::new(&options, namespace, &bundle);
        // Namespaces runc creates for the container (an entry without a path), not joined ones.
        let creates = |typ: LinuxNamespaceType| {
            spec.linux()
                .as_ref()
                .and_then(|l| l.namespaces().as_ref())
                .is_some_and(|ns| ns.iter().any(|n| n.typ() == typ && n.path().is_none()))
        };
        let shares_pid_namespace = !creates(LinuxNamespaceType::Pid);
        let own_network_namespace = creates(LinuxNamespaceType::Network);

        // A restore: containerd's checkpoint (ctr container restore, CRI restore-via-create), or
        // a CRIU image directory named in the runc options (the containerd API's CriuImagePath).
        let restore_from = [req.checkpoint.as_str(), options.criu_image_path.as_str()]
            .into_iter()
            .find(|p| !p.is_empty())
            .map(PathBuf::from);
        let spec_annotations = spec.annotations().clone().unwrap_or_default();
        // containerd's own checkpoint (ctr container restore, CRI restore-via-create) gave
        // this spec its annotations from the archive's unsigned members: held to the signed
        // record before anything reads them.
        if !req.checkpoint.is_empty() {
            crate::restored_annotations::check_dir(
                Path::new(&req.checkpoint),
                &spec_annotations,
                &options,
            )?;
        }
        let annotations = Annotations::from_spec(&spec_annotations)?;
        let stdio = Stdio::new(&req.stdin, &req.stdout, &req.stderr, req.terminal);
        let devices = ContainerDevices::new(
            &bundle,
            &options,
            annotations.get(annotations::LOCK_TIMEOUT),
        );
        let mut container = Container {
            id: req.id.clone(),
            bundle: bundle.clone(),
            runc,
            options,
            init: Process::new("", stdio),
            execs: HashMap::new(),
            oom: None,
            shares_pid_namespace,
            own_network_namespace,
            mounted_rootfs: false,
            spec_annotations,
            annotations,
            restore_from,
            restore_unpacked: false,
            restore_staging: None,
            own_criu_conf: false,
            upperdir: None,
            devices,
        };

        // Step 1: the rootfs. Undo: unmount.
        if let Err(e) = container
            .mount_rootfs(req, &spec)
            .instrument(info_span!("mount_rootfs", id = %req.id))
            .await
        {
            container.unmount_rootfs();
            return Err(e);
        }
        // Step 2: the CRIU configuration file runc will use for this container's checkpoints.
        match checkpoint::CriuConf::default()
            .write(&bundle)
            .and_then(|_| checkpoint::point_runc_at_criu_conf(&bundle))
        {
            Ok(ours) => container.own_criu_conf = ours,
            Err(e) => {
                container.unmount_rootfs();
                return Err(e);
            }
        }
        // Step 3 (restore handler): the checkpoint the pod names for this container, fetched,
        // checked, unpacked and its rootfs diff applied. Undo: what it unpacked, the mount.
        // A checkpoint's image volume is mounted only by the container restoring from it.
        if container.restore_from.is_none() && container.options.restore_mode() {
            let prepared = container
                .prepare_own_restore(namespace)
                .instrument(info_span!("prepare_restore", id = %req.id))
                .await
                .and_then(|()| {
                    restore::refuse_checkpoint_volumes(&bundle, &container.spec_annotations)
                });
            if let Err(e) = prepared {
                if let Some(staging) = container.restore_staging.take() {
                    restore::remove_staging(&staging);
                }
                container.unmount_rootfs();
                return Err(e);
            }
        }
        // A restore creates nothing now: containerd lays the rootfs diff over the rootfs after
        // Create, and Start restores the process.
        if container.restore_from.is_some() {
            return Ok(container);
        }
        // Step 4: stdio and runc create. Undo: stop the copies, runc delete, unmount.
        if let Err(e) = container
            .runc_create()
            .instrument(info_span!("runc_create", id = %req.id))
            .await
        {
            container.init.io.tasks.abort().await;
            if let Err(de) = container.runc.delete(&container.id, true).await {
                warn!(id = %container.id, error = %de, "undo of a failed create: runc delete");
            }
            container.unmount_rootfs();
            return Err(e);
        }
        // Step 5: OOM watch (nothing to undo: it ends with the cgroup).
        container.watch_oom(events);
        Ok(container)
    }

    /// Under the restore handler, a container (not the pod's sandbox) whose pod names a
    /// checkpoint for it is set up to be restored from it at Start.
    async fn prepare_own_restore(&mut self, containerd_namespace: &str) -> Result<()> {
        let a = &self.spec_annotations;
        if a.get("io.kubernetes.cri.container-type")
            .map(String::as_str)
            != Some("container")
        {
            return Ok(());
        }
        let name = a
            .get("io.kubernetes.cri.container-name")
            .cloned()
            .unwrap_or_else(|| self.id.clone());
        let Some(source) = self.annotations.restore_from(&name).map(str::to_string) else {
            return Ok(());
        };
        let image = a
            .get("io.kubernetes.cri.image-name")
            .cloned()
            .unwrap_or_default();
        let namespace = a
            .get(crate::trust::SANDBOX_NAMESPACE)
            .cloned()
            .unwrap_or_default();
        let sandbox_id = a.get(crate::trust::SANDBOX_ID).cloned().unwrap_or_default();
        let staging = restore::staging_dir(&self.options, containerd_namespace, &self.id)?;
        self.restore_staging = Some(staging.clone());
        let bundle = self.bundle.clone();
        let ann = self.annotations.clone();
        let options = self.options.clone();
        let plan = tokio::task::spawn_blocking(move || {
            let me = restore::Identity {
                name: &name,
                image: &image,
                namespace: &namespace,
                sandbox_id: &sandbox_id,
            };
            restore::prepare(
                &bundle,
                &bundle.join("rootfs"),
                &staging,
                &source,
                &me,
                &ann,
                &options,
            )
        })
        .await
        .map_err(|e| Error::FailedPrecondition(format!("prepare restore: {e}")))??;
        match plan {
            restore::Plan::Restore(dir) => {
                self.restore_from = Some(dir);
                self.restore_unpacked = true;
            }
            // Read in place from an image volume: Start verifies all of it.
            restore::Plan::RestoreInPlace(dir) => {
                self.restore_from = Some(dir);
                self.restore_unpacked = false;
                self.restore_staging = None;
            }
            restore::Plan::ColdStart(_) => self.restore_staging = None,
        }
        Ok(())
    }

    fn watch_oom(&mut self, events: &EventSender) {
        if let Some(cgroup) = MemoryCgroup::of_pid(self.init.pid) {
            self.oom = Some(OomMonitor::start(&self.id, cgroup, events.clone()));
        }
    }

    async fn mount_rootfs(&mut self, req: &CreateTaskRequest, spec: &Spec) -> Result<()> {
        let rootfs = self.bundle.join("rootfs");
        if !req.rootfs.is_empty() {
            std::fs::create_dir_all(&rootfs)
                .map_err(Error::io(format!("create {}", rootfs.display())))?;
            self.mounted_rootfs = true;
            for m in &req.rootfs {
                mount_rootfs(m, &rootfs).await?;
            }
            self.upperdir = req
                .rootfs
                .iter()
                .rev()
                .find_map(|m| crate::rootfs_changes::upperdir_of(&m.type_, &m.options));
        }
        let root = spec
            .root()
            .as_ref()
            .map(|r| r.path().clone())
            .unwrap_or_else(|| PathBuf::from("rootfs"));
        let root = if root.is_absolute() {
            root
        } else {
            self.bundle.join(root)
        };
        if !root.is_dir() {
            return Err(Error::InvalidArgument(format!(
                "container rootfs {} does not exist",
                root.display()
            )));
        }
        Ok(())
    }

    fn unmount_rootfs(&mut self) {
        if self.mounted_rootfs {
            let rootfs = self.bundle.join("rootfs");
            if let Err(e) = umount_recursive(rootfs.to_str(), libc::MNT_DETACH) {
                warn!(id = %self.id, error = %e, "unmount rootfs");
            }
            self.mounted_rootfs = false;
        }
    }

    async fn runc_create(&mut self) -> Result<()> {
        let prepared = stdio::prepare(
            &self.init.stdio,
            &self.id,
            self.options.io_uid,
            self.options.io_gid,
            Absent::DevNull,
        )
        .await?;
        self.init.io = prepared.io;
        let pid_file = self.bundle.join(INIT_PID_FILE);
        let console = prepared.console;
        let console_path = console.as_ref().map(|c| c.path().to_path_buf());
        let opts = CreateOpts {
            pid_file: &pid_file,
            console_socket: console_path.as_deref(),
            no_pivot: self.options.no_pivot_root,
            no_new_keyring: self.options.no_new_keyring,
        };
        let create = self
            .runc
            .create(&self.id, &self.bundle, &opts, prepared.child);
        match console {
            Some(console) => {
                let stdio = self.init.stdio.clone();
                let mut io = self.init.io.clone();
                let (created, received) = tokio::join!(create, console.receive(&stdio, &mut io));
                created?;
                received?;
                self.init.io = io;
            }
            None => create.await?,
        }
        self.init.pid = read_pid_from_file(&pid_file).await?;
        Ok(())
    }

    pub async fn start_init(&mut self, events: &EventSender) -> Result<()> {
        match self.init.status {
            Status::Created => {}
            Status::Stopped => {
                return Err(Error::FailedPrecondition(format!(
                    "container {} has already exited",
                    self.id
                )))
            }
            _ => {
                return Err(Error::FailedPrecondition(format!(
                    "container {} is already started",
                    self.id
                )))
            }
        }
        if let Some(dir) = self.restore_from.clone() {
            let span = info_span!("restore", id = %self.id);
            let restored = self.restore(&dir).instrument(span).await;
            // The directory containerd extracted the checkpoint into (`ctr container restore`),
            // which containerd never removes: restored or not, nothing reads it again (a failed
            // Start is not retried on it), and it holds the process's memory.
            if self.options.criu_image_path.is_empty()
                && restore::is_containerd_extracted_checkpoint(&dir)
            {
                if let Err(e) = std::fs::remove_dir_all(&dir) {
                    warn!(id = %self.id, dir = %dir.display(), error = %e, "remove containerd's extracted checkpoint");
                }
            }
            // What the restore handler unpacked: CRIU has read it (runc restore returned).
            if let Some(staging) = self.restore_staging.take() {
                restore::remove_staging(&staging);
            }
            restored?;
            self.watch_oom(events);
        } else {
            self.runc.start(&self.id).await?;
        }
        self.init.status = Status::Running;
        Ok(())
    }

    /// Restores the container's process tree from the checkpoint directory `dir`.
    async fn restore(&mut self, dir: &Path) -> Result<()> {
        // A CRIU older than the minimum fails here, before anything is read.
        crate::criu::version().await?;
        // Step 1: verify the checkpoint against its manifest: listing, sizes, and the digest of
        // every file but the page images, before CRIU reads any of it. The page images are
        // hashed while CRIU restores them (step 3) when the gate can hold the restored tasks;
        // otherwise here too. A checkpoint this shim unpacked, verifying every digest as it
        // wrote it into a directory only it writes, is not hashed a second time.
        let overlap = self.own_criu_conf;
        let unpacked = self.restore_unpacked;
        let t = Instant::now();
        // The signature and its signer, and the namespace, for every way a restore arrives
        // (`trust::check_dir`); the restore handler checked them at Create already.
        let namespace = self
            .spec_annotations
            .get(crate::trust::SANDBOX_NAMESPACE)
            .cloned()
            .unwrap_or_default();
        let (verdict, signed_manifest) =
            crate::trust::check_dir(dir, &self.options, &namespace, !unpacked)?;
        let (manifest, deferred) = tokio::task::spawn_blocking({
            let dir = dir.to_path_buf();
            move || {
                let defer = |name: &str| unpacked || (overlap && manifest::is_page_image(name));
                manifest::verify_dir_staged(&dir, &defer, &mut no_progress)
            }
        })
        .await
        .map_err(|e| restore::step("verify")(e.to_string()))?
        .map_err(|e| restore::step("verify")(e.to_string()))?;
        if manifest != signed_manifest {
            return Err(restore::step("verify")(format!(
                "the manifest in {} changed while it was verified",
                dir.display()
            )));
        }
        // containerd laid its rootfs-diff.tar (which no signature covers) over the rootfs:
        // the signed copy of the container's changes goes over it again.
        if !unpacked && matches!(verdict, crate::trust::Verdict::Signed { .. }) {
            if let Some(copy) = crate::rootfs_changes::exists(dir) {
                let rootfs = self.bundle.join("rootfs");
                let ids = spec_check::Policy::from_bundle(&self.bundle)?;
                tokio::task::spawn_blocking(move || {
                    restore::apply_rootfs_diff(&copy, &rootfs, restore::DiffFormat::Own, &ids)
                })
                .await
                .map_err(|e| restore::step("rootfs-diff")(e.to_string()))?
                .map_err(|e| restore::step("rootfs-diff")(e.to_string()))?;
            }
        }
        let deferred = if unpacked {
            manifest::DeferredDigests::default()
        } else {
            deferred
        };
        let verified_first = t.elapsed();
        // Step 1b: the checkpoint's own record of its tasks' credentials and seccomp state
        // (CRIU's core and seccomp images, verified above) and of the seccomp profile it ran
        // under (the manifest), held to this container's spec: the usual mismatch fails here,
        // before CRIU starts (`spec_check.rs`).
        let policy = Arc::new(spec_check::Policy::from_bundle(&self.bundle)?);
        let expected = tokio::task::spawn_blocking({
            let (dir, policy) = (dir.to_path_buf(), policy.clone());
            let record = manifest.security.clone();
            move || spec_check::check_checkpoint(&dir, &policy, record.as_ref())
        })
        .instrument(info_span!("spec_check", id = %self.id))
        .await
        .map_err(|e| restore::step("spec-check")(e.to_string()))??;
        let expected = Arc::new(expected);
        // Step 1c: the checkpoint's GPUs held to the ones this container was given on this
        // node (model, count, memory, free memory, driver branch, CUDA version), and the pairs
        // that map one onto the other, in order.
        let device_plan = self
            .devices
            .plan_restore(&manifest.devices)
            .instrument(info_span!("device_compat", id = %self.id))
            .await?;
        // Step 1d: the spec's mounts, each of which the checkpoint must have a mount for: CRIU
        // restores only the checkpoint's mounts and would leave an empty directory for a new
        // one (`mount_check.rs`).
        let spec = load_spec(&self.bundle)?;
        let mount_policy = mount_check::MountPolicy::from_spec(&spec);
        tokio::task::spawn_blocking({
            let (dir, mount_policy) = (dir.to_path_buf(), mount_policy.clone());
            let rootfs = self.bundle.join("rootfs");
            move || mount_check::refuse_new_mounts(&dir, &rootfs, &mount_policy)
        })
        .instrument(info_span!("mount_check", id = %self.id))
        .await
        .map_err(|e| restore::step("spec-check")(e.to_string()))??;
        // Step 2: CRIU configuration. Connections are closed when the checkpoint closed them or
        // this container asks for it (a new address). The gate holds the restored tasks until
        // the page images are verified. Undo: the configuration goes back to the checkpoints'.
        let tcp_close = manifest.criu.tcp == "close"
            || self.annotations.get(annotations::TCP) == Some("close")
            || (self.annotations.get(annotations::TCP).is_none()
                && self.options.tcp_mode == "close");
        // Established connections come back bound to the addresses they were dumped on: only
        // into a namespace that has them all (`pod_network.rs`).
        if manifest.criu.tcp == "established" && !tcp_close {
            let spec = load_spec(&self.bundle)?;
            let recorded = manifest.container.addresses.clone();
            tokio::task::spawn_blocking(move || -> Result<()> {
                match crate::pod_network::addresses_for_spec(&spec)? {
                    Some((here, which)) => {
                        crate::pod_network::check_established(recorded.as_deref(), &here, &which)
                    }
                    // Its own namespace, which CRIU restores with the checkpoint's addresses.
                    None => Ok(()),
                }
            })
            .instrument(info_span!("pod_network", id = %self.id))
            .await
            .map_err(|e| restore::step("network")(e.to_string()))?
            .map_err(|e| restore::step("network")(e.to_string()))?;
        }
        // Sub-mounts of the checkpoint's bind mounts (its list, verified in step 1) go to the
        // host paths below the new spec's mounts at the same destinations, resolved without a
        // symlink and held open until the gate has checked that CRIU mounted them.
        let (ext_mount_map, held) = {
            let _span = info_span!("sub_mounts", id = %self.id).entered();
            let list =
                sub_mounts::read_list(dir).map_err(|e| restore::step("prepare")(e.to_string()))?;
            if list.is_empty() {
                (Vec::new(), Vec::new())
            } else {
                let held = sub_mounts::hold_all(&list, &spec)
                    .map_err(|e| restore::step("prepare")(e.to_string()))?;
                let map = sub_mounts::restore_map(&held);
                info!(id = %self.id, count = map.len(), "sub-mounts of bind mounts mapped for CRIU");
                if !self.own_criu_conf {
                    warn!(id = %self.id, "the spec names its own CRIU configuration: the sub-mounts are not mapped");
                }
                (map, held)
            }
        };
        let mounts = Arc::new(mount_check::Mounts {
            policy: mount_policy,
            held,
        });
        let gate = Arc::new(
            VerifyGate::create(&self.bundle)
                .map_err(|e| restore::step("prepare")(e.to_string()))?,
        );
        let conf = checkpoint::CriuConf {
            tcp_close,
            action_script: Some(gate.script()),
            ext_mount_map: &ext_mount_map,
            ..Default::default()
        };
        conf.write(&self.bundle)
            .map_err(|e| restore::step("prepare")(e.to_string()))?;
        // Step 3: the page images' digests, in parallel with runc restore; the verdict opens
        // the gate. Undo: cancel the hashing.
        let cancel = Arc::new(AtomicBool::new(false));
        let verified = tokio::task::spawn_blocking({
            let (cancel, gate) = (cancel.clone(), gate.clone());
            move || -> Result<Duration> {
                let t = Instant::now();
                // A verdict whatever happens: CRIU waits for one.
                let result =
                    std::panic::catch_unwind(AssertUnwindSafe(|| deferred.verify(&cancel)))
                        .unwrap_or_else(|_| {
                            Err(image_format::Error::Cancelled {
                                name: "page images (the verification panicked)".into(),
                            })
                        });
                gate.open(result.is_ok())?;
                result?;
                Ok(t.elapsed())
            }
        });
        // Step 3b: the restored tree held to the spec at the gate's pre-resume, where CRIU has
        // restored every task's credentials and seccomp filters and every mount, and none has
        // run: the spec's mount flags applied, then credentials and mounts checked; a refusal
        // kills the tree there and CRIU fails the restore.
        let held = tokio::task::spawn_blocking({
            let (gate, policy, expected, mounts) = (
                gate.clone(),
                policy.clone(),
                expected.clone(),
                mounts.clone(),
            );
            let span = info_span!("spec_check_restored", id = %self.id);
            move || {
                let _span = span.enter();
                spec_check::hold_at_gate(&gate, &policy, &expected, &mounts)
            }
        });
        // Step 4: runc restore; CRIU waits at the gate. Undo (in `run_restore`): stop the
        // copies, runc delete. Every wait of steps 3 and 4 is bounded (`watchdog.rs`).
        let checkpoint_bytes: u64 = manifest.files.values().map(|f| f.size).sum();
        let watchdog = Watchdog::start(
            watchdog::bound(&self.options, checkpoint_bytes)?,
            &self.bundle,
            gate.clone(),
            cancel.clone(),
        );
        let t = Instant::now();
        let restored = self.run_restore(dir, &manifest, tcp_close).await;
        let runc_restore = t.elapsed();
        if restored.is_err() {
            cancel.store(true, Ordering::Relaxed);
        }
        let verified = verified
            .await
            .unwrap_or_else(|e| Err(Error::FailedPrecondition(format!("page verification: {e}"))));
        if let Err(e) = gate.no_root() {
            warn!(id = %self.id, error = %e, "release the restore gate's spec check");
        }
        let held = held.await.unwrap_or_else(|e| {
            Some(Err(Error::FailedPrecondition(format!(
                "restore refused: the check of the restored tree failed: {e}"
            ))))
        });
        let held = match (held, &restored) {
            (Some(verdict), _) => verdict,
            // The gate's pre-resume did not run (a CRIU configuration the spec names): the tree
            // is checked now, after it has resumed, and killed if it is beyond the spec.
            (None, Ok(())) => {
                warn!(id = %self.id, "restored tasks were not held at pre-resume: checked after they resumed");
                let (pid, policy, expected, mounts) = (
                    self.init.pid,
                    policy.clone(),
                    expected.clone(),
                    mounts.clone(),
                );
                tokio::task::spawn_blocking(move || {
                    let verdict = spec_check::check_tree(pid, &policy, &expected)
                        .and_then(|()| mounts.hold(pid));
                    if verdict.is_err() {
                        spec_check::kill_restored(pid);
                    }
                    verdict
                })
                .instrument(info_span!("spec_check_restored", id = %self.id))
                .await
                .unwrap_or_else(|e| {
                    Err(Error::FailedPrecondition(format!(
                        "restore refused: the check of the restored tree failed: {e}"
                    )))
                })
            }
            (None, Err(_)) => Ok(()),
        };
        drop(gate);
        if let Err(e) = checkpoint::CriuConf::default().write(&self.bundle) {
            warn!(id = %self.id, error = %e, "CRIU configuration after a restore");
        }
        // Past the bound, whatever else happened, the restore fails, and nothing it restored
        // may run on.
        let (deadline, bound) = (watchdog.deadline(), watchdog.bound());
        if let Err(e) = watchdog.stop() {
            self.init.io.tasks.abort().await;
            if let Err(de) = self.runc.delete(&self.id, true).await {
                if !de.to_string().contains("does not exist") {
                    warn!(id = %self.id, error = %de, "undo of a restore past its bound: runc delete");
                }
            }
            return Err(e);
        }
        match (restored, verified, held) {
            (Ok(()), Ok(pages), Ok(())) => {
                // Step 5: the device state back onto this container's GPUs, unlocked, every
                // process confirmed RUNNING, before Start returns, within what is left of the
                // restore's bound. Undo: kill what was restored (which also ends a driver call
                // still waiting on it).
                let t = Instant::now();
                let recorded = &manifest.devices.processes;
                let devices = if recorded.is_empty() {
                    Ok(())
                } else {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let steps = async {
                        let pids = self.runc.ps(&self.id).await?;
                        self.devices
                            .restore(recorded, pids, &device_plan)
                            .instrument(info_span!("device_restore", id = %self.id))
                            .await
                    };
                    tokio::time::timeout(left, steps).await.unwrap_or_else(|_| {
                        Err(restore::step("device-restore")(format!(
                            "not done within {}: the driver did not finish restoring the device state; the restored tasks were killed",
                            watchdog::describe(bound)
                        )))
                    })
                };
                if let Err(e) = devices {
                    self.init.io.tasks.abort().await;
                    if let Err(de) = self.runc.delete(&self.id, true).await {
                        warn!(id = %self.id, error = %de, "undo of a failed device restore: runc delete");
                    }
                    return Err(e);
                }
                info!(
                    id = %self.id,
                    verify_ms = verified_first.as_millis() as u64,
                    page_verify_ms = pages.as_millis() as u64,
                    runc_restore_ms = runc_restore.as_millis() as u64,
                    device_restore_ms = t.elapsed().as_millis() as u64,
                    "restored"
                );
                Ok(())
            }
            (Err(e), Err(Error::Image(image_format::Error::Cancelled { .. })), _) => Err(e),
            // The verdict is the cause: the gate made CRIU abort, or, were the gate bypassed
            // (a CRIU configuration the spec names), the restored tasks are killed here.
            (Err(_), Err(e), _) => Err(restore::step("verify")(format!(
                "{e}; CRIU aborted the restore before the restored tasks ran"
            ))),
            (Ok(()), Err(e), _) => {
                self.init.io.tasks.abort().await;
                if let Err(de) = self.runc.delete(&self.id, true).await {
                    warn!(id = %self.id, error = %de, "undo of a refused restore: runc delete");
                }
                Err(restore::step("verify")(format!(
                    "{e}; the restored tasks were killed"
                )))
            }
            // The restored tree was beyond the spec: killed at the gate, so CRIU failed.
            (Err(_), Ok(_), Err(e)) => Err(spec_check::with_note(
                e,
                "the restored tasks were killed before they ran",
            )),
            (Ok(()), Ok(_), Err(e)) => {
                self.init.io.tasks.abort().await;
                if let Err(de) = self.runc.delete(&self.id, true).await {
                    warn!(id = %self.id, error = %de, "undo of a refused restore: runc delete");
                }
                Err(spec_check::with_note(e, "the restored tasks were killed"))
            }
            (Err(e), Ok(_), Ok(())) => Err(e),
        }
    }

    /// `runc restore` of `dir` with the container's IO; reads the restored pid.
    async fn run_restore(
        &mut self,
        dir: &Path,
        manifest: &Manifest,
        tcp_close: bool,
    ) -> Result<()> {
        let work = if self.options.criu_work_path.is_empty() {
            self.bundle.join(CRIU_WORK)
        } else {
            PathBuf::from(&self.options.criu_work_path)
        };
        std::fs::create_dir_all(&work).map_err(|e| restore::step("prepare")(e.to_string()))?;
        let prepared = stdio::prepare(
            &self.init.stdio,
            &self.id,
            self.options.io_uid,
            self.options.io_gid,
            Absent::Pipe,
        )
        .await?;
        let mut io = prepared.io;
        let console = prepared.console;
        let console_path = console.as_ref().map(|c| c.path().to_path_buf());
        let pid_file = self.bundle.join(INIT_PID_FILE);
        let opts = CreateOpts {
            pid_file: &pid_file,
            console_socket: console_path.as_deref(),
            no_pivot: self.options.no_pivot_root,
            no_new_keyring: false,
        };
        let args = checkpoint::restore_args(&manifest.criu, tcp_close);
        let restore = self.runc.restore(
            &self.id,
            &self.bundle,
            dir,
            &work,
            &opts,
            &args,
            prepared.child,
        );
        let criu_exit = ExitWatch::for_container(&self.id);
        let result = match console {
            Some(console) => {
                let stdio = self.init.stdio.clone();
                let (restored, received) = tokio::join!(restore, console.receive(&stdio, &mut io));
                restored.and(received)
            }
            None => restore.await,
        };
        let criu_ended = finish_watch(criu_exit, result.is_err()).await;
        let result = match result {
            Ok(()) => read_pid_from_file(&pid_file).await.map_err(Error::from),
            Err(e) => Err(e),
        };
        match result {
            Ok(pid) => {
                self.init.io = io;
                self.init.pid = pid;
                if self.options.criu_work_path.is_empty() {
                    let _ = std::fs::remove_dir_all(&work);
                }
                Ok(())
            }
            Err(e) => {
                io.tasks.abort().await;
                let log = work.join("restore.log");
                let kept = self.bundle.join(checkpoint::RESTORE_LOG_COPY);
                let _ = std::fs::copy(&log, &kept);
                let message = checkpoint::criu_failure(&e.to_string(), &log, &kept, &criu_ended);
                if let Err(de) = self.runc.delete(&self.id, true).await {
                    if !de.to_string().contains("does not exist") {
                        warn!(id = %self.id, error = %de, "undo of a failed restore: runc delete");
                    }
                }
                Err(Error::Step {
                    operation: "restore",
                    step: "criu-restore",
                    message,
                })
            }
        }
    }

    /// Pause: the device state leaves the GPUs first (lock, then checkpoint, every process that
    /// holds some), since the driver's restore thread cannot run in a frozen cgroup; then the
    /// freeze. containerd pauses a task before it checkpoints it (ctr, the containerd client,
    /// CRI), so this is where a checkpoint's device steps run. Undo: device resume.
    pub async fn pause(&mut self) -> Result<()> {
        self.quiesce_devices().await?;
        if let Err(e) = self.runc.pause(&self.id).await {
            if let Err(de) = self.devices.resume().await {
                warn!(id = %self.id, error = %de, "undo of a failed pause: device resume");
            }
            return Err(e);
        }
        Ok(())
    }

    /// Device quiesce of the container's processes, on a node with a driver (no `runc ps`
    /// elsewhere).
    async fn quiesce_devices(&mut self) -> Result<()> {
        if !self.devices.active().await? {
            return Ok(());
        }
        let pids = self.runc.ps(&self.id).await?;
        self.devices
            .quiesce(pids)
            .instrument(info_span!("device_quiesce", id = %self.id))
            .await
    }

    /// Resume: thaw, then the device state back onto the GPUs and unlocked (whether or not a
    /// checkpoint came in between).
    pub async fn resume(&mut self) -> Result<()> {
        if let Err(e) = self.runc.resume(&self.id).await {
            // A dump whose CRIU was killed leaves the cgroup thawed: runc finds the container
            // running ("container not paused"), which is what Resume is for.
            if !e.to_string().contains("container not paused") {
                return Err(e);
            }
            warn!(id = %self.id, error = %e, "resume of a container that is no longer frozen");
        }
        self.devices
            .resume()
            .instrument(info_span!("device_resume", id = %self.id))
            .await
    }

    /// Checkpoints the container, device state included, into `plan.image_path`:
    ///
    /// 0. device quiesce, for a running container (a paused one had it at Pause). Undo: device
    ///    resume.
    /// 1. to 3. image directory, CRIU dump, manifest ([`Container::checkpoint_files`]).
    /// 4. leave-running: device resume of what step 0 quiesced (a paused container's waits for
    ///    Resume); `--exit`: nothing is left to resume.
    ///
    /// On failure the container runs on as before, with its device memory back on its GPUs.
    pub async fn checkpoint(&mut self, plan: &CheckpointPlan) -> Result<Manifest> {
        if !matches!(self.init.status, Status::Running | Status::Paused) {
            return Err(Error::FailedPrecondition(format!(
                "container {} is not running",
                self.id
            )));
        }
        // A CRIU older than the minimum fails here, before anything is touched.
        crate::criu::version().await?;
        let here = self.init.status == Status::Running;
        if here {
            self.quiesce_devices().await?;
        }
        let result = match self.devices.record().await {
            Ok(devices) => self.checkpoint_files(plan, devices).await,
            Err(e) => Err(e),
        };
        let result = result.map_err(|e| match (self.devices.left_alone(), e) {
            (
                Some(why),
                Error::Step {
                    operation,
                    step,
                    message,
                },
            ) => Error::Step {
                operation,
                step,
                message: format!("{why}; {message}"),
            },
            (Some(why), e) => Error::FailedPrecondition(format!("{why}; {e}")),
            (None, e) => e,
        });
        if result.is_ok() && !plan.criu.leave_running {
            self.devices.forget();
        } else if here {
            let resumed = self
                .devices
                .resume()
                .instrument(info_span!("device_resume", id = %self.id))
                .await;
            if let Err(de) = resumed {
                return Err(match result {
                    Ok(_) => de,
                    Err(e) => Error::FailedPrecondition(format!("{e}; and its undo failed: {de}")),
                });
            }
        }
        result
    }

    /// Steps 1 to 3 of a checkpoint: CRIU dump, then the manifest (with `devices`) written
    /// last, so a directory without a manifest is never a complete checkpoint. On failure
    /// every file the checkpoint wrote is removed and the container runs on as before.
    async fn checkpoint_files(
        &self,
        plan: &CheckpointPlan,
        devices: manifest::Devices,
    ) -> Result<Manifest> {
        let fail = |step: &'static str, message: String| Error::Step {
            operation: "checkpoint",
            step,
            message,
        };
        // Step 1: the image directory, root-only (checkpoints hold process memory).
        let image = &plan.image_path;
        let created_dir = !image.exists();
        std::fs::create_dir_all(image)
            .and_then(|_| std::fs::set_permissions(image, std::fs::Permissions::from_mode(0o700)))
            .map_err(|e| {
                fail(
                    "prepare",
                    format!("image directory {}: {e}", image.display()),
                )
            })?;
        let before = dir_names(image);
        let undo = || {
            for name in dir_names(image).difference(&before) {
                let _ = std::fs::remove_file(image.join(name));
            }
            if created_dir {
                let _ = std::fs::remove_dir(image);
            }
        };
        let work = plan
            .work_path
            .clone()
            .unwrap_or_else(|| self.bundle.join(CRIU_WORK));
        // CRIU's network lock (iptables rules in the container's own network namespace, put
        // in at the dump and taken out at the end of the restore: about 60 ms of
        // iptables-restore runs) holds TCP conversations still. A paused container whose own
        // namespace has no TCP connection and no interface but loopback has none to hold, and
        // none can start before CRIU freezes it.
        // `network-lock skip` from CRIU 4.2 on (4.1 crashes on it).
        let skip_network_lock = crate::criu::version()
            .await
            .is_ok_and(|v| v.network_lock_skip())
            && self.own_network_namespace
            && self.init.status == Status::Paused
            && checkpoint::nothing_to_lock(self.init.pid);
        if skip_network_lock {
            info!(id = %self.id, "network namespace of its own with no TCP connection and only loopback: CRIU's network lock skipped");
        }
        // Mounts below the spec's bind mounts (an rbind's or a recursive read-only mount's
        // sub-mounts), which runc does not map for CRIU: marked external under a key, and
        // listed in the image directory for the restore to map to the new spec's host paths.
        let found = {
            let _span = info_span!("sub_mounts", id = %self.id).entered();
            load_spec(&self.bundle).and_then(|spec| {
                sub_mounts::of_process(self.init.pid, &spec)
                    .map_err(|e| Error::FailedPrecondition(e.to_string()))
            })
        };
        if let Ok(list) = &found {
            if !list.is_empty() {
                info!(id = %self.id, count = list.len(), "sub-mounts of bind mounts marked external for CRIU");
                if !self.own_criu_conf {
                    warn!(id = %self.id, "the spec names its own CRIU configuration: the sub-mounts are not mapped");
                }
            }
        }
        let mapped_sub_mounts = match std::fs::create_dir_all(&work)
            .map_err(|e| fail("prepare", format!("work directory {}: {e}", work.display())))
            .and_then(|_| found.map_err(|e| fail("prepare", e.to_string())))
            .and_then(|list| {
                let map = sub_mounts::dump_map(&list);
                let conf = checkpoint::CriuConf {
                    tcp_close: plan.criu.tcp == "close",
                    skip_network_lock,
                    action_script: None,
                    ext_mount_map: &map,
                };
                conf.write(&self.bundle)
                    .map_err(|e| fail("prepare", e.to_string()))?;
                if !list.is_empty() {
                    sub_mounts::write_list(image, &list)
                        .map_err(|e| fail("prepare", e.to_string()))?;
                }
                Ok(!list.is_empty())
            }) {
            Ok(mapped) => mapped,
            Err(e) => {
                undo();
                if let Err(e) = checkpoint::CriuConf::default().write(&self.bundle) {
                    warn!(id = %self.id, error = %e, "CRIU configuration after a checkpoint");
                }
                return Err(e);
            }
        };
        // The addresses of its network namespace (the pod's IPs), which established TCP
        // connections are bound to, for the manifest: read before the dump, which may end
        // the process. A checkpoint of established connections fails without them.
        let addresses = {
            let pid = self.init.pid;
            let read =
                tokio::task::spawn_blocking(move || crate::pod_network::addresses_of_pid(pid))
                    .await
                    .map_err(|e| {
                        Error::FailedPrecondition(format!("read the network addresses: {e}"))
                    })
                    .and_then(|r| r);
            match read {
                Ok(a) => Some(a),
                Err(e) if plan.criu.tcp == "established" => {
                    undo();
                    if let Err(e) = checkpoint::CriuConf::default().write(&self.bundle) {
                        warn!(id = %self.id, error = %e, "CRIU configuration after a checkpoint");
                    }
                    return Err(fail(
                        "prepare",
                        format!("the addresses its established TCP connections are bound to: {e}"),
                    ));
                }
                Err(e) => {
                    warn!(id = %self.id, error = %e, "network addresses not recorded");
                    None
                }
            }
        };
        let mut timings = Vec::new();

        // Step 2: CRIU dump through runc, its page images hashed as CRIU writes them (and the
        // versions for the manifest read meanwhile). Undo: remove what it wrote; CRIU resumes
        // the tasks.
        let t = Instant::now();
        let dumped_all = Arc::new(manifest::WriterDone::default());
        let follower = tokio::task::spawn_blocking({
            let (image, dumped_all, pages) = (image.clone(), dumped_all.clone(), plan.page_digests);
            let skip = before
                .iter()
                .filter_map(|n| n.to_str().map(str::to_string))
                .collect();
            move || -> image_format::Result<BTreeMap<String, manifest::FileDigest>> {
                manifest::AppendHasher::new(&image, manifest::is_page_image, skip, pages)
                    .follow_until(&dumped_all, FOLLOW_INTERVAL)
            }
        });
        let runc_args = plan.runc_args();
        let criu_exit = ExitWatch::for_container(&self.id);
        let (dumped, node) = tokio::join!(
            self.runc
                .checkpoint(&self.id, image, &work, &runc_args)
                .instrument(info_span!("criu_dump", id = %self.id)),
            node_info(&self.runc)
        );
        dumped_all.set();
        let criu_ended = finish_watch(criu_exit, dumped.is_err()).await;
        // The lock decision and the sub-mounts' keys held for this dump only.
        if skip_network_lock || mapped_sub_mounts {
            if let Err(e) = checkpoint::CriuConf::default().write(&self.bundle) {
                warn!(id = %self.id, error = %e, "CRIU configuration after a checkpoint");
            }
        }
        // What the follower hashed saves the manifest step that much; if it failed, the
        // manifest step hashes everything itself.
        let followed = follower
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()))
            .unwrap_or_else(|e| {
                warn!(id = %self.id, error = %e, "hashing page images during the dump");
                BTreeMap::new()
            });
        if let Err(e) = dumped {
            let log = work.join("dump.log");
            let kept = self.bundle.join(checkpoint::DUMP_LOG_COPY);
            let _ = std::fs::copy(&log, &kept);
            let message = checkpoint::criu_failure(&e.to_string(), &log, &kept, &criu_ended);
            undo();
            return Err(fail("criu-dump", message));
        }
        timings.push(("criu-dump", t.elapsed()));
        // CRIU's own statistics travel with the images (checkpointctl and `gpu-ckpt inspect`
        // show them); CRIU wrote them to the work directory.
        let stats = work.join("stats-dump");
        if stats.exists() && !image.join("stats-dump").exists() {
            if let Err(e) = std::fs::copy(&stats, image.join("stats-dump")) {
                warn!(id = %self.id, error = %e, "keep CRIU's dump statistics");
            }
        }

        // Step 3: the manifest, written last. Undo: remove everything the checkpoint wrote.
        let written = self
            .write_manifest(plan, node, devices, followed, addresses, &mut timings)
            .instrument(info_span!("manifest", id = %self.id))
            .await;
        if plan.work_path.is_none() {
            let _ = std::fs::remove_dir_all(&work);
        }
        match written {
            Ok(m) => Ok(m),
            Err(e) => {
                undo();
                Err(fail("manifest", e.to_string()))
            }
        }
    }

    async fn write_manifest(
        &self,
        plan: &CheckpointPlan,
        node: manifest::Node,
        devices: manifest::Devices,
        followed: BTreeMap<String, manifest::FileDigest>,
        addresses: Option<Vec<String>>,
        timings: &mut Vec<(&'static str, std::time::Duration)>,
    ) -> Result<Manifest> {
        let started = Instant::now();
        let image = plan.image_path.clone();
        let a = &self.spec_annotations;
        let get = |k: &str| a.get(k).cloned().unwrap_or_default();
        let name = a
            .get("io.kubernetes.cri.container-name")
            .cloned()
            .unwrap_or_else(|| self.id.clone());
        let container = manifest::Container {
            id: self.id.clone(),
            name,
            pod_name: get("io.kubernetes.cri.sandbox-name"),
            pod_namespace: get(crate::trust::SANDBOX_NAMESPACE),
            pod_uid: get(crate::trust::SANDBOX_UID),
            image: get("io.kubernetes.cri.image-name"),
            image_digest: String::new(),
            annotations: crate::restored_annotations::record(a),
            addresses,
        };
        let workload = manifest::Workload {
            engine_version: get(annotations::ENGINE_VERSION),
            model_version: get(annotations::MODEL_VERSION),
        };
        let mut m = Manifest::new(now_rfc3339(), container, node, devices, workload);
        m.criu = plan.criu.clone();
        // The security context it ran under, for the restore's check against its new spec.
        m.security = spec_check::security_record(&self.bundle);
        let pages = plan.page_digests;
        // The node key (made on first use), and a copy of the container's rootfs changes in the
        // image directory, so that the signature covers them (containerd's rootfs-diff.tar comes
        // after the shim returns).
        let key = if self.options.sign_checkpoints() {
            Some(crate::trust::node_key(&self.options)?)
        } else {
            None
        };
        let upper = self.upperdir.clone();
        // Owners are recorded as the container sees them (its user namespace mappings).
        let ids = spec_check::Policy::from_bundle(&self.bundle)?;
        let mut m = tokio::task::spawn_blocking(move || -> Result<Manifest> {
            let mut m = m;
            if let Some(upper) = upper.filter(|u| u.is_dir()) {
                let copy = image.join(manifest::ROOTFS_CHANGES_FILE);
                let _ = std::fs::remove_file(&copy);
                crate::rootfs_changes::write(&upper, &copy, &ids)?;
            }
            restrict_files(&image)?;
            m.files = manifest::hash_dir_flat_with(&image, followed, pages, &mut no_progress)?;
            Ok(m)
        })
        .await
        .map_err(|e| Error::FailedPrecondition(format!("hash checkpoint: {e}")))??;
        timings.push(("manifest-hash", started.elapsed()));
        for (step, d) in timings.iter() {
            m.add_timing(*step, d.as_secs_f64() * 1000.0);
        }
        if let Some(key) = &key {
            key.sign_manifest(&mut m)?;
        }
        m.write_durable(&plan.image_path, plan.durability)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        Ok(m)
    }

    /// Starts an exec process with `runc exec --detach`; returns its pid.
    pub async fn start_exec(&mut self, exec_id: &str) -> Result<i32> {
        if self.init.is_stopped() {
            return Err(Error::FailedPrecondition(format!(
                "container {} is not running",
                self.id
            )));
        }
        let bundle = self.bundle.clone();
        let process = self.exec_mut(exec_id)?;
        if process.status != Status::Created {
            return Err(Error::FailedPrecondition(format!(
                "exec {exec_id} is already started"
            )));
        }
        let spec_path = bundle.join(format!("exec-{exec_id}.json"));
        std::fs::write(&spec_path, &process.spec)
            .map_err(Error::io(format!("write {}", spec_path.display())))?;
        let pid_file = bundle.join(format!("exec-{exec_id}.pid"));
        let stdio = process.stdio.clone();
        // A logging binary runs as the exec (its CONTAINER_ID), as runc-v2 starts it.
        let prepared = stdio::prepare(
            &stdio,
            exec_id,
            self.options.io_uid,
            self.options.io_gid,
            Absent::DevNull,
        )
        .await?;
        let mut io = prepared.io;
        let console = prepared.console;
        let console_path = console.as_ref().map(|c| c.path().to_path_buf());
        let opts = CreateOpts {
            pid_file: &pid_file,
            console_socket: console_path.as_deref(),
            no_pivot: false,
            no_new_keyring: false,
        };
        let exec = self.runc.exec(&self.id, &spec_path, &opts, prepared.child);
        let result = match console {
            Some(console) => {
                let (ran, received) = tokio::join!(exec, console.receive(&stdio, &mut io));
                ran.and(received)
            }
            None => exec.await,
        };
        let _ = std::fs::remove_file(&spec_path);
        if let Err(e) = result {
            io.tasks.abort().await;
            return Err(e);
        }
        let pid = read_pid_from_file(&pid_file).await;
        let _ = std::fs::remove_file(&pid_file);
        let pid = match pid {
            Ok(pid) => pid,
            Err(e) => {
                io.tasks.abort().await;
                return Err(e.into());
            }
        };
        let process = self.exec_mut(exec_id)?;
        process.io = io;
        process.pid = pid;
        process.status = Status::Running;
        Ok(pid)
    }

    pub fn process(&self, exec_id: &str) -> Result<&Process> {
        if exec_id.is_empty() {
            return Ok(&self.init);
        }
        self.execs.get(exec_id).ok_or_else(|| {
            Error::NotFound(format!("exec {exec_id} not found in container {}", self.id))
        })
    }

    pub fn process_mut(&mut self, exec_id: &str) -> Result<&mut Process> {
        if exec_id.is_empty() {
            return Ok(&mut self.init);
        }
        self.exec_mut(exec_id)
    }

    fn exec_mut(&mut self, exec_id: &str) -> Result<&mut Process> {
        let id = &self.id;
        self.execs
            .get_mut(exec_id)
            .ok_or_else(|| Error::NotFound(format!("exec {exec_id} not found in container {id}")))
    }

    /// Sends `signal` to a process; `all` to every process of the container.
    pub async fn kill(&self, exec_id: &str, signal: u32, all: bool) -> Result<()> {
        let process = self.process(exec_id)?;
        if process.is_stopped() && !all {
            return Err(Error::NotFound("process already finished".into()));
        }
        if exec_id.is_empty() {
            return self.runc.kill(&self.id, signal, all).await.map_err(|e| {
                if process.is_stopped() || e.to_string().contains("not running") {
                    Error::NotFound("process already finished".into())
                } else {
                    e
                }
            });
        }
        if process.status == Status::Created {
            return Err(Error::FailedPrecondition(format!(
                "exec {exec_id} is not started"
            )));
        }
        let sig = nix::sys::signal::Signal::try_from(signal as i32)
            .map_err(|_| Error::InvalidArgument(format!("invalid signal {signal}")))?;
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(process.pid), sig).map_err(|e| {
            if e == nix::errno::Errno::ESRCH {
                Error::NotFound("process already finished".into())
            } else {
                Error::io(format!("kill exec {exec_id}"))(e.into())
            }
        })
    }

    /// What must happen when init has exited: report any OOM kill first, and kill the processes
    /// left behind when the container shares a PID namespace.
    pub async fn on_init_exit(&self) {
        if let Some(oom) = &self.oom {
            oom.check();
        }
        if self.shares_pid_namespace {
            if let Err(e) = self.runc.kill(&self.id, libc::SIGKILL as u32, true).await {
                warn!(id = %self.id, error = %e, "kill processes left after init exited");
            }
        }
    }

    /// Deletes the container with runc, stops its IO and unmounts its rootfs.
    pub async fn delete(&mut self) -> Result<()> {
        if matches!(self.init.status, Status::Running | Status::Paused) {
            return Err(Error::FailedPrecondition(format!(
                "cannot delete container {}: it is still running",
                self.id
            )));
        }
        if let Err(e) = self.runc.delete(&self.id, true).await {
            if !e.to_string().contains("does not exist") {
                return Err(e);
            }
        }
        for process in self.execs.values() {
            process.io.tasks.shutdown().await;
        }
        self.init.io.tasks.shutdown().await;
        self.unmount_rootfs();
        // A container created for a restore and never started.
        if let Some(staging) = self.restore_staging.take() {
            restore::remove_staging(&staging);
        }
        let _ = std::fs::remove_file(self.bundle.join(INIT_PID_FILE));
        Ok(())
    }
}

/// Names of the entries of `dir` (empty when it cannot be read).
fn dir_names(dir: &Path) -> HashSet<OsString> {
    std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default()
}

/// Makes every file of a checkpoint directory readable by root alone.
fn restrict_files(dir: &Path) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(Error::io(format!("list {}", dir.display())))? {
        let entry = entry.map_err(Error::io(format!("list {}", dir.display())))?;
        if entry.file_type().map(|t| t.is_file()).unwrap_or(false) {
            std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(0o600))
                .map_err(Error::io(format!("chmod {}", entry.path().display())))?;
        }
    }
    Ok(())
}

/// The versions a checkpoint was taken with.
/// The exits of the CRIU that a runc run started, when it `failed` (the watch is dropped
/// otherwise); read off the blocking pool, since finishing waits for the last queued events.
async fn finish_watch(watch: Option<ExitWatch>, failed: bool) -> Vec<CriuExit> {
    match watch {
        Some(w) if failed => tokio::task::spawn_blocking(move || w.finish())
            .await
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

async fn node_info(runc: &Runc) -> manifest::Node {
    let criu = crate::criu::version()
        .await
        .map(|v| v.to_string())
        .unwrap_or_default();
    let uts = nix::sys::utsname::uname().ok();
    manifest::Node {
        hostname: uts
            .as_ref()
            .map(|u| u.nodename().to_string_lossy().into_owned())
            .unwrap_or_default(),
        kernel: uts
            .as_ref()
            .map(|u| u.release().to_string_lossy().into_owned())
            .unwrap_or_default(),
        criu,
        runc: runc.version().await,
        shim: env!("CARGO_PKG_VERSION").to_string(),
    }
}

fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

/// Cleans up after a shim that is gone (the `delete` action): runc delete, unmount.
pub async fn cleanup_bundle(bundle: &Path, id: &str, namespace: &str) -> Result<()> {
    let options = RuntimeOptions::read_from_bundle(bundle)?;
    let runc = Runc::new(&options, namespace, bundle);
    if let Err(e) = runc.delete(id, true).await {
        warn!(%id, error = %e, "runc delete during cleanup");
    }
    let rootfs = bundle.join("rootfs");
    umount_recursive(rootfs.to_str(), libc::MNT_DETACH)?;
    // The restore handler's staging directory, had the shim gone before it removed it.
    if options.restore_mode() {
        if let Ok(staging) = restore::staging_dir(&options, namespace, id) {
            restore::remove_staging(&staging);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_config_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), "{\"ociVersion\": ").unwrap();
        let err = load_spec(dir.path()).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)));
        assert!(err.to_string().contains("malformed bundle config"), "{err}");
        assert!(err.to_string().contains("config.json"), "{err}");
    }

    #[test]
    fn missing_config_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = load_spec(dir.path()).unwrap_err().to_string();
        assert!(err.contains("cannot read bundle config"), "{err}");
    }
}
