//! The admission policies (runtime-class/manifests/admission.yaml, the Helm chart's rendering
//! with its default values) against the Kubernetes API's own types (k8s-openapi, Kubernetes
//! 1.33): every document parses as its kind, and writing it back gives the same document, so no
//! field is unknown, misspelt or of the wrong type (an unknown field would be dropped on the
//! way through and the comparison would fail).

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use serde::Deserialize;

fn round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(
    doc: &serde_json::Value,
) -> Result<serde_json::Value> {
    let typed: T = serde_json::from_value(doc.clone())?;
    Ok(serde_json::to_value(&typed)?)
}

#[test]
fn the_admission_policies_match_the_kubernetes_schema() -> Result<()> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../runtime-class/manifests/admission.yaml");
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let mut kinds = Vec::new();
    for de in serde_yaml::Deserializer::from_str(&text) {
        let doc = serde_json::Value::deserialize(de)?;
        let kind = doc["kind"].as_str().unwrap_or_default().to_string();
        ensure!(
            doc["apiVersion"] == "admissionregistration.k8s.io/v1",
            "{kind}: apiVersion {}",
            doc["apiVersion"]
        );
        let back = match kind.as_str() {
            "ValidatingAdmissionPolicy" => round_trip::<ValidatingAdmissionPolicy>(&doc)?,
            "ValidatingAdmissionPolicyBinding" => {
                round_trip::<ValidatingAdmissionPolicyBinding>(&doc)?
            }
            other => bail!("unexpected kind {other:?}"),
        };
        ensure!(
            back == doc,
            "{kind} does not survive the Kubernetes types:\nfile: {doc:#}\ntypes: {back:#}"
        );
        kinds.push((kind, doc));
    }
    ensure!(
        kinds.len() == 4,
        "expected two policies, each with its binding: {:?}",
        kinds.iter().map(|(k, _)| k).collect::<Vec<_>>()
    );
    for pair in kinds.chunks(2) {
        let (policy, binding) = (&pair[0].1, &pair[1].1);
        ensure!(pair[0].0 == "ValidatingAdmissionPolicy", "{}", pair[0].0);
        ensure!(binding["spec"]["policyName"] == policy["metadata"]["name"]);
        ensure!(binding["spec"]["validationActions"][0] == "Deny");
    }
    let cond = kinds[0].1["spec"]["matchConditions"][0]["expression"]
        .as_str()
        .unwrap_or_default();
    ensure!(cond.contains("'gpu-ckpt-restore'"), "{cond}");
    let cond = kinds[2].1["spec"]["matchConditions"][0]["expression"]
        .as_str()
        .unwrap_or_default();
    ensure!(
        cond.contains("'system:serviceaccount:gpu-ckpt-system:gpu-ckpt-node-installer'"),
        "{cond}"
    );
    Ok(())
}
