//! containerd's `base_runtime_spec` with the hooks installed.
//!
//! containerd's CRI plugin takes, per runtime handler, a full OCI runtime spec file as the base
//! of every container's spec (`base_runtime_spec` in
//! `[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.<handler>]`); its `hooks` are
//! kept. [`with_hooks`] appends this binary's createRuntime and prestart entries to such a spec,
//! and [`default_spec`] is containerd's default spec to start from.

use std::path::Path;

use serde_json::{json, Value};

use crate::{HookError, BIN_NAME, CREATE_RUNTIME, PRESTART};

/// containerd's default spec, as `ctr oci spec` prints it (containerd 2.1), less
/// `linux.cgroupsPath` (`/default`, the namespace ctr runs in: every container would share that
/// cgroup when CRI is given no cgroup parent).
pub const CONTAINERD_DEFAULT_SPEC: &str = include_str!("containerd-default-spec.json");

/// The OCI hook stages and the subcommand each runs.
pub const STAGES: [(&str, &str); 2] = [("createRuntime", CREATE_RUNTIME), ("prestart", PRESTART)];

/// [`CONTAINERD_DEFAULT_SPEC`], parsed.
pub fn default_spec() -> Result<Value, HookError> {
    serde_json::from_str(CONTAINERD_DEFAULT_SPEC)
        .map_err(|e| HookError::BaseSpec(format!("the built-in default spec is not valid: {e}")))
}

fn absolute<'a>(what: &str, p: &'a Path) -> Result<&'a str, HookError> {
    if !p.is_absolute() {
        return Err(HookError::Usage(format!(
            "{what} {} is not an absolute path (the runtime runs hooks from its own working directory)",
            p.display()
        )));
    }
    p.to_str()
        .ok_or_else(|| HookError::Usage(format!("{what} {} is not UTF-8", p.display())))
}

/// The hook entry (OCI runtime spec `hooks.<stage>[]`) that runs `subcommand` of the binary at
/// `hook_path`, with `--libnvml` when given.
pub fn hook_entry(
    hook_path: &Path,
    subcommand: &str,
    libnvml: Option<&Path>,
) -> Result<Value, HookError> {
    let path = absolute("--hook-path", hook_path)?;
    let mut args = vec![BIN_NAME.to_string(), subcommand.to_string()];
    if let Some(lib) = libnvml {
        args.push("--libnvml".to_string());
        args.push(absolute("--libnvml", lib)?.to_string());
    }
    Ok(json!({ "path": path, "args": args }))
}

/// `spec` (a full OCI runtime spec) with the createRuntime and prestart entries appended to its
/// `hooks`; the hooks it has are kept, and an entry equal to one it has is not added twice.
pub fn with_hooks(
    mut spec: Value,
    hook_path: &Path,
    libnvml: Option<&Path>,
) -> Result<Value, HookError> {
    let Some(obj) = spec.as_object_mut() else {
        return Err(HookError::BaseSpec(
            "the base spec is not a JSON object".to_string(),
        ));
    };
    if !obj.get("ociVersion").is_some_and(Value::is_string) {
        return Err(HookError::BaseSpec(
            "the base spec has no \"ociVersion\": not an OCI runtime spec".to_string(),
        ));
    }
    let hooks = obj
        .entry("hooks")
        .and_modify(|h| {
            if h.is_null() {
                *h = json!({});
            }
        })
        .or_insert_with(|| json!({}));
    let Some(hooks) = hooks.as_object_mut() else {
        return Err(HookError::BaseSpec(
            "the base spec's \"hooks\" is not an object".to_string(),
        ));
    };
    for (stage, subcommand) in STAGES {
        let entry = hook_entry(hook_path, subcommand, libnvml)?;
        let list = hooks
            .entry(stage)
            .and_modify(|l| {
                if l.is_null() {
                    *l = json!([]);
                }
            })
            .or_insert_with(|| json!([]));
        let Some(list) = list.as_array_mut() else {
            return Err(HookError::BaseSpec(format!(
                "the base spec's \"hooks.{stage}\" is not an array"
            )));
        };
        if !list.contains(&entry) {
            list.push(entry);
        }
    }
    Ok(spec)
}
