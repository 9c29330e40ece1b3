//! The admission policies in runtime-class/admission/ against the Kubernetes API's own types
//! (k8s-openapi, Kubernetes 1.33): every document parses as its kind, and writing it back gives
//! the same document, so no field is unknown, misspelt or of the wrong type (an unknown field
//! would be dropped on the way through and the comparison would fail).

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
fn restore_namespaces_policy_matches_the_kubernetes_schema() -> Result<()> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../runtime-class/admission/restore-namespaces.yaml");
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
    ensure!(kinds.len() == 2, "expected a policy and its binding");
    let (policy, binding) = (&kinds[0].1, &kinds[1].1);
    ensure!(binding["spec"]["policyName"] == policy["metadata"]["name"]);
    ensure!(binding["spec"]["validationActions"][0] == "Deny");
    let cond = policy["spec"]["matchConditions"][0]["expression"]
        .as_str()
        .unwrap_or_default();
    ensure!(cond.contains("'gpu-ckpt-restore'"), "{cond}");
    Ok(())
}
