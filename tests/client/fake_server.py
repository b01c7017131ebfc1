"""An in-process gRPC server with scripted twinkle.v1 services, for transport-level tests.

Each RPC records (method, request, metadata) and answers from a per-method script: a list of
responses or (StatusCode, message, retry_after) failures consumed in order, then a default.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from twinkle_client._proto.twinkle.v1 import (
    sampler_pb2,
    sampler_pb2_grpc,
    training_pb2,
    training_pb2_grpc,
    utility_pb2,
    utility_pb2_grpc,
)


@dataclass
class Failure:
    code: grpc.StatusCode
    message: str
    retry_after: int | None = None


@dataclass
class Call:
    method: str
    request: Any
    metadata: dict[str, str]


@dataclass
class Script:
    calls: list[Call] = field(default_factory=list)
    queued: dict[str, list[Any]] = field(default_factory=dict)
    defaults: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    delay_s: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, method: str, *failures: Failure) -> None:
        self.queued.setdefault(method, []).extend(failures)

    def calls_to(self, method: str) -> list[Call]:
        return [c for c in self.calls if c.method == method]

    def answer(self, method: str, request: Any, context: grpc.ServicerContext) -> Any:
        with self.lock:
            self.calls.append(Call(method, request, dict(context.invocation_metadata())))
            queued = self.queued.get(method)
            step = queued.pop(0) if queued else None
        if self.delay_s.get(method):
            time.sleep(self.delay_s[method])
        if isinstance(step, Failure):
            if step.retry_after is not None:
                context.set_trailing_metadata((("retry-after", str(step.retry_after)),))
            context.abort(step.code, step.message)
        if step is not None:
            return step
        return self.defaults[method](request)


def _servicer(base: type, script: Script, names: list[str]) -> Any:
    def make(name: str) -> Callable[..., Any]:
        return lambda self, request, context: script.answer(name, request, context)

    return type(f"Scripted{base.__name__}", (base,), {n: make(n) for n in names})()


def _rpc_names(service: Any) -> list[str]:
    return [m.name for m in service.methods]


def start(script: Script) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    for module, pb, name in ((training_pb2_grpc, training_pb2, "TrainingService"),
                             (utility_pb2_grpc, utility_pb2, "UtilityService"),
                             (sampler_pb2_grpc, sampler_pb2, "SamplerService")):
        names = _rpc_names(pb.DESCRIPTOR.services_by_name[name])
        servicer = _servicer(getattr(module, f"{name}Servicer"), script, names)
        getattr(module, f"add_{name}Servicer_to_server")(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def default_script() -> Script:
    """Plausible answers for every RPC the SDK calls."""
    script = Script()
    tp, up, sp = training_pb2, utility_pb2, sampler_pb2
    counter = iter(range(1, 10**6))

    def forward(request: Any) -> Any:
        sequences = [tp.SequenceOutput(logps=[-0.5 - 0.01 * i for i in range(len(f.input_ids))])
                     for f in request.inputs]
        return tp.ForwardResponse(result=tp.ModelOutput(sequences=sequences, loss=1.25, metrics={"tokens": 3.0}))

    script.defaults.update({
        "CreateSession": lambda r: tp.CreateSessionResponse(session_id=f"s{next(counter)}-abcdef01"),
        "SessionHeartbeat": lambda r: tp.SessionHeartbeatResponse(),
        "AddAdapter": lambda r: tp.AddAdapterResponse(adapter_name=r.adapter_name, num_parameters=1234,
                                                      run_id=f"{r.session_id}-{r.adapter_name}"),
        "RemoveAdapter": lambda r: tp.Empty(),
        "SetLoss": lambda r: tp.Empty(),
        "SetOptimizer": lambda r: tp.Empty(),
        "SetLrScheduler": lambda r: tp.Empty(),
        "Forward": forward,
        "ForwardOnly": forward,
        "ForwardBackward": forward,
        "CalculateLoss": lambda r: tp.ScalarResponse(value=1.25),
        "Backward": lambda r: tp.Empty(),
        "ClipGradNorm": lambda r: tp.ScalarResponse(value=0.75),
        "Step": lambda r: tp.ScalarResponse(),
        "ZeroGrad": lambda r: tp.ScalarResponse(),
        "LrStep": lambda r: tp.ScalarResponse(),
        "ClipGradAndStep": lambda r: tp.ScalarResponse(value=0.5),
        "CalculateMetric": lambda r: tp.MetricResponse(result={"loss": "1.2500"}),
        "GetTrainConfigs": lambda r: tp.TextResponse(result="lora r=8"),
        "GetStateDict": lambda r: tp.StateDictResponse(
            tensors=[tp.NamedTensor(name="a.lora_A.weight", shape=[2, 3], values=[float(i) for i in range(6)])]),
        "Save": lambda r: tp.SaveResponse(twinkle_path=f"twinkle://run-1/weights/{r.name or 'x'}",
                                          checkpoint_dir=f"/data/run-1/weights/{r.name or 'x'}"),
        "Load": lambda r: tp.Empty(),
        "ResumeFromCheckpoint": lambda r: tp.ResumeResponse(cur_step=4, consumed_train_samples=32,
                                                            gradient_accumulation_steps=2),
        "GetServerInfo": lambda r: up.ServerInfo(base_model_id="tiny-qwen3", base_model_name="tiny-qwen3",
                                                 supported_loss_names=["cross_entropy"], max_lora_rank=32),
        "GetCapacity": lambda r: up.Capacity(max_adapters=8, used_adapters=3, free_adapters=5),
        "ListTrainingRuns": lambda r: up.ListTrainingRunsResponse(
            training_runs=[up.TrainingRun(training_run_id="s1-abc-default", base_model="tiny-qwen3",
                                          model_owner="alice", is_lora=True, lora_rank=8,
                                          last_request_time="2026-01-01T00:00:00Z", adapter_name="default",
                                          target_modules=["q_proj"], last_checkpoint="twinkle://s1-abc-default/weights/a")],
            cursor=up.Cursor(limit=r.limit or 20, offset=r.offset, total_count=1)),
        "GetTrainingRun": lambda r: up.TrainingRun(training_run_id=r.run_id, base_model="tiny-qwen3",
                                                   model_owner="alice", is_lora=True, lora_rank=8),
        "ListCheckpoints": lambda r: up.ListCheckpointsResponse(checkpoints=[
            up.Checkpoint(checkpoint_id="weights/a", checkpoint_type="training", time="2026-01-01T00:00:00Z",
                          size_bytes=10, twinkle_path=f"twinkle://{r.run_id}/weights/a")]),
        "DeleteCheckpoint": lambda r: up.DeleteCheckpointResponse(success=True, message="deleted"),
        "GetTokenizerFiles": lambda r: up.GetTokenizerFilesResponse(),
        "CreateSamplingSession": lambda r: sp.SamplingSession(sampling_session_id=f"ss{next(counter)}",
                                                              base_model="tiny-qwen3", model_path=r.model_path),
        "CloseSamplingSession": lambda r: tp.Empty(),
    })
    return script
