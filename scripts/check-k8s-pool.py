#!/usr/bin/env python3
"""Checks the references of a rendered overlay that deploys kvmesh as an InferencePool's
endpoint picker (scripts/validate-k8s.sh runs it on overlays with an InferencePool):

- every HTTPRoute backendRef of kind InferencePool names a pool in the file;
- each pool has a selector (matchLabels) that some workload's pod template carries, 1..8 target
  ports, a known failureMode, and an endpointPickerRef naming a Service in the file with that
  port, whose targetPort (by name or number) a container of a pod the Service selects declares;
- a Role bound to the nodes' ServiceAccount allows get/list/watch on inferencepools
  (inference.networking.k8s.io) and pods.

The schema validators have no schema for these custom resources; this is what stands in.
Usage: check-k8s-pool.py RENDERED.yaml. Exit 0 when every check passes (or, with a message,
when PyYAML is not installed), 1 otherwise.
"""
import sys

try:
    import yaml
except ImportError:  # pragma: no cover - depends on the machine
    print("check-k8s-pool: PyYAML not installed: references not checked (pip install pyyaml)")
    sys.exit(0)


def main(path):
    with open(path, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d.get("kind"), []).append(d)
    errors = []
    pools = {p["metadata"]["name"]: p for p in by_kind.get("InferencePool", [])}
    services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
    templates = [
        w["spec"]["template"]
        for kind in ("Deployment", "StatefulSet", "DaemonSet")
        for w in by_kind.get(kind, [])
    ]

    for route in by_kind.get("HTTPRoute", []):
        for rule in route["spec"].get("rules", []):
            for ref in rule.get("backendRefs", []):
                if ref.get("kind") == "InferencePool":
                    if ref.get("group") != "inference.networking.k8s.io":
                        errors.append(f"HTTPRoute {route['metadata']['name']}: backendRef group {ref.get('group')!r}")
                    if ref.get("name") not in pools:
                        errors.append(f"HTTPRoute {route['metadata']['name']}: no InferencePool {ref.get('name')!r}")

    def labels_match(selector, labels):
        return all(labels.get(k) == v for k, v in selector.items())

    for name, pool in pools.items():
        spec = pool.get("spec", {})
        selector = spec.get("selector", {}).get("matchLabels") or {}
        if not selector:
            errors.append(f"InferencePool {name}: no selector.matchLabels")
        elif not any(labels_match(selector, t["metadata"].get("labels", {})) for t in templates):
            errors.append(f"InferencePool {name}: no pod template carries {selector}")
        ports = spec.get("targetPorts") or []
        if not 1 <= len(ports) <= 8 or not all(1 <= p.get("number", 0) <= 65535 for p in ports):
            errors.append(f"InferencePool {name}: targetPorts {ports}")
        epp = spec.get("endpointPickerRef") or {}
        if epp.get("failureMode", "FailClose") not in ("FailOpen", "FailClose"):
            errors.append(f"InferencePool {name}: failureMode {epp.get('failureMode')!r}")
        if epp.get("kind", "Service") != "Service" or epp.get("group", "") != "":
            errors.append(f"InferencePool {name}: endpointPickerRef is not a core Service")
        svc = services.get(epp.get("name"))
        if svc is None:
            errors.append(f"InferencePool {name}: no Service {epp.get('name')!r}")
            continue
        port = (epp.get("port") or {}).get("number", 9002)
        svc_port = next((p for p in svc["spec"].get("ports", []) if p.get("port") == port), None)
        if svc_port is None:
            errors.append(f"Service {svc['metadata']['name']}: no port {port}")
            continue
        target = svc_port.get("targetPort", port)
        backing = [t for t in templates if labels_match(svc["spec"].get("selector", {}), t["metadata"].get("labels", {}))]
        declared = any(
            (isinstance(target, str) and p.get("name") == target)
            or (isinstance(target, int) and p.get("containerPort") == target)
            for t in backing
            for c in t["spec"].get("containers", [])
            for p in c.get("ports", [])
        )
        if not declared:
            errors.append(f"Service {svc['metadata']['name']}: no selected container declares port {target!r}")

    allowed = set()
    roles = {r["metadata"]["name"]: r for r in by_kind.get("Role", [])}
    for binding in by_kind.get("RoleBinding", []):
        role = roles.get(binding["roleRef"]["name"])
        if role is None:
            continue
        for rule in role.get("rules", []):
            if {"get", "list", "watch"} <= set(rule.get("verbs", [])):
                for group in rule.get("apiGroups", []):
                    for resource in rule.get("resources", []):
                        allowed.add((group, resource))
    for need in (("inference.networking.k8s.io", "inferencepools"), ("", "pods")):
        if need not in allowed:
            errors.append(f"RBAC: no bound Role allows get/list/watch on {need[1]} ({need[0] or 'core'})")

    for e in errors:
        print(f"check-k8s-pool: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
