//! The Kubernetes packaging (runtime-class/): the Helm chart linted and rendered by Helm's own
//! engine (helm-python-sdk: Helm v4's Go SDK, no helm binary) for its default values and for
//! ci/all-values.yaml, which sets every value; every rendered document, every plain manifest in
//! runtime-class/manifests/ and the admission policies validated against the Kubernetes 1.35 API
//! schemas (kubernetes-validate, strict: unknown fields refused; its schemas ship in the package,
//! so nothing is fetched); the plain manifests held equal to the chart's default rendering; and
//! the RuntimeClasses' handlers held to the containerd drop-ins that register them.
//!
//! Needs the Python venv that `make deps` creates under the stack prefix ($GPU_CKPT_STACK/py,
//! pinned versions in test-containers/stack/install.sh). A missing venv fails every test here;
//! none is skipped. The work is done by runtime-class/tools/chart.py, which prints JSON; the
//! assertions are here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};

/// The Kubernetes version whose schemas every manifest is validated against.
const KUBE_VERSION: &str = "1.35";

fn repo() -> PathBuf {
    test_containers::stack::repo_root()
}

pub(crate) fn chart() -> PathBuf {
    repo().join("runtime-class/chart/gpu-ckpt")
}

fn all_values() -> PathBuf {
    chart().join("ci/all-values.yaml")
}

