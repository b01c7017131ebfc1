"""Signed checkpoint downloads are streamed (issue 19, item 2): a checkpoint file of tens of MB
(a rank-1024 LoRA's Adam moments) is sent with its Content-Length and checksum headers while
the coordinator's memory stays far below the file's size; a client that goes away half way,
or one that stops reading, leaves the server serving and holding a couple of chunks, not the
file; a file that fails its checksum on the way is cut short, never sent as whole.

Memory is the coordinator's own (the engine worker is another process): its peak resident
set (VmHWM, reset through /proc/<pid>/clear_refs before each download) and VmRSS sampled
while the bytes flow.
"""

from __future__ import annotations

import base64
import hashlib
import os
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "1")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from e2e_support import paths  # noqa: E402
from e2e_support.server import LaunchServer, ServerProcess  # noqa: E402
from e2e_support.training import KEYS, auth_overrides, resolved  # noqa: E402

MODEL_NAME = "tiny-qwen3"
SEQ = [11, 42, 7, 99, 123, 5, 64, 300, 17, 250]
RANK = 1024  # limits.max_lora_rank's largest value: the biggest adapter the tiny model takes
MIB = 1 << 20
# What one download may add to the coordinator's resident set, whatever the file's size: two
# 1 MiB chunks queued for the socket, the one being read, and the allocator's slack for the
# producer thread's arena (measured: 3-6 MiB). The largest file is over 20 MiB, so a server
# that held the file (or buffered it for a stalled reader) would pass it.
BUDGET = 10 * MIB


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def reset_peak(pid: int) -> None:
    """Resets VmHWM to the current resident set (Linux >= 4.0)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


class RssSampler:
    """Samples a process's VmRSS every few ms on a thread; `peak_kib` is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_kib = status_kib(pid, "VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, status_kib(self.pid, "VmRSS"))
            time.sleep(0.005)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def big(launch_server: LaunchServer, tmp_path: Path) -> dict[str, Any]:
    """A server (auth on) and alice's training checkpoint of a rank-1024 LoRA after one Adam
    step: its signed URLs and recorded checksums."""
    server = launch_server(auth_overrides(storage={"data_dir": str(tmp_path / "data")},
                                          limits={"max_lora_rank": RANK}))
    assert Path(f"/proc/{server.pid}/comm").read_text().strip().startswith("twinkle-server")
    svc = tinker.ServiceClient(base_url=f"http://{server.host}:{server.http_port}", api_key=KEYS["alice"])
    training = svc.create_lora_training_client(base_model=MODEL_NAME, rank=RANK)
    training = resolved(training)
    datum = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                        loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * (len(SEQ) - 1)})
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = training.save_state("big").result().path
    external = training.save_weights_external("bigx").result().path
    model_id = training.get_info().model_id
    answer = requests.get(
        server.http_url(f"/api/v1/training_runs/{model_id}/checkpoints/weights/big/external_weights_urls"),
        headers={"X-API-Key": KEYS["alice"]}, timeout=60)
    assert answer.status_code == 200, answer.text
    signed = answer.json()
    archive = requests.get(server.http_url(f"/api/v1/training_runs/{model_id}/checkpoints/weights/big/archive"),
                           headers={"X-API-Key": KEYS["alice"]}, timeout=60)
    assert archive.status_code == 200, archive.text
    return {"server": server, "path": path, "external": external, "model_id": model_id,
            "urls": signed["urls"],
            "sha256": signed["sha256"], "archive_url": archive.json()["url"], "data": tmp_path / "data"}


def largest(big: dict[str, Any]) -> tuple[str, str]:
    """The optimizer state (two Adam moments per LoRA weight): the checkpoint's largest file."""
    assert "optimizer.safetensors" in big["urls"], sorted(big["urls"])
    return "optimizer.safetensors", big["urls"]["optimizer.safetensors"]


