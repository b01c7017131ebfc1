#!/usr/bin/env bash
# Builds twinkle-server's OCI image from Debian packages, the built binaries and the pinned
# torch wheel's libraries; no base image is pulled from anywhere (docs/deploy.md, "Image").
#   deploy/image/build.sh [--variant cpu|cuda] [--build-dir DIR] [--tag NAME] [--archive FILE] [--plan]
# --plan: step 1 only, without copying: prints the Debian packages and venv libraries the
# image would get and fails if a library belongs to neither (a quick check for CI).
# Steps:
#   1. the runtime libraries of build/bin/twinkle-{server,engine}, found with ldd: those from
#      Debian packages become the image's package list (dpkg -S), those from the venv (torch's
#      lib/, and for cuda the nvidia-* wheels' lib/) are copied to /opt/twinkle/lib
#   2. mmdebstrap makes a Debian bookworm root file system (variant essential plus those
#      packages) from Debian's mirror, with the non-root user twinkle (uid 10001); it is
#      cached under the work dir by its package list, so a rebuild reuses it
#   3. buildah assembles deploy/image/Containerfile from the staged files (no RUN step)
# The cuda variant wants binaries built with TWINKLE_WITH_CUDA=1 (default --build-dir
# build-cuda) and copies the CUDA runtime from the torch wheel's nvidia-* packages; the
# driver (libcuda.so.1) comes from the host at run time (NVIDIA container toolkit / CDI).
# Image-only tools (mmdebstrap, buildah) are installed here when missing, not by setup.sh.
# Environment: TWINKLE_IMAGE_WORK (default /var/tmp/twinkle-image), TWINKLE_IMAGE_MIRROR
# (default http://deb.debian.org), TWINKLE_STORAGE_DRIVER (containers/storage driver;
# default vfs, which works inside unprivileged sandboxes; overlay where the kernel allows).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"

variant=cpu build_dir="" tag="" archive="" plan=0
while (($#)); do
  case "$1" in
    --variant) variant="$2"; shift 2 ;;
    --build-dir) build_dir="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --archive) archive="$2"; shift 2 ;;
    --plan) plan=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$variant" in cpu|cuda) ;; *) echo "build.sh: --variant is cpu or cuda" >&2; exit 2 ;; esac
[ -n "$build_dir" ] || build_dir=$([ "$variant" = cuda ] && echo build-cuda || echo build)
version=$(sed -nE 's/^project\(twinkle[^ ]* VERSION ([0-9.]+).*/\1/p' CMakeLists.txt | head -1)
[ -n "$tag" ] || tag="localhost/twinkle-server:${version:-dev}-$variant"
SUITE=bookworm
MIRROR="${TWINKLE_IMAGE_MIRROR:-http://deb.debian.org}"
DRIVER="${TWINKLE_STORAGE_DRIVER:-vfs}"
WORK="${TWINKLE_IMAGE_WORK:-/var/tmp/twinkle-image}/$variant"
step() { echo "== image: $*"; }

# ---- tools (image building and running only) ----------------------------------------------
# mmdebstrap and buildah build it; podman with runc runs it (tests/deploy/test_image.py picks
# runc: crun refuses hybrid cgroup hierarchies, as some sandboxes have).
need=()
((plan)) && WORK=$(mktemp -d) && trap 'rm -rf "$WORK"' EXIT
for tool in mmdebstrap buildah podman runc; do
  command -v "$tool" >/dev/null || need+=("$tool")
