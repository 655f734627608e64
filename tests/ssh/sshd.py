"""A throwaway OpenSSH server in a container (``vf-sandbox/sshd``) for the SSH backend.

Used by the SSH tests, the SSH conformance run and ``python -m benchmarks``.

* A client key pair is generated per server with ``cryptography`` (ed25519 by default)
  and installed through the image's ``AUTHORIZED_KEY`` variable (root and ``sandbox``).
* The server's ed25519 host key is read out of the container into a private
  ``known_hosts`` file, so every test connects with strict host-key checking.
* Port 22 is published on ``127.0.0.1`` at a fixed free port picked here, so a killed
  and restarted container comes back at the same address.
* The container carries the session labels, so ``vf-sandbox cleanup`` sweeps it if the
  test process dies without stopping it (Ryuk is disabled in this project).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

from testcontainers.core.container import DockerContainer

from runtimes import ownership
from runtimes.ssh import SSHConfig

IMAGE = "vf-sandbox/sshd:latest"
PASSWORD = "sandbox-password"
"""The image's password for the ``sandbox`` user."""


def docker_unavailable_reason() -> str | None:
    """Why the Docker engine cannot be used here, or None when it can."""
    try:
        import docker

        client = docker.from_env(timeout=10)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - any failure means "no engine" for a skip reason
        return f"no Docker engine: {exc}"
    return None


VENV_PARTS = ("/usr/lib/python3.11/ensurepip", "/usr/share/python-wheels")
"""What ``python3 -m venv`` needs and the SSH test image lacks (Debian's ``python3-venv``,
``python3-pip-whl``)."""


def venv_part_mounts(dest: Path) -> list[tuple[str, str, str]]:
    """Volume mappings that give the SSH test host :data:`VENV_PARTS`: copied out of
    ``vf-sandbox/python`` (same base, same interpreter) into ``dest``, to mount read-only, so
    a harness can make its venv there offline."""
    import io
    import tarfile

    import docker

    client = docker.from_env()
    container = client.containers.create("vf-sandbox/python:latest", ["true"])
    mounts = []
    try:
        for part in VENV_PARTS:
            stream, _ = container.get_archive(part)
            with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                tar.extractall(dest, filter="data")
            mounts.append((str(dest / Path(part).name), part, "ro"))
    finally:
        container.remove(force=True)
        client.close()
    return mounts


def image_present() -> bool:
    import docker

    client = docker.from_env(timeout=10)
    try:
        client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        return False
    finally:
        client.close()
    return True


@dataclass(frozen=True)
class KeyPair:
    private_path: Path
    public_line: str
    private_text: str


def make_keypair(directory: Path, name: str = "id_ed25519", kind: str = "ed25519") -> KeyPair:
    """A fresh client key pair (ed25519, or RSA 2048 with ``kind='rsa'``), unencrypted."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

    key: ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey
    key = (
        ed25519.Ed25519PrivateKey.generate()
        if kind == "ed25519"
        else rsa.generate_private_key(65537, 2048)
    )
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    public = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_bytes(private)
    path.chmod(0o600)
    return KeyPair(path, public.decode() + " vf-sandbox-test", private.decode())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SSHServer:
    """One sshd container. ``start()`` / ``stop()``, or use it as a context manager."""

    def __init__(
        self,
        workdir: Path,
        key: KeyPair | None = None,
        *,
        port: int | None = None,
        volumes: list[tuple[str, str, str]] | None = None,
    ):
        self.workdir = workdir
        self.key = key or make_keypair(workdir / "client")
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.volumes = volumes or []
        self.known_hosts = workdir / "known_hosts"
        self.host_key_line = ""
        self._container: DockerContainer | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> SSHServer:
        labels = ownership.ownership_labels("docker", {"vf-sandbox.role": "ssh-test-server"})
        container = DockerContainer(IMAGE, labels=labels).with_env(
            "AUTHORIZED_KEY", self.key.public_line
        )
        # with_bind_ports() binds every interface; this sshd has a known password: loopback only.
        container.ports["22/tcp"] = (self.host, self.port)  # type: ignore[assignment]
        for host_path, container_path, mode in self.volumes:
            container.with_volume_mapping(host_path, container_path, mode)
        self._container = container
        container.start()
        try:
            self.wait_ready()
            key = self.docker_exec("cat /etc/ssh/ssh_host_ed25519_key.pub").split()
            self.host_key_line = f"{key[0]} {key[1]}"
            self.known_hosts.write_text(f"[{self.host}]:{self.port} {self.host_key_line}\n")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._container is not None:
            self._container.stop()
            self._container = None

    def __enter__(self) -> SSHServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def wrapped(self) -> Any:
        assert self._container is not None, "server not started"
        return self._container.get_wrapped_container()

    def kill(self) -> None:
        """SIGKILL the container: every connection drops, the port stops answering."""
        self.wrapped.kill()

    def start_again(self) -> None:
        """Start a killed or stopped container again (same port, same filesystem)."""
        self.wrapped.start()
        self.wait_ready()

    def restart(self) -> None:
        self.wrapped.restart(timeout=1)
        self.wait_ready()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until sshd answers with its banner on the published port."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.port), timeout=2) as sock:
                    sock.settimeout(2)
                    if sock.recv(64).startswith(b"SSH-"):
                        return
            except OSError as exc:
                last = exc
            time.sleep(0.1)
        raise TimeoutError(f"sshd on port {self.port} not ready after {timeout}s: {last}")

    def docker_exec(self, command: str) -> str:
        code, output = self.wrapped.exec_run(["sh", "-c", command])
        text = output.decode("utf-8", "replace")
        if code != 0:
            raise RuntimeError(f"docker exec {command!r} failed ({code}): {text}")
        return str(text)

    # ------------------------------------------------------------------ configs

    def config(self, **overrides: Any) -> SSHConfig:
        """A root config with the test key and strict host-key checking."""
        values: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "username": "root",
            "key_file": str(self.key.private_path),
            "known_hosts": str(self.known_hosts),
            "connect_timeout": 5.0,
        }
        values.update(overrides)
        return SSHConfig(**values)

    def password_config(self, **overrides: Any) -> SSHConfig:
        """The unprivileged ``sandbox`` user, logging in with its password."""
        values: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "username": "sandbox",
            "password": PASSWORD,
            "known_hosts": str(self.known_hosts),
            "connect_timeout": 5.0,
        }
        values.update(overrides)
        return SSHConfig(**values)


# ---------------------------------------------------------------------- a TCP echo server

ECHO_CLIENT = """
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10) as s:
    s.sendall(sys.argv[2].encode() if len(sys.argv) > 2 else b"ping")
    s.shutdown(socket.SHUT_WR)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
print(data.decode())
"""
"""Run inside the sandbox as ``python3 -c ECHO_CLIENT PORT [MESSAGE]``: prints ``echo:MESSAGE``."""


def _serve_echo(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_echo_one, args=(conn,), daemon=True).start()


def _echo_one(conn: socket.socket) -> None:
    with conn:
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        conn.sendall(b"echo:" + data)


@contextmanager
def tcp_echo_server() -> Iterator[int]:
    """A TCP server on the host's loopback answering ``echo:<everything it read>``."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    threading.Thread(target=_serve_echo, args=(listener,), daemon=True).start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        listener.close()
