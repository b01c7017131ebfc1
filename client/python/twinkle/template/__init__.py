"""Templates: chat template + tokenizer -> InputFeature (token ids and training labels).

Template(model_id) takes a local tokenizer/model directory, or a hub id (ms://Qwen/...) whose
tokenizer files are fetched from the twinkle-server the client is connected to.
"""

from twinkle.template.base import Template
from twinkle.template.qwen import Qwen2_5Template, Qwen3_5Template, Qwen3Template, QwenTemplate

__all__ = ["Qwen2_5Template", "Qwen3Template", "Qwen3_5Template", "QwenTemplate", "Template"]
