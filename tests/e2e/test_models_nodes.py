"""Several base models with engines on other nodes (docs/device_pool.md, "Engines on other
nodes"; docs/config.md `models[i].devices`): each model's supervisor has its own node socket,
models[i] on nodes.listen's port + i, and a node agent joins the port of the model whose
devices it runs.

The tiny Qwen3 (the default model) trains on this node; the tiny Llama of test_models.py on
"cpu@node-l", an engine that a node agent joined to port + 1 starts. Both train and sample,
and their log-probs are each model's own (transformers on that model): the Llama's engine is
the agent's child, not the coordinator's.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "1")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from e2e_support import configs  # noqa: E402
from e2e_support.server import launch, stop_all  # noqa: E402
from e2e_support.training import resolved  # noqa: E402
from e2e_support.waiting import scaled  # noqa: E402
from test_models import (  # noqa: E402
    LLAMA, QWEN, SEQ, datum, forward_logprobs, make_llama, reference_logprobs, two_model_config)
from test_models_state import prompt_logprobs  # noqa: E402
from test_nodes import Agent, free_port, node_secret  # noqa: E402

STARTUP_TIMEOUT_S = 120.0


def free_port_pair() -> int:
    """A loopback port whose successor is free too (models[1] listens on port + 1)."""
    import socket

    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def test_each_model_has_its_own_node_socket(server_bin: Path, tiny_model: Path, tmp_path: Path) -> None:
    llama = make_llama(tmp_path, tiny_model)
    secret = node_secret(server_bin, tmp_path)
    port = free_port_pair()
    workdir = tmp_path / "server"
    config = two_model_config(tiny_model, llama, workdir)
    config["models"][0]["devices"] = ["cpu", "cpu@node-q"]  # data parallel across a node
    config["models"][1]["devices"] = ["cpu@node-l"]
    config["nodes"] = {"listen": f"127.0.0.1:{port}", "secret_file": str(secret)}
    agents = {
        "node-q": Agent(server_bin, f"127.0.0.1:{port}", "node-q", secret, tmp_path / "node-q.log"),
        "node-l": Agent(server_bin, f"127.0.0.1:{port + 1}", "node-l", secret, tmp_path / "node-l.log"),
        # The Llama's node at the Qwen model's port: that model has no device there.
        "wrong-port": Agent(server_bin, f"127.0.0.1:{port}", "node-l", secret, tmp_path / "wrong.log"),
    }
    server = launch(server_bin, configs.write_config(workdir / "twinkle.yaml", config), config, workdir)
    try:
        server.wait_ports(scaled(STARTUP_TIMEOUT_S))
        server.wait_health("SERVING", scaled(STARTUP_TIMEOUT_S))
        assert len(server.engine_workers()) == 1, "only the Qwen model's rank 0 is the coordinator's child"
        for name in ("node-q", "node-l"):
            assert "joined" in agents[name].text() and "started engine" in agents[name].text(), agents[name].text()
        logs = server.stderr_text()
        assert "node agent 'node-q' connected" in logs and "node agent 'node-l' connected" in logs
        assert agents["wrong-port"].proc.wait(30) == 1
        assert "has no devices on node 'node-l'" in agents["wrong-port"].text(), agents["wrong-port"].text()

        svc = tinker.ServiceClient(base_url=f"http://{server.host}:{server.http_port}", api_key="tml-local-dev")
        for name in (QWEN, LLAMA):
            training = resolved(svc.create_lora_training_client(base_model=name, rank=4))
            want = reference_logprobs({QWEN: tiny_model, LLAMA: llama}[name], SEQ)
            np.testing.assert_allclose(forward_logprobs(training, SEQ), want, atol=1e-4, rtol=0)
            before = -float(forward_logprobs(training, SEQ).sum())
            for _ in range(3):
                training.forward_backward([datum(SEQ)], "cross_entropy").result()
                training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            after = -float(forward_logprobs(training, SEQ).sum())
            print(f"{name}: loss {before:.4f} -> {after:.4f} after 3 steps")
            assert after < before
            sampler = resolved(svc.create_sampling_client(base_model=name))
            np.testing.assert_allclose(prompt_logprobs(sampler, SEQ), want, atol=1e-4, rtol=0)
    finally:
        stop_all([server])
        for agent in agents.values():
            agent.kill()
