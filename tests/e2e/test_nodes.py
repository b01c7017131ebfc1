"""Engines on other nodes (docs/device_pool.md "Engines on other nodes"), two nodes on
loopback: node agents (`twinkle-server worker --join HOST:PORT --node NAME --secret-file F`)
start the engines the coordinator's engine.devices place on them ("cpu@node-a"); agents and
engines connect over TCP, CURVE-encrypted, and only holders of the node secret get in."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from test_data_parallel import homes, rank_totals, tinker_run
from test_sampler_service import Sampler, prompts_for, vocab
from twinkle_client._proto.twinkle.v1 import sampler_pb2 as spb
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb

from e2e_support.server import LaunchServer, ServerProcess
from e2e_support.training import KEYS, Client, auth_overrides, batch, state_dict
from e2e_support.waiting import wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_secret(server_bin: Path, tmp_path: Path) -> Path:
    path = tmp_path / "node.secret"
    subprocess.run([str(server_bin), "node-secret", "-o", str(path)], check=True)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    return path


class Agent:
    """One `twinkle-server worker` process; its log in a file."""

    def __init__(self, server_bin: Path, listen: str, node: str, secret: Path, log: Path) -> None:
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([str(server_bin), "worker", "--join", listen, "--node", node,
                                          "--secret-file", str(secret)], stdout=out, stderr=out,
                                         start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def train_steps(c: Client, name: str, n_vocab: int, steps: int) -> list[float]:
    """`steps` Twinkle steps (a mean loss: an adapter's rows stay on its home rank)."""
    losses = []
    for _ in range(steps):
        reply = c.call("ForwardBackward", tpb.ForwardRequest(adapter_name=name, inputs=batch(3, n_vocab, sequences=4)))
        losses.append(reply.result.loss)
        c.call("ClipGradAndStep", tpb.ClipGradNormRequest(adapter_name=name, max_grad_norm=1.0))
    return losses


def config(listen: str, secret: Path, devices: list[str]) -> dict[str, Any]:
    return auth_overrides(
        engine={"devices": devices, "restart_backoff_initial_ms": 100, "restart_backoff_max_ms": 500,
                "rank_token_budget": 16},
        nodes={"listen": listen, "secret_file": str(secret)}, logging={"level": "debug"})


def test_two_node_agents_train_sample_and_a_dead_node_fails_retryably(
        launch_server: LaunchServer, server_bin: Path, tiny_model: Path, tmp_path: Path) -> None:
    """Rank 0 on the coordinator's node, ranks 1 and 2 on node agents node-a and node-b: one
    data-parallel group over three processes of two "nodes". A Tinker cross_entropy run whose
    4 datums are split over the three ranks (the gradients all-reduced over TCP) gives the
    one-rank server's step losses within 1e-6 relative (tests/e2e/test_data_parallel.py's
    bounds), every rank running rows; Twinkle training and sampling work, adapter "a" homed
    on node-a's rank 1 and "b" on node-b's rank 2. kill -9 of node-b's agent takes its engine
    with it: the coordinator sees the agent go, "b"'s training calls fail with UNAVAILABLE
    (retry later), nothing hangs, while "a" (and rank 0) train on; a new agent for node-b
    brings rank 2 back, alone, and "b" trains again. A new coordinator on the same address
    gets both agents back (they stop their old engines) and trains the same numbers."""
    secret = node_secret(server_bin, tmp_path)
    listen = f"127.0.0.1:{free_port()}"
    n_vocab = vocab(tiny_model)
    agents = {n: Agent(server_bin, listen, n, secret, tmp_path / f"{n}.log") for n in ("node-a", "node-b")}
    try:
        server = launch_server(config(listen, secret, ["cpu", "cpu@node-a", "cpu@node-b"]))
        workers = server.engine_workers()
        assert len(workers) == 1, "ranks 1 and 2 are the agents' children, not the coordinator's"
        for name, agent in agents.items():
            assert "joined" in agent.text() and "started engine rank-" in agent.text(), agent.text()
        tinker_losses, tinker_final = tinker_run(server, n_vocab)
        totals = rank_totals(server.stderr_text())
        c = Client(server.grpc_address, KEYS["alice"])
        for name in ("a", "b"):
            c.call("AddAdapter", tpb.AddAdapterRequest(adapter_name=name, config=tpb.LoraConfig(r=4, seed=1)))
        losses = train_steps(c, "a", n_vocab, 3)
        train_steps(c, "b", n_vocab, 1)
        session = Sampler(c).call("CreateSamplingSession", spb.CreateSamplingSessionRequest()).sampling_session_id
        sampled = Sampler(c).sample(session, prompts_for(3, n_vocab, 2), max_tokens=5, temperature=0.0)
        assert [len(r.sequences[0].tokens) for r in sampled.results] == [5, 5]
        logs = server.stderr_text()
        assert "node agent 'node-a' connected" in logs and "node agent 'node-b' connected" in logs
        assert "forward_backward over 3 ranks" in logs

        agents["node-b"].kill()
        wait_until(lambda: "node agent 'node-b' is gone" in server.stderr_text() or
                   "node-b) killed" in server.stderr_text() or None, 60, "the coordinator notices node-b")
        with pytest.raises(grpc.RpcError) as info:
            train_steps(c, "b", n_vocab, 1)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        assert server.health() is not None  # the coordinator itself serves on
        train_steps(c, "a", n_vocab, 1)  # rank 1's adapter does not notice

        agents["node-b"] = Agent(server_bin, listen, "node-b", secret, tmp_path / "node-b-2.log")
        server.wait_health("SERVING", 120)
        wait_until(lambda: _trains(c, "b", n_vocab) or None, 120, "training resumes with node-b back")
        assert any(float(np.abs(v).max()) > 0 for k, v in state_dict(c, "b").items() if "lora_B" in k)
        logs = server.stderr_text()
        assert "waits for node agent 'node-b'" in logs
        assert "engine rank 2 restarts alone" in logs and "its data-parallel group lost" not in logs
        assert homes(logs)["a"] == 1

        # A coordinator crash (kill -9: its engines on other nodes are left running) and a new
        # coordinator on the same address: the agents reconnect, stop the engines they had
        # from before, and start the new one's ranks.
        server.send_signal(signal.SIGKILL)
        server.wait_exit(30)
        again = launch_server(config(listen, secret, ["cpu", "cpu@node-a", "cpu@node-b"]))
        c2 = Client(again.grpc_address, KEYS["alice"])
        c2.call("AddAdapter", tpb.AddAdapterRequest(adapter_name="a", config=tpb.LoraConfig(r=4, seed=1)))
        assert train_steps(c2, "a", n_vocab, 3) == losses
        for agent in (agents["node-a"], agents["node-b"]):
            assert "from before the reconnection" in agent.text(), agent.text()[-2000:]
        again.stop()
    finally:
        for agent in agents.values():
            agent.kill()

    one = launch_server(auth_overrides(engine={"devices": ["cpu"]}))
    one_losses, one_final = tinker_run(one, n_vocab)
    c1 = Client(one.grpc_address, KEYS["alice"])
    c1.call("AddAdapter", tpb.AddAdapterRequest(adapter_name="a", config=tpb.LoraConfig(r=4, seed=1)))
    reference = train_steps(c1, "a", n_vocab, 3)
    rel = max(abs(a - b) / abs(b) for a, b in zip(tinker_losses, one_losses))
    worst_lp = max(float(np.abs(a - b).max()) for a, b in zip(tinker_final, one_final))
    print(f"3 ranks (coordinator + node-a + node-b): tinker step losses {tinker_losses} vs one rank {one_losses}: "
          f"max relative diff {rel:.3e}, final log-probs {worst_lp:.3e}; tokens per rank {totals}; "
          f"twinkle losses {losses} vs {reference}")
    assert len(totals) == 3 and all(t > 0 for t in totals), totals
    assert rel <= 1e-6 and worst_lp <= 1e-4
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, reference, rtol=1e-6)


