"""Every module path Twinkle's client scripts import resolves, and none needs torch."""

from __future__ import annotations

import subprocess
import sys

from conftest import CLIENT_DIR

GUIDE_IMPORTS = """
import sys
sys.modules['torch'] = None  # any `import torch` now fails
sys.path.insert(0, {client!r})
from twinkle_client import init_twinkle_client, init_tinker_client
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.dataset import Dataset, DatasetMeta, PackingDataset
from twinkle_client.dataloader import DataLoader
from twinkle_client.sampler import vLLMSampler
from twinkle import get_logger, init_tinker_client
from twinkle.data_format import Message, Trajectory, SamplingParams
from twinkle.dataset import Dataset, DatasetMeta, PackingDataset
from twinkle.dataloader import DataLoader
from twinkle.template import Template, Qwen3_5Template
from twinkle.preprocessor import SelfCognitionProcessor, GSM8KProcessor, CountdownProcessor
from twinkle.preprocessor.llm import GSM8KProcessor
from twinkle.reward import GSM8KAccuracyReward, GSM8KFormatReward, FormatReward
from twinkle.reward.base import Reward
from twinkle.advantage import GRPOAdvantage
from twinkle.metric import CompletionRewardMetric
from twinkle.server.common import input_feature_to_datum
assert 'transformers' not in sys.modules, 'transformers imported eagerly'
print('ok')
"""


def test_guide_imports_resolve_without_torch():
    result = subprocess.run([sys.executable, "-c", GUIDE_IMPORTS.format(client=str(CLIENT_DIR))],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
