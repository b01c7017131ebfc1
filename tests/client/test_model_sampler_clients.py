"""MultiLoraTransformersModel and vLLMSampler against scripted gRPC services: what they send
(HF-style labels, split packed rows, log-probs per trained token, idempotency keys kept across
retries, LoRA configs from peft) and what they return (Twinkle's shapes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from peft import LoraConfig

from fake_server import Failure, Script, default_script, start
from twinkle.data_format import Message, Trajectory
from twinkle.hub import HubNotAvailableError
from twinkle.template import Qwen3_5Template
from twinkle_client import RetryPolicy, _context, init_twinkle_client
from twinkle_client._proto.twinkle.v1 import sampler_pb2, utility_pb2
from twinkle_client.errors import NotConnectedError, UnsupportedFeatureError
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import vLLMSampler


@pytest.fixture
def script(tokenizer_dir: Path) -> Script:
    script = default_script()
    files = [utility_pb2.TokenizerFile(name=p.name, content=p.read_bytes())
             for p in sorted(tokenizer_dir.iterdir())
             if p.name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")]
    script.defaults["GetTokenizerFiles"] = lambda r: utility_pb2.GetTokenizerFilesResponse(files=files)
    return script


@pytest.fixture
def client(script: Script, tmp_path, monkeypatch) -> Iterator:
    monkeypatch.setenv("TWINKLE_CLIENT_CACHE", str(tmp_path / "cache"))
    server, port = start(script)
    client = init_twinkle_client(f"grpc://127.0.0.1:{port}", "key", session_heartbeat_interval=0,
                                 retry=RetryPolicy(jitter=0.0))
    client.call.sleep = lambda s: None
    yield client
    client.close()
    _context.set_current(None)
    server.stop(grace=None)


@pytest.fixture
def template(tokenizer_dir: Path) -> Qwen3_5Template:
    return Qwen3_5Template(str(tokenizer_dir))


def chat(answer: str = "I am fine, thank you.") -> Trajectory:
    return Trajectory(messages=[Message(role="user", content="How are you today?"),
                                Message(role="assistant", content=answer)])


def test_adapter_setup_translates_twinkle_arguments(client, script):
    model = MultiLoraTransformersModel(model_id="ms://Qwen/Qwen3.5-4B")
    model.add_adapter_to_model("default", LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"),
                               gradient_accumulation_steps=2)
    request = script.calls_to("AddAdapter")[0].request
    assert request.adapter_name.startswith("default-") and len(request.adapter_name) == len("default-") + 8
    assert request.session_id == client.session_id and request.gradient_accumulation_steps == 2
    assert (request.config.r, request.config.lora_alpha, list(request.config.target_modules)) == (16, 32.0, [])
    assert model.run_ids["default"] == f"{client.session_id}-{request.adapter_name}"
    model.add_adapter_to_model("other", {"r": 4, "target_modules": ["v_proj", "q_proj"], "lora_dropout": 0.1})
    other = script.calls_to("AddAdapter")[1].request.config
    assert list(other.target_modules) == ["q_proj", "v_proj"] and other.lora_dropout == pytest.approx(0.1)
    model.set_loss("GRPOLoss", epsilon=0.2, beta=0.0, adapter_name="default")
    model.set_optimizer("AdamW", lr=1e-4, betas=(0.9, 0.95), adapter_name="default")
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=5, num_training_steps=100)
    loss = script.calls_to("SetLoss")[0].request
    assert loss.loss_cls == "GRPOLoss" and dict(loss.config) == {"epsilon": 0.2, "beta": 0.0}
    assert loss.adapter_name == request.adapter_name
    optimizer = script.calls_to("SetOptimizer")[0].request
    assert dict(optimizer.config) == pytest.approx({"lr": 1e-4, "beta1": 0.9, "beta2": 0.95})
    assert script.calls_to("SetLrScheduler")[0].request.adapter_name.startswith("other-")  # the last added
    model.set_processor("InputProcessor", padding_side="right")
    with pytest.raises(UnsupportedFeatureError, match="GRPOProcessor"):
        model.set_processor("GRPOProcessor")
    with pytest.raises(UnsupportedFeatureError):
        model.add_adapter_to_model("x", LoraConfig(r=4, modules_to_save=["lm_head"]))
    with pytest.raises(UnsupportedFeatureError):
        model.add_metric("Accuracy")


def test_forward_backward_sends_hf_labels_and_returns_shifted_logps(client, script, template):
    model = MultiLoraTransformersModel("ms://Qwen/Qwen3.5-4B")
    model.add_adapter_to_model("default", LoraConfig(r=8))
    features = template.batch_encode([chat(), chat("Great.")])
    out = model.forward_backward(inputs=features)
    request = script.calls_to("ForwardBackward")[0].request
    for sent, feature in zip(request.inputs, features):
        assert list(sent.input_ids) == feature["input_ids"].tolist()
        shifted = feature["labels"].tolist()
        assert list(sent.labels) == [-100] + shifted[:-1]  # back to HF: labels[i] is token i
    assert out["loss"] == 1.25 and out["metrics"] == {"tokens": 3.0}
    n = len(features[0]["input_ids"])
    server_logps = np.asarray([-0.5 - 0.01 * i for i in range(n)], dtype=np.float32)
    np.testing.assert_allclose(out["logps"][0], server_logps)  # already aligned with the shifted labels
    # A Trajectory is encoded on the client with the model's template (tokenizer from the server).
    model.forward_only(inputs=chat())
    sent = script.calls_to("ForwardOnly")[0].request.inputs[0]
    assert list(sent.input_ids) == features[0]["input_ids"].tolist()


def test_packed_rows_are_split_into_their_sequences(client, script, template):
    model = MultiLoraTransformersModel("tiny")
    model.add_adapter_to_model("default", {"r": 8})
    a, b = template.batch_encode([chat(), chat("Great.")])
    packed = {key: np.concatenate([a[key], b[key]]) for key in ("input_ids", "labels", "position_ids")}
    out = model.forward(inputs=[packed])
    sent = script.calls_to("Forward")[0].request.inputs
    assert [list(s.input_ids) for s in sent] == [a["input_ids"].tolist(), b["input_ids"].tolist()]
    assert len(out["logps"]) == 1 and len(out["logps"][0]) == len(packed["input_ids"])


def test_grpo_inputs_in_every_shape(client, script, template):
    model = MultiLoraTransformersModel("tiny")
    model.add_adapter_to_model("default", {"r": 8})
    features = template.batch_encode([chat(), chat("Great.")])
    trained = [int((f["labels"] != -100).sum()) for f in features]
    sampler_shape = [[[(7, -0.1 * (i + 1))] for i in range(k)] for k in trained]  # [[(token, lp)]] per position
    model.forward_backward(inputs=features, advantages=np.array([0.5, -0.5]), old_logps=sampler_shape)
    request = script.calls_to("ForwardBackward")[0].request
    assert list(request.advantages) == [0.5, -0.5]
    assert [list(v.values) for v in request.old_logps] == [
        pytest.approx([-0.1 * (i + 1) for i in range(k)]) for k in trained]
    full_length = [np.where(f["labels"] != -100, -1.0, 0.0) for f in features]
    model.forward_backward(inputs=features, advantages=[1.0, 1.0], old_logps=full_length)
    assert [list(v.values) for v in script.calls_to("ForwardBackward")[1].request.old_logps] == [
        [-1.0] * k for k in trained]
    with pytest.raises(ValueError, match="log-probs"):
        model.forward_backward(inputs=features, advantages=[1.0, 1.0], old_logps=[[0.0], [0.0]])
    with pytest.raises(ValueError, match="advantages: 1 values for 2 inputs"):
        model.forward_backward(inputs=features, advantages=[1.0])


def test_optimizer_calls_checkpoints_and_retry_keeps_the_idempotency_key(client, script):
    model = MultiLoraTransformersModel("tiny")
    model.add_adapter_to_model("default", {"r": 8})
    script.fail("ForwardBackward", Failure(grpc.StatusCode.UNAVAILABLE, "restarting"))
    model.forward_backward(inputs=[{"input_ids": [1, 2, 3], "labels": [2, 3, -100]}])
    first, second = script.calls_to("ForwardBackward")
    assert first.request.options.idempotency_key == second.request.options.idempotency_key != ""
    assert model.clip_grad_norm(1.0) == 0.75
    model.step()
    model.zero_grad()
    model.lr_step()
    assert model.clip_grad_and_step() == 0.5
    assert model.calculate_metric(is_training=True) == {"loss": "1.2500"}
    assert model.get_train_configs() == "lora r=8"
    state = model.get_state_dict()
    assert state["a.lora_A.weight"].shape == (2, 3)
    path = model.save(name="step-1", save_optimizer=True, consumed_train_samples=16, output_dir="./ignored")
    assert path == "twinkle://run-1/weights/step-1" and path.checkpoint_dir.endswith("step-1")
    save = script.calls_to("Save")[0].request
    assert save.save_optimizer and save.consumed_train_samples == 16
    model.load(path, load_optimizer=True)
    assert script.calls_to("Load")[0].request.name == "twinkle://run-1/weights/step-1"
    assert model.resume_from_checkpoint(path) == {"cur_step": 4, "consumed_train_samples": 32,
                                                  "gradient_accumulation_steps": 2}


def test_model_needs_a_connection(monkeypatch):
    monkeypatch.delenv("TWINKLE_SERVER_URL", raising=False)
    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    _context.set_current(None)
    with pytest.raises(NotConnectedError, match="init_twinkle_client"):
        MultiLoraTransformersModel("ms://Qwen/Qwen3.5-4B")
    with pytest.raises(HubNotAvailableError, match="init_twinkle_client"):
        Qwen3_5Template("ms://Qwen/Qwen3.5-4B")


def test_template_on_a_hub_id_uses_the_servers_tokenizer(client, template):
    remote = Qwen3_5Template("ms://Qwen/Qwen3.5-4B")
    assert remote.batch_encode([chat()])[0]["input_ids"].tolist() == template.batch_encode([chat()])[0]["input_ids"].tolist()
    assert Path(remote.tokenizer.name_or_path).is_relative_to(Path(_context.cache_root()))


def test_sampler_returns_twinkle_shapes_and_training_rows(client, script, template):
    completion = template.tokenizer.encode("Fine, thanks.", add_special_tokens=False)
    completion.append(template.tokenizer.convert_tokens_to_ids("<|im_end|>"))

    def sample(request):
        results = []
        for p in request.prompts:
            seqs = [sampler_pb2.SampledSequence(tokens=completion, logprobs=[-0.25] * len(completion),
                                                stop_reason="stop") for _ in range(request.params.num_samples)]
            results.append(sampler_pb2.PromptResult(sequences=seqs, prompt_logprobs=[float("nan")] + [-1.0] * (
                len(p.tokens) - 1)))
        return sampler_pb2.SampleResponse(results=results)

    script.defaults["Sample"] = sample
    sampler = vLLMSampler(model_id="ms://Qwen/Qwen3.5-4B")
    sampler.set_template("Qwen3_5Template", model_id="ms://Qwen/Qwen3.5-4B")
    prompts = [Trajectory(messages=[Message(role="user", content="How are you?")], user_data=[("ground_truth", "4")]),
               Trajectory(messages=[Message(role="user", content="Hello!")])]
    out = sampler.sample(inputs=prompts, sampling_params={"max_tokens": 16, "temperature": 1.0, "top_p": 0.95,
                                                          "stop": ["\n\n", 2]},
                         adapter_uri="twinkle://run-1/sampler_weights/s0", num_samples=3)
    request = script.calls_to("Sample")[0].request
    assert request.params.num_samples == 3 and request.params.max_tokens == 16
    assert list(request.params.stop) == ["\n\n"] and list(request.params.stop_token_ids) == [2]
    assert script.calls_to("CreateSamplingSession")[0].request.model_path == "twinkle://run-1/sampler_weights/s0"
    assert len(out) == 2 and len(out.get("sequences")) == 6 and len(out["sequences"]) == 6
    seq = out.get("sequences")[0]
    assert seq.get("tokens") == completion and seq.stop_reason == "stop"
    assert [lp[0][1] for lp in seq.logprobs] == [-0.25] * len(completion)
    assert seq.decoded == "Fine, thanks."
    row = seq.get("new_input_feature", seq)
    assert row["messages"][-1] == {"role": "assistant", "content": "Fine, thanks."}
    assert row["user_data"] == [("ground_truth", "4")]
    assert int((row["labels"] != -100).sum()) == len(completion)
    # The sampled rows train directly, with the sampler's log-probs as old_logps.
    model = MultiLoraTransformersModel("ms://Qwen/Qwen3.5-4B")
    model.add_adapter_to_model("default", {"r": 8})
    sequences = out.get("sequences")
    model.forward_backward(inputs=[s.new_input_feature for s in sequences], advantages=[0.0] * 6,
                           old_logps=[s.get("logprobs", []) for s in sequences])
    assert [len(v.values) for v in script.calls_to("ForwardBackward")[0].request.old_logps] == [len(completion)] * 6
    # Same adapter_uri: the session is reused; another one replaces (and closes) it.
    sampler.sample(inputs=prompts[:1], adapter_uri="twinkle://run-1/sampler_weights/s0")
    assert len(script.calls_to("CreateSamplingSession")) == 1
    sampler.sample(inputs=prompts[:1])
    assert len(script.calls_to("CreateSamplingSession")) == 2 and len(script.calls_to("CloseSamplingSession")) == 1
    # repetition_penalty travels (1 = off is sent as 1); a value the server would refuse fails here.
    assert script.calls_to("Sample")[0].request.params.repetition_penalty == 1.0
    sampler.sample(inputs=prompts[:1], sampling_params={"repetition_penalty": 1.1})
    assert script.calls_to("Sample")[-1].request.params.repetition_penalty == pytest.approx(1.1)
    calls = len(script.calls_to("Sample"))
    with pytest.raises(ValueError, match="repetition_penalty"):
        sampler.sample(inputs=prompts, sampling_params={"repetition_penalty": 0.0})
    assert len(script.calls_to("Sample")) == calls


def test_sampler_maps_top_k_logprobs_both_ways(client, script, template):
    """logprobs: k > 1 asks for top-k per generated position (returned in place of the sampled
    token's pair); prompt_logprobs: k also for top-k per prompt position (None at 0); True and
    logprobs: 1 keep the one-token shapes; a width above 20 fails before anything is sent."""
    def sample(request):
        k, pk = request.params.top_logprobs, request.params.prompt_top_logprobs
        results = []
        for p in request.prompts:
            top = [sampler_pb2.TopLogprobs(token_ids=list(range(7, 7 + k)), logprobs=[-0.5 - j for j in range(k)])
                   for _ in range(2)] if k else []
            seqs = [sampler_pb2.SampledSequence(tokens=[7, 8], logprobs=[-0.5, -1.5], stop_reason="length",
                                                top_logprobs=top)]
            prompt_top = ([sampler_pb2.TopLogprobs()] + [
                sampler_pb2.TopLogprobs(token_ids=list(range(pk)), logprobs=[-1.0] * pk)
                for _ in range(len(p.tokens) - 1)]) if pk else []
            results.append(sampler_pb2.PromptResult(
                sequences=seqs, prompt_logprobs=[float("nan")] + [-2.0] * (len(p.tokens) - 1) if
                request.params.prompt_logprobs else [], prompt_top_logprobs=prompt_top))
        return sampler_pb2.SampleResponse(results=results)

    script.defaults["Sample"] = sample
    sampler = vLLMSampler(model_id="ms://Qwen/Qwen3.5-4B")
    sampler.set_template("Qwen3_5Template", model_id="ms://Qwen/Qwen3.5-4B")
    rows = [{"input_ids": [1, 2, 3]}]
    out = sampler.sample(rows, {"max_tokens": 2, "logprobs": 3, "prompt_logprobs": 2})[0]
    params = script.calls_to("Sample")[-1].request.params
    assert (params.top_logprobs, params.prompt_top_logprobs, params.prompt_logprobs) == (3, 2, True)
    assert out.sequences[0].logprobs == [[(7, -0.5), (8, -1.5), (9, -2.5)]] * 2
    assert out.prompt_logprobs == [None, -2.0, -2.0]
    assert out.topk_prompt_logprobs == [None, [(0, -1.0), (1, -1.0)], [(0, -1.0), (1, -1.0)]]
    out = sampler.sample(rows, {"max_tokens": 2, "logprobs": 1, "prompt_logprobs": True})[0]
    params = script.calls_to("Sample")[-1].request.params
    assert (params.top_logprobs, params.prompt_top_logprobs, params.prompt_logprobs) == (0, 0, True)
    assert out.sequences[0].logprobs == [[(7, -0.5)], [(8, -1.5)]] and out.topk_prompt_logprobs is None
    calls = len(script.calls_to("Sample"))
    for bad in ({"logprobs": 21}, {"prompt_logprobs": -1}, {"logprobs": "3"}):
        with pytest.raises(ValueError, match=f"sampling_params.{next(iter(bad))}"):
            sampler.sample(rows, {"max_tokens": 2, **bad})
    assert len(script.calls_to("Sample")) == calls
