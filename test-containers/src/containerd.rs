//! A containerd API client over a node's socket (containerd-client 0.9): Tasks (Wait, Update,
//! Get, Metrics) and Events.Subscribe with decoded `/tasks/*` events.
//!
//! The namespace travels in the `containerd-namespace` gRPC metadata header.

use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use containerd_client::events as ev;
use containerd_client::services::v1::events_client::EventsClient;
use containerd_client::services::v1::tasks_client::TasksClient;
use containerd_client::services::v1::{
    GetRequest, MetricsRequest, PublishRequest, SubscribeRequest, UpdateTaskRequest, WaitRequest,
};
use containerd_client::types::v1::{Process, Status};
use containerd_client::types::{Envelope, Metric};
use prost_types::{Any, Timestamp};
use tonic::transport::Channel;

pub use containerd_client;

/// Type URL under which containerd's typeurl registers runtime-spec `LinuxResources`
/// (`types.containerd.io` + `opencontainers/runtime-spec` + spec major version + name). The
/// value of such an Any is the JSON encoding of the Go struct (typeurl marshals types that are
/// not protobuf messages with encoding/json).
pub const LINUX_RESOURCES_TYPE_URL: &str =
    "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources";

/// How a task ended.
#[derive(Debug, Clone, PartialEq)]
pub struct ExitStatus {
    pub code: u32,
    pub exited_at: Option<Timestamp>,
}

/// Memory numbers from Tasks.Metrics (cgroup v1 or v2).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemoryMetrics {
    /// Current usage in bytes.
    pub usage: u64,
    /// Limit in bytes (cgroup v1 reports a huge number when unlimited; v2 reports u64::MAX).
    pub limit: u64,
    /// Peak usage (v1 `max_usage_in_bytes`, v2 `max_usage` when the kernel reports it).
    pub max_usage: u64,
    /// OOM kills (v1 `memory.oom_control oom_kill`, v2 `memory.events oom_kill`).
    pub oom_kill: u64,
    /// Which cgroup version the metric came from (1 or 2).
    pub cgroup_version: u8,
}

/// A decoded event.
#[derive(Debug, Clone)]
pub enum TaskEvent {
    Create(ev::TaskCreate),
    Start(ev::TaskStart),
    Exit(ev::TaskExit),
    Delete(ev::TaskDelete),
    Oom(ev::TaskOom),
    ExecAdded(ev::TaskExecAdded),
    ExecStarted(ev::TaskExecStarted),
    Paused(ev::TaskPaused),
    Resumed(ev::TaskResumed),
    Checkpointed(ev::TaskCheckpointed),
    /// Anything else (other topics, or a type this client does not decode).
    Other(Any),
}

/// One event from Events.Subscribe.
#[derive(Debug, Clone)]
pub struct Event {
    pub namespace: String,
    pub topic: String,
    pub timestamp: Option<Timestamp>,
    pub event: TaskEvent,
}

impl Event {
    /// The container id the event is about, for task events.
    pub fn container_id(&self) -> Option<&str> {
        Some(match &self.event {
            TaskEvent::Create(e) => &e.container_id,
            TaskEvent::Start(e) => &e.container_id,
            TaskEvent::Exit(e) => &e.container_id,
            TaskEvent::Delete(e) => &e.container_id,
            TaskEvent::Oom(e) => &e.container_id,
            TaskEvent::ExecAdded(e) => &e.container_id,
            TaskEvent::ExecStarted(e) => &e.container_id,
            TaskEvent::Paused(e) => &e.container_id,
            TaskEvent::Resumed(e) => &e.container_id,
            TaskEvent::Checkpointed(e) => &e.container_id,
            TaskEvent::Other(_) => return None,
        })
    }
}

