"""From the base URL a user gives to a gRPC channel.

grpc://host:port and grpcs://host:port (TLS) name the gRPC endpoint directly. An HTTP(S) base
URL (http://127.0.0.1:8000, as Twinkle's scripts use; a bare host:port means http) is asked
GET {base}/api/v1/twinkle/endpoints, which answers {"grpc": "host:port", "tls": bool}.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc

from twinkle_client.errors import EndpointDiscoveryError

DISCOVERY_PATH = "/twinkle/endpoints"
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
_UNSPECIFIED_HOSTS = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class Endpoint:
    target: str          # host:port for grpc
    tls: bool
    discovered_from: str | None = None


def resolve_endpoint(base_url: str, api_key: str | None = None, timeout_s: float = 10.0,
                     root_certificates: bytes | None = None) -> Endpoint:
    url = base_url.strip()
    if not url:
        raise EndpointDiscoveryError("empty base_url")
    if url.startswith(("grpc://", "grpcs://")):
        parsed = urllib.parse.urlsplit(url)
        if not parsed.hostname or not parsed.port:
            raise EndpointDiscoveryError(f"{base_url}: expected grpc://host:port")
        return Endpoint(_host_port(parsed.hostname, parsed.port), tls=parsed.scheme == "grpcs")
    if "://" not in url:
        url = "http://" + url
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise EndpointDiscoveryError(f"{base_url}: expected http(s)://host:port, grpc://host:port or grpcs://host:port")
    return _discover(url, parsed, api_key, timeout_s, root_certificates)


def discovery_url(url: str) -> str:
    base = url.rstrip("/")
    if not base.endswith("/api/v1"):
        base += "/api/v1"
    return base + DISCOVERY_PATH


def _discover(url: str, parsed: urllib.parse.SplitResult, api_key: str | None, timeout_s: float,
              root_certificates: bytes | None) -> Endpoint:
    where = discovery_url(url)
    request = urllib.request.Request(where, headers={"Accept": "application/json"})
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    context = None
    if parsed.scheme == "https":
        context = ssl.create_default_context(cadata=root_certificates.decode() if root_certificates else None)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            body = json.loads(response.read().decode("utf-8"))
    except urllib.error.HTTPError as exc:
        raise EndpointDiscoveryError(
            f"GET {where}: HTTP {exc.code} {exc.reason}; is this a twinkle-server? "
            "(or pass the gRPC endpoint as grpc://host:port)") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise EndpointDiscoveryError(
            f"GET {where}: {getattr(exc, 'reason', exc)} (or pass the gRPC endpoint as grpc://host:port)") from exc
    target = body.get("grpc") if isinstance(body, dict) else None
    if not isinstance(target, str) or ":" not in target:
        raise EndpointDiscoveryError(f"GET {where}: expected {{'grpc': 'host:port', 'tls': bool}}, got {body!r}")
    host, _, port = target.rpartition(":")
    if host in _UNSPECIFIED_HOSTS:
        host = parsed.hostname or "127.0.0.1"
    tls = body.get("tls")
    return Endpoint(_host_port(host.strip("[]"), int(port)),
                    tls=bool(tls) if tls is not None else parsed.scheme == "https", discovered_from=where)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def read_certificates(value: bytes | str | Path | None) -> bytes | None:
    """PEM bytes from bytes, or from a file path."""
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).expanduser().read_bytes()


def make_channel(endpoint: Endpoint, root_certificates: bytes | None = None) -> grpc.Channel:
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 60_000),
    ]
    if endpoint.tls:
        credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
        return grpc.secure_channel(endpoint.target, credentials, options=options)
    return grpc.insecure_channel(endpoint.target, options=options)