done
if ((${#need[@]})) && ((!plan)); then
  step "installing ${need[*]} (image building and running only)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${need[@]}"
fi

server="$build_dir/bin/twinkle-server" engine="$build_dir/bin/twinkle-engine"
# The coordinator never links torch, so a CUDA build dir made by scripts/cuda_build.sh (engine
# and kernels only) takes it from the CPU build.
[ "$variant" = cuda ] && [ ! -x "$server" ] && [ -x build/bin/twinkle-server ] && server=build/bin/twinkle-server
for b in "$server" "$engine"; do
  [ -x "$b" ] || { echo "build.sh: $b is not built (scripts/setup.sh, or TWINKLE_WITH_CUDA=1 for cuda)" >&2; exit 1; }
done
if [ "$variant" = cuda ] && ! ldd "$engine" | grep -q libtorch_cuda; then
  echo "build.sh: $engine does not link libtorch_cuda: build it with TWINKLE_WITH_CUDA=1" >&2; exit 1
fi

# ---- 1. runtime libraries -----------------------------------------------------------------
step "runtime libraries of $server and $engine"
SITE=$(cd .venv && ./bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$WORK/stage"
mkdir -p "$WORK/stage/opt/twinkle/bin" "$WORK/stage/opt/twinkle/lib" "$WORK/stage/etc/twinkle"
# One dpkg-query for every library (it reads the whole database per call): each path is
# asked as ldd printed it and as its real path, with and without /usr (merged /usr).
mapfile -t libs < <(ldd "$server" "$engine" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u)
site_real=$(realpath "$SITE")
system_libs=() venv_libs=()
for lib in "${libs[@]}"; do
  case "$(realpath "$lib")" in
    "$site_real"/*) venv_libs+=("$lib"); ((plan)) || cp -L "$lib" "$WORK/stage/opt/twinkle/lib/" ;;
    *) system_libs+=("$lib") ;;
  esac
done
candidates=()
for lib in "${system_libs[@]}"; do
  real=$(realpath "$lib")
  candidates+=("$lib" "${lib#/usr}" "/usr${lib#/usr}" "$real" "${real#/usr}")
done
owners=$(dpkg-query -S "${candidates[@]}" 2>/dev/null || true)
declare -A packages=()
for lib in "${system_libs[@]}"; do
  real=$(realpath "$lib")
  pkg=$(awk -v a="$lib" -v b="${lib#/usr}" -v c="/usr${lib#/usr}" -v d="$real" -v e="${real#/usr}" \
          -F': ' '$2 == a || $2 == b || $2 == c || $2 == d || $2 == e {split($1, p, ":"); print p[1]; exit}' <<< "$owners")
  [ -n "$pkg" ] || { echo "build.sh: no Debian package owns $lib" >&2; exit 1; }
  packages[$pkg]=1
done
if [ "$variant" = cuda ]; then
  # dlopen()ed at run time, so ldd cannot see them: all of torch/lib and the CUDA runtime
  # of the wheel's nvidia-* packages (cuBLAS, cuDNN, NCCL, nvrtc, ...).
  cp -L "$SITE"/torch/lib/*.so* "$WORK/stage/opt/twinkle/lib/"
  for d in "$SITE"/nvidia/*/lib; do cp -L "$d"/*.so* "$WORK/stage/opt/twinkle/lib/"; done
fi
mapfile -t pkg_list < <(printf '%s\n' "${!packages[@]}" | sort)
echo "   Debian packages: ${pkg_list[*]}"
if ((plan)); then
  echo "   from the venv: ${venv_libs[*]##*/}"
  [ -f deploy/image/Containerfile ] && grep -q '^ADD rootfs.tar /' deploy/image/Containerfile
  echo "== image: plan done"
  exit 0
fi
echo "   from the venv: $(ls "$WORK/stage/opt/twinkle/lib" | wc -l) libraries, $(du -sh "$WORK/stage/opt/twinkle/lib" | cut -f1)"
printf '%s\n' "${pkg_list[@]}" > "$WORK/stage/packages.txt"

for b in "$server" "$engine"; do
  strip --strip-unneeded -o "$WORK/stage/opt/twinkle/bin/$(basename "$b")" "$b"
done
cp deploy/image/config.yaml "$WORK/stage/etc/twinkle/config.yaml"

# ---- 2. root file system ------------------------------------------------------------------
key=$( (echo "$SUITE $MIRROR"; cat "$WORK/stage/packages.txt"; sed -n '/^# ---- 2/,/^# ---- 3/p' "$0") | sha256sum | cut -c1-16)
rootfs="$WORK/rootfs-$key.tar"
if [ ! -f "$rootfs" ]; then
  step "mmdebstrap $SUITE (essential + ${#pkg_list[@]} packages) from $MIRROR"
  rm -f "$WORK"/rootfs-*.tar
  includes=$(IFS=,; echo "${pkg_list[*]}")
  SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null || date +%s) \
  mmdebstrap --variant=essential --format=tar --include="$includes" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='echo "twinkle:x:10001:10001:twinkle-server:/var/lib/twinkle:/usr/sbin/nologin" >> "$1/etc/passwd"' \
    --customize-hook='echo "twinkle:x:10001:" >> "$1/etc/group"' \
    --customize-hook='echo "twinkle:!:1::::::" >> "$1/etc/shadow"' \
    --customize-hook='mkdir -p "$1/var/lib/twinkle" "$1/models" && chown 10001:10001 "$1/var/lib/twinkle"' \
    --customize-hook='rm -rf "$1/var/cache/apt" "$1"/var/lib/apt/lists/* "$1"/var/log/*' \
    "$SUITE" "$rootfs.part" \
    "deb $MIRROR/debian $SUITE main" "deb $MIRROR/debian $SUITE-updates main" \
    "deb $MIRROR/debian-security $SUITE-security main"
  mv "$rootfs.part" "$rootfs"
else
  step "reusing $rootfs"
fi
ln -f "$rootfs" "$WORK/stage/rootfs.tar" 2>/dev/null || cp "$rootfs" "$WORK/stage/rootfs.tar"

# ---- 3. image -----------------------------------------------------------------------------
step "buildah build $tag (storage driver $DRIVER)"
lib_path=/opt/twinkle/lib
buildah --storage-driver "$DRIVER" build --quiet --layers=false \
  --timestamp "$(git log -1 --format=%ct 2>/dev/null || date +%s)" \
  --build-arg "TWINKLE_LIBRARY_PATH=$lib_path" \
  --label "org.opencontainers.image.version=$version" \
  --label "org.opencontainers.image.revision=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
  -f deploy/image/Containerfile -t "$tag" "$WORK/stage"
size=$(buildah --storage-driver "$DRIVER" images --format '{{.Size}}' "$tag" | head -1)
echo "   $tag: $size (uncompressed)"
if [ -n "$archive" ]; then
  rm -f "$archive"
  buildah --storage-driver "$DRIVER" push --quiet "$tag" "oci-archive:$archive:$tag"
  echo "   $archive: $(du -h "$archive" | cut -f1) (compressed layers)"
fi
echo "== image: done: $tag"