/// Decodes an envelope's Any for `/tasks/*` topics.
pub fn decode_event(env: Envelope) -> Event {
    let any = env.event.unwrap_or_default();
    // containerd sends the protobuf full name ("containerd.events.TaskExit"), with or without a
    // URL prefix; prost's `to_msg` needs a '/' before the name.
    let name = any
        .type_url
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .to_string();
    let mut norm = any.clone();
    norm.type_url = format!("/{name}");
    macro_rules! dec {
        ($a:expr, $t:ty) => {
            $a.to_msg::<$t>().ok()
        };
    }
    let decoded = match name.as_str() {
        "containerd.events.TaskCreate" => dec!(norm, ev::TaskCreate).map(TaskEvent::Create),
        "containerd.events.TaskStart" => dec!(norm, ev::TaskStart).map(TaskEvent::Start),
        "containerd.events.TaskExit" => dec!(norm, ev::TaskExit).map(TaskEvent::Exit),
        "containerd.events.TaskDelete" => dec!(norm, ev::TaskDelete).map(TaskEvent::Delete),
        "containerd.events.TaskOOM" => dec!(norm, ev::TaskOom).map(TaskEvent::Oom),
        "containerd.events.TaskExecAdded" => {
            dec!(norm, ev::TaskExecAdded).map(TaskEvent::ExecAdded)
        }
        "containerd.events.TaskExecStarted" => {
            dec!(norm, ev::TaskExecStarted).map(TaskEvent::ExecStarted)
        }
        "containerd.events.TaskPaused" => dec!(norm, ev::TaskPaused).map(TaskEvent::Paused),
        "containerd.events.TaskResumed" => dec!(norm, ev::TaskResumed).map(TaskEvent::Resumed),
        "containerd.events.TaskCheckpointed" => {
            dec!(norm, ev::TaskCheckpointed).map(TaskEvent::Checkpointed)
        }
        _ => None,
    };
    Event {
        namespace: env.namespace,
        topic: env.topic,
        timestamp: env.timestamp,
        event: decoded.unwrap_or(TaskEvent::Other(any)),
    }
}

/// A stream of events, fed by a background task that holds the Subscribe call.
///
/// containerd's server does not answer a Subscribe call (no response headers) before the first
/// event, and tonic waits for those headers: so the call runs in a task, and
/// [`Containerd::subscribe`] returns only after a probe event it published itself has come
/// through, which proves that the subscription is registered.
pub struct EventStream {
    rx: tokio::sync::mpsc::UnboundedReceiver<Result<Envelope, tonic::Status>>,
    buffered: std::collections::VecDeque<Envelope>,
    probe_topic: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for EventStream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl EventStream {
    async fn next_envelope(&mut self) -> Result<Option<Envelope>> {
        loop {
            let env = match self.buffered.pop_front() {
                Some(e) => e,
                None => match self.rx.recv().await {
                    Some(Ok(e)) => e,
                    Some(Err(status)) => return Err(anyhow!("events stream: {status}")),
                    None => return Ok(None),
                },
            };
            if env.topic == self.probe_topic {
                continue;
            }
            return Ok(Some(env));
        }
    }

    /// The next event; `None` when the server closed the stream.
    pub async fn next(&mut self) -> Result<Option<Event>> {
        Ok(self.next_envelope().await?.map(decode_event))
    }

    /// The next event within `timeout`; `None` on timeout or end of stream.
    pub async fn next_timeout(&mut self, timeout: Duration) -> Result<Option<Event>> {
        match tokio::time::timeout(timeout, self.next()).await {
            Ok(r) => r,
            Err(_) => Ok(None),
        }
    }

    /// Reads events until one satisfies `pred`; returns it and everything seen before it.
    /// Fails when `timeout` passes first (the error lists the topics seen).
    pub async fn wait_for<F>(
        &mut self,
        timeout: Duration,
        mut pred: F,
    ) -> Result<(Event, Vec<Event>)>
    where
        F: FnMut(&Event) -> bool,
    {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                let topics: Vec<String> = seen
                    .iter()
                    .map(|e: &Event| format!("{} {:?}", e.topic, e.container_id()))
                    .collect();
                bail!("no matching event within {timeout:?}; seen: {topics:?}");
            }
            match tokio::time::timeout(left, self.next()).await {
                Ok(Ok(Some(e))) => {
                    if pred(&e) {
                        return Ok((e, seen));
                    }
                    seen.push(e);
                }
                Ok(Ok(None)) => bail!("events stream ended while waiting"),
                Ok(Err(e)) => return Err(e),
                Err(_) => continue,
            }
        }
    }
}

/// A containerd API client bound to one namespace. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Containerd {
    channel: Channel,
    namespace: String,
}

impl Containerd {
    /// Connects to containerd's socket; requests go to `namespace`.
    pub async fn connect(socket: &Path, namespace: &str) -> Result<Containerd> {
        let channel = crate::cri::unix_channel(socket).await?;
        Ok(Containerd {
            channel,
            namespace: namespace.to_string(),
        })
    }

    /// The same connection, another namespace.
    pub fn with_namespace(&self, namespace: &str) -> Containerd {
        Containerd {
            channel: self.channel.clone(),
            namespace: namespace.to_string(),
        }
    }

