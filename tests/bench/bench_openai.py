#!/usr/bin/env python3
"""OpenAI-route benchmark: prints a table, then `BENCH {json}` as the last line.

A real server on the tiny model (models/tiny-qwen3, CPU), N concurrent clients of the
official openai SDK, each sending `--requests` completions of `--max-tokens` tokens
(ignore_eos, so every one generates exactly that many) on token-id prompts; once streaming
(stream: true, time to first token = the first chunk that carries a token) and once not (the
whole answer: its time to first token is its latency), in alternating rounds. Figures: time to first token p50 /
p90, end-to-end tokens/s over all clients, per mode. Figures only: no goals, no assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

import openai  # noqa: E402

from e2e_support import configs, paths  # noqa: E402
from e2e_support.server import ServerProcess, launch  # noqa: E402
from e2e_support.training import sha256_hex  # noqa: E402

KEY = "tml-bench-openai-0123456789abcdef0123456789abcdef"
STARTUP_TIMEOUT_S = 120.0


def binary(name: str) -> Path:
    path = Path(os.environ.get("TWINKLE_BUILD_DIR", str(ROOT / "build"))).resolve() / "bin" / name
    if not os.access(path, os.X_OK):
        sys.exit(f"{path} is not built: run ./scripts/setup.sh (or set TWINKLE_BUILD_DIR)")
    return path


def start_server(workdir: Path, model: Path, clients: int) -> ServerProcess:
    overrides = {
        "auth": {"enabled": True, "tenants": [{"id": "bench", "key_sha256": [sha256_hex(KEY)]}]},
        "logging": {"level": "warning"},
    }
    config = configs.merged(configs.base_config(model), overrides)
    config_path = configs.write_config(workdir / "twinkle.yaml", config)
    server = launch(binary("twinkle-server"), config_path, config, workdir)
    server.wait_ports(STARTUP_TIMEOUT_S)
    server.wait_health("SERVING", STARTUP_TIMEOUT_S)
    return server


def run(server: ServerProcess, model: str, stream: bool, args: argparse.Namespace) -> dict[str, Any]:
    ttft: list[float] = []
    tokens = 0
    lock = threading.Lock()
    errors: list[str] = []

    def client(i: int) -> None:
        nonlocal tokens
        oa = openai.OpenAI(base_url=server.http_url("/v1"), api_key=KEY, max_retries=0, timeout=600)
        prompt = [(7 * i + j) % 500 + 3 for j in range(args.prompt_tokens)]
        for _ in range(args.requests):
            start = time.monotonic()
            first = None
            got = 0
            try:
                if stream:
                    for chunk in oa.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens,
                                                       temperature=0, stream=True, extra_body={"ignore_eos": True}):
                        n = len((chunk.choices[0].model_extra or {}).get("token_ids", [])) if chunk.choices else 0
                        if n and first is None:
                            first = time.monotonic() - start
                        got += n
                else:
                    out = oa.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens,
                                                temperature=0, extra_body={"ignore_eos": True})
                    first = time.monotonic() - start
                    got = out.usage.completion_tokens
            except openai.OpenAIError as e:  # reported, not hidden
                with lock:
                    errors.append(str(e)[:200])
                continue
            with lock:
                ttft.append(first if first is not None else float("nan"))
                tokens += got

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - start
    ttft.sort()
    return {
        "requests": len(ttft),
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
        "seconds": round(seconds, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0,
        "ttft_p50_ms": round(1000 * statistics.median(ttft), 1) if ttft else 0.0,
        "ttft_p90_ms": round(1000 * ttft[int(0.9 * (len(ttft) - 1))], 1) if ttft else 0.0,
    }


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one mode: summed counts and times; the TTFT figures of the median round."""
    seconds = sum(r["seconds"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    mid = sorted(runs, key=lambda r: r["ttft_p50_ms"])[len(runs) // 2]
    return {"requests": sum(r["requests"] for r in runs), "errors": sum(r["errors"] for r in runs),
            "first_error": next((r["first_error"] for r in runs if r["first_error"]), ""),
            "seconds": round(seconds, 2), "tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0,
            "ttft_p50_ms": mid["ttft_p50_ms"], "ttft_p90_ms": mid["ttft_p90_ms"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4, help="requests per client, per mode")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per mode")
    args = parser.parse_args()
    model_dir = paths.reusable_model()
    if model_dir is None or not paths.looks_like_model(model_dir):
        sys.exit("no tiny model: run ./scripts/setup.sh (models/tiny-qwen3) or set TWINKLE_TINY_MODEL")
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="twinkle-bench-openai-") as tmp:
        server = start_server(Path(tmp), model_dir, args.clients)
        try:
            model = openai.OpenAI(base_url=server.http_url("/v1"), api_key=KEY).models.list().data[0].id
            run(server, model, True, argparse.Namespace(**{**vars(args), "requests": 1}))  # warm-up
            # Alternating rounds, so a change in the (shared) machine's load falls on both modes.
            rounds = {True: [], False: []}
            for _ in range(args.rounds):
                for stream in (True, False):
                    rounds[stream].append(run(server, model, stream, args))
            streamed, whole = merge(rounds[True]), merge(rounds[False])
        except BaseException:
            print(server.logs(), file=sys.stderr)
            raise
        finally:
            server.stop()
    load_after = os.getloadavg()
    print(f"server: {binary('twinkle-server')}, model {model_dir.name} (CPU), {args.clients} concurrent openai SDK "
          f"clients x {args.requests} completions of {args.prompt_tokens} prompt + {args.max_tokens} generated tokens, "
          f"{args.rounds} alternating rounds per mode")
    for name, r in (("stream", streamed), ("no stream", whole)):
        print(f"{name:>10}: TTFT p50 {r['ttft_p50_ms']:.1f} ms, p90 {r['ttft_p90_ms']:.1f} ms; "
              f"{r['tokens_per_s']:.0f} tokens/s ({r['requests']} requests, {r['tokens']} tokens in {r['seconds']:.1f} s"
              f"{', ' + str(r['errors']) + ' errors: ' + r['first_error'] if r['errors'] else ''})")
    print(f"load average (1 min) before {load_before[0]:.2f}, after {load_after[0]:.2f}; {os.cpu_count()} CPUs")
    result = {"stream": streamed, "no_stream": whole, "clients": args.clients, "load_before": round(load_before[0], 2),
              "load_after": round(load_after[0], 2), "cpus": os.cpu_count()}
    print("BENCH " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
