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
# Needs PyPI (or a pip cache / index holding those packages); not part of the offline tests.
# Takes about 1-2 minutes with a warm pip cache. Usage: scripts/check_client_install.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/twinkle-client-install.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)
step() { echo "== check_client_install: $1 ($(( $(date +%s) - start )) s)"; }

# Copy the sources so the build never writes into the checkout (egg-info, build/, _proto).
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
step "done: twinkle-server-client installs and imports cleanly"
