#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora under tests/fuzz/corpus/<target>/: small, real-shaped
inputs (what the SDK, an operator or the engine link actually send), one file each, named by
what they are. Deterministic; rerun after changing it and commit the result:
    .venv/bin/python tests/fuzz/make_corpus.py
Needs only the standard library and msgpack (in the project's venv)."""
import json
import os
import shutil
import struct
import sys

import msgpack

ROOT = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(ROOT, "corpus")
REPO = os.path.dirname(os.path.dirname(ROOT))


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- protobuf wire format, by hand (no generated code needed) ------------------------------
def varint(n):
    n &= (1 << 64) - 1
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def field(num, wire, payload):
    key = varint((num << 3) | wire)
    if wire == 0:
        return key + varint(payload)
    if wire == 1:
        return key + struct.pack("<d", payload)
    return key + varint(len(payload)) + payload  # wire 2


def tensor(dtype, shape, dense=None, csr=None):
    t = b""
    if dense is not None:
        t += field(1, 2, dense)
    if csr is not None:
        values, crow, col = csr
        t += field(2, 2, field(1, 2, values) + field(2, 2, crow) + field(3, 2, col))
    t += field(3, 0, dtype)
    if shape:
        t += field(4, 2, b"".join(varint(s) for s in shape))  # packed repeated int64
    return t


F32, I64, I32, BF16 = 1, 2, 3, 4


def datum(tokens, inputs):
    chunk = field(1, 2, field(1, 2, struct.pack(f"<{len(tokens)}i", *tokens)))
    d = field(1, 2, chunk)
    for name, t in inputs.items():
        d += field(2, 2, field(1, 2, name.encode()) + field(2, 2, t))
    return d


def fb_request(datums, loss_fn="cross_entropy", config=None, config_v2=None):
    r = field(1, 2, b"sess-1:train:0") + field(2, 0, 3)
    for d in datums:
        r += field(3, 2, d)
    r += field(4, 2, loss_fn.encode())
    for k, v in (config or {}).items():
        r += field(5, 2, field(1, 2, k.encode()) + field(2, 1, v))
    for k, v in (config_v2 or {}).items():
        val = field(2, 2, v.encode()) if isinstance(v, str) else field(1, 1, v)
        r += field(7, 2, field(1, 2, k.encode()) + field(2, 2, val))
    return r


def protos():
    toks = [1, 15, 27, 300, 9]
    tgt = toks[1:] + [2]
    dense_t = tensor(I64, [5], dense=struct.pack("<5q", *tgt))
    w = tensor(F32, [5], dense=struct.pack("<5f", 0, 1, 1, 1, 1))
    write("tinker_proto_fuzz", "cross_entropy_dense", fb_request([datum(toks, {"target_tokens": dense_t, "weights": w})]))
    # importance_sampling: logprobs and advantages, int32 targets, bfloat16 weights.
    t32 = tensor(I32, [5], dense=struct.pack("<5i", *tgt))
    lp = tensor(F32, [5], dense=struct.pack("<5f", -1.5, -0.2, -3.0, -0.7, -2.2))
    adv = tensor(BF16, [5], dense=struct.pack("<5H", 0x3F80, 0xBF80, 0, 0x3F00, 0x4000))
    write("tinker_proto_fuzz", "importance_sampling_v2",
          fb_request([datum(toks, {"target_tokens": t32, "logprobs": lp, "advantages": adv})],
                     loss_fn="importance_sampling", config_v2={"clip_low": 0.8, "reduction": "mean"}))
    # Sparse CSR [1, 5]: two non-zeros.
    sp = tensor(F32, [1, 5], csr=(struct.pack("<2f", 1.0, 0.5), struct.pack("<2q", 0, 2), struct.pack("<2q", 1, 4)))
    write("tinker_proto_fuzz", "sparse_csr_weights", fb_request([datum(toks, {"target_tokens": dense_t, "weights": sp})]))
    # Sparse CSR [2, 3] with an empty row, int64 values.
    sp2 = tensor(I64, [2, 3], csr=(struct.pack("<2q", 7, 8), struct.pack("<3q", 0, 0, 2), struct.pack("<2q", 0, 2)))
    write("tinker_proto_fuzz", "sparse_csr_two_rows",
          fb_request([datum([1, 2, 3, 4, 5, 6], {"target_tokens": sp2})], loss_fn="ppo", config={"clip_eps": 0.2}))
    write("tinker_proto_fuzz", "two_datums_old_config",
          fb_request([datum(toks, {"target_tokens": dense_t}), datum([4, 5], {"target_tokens": tensor(I64, [], dense=struct.pack("<2q", 5, 6))})],
                     config={"beta": 0.1}))


# ---- Tinker JSON bodies ---------------------------------------------------------------------
def jsons():
    def td(data, dtype="int64"):
        return {"data": data, "dtype": dtype, "shape": [len(data)]}

    mi = {"chunks": [{"type": "encoded_text", "tokens": [1, 15, 27, 300, 9]}]}
    bodies = {
        "forward_backward": {"model_id": "sess-1:train:0", "seq_id": 3, "forward_backward_input": {
            "data": [{"model_input": mi, "loss_fn_inputs": {"target_tokens": td([15, 27, 300, 9, 2]),
                                                            "weights": td([0, 1, 1, 1, 1], "float32")}}],
            "loss_fn": "cross_entropy", "loss_fn_config": None}},
        "forward_importance_sampling": {"model_id": "sess-1:train:0", "seq_id": "4", "forward_input": {
            "data": [{"model_input": mi, "loss_fn_inputs": {"target_tokens": [15, 27, 300, 9, 2],
                                                            "logprobs": td([-1.5, -0.2, -3.0, -0.7, -2.2], "float32"),
                                                            "advantages": td([1.0, -1.0, 0.0, 0.5, 2.0], "float32")}}],
            "loss_fn": "importance_sampling", "loss_fn_config": {"clip_low": 0.8, "reduction": "mean"}}},
        "create_model": {"session_id": "sess-1", "model_seq_id": 0, "base_model": "Qwen/Qwen3-0.6B",
                         "lora_config": {"rank": 8, "seed": 7, "train_attn": True, "train_mlp": True,
                                         "train_unembed": False}, "type": "create_model"},
        "asample": {"sampling_session_id": "sess-1:sample:0", "seq_id": 1, "num_samples": 2,
                    "prompt": mi, "prompt_logprobs": True, "topk_prompt_logprobs": 5,
                    "sampling_params": {"max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 50,
                                        "seed": 123, "stop": ["\n\n"]}},
        "optim_step": {"model_id": "sess-1:train:0", "seq_id": 5,
                       "adam_params": {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12,
                                       "weight_decay": 0.0}},
        "save_weights": {"model_id": "sess-1:train:0", "path": "ckpt-001", "seq_id": 6, "type": "save_weights"},
        "retrieve_future": {"request_id": "req-0001"},
        "create_session": {"tags": ["a", "b"], "user_metadata": {"k": "v"}, "sdk_version": "0.38.0"},
        "escapes": {"session_id": "s\u00e9ss\\\"1\"", "path": "\ud83d\ude00", "seq_id": 1.0e0},
    }
    for name, body in bodies.items():
        write("tinker_json_fuzz", name, json.dumps(body))
    write("tinker_json_fuzz", "empty", "")


# ---- safetensors headers ---------------------------------------------------------------------
def safetensors():
    def st(header, data):
        h = json.dumps(header).encode()
        return struct.pack("<Q", len(h)) + h + data

    write("safetensors_fuzz", "two_tensors", st({
        "__metadata__": {"format": "pt"},
        "model.embed_tokens.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "lm_head.weight": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [16, 24]}}, bytes(24)))
    write("safetensors_fuzz", "scalar_and_empty", st({
        "a": {"dtype": "I64", "shape": [], "data_offsets": [0, 8]},
        "b": {"dtype": "F16", "shape": [0, 4], "data_offsets": [8, 8]}}, bytes(8)))
    write("safetensors_fuzz", "every_dtype", st({
        f"t{i}": {"dtype": d, "shape": [1], "data_offsets": [i * 8, i * 8 + s]}
        for i, (d, s) in enumerate([("F32", 4), ("F16", 2), ("BF16", 2), ("I64", 8), ("I32", 4), ("U8", 1),
                                    ("BOOL", 1), ("F64", 8), ("I8", 1), ("I16", 2)])}, bytes(80)))


# ---- config YAML -----------------------------------------------------------------------------
def configs():
    for name in sorted(os.listdir(os.path.join(REPO, "configs"))):
        if name.endswith(".yaml"):
            shutil.copyfile(os.path.join(REPO, "configs", name), os.path.join(CORPUS, "config_yaml_fuzz", name))
    write("config_yaml_fuzz", "tenants_inline.yaml", """server:
  host: 127.0.0.1
  http_port: 8000
  allowed_hosts: [example.com]
  allowed_origins: ["https://example.com"]
model:
  path: models/tiny-qwen3
limits:
  max_adapters: 4
  max_lora_rank: 32
auth:
  enabled: true
  tenants:
    - id: team-a
      key_sha256: ["2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"]
      quotas: {max_adapters: 2, tokens_per_s: 1000}
    - id: team-b
      key_sha256:
        - FCDE2B2EDBA56BF408601FB721FE9B5C338D10EE429EA04FAE5511B68FBF8FB9
""")
    write("config_yaml_fuzz", "errors.yaml", "server:\n  grpc_port: 70000\n  nope: 1\nmodel: [1, 2]\nengine:\n  devices: cpu\n")


# ---- engine link messages --------------------------------------------------------------------
def frames_input(pick, envelope, buffers=()):
    """The fuzz target's framing: a pick byte, then each frame behind a 2-byte LE length."""
    out = bytes([pick])
    for f in [envelope, *buffers]:
        out += struct.pack("<H", len(f)) + f
    return out


def envelope(method, body, type_=4):
    return msgpack.packb({"v": 1, "t": type_, "id": 42, "m": method, "c": 0, "e": "", "b": body}, use_bin_type=True)


def ipcs():
    def desc(dtype, shape, frame):
        return {"dtype": dtype, "shape": shape, "frame": frame}

    p = lambda o: msgpack.packb(o, use_bin_type=True)
    loss = {"name": "cross_entropy", "config": {"beta": 0.1}, "string_config": {"reduction": "mean"}}
    op = {"adapter_id": "a1", "disable_adapter": False, "loss": loss,
          "datums": [{"input_tokens": [1, 2, 3], "target_tokens": [2, 3, 4], "inputs": {"weights": [1.0, 1.0, 0.5]}}],
          "window_tokens": 3, "window_sequences": 1}
    w = struct.pack("<4f", 0.1, 0.2, 0.3, 0.4)
    cases = {
        "load_model": (0, envelope("load_model", p({"model_dir": "/m", "dtype": "bfloat16", "device": "cpu",
                                                  "max_lora_rank": 32, "kv_cache_blocks": 0, "kv_block_size": 16})), []),
        "create_adapter": (1, envelope("create_adapter", p({"adapter_id": "a1", "rank": 8, "alpha": 16.0, "dropout": 0.0,
                                                          "use_rslora": False, "targets": ["q_proj", "v_proj"],
                                                          "seed": 7})), []),
        "forward_backward": (3, envelope("forward_backward", p({"ops": [op], "return_logits": False})), []),
        "optim_step": (4, envelope("optim_step", p({"adapter_id": "a1", "hyper": {"learning_rate": 1e-4},
                                                  "zero_grad": True})), []),
        "set_adapter_state": (7, envelope("set_adapter_state", p({
            "adapter_id": "a1", "weights": {"base_model.q.lora_A.weight": desc("float32", [2, 2], 0)},
            "grads": {"base_model.q.lora_A.weight": desc("float32", [4], 1)},
            "optimizer": {"state.0.exp_avg": desc("bfloat16", [2, 1], 2)}, "optimizer_kind": "adamw",
            "micro_batches_since_step": 3, "reset_optimizer": False})), [w, w, bytes(4)]),
        "get_adapter_state_reply": (14, envelope("get_adapter_state", p({
            "weights": {"x": desc("float32", [1, 4], 0)}, "grads": {}, "optimizer": {"m": desc("int64", [0], 1)},
            "step": 2, "optimizer_kind": "adamw", "micro_batches_since_step": 0,
            "config": {"adapter_id": "a1", "rank": 8}}), 5), [w, b""]),
        "sample": (9, envelope("sample", p({"rows": [{"adapter_id": "a1", "prompt_tokens": [1, 2, 3], "max_tokens": 8,
                                                   "temperature": 0.7, "top_p": 1.0, "top_k": -1}]})), []),
        "sample_step": (10, envelope("sample_step", p({"admit": [{"request_id": 1, "row": {"prompt_tokens": [5, 6]}}],
                                                      "cancel": [2], "max_decode_steps": 4, "reset": False})), []),
        "hello": (12, envelope("", p({"protocol_version": 1, "engine_version": "0.1.0", "rank": 0, "pid": 1234,
                                     "device": "cpu"}), 1), []),
        "tensor_desc": (18, envelope("x", p(desc("int64", [2], 0))), [struct.pack("<2q", 7, 8)]),
        "debug_sleep": (11, envelope("debug_sleep", p({"milliseconds": 5, "frames": 0})), []),
    }
    for name, (pick, env, bufs) in cases.items():
        write("ipc_envelope_fuzz", name, frames_input(pick, env, bufs))


# ---- raw HTTP requests -----------------------------------------------------------------------
def https():
    body = json.dumps({"session_id": "sess-1", "model_seq_id": 0, "base_model": "Qwen/Qwen3-0.6B"})
    reqs = {
        "post_create_model": f"POST /api/v1/create_model HTTP/1.1\r\nHost: localhost:8000\r\nX-API-Key: k\r\n"
                             f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}",
        "get_training_runs": "GET /api/v1/training_runs?limit=10&offset=20 HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
                             "Accept: */*\r\n\r\n",
        "get_checkpoint_tail": "GET /api/v1/training_runs/sess-1%3Atrain%3A0/checkpoints HTTP/1.1\r\n"
                               "Host: [::1]:8000\r\n\r\n",
        "delete_checkpoint": "DELETE /api/v1/training_runs/r1/checkpoints/weights%2Fckpt-1 HTTP/1.1\r\n"
                             "Host: Example.COM\r\nOrigin: https://example.com\r\nContent-Length: 0\r\n\r\n",
        "chunked_proto": "POST /api/v1/forward_backward HTTP/1.1\r\nHost: localhost\r\n"
                         "Content-Type: application/x-protobuf\r\nTransfer-Encoding: chunked\r\n\r\n"
                         "5\r\n\x0a\x03abc\r\n0\r\n\r\n",
        "evil_origin": "POST /api/v1/asample HTTP/1.1\r\nHost: evil.test\r\nOrigin: http://evil.test\r\n"
                       "Content-Length: 2\r\n\r\n{}",
        "http10_query_plus": "GET /api/v1/checkpoints?limit=1+2&offset=%zz&a+b=c HTTP/1.0\r\n\r\n",
    }
    for name, raw in reqs.items():
        write("http_request_fuzz", name, raw)


# ---- tokenizer: text, ids, chat messages, tokenizer.json (first byte picks) -------------------
def tokenizers():
    seeds = {
        "text_mixed": b"\x00Hello world, it's 123 <|im_start|>user\ncaf\xc3\xa9 e\xcc\x81 \xe4\xb8\xad\xf0\x9f\x98\x80 <mask> [R]  word",
        "text_spaces": b"\x00  \t\r\n\n   \xc2\x85\xe1\xa0\x8e x",
        "text_invalid": b"\x00abc\xc3(\xe2\x82",
        "ids": b"\x01" + b"".join(struct.pack("<H", i + 64) for i in (72, 101, 228, 184, 173, 256, 270, 271, -1 + 64, 5000)),
        "render": b"\x02sys\x00hi <think>a</think>\x00{\"q\": [1, 2.5, null]}\x00result\x00again",
        "render_tools": b"\x02\x00u\x00{}\x00t\x00u\x00a\x00\x00\x00[{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]",
        "json": b"\x03" + json.dumps({"pre_tokenizer": {"type": "ByteLevel"}, "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
                                       "added_tokens": [{"id": 3, "content": "<s>", "special": True}]}).encode(),
    }
    for name, raw in seeds.items():
        write("tokenizer_fuzz", name, raw)


def main():
    if os.path.isdir(CORPUS):
        shutil.rmtree(CORPUS)
    os.makedirs(os.path.join(CORPUS, "config_yaml_fuzz"))
    protos()
    jsons()
    safetensors()
    configs()
    ipcs()
    https()
    tokenizers()
    for t in sorted(os.listdir(CORPUS)):
        n = len(os.listdir(os.path.join(CORPUS, t)))
        print(f"{t}: {n} seeds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
