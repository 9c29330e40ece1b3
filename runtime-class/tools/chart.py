#!/usr/bin/env python3
"""The chart's checks and the plain manifests, with Helm's own engine and the Kubernetes schemas.

Runs with the test stack's Python venv ($GPU_CKPT_STACK/py, made by
test-containers/stack/install.sh), which holds helm-python-sdk (Helm's Go SDK, no helm binary)
and kubernetes-validate (the Kubernetes API's JSON schemas per version, shipped in the package,
so nothing is fetched). Every command prints one JSON object on stdout; a failure is a JSON
object with "error" and exit status 1.

  chart.py lint CHART [--values FILE]... [--set-json JSON] [--kube-version V]
  chart.py render CHART [--values FILE]... [--set-json JSON] [--release NAME] [--namespace NS]
                  [--kube-version V]        (V: validate every rendered document too)
  chart.py validate --kube-version V FILE...
  chart.py manifests CHART OUTDIR [--check]  (the plain manifests: default values)
  chart.py toml FILE...                     (TOML files as JSON: the containerd drop-ins)

Used by test-containers/tests/integration/k8s_manifests.rs and by `make manifests`.
"""

import argparse
import copy
import json
import os
import sys
import tomllib

import helm_python as helm
import jsonschema
import kubernetes_validate
import kubernetes_validate.utils as kv_utils
import yaml

# The plain manifests: which templates go into which file of runtime-class/manifests/. A
# template that is in neither (other than NOTES.txt) is an error, so none is left out unseen.
MANIFEST_FILES = {
    "runtimeclasses.yaml": ["runtimeclasses.yaml"],
    "node-installer.yaml": ["serviceaccount.yaml", "registry-ca.yaml", "daemonset.yaml"],
    "agent.yaml": ["agent.yaml"],
    "admission.yaml": ["admission.yaml"],
}
MANIFESTS_RELEASE = "gpu-ckpt"
# Custom resources the chart renders, which kubernetes-validate has no schema for: (apiVersion,
# kind) -> a strict JSON schema of the part of them the chart uses (schemas/, from the CRD).
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-v1.json",
}
SCHEMA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schemas")
MANIFESTS_NAMESPACE = "gpu-ckpt-system"


class Failure(Exception):
    pass


