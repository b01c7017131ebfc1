#!/usr/bin/env bash
# Checks that the Python SDK (client/python, distribution twinkle-server-client) builds and
# installs into a clean virtual environment without torch, the way a user installs it:
#   1. builds the wheel with pip's build isolation (setuptools + grpcio-tools from
#      build-system.requires; the gRPC stubs are generated from proto/ during the build)
#   2. creates a fresh venv (no system site-packages) and installs the wheel, its
#      dependencies at the versions pinned in scripts/requirements.txt (as constraints)
#   3. checks: every module path Twinkle's client scripts import resolves, torch is neither
#      installed nor imported, `pip check` is clean
#   4. installs the [template,data] extras and encodes a conversation with the tiny model's
#      tokenizer (models/tiny-qwen3, when present) - still without torch
# Where the packages come from:
#   --wheelhouse DIR (or TWINKLE_WHEELHOUSE=DIR): offline. Every pip call, the isolated
#     build's included, uses only DIR (PIP_NO_INDEX=1, PIP_FIND_LINKS=DIR), so the check
#     needs no network. scripts/setup.sh fills one for the venv's Python and links it as
#     .wheelhouse; scripts/test.sh runs the check this way. PYTHON defaults to .venv/bin/python
#     here (the wheels are for its version).
#   otherwise: the configured package index (PyPI), PYTHON defaults to python3.
# Takes about 35 s offline on the 2-core machines. On any failure it exits non-zero and its
# last line names the step that failed.
# Usage: scripts/check_client_install.sh [--wheelhouse DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELHOUSE="${TWINKLE_WHEELHOUSE:-}"
while (($#)); do
  case "$1" in
    --wheelhouse) WHEELHOUSE="${2:?--wheelhouse needs a directory}"; shift 2 ;;
    --wheelhouse=*) WHEELHOUSE="${1#*=}"; shift ;;
    -h|--help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "check_client_install: unknown argument $1 (usage: --wheelhouse DIR)" >&2; exit 2 ;;
  esac
done
if [ -n "$WHEELHOUSE" ]; then
  compgen -G "$WHEELHOUSE/*.whl" >/dev/null \
    || { echo "check_client_install: no wheels in $WHEELHOUSE (run scripts/setup.sh)" >&2; exit 2; }
  WHEELHOUSE="$(cd "$WHEELHOUSE" && pwd -P)"
  # pip reads these in every call, and its build isolation passes them on to the pip that
  # installs the build requirements: nothing is fetched from an index. The hub too stays off.
  export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELHOUSE" PIP_DISABLE_PIP_VERSION_CHECK=1 \
         HF_HUB_OFFLINE=1
  default_python="$ROOT/.venv/bin/python"; [ -x "$default_python" ] || default_python=python3
  source_line="the wheelhouse $WHEELHOUSE only (offline)"
else
  default_python=python3
  source_line="the package index (${PIP_INDEX_URL:-PyPI or the configured index})"
fi
PYTHON="${PYTHON:-$default_python}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/twinkle-client-install.XXXXXX")"
start=$(date +%s)
current="starting"
finish() {
  local rc=$?
  rm -rf "$WORK"
  if [ "$rc" -ne 0 ]; then
    echo "== check_client_install: FAILED (exit $rc) at step: $current ($(( $(date +%s) - start )) s)"
  fi
}
trap finish EXIT
step() { current="$1"; echo "== check_client_install: $1 ($(( $(date +%s) - start )) s)"; }
echo "== check_client_install: packages from $source_line; Python $("$PYTHON" -c 'import sys; print(sys.version.split()[0])')"

step "copying client/python and proto/"
mkdir -p "$WORK/src/client"
cp -r "$ROOT/proto" "$WORK/src/proto"
rsync -a --exclude '_proto' --exclude '*.egg-info' --exclude 'build' --exclude '__pycache__' \
  "$ROOT/client/python/" "$WORK/src/client/python/" 2>/dev/null \
  || { cp -r "$ROOT/client/python" "$WORK/src/client/python"; \
       rm -rf "$WORK/src/client/python/twinkle_client/_proto" "$WORK/src/client/python/"*.egg-info \
              "$WORK/src/client/python/build"; }

