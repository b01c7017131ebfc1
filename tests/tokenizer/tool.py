"""Drives build/bin/twinkle-tokenize: a batch of JSON-line requests in, their answers out."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any


class TokenizeTool:
    def __init__(self, binary: Path, tokenizer_json: Path) -> None:
        self.binary = binary
        self.tokenizer_json = tokenizer_json

    def run(self, requests: list[dict[str, Any]], timeout_s: float = 120.0) -> list[dict[str, Any]]:
        """Sends every request in one process and returns the answers in order."""
        payload = "".join(json.dumps(r, ensure_ascii=True) + "\n" for r in requests)
        done = subprocess.run(
            [str(self.binary), str(self.tokenizer_json)], input=payload.encode(), capture_output=True,
            timeout=timeout_s, check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"twinkle-tokenize exited {done.returncode}: {done.stderr.decode(errors='replace')}")
        # split("\n"), not splitlines(): answers hold U+2028, U+0085 and the like unescaped.
        answers = [json.loads(line) for line in done.stdout.decode("utf-8").split("\n") if line]
        if len(answers) != len(requests):
            raise RuntimeError(f"{len(requests)} requests, {len(answers)} answers")
        return answers

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [_field(a, "ids") for a in self.run([{"encode": t} for t in texts])]

    def decode(self, seqs: list[list[int]], skip_special: bool) -> list[str]:
        return [_field(a, "text") for a in self.run([{"decode": s, "skip_special": skip_special} for s in seqs])]

    def stream(self, seqs: list[list[int]], skip_special: bool) -> list[list[str]]:
        return [_field(a, "chunks") for a in self.run([{"stream": s, "skip_special": skip_special} for s in seqs])]

    def close(self) -> None:
        pass


def _field(answer: dict[str, Any], key: str) -> Any:
    if key not in answer:
        raise AssertionError(f"twinkle-tokenize answered {answer}")
    return answer[key]
