"""The OpenAI-compatible routes (/v1/models, /v1/completions, /v1/chat/completions) driven by
the official openai SDK (pinned in scripts/requirements.txt) against a real server on the tiny
model, with the tinker SDK's sampler as the reference for the same prompt tokens.

Token ids come back in each choice's `token_ids` (vLLM's field), so every output is checked
against the Tinker sampler's tokens, not against a re-implementation in the test.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import requests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "1")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from e2e_support import configs, prom  # noqa: E402
from e2e_support.server import LaunchServer, ServerProcess, launch, stop_all  # noqa: E402
from e2e_support.training import KEYS, auth_overrides, resolved  # noqa: E402
from e2e_support.waiting import scaled  # noqa: E402

MODEL = "tiny-qwen3"
PROMPT = [11, 42, 7, 99, 123, 5, 64, 300]
MAX_N = 4  # sampler.max_num_samples on the test server
MAX_POSITIONS = 512  # the tiny model's max_position_embeddings
MAX_BODY_BYTES = 4 << 20  # server/openai/openai_routes.h kMaxBodyBytes


@pytest.fixture(scope="module")
def oa_server(server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("openai-server")
    overrides = auth_overrides(storage={"data_dir": str(workdir / "data")}, sampler={"max_num_samples": MAX_N})
    config = configs.merged(configs.base_config(tiny_model), overrides)
    config_path = configs.write_config(workdir / "twinkle.yaml", config)
    server = launch(server_bin, config_path, config, workdir)
    try:
        server.wait_ports(scaled(120))
        server.wait_health("SERVING", scaled(120))
        yield server
    finally:
        stop_all([server])


def client(server: ServerProcess, key: str = KEYS["alice"]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url("/v1"), api_key=key, max_retries=0, timeout=120)


def tinker_service(server: ServerProcess, key: str = KEYS["alice"]) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=f"http://{server.host}:{server.http_port}", api_key=key)


def token_ids(choice: Any) -> list[int]:
    return list((choice.model_extra or {})["token_ids"])


def tinker_greedy(server: ServerProcess, prompt: list[int], max_tokens: int) -> Any:
    sampler = tinker_service(server).create_sampling_client(base_model=MODEL)
    sampler = resolved(sampler)
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params).result()
    return out.sequences[0]


def metrics(server: ServerProcess) -> list[prom.Sample]:
    return prom.parse(requests.get(server.http_url("/metrics"), timeout=10).text)


def sampler_idle(server: ServerProcess) -> bool:
    samples = metrics(server)
    return (
        prom.value(samples, "twinkle_sampler_rows", state="running") == 0
        and prom.value(samples, "twinkle_sampler_rows", state="waiting") == 0
        and prom.value(samples, "twinkle_sampler_kv_blocks", state="in_use") == 0
    )


def wait_idle(server: ServerProcess, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while not sampler_idle(server):
        assert time.monotonic() < deadline, "the sampler did not return to idle"
        time.sleep(0.05)


def post(server: ServerProcess, path: str, body: bytes | dict[str, Any], key: str | None = KEYS["alice"]) -> requests.Response:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(server.http_url(path), data=data, headers=headers, timeout=60)


def assert_openai_error(response: requests.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- routes, with the SDK ---------------------------------------------------------------------


def test_greedy_completion_equals_tinker_sampler_and_usage_is_exact(oa_server: ServerProcess) -> None:
    reference = tinker_greedy(oa_server, PROMPT, 24)
    generated_before = prom.value(metrics(oa_server), "twinkle_sampler_tokens_total")
    out = client(oa_server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    # Metered like Tinker's sampling: the sampler's generated-token counter moves by exactly this.
    generated = prom.value(metrics(oa_server), "twinkle_sampler_tokens_total") - generated_before
    assert generated == len(reference.tokens)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    (choice,) = out.choices
    assert token_ids(choice) == list(reference.tokens)
    assert choice.finish_reason == ("length" if reference.stop_reason == "length" else "stop")
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(PROMPT)
    assert out.usage.completion_tokens == len(reference.tokens)
    assert out.usage.total_tokens == len(PROMPT) + len(reference.tokens)


def test_n_and_several_prompts_and_seed(oa_server: ServerProcess) -> None:
    oa = client(oa_server)
    prompts = [PROMPT, PROMPT[:3]]
    out = oa.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=8, temperature=1.0, seed=7)
    assert [c.index for c in out.choices] == list(range(6))
    generated = [token_ids(c) for c in out.choices]
    assert out.usage.prompt_tokens == len(PROMPT) + 3
    assert out.usage.completion_tokens == sum(len(g) for g in generated)
    again = oa.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=8, temperature=1.0, seed=7)
    assert [token_ids(c) for c in again.choices] == generated  # seeded: reproducible


def test_logprobs_match_tinker(oa_server: ServerProcess) -> None:
    reference = tinker_greedy(oa_server, PROMPT, 10)
    out = client(oa_server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)
    (choice,) = out.choices
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == len(reference.tokens)
    assert lp.token_logprobs == pytest.approx(list(reference.logprobs), abs=1e-4)
    assert lp.tokens == [f"token_id:{t}" for t in reference.tokens] or all(isinstance(t, str) for t in lp.tokens)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the chosen is the top one
    assert lp.text_offset == sorted(lp.text_offset)


def test_stop_token_ids_and_stop_strings(oa_server: ServerProcess, tiny_model: Path) -> None:
    from tokenizers import Tokenizer

    reference = list(tinker_greedy(oa_server, PROMPT, 24).tokens)
    assert len(reference) >= 6, "the tiny model stopped too early for this test"
    oa = client(oa_server)
    at = reference[4]
    first = reference.index(at)
    out = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                extra_body={"stop_token_ids": [at]})
    assert token_ids(out.choices[0]) == reference[: first + 1]
    assert out.choices[0].finish_reason == "stop"
    # A stop string: the text of tokens 3..4; generation ends with the token that completes it.
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    text = tok.decode(reference, skip_special_tokens=False)
    piece = tok.decode(reference[:5], skip_special_tokens=False)[len(tok.decode(reference[:3], skip_special_tokens=False)):]
    if not piece.strip():
        pytest.skip("the greedy text has no usable stop string")  # pragma: no cover
    cut = text.index(piece) + len(piece)
    expected = next(n for n in range(1, len(reference) + 1) if len(tok.decode(reference[:n], skip_special_tokens=False)) >= cut)
    out = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[piece])
    assert token_ids(out.choices[0]) == reference[:expected]
    assert out.choices[0].finish_reason == "stop"
    assert piece not in out.choices[0].text


def test_stream_chunks_usage_and_done(oa_server: ServerProcess) -> None:
    reference = tinker_greedy(oa_server, PROMPT, 32)
    arrivals: list[tuple[float, Any]] = []
    stream = client(oa_server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": False},
    )
    for chunk in stream:
        arrivals.append((time.monotonic(), chunk))
    chunks = [c for _, c in arrivals]
    content = [c for c in chunks if c.choices]
    usage = [c for c in chunks if c.usage is not None]
    streamed = [t for c in content for t in token_ids(c.choices[0])]
    assert streamed == list(reference.tokens)
    # Flushed per decode step: several chunks, the first before the one that finishes.
    assert len([c for c in content if token_ids(c.choices[0])]) >= 2
    finish = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason is not None]
    assert len(finish) == 1
    first_tokens = next(i for i, c in enumerate(chunks) if c.choices and token_ids(c.choices[0]))
    assert first_tokens < finish[0]
    assert arrivals[first_tokens][0] <= arrivals[finish[0]][0]
    # The usage chunk is last, with no choices, and exact.
    assert len(usage) == 1 and chunks[-1] is usage[0] and not usage[0].choices
    assert usage[0].usage.prompt_tokens == len(PROMPT)
    assert usage[0].usage.completion_tokens == len(reference.tokens)


def test_stream_raw_sse_ends_with_done(oa_server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True, "n": 2}
    with requests.post(oa_server.http_url("/v1/completions"), json=body, stream=True, timeout=60,
                       headers={"Authorization": f"Bearer {KEYS['alice']}"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    assert sum(1 for c in chunks if c["choices"][0]["finish_reason"]) == 2


def test_disconnect_mid_stream_frees_the_rows(oa_server: ServerProcess) -> None:
    wait_idle(oa_server)
    generated_before = prom.value(metrics(oa_server), "twinkle_sampler_tokens_total")
    oa = client(oa_server)
    received = 0
    # 16 prompts x n = 4, each to the model's full length: 64 rows that fill the KV cache and
    # take seconds of decode steps, so the client leaves well before they could finish.
    with oa.completions.create(model=MODEL, prompt=[PROMPT] * 16, n=MAX_N, max_tokens=MAX_POSITIONS - len(PROMPT),
                               temperature=0, stream=True, extra_body={"ignore_eos": True}) as stream:
        for chunk in stream:
            received += len(token_ids(chunk.choices[0])) if chunk.choices else 0
            if received >= 2:
                break
        assert not sampler_idle(oa_server)  # still decoding while the client holds the stream
    # The client closed its connection: the rows leave the batch and their KV blocks go back,
    # cancelled rather than finished (the generated-token counter counts finished rows only).
    wait_idle(oa_server)
    assert prom.value(metrics(oa_server), "twinkle_sampler_tokens_total") == generated_before
    # And the server still serves.
    out = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert len(token_ids(out.choices[0])) >= 1


def test_disconnect_while_a_whole_answer_is_pending_frees_the_rows(oa_server: ServerProcess) -> None:
    """A non-streaming request whose client closes its socket before the answer is cancelled
    like a streaming one: its rows leave the batch and their KV blocks go back (cancelled, not
    finished: the generated-token counter does not move); keep-alive connections still work."""
    wait_idle(oa_server)
    generated_before = prom.value(metrics(oa_server), "twinkle_sampler_tokens_total")
    body = json.dumps({"model": MODEL, "prompt": [PROMPT] * 16, "n": MAX_N, "max_tokens": MAX_POSITIONS - len(PROMPT),
                       "temperature": 0, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {oa_server.host}\r\nAuthorization: Bearer {KEYS['alice']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.create_connection((oa_server.host, oa_server.http_port), timeout=30)
    try:
        sock.sendall(head + body)
        deadline = time.monotonic() + scaled(60)
        while sampler_idle(oa_server):  # the request reaches the sampler
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    finally:
        sock.close()
    wait_idle(oa_server)
    assert prom.value(metrics(oa_server), "twinkle_sampler_tokens_total") == generated_before
    # Whole answers on one keep-alive connection are unaffected by the watch.
    with requests.Session() as http:
        for _ in range(2):
            r = http.post(oa_server.http_url("/v1/completions"), json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                          headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=60)
            assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_models_list_and_checkpoints_by_tenant(oa_server: ServerProcess) -> None:
    alice = client(oa_server)
    assert MODEL in [m.id for m in alice.models.list()]
    training = tinker_service(oa_server).create_lora_training_client(base_model=MODEL, rank=4)
    training = resolved(training)
    path = training.save_weights_for_sampler("oa1").result().path
    assert path.startswith("tinker://") and "/sampler_weights/" in path
    assert path in [m.id for m in alice.models.list()]
    bob = client(oa_server, KEYS["bob"])
    assert path not in [m.id for m in bob.models.list()]
    # The checkpoint as the model, alone and as <base>;<path>: a fresh LoRA (B = 0) samples like the base.
    base = alice.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    for name in (path, f"{MODEL};{path}"):
        out = alice.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0)
        assert out.model == name
        assert token_ids(out.choices[0]) == token_ids(base.choices[0])
    # A trained checkpoint: greedy equals the tinker sampler's on the same path, and differs from the base.
    target = PROMPT + token_ids(base.choices[0])[:1] * 8
    datum = types.Datum(model_input=types.ModelInput.from_ints(target[:-1]),
                        loss_fn_inputs={"target_tokens": [7] * (len(target) - 1), "weights": [1.0] * (len(target) - 1)})
    for _ in range(4):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    trained = training.save_weights_for_sampler("oa2").result().path
    sampler = tinker_service(oa_server).create_sampling_client(model_path=trained)
    sampler = resolved(sampler)
    reference = sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=1,
                               sampling_params=types.SamplingParams(max_tokens=12, temperature=0.0)).result()
    out = alice.completions.create(model=trained, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1)
    assert token_ids(out.choices[0]) == list(reference.sequences[0].tokens)
    assert out.choices[0].logprobs.token_logprobs == pytest.approx(list(reference.sequences[0].logprobs), abs=1e-4)
    assert token_ids(out.choices[0])[:6] != token_ids(base.choices[0])
    # Another tenant's checkpoint is unknown to bob.
    with pytest.raises(openai.NotFoundError) as err:
        bob.completions.create(model=path, prompt=PROMPT, max_tokens=2)
    assert err.value.code == "model_not_found"


# ---- text: the server's tokenizer and chat renderer -----------------------------------------

TEXT = "def add(a, b): return a + b. The quick brown fox"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to the fox."}]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def visible_text(hf: Any, tokens: list[int], finish_reason: str) -> str:
    """What a choice's text must be: the tokens decoded by HF tokenizers, special ones skipped."""
    return hf.decode(tokens, skip_special_tokens=True)


