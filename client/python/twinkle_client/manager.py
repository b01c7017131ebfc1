"""TwinkleClient: the connection, the session that keeps adapters alive, and run management."""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twinkle import get_logger
from twinkle.hub import strip_hub_scheme
from twinkle_client._connection import Endpoint, make_channel, read_certificates, resolve_endpoint
from twinkle_client._rpc import Caller, ProgressCallback, RetryPolicy
from twinkle_client.errors import ServerError
from twinkle_client.types import Checkpoint, Cursor, TrainingRun, TrainingRunsResponse

try:
    from twinkle_client._proto.twinkle.v1 import (
        sampler_pb2_grpc,
        training_pb2,
        training_pb2_grpc,
        utility_pb2,
        utility_pb2_grpc,
    )
except ImportError as exc:  # pragma: no cover - depends on the checkout's state
    raise ImportError("twinkle_client._proto is missing or stale: run client/python/generate_protos.py") from exc

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 600.0
logger = get_logger("twinkle_client")


class TwinkleClient:
    """A connection to twinkle-server (what init_twinkle_client returns).

    Args:
        base_url: http(s)://host:port of the server (the gRPC endpoint is discovered), or
            grpc://host:port / grpcs://host:port. Default: TWINKLE_SERVER_URL, else
            http://127.0.0.1:8000.
        api_key: sent as `authorization: Bearer KEY`. Default: TWINKLE_SERVER_TOKEN.
        session_heartbeat_interval: seconds between session heartbeats (adapters added through
            this client live as long as its session does).
        timeout: deadline of each call in seconds (None: no deadline).
        retry: RetryPolicy for transient failures.
        progress: True (lines on stderr) or a callback(label, elapsed_s) for calls running
            longer than progress_interval seconds.
        root_certificates: PEM bytes or a file path trusted for TLS (default: system roots).
    """

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 session_heartbeat_interval: float = 10.0, timeout: float | None = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy | None = None, progress: bool | ProgressCallback = False,
                 progress_interval: float = 10.0, root_certificates: bytes | str | Path | None = None,
                 create_session: bool = True, **kwargs: Any) -> None:
        self.base_url = base_url or os.environ.get("TWINKLE_SERVER_URL") or DEFAULT_BASE_URL
        self.api_key = api_key if api_key is not None else os.environ.get("TWINKLE_SERVER_TOKEN", "")
        self._root_certificates = read_certificates(root_certificates or os.environ.get("TWINKLE_CA_CERT"))
        self.endpoint: Endpoint = resolve_endpoint(self.base_url, self.api_key, root_certificates=self._root_certificates)
        self.channel = make_channel(self.endpoint, self._root_certificates)
        metadata = [("authorization", f"Bearer {self.api_key}")] if self.api_key else []
        self.call = Caller(metadata, timeout, retry or RetryPolicy(), progress, progress_interval, logger=logger)
        self.training = training_pb2_grpc.TrainingServiceStub(self.channel)
        self.utility = utility_pb2_grpc.UtilityServiceStub(self.channel)
        self.sampler = sampler_pb2_grpc.SamplerServiceStub(self.channel)
        self.closed = False
        self.session_id: str | None = None
        self._tokenizer_dir: Path | None = None
        self._server_info: Any = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        if create_session:
            try:
                self.create_session()
            except BaseException:
                self.close()
                raise
            self._start_heartbeat(session_heartbeat_interval)
        atexit.register(_close_quietly, weakref.ref(self))

    # ---- session -------------------------------------------------------------------------

    def create_session(self, metadata: dict[str, str] | None = None) -> str:
        from twinkle_client import __version__

        meta = {"client": f"twinkle-server-client/{__version__}", **(metadata or {})}
        reply = self.call(self.training.CreateSession, training_pb2.CreateSessionRequest(metadata=meta),
                          name="CreateSession")
        self.session_id = reply.session_id
        return self.session_id

    def _start_heartbeat(self, interval_s: float) -> None:
        if interval_s <= 0:
            return
        ref = weakref.ref(self)
        stop = self._stop

        def beat() -> None:
            while not stop.wait(interval_s):
                client = ref()
                if client is None or client.closed:
                    return
                try:
                    client.call(client.training.SessionHeartbeat,
                                training_pb2.SessionHeartbeatRequest(session_id=client.session_id or ""),
                                name="SessionHeartbeat", timeout_s=min(30.0, interval_s * 3), progress=False)
                except ServerError as exc:
                    logger.warning(f"session heartbeat failed: {exc}")
                del client

        self._heartbeat = threading.Thread(target=beat, name="twinkle-session-heartbeat", daemon=True)
        self._heartbeat.start()

    def close(self) -> None:
        """Stop the heartbeat and close the channel (the session's adapters then expire)."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self.channel.close()

    def __enter__(self) -> TwinkleClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- server facts --------------------------------------------------------------------

    def health_check(self) -> dict[str, str]:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = self.call(stub.Check, health_pb2.HealthCheckRequest(service=""), name="Health/Check", timeout_s=10.0)
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return {"status": "ok" if status == "SERVING" else status.lower()}

    def get_server_info(self) -> Any:
        """twinkle.v1.ServerInfo: model, devices, limits, supported losses."""
        self._server_info = self.call(self.utility.GetServerInfo, utility_pb2.GetServerInfoRequest(),
                                      name="GetServerInfo", timeout_s=30.0)
        return self._server_info

    def get_server_capabilities(self) -> dict[str, Any]:
        info = self.get_server_info()
        names = [m.name for m in info.models] or [info.base_model_id]  # every served base model
        return {"supported_models": [{"model_name": name} for name in names],
                "supported_loss_names": list(info.supported_loss_names), "max_lora_rank": info.max_lora_rank}

    def get_capacity_info(self) -> dict[str, int]:
        """{'max_loras', 'used_loras', 'free_loras'}: adapter slots on the server."""
        reply = self.call(self.utility.GetCapacity, utility_pb2.GetCapacityRequest(), name="GetCapacity",
                          timeout_s=30.0)
        return {"max_loras": reply.max_adapters, "used_loras": reply.used_adapters, "free_loras": reply.free_adapters}

    # ---- runs and checkpoints ------------------------------------------------------------

    def list_training_runs_with_cursor(self, limit: int = 20, offset: int = 0) -> TrainingRunsResponse:
        reply = self.call(self.utility.ListTrainingRuns,
                          utility_pb2.ListTrainingRunsRequest(limit=limit, offset=offset), name="ListTrainingRuns")
        cursor = Cursor(reply.cursor.limit, reply.cursor.offset, reply.cursor.total_count)
        return TrainingRunsResponse([_run(r) for r in reply.training_runs], cursor)

    def list_training_runs(self, limit: int = 20, offset: int = 0, all_users: bool = False) -> list[TrainingRun]:
        """Your training runs, newest first (all_users is accepted; runs are always your own)."""
        return self.list_training_runs_with_cursor(limit, offset).training_runs

    def get_training_run(self, run_id: str) -> TrainingRun:
        return _run(self.call(self.utility.GetTrainingRun, utility_pb2.GetTrainingRunRequest(run_id=run_id),
                              name="GetTrainingRun"))

    def list_checkpoints(self, run_id: str) -> list[Checkpoint]:
        run = self.get_training_run(run_id)
        reply = self.call(self.utility.ListCheckpoints, utility_pb2.ListCheckpointsRequest(run_id=run_id),
                          name="ListCheckpoints")
        return [Checkpoint(checkpoint_id=c.checkpoint_id, checkpoint_type=c.checkpoint_type, time=c.time or None,
                           size_bytes=c.size_bytes, twinkle_path=c.twinkle_path, base_model=run.base_model,
                           is_lora=run.is_lora, lora_rank=run.lora_rank, training_run_id=run_id)
                for c in reply.checkpoints]

    def get_checkpoint_twinkle_path(self, run_id: str, checkpoint_id: str) -> str:
        return f"twinkle://{run_id}/{checkpoint_id}"

    def get_checkpoint_path(self, run_id: str, checkpoint_id: str) -> dict[str, str]:
        """{'twinkle_path': ...} of a checkpoint of yours (NotFoundError otherwise)."""
        for checkpoint in self.list_checkpoints(run_id):
            if checkpoint.checkpoint_id == checkpoint_id:
                return {"twinkle_path": checkpoint.twinkle_path}
        from twinkle_client.errors import NotFoundError

        raise NotFoundError(f"no checkpoint '{checkpoint_id}' in run '{run_id}'", method="get_checkpoint_path")

    def get_latest_checkpoint_path(self, run_id: str) -> str | None:
        checkpoints = [c for c in self.list_checkpoints(run_id) if c.checkpoint_type == "training"]
        return checkpoints[-1].twinkle_path if checkpoints else None

    def find_training_run_by_model(self, base_model: str) -> list[TrainingRun]:
        wanted = strip_hub_scheme(base_model)
        runs, offset = [], 0
        while True:
            page = self.list_training_runs_with_cursor(100, offset)
            runs.extend(r for r in page.training_runs if strip_hub_scheme(r.base_model) == wanted)
            offset += len(page.training_runs)
            if not page.training_runs or offset >= page.cursor.total_count:
                return runs

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> dict[str, Any]:
        """{'success': bool, 'message': str}; NotFoundError for a checkpoint that is not yours."""
        reply = self.call(self.utility.DeleteCheckpoint,
                          utility_pb2.DeleteCheckpointRequest(run_id=run_id, checkpoint_id=checkpoint_id),
                          name="DeleteCheckpoint")
        return {"success": reply.success, "message": reply.message}

    def export_merged_model(self, checkpoint_path: str, name: str) -> dict[str, Any]:
        """Fold a checkpoint into the base weights on the server: {'path', 'size_bytes'}."""
        reply = self.call(self.utility.ExportMergedModel,
                          utility_pb2.ExportMergedModelRequest(checkpoint_path=checkpoint_path, name=name),
                          name="ExportMergedModel")
        return {"path": reply.path, "size_bytes": reply.size_bytes}

    # ---- tokenizer -----------------------------------------------------------------------

    def get_tokenizer_files(self) -> dict[str, bytes]:
        reply = self.call(self.utility.GetTokenizerFiles, utility_pb2.GetTokenizerFilesRequest(),
                          name="GetTokenizerFiles")
        return {f.name: f.content for f in reply.files}

    def tokenizer_dir(self, model_id: str | None = None) -> Path:
        """A local directory with the server's tokenizer (fetched once per client, cached on disk).

        model_id, when given, is compared with the server's model; a different name is logged
        (the server has one base model, and its tokenizer is what the data must use)."""
        if self._tokenizer_dir is None:
            from twinkle_client._context import write_tokenizer_files

            self._tokenizer_dir = write_tokenizer_files(self.get_tokenizer_files())
        if model_id:
            self._warn_if_other_model(model_id)
        return self._tokenizer_dir

    def served_model(self, model_id: str) -> str:
        """The served base model `model_id` names (ms://org/Name, a path or the server's name,
        matched by its last part), or "" for the server's default model when it names none."""
        info = self._server_info or self.get_server_info()
        wanted = strip_hub_scheme(model_id).rstrip("/").split("/")[-1]
        for m in info.models:
            if wanted and wanted in (m.name, m.directory):
                return str(m.name)
        return ""

    def _warn_if_other_model(self, model_id: str) -> None:
        info = self._server_info or self.get_server_info()
        wanted = strip_hub_scheme(model_id).rstrip("/")
        names = {info.base_model_id, info.base_model_name}
        if not any(n and (wanted == n or wanted.split("/")[-1] == n.split("/")[-1]) for n in names):
            logger.warning(f"model_id '{model_id}' is not the server's model ('{info.base_model_id}'); "
                           "using the server's tokenizer")


def _run(r: Any) -> TrainingRun:
    return TrainingRun(
        training_run_id=r.training_run_id, base_model=r.base_model, model_owner=r.model_owner, is_lora=r.is_lora,
        corrupted=r.corrupted, lora_rank=r.lora_rank or None, last_request_time=r.last_request_time or None,
        created_time=r.created_time or None, adapter_name=r.adapter_name or None,
        target_modules=list(r.target_modules), last_checkpoint=r.last_checkpoint or None, last_step=r.last_step)


def _close_quietly(ref: Callable[[], TwinkleClient | None]) -> None:
    client = ref()
    if client is not None:
        try:
            client.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


__all__ = ["DEFAULT_BASE_URL", "TwinkleClient"]
