"""The OCI image (deploy/image). Always (fast): the build script's plan resolves every runtime
library of the built binaries to a Debian package or the venv. Opt-in (TWINKLE_IMAGE_TEST=1;
minutes: mmdebstrap, buildah, a container start): build the image from scratch, run it with
podman (or, where podman cannot run containers here or TWINKLE_IMAGE_RUNNER=chroot, its root
file system with unshare and chroot), reach /readyz and a tinker SDK forward_backward through it, stop it with SIGTERM and
find the checkpoint data written by the non-root user on the data mount. The image's size
is printed (run with -s to see it)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml
from e2e_support.waiting import scaled, wait_until

import workload

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "deploy" / "image" / "build.sh"
TAG = os.environ.get("TWINKLE_IMAGE", "localhost/twinkle-server:test-cpu")
DRIVER = os.environ.get("TWINKLE_STORAGE_DRIVER", "vfs")
IMAGE_TEST = os.environ.get("TWINKLE_IMAGE_TEST") == "1"
UID = 10001


def test_build_plan_resolves_every_library() -> None:
    out = subprocess.run([str(BUILD), "--plan"], cwd=REPO, capture_output=True, text=True, check=False,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "libtorch_cpu.so" in out.stdout and "libgrpc++1.51" in out.stdout, out.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Container:
    """The image running on the host's network namespace, its config and data mounted."""

    def __init__(self, tmp: Path, model: Path) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self.config_dir, self.data_dir, self.model = tmp / "etc", tmp / "data", model
        self.config_dir.mkdir()
        self.data_dir.mkdir()
        os.chown(self.data_dir, UID, UID)
        config = yaml.safe_load((REPO / "deploy" / "image" / "config.yaml").read_text(encoding="utf-8"))
        config["server"].update(host="127.0.0.1", grpc_port=self.grpc_port, http_port=self.http_port,
                                drain_timeout_s=5)
        config["model"]["name"] = workload.MODEL_NAME  # the mount is /models/model
        (self.config_dir / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
        self.log = tmp / "container.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.how = ""

    def mounts(self) -> list[tuple[Path, str, bool]]:
        return [(self.config_dir, "/etc/twinkle", True), (self.model.resolve(), "/models/model", True),
                (self.data_dir, "/var/lib/twinkle", False)]

    def start_podman(self) -> bool:
        podman = shutil.which("podman")
        if podman is None or os.environ.get("TWINKLE_IMAGE_RUNNER") == "chroot":
            return False
        # runc and cgroupfs, and the host's own ulimits (containers.conf default_ulimits = []):
        # crun refuses hybrid cgroup hierarchies and sandboxes may forbid raising rlimits;
        # on an ordinary host these settings work as well.
        conf = self.log.parent / "containers.conf"
        conf.write_text("[containers]\ndefault_ulimits = []\n", encoding="utf-8")
        os.environ["CONTAINERS_CONF"] = str(conf)
        command = podman_command() + ["run", "--rm", "--name", f"twinkle-test-{self.http_port}", "--network", "host"]
        for src, dst, ro in self.mounts():
            command += ["-v", f"{src}:{dst}:{'ro' if ro else 'rw'}"]
        command.append(TAG)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.how = "podman run"
        return True

    def start_chroot(self, root: Path) -> None:
        """unshare (mount + pid namespaces) and chroot into the image's mounted root file system,
        as uid 10001, with the image's environment and command."""
        script = ["set -e"]
        for src, dst, ro in self.mounts():
            script.append(f"mkdir -p '{root}{dst}' && mount --bind '{src}' '{root}{dst}'")
            if ro:
                script.append(f"mount -o remount,bind,ro '{root}{dst}'")
        script.append(f"mount -t proc proc '{root}/proc'")
        script.append(f"exec chroot --userspec={UID}:{UID} '{root}' /usr/bin/env -i "
                      "LD_LIBRARY_PATH=/opt/twinkle/lib HOME=/var/lib/twinkle LANG=C.UTF-8 "
                      "/opt/twinkle/bin/twinkle-server launch -c /etc/twinkle/config.yaml")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(["unshare", "--mount", "--pid", "--fork", "--propagation", "private",
                                          "bash", "-c", "\n".join(script)],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.how = "unshare + chroot"

    def exited(self) -> str | None:
        assert self.proc is not None
        code = self.proc.poll()
        return None if code is None else f"{self.how} exited ({code}):\n{self.log.read_text(errors='replace')[-3000:]}"

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"


def podman_command() -> list[str]:
    command = ["podman", "--storage-driver", DRIVER]
    if shutil.which("runc"):
        command += ["--runtime", "runc", "--cgroup-manager", "cgroupfs"]
    return command


def image_size() -> str:
    out = subprocess.run(["buildah", "--storage-driver", DRIVER, "images", "--format", "{{.Size}}", TAG],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.fixture(scope="module")
def built_image() -> str:
    if not IMAGE_TEST:
        pytest.skip("the image build and run take minutes: TWINKLE_IMAGE_TEST=1 runs them")
    if os.environ.get("TWINKLE_IMAGE") is None:
        out = subprocess.run([str(BUILD), "--tag", TAG], cwd=REPO, capture_output=True, text=True, check=False,
                             timeout=3600)
        print(out.stdout)
        assert out.returncode == 0, out.stdout + out.stderr
    size = image_size()
    print(f"image {TAG}: {size}")
    return size


@pytest.fixture
def container(built_image: str, tiny_model: Path, tmp_path: Path) -> Iterator[Container]:
    box = Container(tmp_path, tiny_model)
    mounted = None
    box.start_podman()
    try:
        def up() -> bool | None:
            if box.exited() is not None:
                return None
            try:
                return requests.get(box.url("/healthz"), timeout=1).status_code == 200
            except requests.RequestException:
                return False

        if box.proc is not None:
            try:
                wait_until(lambda: up() or box.exited() is not None, scaled(60), "the container's /healthz")
            except AssertionError:
                pass
        if box.proc is None or box.exited() is not None or not up():
            # podman cannot run containers here (no cgroups, no user namespaces, ...): run
            # the image's own root file system instead.
            if box.proc is not None:
                print(f"podman run failed, running the root file system:\n{box.log.read_text(errors='replace')[-2000:]}")
            if box.proc is not None and box.proc.poll() is None:
                box.proc.kill()
            out = subprocess.run(["buildah", "--storage-driver", DRIVER, "from", "--name",
                                  f"twinkle-test-{box.http_port}", TAG], capture_output=True, text=True, check=True)
            mounted = out.stdout.strip()
            root = subprocess.run(["buildah", "--storage-driver", DRIVER, "mount", mounted],
                                  capture_output=True, text=True, check=True).stdout.strip()
            box.start_chroot(Path(root))
        yield box
    finally:
        if box.how == "podman run":  # the container outlives a killed `podman run` client
            subprocess.run(podman_command() + ["rm", "-f", "-t", "5", f"twinkle-test-{box.http_port}"],
                           check=False, capture_output=True)
        if box.proc is not None and box.proc.poll() is None:
            os.killpg(box.proc.pid, signal.SIGKILL)
            box.proc.wait()
        if mounted is not None:
            subprocess.run(["buildah", "--storage-driver", DRIVER, "rm", mounted], check=False)


def test_image_serves_readyz_and_a_forward_backward(container: Container) -> None:
    def ready() -> bool:
        try:
            return requests.get(container.url("/readyz"), timeout=2).status_code == 200
        except requests.RequestException:
            return False

    wait_until(ready, scaled(180), f"/readyz through {container.how}", interval_s=0.5, abort=container.exited)
    r = requests.get(container.url("/readyz"), timeout=5)
    assert r.headers.get("X-Request-Id"), r.headers
    losses = workload.forward_backward(f"http://127.0.0.1:{container.http_port}", "tml-image-test")
    print(f"{container.how}: forward_backward losses {losses}")
    assert losses[1] < losses[0], losses  # one optimizer step lowered the loss on the same data
    # Non-root: the server's files on the data mount belong to uid 10001.
    owned = {p.stat().st_uid for p in container.data_dir.rglob("*")}
    assert owned == {UID}, owned
    assert (container.data_dir / "registry.sqlite").exists(), sorted(container.data_dir.rglob("*"))
    # SIGTERM drains and exits cleanly.
    assert container.proc is not None
    if container.how == "podman run":
        subprocess.run(podman_command() + ["stop", "-t", "30",
                        f"twinkle-test-{container.http_port}"], check=False, capture_output=True)
    else:
        # The chroot'ed server is pid 1 of its pid namespace: signal it from the host.
        import psutil

        for child in psutil.Process(container.proc.pid).children(recursive=True):
            if child.cmdline()[:1] == ["/opt/twinkle/bin/twinkle-server"]:
                child.send_signal(signal.SIGTERM)
    assert container.proc.wait(timeout=scaled(60)) == 0, container.log.read_text(errors="replace")[-3000:]
    lines = container.log.read_text(errors="replace").splitlines()
    assert any('"stopped cleanly"' in line for line in lines), lines[-5:]