def test_text_prompt_is_tokenized_and_output_detokenized(oa_server: ServerProcess, hf_tokenizer: Any) -> None:
    ids = hf_tokenizer.encode(TEXT, add_special_tokens=False).ids
    reference = tinker_greedy(oa_server, ids, 16)
    out = client(oa_server).completions.create(model=MODEL, prompt=TEXT, max_tokens=16, temperature=0)
    (choice,) = out.choices
    assert out.usage.prompt_tokens == len(ids)
    assert token_ids(choice) == list(reference.tokens)
    assert choice.text == visible_text(hf_tokenizer, token_ids(choice), choice.finish_reason)
    echoed = client(oa_server).completions.create(model=MODEL, prompt=TEXT, max_tokens=16, temperature=0, echo=True)
    assert echoed.choices[0].text == TEXT + choice.text


def test_chat_completion_renders_like_apply_chat_template(oa_server: ServerProcess, tiny_model: Path,
                                                          hf_tokenizer: Any) -> None:
    from transformers import AutoTokenizer

    rendered = AutoTokenizer.from_pretrained(str(tiny_model)).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = hf_tokenizer.encode(rendered, add_special_tokens=False).ids
    reference = tinker_greedy(oa_server, ids, 20)
    out = client(oa_server).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    (choice,) = out.choices
    assert choice.message.role == "assistant"
    assert out.usage.prompt_tokens == len(ids)
    assert token_ids(choice) == list(reference.tokens)
    assert choice.message.content == visible_text(hf_tokenizer, token_ids(choice), choice.finish_reason)
    assert out.usage.completion_tokens == len(reference.tokens)


