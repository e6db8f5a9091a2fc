#!/usr/bin/env bash
# Renders the Kubernetes manifests of the example overlays and validates them offline:
#   scripts/validate-k8s.sh [OVERLAY...]         (default: eu us picker)
# The overlays: the two example regions, and `picker` (kvmesh as an InferencePool's endpoint
# picker, with a Gateway and an HTTPRoute).
# 1. `kubectl kustomize deploy/k8s/overlays/<overlay>` (needs kubectl; its built-in kustomize).
# 2. Where `kubernetes-validate` is installed (pip install kubernetes-validate), the rendered
#    objects are checked against the Kubernetes OpenAPI schemas it ships, in strict mode (unknown
#    fields are errors, so a misspelt key fails). Version: KUBERNETES_VERSION if set, else the
#    newest the tool knows. Kinds it has no schema for — custom resources: the ServiceMonitor
#    (Prometheus Operator), and in `picker` the Gateway and HTTPRoute (Gateway API) and the
#    InferencePool (Inference Extension) — are only rendered, not validated: the tool prints a
#    WARN for them and passes (it has no option to load CRD schemas). Step 3 checks the
#    references between them instead. Without the tool this step is skipped with a message.
# 3. For an overlay with an InferencePool: the HTTPRoute's backendRef names the pool, the pool's
#    endpointPickerRef names a Service with that port, whose targetPort a container declares,
#    and the Role lets the nodes get/list/watch inferencepools and pods.
# Exits non-zero if a render or a validation fails. Needs no cluster and no network.
set -euo pipefail
cd "$(dirname "$0")/.."

regions=("$@")
[ ${#regions[@]} -gt 0 ] || regions=(eu us picker)

if ! command -v kubectl >/dev/null 2>&1; then
  echo "validate-k8s: kubectl is not installed (needed for kubectl kustomize)" >&2
  exit 2
fi
validate=()
if command -v kubernetes-validate >/dev/null 2>&1; then
  validate=(kubernetes-validate --strict --quiet)
  [ -z "${KUBERNETES_VERSION:-}" ] || validate+=(-k "$KUBERNETES_VERSION")
  version=${KUBERNETES_VERSION:-"its newest"}
  echo "validate-k8s: kubernetes-validate $(kubernetes-validate --version 2>&1 | head -n1)," \
    "strict, Kubernetes version: $version"
else
  echo "validate-k8s: kubernetes-validate not installed: rendering only (pip install kubernetes-validate)"
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
status=0
for region in "${regions[@]}"; do
  file="$out/$region.yaml"
  if ! kubectl kustomize "deploy/k8s/overlays/$region" >"$file"; then
    echo "validate-k8s: $region: kubectl kustomize failed" >&2
    status=1
    continue
  fi
  count=$(grep -c '^kind: ' "$file")
  kinds=$(grep '^kind: ' "$file" | cut -d' ' -f2 | sort | uniq -c | awk '{print $2 " x" $1}' | paste -sd, -)
  echo "validate-k8s: $region: rendered $count objects: $kinds"
  if grep -q '^kind: InferencePool$' "$file"; then
    if python3 "scripts/check-k8s-pool.py" "$file"; then
      echo "validate-k8s: $region: pool references check passed"
    else
      echo "validate-k8s: $region: pool references check FAILED" >&2
      status=1
    fi
  fi
  if [ ${#validate[@]} -gt 0 ]; then
    if "${validate[@]}" "$file"; then
      echo "validate-k8s: $region: schema validation passed"
    else
      echo "validate-k8s: $region: schema validation FAILED" >&2
      status=1
    fi
  fi
done
exit "$status"