def download(url: str, chunk: int = 64 << 10) -> tuple[bytes, dict[str, str]]:
    with requests.get(url, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        body = b"".join(r.iter_content(chunk))
        return body, dict(r.headers)


def test_a_large_file_streams_with_its_checksum_in_bounded_memory(big: dict[str, Any]) -> None:
    server: ServerProcess = big["server"]
    name, url = largest(big)
    pid = server.pid
    download(big["urls"]["adapter_config.json"])  # warm: threads, arenas, the first connection
    reset_peak(pid)
    before = status_kib(pid, "VmRSS")
    started = time.monotonic()
    with RssSampler(pid) as sampler:
        body, headers = download(url)
    seconds = time.monotonic() - started
    peak = max(status_kib(pid, "VmHWM"), sampler.peak_kib)
    size = len(body)
    digest = hashlib.sha256(body).hexdigest()
    growth_kib = peak - before
    print(f"{name}: {size / MIB:.1f} MiB in {seconds:.2f} s; coordinator VmRSS before {before / 1024:.1f} MiB, "
          f"peak {peak / 1024:.1f} MiB, growth {growth_kib / 1024:.1f} MiB")
    assert size >= 20 * MIB, f"{name} is only {size} bytes: not a large download"
    assert int(headers["Content-Length"]) == size
    assert "chunked" not in headers.get("Transfer-Encoding", "")
    assert headers["X-Checksum-SHA256"] == digest == big["sha256"][name]
    assert headers["Repr-Digest"] == f"sha-256=:{base64.b64encode(bytes.fromhex(digest)).decode()}:"
    assert headers["Cache-Control"] == "no-store"
    # The server holds a couple of 1 MiB chunks per download, never the file.
    assert growth_kib * 1024 < BUDGET < size / 2, (growth_kib, size)

    # The archive (what SDKs <= 0.30 download): streamed the same way, its checksum in the head.
    reset_peak(pid)
    before = status_kib(pid, "VmRSS")
    with RssSampler(pid) as sampler:
        tar, headers = download(big["archive_url"])
    peak = max(status_kib(pid, "VmHWM"), sampler.peak_kib)
    print(f"archive.tar: {len(tar) / MIB:.1f} MiB; coordinator growth {(peak - before) / 1024:.1f} MiB")
    assert headers["X-Checksum-SHA256"] == hashlib.sha256(tar).hexdigest()
    assert int(headers["Content-Length"]) == len(tar)
    assert (peak - before) * 1024 < BUDGET


def test_a_client_that_goes_away_half_way_leaves_the_server_serving(big: dict[str, Any]) -> None:
    server: ServerProcess = big["server"]
    name, url = largest(big)
    pid = server.pid
    download(big["urls"]["adapter_config.json"])
    baseline_fds = open_fds(pid)
    for _ in range(3):
        with requests.get(url, stream=True, timeout=60) as r:
            assert r.status_code == 200
            total = int(r.headers["Content-Length"])
            got = 0
            for piece in r.iter_content(64 << 10):
                got += len(piece)
                if got >= total // 2:
                    break
        # Leaving the block closes the connection with half the body unread.
    # The server noticed (its producers stopped, their sockets closed): fds come back.
    deadline = time.monotonic() + 60
    while open_fds(pid) > baseline_fds and time.monotonic() < deadline:
        time.sleep(0.1)
    assert open_fds(pid) <= baseline_fds, (open_fds(pid), baseline_fds)
    # And the next request is served: the whole file, its checksum right.
    body, headers = download(url)
    assert hashlib.sha256(body).hexdigest() == headers["X-Checksum-SHA256"] == big["sha256"][name]
    assert requests.get(server.http_url("/readyz"), timeout=10).status_code == 200


def test_a_client_that_stops_reading_does_not_make_the_server_buffer_the_file(big: dict[str, Any]) -> None:
    server: ServerProcess = big["server"]
    name, url = largest(big)
    pid = server.pid
    download(big["urls"]["adapter_config.json"])
    parts = requests.utils.urlparse(url)
    reset_peak(pid)
    before = status_kib(pid, "VmRSS")
    slow = socket.create_connection((server.host, server.http_port))
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    try:
        slow.sendall(f"GET {parts.path}?{parts.query} HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += slow.recv(4096)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        size = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")))
        # It reads nothing more: the server fills the socket buffers and stops its producer.
        with RssSampler(pid) as sampler:
            time.sleep(2.0)
        peak = max(status_kib(pid, "VmHWM"), sampler.peak_kib)
        print(f"a stalled reader of a {size / MIB:.1f} MiB file: coordinator growth {(peak - before) / 1024:.1f} MiB")
        assert (peak - before) * 1024 < BUDGET < size / 2
        # Meanwhile the server serves: another client downloads the whole file.
        body, headers = download(url)
        assert hashlib.sha256(body).hexdigest() == headers["X-Checksum-SHA256"] == big["sha256"][name]
        assert requests.get(server.http_url("/readyz"), timeout=10).status_code == 200
    finally:
        slow.close()


