"""Raw HTTP edge cases of the Tinker API (tinker-protocol.md §1.5, §5, §6), below the SDK:
error bodies and status codes, idempotent resubmission, seq_id reordering, protobuf content
negotiation, checkpoint ids with a slash."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from e2e_support.server import LaunchServer, ServerProcess
from e2e_support.training import KEYS, auth_overrides
from twinkle_client._proto.tinker.v1 import tinker_public_pb2 as tp

MODEL_NAME = "tiny-qwen3"
SEQ = [11, 42, 7, 99, 123, 5, 64, 300]


@pytest.fixture
def api(launch_server: LaunchServer, tmp_path: Path) -> Any:
    server = launch_server(auth_overrides(storage={"data_dir": str(tmp_path / "data")}))
    return Api(server, KEYS["alice"])


class Api:
    def __init__(self, server: ServerProcess, key: str) -> None:
        self.base = f"http://{server.host}:{server.http_port}/api/v1"
        self.key = key

    def post(self, path: str, body: Any = None, *, headers: dict[str, str] | None = None,
             data: bytes | None = None) -> requests.Response:
        h = {"X-API-Key": self.key, **(headers or {})}
        if data is not None:
            return requests.post(self.base + path, data=data, headers=h, timeout=60)
        return requests.post(self.base + path, json=body if body is not None else {}, headers=h, timeout=60)

    def get(self, path: str) -> requests.Response:
        return requests.get(self.base + path, headers={"X-API-Key": self.key}, timeout=60)

    def delete(self, path: str) -> requests.Response:
        return requests.delete(self.base + path, headers={"X-API-Key": self.key}, timeout=60)

    def result(self, request_id: str, *, proto: bool = False) -> requests.Response:
        headers = {"Accept": "application/x-protobuf"} if proto else {}
        while True:
            r = self.post("/retrieve_future", {"request_id": request_id}, headers=headers)
            assert r.status_code == 200, r.text
            if r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again":
                continue
            return r

    def create_model(self, rank: int = 4) -> str:
        session = self.post("/create_session", {"tags": []}).json()["session_id"]
        promise = self.post("/create_model", {"session_id": session, "model_seq_id": 0, "base_model": MODEL_NAME,
                                              "lora_config": {"rank": rank}}).json()
        return self.result(promise["request_id"]).json()["model_id"]


def fwdbwd_body(model_id: str, seq_id: int, loss: str = "cross_entropy", forward_only: bool = False) -> bytes:
    datum = tp.Datum(
        model_input=[tp.Chunk(encoded_text=tp.EncodedTextChunk(tokens=np.asarray(SEQ[:-1], np.int32).tobytes()))],
        loss_fn_inputs={"target_tokens": tp.Tensor(dense=np.asarray(SEQ[1:], np.int64).tobytes(),
                                                   dtype=tp.DTYPE_INT64, shape=[len(SEQ) - 1])})
    return tp.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, data=[datum], loss_fn=loss,
                                     forward_only=forward_only).SerializeToString()


def assert_json_error(r: requests.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert int(r.headers["content-length"]) > 0
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["detail"]
    return body


def test_errors_have_json_bodies_and_retryable_codes(api: Api) -> None:
    wrong = Api.__new__(Api)
    wrong.base, wrong.key = api.base, "tml-wrong"
    assert_json_error(wrong.post("/create_session", {}), 401)
    assert_json_error(api.post("/create_model", {"session_id": "x"}), 400)  # missing fields
    session = api.post("/create_session", {}).json()["session_id"]
    body = assert_json_error(api.post("/create_model", {"session_id": session, "model_seq_id": 0,
                                                        "base_model": "nope", "lora_config": {"rank": 4}}), 400)
    assert body["category"] == "user"
    assert_json_error(api.post("/create_model", {"session_id": session, "model_seq_id": 1,
                                                 "base_model": MODEL_NAME, "lora_config": {"rank": 100000}}), 400)
    assert_json_error(api.post("/get_info", {"model_id": "no-such-model"}), 404)
    assert_json_error(api.post("/retrieve_future", {"request_id": "tk-nope"}), 404)
    assert_json_error(api.post("/forward_backward", data=b"\xff\xff\xff",
                               headers={"Content-Type": "application/x-protobuf"}), 400)
    assert_json_error(api.post("/session_heartbeat", {"session_id": "s-unknown"}), 404)
    assert_json_error(api.get("/no_such_route"), 404)
    # Telemetry is always accepted.
    assert api.post("/telemetry", {"events": []}).json() == {"status": "accepted"}
    assert wrong.post("/telemetry", {"events": []}).json() == {"status": "accepted"}


def forward_logprobs(api: Api, request_id: str) -> np.ndarray:
    out = tp.ForwardBackwardOutput.FromString(api.result(request_id, proto=True).content)
    return np.frombuffer(out.loss_fn_outputs[0].fields["logprobs"].data, np.float32)


def test_idempotent_resubmission_and_seq_reordering(api: Api) -> None:
    model_id = api.create_model()
    proto = {"Content-Type": "application/x-protobuf"}
    # Sent last-first (as the SDK posts a chunked forward_backward's chunks): seq_id 3, a
    # forward, must see the weights seq_id 2's optim_step wrote from seq_id 1's gradients.
    # Run in arrival order, it would see the initial weights (those of seq_id 1's forward).
    third = api.post("/forward_backward", data=fwdbwd_body(model_id, 3, forward_only=True), headers=proto).json()
    step = api.post("/optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-2}})
    assert step.status_code == 200, step.text
    first = api.post("/forward_backward", data=fwdbwd_body(model_id, 1), headers=proto).json()
    assert len({first["request_id"], step.json()["request_id"], third["request_id"]}) == 3
    # A retry of the same (model_id, seq_id) gets the same request id and runs nothing new.
    again = api.post("/forward_backward", data=fwdbwd_body(model_id, 1), headers=proto).json()
    assert again["request_id"] == first["request_id"]
    assert api.post("/optim_step", {"model_id": model_id, "seq_id": 2,
                                    "adam_params": {"learning_rate": 1e-2}}).json() == step.json()

    out = tp.ForwardBackwardOutput.FromString(api.result(first["request_id"], proto=True).content)
    lp1 = np.frombuffer(out.loss_fn_outputs[0].fields["logprobs"].data, np.float32)
    offsets = np.frombuffer(out.loss_fn_outputs[0].fields["logprobs"].offsets, np.int64)
    assert list(offsets) == [0, 4 * (len(SEQ) - 1)]
    assert out.metrics["loss:sum"] == pytest.approx(-float(lp1.sum()), rel=1e-5)
    assert "metrics" in api.result(step.json()["request_id"]).json()
    lp3 = forward_logprobs(api, third["request_id"])
    # The reference: a forward sent in order after everything, on the same weights.
    fourth = api.post("/forward_backward", data=fwdbwd_body(model_id, 4, forward_only=True), headers=proto).json()
    lp4 = forward_logprobs(api, fourth["request_id"])
    np.testing.assert_array_equal(lp3, lp4)
    assert np.abs(lp3 - lp1).max() > 1e-4, "seq_id 3 ran before the optim_step of seq_id 2"
    # Without Accept: protobuf, the same result as JSON.
    j = api.result(third["request_id"]).json()
    np.testing.assert_array_equal(np.asarray(j["loss_fn_outputs"][0]["logprobs"]["data"], np.float32), lp3)


def test_checkpoint_routes_with_slashes(api: Api) -> None:
    model_id = api.create_model()
    r = api.post("/save_weights", {"model_id": model_id, "seq_id": 1, "path": "c1"}).json()
    assert api.result(r["request_id"]).json()["path"] == f"tinker://{model_id}/weights/c1"
    r = api.post("/save_weights_for_sampler", {"model_id": model_id, "seq_id": 2, "path": "s1"}).json()
    assert api.result(r["request_id"]).json()["path"] == f"tinker://{model_id}/sampler_weights/s1"
    # The same name again without overwrite fails as a user error.
    r = api.post("/save_weights", {"model_id": model_id, "seq_id": 3, "path": "c1"}).json()
    failed = api.result(r["request_id"]).json()
    assert failed["category"] == "user" and "error" in failed

    listed = api.get(f"/training_runs/{model_id}/checkpoints").json()["checkpoints"]
    assert sorted(c["checkpoint_id"] for c in listed) == ["sampler_weights/s1", "weights/c1"]
    info = api.post("/weights_info", {"tinker_path": f"tinker://{model_id}/weights/c1"}).json()
    assert info["lora_rank"] == 4 and info["is_lora"] is True and info["train_mlp"] is True
    assert api.delete(f"/training_runs/{model_id}/checkpoints/weights/c1").status_code == 200
    listed = api.get(f"/training_runs/{model_id}/checkpoints").json()["checkpoints"]
    assert [c["checkpoint_id"] for c in listed] == ["sampler_weights/s1"]
    assert_json_error(api.delete(f"/training_runs/{model_id}/checkpoints/weights/c1"), 404)
    run = api.get(f"/training_runs/{model_id}").json()
    assert run["training_run_id"] == model_id and run["lora_rank"] == 4


def test_model_quota_is_a_lasting_403(launch_server: LaunchServer, tmp_path: Path) -> None:
    overrides = auth_overrides(storage={"data_dir": str(tmp_path / "data")})
    overrides["auth"]["tenants"][0]["quotas"] = {"max_adapters": 1}
    server = launch_server(overrides)
    api = Api(server, KEYS["alice"])
    api.create_model()
    session = api.post("/create_session", {}).json()["session_id"]
    r = api.post("/create_model", {"session_id": session, "model_seq_id": 0, "base_model": MODEL_NAME,
                                   "lora_config": {"rank": 4}})
    body = assert_json_error(r, 403)
    assert body["category"] == "user" and r.headers["x-should-retry"] == "false"
