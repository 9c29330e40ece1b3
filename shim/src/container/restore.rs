//! The restore Start runs ([`Container::restore`]), and the pending restore Create hands it
//! ([`PendingRestore`]).
//!
//! Create decides whether a container is restored and from what: containerd's checkpoint
//! (`ctr container restore`, CRI's restore-via-create), a CRIU image directory named in the
//! runc options (`CriuImagePath`), or, under the restore handler, the checkpoint the pod names
//! (`gpu-ckpt.io/restore-from`), unpacked into a staging directory with every digest verified
//! or read in place from an image volume. Start restores it in these steps, each with its undo:
//!
//! - 1\. verify: signature and namespace, listing, sizes, digests; the signed copy of the
//!   rootfs changes laid again over containerd's unsigned diff ([`Container::verify`]);
//! - 1b. the checkpoint's credentials and seccomp state held to the spec (`spec_check`);
//! - 1c. the checkpoint's GPUs held to this container's, and their pairs (`device`);
//! - 1d. every mount of the spec present in the checkpoint (`mount_check`);
//! - 1e. established TCP connections only on the recorded addresses (`pod_network`);
//! - 1f. host memory for the pages CRIU brings back, the staged device memory among them
//!   (`memory_room`): refused, or the spec's limit raised for the restore. Undo, after step 5
//!   whatever happened: the spec's limit back in `config.json` and the restored cgroup;
//! - 2\. sub-mounts held, the verify gate and the CRIU configuration
//!   ([`Container::prepare_criu`]). Undo: the configuration back to the checkpoints' (after
//!   step 4);
//! - 3\. the page images hashed while CRIU restores them; the verdict opens the gate. Undo:
//!   the hashing cancelled. 3b. the restored tree held to the spec at CRIU's pre-resume
//!   (credentials, mounts, then `/dev`'s device nodes: `spec_check`, `mount_check`,
//!   `device_nodes`);
//! - 4\. `runc restore` ([`Container::run_restore`]). Undo: `runc delete` of the restored
//!   tree ([`Container::undo_restored`]), which every later failure runs too;
//! - 5\. the device state back onto the GPUs ([`Container::restore_devices`]);
//! - 6\. the processes with NCCL communicators the manifest records connected again to the
//!   control socket, their communicators rebuilt on fresh unique ids, Go (`nccl`). Undo of 4
//!   on failure.
//!
//! # Which check runs where, and why some run twice
//!
//! - **Signature and namespace.** Under the restore handler, at Create (`restore::admit`), on
//!   the manifest read from the archive or image volume, before anything is unpacked or laid
//!   over the rootfs: Create applies the rootfs changes, and only Create can turn a checkpoint
//!   that does not fit into a cold start. For containerd's checkpoint, at Create too
//!   (`restored_annotations::check_dir`): containerd gave the spec annotations from the
//!   archive's unsigned `status.dump`, and Create reads them (lock timeout, TCP mode, declared
//!   versions), so they are held to the signed record first, which needs the signature checked.
//!   Then at Start for every kind (`trust::check_dir` in step 1), because Start reads the
//!   manifest anew from the directory CRIU will read, and every later step (the listing,
//!   sizes and digests, the security record, the devices, the recorded addresses) trusts that
//!   read: for a `CriuImagePath` restore it is the only check; containerd's extraction lies in
//!   a directory containerd, not the shim, owns; an image volume is read in place, where Create
//!   checked it but did not copy it. For a checkpoint the restore handler unpacked into its
//!   root-only staging directory, the manifest is the very bytes Create admitted and nothing
//!   but root can change them between Create and Start: the second check has no reason beyond
//!   one path for every kind (one signature over a small file); it is kept, and logs no
//!   second "unsigned" line.
//! - **Digests.** The restore handler's unpack verifies every digest as it writes; Start checks
//!   that checkpoint's listing and sizes only. Every other kind is hashed at Start, the page
//!   images while CRIU reads them (step 3), the gate holding the restored tasks until then.
//! - **GPU fit.** Under the restore handler at Create (`restore::admit`): before anything is
//!   unpacked, and so that `gpu-ckpt.io/on-incompatible: cold-start` can still start the
//!   container fresh. At Start (`ContainerDevices::plan_restore`, step 1c) for every kind: the
//!   only check before CRIU for containerd's and `CriuImagePath` restores, the GPUs' free
//!   memory may have changed since Create, and it computes the pairs (checkpoint GPU → this
//!   container's GPU) that step 5 needs; it leaves the checkpoint's devices in the bundle for
//!   the hook. In the prestart hook (`gpu-ckpt-hook prestart`, inside `runc restore`): runc's
//!   own check, on the GPUs resolved through NVML from the spec runc restores with, after
//!   CRIU set up the namespaces and before any restored process runs; it holds whatever
//!   changed since step 1c (page verification can take a while) and any restore the shim's
//!   check let through.

