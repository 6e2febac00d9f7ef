"""The agent's ResourceSlice admission policy, evaluated (run by `cargo xtask validate-manifests`
and so by `cargo xtask test`).

usage: slice_policy_cel.py ROOT [POLICY_FILE]

Loads the ValidatingAdmissionPolicy in deploy/dra/slice-policy.yaml (or POLICY_FILE) and
evaluates its own CEL expressions, as written there, with a CEL interpreter (cel-python,
module `celpy`) over admission requests shaped as the API server gives them to a policy:
`request` (operation, userInfo with username and, when the token has any, extra),
`object` (null on a DELETE), `oldObject` (null on a CREATE) and `variables`, each variable
evaluated in the policy's order and seen by the ones after it. Then, as the API server
decides: a false match condition and the policy does not apply; otherwise every validation
must be true, a false one denies with its message, and an error denies too (failurePolicy
Fail), which a case counts as a failure (the policy should deny by its rules, not by an error).

Each case below says what must happen: allowed, not applicable, or denied by exactly the
rules it names (a word from each rule's message). The policy may use only what this script
evaluates (matchConditions, variables, validations with expression and message): anything
else is an error here, not something skipped.

celpy is standard CEL; the policy uses only standard CEL (has(), `in` on a map, size(),
exists(), all(), the conditional), none of Kubernetes' CEL libraries. Not the API server's
type checker: a type error Kubernetes would reject at creation shows here only if a case
reaches it.

Prints one line per case and exits 1 if any failed.
"""
import copy
import pathlib
import sys

import celpy
import yaml

AGENT = "system:serviceaccount:vramguard-system:vramguard-agent"
NODE_NAME = "authentication.kubernetes.io/node-name"
DRIVER = "gpu.vramguard.io"
POLICY_KEYS = {"failurePolicy", "matchConstraints", "matchConditions", "variables", "validations"}
VALIDATION_KEYS = {"expression", "message"}


def slice_of(node, pool=None, driver=DRIVER, owners=None, **spec):
    """A ResourceSlice as the agent writes it (pool named after the node) unless told otherwise."""
    body = {"driver": driver, "pool": {"name": node if pool is None else pool, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", "allowMultipleAllocations": True,
                         "capacity": {"memory": {"value": "80Gi"}}}]}
    if not spec:
        body["nodeName"] = node
    body.update(spec)
    metadata = {"name": f"{node}-{DRIVER}-0", "uid": "5b7e6a52-0000-4000-8000-000000000001"}
    if owners is not None:
        metadata["ownerReferences"] = owners
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": metadata, "spec": body}


def owner(name, kind="Node", api_version="v1"):
    return {"apiVersion": api_version, "kind": kind, "name": name, "uid": "0d6c1f7e-0000-4000-8000-00000000000a"}


def token(node):
    """A bound service-account token's extra: the node it was issued on."""
    return {NODE_NAME: [node], "authentication.kubernetes.io/pod-name": ["vramguard-agent-x7k2p"]}


def with_pool(slice_, name):
    changed = copy.deepcopy(slice_)
    changed["spec"]["pool"]["name"] = name
    return changed