step "building the wheel (isolated build: setuptools + grpcio-tools)"
"$PYTHON" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src/client/python"
wheel=$(ls "$WORK/dist"/twinkle_server_client-*.whl)
echo "   $(basename "$wheel")"
"$PYTHON" - "$wheel" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
for needed in ("twinkle/__init__.py", "twinkle_client/__init__.py",
               "twinkle_client/_proto/twinkle/v1/training_pb2.py",
               "twinkle_client/_proto/twinkle/v1/sampler_pb2_grpc.py"):
    assert needed in names, f"{needed} missing from the wheel"
print(f"   {len(names)} files, stubs included")
EOF

step "installing into a clean venv (no system site-packages)"
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q --upgrade pip
"$VPY" -m pip install -q -c "$ROOT/scripts/requirements.txt" "$wheel"
"$VPY" -m pip check

step "importing every module path of the guide's scripts, without torch"
cd "$WORK"  # not the checkout: the installed copy must be the one imported
"$VPY" - <<'EOF'
import importlib, importlib.util, sys
assert importlib.util.find_spec("torch") is None, "torch is installed"
modules = {
    "twinkle_client": ["init_twinkle_client", "init_tinker_client", "TwinkleClient"],
    "twinkle_client.model": ["MultiLoraTransformersModel"],
    "twinkle_client.dataset": ["Dataset", "DatasetMeta", "PackingDataset"],
    "twinkle_client.dataloader": ["DataLoader"],
    "twinkle_client.sampler": ["vLLMSampler"],
    "twinkle": ["get_logger", "init_tinker_client"],
    "twinkle.data_format": ["Message", "Trajectory", "InputFeature", "SamplingParams"],
    "twinkle.dataset": ["Dataset", "DatasetMeta", "PackingDataset"],
    "twinkle.dataloader": ["DataLoader"],
    "twinkle.template": ["Template", "Qwen3_5Template"],
    "twinkle.preprocessor": ["SelfCognitionProcessor", "GSM8KProcessor", "CountdownProcessor"],
    "twinkle.preprocessor.llm": ["GSM8KProcessor"],
    "twinkle.reward": ["GSM8KAccuracyReward", "GSM8KFormatReward", "FormatReward"],
    "twinkle.reward.base": ["Reward"],
    "twinkle.advantage": ["GRPOAdvantage"],
    "twinkle.metric": ["CompletionRewardMetric"],
    "twinkle.server.common": ["input_feature_to_datum"],
}
for name, attributes in modules.items():
    module = importlib.import_module(name)
    assert "site-packages" in module.__file__, f"{name} imported from {module.__file__}"
    for attribute in attributes:
        getattr(module, attribute)
assert "torch" not in sys.modules and "transformers" not in sys.modules
from twinkle.advantage import GRPOAdvantage
assert GRPOAdvantage()([0.0, 1.0, 1.0, 1.0], num_generations=2).tolist()[0] < 0
print(f"   {len(modules)} modules import; torch absent")
EOF

step "installing the [template,data] extras; encoding with a real tokenizer"
"$VPY" -m pip install -q -c "$ROOT/scripts/requirements.txt" "${wheel}[template,data]"
"$VPY" -m pip check
TOKENIZER="$ROOT/models/tiny-qwen3"
if [ -f "$TOKENIZER/tokenizer.json" ]; then
  "$VPY" - "$TOKENIZER" <<'EOF'
import importlib.util, sys
from twinkle.data_format import Message, Trajectory
from twinkle.template import Qwen3_5Template
assert importlib.util.find_spec("torch") is None, "an extra pulled in torch"
template = Qwen3_5Template(sys.argv[1])
feature = template.batch_encode([Trajectory(messages=[Message(role="user", content="Hello!"),
                                                      Message(role="assistant", content="Hi.")])])[0]
assert (feature["labels"] != -100).sum() > 0
print(f"   encoded {feature['length']} tokens; torch absent")
EOF
else
  echo "   (no models/tiny-qwen3: run scripts/setup.sh for the template check)"
fi
current="done"
echo "== check_client_install: PASSED: twinkle-server-client builds, installs and imports cleanly without torch ($(( $(date +%s) - start )) s)"