use std::{
    panic::AssertUnwindSafe,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use containerd_shim::util::read_pid_from_file;
use image_format::{
    digest::no_progress,
    manifest::{self, DeferredDigests, Manifest},
};
use tokio::task::JoinHandle;
use tracing::{info, info_span, warn, Instrument};

use super::{finish_watch, Container, INIT_PID_FILE};
use crate::{
    annotations,
    checkpoint::{self, CriuConf},
    criu_exit::ExitWatch,
    device::RestorePlan,
    device_nodes::DevPolicy,
    error::{Error, Result},
    mount_check::{self, MountPolicy, Mounts},
    options::RuntimeOptions,
    restore::{self as steps, step},
    runc::CreateOpts,
    spec_check::{self, Expected, Policy},
    stdio::Absent,
    sub_mounts,
    verify_gate::VerifyGate,
    watchdog::{self, Watchdog},
};

/// CRIU `ext-mount-map` entries (key, host path).
type ExtMountMap = Vec<(String, String)>;

/// Where the checkpoint Start restores from came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RestoreSource {
    /// containerd's checkpoint (`ctr container restore`, CRI's restore-via-create), which
    /// containerd extracted; its annotations were held to the signed record at Create.
    Containerd,
    /// A CRIU image directory named in the runc options (the containerd API's
    /// `CriuImagePath`); nothing was checked at Create.
    CriuImagePath,
    /// The restore handler's own restore, admitted at Create and unpacked into its staging
    /// directory with every digest verified.
    Unpacked,
    /// The restore handler's own restore from an image volume of the pod, admitted at Create
    /// and read in place.
    ImageVolume,
}

/// The restore Create set up for Start.
#[derive(Debug, Clone)]
pub(crate) struct PendingRestore {
    pub source: RestoreSource,
    /// The CRIU image directory.
    pub dir: PathBuf,
    /// The restore handler's staging directory holding `dir` (`restore::staging_dir`),
    /// removed once Start's restore is done, or at Delete.
    staging: Option<PathBuf>,
    /// What the pod named (`gpu-ckpt.io/restore-from`), for the record, where it is not `dir`.
    pub named: Option<String>,
}

impl PendingRestore {
    /// The restore containerd asks for: its checkpoint, or a CRIU image directory.
    pub fn from_containerd(checkpoint: &str, options: &RuntimeOptions) -> Option<Self> {
        let (source, dir) = if !checkpoint.is_empty() {
            (RestoreSource::Containerd, checkpoint)
        } else if !options.criu_image_path.is_empty() {
            (
                RestoreSource::CriuImagePath,
                options.criu_image_path.as_str(),
            )
        } else {
            return None;
        };
        Some(PendingRestore {
            source,
            dir: PathBuf::from(dir),
            staging: None,
            named: None,
        })
    }

    /// What the restore handler's preparation decided (a cold start restores nothing).
    pub fn from_plan(plan: steps::Plan, staging: PathBuf) -> Option<Self> {
        match plan {
            steps::Plan::Restore(dir) => Some(PendingRestore {
                source: RestoreSource::Unpacked,
                dir,
                staging: Some(staging),
                named: None,
            }),
            // Read in place from an image volume: Start verifies all of it.
            steps::Plan::RestoreInPlace(dir) => Some(PendingRestore {
                source: RestoreSource::ImageVolume,
                dir,
                staging: None,
                named: None,
            }),
            steps::Plan::ColdStart(_) => None,
        }
    }

