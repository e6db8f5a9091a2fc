#!/usr/bin/env bash
# Builds the kvmesh runtime image here, without pulling any base image, and tests it:
#   scripts/build-image.sh [--no-build] [--tag NAME] [--port N]
# 1. A static binary on the host: glibc with crt-static on the gnu target (works with this crate
#    set: nothing links a C library dynamically; ring's C/asm is compiled in). The image then
#    needs no libc (no fallback to copying shared libraries was needed). Static glibc loads no
#    NSS plugins; /etc/hosts works (the serve test below resolves localhost inside the image),
#    DNS through /etc/resolv.conf was not tested here (no resolver reachable).
# 2. `buildah bud` of deploy/container/Containerfile.local (FROM scratch) in vfs storage with
#    chroot isolation (what works on this machine: no overlay, no cgroups for a runtime).
# 3. Runs `kvmesh --version` and `kvmesh certs init`/`issue` inside the image (`buildah run`),
#    then `kvmesh serve` inside it in front of a simulated replica on the host (reached as
#    http://localhost:PORT, so name resolution is exercised), probes /health, /ready and one
#    completion from the host, stops it with SIGTERM, and prints the image size.
# Re-running replaces the image and the working container. --no-build reuses the binary from an
# earlier run; --port N: the node listens on 127.0.0.1:N, the replica on N+1 (default 18080).
# CARGO_TARGET_DIR is honoured. Needs root (buildah vfs), curl, and a host CA bundle.
set -euo pipefail

tag=localhost/kvmesh:dev
build=1
port=18080
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) build=0 ;;
    --tag) tag="$2"; shift ;;
    --port) port="$2"; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

root=$(cd "$(dirname "$0")/.." && pwd)
target_dir=${CARGO_TARGET_DIR:-$root/target}
triple=x86_64-unknown-linux-gnu
bin=$target_dir/$triple/release/kvmesh
bah=(buildah --storage-driver vfs)

command -v buildah >/dev/null || { echo "buildah not found (apt-get install buildah)" >&2; exit 1; }

if [ "$build" = 1 ]; then
  # No debug info, stripped: the release profile's line tables make a ~170 MB binary.
  (cd "$root" && RUSTFLAGS="-C target-feature=+crt-static" \
    CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols \
    cargo build --release --locked --target "$triple" --bin kvmesh)
fi
[ -x "$bin" ] || { echo "no binary at $bin (run without --no-build)" >&2; exit 1; }
# Refuse a dynamic binary: it would not start in a scratch image.
if ! ldd "$bin" 2>&1 | grep -Eq 'statically linked|not a dynamic executable'; then
  echo "$bin is dynamically linked:"; ldd "$bin"; exit 1
fi

# The build context: the binary and two empty directories the image needs.
ctx=$target_dir/image-context
rm -rf "$ctx"
mkdir -p "$ctx/tmp" "$ctx/data"
cp "$bin" "$ctx/kvmesh"
# The HTTP client will not build without system roots (see Containerfile.local).
cp /etc/ssl/certs/ca-certificates.crt "$ctx/ca-certificates.crt"

old=$("${bah[@]}" images -q "$tag" 2>/dev/null || true)
"${bah[@]}" bud --isolation chroot -f "$root/deploy/container/Containerfile.local" -t "$tag" "$ctx"
# The previous build under this tag is now dangling: remove it (vfs keeps a full copy per image).
new=$("${bah[@]}" images -q "$tag")
if [ -n "$old" ] && [ "$old" != "$new" ]; then "${bah[@]}" rmi "$old" >/dev/null || true; fi

# A fresh working container each run (the name is fixed so a re-run replaces it).
name=kvmesh-image-test
"${bah[@]}" rm "$name" >/dev/null 2>&1 || true
"${bah[@]}" from --name "$name" "$tag" >/dev/null
pids=()
# Every process under pid $1 (buildah run -> chroot helper -> kvmesh).
descendants() { local c; for c in $(pgrep -P "$1" || true); do echo "$c"; descendants "$c"; done; }
cleanup() {
  local p
  for p in "${pids[@]}"; do
    for p in $(descendants "$p") "$p"; do kill "$p" 2>/dev/null || true; done
  done
  "${bah[@]}" rm "$name" >/dev/null 2>&1 || true
}
trap cleanup EXIT
run() { "${bah[@]}" run --isolation chroot "$name" "$@"; }

echo "--- image config: user, entrypoint, ports"
"${bah[@]}" inspect --format '{{.OCIv1.Config.User}} {{.OCIv1.Config.Entrypoint}} {{.OCIv1.Config.ExposedPorts}}{{println}}' "$tag"
echo "--- inside the image: kvmesh --version"
run /kvmesh --version
echo "--- inside the image: kvmesh certs init --dir /tmp/x && kvmesh certs issue --dir /tmp/x --name eu-1"
run /kvmesh certs init --dir /tmp/x
run /kvmesh certs issue --dir /tmp/x --name eu-1
# Written as the image's USER (uid:gid mode file), seen from the host.
mnt=$("${bah[@]}" mount "$name")
stat -c '%u:%g %a %n' "$mnt"/tmp/x/* | sed "s#$mnt##"

echo "--- inside the image: kvmesh serve --listen 127.0.0.1:$port --replica http://localhost:$((port + 1))"
"$bin" replica --port $((port + 1)) --id image-test-replica >/dev/null 2>&1 &
pids+=($!)
run /kvmesh serve --listen "127.0.0.1:$port" --replica "http://localhost:$((port + 1))" \
  >"$ctx/serve.log" 2>&1 &
serve=$!
pids+=("$serve")
probe() { curl -s -o /dev/null -w '%{http_code}' --max-time 2 "http://127.0.0.1:$port$1" || true; }
for _ in $(seq 1 100); do [ "$(probe /ready)" = 200 ] && break; sleep 0.1; done
echo "GET /health: $(probe /health)   GET /ready: $(probe /ready)"
echo -n "POST /v1/completions: "
curl -sS --max-time 10 "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
  -d '{"model":"sim-llama-8b","prompt":"Hello from the image","max_tokens":4}'
echo
# SIGTERM to the kvmesh process itself (buildah does not forward it), which must then exit.
node=$(for p in $(descendants "$serve"); do [ "$(ps -o comm= -p "$p")" = kvmesh ] && echo "$p"; done)
[ -n "$node" ] || { echo "no kvmesh process under buildah run" >&2; exit 1; }
kill -TERM "$node"
for _ in $(seq 1 100); do kill -0 "$serve" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$serve" 2>/dev/null; then echo "serve did not stop within 10 s of SIGTERM" >&2; exit 1; fi
wait "$serve" && echo "serve exited 0 after SIGTERM" || { echo "serve exited $?"; cat "$ctx/serve.log"; exit 1; }
echo "--- image size"
"${bah[@]}" images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$tag"
echo "binary: $(stat -c %s "$ctx/kvmesh") bytes"