def deep_merge(base, over):
    """`over` on top of `base`, as `helm -f a -f b` layers values files: maps merge, the rest
    is replaced."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def user_values(args):
    values = {}
    for path in args.values or []:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
        if not isinstance(doc, dict):
            raise Failure(f"values file {path} is not a map of values")
        values = deep_merge(values, doc)
    if args.set_json:
        try:
            doc = json.loads(args.set_json)
        except json.JSONDecodeError as e:
            raise Failure(f"--set-json is not JSON: {e}")
        if not isinstance(doc, dict):
            raise Failure("--set-json is not a JSON object")
        values = deep_merge(values, doc)
    return values


def schema_version(version):
    """The validator's schema version for `version` (major.minor); it must have that exact one,
    never an older stand-in."""
    want = kv_utils.major_minor(version.lstrip("v"))
    have = [kv_utils.major_minor(v) for v in kv_utils.all_versions()]
    if want not in have:
        raise Failure(
            f"kubernetes-validate {kubernetes_validate.__version__} has no schemas for "
            f"Kubernetes {want} (it has {', '.join(have)})"
        )
    return want


def field_path(path):
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out


def validate_doc(doc, version):
    """One document against the strict schema (unknown fields refused) of `version`."""
    res = {
        "kind": doc.get("kind") if isinstance(doc, dict) else None,
        "name": (doc.get("metadata") or {}).get("name") if isinstance(doc, dict) else None,
        "valid": False,
        "error": None,
        "field": None,
    }
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        res["error"] = "not a Kubernetes object (no apiVersion or kind)"
        return res
    crd = CRD_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    if crd:
        with open(os.path.join(SCHEMA_DIR, crd)) as f:
            schema = json.load(f)
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.absolute_path))
        if errors:
            res["field"] = field_path(errors[0].absolute_path)
            res["error"] = errors[0].message
        else:
            res["valid"] = True
            res["schema_version"] = version
            res["schema"] = crd
        return res
    try:
        res["schema_version"] = kubernetes_validate.validate(doc, version, strict=True)
        res["valid"] = True
    except kv_utils.ValidationError as e:
        res["field"] = field_path(e.absolute_path)
        res["error"] = e.message
    except kv_utils.SchemaNotFoundError as e:
        res["error"] = e.message
    return res


def validate_text(text, version, source):
    out = []
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as e:
        raise Failure(f"{source} is not YAML: {e}")
    for i, doc in enumerate(d for d in docs if d is not None):
        r = validate_doc(doc, version)
        r["source"] = source
        r["index"] = i
        r["object"] = doc
        out.append(r)
    return out


def render(chart_dir, values, release, namespace):
    try:
        with helm.Chart.load(chart_dir) as chart:
            return chart.render(values, name=release, namespace=namespace, is_install=True)
    except helm.HelmError as e:
        raise Failure(f"helm render of {chart_dir} failed: {e}")


def cmd_lint(args):
    opts = {"strict": True}
    if args.kube_version:
        opts["kube_version"] = args.kube_version
    try:
        report = helm.lint(args.chart, user_values(args) or None, **opts)
    except helm.HelmError as e:
        raise Failure(f"helm lint of {args.chart} failed: {e}")
    return {"lint": report, "helm_sdk": helm.helm_sdk_version()}


def cmd_render(args):
    templates = render(args.chart, user_values(args), args.release, args.namespace)
    out = {"templates": templates, "helm_sdk": helm.helm_sdk_version()}
    if args.kube_version:
        version = schema_version(args.kube_version)
        docs = []
        for name in sorted(templates):
            if name.endswith("NOTES.txt"):
                continue
            docs.extend(validate_text(templates[name], version, name))
        out["documents"] = docs
        out["kube_version"] = version
        out["validator"] = kubernetes_validate.__version__
    return out


def cmd_validate(args):
    version = schema_version(args.kube_version)
    docs = []
    for path in args.files:
        with open(path) as f:
            docs.extend(validate_text(f.read(), version, path))
    return {"documents": docs, "kube_version": version, "validator": kubernetes_validate.__version__}


def manifests_text(chart_dir):
    templates = render(chart_dir, {}, MANIFESTS_RELEASE, MANIFESTS_NAMESPACE)
    by_base = {}
    for name, text in templates.items():
        base = name.split("/templates/", 1)[-1]
        if base == "NOTES.txt":
            continue
        by_base[base] = (name, text)
    placed = {t for ts in MANIFEST_FILES.values() for t in ts}
    stray = sorted(set(by_base) - placed)
    if stray:
        raise Failure(
            f"templates {', '.join(stray)} go into no plain manifest: add them to MANIFEST_FILES "
            "in runtime-class/tools/chart.py"
        )
    files = {}
    for fname, bases in MANIFEST_FILES.items():
        out = [
            "# Generated from runtime-class/chart/gpu-ckpt with its default values (release "
            f"{MANIFESTS_RELEASE}, namespace {MANIFESTS_NAMESPACE})",
            "# by `make manifests`; do not edit: the test k8s_manifests.rs fails when this file and",
            "# the chart's rendering differ. Apply: kubectl create namespace "
            f"{MANIFESTS_NAMESPACE}; kubectl apply -f runtime-class/manifests/",
        ]
        for base in bases:
            if base not in by_base:
                raise Failure(f"the chart has no template {base} (MANIFEST_FILES names it)")
            name, text = by_base[base]
            body = text.strip("\n")
            if body.startswith("---"):
                body = body[3:].lstrip("\n")
            for doc in body.split("\n---\n"):
                doc = doc.strip("\n")
                if doc:
                    out.append("---")
                    out.append(f"# Source: {name}")
                    out.append(doc)
        files[fname] = "\n".join(out) + "\n"
    return files


def cmd_manifests(args):
    files = manifests_text(args.chart)
    differ = []
    for fname, text in sorted(files.items()):
        path = os.path.join(args.outdir, fname)
        try:
            with open(path) as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != text:
            differ.append(path)
            if not args.check:
                os.makedirs(args.outdir, exist_ok=True)
                with open(path + ".tmp", "w") as f:
                    f.write(text)
                os.replace(path + ".tmp", path)
    extra = sorted(
        os.path.join(args.outdir, f)
        for f in (os.listdir(args.outdir) if os.path.isdir(args.outdir) else [])
        if f.endswith(".yaml") and f not in files
    )
    if args.check and (differ or extra):
        raise Failure(
            "the plain manifests differ from the chart's rendering with default values: "
            + ", ".join(differ + [f"{e} (not rendered from the chart)" for e in extra])
            + "; run `make manifests`"
        )
    return {"files": sorted(os.path.join(args.outdir, f) for f in files), "changed": differ, "extra": extra}


def cmd_toml(args):
    out = {}
    for path in args.files:
        try:
            with open(path, "rb") as f:
                out[path] = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise Failure(f"{path} is not valid TOML: {e}")
    return {"files": out}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def values_args(sp):
        sp.add_argument("chart")
        sp.add_argument("--values", action="append", help="a values file (repeatable, layered in order)")
        sp.add_argument("--set-json", help="values as a JSON object, on top of the files")
        sp.add_argument("--kube-version", help="e.g. 1.35")

    sp = sub.add_parser("lint")
    values_args(sp)
    sp = sub.add_parser("render")
    values_args(sp)
    sp.add_argument("--release", default=MANIFESTS_RELEASE)
    sp.add_argument("--namespace", default=MANIFESTS_NAMESPACE)
    sp = sub.add_parser("validate")
    sp.add_argument("--kube-version", required=True)
    sp.add_argument("files", nargs="+")
    sp = sub.add_parser("manifests")
    sp.add_argument("chart")
    sp.add_argument("outdir")
    sp.add_argument("--check", action="store_true")
    sp = sub.add_parser("toml")
    sp.add_argument("files", nargs="+")
    args = p.parse_args()

    try:
        out = {"lint": cmd_lint, "render": cmd_render, "validate": cmd_validate, "manifests": cmd_manifests, "toml": cmd_toml}[
            args.cmd
        ](args)
    except (Failure, OSError) as e:
        print(json.dumps({"error": str(e)}))
        print(f"chart.py {args.cmd}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