    /// The checkpoint was unpacked by this shim with every digest verified: at Start its
    /// listing and sizes are checked again, not its digests.
    fn unpacked(&self) -> bool {
        self.source == RestoreSource::Unpacked
    }

    /// Removes what the restore handler unpacked.
    pub fn remove_staging(&mut self) {
        if let Some(staging) = self.staging.take() {
            steps::remove_staging(&staging);
        }
    }

    /// After Start's restore, restored or not: the directory containerd extracted the
    /// checkpoint into (`ctr container restore`), which containerd never removes and which
    /// holds the process's memory, and what the restore handler unpacked (CRIU has read it).
    pub fn done(&mut self, id: &str, options: &RuntimeOptions) {
        if self.source == RestoreSource::Containerd
            && options.criu_image_path.is_empty()
            && steps::is_containerd_extracted_checkpoint(&self.dir)
        {
            if let Err(e) = std::fs::remove_dir_all(&self.dir) {
                warn!(%id, dir = %self.dir.display(), error = %e, "remove containerd's extracted checkpoint");
            }
        }
        self.remove_staging();
    }
}

/// What the checks before CRIU (steps 1 to 1e) found, for the steps after them.
struct Checked {
    manifest: Manifest,
    /// How long step 1 took.
    verified_in: Duration,
    policy: Arc<Policy>,
    expected: Arc<Expected>,
    devices: RestorePlan,
    mount_policy: MountPolicy,
    tcp_close: bool,
}

/// What steps 3, 3b and 4 ended with.
struct Ran {
    restored: Result<()>,
    verified: Result<Duration>,
    held: Result<()>,
    runc_restore: Duration,
}

/// How a restore ended, from what `runc restore`, the page verification and the check of the
/// restored tree each said.
enum Outcome {
    /// Every one passed: the page images' verification took `pages`.
    Restored { pages: Duration },
    /// `runc restore` failed: no restored task ran, nothing is left to undo.
    Failed(Error),
    /// `runc restore` succeeded, and the tree was refused after: it must be killed.
    Refused(Error),
}

impl Outcome {
    fn of(ran: Ran) -> Outcome {
        match (ran.restored, ran.verified, ran.held) {
            (Ok(()), Ok(pages), Ok(())) => Outcome::Restored { pages },
            (Err(e), Err(Error::Image(image_format::Error::Cancelled { .. })), _) => {
                Outcome::Failed(e)
            }
            // The verdict is the cause: the gate made CRIU abort, or, were the gate bypassed
            // (a CRIU configuration the spec names), the restored tasks are killed here.
            (Err(_), Err(e), _) => Outcome::Failed(step("verify")(format!(
                "{e}; CRIU aborted the restore before the restored tasks ran"
            ))),
            (Ok(()), Err(e), _) => Outcome::Refused(step("verify")(format!(
                "{e}; the restored tasks were killed"
            ))),
            // The restored tree was beyond the spec: killed at the gate, so CRIU failed.
            (Err(_), Ok(_), Err(e)) => Outcome::Failed(spec_check::with_note(
                e,
                "the restored tasks were killed before they ran",
            )),
            (Ok(()), Ok(_), Err(e)) => {
                Outcome::Refused(spec_check::with_note(e, "the restored tasks were killed"))
            }
            (Err(e), Ok(_), Ok(())) => Outcome::Failed(e),
        }
    }
}

