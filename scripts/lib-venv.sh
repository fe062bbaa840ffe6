# Sourced by the scripts that need Python packages: venv_ready DIR REQUIREMENTS
# makes DIR a virtualenv holding exactly the pinned REQUIREMENTS (pip -r), and
# does nothing when it already does (a stamp of the requirements' digest).
# Installs python3 and python3-venv from Debian when they are missing. $PYTHON
# chooses the interpreter the virtualenv is made from (default python3).
# Returns non-zero, writing no stamp, when any step fails: each is checked
# here, since a caller's `venv_ready ... || { ...; }` turns set -e off
# inside (a failed pip install was once stamped as ready).
venv_ready() {
  local dir=$1 req=$2 want py=${PYTHON:-python3}
  want=$(sha256sum <"$req") || return 1
  want=${want%% *}
  if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.requirements.sha256" 2>/dev/null)" = "$want" ]; then
    return 0
  fi
  if ! command -v "$py" >/dev/null 2>&1; then
    echo "venv: installing python3 from Debian" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv >/dev/null ||
      return 1
    py=python3
  fi
  rm -rf "$dir"
  mkdir -p "$(dirname "$dir")" || return 1
  if ! "$py" -m venv "$dir" >/dev/null 2>&1; then
    # Debian's python3 makes virtualenvs only with python3-venv (ensurepip).
    echo "venv: installing python3-venv from Debian" >&2
    rm -rf "$dir"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null &&
      "$py" -m venv "$dir" || return 1
  fi
  echo "venv: pip install -r ${req#"$PWD"/} into $dir" >&2
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2 || {
    echo "venv: pip install -r $req failed" >&2
    return 1
  }
  echo "$want" >"$dir/.requirements.sha256"
}
