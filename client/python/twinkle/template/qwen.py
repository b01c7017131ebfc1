"""Qwen-family templates: ChatML turns (<|im_start|>role ... <|im_end|>).

They use the tokenizer's own chat template (so Qwen3's thinking options apply) and fall back to
plain ChatML when the tokenizer has none. The tokenizer must know <|im_start|> and <|im_end|>.
"""

from __future__ import annotations

from typing import Any

from twinkle.template.base import Template

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class QwenTemplate(Template):
    """ChatML; trains each assistant turn through its <|im_end|>."""

    end_of_turn = IM_END

    def _check_tokenizer(self) -> None:
        tokenizer = self.tokenizer
        vocab: dict[str, Any] = tokenizer.get_vocab()
        missing = [t for t in (IM_START, IM_END) if t not in vocab]
        if missing:
            raise ValueError(f"{type(self).__name__}: the tokenizer of {self.model_id} lacks {missing}")
        if self.use_chat_template and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = CHATML_TEMPLATE
        super()._check_tokenizer()


class Qwen2_5Template(QwenTemplate):
    """Qwen2 / Qwen2.5 chat models."""


class Qwen3Template(QwenTemplate):
    """Qwen3 chat models (enable_thinking=... reaches their chat template)."""


class Qwen3_5Template(Qwen3Template):
    """Qwen3.5 chat models (the name Twinkle's cookbooks use)."""