    /// The namespace requests go to.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The underlying channel (for other containerd-client services).
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// Wraps a message in a request carrying the namespace header.
    pub fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        req.metadata_mut().insert(
            "containerd-namespace",
            self.namespace
                .parse()
                .expect("namespace is valid ASCII metadata"),
        );
        req
    }

    fn tasks(&self) -> TasksClient<Channel> {
        TasksClient::new(self.channel.clone())
    }

    /// Tasks.Wait for the init process: blocks until the task exits.
    pub async fn wait(&self, container_id: &str) -> Result<ExitStatus> {
        self.wait_exec(container_id, "").await
    }

    /// Tasks.Wait for an exec process (`exec_id` "" = init).
    pub async fn wait_exec(&self, container_id: &str, exec_id: &str) -> Result<ExitStatus> {
        let r = self
            .tasks()
            .wait(self.request(WaitRequest {
                container_id: container_id.to_string(),
                exec_id: exec_id.to_string(),
            }))
            .await
            .with_context(|| format!("Tasks.Wait {container_id} (ns {})", self.namespace))?
            .into_inner();
        Ok(ExitStatus {
            code: r.exit_status,
            exited_at: r.exited_at,
        })
    }

    /// Tasks.Wait with a timeout.
    pub async fn wait_timeout(&self, container_id: &str, timeout: Duration) -> Result<ExitStatus> {
        tokio::time::timeout(timeout, self.wait(container_id))
            .await
            .map_err(|_| anyhow!("task {container_id} did not exit within {timeout:?}"))?
    }

    /// Tasks.Get: the init process (pid, status, exit status).
    pub async fn get(&self, container_id: &str) -> Result<Process> {
        let r = self
            .tasks()
            .get(self.request(GetRequest {
                container_id: container_id.to_string(),
                exec_id: String::new(),
            }))
            .await
            .with_context(|| format!("Tasks.Get {container_id} (ns {})", self.namespace))?
            .into_inner();
        r.process
            .ok_or_else(|| anyhow!("Tasks.Get {container_id}: no process in the answer"))
    }

    /// The task's status (Created, Running, Stopped, Paused, ...).
    pub async fn status(&self, container_id: &str) -> Result<Status> {
        let p = self.get(container_id).await?;
        Ok(Status::try_from(p.status).unwrap_or(Status::Unknown))
    }

    /// Tasks.Checkpoint straight to the shim, into `image_path`, leaving the task running; unlike
    /// `ctr task checkpoint` (containerd's client), without pausing the task first.
    pub async fn checkpoint_unpaused(&self, id: &str, image_path: &Path) -> Result<()> {
        use containerd_client::services::v1::CheckpointTaskRequest;
        // containerd.runc.v1.CheckpointOptions, field 8: image_path.
        let mut value = Vec::new();
        prost::encoding::string::encode(8, &image_path.display().to_string(), &mut value);
        TasksClient::new(self.channel())
            .checkpoint(self.request(CheckpointTaskRequest {
                container_id: id.to_string(),
                options: Some(Any {
                    type_url: "containerd.runc.v1.CheckpointOptions".into(),
                    value,
                }),
                ..Default::default()
            }))
            .await
            .map_err(|s| {
                anyhow!(
                    "Tasks.Checkpoint {id} into {}: {:?}: {}",
                    image_path.display(),
                    s.code(),
                    s.message()
                )
            })?;
        Ok(())
    }

    /// Restores container `id` (its task deleted) from a CRIU image directory, the way the
    /// containerd API allows it: Tasks.Create with the container's rootfs mounts (from its
    /// snapshot, as containerd's client does) and runc options naming `CriuImagePath`, then
    /// Tasks.Start. Returns the pid. Works with gpu-ckpt and with containerd-shim-runc-v2.
    pub async fn restore_from_image_path(&self, id: &str, image_path: &Path) -> Result<u32> {
        self.restore_from_image_path_with(id, Some(image_path))
            .await
    }

    /// [`Self::restore_from_image_path`]; with `image_path` `None` the request carries no
    /// options, so the shim gets the container's own runtime options (ctr run
    /// `--runtime-config-path`: a TOML file, which can name `CriuImagePath` itself).
    pub async fn restore_from_image_path_with(
        &self,
        id: &str,
        image_path: Option<&Path>,
    ) -> Result<u32> {
        use containerd_client::services::v1::CreateTaskRequest;
        let what = format!("from {image_path:?}");
        self.create_and_start(
            CreateTaskRequest {
                container_id: id.to_string(),
                options: image_path.map(criu_image_path_options),
                ..Default::default()
            },
            &what,
        )
        .await
    }

    /// Tasks.Create of `req` on its container's rootfs (the mounts of the container's snapshot,
    /// as containerd's client passes them), then Tasks.Start; returns the pid. `what` goes into
    /// the errors.
    pub async fn create_and_start(
        &self,
        mut req: containerd_client::services::v1::CreateTaskRequest,
        what: &str,
    ) -> Result<u32> {
        use containerd_client::services::v1::{
            containers_client::ContainersClient, snapshots::snapshots_client::SnapshotsClient,
            snapshots::MountsRequest, GetContainerRequest, StartRequest,
        };
        let id = req.container_id.clone();
        let container = ContainersClient::new(self.channel())
            .get(self.request(GetContainerRequest { id: id.clone() }))
            .await
            .with_context(|| format!("Containers.Get {id}"))?
            .into_inner()
            .container
            .context("no container")?;
        req.rootfs = SnapshotsClient::new(self.channel())
            .mounts(self.request(MountsRequest {
                snapshotter: container.snapshotter.clone(),
                key: container.snapshot_key.clone(),
            }))
            .await
            .with_context(|| format!("Snapshots.Mounts {}", container.snapshot_key))?
            .into_inner()
            .mounts;
        let mut tasks = TasksClient::new(self.channel());
        tasks
            .create(self.request(req))
            .await
            .with_context(|| format!("Tasks.Create {id} {what}"))?;
        let r = tasks
            .start(self.request(StartRequest {
                container_id: id.clone(),
                exec_id: String::new(),
            }))
            .await
            .with_context(|| format!("Tasks.Start {id}"))?;
        Ok(r.into_inner().pid)
    }

    /// Tasks.Update with an arbitrary resources Any.
    pub async fn update_raw(
        &self,
        container_id: &str,
        resources: Option<Any>,
        annotations: std::collections::HashMap<String, String>,
    ) -> Result<()> {
        self.tasks()
            .update(self.request(UpdateTaskRequest {
                container_id: container_id.to_string(),
                resources,
                annotations,
            }))
            .await
            .with_context(|| format!("Tasks.Update {container_id} (ns {})", self.namespace))?;
        Ok(())
    }

    /// Tasks.Update with runtime-spec `LinuxResources` given as JSON (for example
    /// `{"memory":{"limit":268435456}}`).
    pub async fn update_resources_json(
        &self,
        container_id: &str,
        linux_resources: &serde_json::Value,
    ) -> Result<()> {
        self.update_raw(
            container_id,
            Some(linux_resources_any(linux_resources)?),
            Default::default(),
        )
        .await
    }

    /// Sets the task's memory limit (bytes) through Tasks.Update.
    pub async fn update_memory_limit(&self, container_id: &str, bytes: i64) -> Result<()> {
        self.update_resources_json(
            container_id,
            &serde_json::json!({ "memory": { "limit": bytes } }),
        )
        .await
    }

    /// Tasks.Metrics for one container (raw metrics).
    pub async fn metrics(&self, container_id: &str) -> Result<Vec<Metric>> {
        let r = self
            .tasks()
            .metrics(self.request(MetricsRequest {
                filters: vec![format!("id=={container_id}")],
            }))
            .await
            .with_context(|| format!("Tasks.Metrics {container_id} (ns {})", self.namespace))?
            .into_inner();
        Ok(r.metrics)
    }

    /// Memory usage and limit of the task, decoded from cgroup v1 or v2 metrics.
    pub async fn memory(&self, container_id: &str) -> Result<MemoryMetrics> {
        let metrics = self.metrics(container_id).await?;
        let m = metrics
            .into_iter()
            .find(|m| m.id == container_id)
            .ok_or_else(|| anyhow!("Tasks.Metrics: no metric for {container_id}"))?;
        let data = m
            .data
            .ok_or_else(|| anyhow!("Tasks.Metrics {container_id}: metric without data"))?;
        decode_memory_metrics(&data)
    }

    /// Events.Subscribe with raw filters (containerd filter syntax; several filters are ORed).
    /// Returns once the subscription is live (see [`EventStream`]).
    pub async fn subscribe(&self, filters: &[&str]) -> Result<EventStream> {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let probe_topic = format!(
            "/gpu-ckpt-test/subscribed/{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let mut all: Vec<String> = filters.iter().map(|s| s.to_string()).collect();
        if !all.is_empty() {
            all.push(format!("topic==\"{probe_topic}\""));
        }
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut client = EventsClient::new(self.channel.clone());
        let req = self.request(SubscribeRequest { filters: all });
        let task = tokio::spawn(async move {
            match client.subscribe(req).await {
                Ok(resp) => {
                    let mut stream = resp.into_inner();
                    loop {
                        match stream.message().await {
                            Ok(Some(env)) => {
                                if tx.send(Ok(env)).is_err() {
                                    break;
                                }
                            }
                            Ok(None) => break,
                            Err(status) => {
                                let _ = tx.send(Err(status));
                                break;
                            }
                        }
                    }
                }
                Err(status) => {
                    let _ = tx.send(Err(status));
                }
            }
        });
        let mut stream = EventStream {
            rx,
            buffered: Default::default(),
            probe_topic: probe_topic.clone(),
            task,
        };

        // Publish probes until one comes back through the subscription.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        loop {
            self.publish(&probe_topic, empty_any()).await?;
            let until = tokio::time::Instant::now() + Duration::from_millis(200);
            loop {
                match tokio::time::timeout_at(until, stream.rx.recv()).await {
                    Err(_) => break,
                    Ok(None) => bail!("Events.Subscribe: stream ended before it was live"),
                    Ok(Some(Err(status))) => bail!("Events.Subscribe: {status}"),
                    Ok(Some(Ok(env))) => {
                        if env.topic == probe_topic {
                            return Ok(stream);
                        }
                        stream.buffered.push_back(env);
                    }
                }
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("Events.Subscribe: the subscription did not deliver a probe event in 15 s");
            }
        }
    }

    /// Events.Publish of `event` under `topic` in this namespace.
    pub async fn publish(&self, topic: &str, event: Any) -> Result<()> {
        EventsClient::new(self.channel.clone())
            .publish(self.request(PublishRequest {
                topic: topic.to_string(),
                event: Some(event),
            }))
            .await
            .with_context(|| format!("Events.Publish {topic}"))?;
        Ok(())
    }

    /// Events.Subscribe for `/tasks/*` topics in this client's namespace.
    pub async fn subscribe_tasks(&self) -> Result<EventStream> {
        let f = format!("namespace=={},topic~=\"^/tasks/\"", self.namespace);
        self.subscribe(&[&f]).await
    }
}

