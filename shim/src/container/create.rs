//! Create: the container's bundle read, its rootfs mounted, runc pointed at the shim's CRIU
//! configuration, the restore handler's own restore prepared, and `runc create`, each step
//! undone in reverse order when a later one fails. A container to be restored is left at the
//! pending restore ([`PendingRestore`]): Start restores it.

use std::{collections::HashMap, path::Path, path::PathBuf};

use containerd_shim::{
    asynchronous::io::Stdio,
    protos::api::CreateTaskRequest,
    util::{mount_rootfs, read_pid_from_file},
};
use oci_spec::runtime::LinuxNamespaceType;
use tracing::{info_span, warn, Instrument};

use super::{Container, PendingRestore, RestoreSource, INIT_PID_FILE};
use crate::{
    annotations::{self, Annotations},
    bundle::Bundle,
    device::ContainerDevices,
    error::{Error, Result},
    events::EventSender,
    nccl::inject,
    options::RuntimeOptions,
    process::Process,
    runc::{CreateOpts, Runc},
    stdio::Absent,
    unsupported::Given,
};

/// A restore Create was asked for, for the record of one it refused or failed.
#[derive(Debug, Clone)]
pub struct RestoreAsked {
    pub cri: crate::bundle::CriIdentity,
    /// Where the checkpoint is: containerd's directory, a CRIU image directory, or the pod's
    /// `gpu-ckpt.io/restore-from` (a credential in a URL left out).
    pub checkpoint: String,
    pub options: RuntimeOptions,
}

impl Container {
    /// Whether `req` asks for a restore: containerd's checkpoint, a CRIU image directory, or
    /// under the restore handler a checkpoint the pod names for this container. Read again
    /// from the bundle for a Create that failed, when nothing else is left of it.
    pub fn restore_asked(req: &CreateTaskRequest) -> Option<RestoreAsked> {
        let bundle = Bundle::load(Path::new(&req.bundle)).ok()?;
        let options = RuntimeOptions::from_any(req.options.as_ref()).ok()?;
        let cri = bundle.cri(&req.id);
        let checkpoint = match PendingRestore::from_containerd(&req.checkpoint, &options) {
            Some(pending) => pending.dir.display().to_string(),
            None if options.restore_mode() && cri.container_type == "container" => {
                let annotations = Annotations::from_spec(bundle.annotations()).ok()?;
                without_userinfo(annotations.restore_from(&cri.name)?)
            }
            None => return None,
        };
        Some(RestoreAsked {
            cri,
            checkpoint,
            options,
        })
    }

    /// Creates the container: options, rootfs, stdio, `runc create`. On failure every step
    /// already taken is undone, in reverse order, and the error says which step failed.
    pub async fn create(
        req: &CreateTaskRequest,
        namespace: &str,
        events: &EventSender,
    ) -> Result<Self> {
        let mut container = Container::new(req, namespace)?;
        // Steps 1 to 3: the rootfs; the CRIU configuration; the restore handler's own restore.
        // Undo: what the restore unpacked, the mount.
        if let Err(e) = container.prepare(req, namespace).await {
            container.discard_pending();
            container.unmount_rootfs();
            return Err(e);
        }
        // Step 3b: gpu-ckpt's NCCL layer and its control socket's directory, for a container
        // that opts in, cold started or restored. Undo: the directory.
        if let Err(e) = container.inject_nccl(namespace) {
            container.discard_pending();
            container.unmount_rootfs();
            return Err(e);
        }
        // A restore creates nothing now: containerd lays the rootfs diff over the rootfs after
        // Create, and Start restores the process.
        if container.pending.is_some() {
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
            container.remove_nccl();
            container.unmount_rootfs();
            return Err(e);
        }
        // Step 5: OOM watch (nothing to undo: it ends with the cgroup).
        container.watch_oom(events);
        Ok(container)
    }

