//! The Task service: containerd's task API (v3) mapped onto [`Container`]s, and the exit
//! handler that turns the reaper's exits into process state and TaskExit events.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, Instant},
};

use async_trait::async_trait;
use containerd_shim::{
    api::{
        CheckpointTaskRequest, CloseIORequest, ConnectRequest, ConnectResponse, CreateTaskRequest,
        CreateTaskResponse, DeleteRequest, Empty, ExecProcessRequest, KillRequest, PauseRequest,
        PidsRequest, PidsResponse, ResizePtyRequest, ResumeRequest, ShutdownRequest, StartRequest,
        StartResponse, StateRequest, StateResponse, Status as ApiStatus, UpdateTaskRequest,
        WaitRequest, WaitResponse,
    },
    asynchronous::{io::Stdio, ExitSignal},
    monitor::{monitor_subscribe, Subject, Topic},
    protos::{
        api::{DeleteResponse, ProcessInfo, StatsRequest, StatsResponse},
        events::task::{
            TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskIO, TaskPaused,
            TaskResumed, TaskStart,
        },
        protobuf::MessageField,
        shim::oci::ProcessDetails,
        topics::*,
        ttrpc,
    },
    util::convert_to_any,
    Task, TtrpcContext,
};
use tokio::sync::{Mutex, RwLock};
use tracing::{debug, info, info_span, warn, Instrument};

use crate::{
    checkpoint::CheckpointPlan,
    container::Container,
    error::{Error, Result},
    events::EventSender,
    process::{Exit, Status},
    record::{self, Facts, OpLog},
    stdio,
};

/// The ttrpc request's metadata (containerd's W3C `traceparent` travels there).
type Metadata = HashMap<String, Vec<String>>;

/// How long the export of a checkpoint's or restore's spans may take (sent beside the reply, never before it).
const FLUSH_BOUND: Duration = Duration::from_secs(2);

type Shared = Arc<Mutex<Container>>;

/// How long an exit nobody has claimed yet is kept: an exec can exit before its pid is known.
const UNCLAIMED_EXIT_TTL: Duration = Duration::from_secs(60);

/// How long Pids waits for a busy container before it answers from the container's cgroup.
const PIDS_LOCK_WAIT: Duration = Duration::from_secs(1);

/// Which process a pid belongs to, each container's init pid, and exits that came before their
/// pid was registered.
#[derive(Default)]
struct PidIndex {
    owners: HashMap<i32, (String, String)>,
    /// One init pid per container: what Connect answers without the container's lock. A
    /// restore has no process at Create (pid 0, never recorded) and gets its pid at Start.
    inits: HashMap<String, i32>,
    unclaimed: HashMap<i32, (i32, Instant)>,
}

impl PidIndex {
    /// Records that `pid` is `exec_id` of `container`; returns its exit code if it has already
    /// exited since `since`. Pid 0 (a restore before Start: no process yet) records nothing.
    fn register(
        &mut self,
        pid: i32,
        container: &str,
        exec_id: &str,
        since: Instant,
    ) -> Option<i32> {
        if pid <= 0 {
            return None;
        }
        if exec_id.is_empty() {
            self.inits.insert(container.to_string(), pid);
        }
        if let Some((code, at)) = self.unclaimed.remove(&pid) {
            if at >= since {
                return Some(code);
            }
        }
        self.owners
            .insert(pid, (container.to_string(), exec_id.to_string()));
        None
    }

    /// Forgets the processes `pids` of `container`, and its init pid when `init`.
    fn forget(&mut self, container: &str, pids: impl IntoIterator<Item = i32>, init: bool) {
        for pid in pids {
            self.owners.remove(&pid);
        }
        if init {
            self.inits.remove(container);
        }
    }
}

/// The Task service containerd talks to; shares its state with the exit handler.
#[derive(Clone)]
pub struct TaskService(Arc<Tasks>);

impl std::ops::Deref for TaskService {
    type Target = Tasks;
    fn deref(&self) -> &Tasks {
        &self.0
    }
}

pub struct Tasks {
    namespace: String,
    containers: RwLock<HashMap<String, Shared>>,
    pids: std::sync::Mutex<PidIndex>,
    events: EventSender,
    exit: Arc<ExitSignal>,
}

impl TaskService {
    /// Builds the service and starts its exit handler.
    pub async fn start(
        namespace: &str,
        events: EventSender,
        exit: Arc<ExitSignal>,
    ) -> Result<Self> {
        let service = Arc::new(Tasks {
            namespace: namespace.to_string(),
            containers: RwLock::new(HashMap::new()),
            pids: Default::default(),
            events,
            exit,
        });
        let mut sub = monitor_subscribe(Topic::Pid).await?;
        let weak = Arc::downgrade(&service);
        tokio::spawn(async move {
            while let Some(ev) = sub.rx.recv().await {
                let Subject::Pid(pid) = ev.subject else {
                    continue;
                };
                match weak.upgrade() {
                    Some(s) => s.on_exit(pid, ev.exit_code).await,
                    None => break,
                }
            }
        });
        Ok(TaskService(service))
    }
}

