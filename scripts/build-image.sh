#!/usr/bin/env bash
# Builds the kvmesh runtime image here, without pulling any base image, and tests it:
#   scripts/build-image.sh [--no-build] [--tag NAME]
# 1. A static binary on the host: glibc with crt-static on the gnu target (works with this crate
#    set: nothing links a C library dynamically; ring's C/asm is compiled in). The image then
#    needs no libc. Caveat of static glibc: host names resolve through the built-in "files" and
#    "dns" lookups only (no NSS plugins); IP addresses and /etc/hosts, /etc/resolv.conf work.
# 2. `buildah bud` of deploy/container/Containerfile.local (FROM scratch) in vfs storage with
#    chroot isolation (what works on this machine: no overlay, no cgroups for a runtime).
# 3. Runs `kvmesh --version` and `kvmesh certs init` inside the image (`buildah run`), and prints
#    the image size. Re-running replaces the image and the working container.
# --no-build reuses the binary from an earlier run. CARGO_TARGET_DIR is honoured.
set -euo pipefail

tag=localhost/kvmesh:dev
build=1
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) build=0 ;;
    --tag) tag="$2"; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
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
if ldd "$bin" >/dev/null 2>&1; then
  echo "$bin is dynamically linked:"; ldd "$bin"; exit 1
fi

# The build context: the binary and two empty directories the image needs.
ctx=$target_dir/image-context
rm -rf "$ctx"
mkdir -p "$ctx/tmp" "$ctx/data"
cp "$bin" "$ctx/kvmesh"

"${bah[@]}" bud --isolation chroot -f "$root/deploy/container/Containerfile.local" -t "$tag" "$ctx"

# A fresh working container each run (the name is fixed so a re-run replaces it).
name=kvmesh-image-test
"${bah[@]}" rm "$name" >/dev/null 2>&1 || true
"${bah[@]}" from --name "$name" "$tag" >/dev/null
trap '"${bah[@]}" rm "$name" >/dev/null 2>&1 || true' EXIT
run() { "${bah[@]}" run --isolation chroot "$name" "$@"; }

echo "--- image config: user, entrypoint, ports"
"${bah[@]}" inspect --format '{{.OCIv1.Config.User}} {{.OCIv1.Config.Entrypoint}} {{.OCIv1.Config.ExposedPorts}}' "$tag"
echo "--- inside the image: kvmesh --version"
run /kvmesh --version
echo "--- inside the image: kvmesh certs init --dir /tmp/x && kvmesh certs issue --dir /tmp/x --name eu-1"
run /kvmesh certs init --dir /tmp/x
run /kvmesh certs issue --dir /tmp/x --name eu-1
echo "--- image size"
"${bah[@]}" images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$tag"
echo "binary: $(stat -c %s "$ctx/kvmesh") bytes"
