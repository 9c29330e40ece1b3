//! Pause, resume and checkpoint: the device state off the GPUs, the CRIU dump with its page
//! images hashed as they are written, and the manifest written last, each step with its undo.

use std::{
    collections::{BTreeMap, HashSet},
    ffi::OsString,
    os::unix::fs::PermissionsExt,
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use image_format::{
    digest::no_progress,
    manifest::{self, Manifest},
};
use tracing::{info, info_span, warn, Instrument};

use super::{finish_watch, Container, CRIU_WORK};
use crate::{
    annotations,
    checkpoint::{self, CheckpointPlan},
    criu_exit::ExitWatch,
    error::{Error, Result},
    process::Status,
    runc::Runc,
    spec_check, sub_mounts,
};

/// How long the follower of the dump's page images waits for new bytes before it looks again
/// (the end of the dump wakes it at once).
const FOLLOW_INTERVAL: Duration = Duration::from_millis(10);

/// A checkpoint step's failure.
fn fail(step: &'static str, message: String) -> Error {
    Error::Step {
        operation: "checkpoint",
        step,
        message,
    }
}

/// A checkpoint's image directory, root-only (checkpoints hold process memory), and its undo:
/// every file the checkpoint wrote in it removed, and the directory too if it made it.
struct ImageDir<'a> {
    path: &'a Path,
    /// What was there before (an earlier checkpoint's files are left alone).
    before: HashSet<OsString>,
    created: bool,
}

impl<'a> ImageDir<'a> {
    fn create(path: &'a Path) -> Result<Self> {
        let created = !path.exists();
        std::fs::create_dir_all(path)
            .and_then(|_| std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)))
            .map_err(|e| {
                fail(
                    "prepare",
                    format!("image directory {}: {e}", path.display()),
                )
            })?;
        Ok(ImageDir {
            path,
            before: dir_names(path),
            created,
        })
    }

    fn undo(&self) {
        for name in dir_names(self.path).difference(&self.before) {
            let _ = std::fs::remove_file(self.path.join(name));
        }
        if self.created {
            let _ = std::fs::remove_dir(self.path);
        }
    }
}

/// What step 1 set up for the dump.
struct DumpSetup {
    /// CRIU's network lock skipped (see [`Container::skip_network_lock`]).
    skip_network_lock: bool,
    /// Sub-mounts of bind mounts marked external in the CRIU configuration.
    mapped_sub_mounts: bool,
    /// The pod's addresses, for the manifest.
    addresses: Option<Vec<String>>,
}

impl Container {
    /// Pause: the device state leaves the GPUs first (lock, then checkpoint, every process that
    /// holds some), since the driver's restore thread cannot run in a frozen cgroup; then the
    /// freeze. containerd pauses a task before it checkpoints it (ctr, the containerd client,
    /// CRI), so this is where a checkpoint's device steps run, timed into `self.op` (the
    /// caller's: `OpLog::at_pause`). Undo: device resume.
    pub async fn pause(&mut self) -> Result<()> {
        let quiesce = Instant::now();
        self.quiesce_devices().await?;
        let quiesced = quiesce.elapsed();
        self.op.frozen_from(Instant::now());
        if let Err(e) = self.runc.pause(&self.id).await {
            if let Err(de) = self.devices.resume().await {
                warn!(id = %self.id, error = %de, "undo of a failed pause: device resume");
            }
            self.memory.put_back().await;
            if let Err(ne) = self.comms().resume("pause").await {
                warn!(id = %self.id, error = %ne, "undo of a failed pause: NCCL resume");
            }
            return Err(e);
        }
        self.paused_devices = self.devices.is_quiesced().then_some(quiesced);
        self.resumed_after_dump = false;
        Ok(())
    }

