"""Offline validation of deploy/'s Kubernetes manifests (run by `cargo xtask validate-manifests`).

usage: validate_manifests.py KUBERNETES_VERSION ROOT

- Core resources: kubernetes-validate's bundled JSON schemas for KUBERNETES_VERSION, strict
  (unknown fields are errors). A kind without a bundled schema is an error, not a warning.
- The Prometheus Operator's CRDs (ServiceMonitor, PrometheusRule), which those schemas do
  not include: the fields this project uses, checked by hand below.
- Cross-checks against the agent's source: every vramguard_* metric a manifest names is
  registered in agent/src/serve/ (or a room's metrics.rs), and every `vramguard run` flag the DaemonSet passes is
  declared in agent/src/run.rs or in an argument struct under agent/src/provision/ or
  agent/src/dra/ that `RunArgs` flattens; every `vramguard webhook` flag the webhook's
  Deployment passes is declared in agent/src/webhook/mod.rs.
- YAML itself: every document parses, and no mapping repeats a key.
- DRA (`deploy/dra/`, `deploy/examples/dra-*`): resource.k8s.io/v1 exists from Kubernetes
  1.34, so those files are validated against DRA_VERSION; `deploy/dra/patch/daemonset.json`
  (the JSON patch that turns DRA on) is applied to deploy/kubernetes/daemonset.yaml and the
  result validated as a manifest (schema, flags).

Every *.yaml/*.yml under deploy/ is a manifest except deploy/monitoring/'s (promtool's unit
tests of the alert rules, which promtool itself checks).

Prints one line per error (`FILE: KIND/NAME: where: what`) and exits 1 if there was any.
"""
import pathlib
import re
import sys

import yaml
from kubernetes_validate import utils as kv

NAMESPACE = "vramguard-system"
# The first Kubernetes version with resource.k8s.io/v1 (DRA GA, consumable capacity alpha).
DRA_VERSION = "1.34"
DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
ENDPOINT_KEYS = {"port", "targetPort", "path", "interval", "scrapeTimeout", "honorLabels", "scheme",
                 "relabelings", "metricRelabelings", "tlsConfig", "authorization", "params"}
ALERT_KEYS = {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
RECORD_KEYS = {"record", "expr", "labels"}


class UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that rejects a mapping with the same key twice (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def string_map(value):
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def check_service_monitor(doc):
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return ["spec: missing"]
    errors = []
    if not isinstance(spec.get("selector"), dict):
        errors.append("spec.selector: missing (a label selector)")
    endpoints = spec.get("endpoints")
    if not isinstance(endpoints, list) or not endpoints:
        return errors + ["spec.endpoints: must be a non-empty list"]
    for i, endpoint in enumerate(endpoints):
        where = f"spec.endpoints.{i}"
        if not isinstance(endpoint, dict):
            errors.append(f"{where}: not a mapping")
            continue
        for key in sorted(set(endpoint) - ENDPOINT_KEYS):
            errors.append(f"{where}.{key}: unknown field")
        if "port" not in endpoint and "targetPort" not in endpoint:
            errors.append(f"{where}: needs port or targetPort")
        for key in ("interval", "scrapeTimeout"):
            if key in endpoint and not DURATION.match(str(endpoint[key])):
                errors.append(f"{where}.{key}: not a duration")
    return errors


def check_prometheus_rule(doc):
    groups = (doc.get("spec") or {}).get("groups")
    if not isinstance(groups, list) or not groups:
        return ["spec.groups: must be a non-empty list"]
    errors, names = [], set()
    for i, group in enumerate(groups):
        where = f"spec.groups.{i}"
        if not isinstance(group, dict) or not isinstance(group.get("name"), str):
            errors.append(f"{where}.name: missing")
            continue
        if group["name"] in names:
            errors.append(f"{where}.name: {group['name']!r} used twice")
        names.add(group["name"])
        rules = group.get("rules")
        if not isinstance(rules, list) or not rules:
            errors.append(f"{where}.rules: must be a non-empty list")
            continue
        for j, rule in enumerate(rules):
            at = f"{where}.rules.{j}"
            if not isinstance(rule, dict):
                errors.append(f"{at}: not a mapping")
                continue
            if ("alert" in rule) == ("record" in rule):
                errors.append(f"{at}: needs exactly one of alert and record")
                continue
            for key in sorted(set(rule) - (ALERT_KEYS if "alert" in rule else RECORD_KEYS)):
                errors.append(f"{at}.{key}: unknown field")
            if not isinstance(rule.get("expr"), str) or not rule["expr"].strip():
                errors.append(f"{at}.expr: missing")
            for key in ("for", "keep_firing_for"):
                if key in rule and not DURATION.match(str(rule[key])):
                    errors.append(f"{at}.{key}: not a duration")
            for key in ("labels", "annotations"):
                if key in rule and not string_map(rule[key]):
                    errors.append(f"{at}.{key}: must map strings to strings")
    return errors


CRDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): check_service_monitor,
    ("monitoring.coreos.com/v1", "PrometheusRule"): check_prometheus_rule,
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                  "ValidatingAdmissionPolicyBinding", "MutatingWebhookConfiguration"}


