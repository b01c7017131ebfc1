"""TLS on both listeners, and mutual TLS, against the real server.

A throw-away PKI is made with the openssl CLI for each test module: a CA, a server
certificate for 127.0.0.1/localhost, a client certificate from the same CA, and a client
certificate from an unrelated CA. The server then runs with server.tls set; gRPC (health)
and HTTPS (/healthz) must work for clients that trust the CA and fail for plaintext clients;
with server.tls.client_ca_file, only clients presenting a certificate from that CA get in.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from e2e_support.server import LaunchServer, ServerProcess
from e2e_support.waiting import scaled, wait_until

STARTUP_TIMEOUT_S = 120.0
RPC_TIMEOUT_S = 5.0

CA_CONFIG = """\
[req]
distinguished_name = dn
x509_extensions = v3_ca
prompt = no
[dn]
CN = {name}
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
"""

SERVER_EXTENSIONS = """\
basicConstraints = CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
"""

CLIENT_EXTENSIONS = """\
basicConstraints = CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
"""


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_client_cert: Path  # signed by a CA the server does not know
    rogue_client_key: Path

    def read(self, path: Path) -> bytes:
        return path.read_bytes()


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(
        ["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"openssl {' '.join(args)} failed:\n{result.stderr}"


def _make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    config = directory / f"{name}.cnf"
    config.write_text(CA_CONFIG.format(name=f"twinkle test {name}"), encoding="utf-8")
    key, cert = directory / f"{name}.key", directory / f"{name}.crt"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(cert), "-days", "2", "-config", str(config),
        cwd=directory,
    )
    return cert, key


def _make_leaf(
    directory: Path, name: str, extensions: str, ca: tuple[Path, Path]
) -> tuple[Path, Path]:
    key, csr, cert = (directory / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
    ext_file = directory / f"{name}.ext"
    ext_file.write_text(extensions, encoding="utf-8")
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}",
        cwd=directory,
    )
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
        "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext_file),
        cwd=directory,
    )
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca = _make_ca(directory, "ca")
    rogue_ca = _make_ca(directory, "rogue-ca")
    server_cert, server_key = _make_leaf(directory, "localhost", SERVER_EXTENSIONS, ca)
    client_cert, client_key = _make_leaf(directory, "client", CLIENT_EXTENSIONS, ca)
    rogue_cert, rogue_key = _make_leaf(directory, "rogue-client", CLIENT_EXTENSIONS, rogue_ca)
    return Pki(ca[0], server_cert, server_key, client_cert, client_key, rogue_cert, rogue_key)


def _tls_overrides(pki: Pki, client_ca: bool) -> Mapping[str, Any]:
    tls = {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)}
    if client_ca:
        tls["client_ca_file"] = str(pki.ca_cert)
    return {"server": {"tls": tls}}


def _health(
    address: str, credentials: grpc.ChannelCredentials | None, timeout_s: float = RPC_TIMEOUT_S
) -> str:
    """The server's health status name; raises grpc.RpcError when the call fails."""
    channel = (
        grpc.secure_channel(address, credentials)
        if credentials is not None
        else grpc.insecure_channel(address)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def _start_tls(launch_server: LaunchServer, pki: Pki, client_ca: bool) -> ServerProcess:
    """Launch with TLS and wait until health over TLS (with the client cert) says SERVING."""
    server = launch_server(_tls_overrides(pki, client_ca), wait=False)
    server.wait_ports(scaled(STARTUP_TIMEOUT_S))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.read(pki.ca_cert),
        private_key=pki.read(pki.client_key),
        certificate_chain=pki.read(pki.client_cert),
    )

    def serving() -> bool:
        try:
            return _health(server.grpc_address, credentials, timeout_s=1.0) == "SERVING"
        except grpc.RpcError:
            return False

    wait_until(
        serving,
        scaled(STARTUP_TIMEOUT_S),
        f"health SERVING over TLS at {server.grpc_address}",
        interval_s=0.1,
        abort=server.exit_reason,
    )
    return server


def _https(server: ServerProcess, path: str) -> str:
    return f"https://127.0.0.1:{server.http_port}{path}"


def test_tls_serves_grpc_and_https(launch_server: LaunchServer, pki: Pki) -> None:
    server = _start_tls(launch_server, pki, client_ca=False)
    ca_only = grpc.ssl_channel_credentials(root_certificates=pki.read(pki.ca_cert))
    assert _health(server.grpc_address, ca_only) == "SERVING", server.logs()

    # A plaintext gRPC client cannot talk to the TLS port.
    with pytest.raises(grpc.RpcError) as plain:
        _health(server.grpc_address, None, timeout_s=2.0)
    assert plain.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

    # A client that does not trust the CA refuses the server.
    with pytest.raises(grpc.RpcError):
        _health(server.grpc_address, grpc.ssl_channel_credentials(), timeout_s=2.0)

    # HTTPS with the CA works, on the IP and on the name of the certificate.
    response = requests.get(_https(server, "/healthz"), verify=str(pki.ca_cert), timeout=scaled(5))
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "ok"}
    by_name = requests.get(
        f"https://localhost:{server.http_port}/readyz", verify=str(pki.ca_cert), timeout=scaled(5)
    )
    assert by_name.status_code == 200, by_name.text
    endpoints = requests.get(
        _https(server, "/api/v1/twinkle/endpoints"), verify=str(pki.ca_cert), timeout=scaled(5)
    )
    assert endpoints.json()["tls"] is True

    # Without the CA the certificate is not trusted; plaintext HTTP gets no answer.
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(_https(server, "/healthz"), timeout=scaled(5))
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(server.http_url("/healthz"), timeout=scaled(5))

    # The server still answers after those failed handshakes.
    again = requests.get(_https(server, "/healthz"), verify=str(pki.ca_cert), timeout=scaled(5))
    assert again.status_code == 200