    /// The container as the request and its bundle describe it, nothing done yet. A restore
    /// containerd hands over (its checkpoint, or a CRIU image directory in the runc options)
    /// is pending from here; containerd's checkpoint gave the spec its annotations from the
    /// archive's unsigned members, which are held to the signed record before anything reads
    /// them.
    fn new(req: &CreateTaskRequest, namespace: &str) -> Result<Self> {
        let bundle = Bundle::load(Path::new(&req.bundle))?;
        let options = RuntimeOptions::from_any(req.options.as_ref())?;
        options.write_to_bundle(bundle.path())?;
        let runc = Runc::new(&options, namespace, bundle.path());
        // Namespaces runc creates for the container (an entry without a path), not joined ones.
        let creates = |typ: LinuxNamespaceType| {
            bundle
                .spec()
                .linux()
                .as_ref()
                .and_then(|l| l.namespaces().as_ref())
                .is_some_and(|ns| ns.iter().any(|n| n.typ() == typ && n.path().is_none()))
        };
        let shares_pid_namespace = !creates(LinuxNamespaceType::Pid);
        let own_network_namespace = creates(LinuxNamespaceType::Network);
        let pending = PendingRestore::from_containerd(&req.checkpoint, &options);
        if let Some(p) = pending
            .as_ref()
            .filter(|p| p.source == RestoreSource::Containerd)
        {
            crate::restored_annotations::check_dir(&p.dir, bundle.annotations(), &options)?;
        }
        let annotations = Annotations::from_spec(bundle.annotations())?;
        let stdio = Stdio::new(&req.stdin, &req.stdout, &req.stderr, req.terminal);
        let devices = ContainerDevices::new(&options, annotations.get(annotations::LOCK_TIMEOUT))
            .given(Given::from_spec(bundle.json()))
            .stored_under(crate::device_storage::dir_for(&options, namespace, &req.id).ok());
        let memory = crate::memory_room::HostMemory::new(&req.id, &options);
        Ok(Container {
            id: req.id.clone(),
            bundle,
            runc,
            options,
            init: Process::new("", stdio),
            execs: HashMap::new(),
            oom: None,
            shares_pid_namespace,
            own_network_namespace,
            mounted_rootfs: false,
            annotations,
            pending,
            own_criu_conf: false,
            upperdir: None,
            devices,
            memory,
            paused_devices: None,
            resumed_after_dump: false,
            nccl: None,
            op: Default::default(),
        })
    }

    /// Step 3b: where the container opts in (`nccl::inject::opt_in`; at a restore, where the
    /// checkpoint was taken with the layer: `opt_in_at_restore`), the NCCL layer's and the
    /// socket directory's mounts and environment written into `config.json`, the directory
    /// made, and the device steps told that its NCCL processes are managed. Undo: the
    /// directory ([`Container::remove_nccl`]).
    fn inject_nccl(&mut self, namespace: &str) -> Result<()> {
        let _span = info_span!("nccl_inject", id = %self.id).entered();
        let opt_in = match &self.pending {
            Some(p) => inject::opt_in_at_restore(&self.options, &self.annotations, &p.dir),
            None => inject::opt_in(&self.options, &self.annotations),
        };
        if !opt_in {
            return Ok(());
        }
        let mut json = self.bundle.json().clone();
        let setup = inject::inject_managed(&mut json, &self.options, namespace, &self.id)?;
        if let Err(e) = self.bundle.rewrite(json) {
            inject::remove_setup(&setup);
            return Err(e);
        }
        self.devices.nccl_managed();
        self.nccl = Some(setup);
        Ok(())
    }

    /// Undo of step 3b: the socket directory.
    pub(super) fn remove_nccl(&mut self) {
        if let Some(setup) = self.nccl.take() {
            inject::remove_setup(&setup);
        }
    }