impl Container {
    /// Restores the container's process tree from `pending` (the steps are listed in this
    /// module's documentation).
    pub(super) async fn restore(&mut self, pending: &PendingRestore) -> Result<()> {
        // A CRIU older than the minimum fails here, before anything is read.
        crate::criu::version().await?;
        // Start's checks use the spec read at Create; runc reads the file again.
        self.bundle.unchanged()?;
        // Steps 1 to 1e: nothing has read the checkpoint before they pass.
        let (checked, deferred) = self.check_before_criu(pending).await?;
        // Step 1f: host memory for the pages CRIU brings back, the staged device memory among
        // them: refused, or the spec's limit raised for the restore (`memory_room.rs`). Undo,
        // after step 5 whatever happened: the spec's limit back.
        let step = self.op.step("host-memory");
        let spec_limit = self
            .memory
            .before_restore(&mut self.bundle, &checked.manifest);
        step.end(&spec_limit);
        let spec_limit = spec_limit?;
        let restored = self.restore_checked(pending, checked, deferred).await;
        let running = restored.is_ok() && self.init.pid > 0;
        let memory = self.memory.clone();
        memory
            .after_restore(&mut self.bundle, spec_limit, running)
            .await;
        restored
    }

    /// Steps 2 to 5 of [`Container::restore`].
    async fn restore_checked(
        &mut self,
        pending: &PendingRestore,
        checked: Checked,
        deferred: DeferredDigests,
    ) -> Result<()> {
        let dir = &pending.dir;
        // Step 2: sub-mounts held, the gate, CRIU's configuration; the processes with NCCL
        // communicators expected at the control socket (open since Start began).
        let step = self.op.step("prepare");
        let prepared = self.prepare_criu(dir, &checked);
        step.end(&prepared);
        let (gate, mounts) = prepared?;
        if let Some(record) = &checked.manifest.nccl {
            self.comms().expect(record);
        }
        // Steps 3 to 4, every wait bounded (`watchdog.rs`).
        let (ran, watchdog) = self
            .run_gated(dir, &checked, deferred, gate, mounts)
            .await?;
        // Undo of step 2.
        self.reset_criu_conf("restore");
        // Past the bound, whatever else happened, the restore fails, and nothing it restored
        // may run on.
        let (deadline, bound) = (watchdog.deadline(), watchdog.bound());
        if let Err(e) = watchdog.stop() {
            self.undo_restored("a restore past its bound").await;
            return Err(e);
        }
        let runc_restore = ran.runc_restore;
        let pages = match Outcome::of(ran) {
            Outcome::Restored { pages } => pages,
            Outcome::Failed(e) => return Err(e),
            Outcome::Refused(e) => {
                self.undo_restored("a refused restore").await;
                return Err(e);
            }
        };
        // Step 5: the device state back onto this container's GPUs. Undo: kill what was
        // restored (which also ends a driver call still waiting on it).
        let t = Instant::now();
        let op = self.op.clone();
        let devices =
            self.restore_devices(dir, &checked.manifest, &checked.devices, deadline, bound);
        if let Err(e) = op.timed("device-restore", devices).await {
            self.undo_restored("a failed device restore").await;
            return Err(e);
        }
        let device_restore = t.elapsed();
        // Step 6: every process the manifest records with NCCL communicators connected again,
        // its communicators rebuilt on fresh unique ids, Go (bounded by NcclTimeout). Undo:
        // kill what was restored.
        let comms = self.comms();
        let rebuild = comms
            .restored(self.init.pid)
            .instrument(info_span!("nccl_restore", id = %self.id));
        let rebuilt = match checked.manifest.nccl {
            Some(_) => op.timed("nccl-rebuild", rebuild).await,
            None => rebuild.await,
        };
        if let Err(e) = rebuilt {
            self.undo_restored("a failed NCCL rebuild").await;
            return Err(e);
        }
        info!(
            id = %self.id,
            verify_ms = checked.verified_in.as_millis() as u64,
            page_verify_ms = pages.as_millis() as u64,
            runc_restore_ms = runc_restore.as_millis() as u64,
            device_restore_ms = device_restore.as_millis() as u64,
            nccl_rebuild_ms = t.elapsed().saturating_sub(device_restore).as_millis() as u64,
            "restored"
        );
        Ok(())
    }