def _trains(c: Client, name: str, n_vocab: int) -> bool:
    try:
        train_steps(c, name, n_vocab, 1)
    except grpc.RpcError:
        return False
    return True


def test_a_peer_without_the_node_secret_is_refused(launch_server: LaunchServer, server_bin: Path,
                                                   tmp_path: Path) -> None:
    """An agent holding another secret never gets in: the coordinator logs the refused
    handshake, the rank it would run is not started, and startup fails naming the node that
    did not connect (engine.startup_timeout_s). An agent with the secret but a node name the
    config does not use is told to stop and exits 1 saying so."""
    secret = node_secret(server_bin, tmp_path)
    (tmp_path / "other").mkdir()
    wrong = node_secret(server_bin, tmp_path / "other")
    listen = f"127.0.0.1:{free_port()}"
    intruder = Agent(server_bin, listen, "node-a", wrong, tmp_path / "intruder.log")
    # With the right secret but a node no engine.devices entry names: told to stop.
    stranger = Agent(server_bin, listen, "node-z", secret, tmp_path / "stranger.log")
    try:
        overrides = config(listen, secret, ["cpu@node-a"])
        overrides["engine"]["startup_timeout_s"] = 8
        server: ServerProcess = launch_server(overrides, wait=False)
        assert server.wait_exit(120) == 1
        logs = server.stderr_text()
        assert "node connection(s) on " + listen + ": the CURVE handshake failed" in logs, logs[-3000:]
        assert "node agent 'node-a' did not connect within 8s" in logs, logs[-3000:]
        assert "joined" not in intruder.text()
        assert stranger.proc.wait(30) == 1
        assert "has no devices on node 'node-z'" in stranger.text(), stranger.text()
        assert "node agent 'node-z' has no device in engine.devices; told to stop" in logs
    finally:
        intruder.kill()
        stranger.kill()
