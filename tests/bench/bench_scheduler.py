#!/usr/bin/env python3
"""Scheduler benchmark: prints a table, then `BENCH {json}` as the last line.

Figures (goals beside them are printed, never asserted):
  jain, flood_share, flood_p99_ratio   the scheduler's policy against a simulated engine
                        (build/bin/scheduler_bench, its BENCH_SCHED line; definitions there)
  fused_vs_unfused      the FULL server (twinkle-server + its twinkle-engine worker, CPU, the
                        tiny model): 8 tenants (auth on, one key each), one adapter each, one
                        closed-loop client thread each sending ForwardBackward of one
                        32-token sequence; served tokens/s with scheduler.fuse true / false
  noop_p50_us           a C++ gRPC client (build/bin/noop_latency): UtilityService/GetCapacity
                        with a tenant's key (auth on), 1000 warm-up then 5000 timed calls
Binaries come from $TWINKLE_BUILD_DIR (default build/); the model from $TWINKLE_TINY_MODEL
(default models/tiny-qwen3).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
sys.path.insert(0, str(ROOT / "client" / "python"))

import generate_protos  # noqa: E402  (client/python/generate_protos.py)

generate_protos.ensure_generated()

import requests  # noqa: E402
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb  # noqa: E402

from e2e_support import configs, paths, prom  # noqa: E402
from e2e_support.server import ServerProcess, launch  # noqa: E402
from e2e_support.training import Client, sha256_hex  # noqa: E402

GOALS = {"jain": (">=", 0.95), "flood_share": (">=", 0.45), "flood_p99_ratio": ("<=", 2.0),
         "fused_vs_unfused": (">=", 2.0), "noop_p50_us": ("<=", 150.0)}
STARTUP_TIMEOUT_S = 120.0


def build_dir() -> Path:
    return Path(os.environ.get("TWINKLE_BUILD_DIR", str(ROOT / "build"))).resolve()


def binary(name: str) -> Path:
    path = build_dir() / "bin" / name
    if not os.access(path, os.X_OK):
        sys.exit(f"{path} is not built: run ./scripts/setup.sh (or set TWINKLE_BUILD_DIR)")
    return path


def goal_text(key: str, value: float) -> str:
    op, target = GOALS[key]
    met = value >= target if op == ">=" else value <= target
    return f"(goal {'≥' if op == '>=' else '≤'} {target:g}: {'met' if met else 'NOT met'})"


# ---- the policy bench --------------------------------------------------------------------------

def policy_bench() -> dict[str, Any]:
    run = subprocess.run([str(binary("scheduler_bench"))], capture_output=True, text=True, timeout=300, check=False)
    if run.returncode != 0:
        sys.exit(f"scheduler_bench failed ({run.returncode}):\n{run.stdout}\n{run.stderr}")
    figures = None
    for line in run.stdout.splitlines():
        if line.startswith("BENCH_SCHED "):
            figures = json.loads(line[len("BENCH_SCHED "):])
        else:
            print(f"  {line}")
    if figures is None:
        sys.exit(f"scheduler_bench printed no BENCH_SCHED line:\n{run.stdout}")
    return figures


# ---- the full server ---------------------------------------------------------------------------

def tenant_keys(n: int) -> dict[str, str]:
    return {f"tenant{i}": f"tml-bench-tenant{i}-{i:02d}0123456789abcdef0123456789ab" for i in range(n)}


def start_server(workdir: Path, model: Path, keys: dict[str, str], fuse: bool) -> ServerProcess:
    overrides = {
        "auth": {"enabled": True, "tenants": [{"id": t, "key_sha256": [sha256_hex(k)]} for t, k in keys.items()]},
        "scheduler": {"fuse": fuse},
        "logging": {"level": "warning"},
    }
    config = configs.merged(configs.base_config(model), overrides)
    config_path = configs.write_config(workdir / "twinkle.yaml", config)
    server = launch(binary("twinkle-server"), config_path, config, workdir)
    server.wait_ports(STARTUP_TIMEOUT_S)
    server.wait_health("SERVING", STARTUP_TIMEOUT_S)
    return server


def sequence(tenant: int, tokens: int, vocab: int) -> tpb.InputFeature:
    ids = [(17 * tenant + 7 * i + 3) % vocab for i in range(tokens)]
    return tpb.InputFeature(input_ids=ids, labels=ids)


def fused_histogram(server: ServerProcess) -> tuple[float, float, float]:
    """(adapters sum, step count, forward_backward tokens) from /metrics."""
    samples = prom.parse(requests.get(server.http_url("/metrics"), timeout=10).text)

    def one(name: str, **labels: str) -> float:
        found = prom.select(samples, name, **labels)
        return found[0].value if found else 0.0

    return (one("twinkle_fused_step_adapters_sum", kind="forward_backward"),
            one("twinkle_fused_step_adapters_count", kind="forward_backward"),
            one("twinkle_tokens_total", kind="forward_backward"))


class Tenants:
    """One client per tenant, each with one adapter ("bench") on `server`, warmed up."""

    def __init__(self, server: ServerProcess, keys: dict[str, str], tokens: int, vocab: int) -> None:
        self.server = server
        self.tokens = tokens
        self.clients = [Client(server.grpc_address, key) for key in keys.values()]
        self.requests = [tpb.ForwardRequest(adapter_name="bench", inputs=[sequence(i, tokens, vocab)])
                         for i in range(len(self.clients))]
        for i, client in enumerate(self.clients):
            client.call("AddAdapter", tpb.AddAdapterRequest(
                adapter_name="bench", config=tpb.LoraConfig(r=8, lora_alpha=16, seed=i)))
            for _ in range(2):  # warm-up: residency, first-step allocations
                client.call("ForwardBackward", self.requests[i])
        self.counts = [0] * len(self.clients)
        self.latencies: list[float] = []
        self.seconds = 0.0
        self.steps = 0.0
        self.adapters = 0.0
        self.server_tokens = 0.0

    def round(self, seconds: float) -> None:
        """Every tenant's thread keeps one ForwardBackward in flight until `seconds` pass;
        the round ends when the last request in flight has returned (its time counts)."""
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(self.clients) + 1)
        stop_at = [0.0]
        lock = threading.Lock()

        def work(i: int) -> None:
            try:
                barrier.wait()
                while time.perf_counter() < stop_at[0]:
                    t = time.perf_counter()
                    self.clients[i].call("ForwardBackward", self.requests[i], timeout=120)
                    with lock:
                        self.latencies.append(time.perf_counter() - t)
                        self.counts[i] += 1
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(self.clients))]
        for thread in threads:
            thread.start()
        before = fused_histogram(self.server)
        start = time.perf_counter()
        stop_at[0] = start + seconds
        barrier.wait()
        for thread in threads:
            thread.join(timeout=seconds + 300)
        self.seconds += time.perf_counter() - start
        after = fused_histogram(self.server)
        if errors:
            raise errors[0]
        self.adapters += after[0] - before[0]
        self.steps += after[1] - before[1]
        self.server_tokens += after[2] - before[2]

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        served = sum(self.counts) * self.tokens
        return {
            "requests": sum(self.counts),
            "per_tenant": list(self.counts),
            "tokens_per_s": served / self.seconds if self.seconds else 0.0,
            "served_tokens": served,
            "server_tokens": self.server_tokens,
            "seconds": self.seconds,
            "steps": self.steps,
            "adapters_per_step": self.adapters / self.steps if self.steps else 0.0,
            "latency_p50_ms": 1000 * lat[len(lat) // 2] if lat else 0.0,
        }


def noop_latency(server: ServerProcess, key: str, calls: int) -> dict[str, Any]:
    run = subprocess.run([str(binary("noop_latency")), "--target", server.grpc_address, "--key", key,
                          "--warmup", "1000", "--calls", str(calls), "--deadline-ms", "2000"],
                         capture_output=True, text=True, timeout=300, check=False)
    if run.returncode != 0:
        sys.exit(f"noop_latency failed ({run.returncode}):\n{run.stdout}\n{run.stderr}")
    for line in run.stdout.splitlines():
        if line.startswith("NOOP "):
            return json.loads(line[len("NOOP "):])
    sys.exit(f"noop_latency printed no NOOP line:\n{run.stdout}")


def server_runs(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Both servers run at once (an idle one costs next to nothing); the closed-loop rounds
    alternate fused, unfused, fused, ... so that a change in the machine's load (it is
    shared) falls on both alike."""
    model = paths.reusable_model()
    if model is None or not paths.looks_like_model(model):
        sys.exit("no tiny model: run ./scripts/setup.sh (models/tiny-qwen3) or set TWINKLE_TINY_MODEL")
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    keys = tenant_keys(args.tenants)
    servers: dict[bool, ServerProcess] = {}
    with tempfile.TemporaryDirectory(prefix="twinkle-bench-sched-") as tmp:
        try:
            for fuse in (True, False):
                servers[fuse] = start_server(Path(tmp) / ("fused" if fuse else "unfused"), model, keys, fuse)
            loads = {fuse: Tenants(server, keys, args.tokens, vocab) for fuse, server in servers.items()}
            for _ in range(args.rounds):
                for fuse in (True, False):
                    loads[fuse].round(args.seconds / args.rounds)
            for load in loads.values():
                load.close()
            # On the idle fused server, after the load.
            noop = noop_latency(servers[True], next(iter(keys.values())), args.noop_calls)
        except BaseException:
            for server in servers.values():
                print(server.logs(), file=sys.stderr)
            raise
        finally:
            for server in servers.values():
                server.stop()
    return loads[True].summary(), loads[False].summary(), noop


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per ForwardBackward (one sequence)")
    parser.add_argument("--seconds", type=float, default=20.0, help="closed-loop time per server, in all")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds the time is split into")
    parser.add_argument("--noop-calls", type=int, default=5000)
    args = parser.parse_args()

    print(f"policy: {binary('scheduler_bench')} (simulated engine)")
    policy = policy_bench()
    print(f"server: {binary('twinkle-server')}, {args.tenants} tenants x 1 adapter, closed loop, "
          f"ForwardBackward of 1 x {args.tokens} tokens, {args.seconds:g} s per server in {args.rounds} "
          f"alternating rounds, CPU")
    fused, unfused, noop = server_runs(args)
    ratio = fused["tokens_per_s"] / unfused["tokens_per_s"] if unfused["tokens_per_s"] else 0.0

    result = {
        "jain": round(policy["jain"], 5),
        "flood_share": round(policy["flood_share"], 4),
        "flood_p99_ratio": round(policy["flood_p99_ratio"], 3),
        "fused_vs_unfused": round(ratio, 3),
        "noop_p50_us": round(noop["p50_us"], 1),
        "noop_p99_us": round(noop["p99_us"], 1),
        "fused_tokens_per_s": round(fused["tokens_per_s"], 1),
        "unfused_tokens_per_s": round(unfused["tokens_per_s"], 1),
        "fused_adapters_per_step": round(fused["adapters_per_step"], 2),
        "unfused_adapters_per_step": round(unfused["adapters_per_step"], 2),
        "burst_p99_ratio": round(policy.get("burst_p99_ratio", 0.0), 3),
        "jain_mixed_sizes": round(policy.get("jain_mixed_sizes", 0.0), 5),
        "tenants": args.tenants,
        "tokens_per_request": args.tokens,
        "cpus": os.cpu_count(),
    }
    rows = [
        ("Jain index, 4 equal backlogged tenants", f"{result['jain']:.4f}  {goal_text('jain', result['jain'])}"),
        ("light tenant's share vs 50x flooder", f"{result['flood_share'] * 100:.1f} %  "
                                                 f"{goal_text('flood_share', result['flood_share'])}"),
        ("light p99 queue wait, flooder / alone", f"{result['flood_p99_ratio']:.2f}x  "
                                                   f"{goal_text('flood_p99_ratio', result['flood_p99_ratio'])}; an even split "
                                                   "predicts ~2"),
        ("  (bursty light tenant, for reference)", f"{result['burst_p99_ratio']:.2f}x  (an even split predicts ~4)"),
        ("server fused tokens/s", f"{fused['tokens_per_s']:.0f} tok/s  ({fused['requests']} requests in "
                                  f"{fused['seconds']:.1f} s, p50 {fused['latency_p50_ms']:.1f} ms)"),
        ("server unfused tokens/s", f"{unfused['tokens_per_s']:.0f} tok/s  ({unfused['requests']} requests in "
                                    f"{unfused['seconds']:.1f} s, p50 {unfused['latency_p50_ms']:.1f} ms)"),
        ("fused / unfused", f"{ratio:.2f}x  {goal_text('fused_vs_unfused', ratio)}"),
        ("mean adapters per fused step", f"{fused['adapters_per_step']:.2f}  (of {args.tenants}; unfused "
                                         f"{unfused['adapters_per_step']:.2f})"),
        ("requests per tenant, fused", " ".join(str(c) for c in fused["per_tenant"])),
        ("no-op RPC (GetCapacity, key) p50", f"{noop['p50_us']:.1f} us  {goal_text('noop_p50_us', noop['p50_us'])}"),
        ("no-op RPC p90 / p99", f"{noop['p90_us']:.1f} us / {noop['p99_us']:.1f} us  ({noop['calls']} calls)"),
        ("machine", f"{os.cpu_count()} CPUs, CPU only; engine threads: "
                    f"{os.environ.get('OMP_NUM_THREADS', 'LibTorch default (one per CPU)')}"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    if fused["served_tokens"] != fused["server_tokens"] or unfused["served_tokens"] != unfused["server_tokens"]:
        print(f"note: server counted {fused['server_tokens']:.0f} / {unfused['server_tokens']:.0f} tokens, "
              f"clients {fused['served_tokens']} / {unfused['served_tokens']}")
    print("BENCH " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