def test_chat_stream_equals_whole_answer(oa_server: ServerProcess) -> None:
    oa = client(oa_server)
    whole = oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, n=2, seed=3)
    chunks = list(oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, n=2,
                                             seed=3, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[index].message.content
        assert [t for c in mine for t in token_ids(c)] == token_ids(whole.choices[index])
        assert [c.finish_reason for c in mine if c.finish_reason] == [whole.choices[index].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_string_cuts_text_streamed_and_whole(oa_server: ServerProcess, hf_tokenizer: Any) -> None:
    oa = client(oa_server)
    free = oa.completions.create(model=MODEL, prompt=TEXT, max_tokens=32, temperature=0, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    candidates = [text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i]
    if not candidates:
        pytest.skip("the greedy text has no usable stop string")  # pragma: no cover
    stop = candidates[0]
    expected = text[: text.index(stop)]
    whole = oa.completions.create(model=MODEL, prompt=TEXT, max_tokens=32, temperature=0, stop=stop,
                                  extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    streamed = oa.completions.create(model=MODEL, prompt=TEXT, max_tokens=32, temperature=0, stop=[stop], stream=True,
                                     extra_body={"ignore_eos": True})
    pieces = [c.choices[0] for c in streamed if c.choices]
    assert "".join(p.text for p in pieces) == expected
    assert pieces[-1].finish_reason == "stop"


def test_chat_logprobs_shape(oa_server: ServerProcess) -> None:
    out = client(oa_server).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                    logprobs=True, top_logprobs=2)
    (choice,) = out.choices
    content = choice.logprobs.content
    assert len(content) == len(token_ids(choice))
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy
        assert entry.bytes == list(entry.token.encode())


# ---- hostile ----------------------------------------------------------------------------------


def test_auth(oa_server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    assert_openai_error(post(oa_server, "/v1/completions", body, key=None), 401)
    assert_openai_error(post(oa_server, "/v1/completions", body, key="sk-wrong"), 401)
    r = requests.get(oa_server.http_url("/v1/models"), timeout=10)
    assert_openai_error(r, 401)
    with pytest.raises(openai.AuthenticationError):
        client(oa_server, "sk-wrong").models.list()


def test_malformed_and_wrong_types(oa_server: ServerProcess) -> None:
    assert_openai_error(post(oa_server, "/v1/completions", b'{"model": "tiny-qwen3", "prompt": [1, 2'), 400)
    assert_openai_error(post(oa_server, "/v1/completions", b"[1, 2, 3]"), 400)
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    for key, value in (("n", "two"), ("max_tokens", 1.5), ("temperature", "hot"), ("stream", "yes"),
                       ("stop", 5), ("logprobs", True), ("seed", "x")):
        assert_openai_error(post(oa_server, "/v1/completions", {**base, key: value}), 400, key)
    assert_openai_error(post(oa_server, "/v1/completions", {**base, "prompt": [1, "a"]}), 400, "prompt")
    assert_openai_error(post(oa_server, "/v1/completions", {**base, "prompt": []}), 400, "prompt")
    assert_openai_error(post(oa_server, "/v1/completions", {**base, "prompt": [[1, 2], [900000]]}), 400)
    assert_openai_error(post(oa_server, "/v1/completions", {"prompt": PROMPT}), 400, "model")
    assert_openai_error(post(oa_server, "/v1/chat/completions", {"model": MODEL, "messages": "hi"}), 400, "messages")
    assert_openai_error(post(oa_server, "/v1/chat/completions",
                             {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}), 400, "messages")


def test_limits_at_limit_plus_one(oa_server: ServerProcess) -> None:
    oa = client(oa_server)
    ok = oa.completions.create(model=MODEL, prompt=PROMPT, n=MAX_N, max_tokens=1)
    assert len(ok.choices) == MAX_N
    with pytest.raises(openai.BadRequestError) as err:
        oa.completions.create(model=MODEL, prompt=PROMPT, n=MAX_N + 1, max_tokens=1)
    assert err.value.param == "n"
    fits = MAX_POSITIONS - len(PROMPT)
    with pytest.raises(openai.BadRequestError):
        oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=fits + 1)
    with pytest.raises(openai.BadRequestError):
        oa.completions.create(model=MODEL, prompt=[5] * (MAX_POSITIONS + 1), max_tokens=1)
    with pytest.raises(openai.BadRequestError) as err:
        oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=21)
    assert err.value.param == "logprobs"
    wait_idle(oa_server)  # nothing was started


def test_huge_body_is_refused_before_it_is_read(oa_server: ServerProcess) -> None:
    # Content-Length over the limit: 413 from the header, the body never read.
    with httpx.Client(timeout=30) as http:
        r = http.post(oa_server.http_url("/v1/completions"), content=b" " * (MAX_BODY_BYTES + 1),
                      headers={"Authorization": f"Bearer {KEYS['alice']}", "Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"


def test_model_names_and_unsupported_parameters(oa_server: ServerProcess) -> None:
    oa = client(oa_server)
    for name in ("no-such-model", "tinker://nope/sampler_weights/x", f"other;tinker://a/sampler_weights/b"):
        with pytest.raises(openai.NotFoundError) as err:
            oa.completions.create(model=name, prompt=PROMPT, max_tokens=1)
        assert err.value.code == "model_not_found"
    for key, value in (("logit_bias", {"5": 1}), ("suffix", "x"), ("best_of", 3)):
        with pytest.raises(openai.BadRequestError) as err:
            oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, **{key: value})
        assert err.value.param == key and err.value.code == "unsupported_parameter"
    # No-op values of those, and unknown parameters, are accepted.
    out = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logit_bias={}, user="u1",
                                extra_body={"no_such_parameter": {"x": 1}, "best_of": 1})
    assert len(out.choices) == 1


def penalised_greedy(model: Any, prompt: list[int], max_tokens: int, eos: set[int], repetition: float = 1.0,
                     presence: float = 0.0, frequency: float = 0.0) -> tuple[list[int], list[float]]:
    """The engine-level reference (tests/engine/test_sampler_penalties.py) on the transformers
    model: greedy over the logits with transformers' RepetitionPenaltyLogitsProcessor over prompt +
    generated tokens, then OpenAI's formula over the generated ones, logit - count * frequency -
    (count > 0) * presence; ending after an end-of-sequence token, as the server does. Returns
    the tokens and each step's top-2 gap."""
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    ids = torch.tensor([prompt])
    counts = torch.zeros(1, model.config.vocab_size)
    processor = RepetitionPenaltyLogitsProcessor(float(repetition)) if repetition != 1.0 else None
    tokens: list[int] = []
    gaps: list[float] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=ids).logits[:, -1].float()
            if processor is not None:
                logits = processor(ids, logits)
            logits = logits - counts * frequency - (counts > 0).float() * presence
            top2 = logits[0].double().topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            token = int(logits[0].argmax())
            tokens.append(token)
            counts[0, token] += 1
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if token in eos:
                break
    return tokens, gaps


def agree_until_near_tie(got: list[int], ref: list[int], gaps: list[float], what: Any) -> bool:
    """Tokens equal up to the reference's first top-2 gap below 1e-4; whether all were compared."""
    for t, want in enumerate(ref):
        if gaps[t] < 1e-4:
            return False
        assert t < len(got) and got[t] == want, f"{what}: token {t}: ours {got}, reference {ref}"
    assert len(got) == len(ref), (what, got, ref)
    return True


@pytest.fixture(scope="module")
def hf_model(tiny_model: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()


def test_penalties_change_greedy_output_as_the_reference(oa_server: ServerProcess, hf_model: Any) -> None:
    """presence_penalty / frequency_penalty (OpenAI's) and repetition_penalty (extra_body, vLLM's)
    give the greedy tokens of the engine-level reference on the same model; streamed and whole
    answers agree; and the penalties do change the answer."""
    oa = client(oa_server)
    eos = hf_model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    max_tokens = 24
    plain = token_ids(oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens,
                                            temperature=0).choices[0])
    cases: list[dict[str, Any]] = [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 2.0},
        {"presence_penalty": -1.0, "frequency_penalty": 0.5},
        {"extra_body": {"repetition_penalty": 1.5}},
        {"extra_body": {"repetition_penalty": 0.7}},
        {"presence_penalty": 0.5, "frequency_penalty": 0.5, "extra_body": {"repetition_penalty": 1.3}},
    ]
    full = changed = 0
    for case in cases:
        params = {**{k: v for k, v in case.items() if k != "extra_body"}, **case.get("extra_body", {})}
        ref, gaps = penalised_greedy(hf_model, PROMPT, max_tokens, eos, params.get("repetition_penalty", 1.0),
                                     params.get("presence_penalty", 0.0), params.get("frequency_penalty", 0.0))
        got = token_ids(oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                              **case).choices[0])
        full += agree_until_near_tie(got, ref, gaps, params)
        changed += got != plain
        streamed = [t for c in oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                                     stream=True, **case) if c.choices for t in token_ids(c.choices[0])]
        assert streamed == got, params
    print(f"{full}/{len(cases)} penalised answers compared over all their tokens; {changed} changed by the penalty")
    assert full >= len(cases) - 1
    # Not every setting moves this prompt's greedy answer (those that favour repeats may not).
    assert changed >= len(cases) // 2
    # min_p (extra_body) = 1 keeps only the most likely token: sampled choices (temperature 1,
    # top_k too, n = 3 with their own generators and counts) all equal the penalised greedy.
    ref, gaps = penalised_greedy(hf_model, PROMPT, max_tokens, eos, 1.5, 0.0, 1.0)
    out = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=1.0, n=3, seed=5,
                                frequency_penalty=1.0, extra_body={"min_p": 1.0, "top_k": 50, "repetition_penalty": 1.5})
    for choice in out.choices:
        agree_until_near_tie(token_ids(choice), ref, gaps, ("min_p", choice.index))
    # Chat takes them too.
    chat = oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                      presence_penalty=1.0, extra_body={"repetition_penalty": 1.2, "min_p": 0.1})
    assert len(token_ids(chat.choices[0])) >= 1


