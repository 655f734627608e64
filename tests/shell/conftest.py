"""The docker fixtures (a plain client, the leak check, an image without python3) for the
container tests here."""

from tests.channel.conftest import no_python_image
from tests.docker.conftest import docker_client, no_leaks

__all__ = ["docker_client", "no_leaks", "no_python_image"]