    /// The container's NCCL communicators quiesced and released, every process disconnected
    /// from the shim (`nccl`), then the device quiesce ([`Container::quiesce_gpus`]). Undo
    /// when the device quiesce fails: the communicators back (resumed or rebuilt) and Go.
    async fn quiesce_devices(&mut self) -> Result<()> {
        let comms = self.comms();
        let pids = match self.nccl {
            Some(_) => self.runc.ps(&self.id).await?,
            None => Vec::new(),
        };
        match self.nccl {
            Some(_) => self.op.timed("nccl-quiesce", comms.quiesce(pids)).await?,
            None => comms.quiesce(pids).await?,
        }
        let quiesced = self.quiesce_gpus().await;
        if let Err(e) = quiesced {
            return Err(match comms.resume("checkpoint").await {
                Ok(()) => e,
                Err(ne) => with_undo(e, ne),
            });
        }
        Ok(())
    }

    /// This container's NCCL layer (one that does nothing for a container without it).
    pub(crate) fn comms(&self) -> std::sync::Arc<dyn crate::nccl::CommLayer> {
        crate::nccl::of(&self.id)
    }

    /// Device quiesce of the container's processes, on a node with a driver (no `runc ps`
    /// elsewhere), after the host memory the driver will stage is held to the container's
    /// memory cgroup (refused, or its limit raised: `memory_room.rs`). Undo of a raise on
    /// failure: the limit back.
    async fn quiesce_gpus(&mut self) -> Result<()> {
        if !self.devices.active().await? {
            return Ok(());
        }
        let pids = self.runc.ps(&self.id).await?;
        // A limit an earlier put-back could not lower (v1: EBUSY) first, so that this
        // checkpoint is held to the container's own limit.
        self.memory.put_back().await;
        let room = self.memory.room(self.bundle.json());
        let quiesced = self
            .devices
            .quiesce(pids, move |holders| room.make(holders), &self.op)
            .instrument(info_span!("device_quiesce", id = %self.id))
            .await;
        if quiesced.is_err() {
            self.memory.put_back().await;
        }
        quiesced
    }

    /// Resume: thaw, then the device state back onto the GPUs and unlocked (whether or not a
    /// checkpoint came in between), then the NCCL communicators back and Go.
    pub async fn resume(&mut self) -> Result<()> {
        self.resume_gpus().await?;
        self.comms().resume("resume").await?;
        self.op.runs_again(Instant::now());
        Ok(())
    }

    /// Thaw, then the device state back onto the GPUs and unlocked.
    async fn resume_gpus(&mut self) -> Result<()> {
        if let Err(e) = self.runc.resume(&self.id).await {
            // A dump whose CRIU was killed leaves the cgroup thawed: runc finds the container
            // running ("container not paused"), which is what Resume is for.
            if !e.to_string().contains("container not paused") {
                return Err(e);
            }
            warn!(id = %self.id, error = %e, "resume of a container that is no longer frozen");
        }
        let resumed = self
            .devices
            .resume()
            .instrument(info_span!("device_resume", id = %self.id))
            .await;
        self.memory.put_back().await;
        resumed
    }