def test_penalty_limits_at_limit_plus_one(oa_server: ServerProcess) -> None:
    """Accepted at each limit; just past it 400 in OpenAI's shape naming the parameter."""
    oa = client(oa_server)
    for key, ok, bad in (("presence_penalty", 2.0, 2.01), ("presence_penalty", -2.0, -2.01),
                         ("frequency_penalty", 2.0, 2.01), ("frequency_penalty", -2.0, -2.01),
                         ("min_p", 1.0, 1.01), ("min_p", 0.0, -0.01), ("repetition_penalty", 0.01, 0.0)):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, key: ok}
        assert post(oa_server, "/v1/completions", body).status_code == 200, (key, ok)
        error = assert_openai_error(post(oa_server, "/v1/completions", {**body, key: bad}), 400, key)
        assert error["type"] == "invalid_request_error" and key in error["message"], error
        with pytest.raises(openai.BadRequestError) as err:
            oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={key: bad})
        assert err.value.param == key
    wait_idle(oa_server)


def test_rate_limit_and_quota_as_tinker(launch_server: LaunchServer) -> None:
    """The tenant's token bucket (429 + Retry-After) and max_tokens_per_request (403), in
    OpenAI's error shape, on a server of its own."""
    server = launch_server(auth_overrides(limits={"tokens_per_s": 0.01, "burst_tokens": 40,
                                                  "max_tokens_per_request": 100}))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16}  # (8 + 16) x 1 = 24 tokens
    assert post(server, "/v1/completions", body).status_code == 200
    limited = post(server, "/v1/completions", body)  # 16 tokens left in the bucket
    error = assert_openai_error(limited, 429)
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert int(limited.headers["Retry-After"]) >= 1
    with pytest.raises(openai.RateLimitError):
        client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=16)
    # One over the request quota: refused before the bucket is charged.
    over = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 100 - len(PROMPT) + 1},
                key=KEYS["bob"])
    assert_openai_error(over, 403)