    /// Steps 1 to 1e: the checkpoint verified, then held to this container's spec, GPUs,
    /// mounts and network before CRIU starts. Nothing to undo.
    async fn check_before_criu(
        &mut self,
        pending: &PendingRestore,
    ) -> Result<(Checked, DeferredDigests)> {
        let dir = &pending.dir;
        let t = Instant::now();
        let op = self.op.clone();
        let verify = self
            .verify(pending)
            .instrument(info_span!("verify", id = %self.id));
        let (manifest, deferred) = op.timed("verify", verify).await?;
        op.note_manifest(&manifest);
        let verified_in = t.elapsed();
        let (policy, expected) = op
            .timed("spec-check", self.check_security(dir, &manifest))
            .await?;
        // Step 1c: the checkpoint's GPUs held to the ones this container was given on this
        // node (model, count, memory, free memory, driver branch, CUDA version), and the pairs
        // that map one onto the other, in order; then the driver files its processes mapped
        // held to the ones this container's spec mounts (`driver_files`).
        let compat = self
            .devices
            .plan_restore(&manifest.devices, &self.bundle)
            .instrument(info_span!("device_compat", id = %self.id));
        let devices = op.timed("compat", compat).await?;
        let driver_files = crate::driver_files::check_restore(&self.bundle, &manifest.devices);
        op.timed("driver-files", driver_files).await?;
        // The NCCL layer the checkpoint's processes mapped, held to this container's.
        crate::nccl::check_layer(manifest.nccl.as_ref(), self.nccl.as_ref())?;
        let mount_policy = op.timed("mount-check", self.refuse_new_mounts(dir)).await?;
        let tcp_close = self.tcp_close(&manifest);
        op.timed("network", self.check_network(&manifest, tcp_close))
            .await?;
        let checked = Checked {
            manifest,
            verified_in,
            policy,
            expected,
            devices,
            mount_policy,
            tcp_close,
        };
        Ok((checked, deferred))
    }

    /// Step 1: verify the checkpoint against its manifest: signer and namespace, listing,
    /// sizes, and the digest of every file but the page images, before CRIU reads any of it.
    /// The page images are hashed while CRIU restores them (step 3) when the gate can hold
    /// the restored tasks; otherwise here too. A checkpoint this shim unpacked, verifying every
    /// digest as it wrote it into a directory only it writes, is not hashed a second time.
    async fn verify(&self, pending: &PendingRestore) -> Result<(Manifest, DeferredDigests)> {
        let (dir, unpacked, overlap) = (&pending.dir, pending.unpacked(), self.own_criu_conf);
        // The signature and its signer, and the namespace, for every way a restore arrives
        // (`trust::check_dir`; why the restore handler's are checked again: the module doc).
        let namespace = self.bundle.cri(&self.id).namespace;
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
        .map_err(|e| step("verify")(e.to_string()))?
        .map_err(|e| step("verify")(e.to_string()))?;
        if manifest != signed_manifest {
            return Err(step("verify")(format!(
                "the manifest in {} changed while it was verified",
                dir.display()
            )));
        }
        if !unpacked && matches!(verdict, crate::trust::Verdict::Signed { .. }) {
            self.reapply_rootfs_changes(dir).await?;
        }
        let deferred = if unpacked {
            DeferredDigests::default()
        } else {
            deferred
        };
        Ok((manifest, deferred))
    }

    /// containerd laid its rootfs-diff.tar (which no signature covers) over the rootfs: the
    /// signed copy of the container's changes goes over it again.
    async fn reapply_rootfs_changes(&self, dir: &Path) -> Result<()> {
        let Some(copy) = crate::rootfs_changes::exists(dir) else {
            return Ok(());
        };
        let rootfs = self.bundle.join("rootfs");
        let ids = Policy::from_bundle(&self.bundle)?;
        tokio::task::spawn_blocking(move || {
            steps::apply_rootfs_diff(&copy, &rootfs, steps::DiffFormat::Own, &ids)
        })
        .await
        .map_err(|e| step("rootfs-diff")(e.to_string()))?
        .map_err(|e| step("rootfs-diff")(e.to_string()))
    }

