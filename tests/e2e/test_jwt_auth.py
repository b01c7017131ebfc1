"""The tinker SDK's JWT auth exchange against a real server (auth on; tenants alice and bob):
the SDK trades its API key for a token at POST /api/v1/auth/token (client config
pjwt_auth_enabled) and sends the token from then on. Checked here:

- RestClient.whoami, `tinker auth whoami`, `tinker auth status` and `tinker model list` (whose
  no-match error names the org from whoami) work through tokens;
- a token's signature is HS256 under the configured secret, recomputed here with hmac/hashlib
  (independent of the server's libjwt), and its claims are the documented ones;
- a token acts as its key over HTTP and gRPC; a token is never exchanged for another; forged,
  oversized and expired tokens are 401 with `WWW-Authenticate: Bearer error="invalid_token"`;
- the SDK keeps training across its token's expiry (the server's clock is advanced past it:
  the SDK replaces the refused token and replays the call);
- a revoked key's token fails on its next call, while the other tenant is served;
- tokens survive a restart (the signing key is kept); with auth.jwt_ttl_s 0 the exchange is off.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from e2e_support.server import LaunchServer, ServerProcess  # noqa: E402
from e2e_support.training import KEYS, auth_overrides  # noqa: E402

MODEL_NAME = "tiny-qwen3"
SECRET_HEX = "5e" * 32
SEQ = [11, 42, 7, 99, 123, 5, 64, 300, 17]


def b64url_decode(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def claims_of(token: str) -> dict[str, Any]:
    return json.loads(b64url_decode(token.split(".")[1]))


def exchange(server: ServerProcess, credential: str) -> requests.Response:
    return requests.post(server.http_url("/api/v1/auth/token"), json={}, headers={"X-API-Key": credential},
                         timeout=30)


def me(server: ServerProcess, credential: str) -> requests.Response:
    return requests.get(server.http_url("/api/v1/auth/apikey/me"), headers={"X-API-Key": credential}, timeout=30)


def advance_clock(server: ServerProcess, seconds: float) -> None:
    r = requests.post(server.http_url("/api/v1/twinkle/testing/advance_clock"), json={"seconds": seconds},
                      headers={"X-API-Key": KEYS["alice"]}, timeout=30)
    assert r.status_code == 200, r.text


def overrides(tmp_path: Path, **auth: Any) -> dict[str, Any]:
    base = auth_overrides(storage={"data_dir": str(tmp_path / "data")}, testing={"hooks": True})
    base["auth"] = {**base["auth"], "jwt_signing_secret": SECRET_HEX, **auth}
    return base


def datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]), loss_fn_inputs={"target_tokens": SEQ[1:]})


def auth_failures(server: ServerProcess) -> float:
    text = requests.get(server.http_url("/metrics"), timeout=30).text
    [line] = [ln for ln in text.splitlines() if ln.startswith("twinkle_auth_failures_total")]
    return float(line.split()[-1])


def assert_invalid_token(r: requests.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.headers.get("WWW-Authenticate") == 'Bearer error="invalid_token"'


@pytest.fixture
def server(launch_server: LaunchServer, tmp_path: Path) -> ServerProcess:
    return launch_server(overrides(tmp_path))


def test_tokens_are_hs256_with_the_documented_claims_and_act_as_their_key(server: ServerProcess) -> None:
    config = requests.post(server.http_url("/api/v1/client/config"), json={"sdk_version": tinker.__version__},
                           headers={"X-API-Key": KEYS["alice"]}, timeout=30)
    assert config.status_code == 200 and config.json()["pjwt_auth_enabled"] is True

    r = exchange(server, KEYS["alice"])
    assert r.status_code == 200, r.text
    token = r.json()["jwt"]
    header_b64, payload_b64, signature_b64 = token.split(".")
    assert json.loads(b64url_decode(header_b64))["alg"] == "HS256"
    expected = hmac.new(bytes.fromhex(SECRET_HEX), f"{header_b64}.{payload_b64}".encode(), hashlib.sha256).digest()
    assert hmac.compare_digest(b64url_decode(signature_b64), expected)
    key = me(server, KEYS["alice"]).json()
    claims = claims_of(token)
    assert claims["iss"] == "twinkle-server" and claims["org_id"] == "alice" and claims["email"] == ""
    assert claims["key_id"] == int(key["key_id"]) and claims["sub"] == f"twinkle:key:{key['key_id']}"
    assert claims["exp"] - claims["iat"] == 3600
    assert KEYS["alice"] not in token

    # The token acts as alice's key, over HTTP and over gRPC.
    assert me(server, token).json()["tenant"] == "alice"
    from twinkle_client._proto.tinker.v1 import tinker_service_pb2 as ts
    from twinkle_client._proto.tinker.v1 import tinker_service_pb2_grpc as tsg
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = tsg.TinkerServiceStub(channel)
        caps = stub.GetServerCapabilities(ts.GetServerCapabilitiesRequest(), metadata=[("x-api-key", token)],
                                          timeout=30)
        assert [m.model_name for m in caps.supported_models] == [MODEL_NAME]
        forged_grpc = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
        with pytest.raises(grpc.RpcError) as e:
            stub.GetServerCapabilities(ts.GetServerCapabilitiesRequest(), metadata=[("x-api-key", forged_grpc)],
                                       timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

    # Never a token for a token; no token for a bad key or none.
    again = exchange(server, token)
    assert again.status_code == 401 and "API key" in again.json()["detail"]
    assert exchange(server, "tml-nobody").status_code == 401
    assert requests.post(server.http_url("/api/v1/auth/token"), json={}, timeout=30).status_code == 401

    # Forged: claims changed under alice's signature, another secret, alg none, oversized.
    bob_claims = {**claims, "org_id": "bob"}
    swapped = f"{header_b64}.{base64.urlsafe_b64encode(json.dumps(bob_claims).encode()).decode().rstrip('=')}.{signature_b64}"
    assert_invalid_token(me(server, swapped))
    other = hmac.new(b"x" * 32, f"{header_b64}.{payload_b64}".encode(), hashlib.sha256).digest()
    assert_invalid_token(me(server, f"{header_b64}.{payload_b64}.{base64.urlsafe_b64encode(other).decode().rstrip('=')}"))
    none_header = base64.urlsafe_b64encode(b'{"alg":"none","typ":"JWT"}').decode().rstrip("=")
    assert_invalid_token(me(server, f"{none_header}.{payload_b64}."))
    assert_invalid_token(me(server, "eyJ" + "a" * 5000 + ".b.c"))
    for bad in (swapped, token):
        assert bad[20:60] not in server.logs()


def test_whoami_training_across_expiry_and_revocation(server: ServerProcess, tmp_path: Path) -> None:
    url = f"http://{server.host}:{server.http_port}"
    rest = tinker.RestClient(base_url=url, api_key=KEYS["alice"])
    identity = rest.whoami().result()
    key_id = me(server, KEYS["alice"]).json()["key_id"]
    assert identity.user_urn == f"twinkle:key:{key_id}"
    assert identity.org_urn == "tml:organization:alice"
    assert identity.email is None

    # The CLI prints the same identity.
    env = {**os.environ, "TINKER_BASE_URL": url, "TINKER_API_KEY": KEYS["bob"]}
    cli = Path(sys.executable).parent / "tinker"
    out = subprocess.run([str(cli), "--format", "json", "auth", "whoami"], env=env, capture_output=True, text=True,
                         timeout=120, check=False, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert printed["org_urn"] == "tml:organization:bob"
    assert printed["user_urn"] == f"twinkle:key:{me(server, KEYS['bob']).json()['key_id']}"
    # `tinker auth status`, and `tinker model list` (whose no-match error names the org, from
    # whoami).
    status = subprocess.run([str(cli), "auth", "status"], env=env, capture_output=True, text=True, timeout=120,
                            check=False, cwd=tmp_path)
    assert status.returncode == 0 and "Tinker accessible: yes" in status.stdout, status.stdout + status.stderr
    models = subprocess.run([str(cli), "--format", "json", "model", "list"], env=env, capture_output=True, text=True,
                            timeout=120, check=False, cwd=tmp_path)
    assert models.returncode == 0 and MODEL_NAME in models.stdout, models.stderr
    none = subprocess.run([str(cli), "model", "list", "no-such-model"], env=env, capture_output=True, text=True,
                          timeout=120, check=False, cwd=tmp_path)
    assert none.returncode != 0 and "tml:organization:bob" in none.stdout + none.stderr, none.stdout + none.stderr

    # Training through tokens; then the server's clock passes the tokens' expiry: the SDK
    # gets invalid_token, exchanges its key again and replays the call.
    alice = tinker.ServiceClient(base_url=url, api_key=KEYS["alice"])
    training = alice.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    first = training.forward_backward([datum()], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    old_token = exchange(server, KEYS["alice"]).json()["jwt"]
    advance_clock(server, 3601)
    r = me(server, old_token)
    assert_invalid_token(r)
    assert "expired" in r.json()["detail"]
    refused_before = auth_failures(server)
    after = training.forward_backward([datum()], "cross_entropy").result()
    assert after.metrics["loss:sum"] < first.metrics["loss:sum"]  # the step applied
    assert auth_failures(server) > refused_before  # the SDK's expired token was refused, then replaced
    new_token = exchange(server, KEYS["alice"]).json()["jwt"]
    assert me(server, new_token).status_code == 200

    # bob revokes his own key through his token (tinker auth logout's route): his token fails
    # on its next call, and so does the exchange; alice is served throughout.
    bob_token = exchange(server, KEYS["bob"]).json()["jwt"]
    assert me(server, bob_token).json()["tenant"] == "bob"
    revoked = requests.delete(server.http_url("/api/v1/auth/apikey/me"), headers={"X-API-Key": bob_token},
                              timeout=30)
    assert revoked.status_code == 200, revoked.text
    assert_invalid_token(me(server, bob_token))
    assert exchange(server, KEYS["bob"]).status_code == 401
    with pytest.raises(tinker.AuthenticationError):
        tinker.RestClient(base_url=url, api_key=KEYS["bob"]).whoami().result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert me(server, new_token).json()["tenant"] == "alice"


def test_tokens_survive_a_restart_and_the_exchange_can_be_turned_off(launch_server: LaunchServer,
                                                                      tmp_path: Path) -> None:
    # No configured secret: the server makes <data_dir>/jwt_signing.key once and keeps it.
    config = overrides(tmp_path)
    del config["auth"]["jwt_signing_secret"]
    first = launch_server(config)
    token = exchange(first, KEYS["alice"]).json()["jwt"]
    key_file = tmp_path / "data" / "jwt_signing.key"
    assert key_file.stat().st_size == 32 and (key_file.stat().st_mode & 0o777) == 0o600
    first.stop()
    second = launch_server({**config, "server": {"host": "127.0.0.1", "grpc_port": first.grpc_port,
                                                 "http_port": first.http_port}})
    assert me(second, token).json()["tenant"] == "alice"
    second.stop()

    off = launch_server(overrides(tmp_path / "off", jwt_ttl_s=0))
    config_off = requests.post(off.http_url("/api/v1/client/config"), json={}, headers={"X-API-Key": KEYS["alice"]},
                               timeout=30).json()
    assert config_off["pjwt_auth_enabled"] is False
    r = exchange(off, KEYS["alice"])
    assert r.status_code == 404 and "jwt_ttl_s" in r.json()["detail"]
    with pytest.raises(RuntimeError, match="whoami requires JWT auth"):
        tinker.RestClient(base_url=f"http://{off.host}:{off.http_port}", api_key=KEYS["alice"]).whoami().result()
    # The key alone still trains.
    training = tinker.ServiceClient(base_url=f"http://{off.host}:{off.http_port}",
                                    api_key=KEYS["alice"]).create_lora_training_client(base_model=MODEL_NAME,
                                                                                        rank=4).result()
    training.forward_backward([datum()], "cross_entropy").result()