def test_model_without_tokenizer_serves_ids_and_refuses_text(server_bin: Path, tiny_model: Path,
                                                             tmp_path: Path) -> None:
    """A model directory without tokenizer.json or chat template: token ids still work; text
    prompts and chat answer 501 saying what is missing (and not where the files are)."""
    import shutil

    bare = tmp_path / "bare-model"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_model / name, bare / name)
    config = configs.merged(configs.base_config(bare), auth_overrides())
    server = launch(server_bin, configs.write_config(tmp_path / "twinkle.yaml", config), config, tmp_path / "work")
    try:
        server.wait_ports(scaled(120))
        server.wait_health("SERVING", scaled(120))
        out = client(server).completions.create(model="bare-model", prompt=PROMPT, max_tokens=3, temperature=0)
        assert len(token_ids(out.choices[0])) >= 1 and out.choices[0].text == ""
        error = assert_openai_error(post(server, "/v1/completions", {"model": "bare-model", "prompt": "hello"}), 501,
                                    "prompt")
        assert "tokenizer" in error["message"] and str(bare) not in error["message"]
        error = assert_openai_error(post(server, "/v1/chat/completions",
                                         {"model": "bare-model", "messages": [{"role": "user", "content": "x"}]}),
                                    501, "messages")
        assert str(bare) not in error["message"]
    finally:
        stop_all([server])