# (name, operation, username, extra (None: the field absent), object, oldObject, expected)
# expected: "allowed", "not applicable", or the set of rules that deny (words of their messages).
CASES = [
    ("own slice, created", "CREATE", AGENT, token("node-a"), slice_of("node-a"), None, "allowed"),
    ("own slice, updated", "UPDATE", AGENT, token("node-a"), slice_of("node-a"), slice_of("node-a"), "allowed"),
    ("own slice, deleted", "DELETE", AGENT, token("node-a"), None, slice_of("node-a"), "allowed"),
    ("own slice owned by its Node", "CREATE", AGENT, token("node-a"),
     slice_of("node-a", owners=[owner("node-a")]), None, "allowed"),
    ("own slice owned by its Node, updated", "UPDATE", AGENT, token("node-a"),
     slice_of("node-a", owners=[owner("node-a")]), slice_of("node-a", owners=[owner("node-a")]), "allowed"),
    ("another node's slice", "CREATE", AGENT, token("node-a"), slice_of("node-b"), None, {"own node", "pool"}),
    ("another node's nodeName, own pool", "CREATE", AGENT, token("node-a"),
     slice_of("node-b", pool="node-a"), None, {"own node"}),
    ("own nodeName, another node's pool", "CREATE", AGENT, token("node-a"),
     slice_of("node-a", pool="node-b"), None, {"pool"}),
    ("own slice updated into another node's pool", "UPDATE", AGENT, token("node-a"),
     with_pool(slice_of("node-a"), "node-b"), slice_of("node-a"), {"pool"}),
    ("another driver", "CREATE", AGENT, token("node-a"), slice_of("node-a", driver="gpu.example.com"), None,
     {"driver"}),
    ("nodeSelector instead of nodeName", "CREATE", AGENT, token("node-a"),
     slice_of("node-a", nodeSelector={"nodeSelectorTerms": [{"matchFields": [
         {"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}]}), None, {"own node"}),
    ("allNodes instead of nodeName", "CREATE", AGENT, token("node-a"), slice_of("node-a", allNodes=True), None,
     {"own node"}),
    ("perDeviceNodeSelection instead of nodeName", "CREATE", AGENT, token("node-a"),
     slice_of("node-a", perDeviceNodeSelection=True), None, {"own node"}),
    ("no node-name in the token's extra", "CREATE", AGENT, {"authentication.kubernetes.io/pod-name": ["p"]},
     slice_of("node-a"), None, {"names no node", "own node", "pool"}),
    ("a token without extra", "CREATE", AGENT, None, slice_of("node-a"), None,
     {"names no node", "own node", "pool"}),
    ("two node names in the token", "CREATE", AGENT, {NODE_NAME: ["node-b", "node-a"]}, slice_of("node-a"), None,
     {"names no node", "own node", "pool"}),
    ("another node's slice, deleted (judged on oldObject)", "DELETE", AGENT, token("node-a"), None,
     slice_of("node-b"), {"own node", "pool"}),
    ("another driver's slice on the node, deleted", "DELETE", AGENT, token("node-a"), None,
     slice_of("node-a", driver="gpu.example.com"), {"driver"}),
    ("owned by another node's Node", "CREATE", AGENT, token("node-a"),
     slice_of("node-a", owners=[owner("node-b")]), None, {"ownerReferences"}),
    ("owned by a Pod named as the node", "CREATE", AGENT, token("node-a"),
     slice_of("node-a", owners=[owner("node-a", kind="Pod")]), None, {"ownerReferences"}),
    ("owned by its Node and another object", "UPDATE", AGENT, token("node-a"),
     slice_of("node-a", owners=[owner("node-a"), owner("cm", kind="ConfigMap")]), slice_of("node-a"),
     {"ownerReferences"}),
    ("own slice with other owners, deleted", "DELETE", AGENT, token("node-a"), None,
     slice_of("node-a", owners=[owner("cm", kind="ConfigMap")]), "allowed"),
    ("the kubelet of another node", "CREATE", "system:node:node-b", {}, slice_of("node-a", pool="node-b"), None,
     "not applicable"),
    ("a cluster admin", "DELETE", "kubernetes-admin", None, None, slice_of("node-b"), "not applicable"),
    ("an agent-named service account of another namespace", "CREATE",
     "system:serviceaccount:default:vramguard-agent", token("node-a"), slice_of("node-b"), None, "not applicable"),
]


def reason(error):
    """A CELEvalError's first argument (its message), without the wrapped errors' repr."""
    return str(error.args[0]) if error.args else str(error)


class Policy:
    def __init__(self, doc):
        spec = doc["spec"]
        unknown = set(spec) - POLICY_KEYS
        if unknown:
            raise ValueError(f"spec.{sorted(unknown)[0]}: not evaluated by this script")
        if spec.get("failurePolicy") != "Fail":
            raise ValueError("spec.failurePolicy: the cases assume Fail (an error denies)")
        rules = (spec.get("matchConstraints") or {}).get("resourceRules") or []
        for operation in ("CREATE", "UPDATE", "DELETE"):
            if not any("resource.k8s.io" in r.get("apiGroups", []) and "resourceslices" in r.get("resources", [])
                       and operation in r.get("operations", []) for r in rules):
                raise ValueError(f"spec.matchConstraints: resourceslices' {operation} is not matched")
        env = celpy.Environment()

        def compile_(where, expression):
            try:
                return env.program(env.compile(expression))
            except celpy.CELParseError as error:
                raise ValueError(f"{where}: does not parse: {error}") from None

        self.conditions = [(f"matchConditions.{c['name']}", compile_(f"matchConditions.{c['name']}", c["expression"]))
                           for c in spec.get("matchConditions") or []]
        self.variables = [(v["name"], compile_(f"variables.{v['name']}", v["expression"]))
                          for v in spec.get("variables") or []]
        self.validations = []
        for i, v in enumerate(spec.get("validations") or []):
            unknown = set(v) - VALIDATION_KEYS
            if unknown:
                raise ValueError(f"validations.{i}.{sorted(unknown)[0]}: not evaluated by this script")
            self.validations.append((v.get("message") or v["expression"], compile_(f"validations.{i}", v["expression"])))
        if not self.validations:
            raise ValueError("spec.validations: none")

    def admit(self, request, object_, old_object):
        """("not applicable" | "allowed" | "denied", [messages of false rules], [errors])."""
        activation = {"request": celpy.json_to_cel(request), "object": celpy.json_to_cel(object_),
                      "oldObject": celpy.json_to_cel(old_object)}
        # A false condition: the policy does not apply, whatever the others gave.
        unmatched, errors = decide(self.conditions, activation)
        if unmatched:
            return "not applicable", [], []
        if errors:
            return "denied", [], errors
        # Each variable sees the ones before it.
        activation["variables"] = celpy.celtypes.MapType()
        for name, program in self.variables:
            try:
                value = program.evaluate(activation)
            except celpy.CELEvalError as error:
                return "denied", [], [f"variables.{name}: {reason(error)}"]
            activation["variables"] = celpy.celtypes.MapType({**activation["variables"], celpy.celtypes.StringType(name): value})
        denied, errors = decide(self.validations, activation)
        return ("denied" if denied or errors else "allowed"), denied, errors


def decide(programs, activation):
    """The labels of the (label, program) pairs that evaluate to false, and the errors."""
    false, errors = [], []
    for label, program in programs:
        try:
            value = program.evaluate(activation)
        except celpy.CELEvalError as error:
            errors.append(f"{label}: {reason(error)}")
            continue
        if not isinstance(value, celpy.celtypes.BoolType):
            errors.append(f"{label}: not a bool: {value!r}")
        elif not value:
            false.append(label)
    return false, errors


def request_of(operation, username, extra, object_, old_object):
    user = {"username": username, "uid": "9a1f-0000", "groups": ["system:serviceaccounts", "system:authenticated"]}
    if extra is not None:
        user["extra"] = extra
    slice_ = object_ or old_object
    return {"uid": "3e0c-0000", "kind": {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceSlice"},
            "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceslices"},
            "name": slice_["metadata"]["name"], "operation": operation, "userInfo": user, "dryRun": False}


def check(policy, case):
    """The case's failure, or None."""
    name, operation, username, extra, object_, old_object, expected = case
    outcome, denied, errors = policy.admit(request_of(operation, username, extra, object_, old_object),
                                           object_, old_object)
    if errors:
        return f"evaluation errors (the API server would deny): {'; '.join(errors)}"
    if isinstance(expected, str):
        if outcome != expected:
            return f"expected {expected}, got {outcome}" + (f": {'; '.join(denied)}" if denied else "")
        return None
    if outcome != "denied":
        return f"expected denied by the rules about {', '.join(sorted(expected))}, got {outcome}"
    unexpected = [m for m in denied if not any(word in m for word in expected)]
    missing = [word for word in sorted(expected) if not any(word in m for m in denied)]
    if unexpected or missing:
        return (f"denied by {'; '.join(denied)}; expected the rules about {', '.join(sorted(expected))}"
                + (f" (no false rule mentions {', '.join(missing)})" if missing else ""))
    return None


def main():
    root = pathlib.Path(sys.argv[1])
    path = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else root / "deploy/dra/slice-policy.yaml"
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    policies = [d for d in docs if d.get("kind") == "ValidatingAdmissionPolicy"]
    if len(policies) != 1:
        print(f"{path}: expected one ValidatingAdmissionPolicy, found {len(policies)}")
        return 1
    bindings = [d for d in docs if d.get("kind") == "ValidatingAdmissionPolicyBinding"
                and d["spec"].get("policyName") == policies[0]["metadata"]["name"]]
    if not bindings or "Deny" not in bindings[0]["spec"].get("validationActions", []):
        print(f"{path}: no binding of the policy with validationActions Deny")
        return 1
    try:
        policy = Policy(policies[0])
    except (ValueError, KeyError) as error:
        print(f"{path}: {error}")
        return 1
    failures = 0
    for case in CASES:
        failure = check(policy, case)
        print(f"slice-policy: {case[0]} ({case[1]}) ... {'FAILED: ' + failure if failure else 'ok'}")
        failures += failure is not None
    print(f"slice-policy: {len(CASES)} admission requests evaluated over {path.name}'s CEL "
          f"(cel-python): {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