/// An Any holding `google.protobuf.Empty`.
fn empty_any() -> Any {
    Any {
        type_url: "type.googleapis.com/google.protobuf.Empty".to_string(),
        value: Vec::new(),
    }
}

/// Encodes runtime-spec `LinuxResources` JSON the way containerd's typeurl does.
pub fn linux_resources_any(linux_resources: &serde_json::Value) -> Result<Any> {
    if !linux_resources.is_object() {
        bail!("LinuxResources must be a JSON object, got {linux_resources}");
    }
    Ok(Any {
        type_url: LINUX_RESOURCES_TYPE_URL.to_string(),
        value: serde_json::to_vec(linux_resources)?,
    })
}

/// Decodes memory numbers from an `io.containerd.cgroups.v1.Metrics` or
/// `io.containerd.cgroups.v2.Metrics` Any.
pub fn decode_memory_metrics(any: &Any) -> Result<MemoryMetrics> {
    use image_format::protowire::{bytes_field, varint_field, Value};
    fn fields<'a>(b: &'a [u8], what: &str) -> Result<Vec<(u64, Value<'a>)>> {
        image_format::protowire::fields(b).with_context(|| format!("malformed {what}"))
    }
    let varint = |f: &[(u64, Value<'_>)], n| varint_field(f, n).unwrap_or(0);
    let name = any.type_url.rsplit('/').next().unwrap_or_default();
    match name {
        "io.containerd.cgroups.v1.Metrics" => {
            // Metrics { memory = 4: MemoryStat { usage = 33: MemoryEntry { limit 1, usage 2,
            // max 3, failcnt 4 } }, memory_oom_control = 9: { oom_kill = 3 } }
            let top = fields(&any.value, &any.type_url)?;
            let mut out = MemoryMetrics {
                cgroup_version: 1,
                ..Default::default()
            };
            if let Some(mem) = bytes_field(&top, 4) {
                let mem = fields(mem, &any.type_url)?;
                if let Some(usage) = bytes_field(&mem, 33) {
                    let e = fields(usage, &any.type_url)?;
                    out.limit = varint(&e, 1);
                    out.usage = varint(&e, 2);
                    out.max_usage = varint(&e, 3);
                }
            }
            if let Some(oom) = bytes_field(&top, 9) {
                out.oom_kill = varint(&fields(oom, &any.type_url)?, 3);
            }
            Ok(out)
        }
        "io.containerd.cgroups.v2.Metrics" => {
            // Metrics { memory = 4: MemoryStat { usage 32, usage_limit 33, max_usage 36 },
            // memory_events = 8: { oom_kill = 5 } }
            let top = fields(&any.value, &any.type_url)?;
            let mut out = MemoryMetrics {
                cgroup_version: 2,
                ..Default::default()
            };
            if let Some(mem) = bytes_field(&top, 4) {
                let mem = fields(mem, &any.type_url)?;
                out.usage = varint(&mem, 32);
                out.limit = varint(&mem, 33);
                out.max_usage = varint(&mem, 36);
            }
            if let Some(events) = bytes_field(&top, 8) {
                out.oom_kill = varint(&fields(events, &any.type_url)?, 5);
            }
            Ok(out)
        }
        other => bail!("unknown metrics type {other:?}"),
    }
}

/// `containerd.runc.v1.Options` naming `dir` as `CriuImagePath` (field 10): the containerd API's
/// way to restore a task from `ctr task checkpoint --image-path`.
pub fn criu_image_path_options(dir: &Path) -> Any {
    let mut value = Vec::new();
    prost::encoding::string::encode(10, &dir.display().to_string(), &mut value);
    Any {
        type_url: "containerd.runc.v1.Options".into(),
        value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use prost::encoding::{encode_key, encode_varint, WireType};

    fn field_varint(n: u32, v: u64, out: &mut Vec<u8>) {
        encode_key(n, WireType::Varint, out);
        encode_varint(v, out);
    }
    fn field_bytes(n: u32, b: &[u8], out: &mut Vec<u8>) {
        encode_key(n, WireType::LengthDelimited, out);
        encode_varint(b.len() as u64, out);
        out.extend_from_slice(b);
    }

    #[test]
    fn decodes_v1_memory() {
        let mut entry = Vec::new();
        field_varint(1, 256 << 20, &mut entry);
        field_varint(2, 1234567, &mut entry);
        field_varint(3, 2345678, &mut entry);
        let mut mem = Vec::new();
        field_varint(2, 99, &mut mem); // rss
        field_bytes(33, &entry, &mut mem);
        let mut oom = Vec::new();
        field_varint(3, 2, &mut oom);
        let mut top = Vec::new();
        field_bytes(4, &mem, &mut top);
        field_bytes(9, &oom, &mut top);
        let any = Any {
            type_url: "io.containerd.cgroups.v1.Metrics".into(),
            value: top,
        };
        let m = decode_memory_metrics(&any).unwrap();
        assert_eq!(
            m,
            MemoryMetrics {
                usage: 1234567,
                limit: 256 << 20,
                max_usage: 2345678,
                oom_kill: 2,
                cgroup_version: 1
            }
        );
    }

    #[test]
    fn decodes_v2_memory() {
        let mut mem = Vec::new();
        field_varint(32, 42, &mut mem);
        field_varint(33, 4096, &mut mem);
        let mut top = Vec::new();
        field_bytes(4, &mem, &mut top);
        let any = Any {
            type_url: "types.containerd.io/io.containerd.cgroups.v2.Metrics".into(),
            value: top,
        };
        let m = decode_memory_metrics(&any).unwrap();
        assert_eq!((m.usage, m.limit, m.cgroup_version), (42, 4096, 2));
    }

    #[test]
    fn resources_any_is_json() {
        let a = linux_resources_any(&serde_json::json!({"memory":{"limit": 1}})).unwrap();
        assert_eq!(a.type_url, LINUX_RESOURCES_TYPE_URL);
        assert_eq!(a.value, br#"{"memory":{"limit":1}}"#);
    }

    #[test]
    fn decodes_task_exit_event() {
        let exit = ev::TaskExit {
            container_id: "c1".into(),
            id: "c1".into(),
            pid: 7,
            exit_status: 137,
            exited_at: None,
        };
        let any = containerd_client::to_any(&exit);
        let e = decode_event(Envelope {
            timestamp: None,
            namespace: "default".into(),
            topic: "/tasks/exit".into(),
            event: Some(any),
        });
        match e.event {
            TaskEvent::Exit(ref x) => assert_eq!(x.exit_status, 137),
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(e.container_id(), Some("c1"));
    }
}
