#!/usr/bin/env bash
# Build the rcp container image (Containerfile) without access to a container
# registry, then smoke-test it: rcpd from the image over the TCP provider,
# rcp push/pull/doctor from the image, the health and metrics ports.
#
# By hand, as root on Debian 12 (bookworm); not part of CI. Needs the Debian
# mirror and crates.io, and a rustup-managed Rust toolchain on the host (its
# active toolchain is copied into the local build image). Idempotent: the
# base and Rust images are reused when present (REBUILD_BASE=1 remakes them).
#
#   scripts/build-image.sh              # build localhost/rcp:dev + smoke test
#   SKIP_BUILD=1 scripts/build-image.sh # smoke-test the existing image
#
# Environment: IMAGE (localhost/rcp:dev), WORKDIR (/var/tmp/rcp-image),
# DEBIAN_MIRROR (http://deb.debian.org/debian), SMOKE_PORT (17471; +1 health,
# +2000 metrics), SMOKE_MIB (4).
set -euo pipefail

IMAGE=${IMAGE:-localhost/rcp:dev}
WORKDIR=${WORKDIR:-/var/tmp/rcp-image}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
BASE_IMAGE=localhost/rcp-base:$SUITE
PORT=${SMOKE_PORT:-17471}
HEALTH_PORT=$((PORT + 1))
METRICS_PORT=$((PORT + 2000))
SMOKE_MIB=${SMOKE_MIB:-4}
REPO=$(cd "$(dirname "$0")/.." && pwd)

