#!/usr/bin/env bash
# The soft-RoCE suite: builds the tests, boots the VM once per topology (lo, netns,
# rails) and runs every `#[ignore]`d RDMA test (test targets named *fabric or *_verbs;
# *netns_fabric in netns, *rails_fabric in rails) plus the two-process examples
# there. A VM that cannot boot or an rxe device that cannot be created is a failure,
# never a skip. Prints how long each part took ("== vm NAME took N s":
# the build, each topology's boot + run) and a summary at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
t_all=$SECONDS
times=()
took() { # took NAME T0: record and print the time since T0
  local d=$((SECONDS - $2))
  echo "== vm $1 took $d s"
  times+=("$(printf '%5d s  %s' "$d" "$1")")
}
t=$SECONDS
bash scripts/testbed.sh install
# fault-injection: as the native tests (scripts/test-all.sh), for the
# verbs test that damages pulled blocks.
feat=(--features rcp/fault-injection)
cargo build --workspace --examples --bins "${feat[@]}"
# The test binaries: built once, cargo's exit status checked (a build error
# fails here, its diagnostics on stderr), then picked from its JSON.
json=target/vm-test-bins.json
mkdir -p target
if ! cargo test --workspace "${feat[@]}" --no-run --message-format=json-render-diagnostics >"$json"; then
  echo "vm-tests: building the test binaries failed" >&2
  exit 1
fi
test_bins() { # test_bins SUFFIXES: "name=path" of the test targets ending so
  python3 scripts/lib-test-bins.py "$1" <"$json" | awk '{print $1"="$2}'
}
mapfile -t lo_bins < <(test_bins fabric,_verbs | grep -Ev '^[^=]*(netns|rails)_fabric=')
mapfile -t ns_bins < <(test_bins netns_fabric,control_verbs)
mapfile -t rails_bins < <(test_bins rails_fabric)
# Each topology's binaries, by name: one that is missing (renamed, its
# target gone) fails here rather than leaving its tests unrun.
# require TOPOLOGY "name=path"... -- NAME...
require() {
  local topo=$1 have=() n missing=()
  shift
  while [ "$1" != -- ]; do have+=("${1%%=*}"); shift; done
  shift
  for n in "$@"; do
    [[ " ${have[*]} " == *" $n "* ]] || missing+=("$n")
  done
  if [ ${#missing[@]} -gt 0 ] || [ ${#have[@]} -eq 0 ]; then
    echo "vm-tests: topology $topo: test binaries missing: ${missing[*]:-all} (found: ${have[*]:-none})" >&2
    exit 1
  fi
  echo "vm-tests: topology $topo runs ${have[*]}"
}
require lo "${lo_bins[@]}" -- fabric datapath_fabric control_verbs memory_window_verbs session_pd_verbs
require netns "${ns_bins[@]}" -- events_netns_fabric control_verbs
require rails "${rails_bins[@]}" -- rails_fabric control_rails_fabric
# The binaries the guest runs again and again, without their debug info
# (symbols stay): the guest copies them to its tmpfs over 9p at ~8 MB/s
# (scripts/vm/suite.sh), and DWARF is 80% of a debug build's 450 MB.
vmbin=target/vm-bin
rm -rf "$vmbin" && mkdir -p "$vmbin/examples"
for b in rcp rcpd examples/verbs_blocks; do objcopy --strip-debug "target/debug/$b" "$vmbin/$b"; done
took "install + build (examples, bins, test binaries)" "$t"
rc=0
t=$SECONDS
bash scripts/testbed.sh run lo -- bash scripts/vm/suite.sh lo "${lo_bins[@]}" || rc=1
took "topology lo (boot + suite)" "$t"
t=$SECONDS
bash scripts/testbed.sh run netns -- bash scripts/vm/suite.sh netns "${ns_bins[@]}" || rc=1
took "topology netns (boot + suite)" "$t"
t=$SECONDS
bash scripts/testbed.sh run rails -- bash scripts/vm/suite.sh rails "${rails_bins[@]}" || rc=1
took "topology rails (boot + suite)" "$t"
echo "== vm times:"
for x in "${times[@]}"; do echo "==   $x"; done
echo "== vm total took $((SECONDS - t_all)) s"
exit $rc
