//! The shim process: containerd's `start` and `delete` actions, and the task server.

use std::{path::Path, sync::Arc};

use async_trait::async_trait;
use containerd_shim::{
    asynchronous::{spawn, ExitSignal},
    protos::{
        api::DeleteResponse, protobuf::well_known_types::any::Any,
        types::introspection::RuntimeInfo,
    },
    publisher::RemotePublisher,
    util::timestamp,
    Config, Flags, StartOpts,
};
use tracing::{info, warn};

use crate::{
    bundle::{cri, Bundle},
    container,
    events::EventSender,
    features,
    options::RuntimeOptions,
    task::TaskService,
};

/// The name containerd knows this runtime by.
pub const RUNTIME_ID: &str = "io.containerd.gpu-ckpt.v1";

/// Annotations that put containers into one shim, in the order the runc shim honours them.
const GROUP_ANNOTATIONS: [&str; 2] = ["io.containerd.runc.v2.group", cri::SANDBOX_ID];

pub struct Service {
    id: String,
    namespace: String,
    socket: String,
    exit: Arc<ExitSignal>,
}

/// The shim group a container belongs to: one shim per pod sandbox, else per container.
pub fn grouping(bundle: &Path, id: &str) -> String {
    Bundle::load(bundle)
        .ok()
        .and_then(|bundle| {
            GROUP_ANNOTATIONS.iter().find_map(|k| {
                bundle
                    .annotations()
                    .get(*k)
                    .filter(|v| !v.is_empty())
                    .cloned()
            })
        })
        .unwrap_or_else(|| id.to_string())
}

#[async_trait]
impl containerd_shim::asynchronous::Shim for Service {
    type T = TaskService;

    async fn new(_runtime_id: &str, args: &Flags, config: &mut Config) -> Self {
        // Logging goes through `tracing`; the server writes to containerd's log fifo.
        config.no_setup_logger = true;
        if !matches!(args.action.as_str(), "start" | "delete") {
            crate::logging::init(args.debug);
        }
        Service {
            id: args.id.clone(),
            namespace: args.namespace.clone(),
            socket: args.socket.clone(),
            exit: Arc::new(ExitSignal::default()),
        }
    }

    async fn start_shim(&mut self, opts: StartOpts) -> containerd_shim::Result<String> {
        let cwd = std::env::current_dir()
            .map_err(|e| containerd_shim::Error::Other(format!("bundle directory: {e}")))?;
        let group = grouping(&cwd, &opts.id);
        // The server runs as the resolved binary: it learns the handler options file of the
        // path containerd started us by from the environment.
        let config = crate::options::handler_config_path().map(|p| p.display().to_string());
        let vars: Vec<(&str, &str)> = config
            .iter()
            .map(|p| (crate::options::HANDLER_CONFIG_ENV, p.as_str()))
            .collect();
        let address = spawn(opts, &group, vars).await?;
        // containerd-shim-runc-v2 keeps the address in the bundle too; shutdown reads it.
        containerd_shim::util::write_str_to_file(cwd.join("address"), &address).await?;
        Ok(address)
    }

    async fn delete_shim(&mut self) -> containerd_shim::Result<DeleteResponse> {
        let bundle = std::env::current_dir()
            .map_err(|e| containerd_shim::Error::Other(format!("bundle directory: {e}")))?;
        if let Err(e) = container::cleanup_bundle(&bundle, &self.id, &self.namespace).await {
            warn!(id = %self.id, error = %e, "cleanup of a gone shim's container");
        }
        Ok(DeleteResponse {
            exit_status: 128 + libc::SIGKILL as u32,
            exited_at: containerd_shim::protos::protobuf::MessageField::some(timestamp()?),
            ..Default::default()
        })
    }

    async fn wait(&mut self) {
        self.exit.wait().await;
        // The shim crate removes the socket only when the bundle's address file is still there.
        if let Some(path) = self.socket.strip_prefix("unix://") {
            let _ = std::fs::remove_file(path);
        }
    }

    async fn create_task_service(&self, publisher: RemotePublisher) -> Self::T {
        let events = EventSender::spawn(publisher, self.namespace.clone());
        info!(namespace = %self.namespace, "task service starting");
        match TaskService::start(&self.namespace, events, self.exit.clone()).await {
            Ok(service) => service,
            Err(e) => {
                // Without the exit monitor the shim cannot report exits: give up at once.
                eprintln!("{RUNTIME_ID}: cannot start the task service: {e}");
                std::process::exit(1);
            }
        }
    }

    fn runtime_info(
        runtime_id: &str,
        options: Option<&Any>,
    ) -> containerd_shim::Result<RuntimeInfo> {
        let mut info = RuntimeInfo {
            name: runtime_id.to_string(),
            ..Default::default()
        };
        // What containerd's runc shim reports for a runc with CRIU: checkpoint is supported.
        info.annotations.insert(
            "org.opencontainers.runc.checkpoint.enabled".to_string(),
            "true".to_string(),
        );
        info.version = containerd_shim::protos::protobuf::MessageField::some(
            containerd_shim::protos::types::introspection::RuntimeVersion {
                version: env!("CARGO_PKG_VERSION").to_string(),
                revision: option_env!("GPU_CKPT_REVISION").unwrap_or("").to_string(),
                ..Default::default()
            },
        );
        // The OCI features of the runc this handler drives, as runc-v2 reports them.
        let opts = RuntimeOptions::from_any(options).map_err(|e| {
            containerd_shim::Error::InvalidArgument(format!("runtime options: {e}"))
        })?;
        if let Some(any) = options {
            info.options = containerd_shim::protos::protobuf::MessageField::some(any.clone());
        }
        if let Some(json) =
            features::runc_features(opts.runc_binary()).map_err(containerd_shim::Error::Other)?
        {
            info.features = containerd_shim::protos::protobuf::MessageField::some(Any {
                type_url: features::FEATURES_TYPE_URL.to_string(),
                value: json,
                ..Default::default()
            });
        }
        Ok(info)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bundle_with(annotations: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            format!("{{\"ociVersion\":\"1.0.2\",\"annotations\":{{{annotations}}}}}"),
        )
        .unwrap();
        dir
    }

    #[test]
    fn pods_share_a_shim() {
        let b = bundle_with("\"io.kubernetes.cri.sandbox-id\":\"sb1\"");
        assert_eq!(grouping(b.path(), "c1"), "sb1");
        let b = bundle_with(
            "\"io.containerd.runc.v2.group\":\"g\",\"io.kubernetes.cri.sandbox-id\":\"sb1\"",
        );
        assert_eq!(grouping(b.path(), "c1"), "g");
    }

    #[test]
    fn other_containers_get_their_own() {
        let b = bundle_with("");
        assert_eq!(grouping(b.path(), "c1"), "c1");
    }
}
