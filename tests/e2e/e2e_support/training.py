"""Helpers for tests of the Twinkle-native TrainingService: keys, stubs, inputs, references."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb
from twinkle_client._proto.twinkle.v1 import training_pb2_grpc as tgrpc
from twinkle_client._proto.twinkle.v1 import utility_pb2_grpc as ugrpc

from e2e_support import paths

# Keys look like the tinker SDK's, so the same tenants can use both surfaces.
KEYS: dict[str, str] = {
    "alice": "tml-alice-0123456789abcdef0123456789abcdef",
    "bob": "tml-bob-fedcba9876543210fedcba9876543210",
}


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def resolved(made: Any) -> Any:
    """A tinker training or sampling client from a create_* call, awaited: since 0.38 those
    return a future that still proxies the client's methods (with a deprecation warning);
    older SDKs return the client itself, which has no result()."""
    return made.result() if hasattr(made, "result") else made


def auth_overrides(**extra: Any) -> dict[str, Any]:
    """Config overrides: auth on, tenants alice and bob (digests only, never the keys)."""
    tenants = [{"id": t, "key_sha256": [sha256_hex(k)]} for t, k in KEYS.items()]
    return {"auth": {"enabled": True, "tenants": tenants}, **extra}


class Client:
    """TrainingService + UtilityService stubs that send one tenant's key on every call."""

    def __init__(self, address: str, key: str | None) -> None:
        self.channel = grpc.insecure_channel(address)
        self.training = tgrpc.TrainingServiceStub(self.channel)
        self.utility = ugrpc.UtilityServiceStub(self.channel)
        self.testing = tgrpc.TestingServiceStub(self.channel)
        self.metadata: list[tuple[str, str]] = [("authorization", f"Bearer {key}")] if key else []

    def call(self, method: str, request: Any, timeout: float | None = 60.0) -> Any:
        service = self.testing if method in ("PauseScheduler", "ResumeScheduler", "StepScheduler", "InjectFault") else self.training
        return getattr(service, method)(request, metadata=self.metadata, timeout=timeout)

    def close(self) -> None:
        self.channel.close()


def feature(tokens: Sequence[int], prompt_len: int) -> tpb.InputFeature:
    """input_ids = tokens; labels mask the first prompt_len tokens (-100)."""
    labels = [-100] * prompt_len + list(tokens[prompt_len:])
    return tpb.InputFeature(input_ids=list(tokens), labels=labels)


def batch(seed: int, vocab: int, sequences: int = 2) -> list[tpb.InputFeature]:
    rng = np.random.default_rng(seed)
    out = []
    for s in range(sequences):
        n = int(rng.integers(6, 14))
        out.append(feature(rng.integers(0, vocab, n).tolist(), prompt_len=int(rng.integers(1, n - 2))))
    return out


def state_dict(client: Client, adapter: str) -> dict[str, np.ndarray]:
    reply = client.call("GetStateDict", tpb.AdapterRequest(adapter_name=adapter))
    return {t.name: np.asarray(t.values, dtype=np.float32).reshape(list(t.shape)) for t in reply.tensors}


def engine_harness() -> Any:
    """tests/engine/engine_harness.py: drives a bare twinkle-engine over its IPC, as reference."""
    engine_tests = str(paths.REPO_ROOT / "tests" / "engine")
    if engine_tests not in sys.path:
        sys.path.insert(0, engine_tests)
    import engine_harness

    return engine_harness


def engine_datum(f: tpb.InputFeature) -> dict[str, Any]:
    """The engine datum the server must build from an InputFeature (HF labels, shifted)."""
    import torch

    ids = list(f.input_ids)
    labels = list(f.labels) or ids
    n = len(ids)
    targets, mask = [0] * n, [0.0] * n
    for i in range(n - 1):
        nxt = labels[i + 1]
        targets[i] = ids[i + 1] if nxt == -100 else nxt
        mask[i] = 0.0 if nxt == -100 else 1.0
    return {
        "input_tokens": torch.tensor(ids, dtype=torch.int64),
        "target_tokens": torch.tensor(targets, dtype=torch.int64),
        "inputs": {"mask": torch.tensor(mask, dtype=torch.float32)},
    }