say() { printf '== %s\n' "$*"; }
die() { printf 'build-image: %s\n' "$*" >&2; exit 1; }
PASSED=()
pass() { printf 'PASS %s\n' "$*"; PASSED+=("$*"); }
fail() { printf 'FAIL %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root"
unset RCP_TOKEN

# ---------------------------------------------------------------- packages
need=()
for p in podman:podman debootstrap:debootstrap runc:runc curl:curl openssl:openssl \
         newuidmap:uidmap slirp4netns:slirp4netns; do
    command -v "${p%%:*}" >/dev/null || need+=("${p#*:}")
done
if [ ${#need[@]} -gt 0 ]; then
    say "apt-get install ${need[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive nice -n 19 apt-get install -y -q \
        --no-install-recommends "${need[@]}" netavark aardvark-dns catatonit
fi

# ---------------------------------------------------------------- base image
# debootstrap --variant=minbase is close to debian:bookworm-slim (which is
# what the Containerfile's default RUNTIME_IMAGE points at).
if [ -n "${REBUILD_BASE:-}" ] || ! podman image exists "$BASE_IMAGE"; then
    say "debootstrap $SUITE -> $BASE_IMAGE"
    mkdir -p "$WORKDIR"
    rm -rf "$WORKDIR/rootfs"
    nice -n 19 debootstrap --variant=minbase "$SUITE" "$WORKDIR/rootfs" "$MIRROR" \
        >"$WORKDIR/debootstrap.log" 2>&1 || { tail -20 "$WORKDIR/debootstrap.log"; die "debootstrap failed"; }
    cat >"$WORKDIR/rootfs/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main
EOF
    # What debian:*-slim adds: apt keeps no package caches or translations,
    # dpkg installs no docs, man pages or locales.
    cat >"$WORKDIR/rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
Acquire::Languages "none";
EOF
    cat >"$WORKDIR/rootfs/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
EOF
    find "$WORKDIR/rootfs/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
    rm -rf "$WORKDIR"/rootfs/usr/share/{info,locale,man,lintian,linda}/* \
        "$WORKDIR"/rootfs/var/cache/apt/archives/*.deb \
        "$WORKDIR"/rootfs/var/cache/apt/*.bin "$WORKDIR"/rootfs/var/lib/apt/lists/*
    tar -C "$WORKDIR/rootfs" --numeric-owner -c . |
        podman import --change 'CMD ["bash"]' - "$BASE_IMAGE" >/dev/null
    rm -rf "$WORKDIR/rootfs"
fi

# ---------------------------------------------------------------- podman runtime
# Sandboxes differ: crun refuses hybrid cgroup v1/v2 hosts (runc does not),
# and `podman run` raises RLIMIT_NOFILE/NPROC to values a root without
# CAP_SYS_RESOURCE may not set. Pick the first combination that runs.
RUNTIME=()
RUN_OPTS=()
probe() { podman "${RUNTIME[@]}" run --rm "${RUN_OPTS[@]}" "$BASE_IMAGE" true >/dev/null 2>&1; }
found=
for rt in "" runc; do
    for lim in "" "$(ulimit -Hu)" 32768 4096; do
        RUNTIME=(${rt:+--runtime "$rt"})
        RUN_OPTS=(${lim:+--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit "nproc=$lim:$lim"})
        if probe; then found=1; break 2; fi
    done
done
[ -n "$found" ] || { podman run --rm "$BASE_IMAGE" true || true; die "podman cannot run a container here"; }
say "podman ${RUNTIME[*]:-(default runtime)} run ${RUN_OPTS[*]:-(default ulimits)}"
P=(podman "${RUNTIME[@]}")

# ---------------------------------------------------------------- rust image
# The Containerfile's default build image is docker.io/library/rust:1-bookworm.
# Stand-in: the base image + gcc/libc6-dev + the host's rustup toolchain, laid
# out like the official image (RUSTUP_HOME=/usr/local/rustup,
# CARGO_HOME=/usr/local/cargo, which the Containerfile's cache mounts use).
TOOLCHAIN_DIR=$(cd / && rustc --print sysroot) || die "no rustc on the host"
TOOLCHAIN=$(basename "$TOOLCHAIN_DIR")
RUSTUP_BIN=$(command -v rustup) || die "the host toolchain must be rustup-managed"
RUSTC_VERSION=$("$TOOLCHAIN_DIR/bin/rustc" --version | awk '{print $2}')
MSRV=$(sed -n 's/^rust-version *= *"\(.*\)"/\1/p' "$REPO/Cargo.toml" | head -1)
[ "$(printf '%s\n%s\n' "$MSRV" "$RUSTC_VERSION" | sort -V | head -1)" = "$MSRV" ] ||
    die "host rustc $RUSTC_VERSION is older than rust-version $MSRV"
RUST_IMAGE=localhost/rcp-rust:$RUSTC_VERSION-$SUITE

# The host-trusted root CA that index.crates.io's certificate chain (as this
# host sees it) ends in. Usually a public root already in Debian's bundle;
# behind a TLS-intercepting egress proxy it is the proxy's CA, which the build
# container must trust too for cargo to fetch crates.
crates_io_root() {
    local d top issuer f
    d=$(mktemp -d)
    top=$(openssl s_client -connect index.crates.io:443 -servername index.crates.io \
            -showcerts </dev/null 2>/dev/null |
          awk '/BEGIN CERT/{pem=""} {pem=pem $0 "\n"} /END CERT/{last=pem} END{printf "%s", last}')
    issuer=$(openssl x509 -noout -issuer -nameopt RFC2253 <<<"$top" 2>/dev/null) || { rm -rf "$d"; return 0; }
    awk -v d="$d" '/BEGIN CERT/{n++} n{print > (d "/" n ".pem")}' /etc/ssl/certs/ca-certificates.crt
    for f in "$d"/*.pem; do
        if [ "$(openssl x509 -noout -subject -nameopt RFC2253 -in "$f")" = "subject=${issuer#issuer=}" ]; then
            cat "$f"; break
        fi
    done
    rm -rf "$d"
}

if [ -n "${REBUILD_BASE:-}" ] || ! podman image exists "$RUST_IMAGE"; then
    say "$RUST_IMAGE from $TOOLCHAIN_DIR"
    ctx="$WORKDIR/rust-ctx"
    rm -rf "$ctx" && mkdir -p "$ctx/ca"
    cp "$RUSTUP_BIN" "$ctx/rustup"
    crates_io_root >"$ctx/ca/host-crates-io-root.crt"
    if [ -s "$ctx/ca/host-crates-io-root.crt" ]; then
        say "trusting the host's CA for crates.io in the build image: $(openssl x509 -noout -subject -in "$ctx/ca/host-crates-io-root.crt")"
    else
        rm "$ctx/ca/host-crates-io-root.crt"
    fi
    cat >"$ctx/Containerfile" <<'EOF'
ARG BASE
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates curl gcc libc6-dev make git \
 && rm -rf /var/lib/apt/lists/*
COPY ca/ /usr/local/share/ca-certificates/
RUN update-ca-certificates \
 && curl -sSf -o /dev/null https://index.crates.io/config.json
ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ARG TOOLCHAIN
COPY rustup /usr/local/cargo/bin/rustup
# /mnt/toolchain: the host's toolchain, bind-mounted by `podman build -v`.
RUN mkdir -p "$RUSTUP_HOME/toolchains" \
 && cp -a /mnt/toolchain "$RUSTUP_HOME/toolchains/$TOOLCHAIN" \
 && rm -rf "$RUSTUP_HOME/toolchains/$TOOLCHAIN/share/doc" \
 && printf 'version = "12"\nprofile = "minimal"\ndefault_toolchain = "%s"\n' "$TOOLCHAIN" \
      >"$RUSTUP_HOME/settings.toml" \
 && for b in cargo rustc rustdoc cargo-clippy clippy-driver rustfmt cargo-fmt rust-gdb rust-lldb; do \
      ln -f "$CARGO_HOME/bin/rustup" "$CARGO_HOME/bin/$b"; done \
 && chmod -R a+w "$RUSTUP_HOME" "$CARGO_HOME" \
 && rustc --version && cargo --version
EOF
    nice -n 19 "${P[@]}" build -t "$RUST_IMAGE" \
        --build-arg BASE="$BASE_IMAGE" --build-arg TOOLCHAIN="$TOOLCHAIN" \
        -v "$TOOLCHAIN_DIR:/mnt/toolchain:ro" -f "$ctx/Containerfile" "$ctx"
    rm -rf "$ctx"
fi

# ---------------------------------------------------------------- rcp image
if [ -z "${SKIP_BUILD:-}" ]; then
    say "podman build $IMAGE (RUST_IMAGE=$RUST_IMAGE RUNTIME_IMAGE=$BASE_IMAGE)"
    t0=$(date +%s)
    nice -n 19 "${P[@]}" build -t "$IMAGE" \
        --build-arg RUST_IMAGE="$RUST_IMAGE" --build-arg RUNTIME_IMAGE="$BASE_IMAGE" \
        -f "$REPO/Containerfile" "$REPO"
    BUILD_SECONDS=$(($(date +%s) - t0))
    say "built in ${BUILD_SECONDS}s"
fi
podman image exists "$IMAGE" || die "no image $IMAGE (unset SKIP_BUILD)"
SIZE=$(podman image inspect --format '{{.Size}}' "$IMAGE")
pass "image $IMAGE: $((SIZE / 1000000)) MB"

# ---------------------------------------------------------------- image contents
in_image() { "${P[@]}" run --rm "${RUN_OPTS[@]}" --entrypoint "$1" "$IMAGE" "${@:2}"; }
providers=$(in_image ls /usr/lib/x86_64-linux-gnu/libibverbs/ | tr '\n' ' ')
case "$providers" in *libmlx5-rdmav*.so*) ;; *) fail "no mlx5 provider: $providers" ;; esac
case "$providers" in *librxe-rdmav*.so*) ;; *) fail "no rxe provider: $providers" ;; esac
pass "rdma-core providers: $(wc -w <<<"$providers") libraries (mlx5, rxe, ...)"
user=$(podman image inspect --format '{{.Config.User}}' "$IMAGE")
[ "$user" = 65532:65532 ] || fail "image user is '$user', want 65532:65532"
in_image ibv_devinfo -l >/dev/null 2>&1 || in_image sh -c 'command -v ibv_devinfo' >/dev/null ||
    fail "no ibv_devinfo in the image"
ver=$(in_image rcp --version)
in_image rcpd --version >/dev/null
pass "user 65532, ibv_devinfo, $ver"

# ---------------------------------------------------------------- smoke test
SMOKE="$WORKDIR/smoke"
NAME=rcp-smoke-rcpd
cleanup() { podman rm -f -t 2 "$NAME" >/dev/null 2>&1 || true; }
trap cleanup EXIT
cleanup
# Memlock: rcpd registers its arena and rcp its staging buffers (block size x
# batch) even over TCP. With an unlimited hard limit the image runs as
# documented (--ulimit memlock=-1); below that (sandboxes without
# CAP_SYS_RESOURCE) use the hard limit and shrink the arena and the blocks.
ML=$(ulimit -Hl)
if [ "$ML" = unlimited ]; then
    MEMLOCK=(--ulimit memlock=-1:-1); RCPD_SMALL=(); RCP_SMALL=()
else
    [ "$ML" -ge 4096 ] || die "RLIMIT_MEMLOCK hard limit ${ML} KiB: need at least 4 MiB"
    MEMLOCK=(--ulimit "memlock=$((ML << 10)):$((ML << 10))")
    RCPD_SMALL=(--arena-mib "$((ML >> 11))")   # half the limit
    RCP_SMALL=(-e RCP_BLOCK_SIZE=64K)          # 32 x 64 KiB = 2 MiB staging
    say "memlock hard limit ${ML} KiB: rcpd ${RCPD_SMALL[*]}, rcp RCP_BLOCK_SIZE=64K"
fi
rm -rf "$SMOKE" && mkdir -p "$SMOKE/root" "$SMOKE/data"
chown 65532:65532 "$SMOKE/root" "$SMOKE/data"
TOKEN=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
head -c "$((SMOKE_MIB << 20))" /dev/urandom >"$SMOKE/data/in.bin"
SUM=$(sha256sum <"$SMOKE/data/in.bin" | cut -d' ' -f1)

say "rcpd from $IMAGE on 127.0.0.1:$PORT (health $HEALTH_PORT, metrics $METRICS_PORT), --transport tcp"
"${P[@]}" run -d --name "$NAME" --network host "${RUN_OPTS[@]}" "${MEMLOCK[@]}" \
    -v "$SMOKE/root:/var/lib/rcp" -e RCPD_TOKEN="$TOKEN" "$IMAGE" "${RCPD_SMALL[@]}" \
    --transport tcp --listen "127.0.0.1:$PORT" \
    --health-listen "127.0.0.1:$HEALTH_PORT" --metrics-listen "127.0.0.1:$METRICS_PORT" >/dev/null
logs() { podman logs "$NAME" 2>&1 | tail -20 >&2; }
rcp() {
    "${P[@]}" run --rm --network host "${RUN_OPTS[@]}" "${MEMLOCK[@]}" "${RCP_SMALL[@]}" \
        -v "$SMOKE/data:/data" \
        -e RCP_TOKEN="${RCP_TOKEN-$TOKEN}" -e RCP_PORT="$PORT" -e RCP_TRANSPORT=tcp \
        --entrypoint rcp "$IMAGE" "$@"
}
# grpc.health.v1.Health/Check with an empty request, over h2c; SERVING is the
# 7-byte message 00 00000002 08 01.
health() {
    printf '\0\0\0\0\0' | curl -s --max-time 3 --http2-prior-knowledge \
        -H 'content-type: application/grpc' -H 'te: trailers' --data-binary @- \
        "http://127.0.0.1:$HEALTH_PORT/grpc.health.v1.Health/Check" | od -An -tx1 | tr -d ' \n'
}
for _ in $(seq 60); do
    [ "$(health)" = 00000000020801 ] && break
    [ "$(podman inspect --format '{{.State.Running}}' "$NAME" 2>/dev/null)" = true ] ||
        { logs; fail "rcpd exited"; }
    sleep 0.5
done
[ "$(health)" = 00000000020801 ] || { logs; fail "health port: no SERVING answer"; }
uid=$(podman exec "$NAME" sh -c 'awk "/^Uid:/{print \$2}" /proc/1/status')
[ "$uid" = 65532 ] || fail "rcpd runs as uid $uid"
pass "rcpd up as uid 65532; health port $HEALTH_PORT answers SERVING (grpc.health.v1)"

rcp push -q /data/in.bin 127.0.0.1:in.bin || { logs; fail "rcp push"; }
[ "$(sha256sum <"$SMOKE/root/in.bin" | cut -d' ' -f1)" = "$SUM" ] || fail "pushed file differs"
pass "rcp push ${SMOKE_MIB} MiB: sha256 matches on the server side"

rcp pull -q 127.0.0.1:in.bin /data/out.bin || { logs; fail "rcp pull"; }
[ "$(sha256sum <"$SMOKE/data/out.bin" | cut -d' ' -f1)" = "$SUM" ] || fail "pulled file differs"
pass "rcp pull ${SMOKE_MIB} MiB: sha256 matches the original"

rc=0
RCP_TOKEN=wrong rcp pull -q 127.0.0.1:in.bin /data/bad.bin 2>/dev/null || rc=$?
[ "$rc" = 6 ] && [ ! -e "$SMOKE/data/bad.bin" ] || fail "pull with a wrong token: exit $rc, want 6"
pass "wrong token refused (exit 6)"

rc=0
out=$(rcp doctor 127.0.0.1 2>&1) || rc=$?
printf '%s\n' "$out" | sed 's/^/   | /'
grep -q '^\[FAIL\] devices .*no RDMA device found' <<<"$out" || fail "doctor: no 'no RDMA device' failure"
grep -q '^ *fix: .*rdma_rxe' <<<"$out" || fail "doctor: no fix for the missing device"
grep -q '^\[ok  \] providers' <<<"$out" || fail "doctor: providers not ok"
grep -q "^\[ok  \] rcpd .*127.0.0.1:$PORT answers and accepts the token" <<<"$out" || fail "doctor: rcpd check not ok"
[ "$rc" = 6 ] || fail "doctor exit $rc, want 6 (no RDMA device)"
pass "rcp doctor: 'no RDMA device' FAIL with its fix, providers ok, rcpd ok (exit 6)"

metrics=$(curl -fsS --max-time 3 "http://127.0.0.1:$METRICS_PORT/metrics") || fail "metrics port"
n=$(grep -c '^rcp_' <<<"$metrics" || true)
[ "$n" -gt 0 ] || fail "metrics: no rcp_ series"
pass "metrics port $METRICS_PORT: $n rcp_ samples"

t0=$(date +%s)
podman stop -t 20 "$NAME" >/dev/null
code=$(podman inspect --format '{{.State.ExitCode}}' "$NAME")
[ "$code" = 0 ] || { logs; fail "rcpd exit code $code after SIGTERM"; }
pass "rcpd stops on SIGTERM in $(($(date +%s) - t0))s, exit 0"

echo
say "summary"
[ -n "${BUILD_SECONDS:-}" ] && echo "build: ${BUILD_SECONDS}s (RUST_IMAGE=$RUST_IMAGE, RUNTIME_IMAGE=$BASE_IMAGE)"
for p in "${PASSED[@]}"; do echo "ok: $p"; done