    /// Step 1b: the checkpoint's own record of its tasks' credentials and seccomp state
    /// (CRIU's core and seccomp images, verified in step 1) and of the seccomp profile it ran
    /// under (the manifest), held to this container's spec: the usual mismatch fails here,
    /// before CRIU starts (`spec_check.rs`).
    async fn check_security(
        &self,
        dir: &Path,
        manifest: &Manifest,
    ) -> Result<(Arc<Policy>, Arc<Expected>)> {
        let policy = Arc::new(Policy::from_bundle(&self.bundle)?);
        let expected = tokio::task::spawn_blocking({
            let (dir, policy) = (dir.to_path_buf(), policy.clone());
            let record = manifest.security.clone();
            move || spec_check::check_checkpoint(&dir, &policy, record.as_ref())
        })
        .instrument(info_span!("spec_check", id = %self.id))
        .await
        .map_err(|e| step("spec-check")(e.to_string()))??;
        Ok((policy, Arc::new(expected)))
    }

    /// Step 1d: the spec's mounts, each of which the checkpoint must have a mount for: CRIU
    /// restores only the checkpoint's mounts and would leave an empty directory for a new
    /// one (`mount_check.rs`).
    async fn refuse_new_mounts(&self, dir: &Path) -> Result<MountPolicy> {
        let policy = MountPolicy::from_spec(self.bundle.spec());
        tokio::task::spawn_blocking({
            let (dir, policy) = (dir.to_path_buf(), policy.clone());
            let rootfs = self.bundle.join("rootfs");
            move || mount_check::refuse_new_mounts(&dir, &rootfs, &policy)
        })
        .instrument(info_span!("mount_check", id = %self.id))
        .await
        .map_err(|e| step("spec-check")(e.to_string()))??;
        Ok(policy)
    }

    /// Connections are closed when the checkpoint closed them or this container asks for it
    /// (a new address).
    fn tcp_close(&self, manifest: &Manifest) -> bool {
        let asked = self.annotations.get(annotations::TCP);
        manifest.criu.tcp == "close"
            || asked == Some("close")
            || (asked.is_none() && self.options.tcp_mode == "close")
    }

    /// Step 1e: established connections come back bound to the addresses they were dumped
    /// on: only into a namespace that has them all (`pod_network.rs`).
    async fn check_network(&self, manifest: &Manifest, tcp_close: bool) -> Result<()> {
        if manifest.criu.tcp != "established" || tcp_close {
            return Ok(());
        }
        let spec = self.bundle.spec().clone();
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
        .map_err(|e| step("network")(e.to_string()))?
        .map_err(|e| step("network")(e.to_string()))
    }

    /// Step 2: CRIU's configuration: connections closed or not, the sub-mounts mapped, and the
    /// gate that holds the restored tasks
    /// until the page images are verified. Undo (by the caller, after step 4): the
    /// configuration back to the checkpoints'.
    fn prepare_criu(
        &self,
        dir: &Path,
        checked: &Checked,
    ) -> Result<(Arc<VerifyGate>, Arc<Mounts>)> {
        let (ext_mount_map, held) = self.hold_sub_mounts(dir)?;
        let mounts = Arc::new(Mounts {
            policy: checked.mount_policy.clone(),
            held,
            dev: DevPolicy::of(self.bundle.spec(), &self.bundle.join("rootfs"))
                .map_err(|e| step("prepare")(e.to_string()))?,
        });
        let gate = Arc::new(
            VerifyGate::create(self.bundle.path()).map_err(|e| step("prepare")(e.to_string()))?,
        );
        let conf = CriuConf {
            tcp_close: checked.tcp_close,
            action_script: Some(gate.script()),
            ext_mount_map: &ext_mount_map,
            ..Default::default()
        };
        conf.write(self.bundle.path())
            .map_err(|e| step("prepare")(e.to_string()))?;
        Ok((gate, mounts))
    }