    /// Steps 1 to 3 of Create, before anything runs; the caller undoes them on failure.
    async fn prepare(&mut self, req: &CreateTaskRequest, namespace: &str) -> Result<()> {
        // Step 1: the rootfs. Undo: unmount.
        self.mount_rootfs(req)
            .instrument(info_span!("mount_rootfs", id = %req.id))
            .await?;
        // Step 2: the CRIU configuration file runc will use for this container's checkpoints.
        crate::checkpoint::CriuConf::default().write(self.bundle.path())?;
        self.own_criu_conf = crate::checkpoint::point_runc_at_criu_conf(&mut self.bundle)?;
        // Step 3 (restore handler): the checkpoint the pod names for this container, fetched,
        // checked, unpacked and its rootfs diff applied. Undo: what it unpacked.
        // A checkpoint's image volume is mounted only by the container restoring from it.
        if self.pending.is_none() && self.options.restore_mode() {
            self.prepare_own_restore(namespace)
                .instrument(info_span!("prepare_restore", id = %req.id))
                .await?;
            crate::restore::refuse_checkpoint_volumes(&self.bundle)?;
        }
        Ok(())
    }

    /// Under the restore handler, a container (not the pod's sandbox) whose pod names a
    /// checkpoint for it is set up to be restored from it at Start.
    async fn prepare_own_restore(&mut self, containerd_namespace: &str) -> Result<()> {
        let me = self.bundle.cri(&self.id);
        if me.container_type != "container" {
            return Ok(());
        }
        let Some(source) = self.annotations.restore_from(&me.name).map(str::to_string) else {
            return Ok(());
        };
        let named = source.clone();
        let staging = crate::restore::staging_dir(&self.options, containerd_namespace, &self.id)?;
        let (mut bundle, ann, options) = (
            self.bundle.clone(),
            self.annotations.clone(),
            self.options.clone(),
        );
        let unpack_to = staging.clone();
        let joined = tokio::task::spawn_blocking(move || {
            let me = crate::restore::Identity {
                name: &me.name,
                image: &me.image,
                namespace: &me.namespace,
                sandbox_id: &me.sandbox_id,
            };
            let rootfs = bundle.join("rootfs");
            let req = crate::restore::Request {
                rootfs: &rootfs,
                staging: &unpack_to,
                source: &source,
                me: &me,
                ann: &ann,
                options: &options,
            };
            let plan = crate::restore::prepare(&mut bundle, &req);
            (bundle, plan)
        })
        .await;
        let (bundle, plan) = joined.map_err(|e| {
            crate::restore::remove_staging(&staging);
            Error::FailedPrecondition(format!("prepare restore: {e}"))
        })?;
        // Its spec may have lost the checkpoint volume's mounts.
        self.bundle = bundle;
        self.pending = PendingRestore::from_plan(plan?, staging).map(|mut p| {
            p.named = Some(without_userinfo(&named));
            p
        });
        Ok(())
    }

    /// Undo of a restore prepared at Create and never started: what it unpacked.
    pub(super) fn discard_pending(&mut self) {
        if let Some(mut pending) = self.pending.take() {
            pending.remove_staging();
        }
    }

    async fn mount_rootfs(&mut self, req: &CreateTaskRequest) -> Result<()> {
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
        let root = self
            .bundle
            .spec()
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

    async fn runc_create(&mut self) -> Result<()> {
        let prepared = self
            .prepare_io(&self.init.stdio, &self.id, Absent::DevNull)
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
            .create(&self.id, self.bundle.path(), &opts, prepared.child);
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
}

/// `source` without a `user:password@` before its host, if it has one.
fn without_userinfo(source: &str) -> String {
    let (scheme, rest) = match source.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), source),
    };
    let host_end = rest.find('/').unwrap_or(rest.len());
    match rest[..host_end].rfind('@') {
        Some(at) => format!("{scheme}{}", &rest[at + 1..]),
        None => source.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::without_userinfo;

    #[test]
    fn a_credential_in_a_source_is_left_out() {
        assert_eq!(
            without_userinfo("https://u:p@reg.example/ckpt/a:1"),
            "https://reg.example/ckpt/a:1"
        );
        assert_eq!(without_userinfo("u:p@reg.example/a:1"), "reg.example/a:1");
        assert_eq!(
            without_userinfo("reg.example/ckpt/a@sha256:00"),
            "reg.example/ckpt/a@sha256:00"
        );
        assert_eq!(
            without_userinfo("/var/lib/kubelet/checkpoints/c.tar"),
            "/var/lib/kubelet/checkpoints/c.tar"
        );
    }
}