def check_agent_names(doc, metrics_source, run_source):
    """Metric names and agent flags a manifest uses must exist in the agent's source."""
    errors = []
    text = yaml.safe_dump(doc)
    registered = set(re.findall(r'"(vramguard_[a-z_]+)"', metrics_source))
    for name in sorted(set(re.findall(r"\bvramguard_[a-z_]+", text))):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if name not in registered and base not in registered:
            errors.append(f"metric {name}: not registered in agent/src/serve/ or a metrics.rs of the agent")
    if doc.get("kind") in ("DaemonSet", "Deployment"):
        for container in doc["spec"]["template"]["spec"].get("containers", []):
            args = container.get("args") or []
            if not args or args[0] not in run_source:
                continue
            source, where = run_source[args[0]]
            for arg in args[1:]:
                flag = re.match(r"^--([a-z][a-z0-9-]*)", arg)
                if flag and not re.search(rf"\bpub {flag.group(1).replace('-', '_')}:", source):
                    errors.append(f"container {container['name']}: flag --{flag.group(1)}: not declared in {where}")
    return errors


def check_document(doc, path, version, metrics_source, run_source):
    if not isinstance(doc, dict):
        return ["document: not a mapping"]
    missing = [key for key in ("apiVersion", "kind") if not isinstance(doc.get(key), str)]
    if missing or not isinstance((doc.get("metadata") or {}).get("name"), str):
        return [f"document: needs apiVersion, kind and metadata.name"]
    errors = []
    crd = CRDS.get((doc["apiVersion"], doc["kind"]))
    if crd:
        errors += crd(doc)
    else:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as error:
            errors.append(f"{'.'.join(str(p) for p in error.path) or '(top)'}: {error.message}")
        except kv.SchemaNotFoundError as error:
            errors.append(error.message)
    # deploy/kubernetes/ and its subdirectories (dra/: applied on its own, with DRA).
    if "kubernetes" in (path.parent.name, path.parent.parent.name) and doc["kind"] not in CLUSTER_SCOPED:
        if doc["metadata"].get("namespace") != NAMESPACE:
            errors.append(f"metadata.namespace: must be {NAMESPACE}")
    return errors + check_agent_names(doc, metrics_source, run_source)


def is_dra(path):
    return path.parent.name == "dra" or path.name.startswith("dra-")


def apply_json_patch(doc, ops):
    """RFC 6902's add, remove and replace (what the shipped patch uses) on a copy of `doc`."""
    import copy
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        if op["op"] == "add" and isinstance(parent, list):
            parent.insert(len(parent) if last == "-" else int(last), op["value"])
        elif op["op"] in ("add", "replace"):
            parent[int(last) if isinstance(parent, list) else last] = op["value"]
        elif op["op"] == "remove":
            del parent[int(last) if isinstance(parent, list) else last]
        else:
            raise ValueError(f"op {op['op']!r} is not supported here")
    return doc


def check_patch(root, metrics_source, run_source):
    """deploy/dra/patch/daemonset.json applied to the DaemonSet: (resources checked, errors)."""
    import json
    patch = root / "deploy/dra/patch/daemonset.json"
    if not patch.exists():
        return 0, []
    base = root / "deploy/kubernetes/daemonset.yaml"
    name = patch.relative_to(root)
    try:
        docs = [d for d in yaml.load_all(base.read_text(), Loader=UniqueKeyLoader) if d is not None]
        patched = apply_json_patch(docs[0], json.loads(patch.read_text()))
    except (ValueError, KeyError, IndexError, TypeError, yaml.YAMLError) as error:
        return 1, [f"{name}: does not apply to {base.relative_to(root)}: {error}"]
    errors = check_document(patched, base, DRA_VERSION, metrics_source, run_source)
    return 1, [f"{name}: DaemonSet/{patched['metadata']['name']} patched: {e}" for e in errors]


def main():
    version, root = sys.argv[1], pathlib.Path(sys.argv[2])
    # The families the agent serves: the metrics page's, the tasks' liveness added at each
    # scrape (serve/health.rs), and the rooms' own (their metrics.rs).
    metrics_source = "\n".join(p.read_text() for p in sorted({*(root / "agent/src/serve").glob("*.rs"),
                                                             *(root / "agent/src").rglob("metrics.rs")}))
    # `vramguard run`'s flags: RunArgs, and the argument structs it flattens.
    run_source = "\n".join(p.read_text() for p in [root / "agent/src/run.rs",
                                                   *sorted((root / "agent/src/provision").rglob("*.rs")),
                                                   *sorted((root / "agent/src/dra").rglob("*.rs"))])
    # Each subcommand a manifest runs: the source its flags are declared in.
    run_source = {"run": (run_source, "agent/src/run.rs, agent/src/provision/ or agent/src/dra/"),
                  "webhook": ((root / "agent/src/webhook/mod.rs").read_text(), "agent/src/webhook/mod.rs")}
    # deploy/monitoring/ holds promtool's unit tests of the alert rules, not Kubernetes
    # resources: promtool checks them (tests/e2e/tests/prometheus_rules.rs).
    monitoring = root / "deploy/monitoring"
    files = sorted(p for p in (root / "deploy").rglob("*")
                   if p.suffix in (".yaml", ".yml") and monitoring not in p.parents)
    if not files:
        print("no manifests under deploy/")
        return 1
    failures = checked = 0
    for path in files:
        name = path.relative_to(root)
        try:
            docs = [d for d in yaml.load_all(path.read_text(), Loader=UniqueKeyLoader) if d is not None]
        except yaml.YAMLError as error:
            print(f"{name}: not valid YAML: {error}")
            failures += 1
            continue
        for doc in docs:
            checked += 1
            label = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}" if isinstance(doc, dict) else "?"
            for error in check_document(doc, path, DRA_VERSION if is_dra(path) else version, metrics_source, run_source):
                print(f"{name}: {label}: {error}")
                failures += 1
    patched, errors = check_patch(root, metrics_source, run_source)
    checked += patched
    failures += len(errors)
    for error in errors:
        print(error)
    print(f"validate-manifests: {checked} resources in {len(files)} files against Kubernetes {version} "
          f"(strict) and the agent's metrics and flags: {failures} error(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