    /// Sub-mounts of the checkpoint's bind mounts (its list, verified in step 1) go to the
    /// host paths below the new spec's mounts at the same destinations, resolved without a
    /// symlink and held open until the gate has checked that CRIU mounted them.
    fn hold_sub_mounts(&self, dir: &Path) -> Result<(ExtMountMap, Vec<sub_mounts::Held>)> {
        let _span = info_span!("sub_mounts", id = %self.id).entered();
        let list = sub_mounts::read_list(dir).map_err(|e| step("prepare")(e.to_string()))?;
        if list.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let held = sub_mounts::hold_all(&list, self.bundle.spec())
            .map_err(|e| step("prepare")(e.to_string()))?;
        let map = sub_mounts::restore_map(&held);
        info!(id = %self.id, count = map.len(), "sub-mounts of bind mounts mapped for CRIU");
        if !self.own_criu_conf {
            warn!(id = %self.id, "the spec names its own CRIU configuration: the sub-mounts are not mapped");
        }
        Ok((map, held))
    }

    /// Steps 3, 3b and 4 under the watchdog: the page images hashed while `runc restore` runs
    /// with CRIU waiting at the gate, and the restored tree checked there. Undo of step 3:
    /// the hashing cancelled when the restore fails.
    async fn run_gated(
        &mut self,
        dir: &Path,
        checked: &Checked,
        deferred: DeferredDigests,
        gate: Arc<VerifyGate>,
        mounts: Arc<Mounts>,
    ) -> Result<(Ran, Watchdog)> {
        let cancel = Arc::new(AtomicBool::new(false));
        let pages = self.op.step("page-verify");
        let verified = verify_pages(deferred, cancel.clone(), gate.clone(), pages);
        let held = self.hold_at_gate(&gate, checked, &mounts);
        let checkpoint_bytes: u64 = checked.manifest.files.values().map(|f| f.size).sum();
        let watchdog = Watchdog::start(
            watchdog::bound(&self.options, checkpoint_bytes)?,
            self.bundle.path(),
            gate.clone(),
            cancel.clone(),
        );
        let t = Instant::now();
        let span = info_span!("runc_restore", id = %self.id);
        let op = self.op.clone();
        let restore = self
            .run_restore(dir, &checked.manifest, checked.tcp_close)
            .instrument(span);
        let restored = op.timed("criu-restore", restore).await;
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
        let held = held
            .await
            .unwrap_or_else(|e| Some(Err(tree_check_failed(e))));
        let held = self.held_verdict(held, &restored, checked, mounts).await;
        drop(gate);
        let ran = Ran {
            restored,
            verified,
            held,
            runc_restore,
        };
        Ok((ran, watchdog))
    }

    /// Step 3b: the restored tree held to the spec at the gate's pre-resume, where CRIU has
    /// restored every task's credentials and seccomp filters and every mount, and none has
    /// run: the spec's mount flags applied, then credentials and mounts checked; a refusal
    /// kills the tree there and CRIU fails the restore.
    fn hold_at_gate(
        &self,
        gate: &Arc<VerifyGate>,
        checked: &Checked,
        mounts: &Arc<Mounts>,
    ) -> JoinHandle<Option<Result<()>>> {
        let (gate, policy, expected, mounts) = (
            gate.clone(),
            checked.policy.clone(),
            checked.expected.clone(),
            mounts.clone(),
        );
        let span = info_span!("spec_check_restored", id = %self.id);
        tokio::task::spawn_blocking(move || {
            let _span = span.enter();
            spec_check::hold_at_gate(&gate, &policy, &expected, &mounts)
        })
    }