def test_unknown_chat_template_and_the_configured_fallback(server_bin: Path, tiny_model: Path, tmp_path: Path,
                                                           hf_tokenizer: Any) -> None:
    """A chat template the server does not recognize: chat answers 501 naming the problem;
    with model.chat_renderer_fallback: chatml, chat renders ChatML."""
    import shutil

    odd = tmp_path / "odd-model"
    shutil.copytree(tiny_model, odd)
    (odd / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    messages = [{"role": "user", "content": "hi fox"}]
    servers = []
    try:
        for fallback in ("", "chatml"):
            config = configs.merged(configs.base_config(odd), auth_overrides(model={"chat_renderer_fallback": fallback}))
            work = tmp_path / f"work-{fallback or 'none'}"
            server = launch(server_bin, configs.write_config(work / "twinkle.yaml", config), config, work)
            servers.append(server)
            server.wait_ports(scaled(120))
            server.wait_health("SERVING", scaled(120))
            if not fallback:
                error = assert_openai_error(post(server, "/v1/chat/completions", {"model": "odd-model", "messages": messages}),
                                            501, "messages")
                assert "chat template" in error["message"] and str(odd) not in error["message"]
                continue
            out = client(server).chat.completions.create(model="odd-model", messages=messages, max_tokens=2)
            chatml = "<|im_start|>user\nhi fox<|im_end|>\n<|im_start|>assistant\n"
            assert out.usage.prompt_tokens == len(hf_tokenizer.encode(chatml, add_special_tokens=False).ids)
    finally:
        stop_all(servers)


def test_stream_errors_before_the_stream_are_plain_json(oa_server: ServerProcess) -> None:
    """A streamed request refused before it starts is an ordinary JSON error, not an event stream."""
    for body, status, param in (
        ({"model": "no-such-model", "prompt": PROMPT, "stream": True}, 404, "model"),
        ({"model": MODEL, "prompt": PROMPT, "stream": True, "n": MAX_N + 1}, 400, "n"),
        ({"model": MODEL, "prompt": PROMPT, "stream": True, "logprobs": 21}, 400, "logprobs"),
        ({"model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": MAX_POSITIONS}, 400, None),
    ):
        r = post(oa_server, "/v1/completions", body)
        assert r.headers["content-type"].startswith("application/json")
        assert_openai_error(r, status, param)
    with pytest.raises(openai.NotFoundError):
        client(oa_server).chat.completions.create(model="nope", messages=MESSAGES, stream=True)


def test_streamed_logprobs_equal_the_whole_answers(oa_server: ServerProcess) -> None:
    oa = client(oa_server)
    whole = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2)
    chunks = [c.choices[0] for c in oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                                          logprobs=2, stream=True) if c.choices]
    with_tokens = [c for c in chunks if token_ids(c)]
    assert all(c.logprobs is not None and len(c.logprobs.tokens) == len(token_ids(c)) for c in with_tokens)
    streamed = [lp for c in with_tokens for lp in c.logprobs.token_logprobs]
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-6)
    assert [t for c in with_tokens for t in c.logprobs.top_logprobs] == whole.choices[0].logprobs.top_logprobs
    assert [o for c in with_tokens for o in c.logprobs.text_offset] == whole.choices[0].logprobs.text_offset

    chat = oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True,
                                      top_logprobs=3)
    pieces = [c.choices[0] for c in oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                                               temperature=0, logprobs=True, top_logprobs=3,
                                                               stream=True) if c.choices]
    content = [e for p in pieces if p.logprobs is not None for e in p.logprobs.content]
    assert [e.token for e in content] == [e.token for e in chat.choices[0].logprobs.content]
    assert [e.logprob for e in content] == pytest.approx([e.logprob for e in chat.choices[0].logprobs.content], abs=1e-6)
    assert all(len(e.top_logprobs) == 3 for e in content)