impl Tasks {
    async fn container(&self, id: &str) -> Result<Shared> {
        self.containers
            .read()
            .await
            .get(id)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("container {id} not found")))
    }

    /// Records that `pid` is `exec_id` of `container` ([`PidIndex::register`]).
    fn register_pid(
        &self,
        pid: i32,
        container: &str,
        exec_id: &str,
        since: Instant,
    ) -> Option<i32> {
        let mut index = self.pids.lock().unwrap_or_else(|p| p.into_inner());
        index.register(pid, container, exec_id, since)
    }

    /// Forgets the processes `pids` of `container` ([`PidIndex::forget`]).
    fn forget_pids(&self, container: &str, pids: impl IntoIterator<Item = i32>, init: bool) {
        let mut index = self.pids.lock().unwrap_or_else(|p| p.into_inner());
        index.forget(container, pids, init);
    }

    async fn on_exit(&self, pid: i32, code: i32) {
        let owner = {
            let mut index = self.pids.lock().unwrap_or_else(|p| p.into_inner());
            match index.owners.remove(&pid) {
                Some(owner) => Some(owner),
                None => {
                    let now = Instant::now();
                    index
                        .unclaimed
                        .retain(|_, (_, at)| now.duration_since(*at) < UNCLAIMED_EXIT_TTL);
                    index.unclaimed.insert(pid, (code, now));
                    None
                }
            }
        };
        let Some((id, exec_id)) = owner else { return };
        let Ok(container) = self.container(&id).await else {
            return;
        };
        let mut c = container.lock().await;
        self.finish_process(&mut c, &exec_id, pid, code).await;
    }

    /// Marks a process exited and publishes TaskExit (after TaskOOM, for init).
    async fn finish_process(&self, c: &mut Container, exec_id: &str, pid: i32, code: i32) {
        if exec_id.is_empty() {
            c.on_init_exit().await;
        }
        let id = c.id.clone();
        let Ok(process) = c.process_mut(exec_id) else {
            return;
        };
        let exit = process.set_exited(code);
        info!(container = %id, exec = %exec_id, pid, code, "process exited");
        self.events.send(
            TASK_EXIT_EVENT_TOPIC,
            TaskExit {
                container_id: id.clone(),
                id: if exec_id.is_empty() {
                    id
                } else {
                    exec_id.to_string()
                },
                pid: pid as u32,
                exit_status: exit.code,
                exited_at: exit.exited_at(),
                ..Default::default()
            },
        );
    }

    async fn do_create(
        &self,
        req: CreateTaskRequest,
        parent: &Metadata,
    ) -> Result<CreateTaskResponse> {
        if req.id.is_empty() {
            return Err(Error::InvalidArgument("container id is empty".into()));
        }
        // A restore refused at Create is timed from here.
        let log = OpLog::default();
        let created = self.create_container(&req).await;
        if let Err(e) = &created {
            if let Some(asked) = Container::restore_asked(&req) {
                self.record_refused_restore(&req, asked, e, (&log, parent))
                    .await;
            }
        }
        created
    }

    /// The record of a restore Create refused or failed (trust, admission, the restore
    /// handler's fetch and unpack, containerd's annotations held to the signed record).
    async fn record_refused_restore(
        &self,
        req: &CreateTaskRequest,
        asked: crate::container::RestoreAsked,
        e: &Error,
        (log, parent): (&OpLog, &Metadata),
    ) {
        let options = &asked.options;
        record::configure_traces(options.otlp_endpoint(), options.otlp_protocol());
        let root = record::root_span(journal::Operation::Restore, &req.id, Some(&asked.cri));
        record::adopt_parent(&root, parent);
        log.set_root(root);
        let mut facts = Facts::new(&self.namespace, &req.id, Some(asked.cri.clone()));
        facts.checkpoint = Some(asked.checkpoint.clone());
        let ending = record::Ending {
            operation: journal::Operation::Restore,
            facts,
            result: Err(e),
            manifest: None,
        };
        record::finish(log, ending, options).await;
        record::send_traces(FLUSH_BOUND);
    }

    async fn create_container(&self, req: &CreateTaskRequest) -> Result<CreateTaskResponse> {
        let mut containers = self.containers.write().await;
        if containers.contains_key(&req.id) {
            return Err(Error::AlreadyExists(format!(
                "container {} already exists",
                req.id
            )));
        }
        let since = Instant::now();
        let container = Container::create(req, &self.namespace, &self.events).await?;
        record::configure_traces(
            container.options.otlp_endpoint(),
            container.options.otlp_protocol(),
        );
        let pid = container.init.pid;
        let id = container.id.clone();
        let early = self.register_pid(pid, &id, "", since);
        let shared = Arc::new(Mutex::new(container));
        containers.insert(id.clone(), shared.clone());
        drop(containers);
        self.events.send(
            TASK_CREATE_EVENT_TOPIC,
            TaskCreate {
                container_id: id.clone(),
                bundle: req.bundle.clone(),
                rootfs: req.rootfs.clone(),
                io: MessageField::some(TaskIO {
                    stdin: req.stdin.clone(),
                    stdout: req.stdout.clone(),
                    stderr: req.stderr.clone(),
                    terminal: req.terminal,
                    ..Default::default()
                }),
                checkpoint: req.checkpoint.clone(),
                pid: pid as u32,
                ..Default::default()
            },
        );
        if let Some(code) = early {
            let mut c = shared.lock().await;
            self.finish_process(&mut c, "", pid, code).await;
        }
        Ok(CreateTaskResponse {
            pid: pid as u32,
            ..Default::default()
        })
    }

    async fn do_start(&self, req: StartRequest, parent: &Metadata) -> Result<StartResponse> {
        let container = self.container(&req.id).await?;
        let mut c = container.lock().await;
        if req.exec_id.is_empty() {
            let since = Instant::now();
            let created_pid = c.init.pid;
            match c.restore_source() {
                Some(checkpoint) => self.start_restore(&mut c, checkpoint, parent).await?,
                None => c.start_init(&self.events).await?,
            }
            let pid = c.init.pid;
            // A restore has a pid only now: exits are matched to it from here on.
            let early = (pid != created_pid)
                .then(|| self.register_pid(pid, &c.id, "", since))
                .flatten();
            self.events.send(
                TASK_START_EVENT_TOPIC,
                TaskStart {
                    container_id: c.id.clone(),
                    pid: pid as u32,
                    ..Default::default()
                },
            );
            if let Some(code) = early {
                self.finish_process(&mut c, "", pid, code).await;
            }
            return Ok(StartResponse {
                pid: pid as u32,
                ..Default::default()
            });
        }
        let since = Instant::now();
        let pid = c.start_exec(&req.exec_id).await?;
        let early = self.register_pid(pid, &c.id, &req.exec_id, since);
        self.events.send(
            TASK_EXEC_STARTED_EVENT_TOPIC,
            TaskExecStarted {
                container_id: c.id.clone(),
                exec_id: req.exec_id.clone(),
                pid: pid as u32,
                ..Default::default()
            },
        );
        if let Some(code) = early {
            self.finish_process(&mut c, &req.exec_id, pid, code).await;
        }
        Ok(StartResponse {
            pid: pid as u32,
            ..Default::default()
        })
    }

    /// Start of a container Create left a restore pending: the restore in its root span, its
    /// record, its spans sent.
    async fn start_restore(
        &self,
        c: &mut Container,
        checkpoint: String,
        parent: &Metadata,
    ) -> Result<()> {
        let cri = c.bundle.cri(&c.id);
        let root = record::root_span(journal::Operation::Restore, &c.id, Some(&cri));
        record::adopt_parent(&root, parent);
        c.op = OpLog::new(root.clone());
        let result = c.start_init(&self.events).instrument(root).await;
        let mut facts = Facts::new(&self.namespace, &c.id, Some(cri)).with_noted(&c.op);
        facts.checkpoint = Some(checkpoint);
        let ending = record::Ending {
            operation: journal::Operation::Restore,
            facts,
            result: result.as_ref().map(|_| ()),
            manifest: None,
        };
        record::finish(&c.op, ending, &c.options).await;
        c.op = OpLog::default();
        record::send_traces(FLUSH_BOUND);
        result
    }

    async fn do_delete(&self, req: DeleteRequest) -> Result<DeleteResponse> {
        let container = self.container(&req.id).await?;
        let mut c = container.lock().await;
        if !req.exec_id.is_empty() {
            let process = c.process(&req.exec_id)?;
            if matches!(process.status, Status::Running | Status::Paused) {
                return Err(Error::FailedPrecondition(format!(
                    "cannot delete exec {}: it is still running",
                    req.exec_id
                )));
            }
            let exit = process.exit().unwrap_or_else(|| Exit::now(0));
            let pid = process.pid;
            if let Some(p) = c.execs.remove(&req.exec_id) {
                p.io.tasks.shutdown().await;
            }
            self.forget_pids(&req.id, [pid], false);
            return Ok(DeleteResponse {
                pid: pid as u32,
                exit_status: exit.code,
                exited_at: exit.exited_at(),
                ..Default::default()
            });
        }
        self.end_pause(&c, None).await;
        c.delete()
            .instrument(info_span!("delete", id = %req.id))
            .await?;
        let pid = c.init.pid;
        // A created, never started container has no exit of its own: runc delete killed it.
        let exit = c
            .init
            .exit()
            .unwrap_or_else(|| Exit::now(128 + libc::SIGKILL));
        self.forget_pids(
            &req.id,
            std::iter::once(pid).chain(c.execs.values().map(|p| p.pid)),
            true,
        );
        let id = c.id.clone();
        drop(c);
        self.containers.write().await.remove(&id);
        self.events.send(
            TASK_DELETE_EVENT_TOPIC,
            TaskDelete {
                container_id: id.clone(),
                pid: pid as u32,
                exit_status: exit.code,
                exited_at: exit.exited_at(),
                id,
                ..Default::default()
            },
        );
        Ok(DeleteResponse {
            pid: pid as u32,
            exit_status: exit.code,
            exited_at: exit.exited_at(),
            ..Default::default()
        })
    }

    async fn do_exec(&self, req: ExecProcessRequest) -> Result<Empty> {
        let container = self.container(&req.id).await?;
        let mut c = container.lock().await;
        if c.execs.contains_key(&req.exec_id) {
            return Err(Error::AlreadyExists(format!(
                "exec {} already exists in container {}",
                req.exec_id, req.id
            )));
        }
        if c.init.is_stopped() {
            return Err(Error::FailedPrecondition(format!(
                "container {} is not running",
                req.id
            )));
        }
        let mut spec = req
            .spec
            .as_ref()
            .map(|a| a.value.clone())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| {
                Error::InvalidArgument(format!("exec {} has no process spec", req.exec_id))
            })?;
        // An exec'd process of a container with the NCCL layer runs under it too (a rank
        // started by `kubectl exec` is checkpointed like the others).
        if c.nccl.is_some() {
            spec = crate::nccl::inject::exec_process(&spec, c.options.nccl_release())?;
        }
        serde_json::from_slice::<oci_spec::runtime::Process>(&spec).map_err(|e| {
            Error::InvalidArgument(format!(
                "malformed process spec for exec {}: {e}",
                req.exec_id
            ))
        })?;
        let mut process = crate::process::Process::new(
            &req.exec_id,
            Stdio::new(&req.stdin, &req.stdout, &req.stderr, req.terminal),
        );
        process.spec = spec;
        c.execs.insert(req.exec_id.clone(), process);
        self.events.send(
            TASK_EXEC_ADDED_EVENT_TOPIC,
            TaskExecAdded {
                container_id: req.id.clone(),
                exec_id: req.exec_id.clone(),
                ..Default::default()
            },
        );
        Ok(Empty::new())
    }

    async fn do_state(&self, req: StateRequest) -> Result<StateResponse> {
        let container = self.container(&req.id).await?;
        let c = container.lock().await;
        let p = c.process(&req.exec_id)?;
        let status = match p.status {
            Status::Created => ApiStatus::CREATED,
            Status::Running => ApiStatus::RUNNING,
            Status::Paused => ApiStatus::PAUSED,
            Status::Stopped => ApiStatus::STOPPED,
        };
        let exit = p.exit();
        Ok(StateResponse {
            id: if req.exec_id.is_empty() {
                c.id.clone()
            } else {
                req.exec_id.clone()
            },
            bundle: c.bundle.path().display().to_string(),
            pid: p.pid as u32,
            status: status.into(),
            stdin: p.stdio.stdin.clone(),
            stdout: p.stdio.stdout.clone(),
            stderr: p.stdio.stderr.clone(),
            terminal: p.stdio.terminal,
            exit_status: exit.as_ref().map(|e| e.code).unwrap_or_default(),
            exited_at: exit.map(|e| e.exited_at()).unwrap_or_default(),
            exec_id: req.exec_id.clone(),
            ..Default::default()
        })
    }

    /// A checkpoint whose caller went away before it ended (containerd restarted): whatever
    /// it wrote must not look complete, as its caller was told it failed, so a written one
    /// loses its manifest first and then CRIU's images. A container left paused is resumed: the
    /// caller that paused it for the checkpoint (ctr, CRI) can no longer be relied on to.
    async fn abandon_checkpoint(
        &self,
        c: &mut Container,
        written: Option<(std::path::PathBuf, image_format::manifest::Manifest)>,
        result: Result<()>,
    ) {
        let id = c.id.clone();
        warn!(%id, ok = result.is_ok(), "checkpoint abandoned: its caller is gone");
        if let Some((dir, m)) = written {
            let manifest = dir.join(image_format::manifest::MANIFEST_FILE);
            match std::fs::remove_file(&manifest) {
                Ok(()) => {
                    // CRIU's images (which it would have overwritten anyway); other files may
                    // have been in the directory before.
                    for name in m.files.keys().filter(|n| n.ends_with(".img")) {
                        let _ = std::fs::remove_file(dir.join(name));
                    }
                    let _ = std::fs::remove_dir(&dir);
                    info!(%id, path = %dir.display(), "abandoned checkpoint removed");
                }
                Err(e) => {
                    warn!(%id, path = %manifest.display(), error = %e, "abandoned checkpoint: its manifest could not be removed")
                }
            }
        }
        if c.init.status == Status::Paused {
            match c.resume().await {
                Ok(()) => {
                    c.init.status = Status::Running;
                    self.events.send(
                        TASK_RESUMED_EVENT_TOPIC,
                        TaskResumed {
                            container_id: id.clone(),
                            ..Default::default()
                        },
                    );
                    info!(%id, "resumed after its abandoned checkpoint");
                }
                Err(e) => warn!(%id, error = %e, "resume after an abandoned checkpoint"),
            }
        }
    }

    /// Pauses (`pause`) or resumes the container's processes (cgroup freezer through runc).
    /// A Resume after a checkpoint that resumed the container right after its dump
    /// (`ResumeAfterDump`) is answered as done, once, with no second event: containerd's
    /// client sends it after its copy, as it would to a task it left paused. `parent`: the
    /// request's metadata, the parent of a Pause's root.
    async fn set_paused(&self, id: &str, pause: bool, parent: &Metadata) -> Result<()> {
        let container = self.container(id).await?;
        if !pause {
            info!(%id, "resume requested");
        }
        let mut c = container.lock().await;
        if !pause && c.resumed_after_dump && c.init.status != Status::Paused {
            c.resumed_after_dump = false;
            info!(%id, "resume: already resumed right after the checkpoint's dump");
            return Ok(());
        }
        let (from, to, state) = if pause {
            (Status::Running, Status::Paused, "running")
        } else {
            (Status::Paused, Status::Running, "paused")
        };
        if c.init.status != from {
            return Err(Error::FailedPrecondition(format!(
                "container {id} is not {state}"
            )));
        }
        if pause {
            self.pause_init(&mut c, parent).await?;
        } else {
            self.resume_init(&mut c).await?;
        }
        c.init.status = to;
        Ok(())
    }

    /// Pause of a running container, in the root of the checkpoint that may follow it
    /// ([`OpLog::at_pause`]): its device and NCCL steps are that checkpoint's first.
    async fn pause_init(&self, c: &mut Container, parent: &Metadata) -> Result<()> {
        let root = new_root(c, parent);
        c.op = OpLog::at_pause(root.clone());
        if let Err(e) = c.pause().instrument(root).await {
            self.record_failed_pause(c, &e).await;
            return Err(e);
        }
        self.events.send(
            TASK_PAUSED_EVENT_TOPIC,
            TaskPaused {
                container_id: c.id.clone(),
                ..Default::default()
            },
        );
        Ok(())
    }

    /// Resume of a paused container; a Pause no checkpoint followed ends here.
    async fn resume_init(&self, c: &mut Container) -> Result<()> {
        let resumed = c.resume().await;
        self.end_pause(c, resumed.as_ref().err()).await;
        resumed?;
        self.events.send(
            TASK_RESUMED_EVENT_TOPIC,
            TaskResumed {
                container_id: c.id.clone(),
                ..Default::default()
            },
        );
        Ok(())
    }

    /// The init pid of container `id`, from the pid index (without its lock).
    fn init_pid_of(&self, id: &str) -> Option<i32> {
        let index = self.pids.lock().unwrap_or_else(|p| p.into_inner());
        index.inits.get(id).copied()
    }

    async fn do_pids(&self, id: &str) -> Result<PidsResponse> {
        let container = self.container(id).await?;
        // A container busy for long (a checkpoint holds it until CRIU is done) answers from
        // its cgroup, without exec details: containerd asks for the pids when it starts and
        // takes a shim that does not answer for a dead one.
        let c = match tokio::time::timeout(PIDS_LOCK_WAIT, container.lock()).await {
            Ok(c) => c,
            Err(_) => return self.pids_from_cgroup(id),
        };
        let pids = c.runc.ps(id).await?;
        let mut processes = Vec::with_capacity(pids.len());
        for pid in pids {
            let mut info = ProcessInfo {
                pid: pid as u32,
                ..Default::default()
            };
            if let Some(exec) = c.execs.values().find(|p| p.pid == pid) {
                let details = ProcessDetails {
                    exec_id: exec.exec_id.clone(),
                    ..Default::default()
                };
                info.info = MessageField::some(convert_to_any(Box::new(details))?);
            }
            processes.push(info);
        }
        Ok(PidsResponse {
            processes,
            ..Default::default()
        })
    }

    /// The processes of container `id` as its memory cgroup lists them (`cgroup.procs`).
    fn pids_from_cgroup(&self, id: &str) -> Result<PidsResponse> {
        let busy = |why: String| {
            Error::FailedPrecondition(format!(
                "pids of container {id}: it is busy (a checkpoint runs) and {why}"
            ))
        };
        let init = self
            .init_pid_of(id)
            .ok_or_else(|| busy("its init process is not known".into()))?;
        let dir = match crate::oom::MemoryCgroup::of_pid(init) {
            Some(crate::oom::MemoryCgroup::V1(d) | crate::oom::MemoryCgroup::V2(d)) => d,
            None => return Err(busy(format!("pid {init} has no memory cgroup"))),
        };
        let procs = dir.join("cgroup.procs");
        let text = std::fs::read_to_string(&procs)
            .map_err(|e| busy(format!("{} is unreadable: {e}", procs.display())))?;
        Ok(PidsResponse {
            processes: text
                .lines()
                .filter_map(|l| l.trim().parse::<u32>().ok())
                .map(|pid| ProcessInfo {
                    pid,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
    }

    async fn do_stats(&self, id: &str) -> Result<StatsResponse> {
        let container = self.container(id).await?;
        let pid = container.lock().await.init.pid;
        let stats = tokio::task::spawn_blocking(move || crate::stats::collect(pid))
            .await
            .map_err(|e| Error::FailedPrecondition(format!("collect stats of {id}: {e}")))??;
        Ok(StatsResponse {
            stats: MessageField::some(stats),
            ..Default::default()
        })
    }

    async fn do_update(&self, req: UpdateTaskRequest) -> Result<()> {
        let container = self.container(&req.id).await?;
        let c = container.lock().await;
        if c.init.is_stopped() {
            return Err(Error::FailedPrecondition(format!(
                "container {} is not running",
                req.id
            )));
        }
        let resources = req
            .resources
            .as_ref()
            .map(|a| a.value.clone())
            .unwrap_or_default();
        serde_json::from_slice::<oci_spec::runtime::LinuxResources>(&resources).map_err(|e| {
            Error::InvalidArgument(format!("malformed resources for {}: {e}", req.id))
        })?;
        c.runc.update(&req.id, &resources).await
    }

    /// Checkpoint of a container. The work runs in a task of its own, holding the container
    /// until it ends: ttrpc drops a request's future when its connection closes (containerd
    /// restarted), and a checkpoint cut off at an arbitrary step would skip its undo and free
    /// the container for a Resume while CRIU still holds the cgroup frozen. A checkpoint whose
    /// caller is gone when it ends is abandoned ([`Tasks::abandon_checkpoint`]).
    async fn do_checkpoint(
        self: Arc<Self>,
        req: CheckpointTaskRequest,
        parent: Metadata,
    ) -> Result<()> {
        let container = self.container(&req.id).await?;
        let service = self.clone();
        let id = req.id.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let span = info_span!("checkpoint_work", id = %req.id);
        tokio::spawn(
            async move {
                let mut c = container.lock_owned().await;
                let root = checkpoint_root(&mut c, &parent);
                let result = async {
                    let plan = CheckpointPlan::resolve(
                        &req.path,
                        req.options.as_ref(),
                        &c.options,
                        &c.annotations,
                        c.init.stdio.terminal,
                    )?;
                    c.checkpoint(&plan).await.map(|m| (plan, m))
                }
                .instrument(root)
                .await;
                service.record_checkpoint(&mut c, &req.path, &result).await;
                // Resumed right after the dump (`ResumeAfterDump`): containerd sees the task
                // running from here, and its Resume after the copy has nothing to do.
                if c.resumed_after_dump {
                    service.events.send(
                        TASK_RESUMED_EVENT_TOPIC,
                        TaskResumed {
                            container_id: c.id.clone(),
                            ..Default::default()
                        },
                    );
                }
                if let Ok((plan, manifest)) = &result {
                    let total: u64 = manifest.files.values().map(|f| f.size).sum();
                    info!(
                        id = %req.id,
                        path = %plan.image_path.display(),
                        bytes = total,
                        leave_running = plan.criu.leave_running,
                        "checkpoint written"
                    );
                }
                let (answer, written) = match result {
                    Ok((plan, m)) => (Ok(()), Some((plan.image_path, m))),
                    Err(e) => (Err(e), None),
                };
                if let Err(unsent) = tx.send(answer) {
                    service.abandon_checkpoint(&mut c, written, unsent).await;
                }
            }
            .instrument(span),
        );
        rx.await.map_err(|_| {
            Error::FailedPrecondition(format!(
                "checkpoint of {id}: its task ended without an answer (it panicked)"
            ))
        })?
    }

    /// The record of a checkpoint (its steps as its manifest holds them when it succeeded),
    /// and its spans sent.
    async fn record_checkpoint(
        &self,
        c: &mut Container,
        path: &str,
        result: &Result<(CheckpointPlan, image_format::manifest::Manifest)>,
    ) {
        let cri = c.bundle.cri(&c.id);
        let mut facts = Facts::new(&self.namespace, &c.id, Some(cri));
        facts.checkpoint = (!path.is_empty()).then(|| path.to_string());
        let (result, manifest) = match result {
            Ok((_, m)) => (Ok(()), Some(m)),
            Err(e) => (Err(e), None),
        };
        let ending = record::Ending {
            operation: journal::Operation::Checkpoint,
            facts,
            result,
            manifest,
        };
        record::finish(&c.op, ending, &c.options).await;
        c.op = OpLog::default();
        record::send_traces(FLUSH_BOUND);
    }

    /// The end of a Pause that failed. One whose device or NCCL step failed is the checkpoint
    /// that failed (ctr and CRI pause a task before they checkpoint it, and its Checkpoint
    /// never comes): its record, and its root ends with the step's error. Any other ends the
    /// Pause's root as a failed `pause`, with no record. Its spans sent.
    async fn record_failed_pause(&self, c: &mut Container, e: &Error) {
        if matches!(
            e,
            Error::Step {
                operation: "checkpoint",
                ..
            }
        ) {
            let cri = c.bundle.cri(&c.id);
            let ending = record::Ending {
                operation: journal::Operation::Checkpoint,
                facts: Facts::new(&self.namespace, &c.id, Some(cri)),
                result: Err(e),
                manifest: None,
            };
            record::finish(&c.op, ending, &c.options).await;
        } else {
            record::end_pause(&c.op, Some(e));
        }
        c.op = OpLog::default();
        record::send_traces(FLUSH_BOUND);
    }

    /// The root of a Pause no checkpoint followed ended as `pause` (Resume, Kill, Delete;
    /// `error`: a failed Resume's), its spans sent.
    async fn end_pause(&self, c: &Container, error: Option<&Error>) {
        if record::end_pause(&c.op, error) {
            record::send_traces(FLUSH_BOUND);
        }
    }

    async fn do_wait(&self, req: WaitRequest) -> Result<WaitResponse> {
        let container = self.container(&req.id).await?;
        let mut rx = container.lock().await.process(&req.exec_id)?.exit_watch();
        let exit = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| Error::NotFound(format!("process {} is gone", req.id)))?
            .clone()
            .ok_or_else(|| Error::NotFound(format!("process {} is gone", req.id)))?;
        Ok(WaitResponse {
            exit_status: exit.code,
            exited_at: exit.exited_at(),
            ..Default::default()
        })
    }
}

/// The root span of a checkpoint of `c`: the one its Pause opened (ctr and CRI pause first;
/// its clock and device steps go on), else a new one joined to containerd's trace, its clock
/// starting now.
fn checkpoint_root(c: &mut Container, parent: &Metadata) -> tracing::Span {
    if c.init.status == Status::Paused {
        if let Some(root) = c.op.continue_pause() {
            return root;
        }
    }
    let root = new_root(c, parent);
    c.op = OpLog::new(root.clone());
    root
}

/// A new root span of a checkpoint of `c`, joined to the trace in the request's metadata.
fn new_root(c: &Container, parent: &Metadata) -> tracing::Span {
    let cri = c.bundle.cri(&c.id);
    let root = record::root_span(journal::Operation::Checkpoint, &c.id, Some(&cri));
    record::adopt_parent(&root, parent);
    root
}

/// Runs one request in a span and maps its error to a ttrpc status, in one place.
async fn serve<T>(
    name: &'static str,
    id: &str,
    fut: impl std::future::Future<Output = Result<T>>,
) -> ttrpc::Result<T> {
    let span = info_span!("task", rpc = name, id = %id);
    match fut.instrument(span).await {
        Ok(v) => Ok(v),
        Err(e) => {
            warn!(rpc = name, %id, error = %e, "request failed");
            Err(e.into())
        }
    }
}

#[async_trait]
impl Task for TaskService {
    async fn create(
        &self,
        ctx: &TtrpcContext,
        req: CreateTaskRequest,
    ) -> ttrpc::Result<CreateTaskResponse> {
        let id = req.id.clone();
        serve("create", &id, self.do_create(req, &ctx.metadata)).await
    }

    async fn start(&self, ctx: &TtrpcContext, req: StartRequest) -> ttrpc::Result<StartResponse> {
        let id = req.id.clone();
        serve("start", &id, self.do_start(req, &ctx.metadata)).await
    }

    async fn delete(
        &self,
        _ctx: &TtrpcContext,
        req: DeleteRequest,
    ) -> ttrpc::Result<DeleteResponse> {
        let id = req.id.clone();
        serve("delete", &id, self.do_delete(req)).await
    }

    async fn state(&self, _ctx: &TtrpcContext, req: StateRequest) -> ttrpc::Result<StateResponse> {
        let id = req.id.clone();
        serve("state", &id, self.do_state(req)).await
    }

    async fn pids(&self, _ctx: &TtrpcContext, req: PidsRequest) -> ttrpc::Result<PidsResponse> {
        serve("pids", &req.id, self.do_pids(&req.id)).await
    }

    async fn pause(&self, ctx: &TtrpcContext, req: PauseRequest) -> ttrpc::Result<Empty> {
        serve(
            "pause",
            &req.id,
            self.set_paused(&req.id, true, &ctx.metadata),
        )
        .await
        .map(|_| Empty::new())
    }

    async fn resume(&self, ctx: &TtrpcContext, req: ResumeRequest) -> ttrpc::Result<Empty> {
        serve(
            "resume",
            &req.id,
            self.set_paused(&req.id, false, &ctx.metadata),
        )
        .await
        .map(|_| Empty::new())
    }

    async fn kill(&self, _ctx: &TtrpcContext, req: KillRequest) -> ttrpc::Result<Empty> {
        let fut = async {
            let container = self.container(&req.id).await?;
            // SIGKILL of the container ends a driver call in flight on it, and every wait on its
            // NCCL layers, first: a checkpoint holds the container's lock until its call
            // returns or reaches its bound.
            if req.signal == libc::SIGKILL as u32 && req.exec_id.is_empty() {
                if let Some(init) = self.init_pid_of(&req.id) {
                    crate::device::abandon_calls_under(init);
                }
                crate::nccl::abort(&req.id);
            }
            let c = container.lock().await;
            if req.exec_id.is_empty() {
                self.end_pause(&c, None).await;
            }
            c.kill(&req.exec_id, req.signal, req.all).await
        };
        serve("kill", &req.id, fut).await.map(|_| Empty::new())
    }

    async fn exec(&self, _ctx: &TtrpcContext, req: ExecProcessRequest) -> ttrpc::Result<Empty> {
        let id = req.id.clone();
        serve("exec", &id, self.do_exec(req)).await
    }

    async fn resize_pty(&self, _ctx: &TtrpcContext, req: ResizePtyRequest) -> ttrpc::Result<Empty> {
        let fut = async {
            let container = self.container(&req.id).await?;
            let c = container.lock().await;
            let p = c.process(&req.exec_id)?;
            match &p.io.pty {
                Some(pty) => stdio::resize(pty, req.width, req.height),
                None => Err(Error::FailedPrecondition(format!(
                    "process {} has no terminal",
                    req.id
                ))),
            }
        };
        serve("resize_pty", &req.id, fut)
            .await
            .map(|_| Empty::new())
    }

    async fn close_io(&self, _ctx: &TtrpcContext, req: CloseIORequest) -> ttrpc::Result<Empty> {
        let fut = async {
            let container = self.container(&req.id).await?;
            let c = container.lock().await;
            if req.stdin {
                c.process(&req.exec_id)?.io.tasks.close_input();
            }
            Ok(())
        };
        serve("close_io", &req.id, fut).await.map(|_| Empty::new())
    }

    async fn update(&self, _ctx: &TtrpcContext, req: UpdateTaskRequest) -> ttrpc::Result<Empty> {
        let id = req.id.clone();
        serve("update", &id, self.do_update(req))
            .await
            .map(|_| Empty::new())
    }

    async fn wait(&self, _ctx: &TtrpcContext, req: WaitRequest) -> ttrpc::Result<WaitResponse> {
        let id = req.id.clone();
        serve("wait", &id, self.do_wait(req)).await
    }

    async fn checkpoint(
        &self,
        ctx: &TtrpcContext,
        req: CheckpointTaskRequest,
    ) -> ttrpc::Result<Empty> {
        let id = req.id.clone();
        let parent = ctx.metadata.clone();
        serve("checkpoint", &id, self.0.clone().do_checkpoint(req, parent))
            .await
            .map(|_| Empty::new())
    }

    async fn stats(&self, _ctx: &TtrpcContext, req: StatsRequest) -> ttrpc::Result<StatsResponse> {
        serve("stats", &req.id, self.do_stats(&req.id)).await
    }

    async fn connect(
        &self,
        _ctx: &TtrpcContext,
        req: ConnectRequest,
    ) -> ttrpc::Result<ConnectResponse> {
        let fut = async {
            let container = self.container(&req.id).await?;
            // From the pid index, not under the container's lock: containerd connects when it
            // starts and gives up on a shim that does not answer in time (cleaning it up, its
            // container killed), while a checkpoint holds the lock to its end.
            let pid = match self.init_pid_of(&req.id) {
                Some(pid) => pid,
                None => container.lock().await.init.pid,
            };
            Ok(ConnectResponse {
                shim_pid: std::process::id(),
                task_pid: pid as u32,
                ..Default::default()
            })
        };
        serve("connect", &req.id, fut).await
    }

    async fn shutdown(&self, _ctx: &TtrpcContext, req: ShutdownRequest) -> ttrpc::Result<Empty> {
        let remaining = self.containers.read().await.len();
        if remaining > 0 && !req.now {
            debug!(remaining, "shutdown ignored: containers remain");
            return Ok(Empty::new());
        }
        info!("shutting down");
        self.exit.signal();
        Ok(Empty::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A restore is created without a process (pid 0) and gets its pid at Start: the index
    /// answers that pid for the container, whatever order its map keeps (Connect answered the
    /// pid 0 of Create when a second init entry came first, and CRI's ContainerStatus of a
    /// restore-via-create container showed pid 0).
    #[test]
    fn a_restored_init_is_known_by_its_pid_from_start() {
        for _ in 0..64 {
            let mut index = PidIndex::default();
            let since = Instant::now();
            assert_eq!(index.register(4242, "sandbox", "", since), None);
            assert_eq!(index.register(0, "c1", "", since), None);
            assert_eq!(index.inits.get("c1"), None);
            assert!(!index.owners.contains_key(&0), "pid 0 is no process");
            assert_eq!(index.register(5151, "c1", "", since), None);
            assert_eq!(index.inits.get("c1"), Some(&5151));
            assert_eq!(index.inits.get("sandbox"), Some(&4242));
            index.forget("c1", [5151], true);
            assert_eq!(index.inits.get("c1"), None);
            assert!(!index.owners.contains_key(&5151));
        }
    }

    #[test]
    fn an_exit_before_registration_is_returned_and_the_init_still_known() {
        let mut index = PidIndex::default();
        let since = Instant::now();
        index.unclaimed.insert(77, (3, Instant::now()));
        assert_eq!(index.register(77, "c", "", since), Some(3));
        assert_eq!(index.inits.get("c"), Some(&77));
        assert!(!index.owners.contains_key(&77));
        // An exec's pid is not the init's.
        assert_eq!(index.register(78, "c", "e1", since), None);
        assert_eq!(index.inits.get("c"), Some(&77));
        index.forget("c", [78], false);
        assert_eq!(index.inits.get("c"), Some(&77));
    }
}
