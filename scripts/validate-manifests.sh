#!/usr/bin/env bash
# Render and validate rcp's Kubernetes manifests (deploy/).
#
#   scripts/validate-manifests.sh               validate, then self-test the checks
#   scripts/validate-manifests.sh --self-test   only prove that broken copies fail
#   scripts/validate-manifests.sh --no-self-test
#   scripts/validate-manifests.sh --out DIR     keep the rendered manifests in DIR
#
# Installs what it needs (idempotent): the PyPI packages kubernetes-validate
# (pinned; brings jsonschema) and PyYAML. Rendering uses `kubectl kustomize`
# or `kustomize build` when present, and deploy/tools/minikustomize.py (a
# small renderer for the kustomize features deploy/ uses) otherwise; with an
# external renderer the two must agree, so the fallback stays correct.
# RCP_RENDERER=python forces the fallback; RCP_K8S_VERSIONS="1.31.0 1.37.0"
# sets the Kubernetes versions whose schemas are checked.
#
# Prints PASS/FAIL per check and ends with the line "N passed, M failed";
# exits non-zero if anything failed.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
KV_VERSION=1.37.0

py=${PYTHON:-}
if [[ -z "$py" ]]; then
  for c in python3 python; do
    if command -v "$c" >/dev/null 2>&1; then py=$c; break; fi
  done
fi
if [[ -z "$py" ]]; then
  echo "validate-manifests: installing python3" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-pip >/dev/null
  py=python3
fi

have_deps() {
  "$py" - "$KV_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
import yaml, jsonschema, kubernetes_validate  # noqa: F401
sys.exit(0 if version("kubernetes-validate") == sys.argv[1] else 1)
PY
}
if ! have_deps; then
  echo "validate-manifests: installing kubernetes-validate==$KV_VERSION and PyYAML from PyPI" >&2
  "$py" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    "kubernetes-validate==$KV_VERSION" PyYAML >&2 \
  || "$py" -m pip install --quiet --disable-pip-version-check --break-system-packages \
    "kubernetes-validate==$KV_VERSION" PyYAML >&2
  have_deps || { echo "validate-manifests: dependencies still missing"; echo "0 passed, 1 failed"; exit 1; }
fi

export PYTHONDONTWRITEBYTECODE=1
exec "$py" "$here/deploy/tools/validate_manifests.py" --deploy-dir "$here/deploy" "$@"
