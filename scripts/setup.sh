#!/usr/bin/env bash
# One-command setup for twinkle-server. Idempotent: a second run checks and changes nothing.
#   1. Debian packages (scripts/debian-packages.txt)
#   2. Python venv with pinned packages, outside the checkout and keyed by the requirements'
#      hash (~/.cache/twinkle/venv-<hash>), linked as .venv, so fresh clones reuse it
#   3. a wheelhouse for the offline clean-venv check of the Python client
#      (~/.cache/twinkle/wheelhouse-<hash>, linked as .wheelhouse), the older tinker SDKs
#      (.tinker-sdks) and the tinker-cookbook venv (~/.cache/twinkle/cookbook-venv-<hash>,
#      linked as .cookbook-venv)
#   4. the Python client (client/python) with its generated gRPC code
#   5. a tiny random Qwen3 model in HF format under models/ (no hub: made locally)
#   6. CMake configure + Release build with ccache into build/ (binaries in build/bin/)
# Environment: TWINKLE_CACHE (default ~/.cache/twinkle), TWINKLE_BUILD_TYPE (Release),
# TWINKLE_WITH_CUDA=1 to build the CUDA engine (needs nvcc matching the torch wheel).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE="${TWINKLE_CACHE:-$HOME/.cache/twinkle}"
BUILD_TYPE="${TWINKLE_BUILD_TYPE:-Release}"
mkdir -p "$CACHE"

phase_start=0
phase() { phase_start=$(date +%s); echo "== setup: $1"; }
phase_done() { echo "   ($(( $(date +%s) - phase_start )) s)"; }

# ---- 1. Debian packages --------------------------------------------------------------------
phase "Debian packages"
mapfile -t packages < <(grep -vE '^\s*(#|$)' scripts/debian-packages.txt)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Commands that any package may provide: Debian's is installed only when the command is
# missing (kubernetes-client would conflict with a kubectl from another repository, which owns
# /usr/bin/kubectl too). kubectl renders deploy/k8s in tests/deploy (docs/deploy.md).
for pair in kubectl:kubernetes-client; do
  command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