def test_a_file_that_fails_its_checksum_is_cut_short(big: dict[str, Any]) -> None:
    """The file changed on disk after it was recorded (same size): the check at its end fails,
    the connection is aborted before the last chunk, so no client gets a whole-looking body."""
    server: ServerProcess = big["server"]
    name, url = largest(big)
    files = [p for p in big["data"].rglob(name) if p.parent.name == "big"]
    assert len(files) == 1, files
    raw = bytearray(files[0].read_bytes())
    raw[len(raw) - 10] ^= 0xFF  # in the last chunk: caught only by the whole-file checksum
    os.chmod(files[0], 0o644)
    files[0].write_bytes(bytes(raw))
    got = 0
    with requests.get(url, stream=True, timeout=60) as r:
        assert r.status_code == 200
        total = int(r.headers["Content-Length"])
        try:
            for piece in r.iter_content(64 << 10):
                got += len(piece)
        except (requests.exceptions.ChunkedEncodingError, requests.exceptions.ConnectionError):
            pass  # urllib3 2 raises IncompleteRead; either way the body is short
    assert got < total, (got, total)
    print(f"a corrupted {total / MIB:.1f} MiB file: the client got {got / MIB:.2f} MiB, then the connection was cut")
    log = server.stderr_text() + server.stdout_path.read_text(errors="replace")
    assert "connection aborted" in log and "does not match its recorded size and SHA-256" in log, server.logs()
    assert requests.get(server.http_url("/readyz"), timeout=10).status_code == 200


COOKBOOK_PYTHON = paths.REPO_ROOT / ".cookbook-venv" / "bin" / "python"
COOKBOOK_DOWNLOAD = """
import sys
from tinker_cookbook import weights
weights.download(tinker_path=sys.argv[1], output_dir=sys.argv[2], base_url=sys.argv[3])
"""


def cookbook_download(server: ServerProcess, tinker_path: str, out: Path) -> subprocess.CompletedProcess[str]:
    """tinker_cookbook.weights.download, unmodified, from the cookbook's own venv."""
    if not COOKBOOK_PYTHON.is_file():
        pytest.fail(f"{COOKBOOK_PYTHON} is missing: run scripts/setup.sh", pytrace=False)
    env = {**os.environ, "TINKER_API_KEY": KEYS["alice"], "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(COOKBOOK_PYTHON), "-c", COOKBOOK_DOWNLOAD, tinker_path, str(out),
                           f"http://{server.host}:{server.http_port}"], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_the_cookbook_downloads_an_export(big: dict[str, Any], tmp_path: Path) -> None:
    """weights.download fetches an external export file by file (urlretrieve, which checks the
    Content-Length); the bytes are the recorded ones. A file cut short by a failed check is an
    error there, never a file. (Its sampler_weights path calls
    RestClient.get_checkpoint_archive_url_from_tinker_path, which the cookbook venv's tinker
    SDK no longer has: it fails in the client before any request; the archive itself is
    tested with the 0.30 CLI in test_hosted_checkpoints.)"""
    server: ServerProcess = big["server"]

    def recorded(tinker_path: str) -> dict[str, str]:
        run, kind, name = tinker_path.removeprefix("tinker://").split("/")
        r = requests.get(server.http_url(f"/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/external_weights_urls"),
                         headers={"X-API-Key": KEYS["alice"]}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["sha256"]

    for label, tinker_path in (("external", big["external"]),):
        out = tmp_path / label.replace(" ", "-")
        result = cookbook_download(server, tinker_path, out)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        sums = recorded(tinker_path)
        got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir() if p.is_file()}
        for name in ("adapter_model.safetensors", "adapter_config.json"):
            assert got[name] == sums[name], (label, name)
        print(f"cookbook weights.download ({label}): adapter_model.safetensors "
              f"{(out / 'adapter_model.safetensors').stat().st_size / MIB:.1f} MiB, checksums match")

    # The export's adapter changed on disk after it was recorded: the download is cut short and
    # the cookbook reports it, writing nothing.
    name = big["external"].rsplit("/", 1)[1]
    files = [p for p in big["data"].rglob("adapter_model.safetensors") if p.parent.name == name]
    assert len(files) == 1, files
    raw = bytearray(files[0].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    os.chmod(files[0], 0o644)
    files[0].write_bytes(bytes(raw))
    out = tmp_path / "corrupted"
    result = cookbook_download(server, big["external"], out)
    assert result.returncode != 0
    assert "WeightsDownloadError" in result.stderr, result.stderr[-4000:]
    assert not (out / "adapter_model.safetensors").exists()