def test_echo_with_logprobs_scores_the_prompt_like_tinker(oa_server: ServerProcess, hf_tokenizer: Any) -> None:
    """What evaluation harnesses send to score a text (echo, logprobs, max_tokens 1): the
    prompt's tokens with their log-probs (the first none), equal to the tinker sampler's
    prompt log-probs, then the generated token."""
    ids = hf_tokenizer.encode(TEXT, add_special_tokens=False).ids
    sampler = tinker_service(oa_server).create_sampling_client(base_model=MODEL)
    sampler = resolved(sampler)
    reference = sampler.sample(types.ModelInput.from_ints(ids), num_samples=1, include_prompt_logprobs=True,
                               sampling_params=types.SamplingParams(max_tokens=1, temperature=0.0)).result()
    out = client(oa_server).completions.create(model=MODEL, prompt=TEXT, max_tokens=1, temperature=0, echo=True,
                                               logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(list(reference.prompt_logprobs)[1:], abs=1e-4)
    assert lp.token_logprobs[-1] == pytest.approx(reference.sequences[0].logprobs[0], abs=1e-4)
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert out.choices[0].text.startswith(TEXT)
    assert "".join(lp.tokens[:len(ids)]) == TEXT
    # Streamed, echo puts the prompt's text first in the choice's first chunk.
    streamed = client(oa_server).completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0, echo=True,
                                                    stream=True)
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    whole = client(oa_server).completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0, echo=True)
    assert text == whole.choices[0].text and text.startswith(TEXT)