def test_mutual_tls_requires_a_client_certificate(launch_server: LaunchServer, pki: Pki) -> None:
    server = _start_tls(launch_server, pki, client_ca=True)
    ca = pki.read(pki.ca_cert)

    # gRPC: with the client certificate in; without one, or with one from another CA, out.
    with_cert = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=pki.read(pki.client_key),
        certificate_chain=pki.read(pki.client_cert),
    )
    assert _health(server.grpc_address, with_cert) == "SERVING", server.logs()
    with pytest.raises(grpc.RpcError) as no_cert:
        _health(server.grpc_address, grpc.ssl_channel_credentials(root_certificates=ca), 3.0)
    assert no_cert.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    rogue = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=pki.read(pki.rogue_client_key),
        certificate_chain=pki.read(pki.rogue_client_cert),
    )
    with pytest.raises(grpc.RpcError):
        _health(server.grpc_address, rogue, 3.0)

    # HTTPS: the same.
    verify = str(pki.ca_cert)
    response = requests.get(
        _https(server, "/healthz"),
        verify=verify,
        cert=(str(pki.client_cert), str(pki.client_key)),
        timeout=scaled(5),
    )
    assert response.status_code == 200, response.text
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(_https(server, "/healthz"), verify=verify, timeout=scaled(5))
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(
            _https(server, "/healthz"),
            verify=verify,
            cert=(str(pki.rogue_client_cert), str(pki.rogue_client_key)),
            timeout=scaled(5),
        )


TINKER_OVER_HTTPS = """
import sys
import tinker
from tinker import types
service = tinker.ServiceClient(base_url=sys.argv[1], api_key="tml-tls-check")
made = service.create_lora_training_client(base_model="tiny-qwen3", rank=4)
training = made.result() if hasattr(made, "result") else made
seq = [11, 42, 7, 99, 123, 5]
datum = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                    loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)})
out = training.forward_backward([datum], "cross_entropy").result()
logprobs = out.loss_fn_outputs[0]["logprobs"].tolist()
print("LOSS", out.metrics["loss:sum"], "SUM", -sum(logprobs))
"""


def test_tinker_sdk_trains_over_https(launch_server: LaunchServer, pki: Pki, tmp_path: Path) -> None:
    """The unmodified tinker SDK over the TLS HTTP port, trusting our CA through
    SSL_CERT_FILE (httpx reads it), in its own process so no other test sees that variable."""
    server = _start_tls(launch_server, pki, client_ca=False)
    script = tmp_path / "tinker_https.py"
    script.write_text(TINKER_OVER_HTTPS)
    env = {**os.environ, "SSL_CERT_FILE": str(pki.ca_cert), "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    done = subprocess.run([sys.executable, str(script), _https(server, "")], env=env, capture_output=True,
                          text=True, timeout=scaled(120), check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-4000:]}\n{server.logs()}"
    loss, total = (float(v) for v in done.stdout.split()[1::2])
    assert loss > 0 and abs(loss - total) <= 1e-4 * loss


def test_openai_stream_over_https(launch_server: LaunchServer, pki: Pki) -> None:
    """A streamed /v1/completions (chunked server-sent events) over TLS: every chunk, then
    [DONE]; and a client that closes mid-stream is noticed there too (the sampler goes idle)."""
    import json

    from e2e_support import prom

    server = _start_tls(launch_server, pki, client_ca=False)
    body = {"model": "tiny-qwen3", "prompt": [11, 42, 7, 99], "max_tokens": 12, "temperature": 0, "stream": True,
            "extra": "ignored"}
    with requests.post(_https(server, "/v1/completions"), json=body, stream=True, verify=str(pki.ca_cert),
                       timeout=scaled(60)) as r:
        assert r.status_code == 200, r.text
        events = [line for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "data: [DONE]"
    tokens = [t for e in events[:-1] for t in json.loads(e[len("data: "):])["choices"][0]["token_ids"]]
    assert 1 <= len(tokens) <= 12

    def generated() -> float:
        text = requests.get(_https(server, "/metrics"), verify=str(pki.ca_cert), timeout=scaled(5)).text
        return prom.value(prom.parse(text), "twinkle_sampler_tokens_total")

    before = generated()
    long = {**body, "prompt": [[11, 42, 7, 99]] * 8, "max_tokens": 500, "ignore_eos": True}
    with requests.post(_https(server, "/v1/completions"), json=long, stream=True, verify=str(pki.ca_cert),
                       timeout=scaled(60)) as r:
        next(line for line in r.iter_lines() if line)  # the first event, then the client closes

    def idle() -> bool:
        text = requests.get(_https(server, "/metrics"), verify=str(pki.ca_cert), timeout=scaled(5)).text
        samples = prom.parse(text)
        return (prom.value(samples, "twinkle_sampler_rows", state="running") == 0
                and prom.value(samples, "twinkle_sampler_rows", state="waiting") == 0
                and prom.value(samples, "twinkle_sampler_kv_blocks", state="in_use") == 0)

    wait_until(idle, scaled(60), "the sampler idle after the client closed", interval_s=0.05)
    assert generated() == before  # its rows were cancelled, never finished (finished rows are counted)
