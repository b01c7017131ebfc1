"""A small parser for the Prometheus text exposition format (enough for assertions)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)"
    r"(?:\{(?P<labels>.*)\})?"
    r"\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$"
)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    value: float = 0.0


def _parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        match = _LABEL.match(text, pos)
        if match is None:
            raise ValueError(f"bad label set: {{{text}}}")
        value = re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], match.group(2))
        labels[match.group(1)] = value
        pos = match.end()
    return labels


def parse(text: str) -> list[Sample]:
    """Every sample line of a /metrics body; comments (# HELP, # TYPE) are skipped."""
    samples = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"line {number} is not a Prometheus sample: {line!r}")
        labels = _parse_labels(match.group("labels") or "")
        samples.append(Sample(match.group("name"), labels, float(match.group("value"))))
    return samples


def select(samples: Iterable[Sample], name: str, **labels: str) -> list[Sample]:
    """Samples named name whose labels include the given ones."""
    return [
        s
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def value(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """The value of the one sample matching name and labels (AssertionError otherwise)."""
    found = select(samples, name, **labels)
    assert len(found) == 1, f"expected one sample {name}{labels}, found {found}"
    return found[0].value