    /// Checkpoints the container, device state included, into `plan.image_path`:
    ///
    /// 0. device quiesce, for a running container (a paused one had it at Pause). Undo: device
    ///    resume.
    /// 1. to 3. image directory, CRIU dump, manifest ([`Container::checkpoint_files`]); with
    ///    `ResumeAfterDump`, a paused container is resumed once the dump and the copy of its
    ///    rootfs changes are done ([`Container::resume_after_dump`]).
    /// 4. leave-running: device resume of what step 0 quiesced (a paused container's waits for
    ///    Resume, unless it was resumed after the dump); `--exit`: nothing is left to resume.
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
        self.resumed_after_dump = false;
        if here {
            self.quiesce_devices().await?;
        }
        let result = match self.devices.record(&self.bundle).await {
            Ok(devices) => self.checkpoint_files(plan, devices, !here).await,
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
            self.comms().forget();
            self.memory.put_back().await;
        } else if here {
            let resumed = self
                .devices
                .resume()
                .instrument(info_span!("device_resume", id = %self.id))
                .await;
            self.memory.put_back().await;
            let resumed = match resumed {
                Ok(()) => self.comms().resume("checkpoint").await,
                Err(e) => Err(e),
            };
            if let Err(de) = resumed {
                return Err(match result {
                    Ok(_) => de,
                    Err(e) => Error::FailedPrecondition(format!("{e}; and its undo failed: {de}")),
                });
            }
            self.op.runs_again(Instant::now());
        }
        result
    }

    /// Steps 1 to 3 of a checkpoint: CRIU dump, then the manifest (with `devices`) written
    /// last, so a directory without a manifest is never a complete checkpoint. On failure
    /// every file the checkpoint wrote is removed and the container runs on as before (or,
    /// resumed after the dump, runs).
    async fn checkpoint_files(
        &mut self,
        plan: &CheckpointPlan,
        devices: manifest::Devices,
        paused: bool,
    ) -> Result<Manifest> {
        // Step 1: the image directory, the CRIU configuration of this dump, the addresses.
        // Undo: remove what the checkpoint wrote; the CRIU configuration back.
        let op = self.op.clone();
        let step = op.step("prepare");
        let image = match ImageDir::create(&plan.image_path) {
            Ok(image) => image,
            Err(e) => {
                step.failed(&e);
                return Err(e);
            }
        };
        let work = plan
            .work_path
            .clone()
            .unwrap_or_else(|| self.bundle.join(CRIU_WORK));
        let setup = match self
            .prepare_dump(plan, image.path, &work)
            .instrument(step.span().clone())
            .await
        {
            Ok(setup) => setup,
            Err(e) => {
                step.failed(&e);
                image.undo();
                self.reset_criu_conf("checkpoint");
                return Err(e);
            }
        };
        step.done();
        // Step 2: CRIU dump. Undo: remove what it wrote; CRIU resumes the tasks.
        let mut timings = self.comms().timings();
        timings.extend(self.devices.timings());
        if let Some(quiesced) = self.paused_devices.filter(|_| paused) {
            timings.push(("device-quiesce", quiesced));
        }
        let dumped = op
            .timed(
                "criu-dump",
                self.dump(plan, &image, &work, &setup, &mut timings),
            )
            .await;
        let (node, followed) = match dumped {
            Ok(dumped) => dumped,
            Err(e) => {
                image.undo();
                return Err(e);
            }
        };
        // Step 3: the device-memory files of custom storage into the image directory, then
        // the manifest, written last. Undo: the files back, then remove everything the
        // checkpoint wrote.
        let stored = self.devices.device_files();
        let placed = match &stored {
            Some(stored) => {
                let (stored, image_path) = (stored.clone(), image.path.to_path_buf());
                let keep = plan.criu.leave_running;
                let place = tokio::task::spawn_blocking(move || {
                    crate::device_storage::place(&stored, &image_path, keep)
                })
                .instrument(info_span!("device_files", id = %self.id));
                op.timed("device-storage", async {
                    place
                        .await
                        .map_err(|e| fail("device-storage", e.to_string()))
                        .and_then(|r| r)
                })
                .await
            }
            None => Ok(Default::default()),
        };
        let placed = match placed {
            Ok(p) => p,
            Err(e) => {
                image.undo();
                return Err(e);
            }
        };
        let early = plan.resume_after_dump && paused;
        let step = op.step("manifest-hash");
        let span = info_span!(parent: step.span(), "manifest", id = %self.id);
        let written = self
            .write_manifest(
                plan,
                node,
                devices,
                followed,
                setup.addresses,
                &mut timings,
                early,
            )
            .instrument(span)
            .await;
        if plan.work_path.is_none() {
            let _ = std::fs::remove_dir_all(&work);
        }
        let written = written.map_err(|e| {
            placed.undo(image.path);
            image.undo();
            fail("manifest", e.to_string())
        });
        step.end(&written);
        written
    }

    /// Step 1 of [`Container::checkpoint_files`] after the image directory: the network lock
    /// decision, the sub-mounts marked for CRIU, and the pod's addresses.
    async fn prepare_dump(
        &self,
        plan: &CheckpointPlan,
        image: &Path,
        work: &Path,
    ) -> Result<DumpSetup> {
        let skip_network_lock = self.skip_network_lock().await;
        let mapped_sub_mounts = self.mark_sub_mounts(plan, image, work, skip_network_lock)?;
        let addresses = self
            .record_addresses(plan)
            .instrument(info_span!("pod_network", id = %self.id))
            .await?;
        Ok(DumpSetup {
            skip_network_lock,
            mapped_sub_mounts,
            addresses,
        })
    }

    /// CRIU's network lock (iptables rules in the container's own network namespace, put
    /// in at the dump and taken out at the end of the restore: about 60 ms of
    /// iptables-restore runs) holds TCP conversations still. A paused container whose own
    /// namespace has no TCP connection and no interface but loopback has none to hold, and
    /// none can start before CRIU freezes it.
    /// `network-lock skip` from CRIU 4.2 on (4.1 crashes on it).
    async fn skip_network_lock(&self) -> bool {
        let skip = crate::criu::version()
            .await
            .is_ok_and(|v| v.network_lock_skip())
            && self.own_network_namespace
            && self.init.status == Status::Paused
            && checkpoint::nothing_to_lock(self.init.pid);
        if skip {
            info!(id = %self.id, "network namespace of its own with no TCP connection and only loopback: CRIU's network lock skipped");
        }
        skip
    }

    /// Mounts below the spec's bind mounts (an rbind's or a recursive read-only mount's
    /// sub-mounts), which runc does not map for CRIU: marked external under a key in the
    /// dump's CRIU configuration, and listed in the image directory for the restore to map
    /// to the new spec's host paths. Whether any were marked.
    fn mark_sub_mounts(
        &self,
        plan: &CheckpointPlan,
        image: &Path,
        work: &Path,
        skip_network_lock: bool,
    ) -> Result<bool> {
        let found = {
            let _span = info_span!("sub_mounts", id = %self.id).entered();
            sub_mounts::of_process(self.init.pid, self.bundle.spec())
                .map_err(|e| Error::FailedPrecondition(e.to_string()))
        };
        if let Ok(list) = &found {
            if !list.is_empty() {
                info!(id = %self.id, count = list.len(), "sub-mounts of bind mounts marked external for CRIU");
                if !self.own_criu_conf {
                    warn!(id = %self.id, "the spec names its own CRIU configuration: the sub-mounts are not mapped");
                }
            }
        }
        std::fs::create_dir_all(work)
            .map_err(|e| fail("prepare", format!("work directory {}: {e}", work.display())))?;
        let list = found.map_err(|e| fail("prepare", e.to_string()))?;
        let map = sub_mounts::dump_map(&list);
        let conf = checkpoint::CriuConf {
            tcp_close: plan.criu.tcp == "close",
            skip_network_lock,
            action_script: None,
            ext_mount_map: &map,
        };
        conf.write(self.bundle.path())
            .map_err(|e| fail("prepare", e.to_string()))?;
        if !list.is_empty() {
            sub_mounts::write_list(image, &list).map_err(|e| fail("prepare", e.to_string()))?;
        }
        Ok(!list.is_empty())
    }

    /// The addresses of its network namespace (the pod's IPs), which established TCP
    /// connections are bound to, for the manifest: read before the dump, which may end
    /// the process. A checkpoint of established connections fails without them.
    async fn record_addresses(&self, plan: &CheckpointPlan) -> Result<Option<Vec<String>>> {
        let pid = self.init.pid;
        let read = tokio::task::spawn_blocking(move || crate::pod_network::addresses_of_pid(pid))
            .await
            .map_err(|e| Error::FailedPrecondition(format!("read the network addresses: {e}")))
            .and_then(|r| r);
        match read {
            Ok(a) => Ok(Some(a)),
            Err(e) if plan.criu.tcp == "established" => Err(fail(
                "prepare",
                format!("the addresses its established TCP connections are bound to: {e}"),
            )),
            Err(e) => {
                warn!(id = %self.id, error = %e, "network addresses not recorded");
                Ok(None)
            }
        }
    }

    /// Step 2 of a checkpoint: CRIU dump through runc, its page images hashed as CRIU writes
    /// them (and the versions for the manifest read meanwhile). The caller undoes it.
    async fn dump(
        &self,
        plan: &CheckpointPlan,
        image: &ImageDir<'_>,
        work: &Path,
        setup: &DumpSetup,
        timings: &mut Vec<(&'static str, Duration)>,
    ) -> Result<(manifest::Node, BTreeMap<String, manifest::FileDigest>)> {
        let t = Instant::now();
        let dumped_all = Arc::new(manifest::WriterDone::default());
        let follower = tokio::task::spawn_blocking({
            let (path, dumped_all, pages, durability) = (
                image.path.to_path_buf(),
                dumped_all.clone(),
                plan.page_digests,
                plan.durability,
            );
            let skip = image
                .before
                .iter()
                .filter_map(|n| n.to_str().map(str::to_string))
                .collect();
            move || -> image_format::Result<BTreeMap<String, manifest::FileDigest>> {
                // The writeback of what it hashed starts behind CRIU: the syncs before the
                // manifest then find little left to write.
                manifest::AppendHasher::new(&path, manifest::is_page_image, skip, pages)
                    .writing_back(durability)
                    .follow_until(&dumped_all, FOLLOW_INTERVAL)
            }
        });
        let runc_args = plan.runc_args();
        let criu_exit = ExitWatch::for_container(&self.id);
        let (dumped, node) = tokio::join!(
            self.runc
                .checkpoint(&self.id, image.path, work, &runc_args)
                .instrument(info_span!("criu_dump", id = %self.id)),
            node_info(&self.runc)
        );
        dumped_all.set();
        let criu_ended = finish_watch(criu_exit, dumped.is_err()).await;
        // The lock decision and the sub-mounts' keys held for this dump only.
        if setup.skip_network_lock || setup.mapped_sub_mounts {
            self.reset_criu_conf("checkpoint");
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
            return Err(fail("criu-dump", message));
        }
        timings.push(("criu-dump", t.elapsed()));
        // A container CRIU froze itself (not paused) runs again when the dump ends, unless its
        // device state waits for the end of the checkpoint (which says so then).
        if plan.criu.leave_running && self.init.status == Status::Running {
            self.op.runs_again(Instant::now());
        }
        // CRIU's own statistics travel with the images (checkpointctl and `gpu-ckpt inspect`
        // show them); CRIU wrote them to the work directory.
        let stats = work.join("stats-dump");
        if stats.exists() && !image.path.join("stats-dump").exists() {
            if let Err(e) = std::fs::copy(&stats, image.path.join("stats-dump")) {
                warn!(id = %self.id, error = %e, "keep CRIU's dump statistics");
            }
            if plan.work_path.is_none() {
                self.stats_for_cri(&stats);
            }
        }
        Ok((node, followed))
    }

    /// A copy of CRIU's statistics where containerd's CRI takes them for the archive's top
    /// level (checkpointctl's `inspect --stats` reads them there): the directory it archives
    /// (`ctrd-checkpoint`) where it made one, else the container's CRI directory
    /// ([`checkpoint::cri_container_dir`]). A runc-typed registration gets the former as the
    /// work path, where CRIU wrote them.
    /// The archive's verify checks that copy against `checkpoint/stats-dump`'s manifest entry.
    fn stats_for_cri(&self, stats: &Path) {
        let cri = self.bundle.cri(&self.id);
        let Some(dir) =
            checkpoint::cri_container_dir(self.bundle.spec(), &cri.sandbox_id, &self.id)
        else {
            return;
        };
        let archived = dir.join(checkpoint::CRI_CHECKPOINT_DIR);
        let dir = if std::fs::symlink_metadata(&archived).is_ok_and(|m| m.is_dir()) {
            archived
        } else {
            dir
        };
        let _span = info_span!("stats_for_cri", id = %self.id, dir = %dir.display()).entered();
        if let Err(e) = put_stats_dump(stats, &dir) {
            warn!(id = %self.id, error = %e, "CRIU's dump statistics not put where containerd's CRI takes them: the archive has them only under checkpoint/");
        }
    }

    /// `ResumeAfterDump`, inside step 3 of a checkpoint of a paused container: once CRIU's dump
    /// and the copy of the rootfs changes are done, the container is thawed and its device
    /// state put back on its GPUs and unlocked ([`Container::resume`]), so that containerd's
    /// copy of the checkpoint and its rootfs diff run while the application works. Without a
    /// copy of the rootfs changes (a rootfs that is no overlay) containerd's diff is the only
    /// record of them, and the container waits for containerd's Resume as before; so it does
    /// when the resume fails (containerd's Resume tries again what did not come back). How long
    /// the resume took.
    async fn resume_after_dump(
        &mut self,
        copied: bool,
        timings: &mut Vec<(&'static str, Duration)>,
    ) -> Duration {
        if !copied {
            warn!(id = %self.id, "no resume after the dump: the rootfs has no copy of its changes (no overlay), so the container waits for containerd's Resume");
            return Duration::ZERO;
        }
        let t = Instant::now();
        let step = self.op.step(checkpoint::RESUME_AFTER_DUMP_STEP);
        let span = info_span!(parent: step.span(), "resume_after_dump", id = %self.id);
        let resumed = self.resume().instrument(span).await;
        let took = t.elapsed();
        step.end(&resumed);
        match resumed {
            Ok(()) => {
                self.init.status = Status::Running;
                self.resumed_after_dump = true;
                timings.push((checkpoint::RESUME_AFTER_DUMP_STEP, took));
                info!(id = %self.id, ms = took.as_millis() as u64, "resumed right after the dump");
            }
            Err(e) => {
                // The thaw may have happened (the device resume comes after it), so the
                // container may have run on while containerd takes its diff: the timing is
                // recorded all the same, so that containerd's own restore is refused. The
                // processes whose device resume failed stay quiesced; containerd's Resume
                // tries them again.
                timings.push((checkpoint::RESUME_AFTER_DUMP_STEP, took));
                warn!(id = %self.id, error = %e, "resume right after the dump failed: the container waits for containerd's Resume")
            }
        }
        took
    }

    /// The copy of the container's rootfs changes (its overlay's upper directory) into the
    /// image directory `image`, so that the signature covers them (containerd's
    /// rootfs-diff.tar comes after the shim returns); whether there was one to copy. Owners are
    /// recorded as the container sees them (its user namespace mappings).
    async fn copy_rootfs_changes(&self, image: &Path) -> Result<bool> {
        let upper = self.upperdir.clone();
        let ids = spec_check::Policy::from_bundle(&self.bundle)?;
        let copy = image.join(manifest::ROOTFS_CHANGES_FILE);
        tokio::task::spawn_blocking(move || -> Result<bool> {
            let Some(upper) = upper.filter(|u| u.is_dir()) else {
                return Ok(false);
            };
            let _ = std::fs::remove_file(&copy);
            crate::rootfs_changes::write(&upper, &copy, &ids)?;
            Ok(true)
        })
        .await
        .map_err(|e| Error::FailedPrecondition(format!("copy the rootfs changes: {e}")))?
    }

    /// Step 3: the copy of the rootfs changes, then (with `resume_after_dump`) the resume,
    /// then the manifest hashed, signed and written.
    #[allow(clippy::too_many_arguments)]
    async fn write_manifest(
        &mut self,
        plan: &CheckpointPlan,
        node: manifest::Node,
        devices: manifest::Devices,
        mut followed: BTreeMap<String, manifest::FileDigest>,
        addresses: Option<Vec<String>>,
        timings: &mut Vec<(&'static str, std::time::Duration)>,
        resume_after_dump: bool,
    ) -> Result<Manifest> {
        // The device-memory files (placed in the image directory by now) with their digests,
        // taken as they were written: not read again.
        let device_files = self
            .devices
            .device_files()
            .map(|s| s.files)
            .unwrap_or_default();
        for (_, f) in &device_files {
            followed.insert(
                f.name.clone(),
                manifest::FileDigest {
                    size: f.size,
                    sha256: String::new(),
                    blake3: f.blake3.clone(),
                },
            );
        }
        let started = Instant::now();
        let image = plan.image_path.clone();
        let cri = self.bundle.cri(&self.id);
        let container = manifest::Container {
            id: self.id.clone(),
            name: cri.name,
            pod_name: cri.sandbox_name,
            pod_namespace: cri.namespace,
            pod_uid: cri.pod_uid,
            image: cri.image,
            image_digest: String::new(),
            annotations: crate::restored_annotations::record(self.bundle.annotations()),
            addresses,
        };
        let get = |k: &str| {
            self.bundle
                .annotations()
                .get(k)
                .cloned()
                .unwrap_or_default()
        };
        let workload = manifest::Workload {
            engine_version: get(annotations::ENGINE_VERSION),
            model_version: get(annotations::MODEL_VERSION),
        };
        let mut m = Manifest::new(now_rfc3339(), container, node, devices, workload);
        m.criu = plan.criu.clone();
        // The security context it ran under, for the restore's check against its new spec.
        m.security = Some(spec_check::security_record(&self.bundle));
        // The NCCL processes released for this checkpoint, for the rebuild after a restore.
        m.nccl = self.comms().record();
        let pages = plan.page_digests;
        // The node key (made on first use), and a copy of the container's rootfs changes.
        let key = if self.options.sign_checkpoints() {
            Some(crate::trust::node_key(&self.options)?)
        } else {
            None
        };
        let copied = self.copy_rootfs_changes(&image).await?;
        let mut resumed_for = Duration::ZERO;
        if resume_after_dump {
            resumed_for = self.resume_after_dump(copied, timings).await;
        }
        let mut m = tokio::task::spawn_blocking(move || -> Result<Manifest> {
            let mut m = m;
            restrict_files(&image)?;
            m.files = manifest::hash_dir_flat_with(&image, followed, pages, &mut no_progress)?;
            for (pid, f) in &device_files {
                m.add_device_memory(&f.name, &f.gpu.to_string(), *pid, f.size, &f.blake3)?;
            }
            Ok(m)
        })
        .await
        .map_err(|e| Error::FailedPrecondition(format!("hash checkpoint: {e}")))??;
        timings.push((
            "manifest-hash",
            started.elapsed().saturating_sub(resumed_for),
        ));
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
}

/// A step's error `e` whose undo failed with `undo`.
fn with_undo(e: Error, undo: Error) -> Error {
    match e {
        Error::Step {
            operation,
            step,
            message,
        } => Error::Step {
            operation,
            step,
            message: format!("{message}; and its undo failed: {undo}"),
        },
        e => Error::FailedPrecondition(format!("{e}; and its undo failed: {undo}")),
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

/// The temp name of the stats-dump copy in containerd's directory.
const STATS_TMP: &str = ".stats-dump.gpu-ckpt-tmp";

/// Copies `stats` to `dir/stats-dump` (mode 0600) through a temp file made new (`O_CREAT |
/// O_EXCL | O_NOFOLLOW`) in `dir` opened without following a link, then renamed: a link
/// someone put at either name is replaced, never written through.
fn put_stats_dump(stats: &Path, dir: &Path) -> std::io::Result<()> {
    let root = image_format::safe::SafeRoot::open_existing(dir)?;
    root.remove_file(STATS_TMP)?;
    let copied = (|| {
        let mut out = root.create_file(STATS_TMP)?;
        std::io::copy(&mut std::fs::File::open(stats)?, &mut out)?;
        root.rename(STATS_TMP, "stats-dump")
    })();
    if copied.is_err() {
        let _ = root.remove_file(STATS_TMP);
    }
    copied
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Links at the temp name, at `stats-dump` and at the directory itself are never followed.
    #[test]
    fn the_stats_dump_copy_follows_no_link() {
        let d = tempfile::tempdir().unwrap();
        let stats = d.path().join("stats");
        std::fs::write(&stats, "STATS").unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        let dir = d.path().join("cri");
        std::fs::create_dir(&dir).unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(STATS_TMP)).unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("stats-dump")).unwrap();
        put_stats_dump(&stats, &dir).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        let m = std::fs::symlink_metadata(dir.join("stats-dump")).unwrap();
        assert!(m.file_type().is_file());
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
        assert_eq!(
            std::fs::read_to_string(dir.join("stats-dump")).unwrap(),
            "STATS"
        );
        assert!(!dir.join(STATS_TMP).exists());
        // The directory reached through a link: refused.
        let link = d.path().join("cri-link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(put_stats_dump(&stats, &link).is_err());
    }
}
