"""Which characters of a rendered conversation belong to assistant turns, and their tokens.

Two ways to find a turn, the first that fits is used:
1. Prefixes: the turn starts where the rendering of the messages before it plus the generation
   prompt ends, and ends where the rendering up to and including it ends. Works for any
   template whose rendering of a prefix of the conversation is a prefix of the whole.
2. A placeholder: the turn's content is replaced by a marker (everything else as it is) and the
   result rendered; the turn is what lies between the longest common prefix and the longest
   common suffix of that rendering and the real one (plus the end-of-turn token right after
   it). Works when earlier turns render differently once later turns exist (templates that
   drop old reasoning) and when the turn's own rendering depends on its content (Qwen3.5's
   `<think>` block around reasoning: the turn then starts where the real reasoning starts,
   after "<think>\n", as it does after the generation prompt).
Whitespace at the end of a turn (the newline after <|im_end|>) is never trained.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Render = Callable[[Sequence[Mapping[str, Any]], bool], str]
Span = tuple[int, int]

_MARKER = "<<<TWINKLE_ASSISTANT_{}_7f3d2a1b>>>"


class MaskingError(ValueError):
    """The chat template renders assistant turns in a way neither method can locate."""


def assistant_char_spans(
    messages: Sequence[Mapping[str, Any]], text: str, render: Render, end_of_turn: str | None
) -> list[Span]:
    """Character spans of text (the full rendering) to train: one per assistant message."""
    indices = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not indices:
        return []
    spans = []
    for index in indices:
        span = _by_prefix(messages, index, text, render)
        if span is None:
            span = _by_placeholder(messages, index, text, render, end_of_turn)
        spans.append(_trim(text, span))
    return spans


def label_tokens(ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> list[int]:
    """ids where a token starts inside a span, -100 elsewhere."""
    labels = [-100] * len(ids)
    ordered = sorted(spans)
    j = 0
    for k, (start, _end) in enumerate(offsets):
        while j < len(ordered) and ordered[j][1] <= start:
            j += 1
        if j < len(ordered) and ordered[j][0] <= start < ordered[j][1]:
            labels[k] = int(ids[k])
    return labels


def _by_prefix(messages: Sequence[Mapping[str, Any]], index: int, text: str, render: Render) -> Span | None:
    if index == 0:
        return None
    try:
        before = render(messages[:index], True)
        through = render(messages[: index + 1], False)
    except Exception:  # noqa: BLE001 - a template may refuse a partial conversation
        return None
    if not (text.startswith(before) and text.startswith(through) and len(through) >= len(before)):
        return None
    return len(before), len(through)


def _by_placeholder(
    messages: Sequence[Mapping[str, Any]], index: int, text: str, render: Render, end_of_turn: str | None,
) -> Span:
    dummy = [dict(m) for m in messages]
    marker = _MARKER.format(index)
    dummy[index]["content"] = marker
    dummy[index].pop("reasoning_content", None)
    rendered = render(dummy, False)
    if rendered.count(marker) != 1:
        raise MaskingError(
            f"the chat template rendered assistant turn {index}'s content {rendered.count(marker)} times; "
            "cannot tell which tokens are the assistant's"
        )
    before, after = rendered.split(marker)
    start = _common_prefix(before, text)
    end = len(text) - _common_prefix(after[::-1], text[::-1])
    # The rest of the conversation must render as it really does: only this turn differs.
    if not (text.startswith(before[:start]) and text.endswith(after) and start <= end):
        raise MaskingError(f"the chat template renders assistant turn {index} in a way that cannot be aligned")
    return _with_end_of_turn(text, (start, end), end_of_turn)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _with_end_of_turn(text: str, span: Span, end_of_turn: str | None) -> Span:
    start, end = span
    if end_of_turn and text.startswith(end_of_turn, end):
        end += len(end_of_turn)
    return start, end


def _trim(text: str, span: Span) -> Span:
    start, end = span
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end