done
if ((${#missing[@]})); then
  echo "   installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "   all ${#packages[@]} present"
fi
phase_done

# ---- 2. Python venv ------------------------------------------------------------------------
phase "Python venv"
PYTHON="${PYTHON:-python3}"
key=$( (cat scripts/requirements.txt; "$PYTHON" --version) | sha256sum | cut -c1-16)
VENV="$CACHE/venv-$key"
if [ ! -f "$VENV/.twinkle-complete" ]; then
  echo "   creating $VENV"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -r scripts/requirements.txt
  touch "$VENV/.twinkle-complete"   # written last: a half-made venv is never reused
else
  echo "   reusing $VENV"
fi
if [ "$(readlink .venv 2>/dev/null)" != "$VENV" ]; then ln -sfn "$VENV" .venv; fi
PY="$ROOT/.venv/bin/python"
# Where the wheel's LibTorch lives, without importing torch (that alone takes seconds).
TORCH_DIR="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch"
[ -f "$TORCH_DIR/lib/libtorch_cpu.so" ] || { echo "no LibTorch in $TORCH_DIR"; exit 1; }
phase_done

# ---- 3. Wheelhouse -------------------------------------------------------------------------
phase "wheelhouse (for the client's offline clean-venv check)"
# scripts/check_client_install.sh (a step of test.sh) installs client/python into a fresh venv
# from these wheels alone, no index: pip (the fresh venv upgrades itself), the isolated
# build's requirements, the runtime dependencies and the [template,data] extras, all read
# from pyproject.toml and pinned by requirements.txt. `pip wheel` rather than `pip download`:
# a package with no wheel for this Python is built here, once, not offline in the check.
# Keyed by that list, the pins and the Python, in the cache like the venv.
wheel_reqs_text=$("$PY" - client/python/pyproject.toml <<'EOF'
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)
extras = project["project"]["optional-dependencies"]
print("\n".join(["pip", *project["build-system"]["requires"], *project["project"]["dependencies"],
                 *extras["template"], *extras["data"]]))
EOF
)
mapfile -t wheel_reqs <<< "$wheel_reqs_text"
wheel_key=$( (echo "$wheel_reqs_text"; cat scripts/requirements.txt; "$PY" --version) | sha256sum | cut -c1-16)
WHEELHOUSE="$CACHE/wheelhouse-$wheel_key"
if [ ! -f "$WHEELHOUSE/.twinkle-complete" ]; then
  echo "   filling $WHEELHOUSE"
  rm -rf "$WHEELHOUSE"
  "$PY" -m pip wheel -q -w "$WHEELHOUSE" -c scripts/requirements.txt "${wheel_reqs[@]}"
  touch "$WHEELHOUSE/.twinkle-complete"   # written last: a half-filled one is never reused
  echo "   $(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)"
else
  echo "   reusing $WHEELHOUSE"
fi
if [ "$(readlink .wheelhouse 2>/dev/null)" != "$WHEELHOUSE" ]; then ln -sfn "$WHEELHOUSE" .wheelhouse; fi
phase_done

# ---- 3b. Older tinker SDK releases -----------------------------------------------------------
phase "older tinker SDKs (tests/e2e/test_tinker_versions.py)"
# Each release's wheel, unpacked into <cache>/tinker-sdks/<version> (linked as .tinker-sdks),
# so the test runs it offline from PYTHONPATH on top of the venv (same dependencies as 0.38).
SDKS="$CACHE/tinker-sdks"
for v in 0.16.1 0.25.0 0.30.4; do
  if [ ! -f "$SDKS/$v/.twinkle-complete" ]; then
    rm -rf "$SDKS/$v" && mkdir -p "$SDKS/wheels" "$SDKS/$v"
    "$PY" -m pip download -q --no-deps -d "$SDKS/wheels" "tinker==$v"
    "$PY" -m zipfile -e "$SDKS/wheels/tinker-$v-py3-none-any.whl" "$SDKS/$v"
    touch "$SDKS/$v/.twinkle-complete"
  fi
done
if [ "$(readlink .tinker-sdks 2>/dev/null)" != "$SDKS" ]; then ln -sfn "$SDKS" .tinker-sdks; fi
phase_done

# ---- 3c. tinker-cookbook venv ----------------------------------------------------------------
phase "tinker-cookbook venv (tests/e2e/test_cookbook.py)"
# Its own venv: the cookbook runs on transformers 5.5.4, the main venv pins 5.23.0
# (scripts/requirements-cookbook.txt says why, and why the cookbook goes in --no-deps). torch
# and its CUDA libraries are the main venv's, linked in (scripts/link_torch.py), so the venv
# is keyed by the main venv too. Cached like the main venv; the test runs it offline.
COOKBOOK_VERSION=0.6.1
cb_key=$( (cat scripts/requirements-cookbook.txt scripts/link_torch.py; echo "$key $COOKBOOK_VERSION") | sha256sum | cut -c1-16)
CBVENV="$CACHE/cookbook-venv-$cb_key"
# Reused only while complete and its linked torch resolves (a dangling link: made anew).
if [ ! -f "$CBVENV/.twinkle-complete" ] || ! compgen -G "$CBVENV/lib/python3*/site-packages/torch/__init__.py" >/dev/null; then
  echo "   creating $CBVENV"
  rm -rf "$CBVENV"
  "$PYTHON" -m venv "$CBVENV"
  "$PY" scripts/link_torch.py "$CBVENV"
  "$CBVENV/bin/pip" install -q -r scripts/requirements-cookbook.txt
  "$CBVENV/bin/pip" install -q --no-deps "tinker-cookbook==$COOKBOOK_VERSION"
  # Every requirement met but the one left out on purpose (tml-renderers>=0.4.1, not on PyPI).
  if unmet=$("$CBVENV/bin/pip" check 2>&1 | grep -v -e "^tinker-cookbook $COOKBOOK_VERSION requires tml-renderers, which is not installed" \
                 -e "^No broken requirements found"); then
    echo "$unmet" >&2
    echo "setup: the cookbook venv has unmet requirements (above)" >&2
    exit 1
  fi
  touch "$CBVENV/.twinkle-complete"   # written last: a half-made venv is never reused
else
  echo "   reusing $CBVENV"
fi
if [ "$(readlink .cookbook-venv 2>/dev/null)" != "$CBVENV" ]; then ln -sfn "$CBVENV" .cookbook-venv; fi
phase_done

# ---- 4. Python client ----------------------------------------------------------------------
phase "Python client (client/python)"
client_hash=$( (find client/python proto -type f \( -name '*.py' -o -name '*.toml' -o -name '*.proto' \) \
                  -not -path '*/_proto/*' -not -path '*/build/*' | sort | xargs sha256sum) | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.twinkle-client-hash" 2>/dev/null)" != "$client_hash" ] || \
   [ ! -d client/python/twinkle_client/_proto ]; then
  "$PY" client/python/generate_protos.py
  # The distribution was called twinkle-client before; both would claim twinkle_client/.
  "$VENV/bin/pip" uninstall -q -y twinkle-client 2>/dev/null || true
  "$VENV/bin/pip" install -q --no-deps --no-build-isolation --force-reinstall ./client/python
  rm -rf client/python/build
  echo "$client_hash" > "$VENV/.twinkle-client-hash"
  echo "   installed twinkle-server-client ($client_hash)"
else
  echo "   up to date ($client_hash)"
fi
phase_done

# ---- 5. Tiny model -------------------------------------------------------------------------
phase "tiny model (models/tiny-qwen3)"
# Made once per version of the script and the pinned packages, in the cache; the checkout
# links to it, so a fresh clone does not rebuild it.
model_key=$( (cat scripts/make_tiny_model.py; echo "$key") | sha256sum | cut -c1-16)
MODEL="$CACHE/models/tiny-qwen3-$model_key"
"$PY" scripts/make_tiny_model.py "$MODEL"
mkdir -p models
if [ "$(readlink models/tiny-qwen3 2>/dev/null)" != "$MODEL" ]; then
  rm -rf models/tiny-qwen3
  ln -sfn "$MODEL" models/tiny-qwen3
fi
phase_done

# ---- 6. Build ------------------------------------------------------------------------------
phase "build ($BUILD_TYPE) into build/"
export CCACHE_BASEDIR="$ROOT"          # relative paths in the cache key: hits across clones
export CCACHE_DIR="${CCACHE_DIR:-$CACHE/ccache}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
cuda_flag=OFF; [ "${TWINKLE_WITH_CUDA:-0}" = "1" ] && cuda_flag=ON
mkdir -p build
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
  -DTWINKLE_TORCH_DIR="$TORCH_DIR" -DTWINKLE_WITH_CUDA="$cuda_flag" \
  -DPython3_EXECUTABLE="$PY" > build/cmake-configure.log 2>&1 || { cat build/cmake-configure.log; exit 1; }
# Two jobs: this machine class has 2 cores and the torch TUs are memory-hungry.
command -v ccache >/dev/null && ccache -z >/dev/null 2>&1 || true  # count this build's hits only
cmake --build build -j "${TWINKLE_JOBS:-2}"
command -v ccache >/dev/null && ccache -s 2>/dev/null | grep -E 'Hits|hit rate' | head -2 | sed 's/^/   ccache: /' || true
phase_done

echo "== setup: done. Binaries: build/bin/twinkle-server, build/bin/twinkle-engine"
