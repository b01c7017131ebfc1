"""deploy/k8s: each overlay renders with `kubectl kustomize`, every object validates against a
pinned Kubernetes version's schemas (kubernetes-validate, strict: no unknown fields), and the
Deployment keeps the promises docs/deploy.md makes (probes, preStop, grace, non-root, mounts).
The config the pod would read is parsed by the real `twinkle-server print-config`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ["cpu-demo", "gpu", "gpu-nodes"]
# The Kubernetes version the manifests are validated against (docs/deploy.md).
KUBERNETES_VERSION = "1.33.0"


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is not installed (it renders the kustomizations)"
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True, text=True, check=False, timeout=120,
    )
    assert out.returncode == 0, f"kubectl kustomize {overlay} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(docs: list[dict[str, Any]], kind: str, name_prefix: str = "") -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"expected one {kind} {name_prefix}*, found {[d['metadata']['name'] for d in found]}"
    return found[0]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def test_every_object_validates_against_the_pinned_kubernetes(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    kinds = sorted(d["kind"] for d in docs)
    for kind in ("ConfigMap", "Deployment", "PersistentVolumeClaim", "Service", "ServiceAccount"):
        assert kind in kinds, f"{overlay}: no {kind} rendered ({kinds})"
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")


def test_a_misspelt_field_is_caught(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """The validation above can fail: a field the schema does not know is an error."""
    _, docs = rendered
    deployment = dict(one(docs, "Deployment"))
    deployment["spec"] = dict(deployment["spec"], replica=1)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def pod_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    config_map = one(docs, "ConfigMap", "twinkle-config")
    return yaml.safe_load(config_map["data"]["config.yaml"])


def test_deployment_probes_drain_and_security(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    config = pod_config(docs)
    want = {"grpc": config["server"]["grpc_port"], "http": config["server"]["http_port"]}
    if "nodes" in config:  # node agents connect, their ranks rendezvous (gpu-nodes)
        want |= {"nodes": int(config["nodes"]["listen"].rsplit(":", 1)[1]),
                 "rendezvous": config["nodes"]["rendezvous_port"]}
    assert ports == want
    assert config["server"]["host"] == "0.0.0.0", "probes and Services reach the pod's own address"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    # preStop sleeps, then SIGTERM drains for server.drain_timeout_s: the grace covers both.
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "/bin/sleep", command
    pre_stop_s = float(command[1])
    drain_s = float(config["server"]["drain_timeout_s"])
    grace_s = pod["terminationGracePeriodSeconds"]
    assert grace_s >= pre_stop_s + drain_s + 5, (
        f"{overlay}: terminationGracePeriodSeconds {grace_s} < preStop {pre_stop_s} + drain_timeout_s {drain_s} + 5"
    )
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["automountServiceAccountToken"] is False


def test_each_overlay_runs_its_own_image_variant(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """cpu-demo runs the CPU image, gpu the CUDA one (deploy/image/build.sh --variant) with a GPU
    and a CUDA device in its config. (An `images` entry in the base once renamed the image
    before the gpu overlay's entry could match it, so the GPU pod ran the CPU image.)"""
    overlay, docs = rendered
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    devices = pod_config(docs)["engine"]["devices"]
    if overlay.startswith("gpu"):
        assert container["image"].endswith("-cuda"), container["image"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert devices[0] == "cuda:0" and all(d.startswith("cuda:0@") for d in devices[1:]), devices
        assert len(devices) == (3 if overlay == "gpu-nodes" else 1)
    else:
        assert container["image"].endswith("-cpu"), container["image"]
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
        assert devices == ["cpu"]


def test_mounts_match_the_config(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    config = pod_config(docs)
    config_map = one(docs, "ConfigMap", "twinkle-config")
    assert volumes[mounts["/etc/twinkle"]]["configMap"]["name"] == config_map["metadata"]["name"]
    assert container["args"] == ["launch", "-c", "/etc/twinkle/config.yaml"]
    tenants_dir = str(Path(config["auth"]["tenants_file"]).parent)
    assert "secret" in volumes[mounts[tenants_dir]], f"{overlay}: the tenants file is not from a Secret"
    pvcs = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    data = volumes[mounts[config["storage"]["data_dir"]]]
    assert data["persistentVolumeClaim"]["claimName"] in pvcs
    model_root = str(Path(config["model"]["path"]).parent)
    assert volumes[mounts[model_root]]["persistentVolumeClaim"]["claimName"] in pvcs
    selector = one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    coordinator_services = [d for d in docs if d["kind"] == "Service" and d["spec"]["selector"] == selector]
    services = {p["targetPort"] for d in coordinator_services for p in d["spec"]["ports"]}
    container_ports = {p["name"] for p in container["ports"]}
    assert services == container_ports, f"{overlay}: Services {services} vs the container's ports {container_ports}"
    others = [d["metadata"]["name"] for d in docs if d["kind"] == "Service" and d not in coordinator_services]
    assert others == (["twinkle-node-agent"] if overlay == "gpu-nodes" else []), others


def test_cpu_demo_config_and_tenants_load_in_the_real_server(tmp_path: Path) -> None:
    """The pod's config.yaml and the demo tenants Secret, parsed by twinkle-server itself."""
    import base64

    server = REPO / "build" / "bin" / "twinkle-server"
    assert server.exists(), f"{server} is not built"
    docs = render("cpu-demo")
    config = pod_config(docs)
    secret = one(docs, "Secret", "twinkle-tenants")
    tenants = tmp_path / "tenants.yaml"
    tenants.write_bytes(base64.b64decode(secret["data"]["tenants.yaml"]))
    config["auth"]["tenants_file"] = str(tenants)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    out = subprocess.run([str(server), "print-config", "-c", str(path), "--format", "json"],
                         capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 0, out.stderr
    import json

    effective = json.loads(out.stdout)
    assert effective["logging"]["format"] == "json"
    assert [t["id"] for t in effective["auth"]["tenants"]] == ["demo"]


def test_node_agents_match_the_coordinator_config(tmp_path: Path) -> None:
    """gpu-nodes: the StatefulSet's pods are the nodes engine.devices names (DEVICE@POD), they
    join the Service that fronts the coordinator's nodes.listen port, hold the node secret
    from the same Secret at the configured path, reach the rendezvous through the Service the
    config names, each get one GPU and mount the model where the coordinator says it is (a
    ReadOnlyMany volume). The config itself passes the real server's checks."""
    import json

    docs = render("gpu-nodes")
    config = pod_config(docs)
    agents = one(docs, "StatefulSet", "twinkle-node-agent")
    name, replicas = agents["metadata"]["name"], agents["spec"]["replicas"]
    assert [d for d in config["engine"]["devices"] if "@" in d] == [f"cuda:0@{name}-{i}" for i in range(replicas)]
    pod = agents["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    args = agent["args"]
    assert args[0] == "worker" and args[args.index("--node") + 1] == "$(POD_NAME)"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in agent["env"]
    join_host, join_port = args[args.index("--join") + 1].rsplit(":", 1)
    listen_port = int(config["nodes"]["listen"].rsplit(":", 1)[1])
    nodes_service = one(docs, "Service", join_host)
    service_ports = {p["port"]: p["targetPort"] for p in nodes_service["spec"]["ports"]}
    assert service_ports[int(join_port)] == "nodes"
    coordinator = one(docs, "Deployment")["spec"]["template"]["spec"]
    (server,) = coordinator["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert container_ports["nodes"] == listen_port
    assert config["nodes"]["rendezvous_host"] == join_host
    assert service_ports[config["nodes"]["rendezvous_port"]] == "rendezvous"
    assert container_ports["rendezvous"] == config["nodes"]["rendezvous_port"]
    assert nodes_service["spec"]["selector"] == one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    # The node secret: one Secret, mounted where the config and the agents' flag say.
    secret_path = Path(config["nodes"]["secret_file"])
    assert args[args.index("--secret-file") + 1] == str(secret_path)
    for spec, container in ((coordinator, server), (pod, agent)):
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts[str(secret_path.parent)]]["secret"]["secretName"] == "twinkle-node-secret"
        model_root = str(Path(config["model"]["path"]).parent)
        assert volumes[mounts[model_root]]["persistentVolumeClaim"]["claimName"] == "twinkle-models"
    assert one(docs, "PersistentVolumeClaim", "twinkle-models")["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert agent["image"].endswith("-cuda") and agent["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True

    server_bin = REPO / "build" / "bin" / "twinkle-server"
    config["auth"]["tenants_file"] = str(tmp_path / "tenants.yaml")
    (tmp_path / "tenants.yaml").write_text("tenants:\n  - id: t\n    key_sha256: [" + "0" * 64 + "]\n",
                                           encoding="utf-8")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    out = subprocess.run([str(server_bin), "print-config", "-c", str(path), "--format", "json"],
                         capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["nodes"]["secret_file"] == "***"
