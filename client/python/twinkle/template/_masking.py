"""Which characters of a rendered conversation belong to assistant turns, and their tokens.

Two ways to find a turn, the first that fits is used:
1. Prefixes: the turn starts where the rendering of the messages before it plus the generation
   prompt ends, and ends where the rendering up to and including it ends. Works for any
   template whose rendering of a prefix of the conversation is a prefix of the whole.
2. Placeholders: every assistant content is replaced by a marker; the text between the
   rendered pieces around the markers, found in order in the real rendering, is the turn (plus
   the end-of-turn token right after it). Works when earlier turns render differently once
   later turns exist (e.g. templates that drop old reasoning).
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
    placeholder_spans: list[Span] | None = None
    spans = []
    for turn, index in enumerate(indices):
        span = _by_prefix(messages, index, text, render)
        if span is None:
            if placeholder_spans is None:
                placeholder_spans = _by_placeholder(messages, indices, text, render, end_of_turn)
            span = placeholder_spans[turn]
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
    messages: Sequence[Mapping[str, Any]], indices: Sequence[int], text: str, render: Render,
    end_of_turn: str | None,
) -> list[Span]:
    dummy = [dict(m) for m in messages]
    markers = [_MARKER.format(n) for n in range(len(indices))]
    for marker, index in zip(markers, indices):
        dummy[index]["content"] = marker
        dummy[index].pop("reasoning_content", None)
    rendered = render(dummy, False)
    pieces = re.split("|".join(re.escape(m) for m in markers), rendered)
    if len(pieces) != len(indices) + 1:
        raise MaskingError(
            f"the chat template rendered {len(pieces) - 1} of {len(indices)} assistant contents verbatim; "
            "cannot tell which tokens are the assistant's"
        )
    if not text.startswith(pieces[0]) or not text.endswith(pieces[-1]):
        raise MaskingError("the chat template renders assistant turns in a way that cannot be aligned")
    spans: list[Span] = []
    position = len(pieces[0])
    tail_start = len(text) - len(pieces[-1])
    for piece in pieces[1:-1]:
        found = text.find(piece, position) if piece else position
        if found < 0 or found > tail_start:
            raise MaskingError("the chat template renders assistant turns in a way that cannot be aligned")
        spans.append(_with_end_of_turn(text, (position, found), end_of_turn))
        position = found + len(piece)
    if tail_start < position:
        raise MaskingError("the chat template renders assistant turns in a way that cannot be aligned")
    spans.append(_with_end_of_turn(text, (position, tail_start), end_of_turn))
    return spans


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