    /// The verdict on the restored tree: the gate's, or, where the gate's pre-resume did not
    /// run (a CRIU configuration the spec names), the tree checked now, after it has resumed,
    /// and killed if it is beyond the spec.
    async fn held_verdict(
        &self,
        held: Option<Result<()>>,
        restored: &Result<()>,
        checked: &Checked,
        mounts: Arc<Mounts>,
    ) -> Result<()> {
        match (held, restored) {
            (Some(verdict), _) => verdict,
            (None, Ok(())) => {
                warn!(id = %self.id, "restored tasks were not held at pre-resume: checked after they resumed");
                let (pid, policy, expected) = (
                    self.init.pid,
                    checked.policy.clone(),
                    checked.expected.clone(),
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
                .unwrap_or_else(|e| Err(tree_check_failed(e)))
            }
            (None, Err(_)) => Ok(()),
        }
    }

    /// Step 4: `runc restore` of `dir` with the container's IO; reads the restored pid. Undo
    /// on failure: stop the copies, runc delete.
    async fn run_restore(
        &mut self,
        dir: &Path,
        manifest: &Manifest,
        tcp_close: bool,
    ) -> Result<()> {
        let work = self.criu_work();
        std::fs::create_dir_all(&work).map_err(|e| step("prepare")(e.to_string()))?;
        let prepared = self
            .prepare_io(&self.init.stdio, &self.id, Absent::Pipe)
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
            self.bundle.path(),
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
                crate::nccl::started(&self.id, pid);
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
                self.delete_restored("a failed restore").await;
                Err(Error::Step {
                    operation: "restore",
                    step: "criu-restore",
                    message,
                })
            }
        }
    }

    /// Step 5: the device state back onto this container's GPUs (with custom storage from the
    /// device-memory files in `dir`, verified with the rest at step 1), unlocked, every
    /// process confirmed RUNNING, before Start returns, within what is left of the restore's
    /// bound (`deadline`; `bound` names it). The caller undoes it.
    async fn restore_devices(
        &mut self,
        dir: &Path,
        manifest: &Manifest,
        plan: &RestorePlan,
        deadline: Instant,
        bound: Duration,
    ) -> Result<()> {
        let recorded = &manifest.devices.processes;
        if recorded.is_empty() {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let steps = async {
            let pids = self.runc.ps(&self.id).await?;
            self.devices
                .restore(manifest, dir, pids, plan)
                .instrument(info_span!("device_restore", id = %self.id))
                .await
        };
        tokio::time::timeout(left, steps).await.unwrap_or_else(|_| {
            Err(step("device-restore")(format!(
                "not done within {}: the driver did not finish restoring the device state; the restored tasks were killed",
                watchdog::describe(bound)
            )))
        })
    }

    /// Undo of a restored tree (`why` names the failure for the log): the IO copies stopped,
    /// `runc delete --force`, which kills it.
    async fn undo_restored(&mut self, why: &str) {
        self.init.io.tasks.abort().await;
        self.delete_restored(why).await;
    }

    /// `runc delete --force` of what a restore left; a container runc no longer has is fine.
    async fn delete_restored(&self, why: &str) {
        if let Err(e) = self.runc.delete(&self.id, true).await {
            if !e.to_string().contains("does not exist") {
                warn!(id = %self.id, error = %e, "undo of {why}: runc delete");
            }
        }
    }
}

/// Step 3: the page images' digests, in parallel with runc restore; the verdict opens the
/// gate, whatever happens (CRIU waits for one). `cancel` stops the hashing.
fn verify_pages(
    deferred: DeferredDigests,
    cancel: Arc<AtomicBool>,
    gate: Arc<VerifyGate>,
    step: crate::record::Step,
) -> JoinHandle<Result<Duration>> {
    tokio::task::spawn_blocking(move || -> Result<Duration> {
        let t = Instant::now();
        let verified = step.span().in_scope(|| -> Result<()> {
            let result = std::panic::catch_unwind(AssertUnwindSafe(|| deferred.verify(&cancel)))
                .unwrap_or_else(|_| {
                    Err(image_format::Error::Cancelled {
                        name: "page images (the verification panicked)".into(),
                    })
                });
            gate.open(result.is_ok())?;
            Ok(result?)
        });
        step.end(&verified);
        verified.map(|()| t.elapsed())
    })
}

/// The refusal when the check of the restored tree itself failed (its task panicked).
fn tree_check_failed(e: impl std::fmt::Display) -> Error {
    Error::FailedPrecondition(format!(
        "restore refused: the check of the restored tree failed: {e}"
    ))
}