/// The venv's python: `$GPU_CKPT_STACK/py/bin/python`, else `<repo>/.stack/py/bin/python`.
fn python() -> PathBuf {
    test_containers::stack::venv_python("helm-python-sdk and kubernetes-validate")
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Runs runtime-class/tools/chart.py; its JSON, and whether it succeeded.
fn chart_py(args: &[&str]) -> Result<(bool, Value)> {
    let script = repo().join("runtime-class/tools/chart.py");
    let out = Command::new(python())
        .arg(&script)
        .args(args)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .current_dir(repo())
        .output()
        .with_context(|| format!("cannot run {}", script.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(stdout.trim()).with_context(|| {
        format!(
            "chart.py {args:?} printed no JSON (status {}):\nstdout: {stdout}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    Ok((out.status.success(), v))
}

/// chart.py that must succeed.
fn chart_ok(args: &[&str]) -> Result<Value> {
    let (ok, v) = chart_py(args)?;
    ensure!(ok, "chart.py {args:?} failed: {}", v["error"]);
    Ok(v)
}

/// `chart.py render CHART ARGS… --kube-version KUBE_VERSION`, which must succeed.
pub(crate) fn render(args: &[&str]) -> Result<Value> {
    let chart = chart();
    let mut all = vec!["render", path_str(&chart)];
    all.extend_from_slice(args);
    all.extend(["--kube-version", KUBE_VERSION]);
    chart_ok(&all)
}

pub(crate) fn path_str(p: &Path) -> &str {
    p.to_str().expect("repository paths are UTF-8")
}

/// The documents of the chart rendered with `args` as release gpu-ckpt-prod in namespace infra,
/// each checked valid ([`valid_documents`]).
fn prod_documents(args: &[&str]) -> Result<Vec<Value>> {
    let mut all = args.to_vec();
    all.extend(["--release", "gpu-ckpt-prod", "--namespace", "infra"]);
    valid_documents(&render(&all)?)
}

/// A rendering's documents, each checked valid against KUBE_VERSION's schemas.
pub(crate) fn valid_documents(rendered: &Value) -> Result<Vec<Value>> {
    ensure!(
        rendered["kube_version"] == KUBE_VERSION,
        "validated against {}, not {KUBE_VERSION}",
        rendered["kube_version"]
    );
    let docs = rendered["documents"]
        .as_array()
        .context("no documents in the rendering")?;
    ensure!(!docs.is_empty(), "the rendering has no documents");
    for d in docs {
        ensure!(
            d["valid"] == true,
            "{} {} ({}) is not valid Kubernetes {KUBE_VERSION}: {}: {}",
            d["kind"],
            d["name"],
            d["source"],
            d["field"],
            d["error"]
        );
        ensure!(d["schema_version"] == KUBE_VERSION, "{d}");
    }
    Ok(docs.iter().map(|d| d["object"].clone()).collect())
}

/// The one object of `kind` named `name`.
pub(crate) fn object<'a>(docs: &'a [Value], kind: &str, name: &str) -> Result<&'a Value> {
    let found: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .collect();
    match found.as_slice() {
        [one] => Ok(one),
        [] => bail!(
            "no {kind} {name}; the rendering has {:?}",
            docs.iter()
                .map(|d| format!("{}/{}", d["kind"], d["metadata"]["name"]))
                .collect::<Vec<_>>()
        ),
        _ => bail!("{} objects {kind} {name}", found.len()),
    }
}

fn kinds(docs: &[Value]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for d in docs {
        *m.entry(d["kind"].as_str().unwrap_or_default().to_string())
            .or_insert(0) += 1;
    }
    m
}

fn yaml_file(p: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(p).with_context(|| p.display().to_string())?;
    serde_yaml::from_str(&text).with_context(|| format!("{} is not YAML", p.display()))
}

fn chart_app_version() -> Result<String> {
    let c = yaml_file(&chart().join("Chart.yaml"))?;
    c["appVersion"]
        .as_str()
        .map(str::to_string)
        .context("Chart.yaml has no appVersion")
}

/// Whether `d` is the node installer's DaemonSet (the chart renders the agent's too).
pub(crate) fn is_installer_daemonset(d: &Value) -> bool {
    d["kind"] == "DaemonSet"
        && d["metadata"]["labels"]["app.kubernetes.io/component"] == "node-installer"
}

/// The DaemonSet's one container.
pub(crate) fn installer_container(ds: &Value) -> Result<&Value> {
    let cs = ds["spec"]["template"]["spec"]["containers"]
        .as_array()
        .context("DaemonSet without containers")?;
    ensure!(cs.len() == 1, "the DaemonSet has {} containers", cs.len());
    Ok(&cs[0])
}

pub(crate) fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|s| s.as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// `flag`'s value in the installer's arguments.
pub(crate) fn flag<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

#[test]
fn the_chart_lints_with_helms_engine() -> Result<()> {
    let kv = format!("{KUBE_VERSION}.0");
    let chart = chart();
    for values in [None, Some(all_values())] {
        let mut args = vec!["lint", path_str(&chart), "--kube-version", kv.as_str()];
        if let Some(v) = &values {
            args.extend(["--values", path_str(v)]);
        }
        let out = chart_ok(&args)?;
        let report = &out["lint"];
        ensure!(report["total_charts_linted"] == 1, "{report}");
        ensure!(
            report["errors"].as_array().is_some_and(|e| e.is_empty()),
            "helm lint ({values:?}): {report}"
        );
        // Severity 2 is a warning, 3 an error; 1 (info: "icon is recommended") is allowed.
        for m in report["messages"].as_array().context("no lint messages")? {
            ensure!(
                m["severity"].as_i64().unwrap_or(3) < 2,
                "helm lint ({values:?}): {m}"
            );
        }
        ensure!(
            out["helm_sdk"]
                .as_str()
                .is_some_and(|v| v.starts_with("v4.")),
            "not Helm v4's engine: {}",
            out["helm_sdk"]
        );
    }
    // Lint runs the values through the chart's schema: a wrong value is an error there.
    let (_, out) = chart_py(&[
        "lint",
        path_str(&chart),
        "--set-json",
        r#"{"nodeInstaller":{"action":"reinstall"}}"#,
    ])?;
    let named = out["lint"]["messages"]
        .as_array()
        .context("no lint messages")?
        .iter()
        .any(|m| {
            m["severity"] == 3
                && m["error"]
                    .as_str()
                    .is_some_and(|e| e.contains("/nodeInstaller/action"))
        });
    ensure!(
        named,
        "helm lint did not report nodeInstaller.action=reinstall as an error: {out}"
    );
    Ok(())
}

/// The chart's `kubeVersion` floor (`>=X.Y.0-0` in Chart.yaml) is the oldest Kubernetes whose
/// API has every object the chart renders: at X.Y every document of the default rendering is
/// valid, one minor version below some is not (the admission policies are
/// admissionregistration.k8s.io/v1 from 1.30 on).
#[test]
fn the_charts_kube_version_floor_is_the_oldest_that_has_its_objects() -> Result<()> {
    let meta = std::fs::read_to_string(chart().join("Chart.yaml"))?;
    let floor = meta
        .lines()
        .find_map(|l| l.strip_prefix("kubeVersion:"))
        .context("Chart.yaml has no kubeVersion")?
        .trim()
        .trim_matches('"');
    let minor = floor
        .strip_prefix(">=1.")
        .and_then(|r| r.strip_suffix(".0-0"))
        .and_then(|m| m.parse::<u32>().ok())
        .with_context(|| format!("kubeVersion {floor:?} is not >=1.Y.0-0"))?;
    let invalid_at = |minor: u32| -> Result<Vec<String>> {
        let kv = format!("1.{minor}");
        let out = chart_ok(&["render", path_str(&chart()), "--kube-version", kv.as_str()])?;
        let docs = out["documents"].as_array().context("no documents")?;
        ensure!(!docs.is_empty(), "no documents: {out}");
        Ok(docs
            .iter()
            .filter(|d| d["valid"] != true)
            .map(|d| format!("{} {}: {}", d["kind"], d["name"], d["error"]))
            .collect())
    };
    let at_floor = invalid_at(minor)?;
    ensure!(
        at_floor.is_empty(),
        "the chart says it works on Kubernetes 1.{minor}, whose API lacks: {at_floor:?}"
    );
    let below = invalid_at(minor - 1)?;
    ensure!(
        below
            .iter()
            .any(|d| d.contains("ValidatingAdmissionPolicy")),
        "Kubernetes 1.{} has every object the chart renders ({below:?}): the floor {floor} is too high",
        minor - 1
    );
    Ok(())
}

#[test]
fn the_default_rendering_is_valid_and_wires_the_runtime_classes_to_the_installer() -> Result<()> {
    let rendered = render(&["--release", "gpu-ckpt", "--namespace", "gpu-ckpt-system"])?;
    let docs = valid_documents(&rendered)?;
    let want: BTreeMap<String, usize> = [
        ("RuntimeClass", 2),
        ("ServiceAccount", 1),
        ("ClusterRole", 1),
        ("ClusterRoleBinding", 1),
        ("Role", 1),
        ("RoleBinding", 1),
        ("DaemonSet", 2),
        ("Service", 1),
        ("ValidatingAdmissionPolicy", 2),
        ("ValidatingAdmissionPolicyBinding", 2),
    ]
    .into_iter()
    .map(|(k, n)| (k.to_string(), n))
    .collect();
    ensure!(kinds(&docs) == want, "kinds: {:?}", kinds(&docs));

    // The RuntimeClasses: names, the drop-ins' handlers, the installer's label.
    for (name, handler) in [
        ("gpu-ckpt", "gpu-ckpt"),
        ("gpu-ckpt-restore", "gpu-ckpt-restore"),
    ] {
        let rc = object(&docs, "RuntimeClass", name)?;
        ensure!(rc["apiVersion"] == "node.k8s.io/v1", "{rc}");
        ensure!(
            rc["handler"] == handler,
            "{name}: handler {}",
            rc["handler"]
        );
        ensure!(
            rc["scheduling"]["nodeSelector"]
                == json!({"node-restriction.kubernetes.io/gpu-ckpt-runtime": "installed"}),
            "{name}: {}",
            rc["scheduling"]
        );
        ensure!(rc["scheduling"].get("tolerations").is_none(), "{rc}");
    }

    // The installer: privileged, the host's PID namespace and /, its flags, its identity.
    let ds = object(&docs, "DaemonSet", "gpu-ckpt-node-installer")?;
    ensure!(
        ds["metadata"]["namespace"] == "gpu-ckpt-system",
        "{}",
        ds["metadata"]
    );
    let pod = &ds["spec"]["template"]["spec"];
    ensure!(pod["hostPID"] == true, "hostPID: {}", pod["hostPID"]);
    let c = installer_container(ds)?;
    ensure!(
        c["securityContext"]["privileged"] == true,
        "{}",
        c["securityContext"]
    );
    ensure!(
        c["image"]
            == format!(
                "ghcr.io/gpu-ckpt/gpu-ckpt-node-installer:{}",
                chart_app_version()?
            ),
        "image {}",
        c["image"]
    );
    ensure!(c["imagePullPolicy"] == "IfNotPresent");
    let args = strings(&c["args"]);
    for (f, v) in [
        ("--root", "/host"),
        ("--containerd-config", "/etc/containerd/config.toml"),
        ("--dropin-dir", "/etc/containerd/conf.d"),
        ("--bin-dir", "/usr/local/bin"),
        ("--lib-dir", "/usr/local/lib/gpu-ckpt"),
        ("--payload", "/payload"),
        ("--label-node", "$(NODE_NAME)"),
    ] {
        ensure!(
            flag(&args, f) == Some(v),
            "{f}: {:?} in {args:?}",
            flag(&args, f)
        );
    }
    ensure!(flag(&args, "--restart-command").is_none(), "{args:?}");
    ensure!(
        c["env"]
            == json!([{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                      {"name": "POD_TEMPLATE_GENERATION", "valueFrom": {"fieldRef":
                          {"fieldPath": "metadata.labels['pod-template-generation']"}}}]),
        "env {}",
        c["env"]
    );
    let command = strings(&c["command"]);
    ensure!(
        command.len() == 4 && command[..2] == ["/bin/sh", "-c"],
        "{command:?}"
    );
    let script = &command[2];
    ensure!(
        script.contains(r#"gpu-ckpt-node-installer install "$@" || exit 1"#),
        "the script does not install: {script}"
    );
    // Uninstall on SIGTERM (with the pod's template generation), and the trap is set before
    // the install starts.
    let trap = script
        .find(r#"trap 'gpu-ckpt-node-installer uninstall "$@" --pod-template-generation "$POD_TEMPLATE_GENERATION"; exit $?' TERM"#)
        .context(format!("no uninstall on SIGTERM: {script}"))?;
    ensure!(
        trap < script.find("install \"$@\"").unwrap_or(0),
        "{script}"
    );
    ensure!(
        pod["volumes"]
            == json!([{"name": "host-root", "hostPath": {"path": "/", "type": "Directory"}}]),
        "volumes {}",
        pod["volumes"]
    );
    ensure!(
        c["volumeMounts"] == json!([{"name": "host-root", "mountPath": "/host"}]),
        "{}",
        c["volumeMounts"]
    );
    ensure!(pod["terminationGracePeriodSeconds"] == 120);
    ensure!(pod["priorityClassName"] == "system-node-critical");
    ensure!(
        pod["tolerations"]
            == json!([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]),
        "{}",
        pod["tolerations"]
    );
    let sa = object(&docs, "ServiceAccount", "gpu-ckpt-node-installer")?;
    ensure!(pod["serviceAccountName"] == sa["metadata"]["name"]);
    let role = object(&docs, "ClusterRole", "gpu-ckpt-node-installer")?;
    ensure!(
        role["rules"] == json!([{"apiGroups": [""], "resources": ["nodes"], "verbs": ["patch"]}]),
        "rules {}",
        role["rules"]
    );
    let binding = object(&docs, "ClusterRoleBinding", "gpu-ckpt-node-installer")?;
    ensure!(binding["roleRef"]["name"] == role["metadata"]["name"]);
    ensure!(
        binding["subjects"]
            == json!([{"kind": "ServiceAccount", "name": "gpu-ckpt-node-installer", "namespace": "gpu-ckpt-system"}]),
        "{}",
        binding["subjects"]
    );
    let selector = &ds["spec"]["selector"]["matchLabels"];
    for (k, v) in selector.as_object().context("no selector")? {
        ensure!(
            ds["spec"]["template"]["metadata"]["labels"][k] == *v,
            "selector {k}"
        );
    }
    Ok(())
}

#[test]
fn the_runtime_class_handlers_are_the_drop_ins_runtimes() -> Result<()> {
    let dir = repo().join("runtime-class/containerd");
    let files = [dir.join("gpu-ckpt.toml"), dir.join("gpu-ckpt-restore.toml")];
    let out = chart_ok(&["toml", path_str(&files[0]), path_str(&files[1])])?;
    let cri =
        |f: &Path| out["files"][path_str(f)]["plugins"]["io.containerd.cri.v1.runtime"].clone();
    let mut handlers = BTreeSet::new();
    for f in &files {
        let runtimes = cri(f)["containerd"]["runtimes"].clone();
        for (name, rt) in runtimes.as_object().context("no runtimes")? {
            handlers.insert(name.clone());
            // runc's type, so that CRI asks the handler for its features; the shim by the
            // handler's own name, whose side file holds gpu-ckpt's keys.
            ensure!(
                rt["runtime_type"] == "io.containerd.runc.v2",
                "{name}: {rt}"
            );
            let binary = if name == "gpu-ckpt-restore" {
                "containerd-shim-gpu-ckpt-restore-v1"
            } else {
                "containerd-shim-gpu-ckpt-v1"
            };
            ensure!(
                rt["runtime_path"] == format!("/usr/local/bin/{binary}"),
                "{name}: {rt}"
            );
            for key in ["pod_annotations", "container_annotations"] {
                ensure!(
                    rt[key] == json!(["gpu-ckpt.io/*", "cdi.k8s.io/*"]),
                    "{name}: {key} {}",
                    rt[key]
                );
            }
            // CRI sends only runc's keys for a runc-typed handler: `Mode = "restore"` is in the
            // restore handler's side file, which the installer writes (installer/src/site.rs).
            let mode = &rt["options"]["Mode"];
            ensure!(mode.is_null(), "{name}: Mode {mode} in the drop-in");
            // No BinaryName: runc from containerd's PATH, as containerd's runc shim finds it
            // (the chart's runc.path, written by the installer, pins one).
            ensure!(rt["options"]["BinaryName"].is_null(), "{name}: {rt}");
            ensure!(rt["options"]["Root"].is_string(), "{name}: {rt}");
        }
    }
    ensure!(
        handlers == BTreeSet::from(["gpu-ckpt".to_string(), "gpu-ckpt-restore".to_string()]),
        "{handlers:?}"
    );
    // CDI, once, CRI-wide.
    let main = cri(&files[0]);
    ensure!(main["enable_cdi"] == true, "{main}");
    ensure!(
        main["cdi_spec_dirs"] == json!(["/etc/cdi", "/var/run/cdi"]),
        "{main}"
    );
    ensure!(cri(&files[1]).get("cdi_spec_dirs").is_none());

    // The rendered RuntimeClasses name exactly these handlers.
    let rendered = render(&[])?;
    let rendered_handlers: BTreeSet<String> = valid_documents(&rendered)?
        .iter()
        .filter(|d| d["kind"] == "RuntimeClass")
        .map(|d| d["handler"].as_str().unwrap_or_default().to_string())
        .collect();
    ensure!(
        rendered_handlers == handlers,
        "{rendered_handlers:?} vs {handlers:?}"
    );
    Ok(())
}

/// The chart's settings in `values`: the keys its values.schema.json declares, down to a value
/// the schema does not split further (a string, a list, or a free-form map such as a node
/// selector), each with its path.
fn settings(
    schema: &Value,
    values: &Value,
    path: &[String],
    out: &mut Vec<(Vec<String>, Value)>,
) -> Result<()> {
    match (schema.get("properties"), values.as_object()) {
        (Some(props), Some(m)) => {
            for (k, v) in m {
                let mut p = path.to_vec();
                p.push(k.clone());
                let sub = props.get(k).with_context(|| {
                    format!(
                        "values.yaml has {}, which values.schema.json does not declare",
                        p.join(".")
                    )
                })?;
                settings(sub, v, &p, out)?;
            }
        }
        _ => out.push((path.to_vec(), values.clone())),
    }
    Ok(())
}

fn at<'a>(v: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(v, |v, k| v.get(k))
}

#[test]
fn the_all_values_file_sets_every_value_and_the_rendering_follows_it() -> Result<()> {
    let defaults = yaml_file(&chart().join("values.yaml"))?;
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(
        chart().join("values.schema.json"),
    )?)?;
    let all = yaml_file(&all_values())?;
    let mut d = Vec::new();
    settings(&schema, &defaults, &[], &mut d)?;
    ensure!(
        d.len() > 20,
        "only {} settings found in values.yaml",
        d.len()
    );
    for (path, default) in &d {
        let p = path.join(".");
        let set = at(&all, path).with_context(|| format!("ci/all-values.yaml does not set {p}"))?;
        ensure!(
            set != default,
            "ci/all-values.yaml sets {p} to its default {default}"
        );
    }

    let docs = prod_documents(&["--values", path_str(&all_values())])?;
    let rc_sel = &all["runtimeClasses"]["nodeSelector"];
    let rc_tol = &all["runtimeClasses"]["tolerations"];
    for (name, handler) in [
        ("gpu-ckpt-h100", "gpu-ckpt"),
        ("gpu-ckpt-h100-restore", "gpu-ckpt-restore"),
    ] {
        let rc = object(&docs, "RuntimeClass", name)?;
        // Renamed classes keep the handlers the drop-ins register.
        ensure!(rc["handler"] == handler, "{name}: {}", rc["handler"]);
        ensure!(
            rc["scheduling"]["nodeSelector"] == *rc_sel,
            "{name}: {}",
            rc["scheduling"]
        );
        ensure!(
            rc["scheduling"]["tolerations"] == *rc_tol,
            "{name}: {}",
            rc["scheduling"]
        );
    }
    let ni = &all["nodeInstaller"];
    let ds = object(&docs, "DaemonSet", "gpu-ckpt-prod-node-installer")?;
    let pod = daemonset_as_values(
        ds,
        ni,
        &[
            (
                "terminationGracePeriodSeconds",
                &ni["terminationGracePeriodSeconds"],
            ),
            ("imagePullSecrets", &all["imagePullSecrets"]),
            ("serviceAccountName", &ni["serviceAccount"]["name"]),
        ],
    )?;
    let c = installer_container(ds)?;
    ensure!(
        c["image"]
            == format!(
                "{}:{}",
                all["image"]["repository"].as_str().unwrap_or_default(),
                all["image"]["tag"].as_str().unwrap_or_default()
            ),
        "image {}",
        c["image"]
    );
    ensure!(c["imagePullPolicy"] == all["image"]["pullPolicy"]);
    ensure!(c["resources"] == ni["resources"], "{}", c["resources"]);
    let args = strings(&c["args"]);
    let paths = &all["paths"];
    for (f, v) in [
        ("--root", &paths["hostRoot"]),
        ("--containerd-config", &paths["containerdConfig"]),
        ("--dropin-dir", &paths["dropinDir"]),
        ("--bin-dir", &paths["binDir"]),
        ("--lib-dir", &paths["libDir"]),
        ("--payload", &ni["payloadDir"]),
        ("--restart-command", &ni["restartCommand"]),
    ] {
        ensure!(
            flag(&args, f) == v.as_str(),
            "{f}: {:?} in {args:?}",
            flag(&args, f)
        );
    }
    // labelNode: false.
    ensure!(!args.iter().any(|a| a == "--label-node"), "{args:?}");
    // The site's options: trust, restore sources, registry, runc, handler options.
    let every = |f: &str| -> Vec<&str> {
        args.iter()
            .enumerate()
            .filter(|(_, a)| *a == f)
            .filter_map(|(i, _)| args.get(i + 1).map(String::as_str))
            .collect()
    };
    let trust = &all["trust"];
    ensure!(trust["mode"] == "cluster");
    ensure!(
        flag(&args, "--signing-key") == Some("/etc/gpu-ckpt-installer/cluster-key/signing.key"),
        "{args:?}"
    );
    let trusted: Vec<String> = trust["trustedKeys"]
        .as_object()
        .context("trust.trustedKeys")?
        .iter()
        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
        .collect();
    ensure!(every("--trusted-key") == trusted, "{args:?}");
    ensure!(
        every("--revoked-key") == strings(&trust["revokedKeys"]),
        "{args:?}"
    );
    ensure!(
        every("--restore-source") == strings(&all["restoreSources"]),
        "{args:?}"
    );
    ensure!(
        flag(&args, "--registry-auth") == Some("/etc/gpu-ckpt-installer/registry-auth/config.json"),
        "{args:?}"
    );
    ensure!(
        every("--registry-ca")
            == ["registry.example.com=/etc/gpu-ckpt-installer/registry-ca/ca-0.crt"],
        "{args:?}"
    );
    ensure!(flag(&args, "--runc-path") == all["runc"]["path"].as_str());
    ensure!(args.iter().any(|a| a == "--runc-systemd-cgroup"));
    let options: Value = serde_json::from_str(flag(&args, "--handler-options").unwrap_or("null"))?;
    ensure!(options == all["handlerOptions"], "{options}");
    let volumes = &pod["volumes"];
    let volume = |name: &str| {
        volumes
            .as_array()
            .and_then(|v| v.iter().find(|v| v["name"] == name))
            .cloned()
            .unwrap_or(Value::Null)
    };
    ensure!(
        volume("cluster-key")["secret"]
            == json!({"secretName": trust["clusterKey"]["secretName"], "defaultMode": 0o400,
                      "items": [{"key": trust["clusterKey"]["secretKey"], "path": "signing.key"}]}),
        "{volumes}"
    );
    ensure!(
        volume("registry-auth")["secret"]["secretName"] == all["registry"]["authSecretName"],
        "{volumes}"
    );
    let ca_map = volume("registry-ca")["configMap"]["name"].clone();
    let ca = object(&docs, "ConfigMap", ca_map.as_str().unwrap_or_default())?;
    ensure!(
        ca["data"]["ca-0.crt"] == all["registry"]["caBundles"]["registry.example.com"],
        "{ca}"
    );
    for (name, at) in [
        ("cluster-key", "/etc/gpu-ckpt-installer/cluster-key"),
        ("registry-auth", "/etc/gpu-ckpt-installer/registry-auth"),
        ("registry-ca", "/etc/gpu-ckpt-installer/registry-ca"),
    ] {
        ensure!(
            c["volumeMounts"].as_array().is_some_and(|m| m
                .iter()
                .any(|m| m["name"] == name && m["mountPath"] == at && m["readOnly"] == true)),
            "{name}: {}",
            c["volumeMounts"]
        );
    }
    ensure!(c["volumeMounts"][0]["mountPath"] == paths["hostRoot"]);
    // action: uninstall, uninstallOnStop: false.
    let script = &strings(&c["command"])[2];
    ensure!(
        script.contains(r#"gpu-ckpt-node-installer uninstall "$@" || exit 1"#),
        "{script}"
    );
    ensure!(
        !script.contains("gpu-ckpt-node-installer install"),
        "{script}"
    );
    ensure!(
        !script.contains("trap 'gpu-ckpt-node-installer"),
        "{script}"
    );
    let sa = object(&docs, "ServiceAccount", "gpu-ckpt-installer")?;
    ensure!(sa["metadata"]["annotations"] == ni["serviceAccount"]["annotations"]);
    // admission.enabled: false.
    ensure!(
        !docs
            .iter()
            .any(|d| d["apiVersion"] == "admissionregistration.k8s.io/v1"),
        "admission policies rendered with admission.enabled false: {:?}",
        kinds(&docs)
    );
    let binding = object(&docs, "ClusterRoleBinding", "gpu-ckpt-prod-node-installer")?;
    ensure!(
        binding["subjects"]
            == json!([{"kind": "ServiceAccount", "name": "gpu-ckpt-installer", "namespace": "infra"}])
    );
    Ok(())
}

#[test]
fn the_plain_manifests_are_the_default_rendering_and_every_manifest_validates() -> Result<()> {
    let manifests = repo().join("runtime-class/manifests");
    chart_ok(&[
        "manifests",
        path_str(&chart()),
        path_str(&manifests),
        "--check",
    ])?;

    // The check does catch a drift: a copy with one line changed fails, naming the file.
    let tmp = tempfile::tempdir()?;
    let mut files = Vec::new();
    for e in std::fs::read_dir(&manifests)? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "yaml") {
            files.push(p);
        }
    }
    files.sort();
    ensure!(files.len() == 4, "runtime-class/manifests has {files:?}");
    for p in &files {
        std::fs::copy(p, tmp.path().join(p.file_name().context("name")?))?;
    }
    let edited = tmp.path().join("runtimeclasses.yaml");
    let text = std::fs::read_to_string(&edited)?;
    std::fs::write(
        &edited,
        text.replacen("handler: gpu-ckpt-restore", "handler: runc", 1),
    )?;
    let (ok, out) = chart_py(&[
        "manifests",
        path_str(&chart()),
        path_str(tmp.path()),
        "--check",
    ])?;
    ensure!(!ok, "an edited plain manifest passed the check");
    let err = out["error"].as_str().unwrap_or_default();
    ensure!(
        err.contains("runtimeclasses.yaml") && err.contains("make manifests"),
        "{err}"
    );

    // Every plain manifest, the admission policies among them.
    let all: Vec<PathBuf> = files.clone();
    let mut args = vec!["validate", "--kube-version", KUBE_VERSION];
    args.extend(all.iter().map(|p| path_str(p)));
    let out = chart_ok(&args)?;
    let docs = valid_documents(&out)?;
    let k = kinds(&docs);
    ensure!(k.get("RuntimeClass") == Some(&2), "{k:?}");
    ensure!(k.get("DaemonSet") == Some(&2), "{k:?}");
    ensure!(k.get("Service") == Some(&1), "{k:?}");
    ensure!(k.get("ValidatingAdmissionPolicy") == Some(&2), "{k:?}");
    ensure!(
        k.get("ValidatingAdmissionPolicyBinding") == Some(&2),
        "{k:?}"
    );
    let sources: BTreeSet<String> = out["documents"]
        .as_array()
        .context("documents")?
        .iter()
        .map(|d| d["source"].as_str().unwrap_or_default().to_string())
        .collect();
    ensure!(
        sources.len() == all.len(),
        "not every file had a document: {sources:?}"
    );

    // A Kubernetes version the validator has no schemas for is an error, not an older stand-in.
    let (ok, out) = chart_py(&["validate", "--kube-version", "1.99", path_str(&files[0])])?;
    ensure!(
        !ok && out["error"].as_str().unwrap_or_default().contains("1.99"),
        "{out}"
    );
    Ok(())
}

/// The admission policy of `docs` that matches pods (the restore policy) and its binding,
/// checked to be bound with Deny; the RuntimeClass name its match condition compares with.
fn restore_policy_class(docs: &[Value]) -> Result<String> {
    let policies: Vec<&Value> = docs
        .iter()
        .filter(|d| {
            d["kind"] == "ValidatingAdmissionPolicy"
                && d["spec"]["matchConstraints"]["resourceRules"][0]["resources"] == json!(["pods"])
        })
        .collect();
    let [policy] = policies.as_slice() else {
        bail!(
            "{} admission policies for pods; the rendering has {:?}",
            policies.len(),
            kinds(docs)
        );
    };
    let name = policy["metadata"]["name"].as_str().unwrap_or_default();
    let binding = object(docs, "ValidatingAdmissionPolicyBinding", name)?;
    ensure!(binding["spec"]["policyName"] == name, "{binding}");
    ensure!(
        binding["spec"]["validationActions"] == json!(["Deny"]),
        "{binding}"
    );
    ensure!(policy["spec"]["failurePolicy"] == "Fail", "{policy}");
    let cond = policy["spec"]["matchConditions"][0]["expression"]
        .as_str()
        .unwrap_or_default();
    let class = cond
        .strip_prefix("has(object.spec.runtimeClassName) && object.spec.runtimeClassName == '")
        .and_then(|c| c.strip_suffix('\''))
        .with_context(|| format!("the match condition is not on one RuntimeClass: {cond}"))?;
    let rule = policy["spec"]["validations"][0]["expression"]
        .as_str()
        .unwrap_or_default();
    ensure!(
        rule.contains("namespaceObject.metadata.labels['gpu-ckpt.io/restore'] == 'allowed'"),
        "{rule}"
    );
    Ok(class.to_string())
}

#[test]
fn the_admission_policies_follow_the_runtime_class_and_the_installers_identity() -> Result<()> {
    // Default values: the policy names the restore class the chart creates.
    let docs = valid_documents(&render(&[])?)?;
    ensure!(restore_policy_class(&docs)? == "gpu-ckpt-restore");
    object(&docs, "RuntimeClass", "gpu-ckpt-restore")?;

    // A renamed restore class: the policy names the new name (a policy that still named
    // gpu-ckpt-restore, or none at all, would let every namespace restore).
    let docs = prod_documents(&[
        "--set-json",
        r#"{"runtimeClasses":{"restore":{"name":"ml-restore"},"checkpoint":{"name":"ml"}}}"#,
    ])?;
    let rc = object(&docs, "RuntimeClass", "ml-restore")?;
    ensure!(rc["handler"] == "gpu-ckpt-restore", "{rc}");
    ensure!(
        restore_policy_class(&docs)? == "ml-restore",
        "the policy does not name the renamed class"
    );
    let text = serde_json::to_string(&docs)?;
    ensure!(
        !text.contains("'gpu-ckpt-restore'"),
        "a policy still names gpu-ckpt-restore: {text}"
    );

    // The installer may patch only the Node its token is bound to, and only the gpu-ckpt
    // labels there; its ClusterRole gives patch and nothing else.
    let own = object(
        &docs,
        "ValidatingAdmissionPolicy",
        "gpu-ckpt-prod-node-installer-own-node",
    )?;
    let binding = object(
        &docs,
        "ValidatingAdmissionPolicyBinding",
        "gpu-ckpt-prod-node-installer-own-node",
    )?;
    ensure!(
        binding["spec"]["validationActions"] == json!(["Deny"]),
        "{binding}"
    );
    let spec = &own["spec"];
    ensure!(spec["failurePolicy"] == "Fail", "{spec}");
    ensure!(
        spec["matchConstraints"]["resourceRules"]
            == json!([{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["nodes"]}]),
        "{spec}"
    );
    ensure!(
        spec["matchConditions"][0]["expression"]
            == "request.userInfo.username == 'system:serviceaccount:infra:gpu-ckpt-prod-node-installer'",
        "{}",
        spec["matchConditions"]
    );
    let vars = serde_json::to_string(&spec["variables"])?;
    ensure!(
        vars.contains("request.userInfo.extra['authentication.kubernetes.io/node-name'][0]"),
        "{vars}"
    );
    let rules: Vec<&str> = spec["validations"]
        .as_array()
        .context("validations")?
        .iter()
        .map(|v| v["expression"].as_str().unwrap_or_default())
        .collect();
    ensure!(
        rules[0] == "variables.boundNode != '' && variables.boundNode == object.metadata.name",
        "{rules:?}"
    );
    ensure!(
        rules[1].contains("k.startsWith('node-restriction.kubernetes.io/gpu-ckpt-')"),
        "{rules:?}"
    );
    ensure!(
        rules[2].contains("object.spec == oldObject.spec"),
        "{rules:?}"
    );
    let role = object(&docs, "ClusterRole", "gpu-ckpt-prod-node-installer")?;
    ensure!(
        role["rules"] == json!([{"apiGroups": [""], "resources": ["nodes"], "verbs": ["patch"]}]),
        "{}",
        role["rules"]
    );

    // The RuntimeClasses' node selector: a label a kubelet cannot set on its own Node.
    for rc in docs.iter().filter(|d| d["kind"] == "RuntimeClass") {
        for k in rc["scheduling"]["nodeSelector"]
            .as_object()
            .context("nodeSelector")?
            .keys()
        {
            ensure!(k.starts_with("node-restriction.kubernetes.io/"), "{k}");
        }
    }

    // admission.enabled: false renders none.
    let off = valid_documents(&render(&[
        "--set-json",
        r#"{"admission":{"enabled":false}}"#,
    ])?)?;
    ensure!(
        !off.iter().any(|d| d["kind"] == "ValidatingAdmissionPolicy"),
        "{:?}",
        kinds(&off)
    );
    Ok(())
}

/// Renders with `set` (JSON values) on top of the defaults and validates; the one invalid
/// document's (kind, field, error).
fn first_invalid(set: &str) -> Result<(String, String, String)> {
    let out = render(&["--set-json", set])?;
    let bad: Vec<&Value> = out["documents"]
        .as_array()
        .context("documents")?
        .iter()
        .filter(|d| d["valid"] != true)
        .collect();
    ensure!(!bad.is_empty(), "{set}: every document validated");
    let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
    Ok((s(&bad[0]["kind"]), s(&bad[0]["field"]), s(&bad[0]["error"])))
}

#[test]
fn invalid_values_fail_with_the_field_named() -> Result<()> {
    // A toleration whose tolerationSeconds is not a number: Helm renders it, the schema refuses
    // it at that field.
    let (kind, field, err) = first_invalid(
        r#"{"nodeInstaller":{"tolerations":[{"key":"pool","operator":"Exists","effect":"NoExecute","tolerationSeconds":"soon"}]}}"#,
    )?;
    ensure!(kind == "DaemonSet", "{kind}");
    ensure!(
        field == "spec.template.spec.tolerations[0].tolerationSeconds",
        "{field}"
    );
    ensure!(err.contains("'soon'") && err.contains("integer"), "{err}");

    // A misspelt toleration key on a RuntimeClass: the strict schema refuses the unknown field.
    let (kind, field, err) = first_invalid(
        r#"{"runtimeClasses":{"tolerations":[{"keyy":"pool","operator":"Exists"}]}}"#,
    )?;
    ensure!(kind == "RuntimeClass", "{kind}");
    ensure!(field == "scheduling.tolerations[0]", "{field}");
    ensure!(err.contains("'keyy'"), "{err}");

    // A resource quantity that is a list.
    let (kind, field, _) =
        first_invalid(r#"{"nodeInstaller":{"resources":{"limits":{"memory":[]}}}}"#)?;
    ensure!(kind == "DaemonSet", "{kind}");
    ensure!(
        field == "spec.template.spec.containers[0].resources.limits.memory",
        "{field}"
    );

    // What the chart's own schema refuses before anything renders, naming the value.
    for (set, named) in [
        (
            r#"{"image":{"pullPolicy":"Sometimes"}}"#,
            "/image/pullPolicy",
        ),
        (r#"{"imag":{"tag":"1"}}"#, "imag"),
        (
            r#"{"runtimeClasses":{"checkpoint":{"name":"GPU_Ckpt"}}}"#,
            "/runtimeClasses/checkpoint/name",
        ),
        (r#"{"paths":{"binDir":"usr/local/bin"}}"#, "/paths/binDir"),
        (
            r#"{"runtimeClasses":{"nodeSelector":{"node-restriction.kubernetes.io/gpu-ckpt-runtime":true}}}"#,
            "nodeSelector",
        ),
        // The site's options.
        (
            r#"{"trust":{"mode":"cluster"}}"#,
            "/trust/clusterKey/secretName",
        ),
        (
            r#"{"trust":{"trustedKeys":{"gpu-a":"not-a-key"}}}"#,
            "/trust/trustedKeys/gpu-a",
        ),
        (r#"{"trust":{"revokedKeys":["x"]}}"#, "/trust/revokedKeys/0"),
        (r#"{"restoreSources":["ckpt"]}"#, "/restoreSources/0"),
        (
            r#"{"handlerOptions":{"Mode":"restore"}}"#,
            "'Mode' not allowed",
        ),
        (
            r#"{"handlerOptions":{"DeviceLockTimeout":"soon"}}"#,
            "/handlerOptions/DeviceLockTimeout",
        ),
        (r#"{"runc":{"path":"runc"}}"#, "/runc/path"),
    ] {
        let (ok, out) = chart_py(&["render", path_str(&chart()), "--set-json", set])?;
        ensure!(!ok, "{set} rendered");
        let err = out["error"].as_str().unwrap_or_default();
        ensure!(
            err.contains(named),
            "{set}: the error does not name {named}: {err}"
        );
    }
    Ok(())
}

/// The DaemonSet container's command and its arguments as the kubelet passes them
/// (`$(NODE_NAME)` expanded).
pub(crate) fn pod_command(rendered: &Value, node: &str) -> Result<(Vec<String>, Vec<String>)> {
    let docs = valid_documents(rendered)?;
    let ds = docs
        .iter()
        .find(|d| is_installer_daemonset(d))
        .context("no DaemonSet")?;
    let c = installer_container(ds)?;
    let command = strings(&c["command"]);
    ensure!(
        command.first().map(String::as_str) == Some("/bin/sh"),
        "{command:?}"
    );
    let args = strings(&c["args"])
        .into_iter()
        .map(|a| a.replace("$(NODE_NAME)", node))
        .collect();
    Ok((command, args))
}

/// Runs the installer pod's command as the kubelet would, with `shell` in place of `/bin/sh`
/// and `bin` first on PATH (where gpu-ckpt-node-installer is). Waits until it says it is done
/// (or exits), calls `running` while it waits, sends SIGTERM, and returns its exit status, the
/// expanded arguments and its standard error.
fn run_pod(
    rendered: &Value,
    shell: &[&str],
    bin: &Path,
    running: impl FnOnce() -> Result<()>,
) -> Result<(i32, Vec<String>, String)> {
    use nix::sys::signal::{kill, killpg, Signal};
    use nix::unistd::Pid;
    use std::os::unix::process::CommandExt;
    use std::time::{Duration, Instant};

    let node = "node-a";
    let (command, args) = pod_command(rendered, node)?;
    let tmp = tempfile::tempdir()?;
    let out = tmp.path().join("stdout");
    let err = tmp.path().join("stderr");
    let mut child = Command::new(shell[0])
        .args(&shell[1..])
        .args(&command[1..])
        .args(&args)
        .env_clear()
        .env(
            "PATH",
            format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", bin.display()),
        )
        .env("NODE_NAME", node)
        .env("POD_TEMPLATE_GENERATION", "3")
        .stdout(std::fs::File::create(&out)?)
        .stderr(std::fs::File::create(&err)?)
        .process_group(0)
        .spawn()
        .with_context(|| format!("cannot run {shell:?}"))?;
    let pid = Pid::from_raw(i32::try_from(child.id())?);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut status = None;
    let mut done = false;
    while Instant::now() < deadline {
        if let Some(s) = child.try_wait()? {
            status = Some(s);
            break;
        }
        if std::fs::read_to_string(&out)?.contains(&format!("done on node {node}; waiting")) {
            done = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let checked = if done { running() } else { Ok(()) };
    if status.is_none() {
        kill(pid, Signal::SIGTERM)?;
        while Instant::now() < deadline && status.is_none() {
            status = child.try_wait()?;
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // The shell's `sleep` is left over once it exited; end the group.
    let _ = killpg(pid, Signal::SIGKILL);
    let status = match status {
        Some(s) => s,
        None => {
            let _ = child.kill();
            bail!("the installer pod's command did not exit within 60 s")
        }
    };
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    checked.with_context(|| format!("while the pod ran; its stderr:\n{stderr}"))?;
    Ok((status.code().unwrap_or(-1), args, stderr))
}

/// [`run_pod`] with a stub gpu-ckpt-node-installer that logs its arguments and exits with
/// `stub_status`; the exit status, the stub's calls and the arguments.
fn run_installer_pod(
    rendered: &Value,
    shell: &[&str],
    stub_status: i32,
) -> Result<(i32, Vec<String>, Vec<String>)> {
    let tmp = tempfile::tempdir()?;
    let log = tmp.path().join("calls.log");
    let stub = tmp.path().join("gpu-ckpt-node-installer");
    std::fs::write(
        &stub,
        format!(
            "#!/bin/sh\necho \"$*\" >> '{}'\nexit {stub_status}\n",
            log.display()
        ),
    )?;
    std::fs::set_permissions(&stub, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let (code, args, _) = run_pod(rendered, shell, tmp.path(), || Ok(()))?;
    let calls = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect();
    Ok((code, calls, args))
}

#[test]
fn the_installer_pod_installs_then_uninstalls_when_stopped() -> Result<()> {
    // The image's shell is busybox's; the host's /bin/sh (dash) too. busybox-static is one of
    // the stack's host packages (test-containers/stack/install.sh).
    ensure!(
        Path::new("/bin/busybox").is_file(),
        "/bin/busybox is missing: run `make deps` (busybox-static)"
    );
    let shells: [&[&str]; 2] = [&["/bin/busybox", "sh"], &["/bin/sh"]];
    let defaults = render(&[])?;
    for shell in shells {
        // Default values: install, wait, uninstall with the same flags on SIGTERM and the pod's
        // template generation (POD_TEMPLATE_GENERATION, 3 here), exit 0.
        let (code, calls, args) = run_installer_pod(&defaults, shell, 0)?;
        let joined = args.join(" ");
        ensure!(joined.contains("--label-node node-a"), "{joined}");
        ensure!(
            calls
                == [
                    format!("install {joined}"),
                    format!("uninstall {joined} --pod-template-generation 3")
                ],
            "{shell:?}: {calls:?}"
        );
        ensure!(code == 0, "{shell:?}: exit status {code}");

        // A failed install ends the container (the kubelet restarts it) without an uninstall.
        let (code, calls, args) = run_installer_pod(&defaults, shell, 1)?;
        ensure!(
            calls == [format!("install {}", args.join(" "))],
            "{shell:?}: {calls:?}"
        );
        ensure!(code == 1, "{shell:?}: exit status {code}");
    }

    // action: uninstall (ci/all-values.yaml): uninstall once, then nothing more on SIGTERM.
    let all = render(&["--values", path_str(&all_values())])?;
    let (code, calls, args) = run_installer_pod(&all, &["/bin/busybox", "sh"], 0)?;
    ensure!(
        calls == [format!("uninstall {}", args.join(" "))],
        "{calls:?}"
    );
    ensure!(code == 0, "exit status {code}");
    Ok(())
}

/// A workspace binary next to the test executable's directory (target/<profile>/).
pub(crate) fn workspace_bin(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let mut dir = exe.parent();
    for _ in 0..2 {
        let Some(d) = dir else { break };
        if d.join(name).is_file() {
            return Ok(d.to_path_buf());
        }
        dir = d.parent();
    }
    bail!(
        "{name} not found near {}: build the workspace first (cargo build --workspace, or \
         cargo build -p gpu-ckpt-node-installer)",
        exe.display()
    )
}

/// Every entry under `root`: its kind, mode and content digest (or link target).
fn listing(root: &Path) -> Result<BTreeMap<String, String>> {
    use sha2::{Digest, Sha256};
    use std::os::unix::fs::PermissionsExt;
    let mut out = BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for e in std::fs::read_dir(&dir)? {
            let p = e?.path();
            let rel = p.strip_prefix(root)?.display().to_string();
            let m = std::fs::symlink_metadata(&p)?;
            let mode = m.permissions().mode() & 0o7777;
            let what = if m.file_type().is_symlink() {
                format!("link -> {}", std::fs::read_link(&p)?.display())
            } else if m.is_dir() {
                todo.push(p.clone());
                format!("dir {mode:o}")
            } else {
                let digest = hex::encode(Sha256::digest(std::fs::read(&p)?));
                format!("file {mode:o} {digest}")
            };
            out.insert(rel, what);
        }
    }
    Ok(out)
}

/// A payload of stand-ins at `payload`: every file the installer copies, each a small script.
pub(crate) fn stub_payload(payload: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(payload)?;
    for f in ["containerd-shim-gpu-ckpt-v1", "gpu-ckpt", "gpu-ckpt-hook"] {
        let p = payload.join(f);
        std::fs::write(&p, format!("#!/bin/sh\n# {f}\n"))?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))?;
    }
    std::fs::write(
        payload.join("libgpu-ckpt-nccl.so"),
        "# libgpu-ckpt-nccl.so\n",
    )?;
    // CRIU as `make payload` bundles it: the installer gives it the bundled loader.
    crate::common::bundle_criu(
        &test_containers::stack::Stack::discover()?,
        &payload.join("criu"),
    )
}

#[test]
fn the_installer_pod_runs_the_real_installer_with_the_charts_flags() -> Result<()> {
    let bin = workspace_bin("gpu-ckpt-node-installer")?;
    let tmp = tempfile::tempdir()?;
    // A node: containerd's configuration and the directories a node has.
    let root = tmp.path().join("node");
    std::fs::create_dir_all(root.join("etc/containerd"))?;
    std::fs::create_dir_all(root.join("usr/local/bin"))?;
    std::fs::create_dir_all(root.join("var/lib"))?;
    std::fs::write(
        root.join("etc/containerd/config.toml"),
        "# the node's own configuration\nversion = 3\nroot = '/var/lib/containerd'\n\n\
         [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]\n  \
         runtime_type = 'io.containerd.runc.v2'\n",
    )?;
    // What the image carries: stand-ins for the Rust binaries, and CRIU bundled as the payload
    // bundles it (the installer gives it its interpreter).
    let payload = tmp.path().join("payload");
    stub_payload(&payload)?;
    let restarts = tmp.path().join("restarts.log");
    let before = listing(&root)?;

    let set = json!({
        "paths": {"hostRoot": path_str(&root)},
        "nodeInstaller": {
            "payloadDir": path_str(&payload),
            "restartCommand": format!("echo restarted >> {}", restarts.display()),
            "labelNode": false,
        },
    })
    .to_string();
    let rendered = render(&["--set-json", &set])?;
    let restarts_seen = || -> usize {
        std::fs::read_to_string(&restarts)
            .map(|s| s.lines().count())
            .unwrap_or(0)
    };
    let (code, _, stderr) = run_pod(&rendered, &["/bin/busybox", "sh"], &bin, || {
        let dropin = std::fs::read_to_string(root.join("etc/containerd/conf.d/gpu-ckpt.toml"))
            .context("the gpu-ckpt drop-in was not installed")?;
        ensure!(
            dropin.contains("/usr/local/bin/containerd-shim-gpu-ckpt-v1")
                && dropin.contains("cdi.k8s.io/*"),
            "{dropin}"
        );
        let restore =
            std::fs::read_to_string(root.join("etc/containerd/conf.d/gpu-ckpt-restore.toml"))
                .context("the gpu-ckpt-restore drop-in was not installed")?;
        ensure!(restore.contains("Mode = 'restore'") || restore.contains("Mode = \"restore\""));
        let config = std::fs::read_to_string(root.join("etc/containerd/config.toml"))?;
        for d in ["gpu-ckpt.toml", "gpu-ckpt-restore.toml"] {
            ensure!(
                config.contains(&format!("/etc/containerd/conf.d/{d}")),
                "{d} is not in containerd's imports:\n{config}"
            );
        }
        ensure!(
            config.contains("# the node's own configuration"),
            "{config}"
        );
        for b in [
            "containerd-shim-gpu-ckpt-v1",
            "gpu-ckpt",
            "gpu-ckpt-hook",
            "criu",
        ] {
            ensure!(
                root.join("usr/local/bin").join(b).exists(),
                "{b} is not in the node's /usr/local/bin"
            );
        }
        ensure!(
            restarts_seen() == 1,
            "containerd restarted {} times",
            restarts_seen()
        );
        Ok(())
    })?;
    ensure!(
        code == 0,
        "the pod's command exited {code}; its stderr:\n{stderr}"
    );
    // SIGTERM: the uninstall left the node as it was, and restarted containerd once more.
    let after = listing(&root)?;
    ensure!(
        after == before,
        "the node is not back to where it started:\nbefore {before:#?}\nafter {after:#?}"
    );
    ensure!(
        restarts_seen() == 2,
        "containerd restarted {} times",
        restarts_seen()
    );
    Ok(())
}

#[test]
fn the_installer_is_ready_when_installed_and_asks_for_its_daemonset_before_it_uninstalls(
) -> Result<()> {
    let docs = valid_documents(&render(&[
        "--release",
        "gpu-ckpt",
        "--namespace",
        "gpu-ckpt-system",
    ])?)?;
    let ds = object(&docs, "DaemonSet", "gpu-ckpt-node-installer")?;
    let c = installer_container(ds)?;
    let args = strings(&c["args"]);
    for (f, v) in [
        ("--driver-root", "/"),
        ("--ready-file", "/run/gpu-ckpt-node-installer/ready"),
        ("--daemonset", "gpu-ckpt-system/gpu-ckpt-node-installer"),
        ("--min-restart-interval-seconds", "300"),
    ] {
        ensure!(flag(&args, f) == Some(v), "{f}: {args:?}");
    }
    // The stop's uninstall compares this pod's template generation (its label, through the
    // downward API) with the DaemonSet's.
    ensure!(
        c["env"].as_array().is_some_and(|e| e.iter().any(|e| e
            == &json!({"name": "POD_TEMPLATE_GENERATION", "valueFrom": {"fieldRef":
                {"fieldPath": "metadata.labels['pod-template-generation']"}}}))),
        "{}",
        c["env"]
    );
    ensure!(
        strings(&c["command"])[2].contains(
            r#"gpu-ckpt-node-installer uninstall "$@" --pod-template-generation "$POD_TEMPLATE_GENERATION""#
        ),
        "{}",
        c["command"]
    );
    // The readiness probe: `status` with the installer's own flags.
    let probe = &c["readinessProbe"];
    let cmd = strings(&probe["exec"]["command"]);
    ensure!(
        cmd.len() > 2 && cmd[..2] == ["gpu-ckpt-node-installer", "status"] && cmd[2..] == args[..],
        "probe {probe}"
    );
    ensure!(probe["failureThreshold"] == 1, "{probe}");
    // The watch: `repair` every checkIntervalSeconds (60).
    let script = &strings(&c["command"])[2];
    ensure!(
        script.contains(
            r#"while :; do sleep 60 & wait $!; gpu-ckpt-node-installer repair "$@"; done"#
        ),
        "{script}"
    );
    // get on its own DaemonSet, in its namespace, for the ServiceAccount.
    let role = object(&docs, "Role", "gpu-ckpt-node-installer")?;
    ensure!(role["metadata"]["namespace"] == "gpu-ckpt-system");
    ensure!(
        role["rules"]
            == json!([{"apiGroups": ["apps"], "resources": ["daemonsets"],
                       "resourceNames": ["gpu-ckpt-node-installer"], "verbs": ["get"]}]),
        "rules {}",
        role["rules"]
    );
    let binding = object(&docs, "RoleBinding", "gpu-ckpt-node-installer")?;
    ensure!(
        binding["roleRef"]["kind"] == "Role"
            && binding["roleRef"]["name"] == "gpu-ckpt-node-installer"
    );
    ensure!(
        binding["subjects"]
            == json!([{"kind": "ServiceAccount", "name": "gpu-ckpt-node-installer", "namespace": "gpu-ckpt-system"}]),
        "{}",
        binding["subjects"]
    );

    // No check (0), and the operator's driver root.
    let docs = valid_documents(&render(&[
        "--set-json",
        r#"{"nodeInstaller":{"checkIntervalSeconds":0,"driverRoot":"/run/nvidia/driver"}}"#,
    ])?)?;
    let ds = docs
        .iter()
        .find(|d| is_installer_daemonset(d))
        .context("no DaemonSet")?;
    let c = installer_container(ds)?;
    ensure!(flag(&strings(&c["args"]), "--driver-root") == Some("/run/nvidia/driver"));
    let script = &strings(&c["command"])[2];
    ensure!(
        !script.contains("repair") && script.contains("sleep 3600"),
        "{script}"
    );

    // action uninstall, uninstallOnStop off (ci/all-values.yaml): the probe checks that the node
    // is uninstalled, no repair, and the uninstall asks for no DaemonSet.
    let all = yaml_file(&all_values())?;
    let docs = prod_documents(&["--values", path_str(&all_values())])?;
    let ds = object(&docs, "DaemonSet", "gpu-ckpt-prod-node-installer")?;
    let c = installer_container(ds)?;
    let args = strings(&c["args"]);
    ensure!(flag(&args, "--driver-root") == all["nodeInstaller"]["driverRoot"].as_str());
    ensure!(flag(&args, "--ready-file") == all["nodeInstaller"]["readyFile"].as_str());
    ensure!(flag(&args, "--daemonset").is_none(), "{args:?}");
    ensure!(
        flag(&args, "--min-restart-interval-seconds") == Some("900"),
        "{args:?}"
    );
    let cmd = strings(&c["readinessProbe"]["exec"]["command"]);
    ensure!(
        cmd.len() > 3
            && cmd[..3] == ["gpu-ckpt-node-installer", "status", "--uninstalled"]
            && cmd[3..] == args[..],
        "{c}"
    );
    ensure!(!strings(&c["command"])[2].contains("repair"));
    // action install with uninstallOnStop off: no DaemonSet to ask.
    let docs = valid_documents(&render(&[
        "--set-json",
        r#"{"nodeInstaller":{"uninstallOnStop":false}}"#,
    ])?)?;
    let ds = docs
        .iter()
        .find(|d| is_installer_daemonset(d))
        .context("no DaemonSet")?;
    ensure!(flag(&strings(&installer_container(ds)?["args"]), "--daemonset").is_none());
    Ok(())
}

/// The agent pod's hostPath volumes, path to type, each mounted read-only at its own path (and
/// no volume of another kind).
fn agent_host_paths(pod: &Value) -> Result<BTreeMap<String, String>> {
    let c = &pod["containers"][0];
    let mounts = c["volumeMounts"].as_array().context("volumeMounts")?;
    let volumes = pod["volumes"].as_array().context("volumes")?;
    ensure!(mounts.len() == volumes.len(), "{mounts:?} {volumes:?}");
    let mut out = BTreeMap::new();
    for v in volumes {
        let path = v["hostPath"]["path"].as_str().context("a hostPath")?;
        let m = mounts
            .iter()
            .find(|m| m["name"] == v["name"])
            .with_context(|| format!("volume {} not mounted", v["name"]))?;
        ensure!(
            m["readOnly"] == true && m["mountPath"] == path,
            "{m} for {v}"
        );
        let ty = v["hostPath"]["type"].as_str().unwrap_or_default();
        out.insert(path.to_string(), ty.to_string());
    }
    Ok(out)
}

/// The node agent (templates/agent.yaml, docs/metrics.md): by default its DaemonSet, running
/// gpu-ckpt-agent from the installer's image on the nodes the RuntimeClasses select, with the
/// journal's directory itself and the kubelet's checkpoints read-only and nothing else from the
/// host (not the state directory with the node's private key, dumps and restore staging, not the
/// cluster key; no --key-dir), no capabilities, a port
/// `metrics`, resources and probes, and a headless Service on port 9402; no ServiceMonitor
/// unless asked for. With every value set (ci/all-values.yaml, the agent on) the objects follow
/// them and the ServiceMonitor validates against its CRD's schema (runtime-class/tools/schemas/);
/// `metrics.enabled: false` renders none of them.
#[test]
fn the_metrics_agent_its_service_and_the_opt_in_service_monitor() -> Result<()> {
    let docs = valid_documents(&render(&[
        "--release",
        "gpu-ckpt",
        "--namespace",
        "gpu-ckpt-system",
    ])?)?;
    ensure!(
        !docs.iter().any(|d| d["kind"] == "ServiceMonitor"),
        "a ServiceMonitor by default"
    );
    let ds = object(&docs, "DaemonSet", "gpu-ckpt-agent")?;
    let pod = &ds["spec"]["template"]["spec"];
    ensure!(
        pod["nodeSelector"]
            == json!({"node-restriction.kubernetes.io/gpu-ckpt-runtime": "installed"}),
        "{}",
        pod["nodeSelector"]
    );
    ensure!(
        pod.get("hostPID").is_none() && pod.get("hostNetwork").is_none(),
        "{pod}"
    );
    let cs = pod["containers"].as_array().context("containers")?;
    ensure!(cs.len() == 1 && cs[0]["name"] == "agent", "{cs:?}");
    let c = &cs[0];
    ensure!(
        c["image"]
            == format!(
                "ghcr.io/gpu-ckpt/gpu-ckpt-node-installer:{}",
                chart_app_version()?
            ),
        "{}",
        c["image"]
    );
    ensure!(
        strings(&c["command"]) == ["gpu-ckpt-agent"],
        "{}",
        c["command"]
    );
    let args = strings(&c["args"]);
    ensure!(flag(&args, "--listen") == Some("0.0.0.0:9402"), "{args:?}");
    ensure!(
        flag(&args, "--events-dir") == Some("/var/lib/gpu-ckpt/events"),
        "{args:?}"
    );
    ensure!(flag(&args, "--key-dir").is_none(), "{args:?}");
    ensure!(
        flag(&args, "--checkpoint-dir") == Some("/var/lib/kubelet/checkpoints"),
        "{args:?}"
    );
    ensure!(
        c["ports"] == json!([{"name": "metrics", "containerPort": 9402, "protocol": "TCP"}]),
        "{}",
        c["ports"]
    );
    ensure!(c["readinessProbe"]["httpGet"]["path"] == "/healthz", "{c}");
    ensure!(c["resources"]["requests"]["cpu"].is_string(), "{c}");
    ensure!(c["resources"]["limits"]["memory"].is_string(), "{c}");
    let sc = &c["securityContext"];
    ensure!(sc["capabilities"]["drop"] == json!(["ALL"]), "{sc}");
    ensure!(
        sc["readOnlyRootFilesystem"] == true && sc["allowPrivilegeEscalation"] == false,
        "{sc}"
    );
    ensure!(sc.get("privileged").is_none(), "{sc}");
    // Every mount read-only, at its host path; the journal's directory itself and the kubelet's
    // checkpoints from the host, nothing else (DirectoryOrCreate: the shim makes the journal's
    // 0700 when it opens it).
    let want: BTreeMap<String, String> = [
        ("/var/lib/gpu-ckpt/events", "DirectoryOrCreate"),
        ("/var/lib/kubelet/checkpoints", "DirectoryOrCreate"),
    ]
    .into_iter()
    .map(|(p, t)| (p.to_string(), t.to_string()))
    .collect();
    ensure!(agent_host_paths(pod)? == want, "{}", pod["volumes"]);
    let svc = object(&docs, "Service", "gpu-ckpt-agent")?;
    ensure!(svc["spec"]["clusterIP"] == "None", "{svc}");
    ensure!(
        svc["spec"]["ports"]
            == json!([{"name": "metrics", "port": 9402, "targetPort": "metrics", "protocol": "TCP"}]),
        "{svc}"
    );
    ensure!(
        svc["spec"]["selector"] == ds["spec"]["selector"]["matchLabels"],
        "the Service selects {} but the agent's pods are {}",
        svc["spec"]["selector"],
        ds["spec"]["selector"]["matchLabels"]
    );
    // The installer's pods are not the Service's.
    let installer = object(&docs, "DaemonSet", "gpu-ckpt-node-installer")?;
    let inst_labels = &installer["spec"]["template"]["metadata"]["labels"];
    let selects_installer = svc["spec"]["selector"]
        .as_object()
        .context("selector")?
        .iter()
        .all(|(k, v)| inst_labels[k] == *v);
    ensure!(
        !selects_installer,
        "the agent's Service selects the installer's pods"
    );

    // Every value set, the agent on.
    let all = yaml_file(&all_values())?;
    let m = &all["metrics"];
    let docs = prod_documents(&[
        "--values",
        path_str(&all_values()),
        "--set-json",
        r#"{"metrics":{"enabled":true}}"#,
    ])?;
    let ds = object(&docs, "DaemonSet", "gpu-ckpt-prod-agent")?;
    let pod = daemonset_as_values(ds, m, &[("imagePullSecrets", &all["imagePullSecrets"])])?;
    let c = &pod["containers"][0];
    ensure!(c["resources"] == m["resources"], "{}", c["resources"]);
    ensure!(c["imagePullPolicy"] == all["image"]["pullPolicy"]);
    ensure!(
        c["env"] == json!([{"name": "RUST_LOG", "value": m["logLevel"]}]),
        "{}",
        c["env"]
    );
    let args = strings(&c["args"]);
    ensure!(
        flag(&args, "--listen") == Some(format!("0.0.0.0:{}", m["port"]).as_str()),
        "{args:?}"
    );
    ensure!(
        flag(&args, "--events-dir") == m["eventsDir"].as_str(),
        "{args:?}"
    );
    // Trust mode cluster: still no key directory (the cluster's private key is beside its
    // node.pub).
    ensure!(flag(&args, "--key-dir").is_none(), "{args:?}");
    let dirs: Vec<&str> = args
        .iter()
        .enumerate()
        .filter(|(_, a)| *a == "--checkpoint-dir")
        .filter_map(|(i, _)| args.get(i + 1).map(String::as_str))
        .collect();
    ensure!(dirs == strings(&m["checkpointDirs"]), "{args:?}");
    // The journal itself (all-values' is /var/log/gpu-ckpt: not /var/log), the checkpoint
    // directories, and nothing else: no cluster key.
    let mut want: BTreeMap<String, String> = strings(&m["checkpointDirs"])
        .into_iter()
        .map(|d| (d, "DirectoryOrCreate".to_string()))
        .collect();
    want.insert(
        m["eventsDir"].as_str().context("eventsDir")?.to_string(),
        "DirectoryOrCreate".to_string(),
    );
    ensure!(agent_host_paths(pod)? == want, "{}", pod["volumes"]);
    ensure!(want.contains_key("/var/log/gpu-ckpt"), "{want:?}");
    let svc = object(&docs, "Service", "gpu-ckpt-prod-agent")?;
    ensure!(
        svc["metadata"]["annotations"] == m["service"]["annotations"],
        "{svc}"
    );
    ensure!(svc["spec"]["ports"][0]["port"] == m["port"], "{svc}");
    let sm = object(&docs, "ServiceMonitor", "gpu-ckpt-prod-agent")?;
    ensure!(sm["apiVersion"] == "monitoring.coreos.com/v1", "{sm}");
    ensure!(
        sm["metadata"]["labels"]["release"] == "kube-prometheus-stack",
        "{sm}"
    );
    ensure!(
        sm["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"],
        "{sm}"
    );
    ensure!(
        sm["spec"]["namespaceSelector"]["matchNames"] == json!(["infra"]),
        "{sm}"
    );
    let ep = &sm["spec"]["endpoints"][0];
    ensure!(ep["port"] == "metrics" && ep["path"] == "/metrics", "{ep}");
    ensure!(ep["interval"] == m["serviceMonitor"]["interval"], "{ep}");
    ensure!(
        ep["scrapeTimeout"] == m["serviceMonitor"]["scrapeTimeout"],
        "{ep}"
    );
    ensure!(ep["relabelings"][0]["targetLabel"] == "node", "{ep}");

    // The ServiceMonitor's schema refuses a field the CRD does not have.
    let tmp = tempfile::tempdir()?;
    let mut bad = sm.clone();
    bad["spec"]["endpoints"][0]["intervall"] = json!("15s");
    let f = tmp.path().join("sm.yaml");
    std::fs::write(&f, serde_yaml::to_string(&bad)?)?;
    let out = chart_ok(&["validate", "--kube-version", KUBE_VERSION, path_str(&f)])?;
    let d = &out["documents"][0];
    ensure!(d["valid"] == false, "{d}");
    ensure!(
        d["error"]
            .as_str()
            .unwrap_or_default()
            .contains("intervall"),
        "{d}"
    );

    // Off: no agent, Service or ServiceMonitor.
    let docs = prod_documents(&["--values", path_str(&all_values())])?;
    ensure!(
        !docs
            .iter()
            .any(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == "agent"),
        "metrics.enabled false rendered {:?}",
        kinds(&docs)
    );
    // A wrong value is refused by the chart's schema, naming it: among them a directory for
    // the agent to mount that is the host's / or climbs out of where it says.
    for (set, path) in [
        (
            r#"{"metrics":{"serviceMonitor":{"interval":"soon"}}}"#,
            "/metrics/serviceMonitor/interval",
        ),
        (r#"{"metrics":{"eventsDir":"/"}}"#, "/metrics/eventsDir"),
        (
            r#"{"metrics":{"eventsDir":"/var/lib/gpu-ckpt/events/.."}}"#,
            "/metrics/eventsDir",
        ),
        (
            r#"{"metrics":{"eventsDir":"events"}}"#,
            "/metrics/eventsDir",
        ),
        (
            r#"{"metrics":{"checkpointDirs":["/"]}}"#,
            "/metrics/checkpointDirs/0",
        ),
        (
            r#"{"metrics":{"checkpointDirs":["/srv/../etc"]}}"#,
            "/metrics/checkpointDirs/0",
        ),
    ] {
        let (_, out) = chart_py(&["lint", path_str(&chart()), "--set-json", set])?;
        ensure!(
            out["lint"]["messages"].as_array().is_some_and(|ms| ms
                .iter()
                .any(|m| m["error"].as_str().is_some_and(|e| e.contains(path)))),
            "{set}: {out}"
        );
    }
    // A trailing slash is a directory still.
    let (_, out) = chart_py(&[
        "lint",
        path_str(&chart()),
        "--set-json",
        r#"{"metrics":{"eventsDir":"/var/lib/gpu-ckpt/events/","checkpointDirs":["/srv/c/"]}}"#,
    ])?;
    ensure!(
        !out["lint"]["messages"].as_array().is_some_and(|ms| ms
            .iter()
            .any(|m| m["error"].as_str().is_some_and(|e| e.contains("/metrics/")))),
        "{out}"
    );
    Ok(())
}

/// The DaemonSet `ds` rendered from the values section `v` (`nodeInstaller`, `metrics`) with
/// every value set: in namespace `infra`, its rollout, pod annotations and placement as `v` says,
/// and the pod's `more` fields as given. Its pod spec.
fn daemonset_as_values<'a>(ds: &'a Value, v: &Value, more: &[(&str, &Value)]) -> Result<&'a Value> {
    ensure!(ds["metadata"]["namespace"] == "infra");
    ensure!(ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == v["maxUnavailable"]);
    let tpl = &ds["spec"]["template"];
    ensure!(
        tpl["metadata"]["annotations"] == v["podAnnotations"],
        "{}",
        tpl["metadata"]
    );
    let pod = &tpl["spec"];
    let placement = [
        ("nodeSelector", &v["nodeSelector"]),
        ("affinity", &v["affinity"]),
        ("tolerations", &v["tolerations"]),
        ("priorityClassName", &v["priorityClassName"]),
    ];
    for (field, value) in placement.iter().chain(more) {
        ensure!(
            pod[*field] == **value,
            "pod {field}: {} != {value}",
            pod[*field]
        );
    }
    Ok(pod)
}