def test_streamed_echo_with_logprobs_equals_the_whole_answer(oa_server: ServerProcess, hf_tokenizer: Any) -> None:
    """echo + logprobs + stream: each choice's first chunk leads with the prompt's tokens and
    log-probs (the first null), as OpenAI's legacy completions send them; the chunks together
    equal the whole (non-streamed) answer's log-probs, offsets and text."""
    oa = client(oa_server)
    ids = hf_tokenizer.encode(TEXT, add_special_tokens=False).ids
    for max_tokens in (1, 6):
        params = {"model": MODEL, "prompt": TEXT, "max_tokens": max_tokens, "temperature": 0, "echo": True,
                  "logprobs": 2, "n": 2}
        whole = oa.completions.create(**params)
        chunks = [c for c in oa.completions.create(**params, stream=True) if c.choices]
        for index in (0, 1):
            mine = [c.choices[0] for c in chunks if c.choices[0].index == index]
            with_lp = [c for c in mine if c.logprobs is not None]
            first = with_lp[0].logprobs
            assert mine[0].logprobs is not None and len(first.tokens) == len(ids) + len(token_ids(mine[0]))
            assert first.token_logprobs[0] is None and first.top_logprobs[0] is None
            want = whole.choices[index].logprobs
            assert [t for c in with_lp for t in c.logprobs.tokens] == want.tokens
            got_lps = [v for c in with_lp for v in c.logprobs.token_logprobs]
            assert got_lps[0] is None and got_lps[1:] == pytest.approx(want.token_logprobs[1:], abs=1e-6)
            assert [t for c in with_lp for t in c.logprobs.top_logprobs] == want.top_logprobs
            assert [o for c in with_lp for o in c.logprobs.text_offset] == want.text_offset
            assert "".join(c.text for c in mine) == whole.choices[index].text


def test_routes_also_under_the_tinker_api_prefix(oa_server: ServerProcess) -> None:
    """/api/v1/models, /api/v1/completions and /api/v1/chat/completions, where Twinkle's
    gateway serves them: the same answers as under /v1."""
    oa = openai.OpenAI(base_url=oa_server.http_url("/api/v1"), api_key=KEYS["alice"], max_retries=0, timeout=120)
    assert MODEL in [m.id for m in oa.models.list()]
    here = oa.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    there = client(oa_server).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    assert token_ids(here.choices[0]) == token_ids(there.choices[0])
    streamed = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, stream=True)
    assert [t for c in streamed if c.choices for t in token_ids(c.choices[0])]
    assert post(oa_server, "/api/v1/completions", {"model": MODEL, "prompt": PROMPT}, key=None).status_code == 401
