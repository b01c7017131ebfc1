"""Drives a real twinkle-engine worker process over its own IPC protocol, from Python.

The harness plays the coordinator's part: it binds the ZeroMQ ROUTER socket, spawns
build/bin/twinkle-engine, accepts its hello, and sends requests. Every number a test checks
comes from the C++ engine (the same binary the server runs); Python only supplies inputs and
independent references (transformers, PEFT, torch.optim).

Body convention: a torch.Tensor anywhere in a request body travels as a raw frame and is
replaced by {"dtype", "shape", "frame"}; in a reply, such maps are turned back into tensors.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

PROTOCOL_VERSION = 1
HELLO, HELLO_ACK, HEARTBEAT, REQUEST, REPLY, SHUTDOWN = 1, 2, 3, 4, 5, 6

_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


class EngineError(RuntimeError):
    """A reply with a non-OK status: `code` is the absl status code."""

    def __init__(self, method: str, code: int, message: str) -> None:
        super().__init__(f"{method}: code {code}: {message}")
        self.code = code
        self.message = message


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def _encode_body(value: Any, frames: list[bytes]) -> Any:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        desc = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "frame": len(frames)}
        # bfloat16 has no numpy dtype: ship its raw 16-bit pattern.
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        frames.append(raw.numpy().tobytes())
        return desc
    if isinstance(value, dict):
        return {k: _encode_body(v, frames) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode_body(v, frames) for v in value]
    return value


def _is_tensor_desc(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"dtype", "shape", "frame"}


def _decode_body(value: Any, frames: list[bytes]) -> Any:
    if _is_tensor_desc(value):
        dtype = _TORCH_DTYPES[value["dtype"]]
        data = bytearray(frames[value["frame"]])
        if dtype == torch.bfloat16:
            t = torch.frombuffer(data, dtype=torch.int16).view(torch.bfloat16) if data else torch.empty(0, dtype=dtype)
        else:
            t = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        return t.reshape(value["shape"])
    if isinstance(value, dict):
        return {k: _decode_body(v, frames) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_body(v, frames) for v in value]
    return value


class Engine:
    """One twinkle-engine worker. Use as a context manager."""

    def __init__(self, device: str = "cpu", binary: Path | None = None, timeout_s: float = 120.0,
                 extra_args: list[str] | None = None, rank: int = 0) -> None:
        self.binary = binary or Path(os.environ.get("TWINKLE_ENGINE_BIN", repo_root() / "build/bin/twinkle-engine"))
        if not self.binary.exists():
            raise FileNotFoundError(f"{self.binary} not found: run ./scripts/setup.sh")
        self.timeout_s = timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="twinkle-harness-")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        endpoint = f"ipc://{self._dir.name}/engine.sock"
        self._sock.bind(endpoint)
        self._identity = f"rank-{rank}-gen-1".encode()
        self._next_id = 1
        self.proc = subprocess.Popen(
            [str(self.binary), "--rank", str(rank), "--endpoint", endpoint, "--identity",
             self._identity.decode(), "--device", device, "--heartbeat-ms", "1000", *(extra_args or [])],
            stdout=subprocess.DEVNULL,
        )
        hello = self._receive(lambda t: t == HELLO)
        assert msgpack.unpackb(hello["b"])["protocol_version"] == PROTOCOL_VERSION
        self._send({"t": HELLO_ACK}, [])

    def _send(self, envelope: dict[str, Any], frames: list[bytes]) -> None:
        full = {"v": PROTOCOL_VERSION, "id": 0, "m": "", "c": 0, "e": "", "b": b""}
        full.update(envelope)
        self._sock.send_multipart([self._identity, msgpack.packb(full, use_bin_type=True), *frames])

    def _receive(self, want: Any) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no answer from twinkle-engine within {self.timeout_s} s")
            if self.proc.poll() is not None:
                raise RuntimeError(f"twinkle-engine exited with {self.proc.returncode}")
            if not self._sock.poll(int(min(remaining, 0.5) * 1000)):
                continue
            parts = self._sock.recv_multipart()
            envelope = msgpack.unpackb(parts[1], raw=False)
            envelope["frames"] = parts[2:]
            if want(envelope["t"]):
                return envelope

    def call(self, method: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """Runs `method` on the engine; returns the reply body with tensors decoded."""
        return self.result(self.submit(method, body))

    def submit(self, method: str, body: dict[str, Any] | None = None) -> int:
        """Sends `method` without waiting (several engines of one process group must each get
        their share of a collective before any can answer); result() collects the reply."""
        frames: list[bytes] = []
        packed = msgpack.packb(_encode_body(body or {}, frames), use_bin_type=True)
        request_id = self._next_id
        self._next_id += 1
        self._pending_method = method
        self._send({"t": REQUEST, "id": request_id, "m": method, "b": packed}, frames)
        return request_id

    def result(self, request_id: int) -> dict[str, Any]:
        method = self._pending_method
        reply = self._receive(lambda t: t == REPLY)
        assert reply["id"] == request_id
        if reply["c"] != 0:
            raise EngineError(method, reply["c"], reply["e"])
        if not reply["b"]:
            return {}
        return _decode_body(msgpack.unpackb(reply["b"], raw=False), reply["frames"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self._send({"t": SHUTDOWN}, [])
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._sock.close()
        self._ctx.term()
        self._dir.cleanup()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()
