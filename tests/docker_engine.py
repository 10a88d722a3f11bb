"""The real Docker Engine for the docker runtime's tests, made ready by ``scripts/docker-up``
(``make test`` runs it): dockerd without its default bridge and a local busybox image, no registry.

Where the engine does not answer or the image is missing, the tests that need it skip with the
reason (``scripts/docker-up`` writes its own to ``var/docker-up.txt``); with
``GPUPOOL_REQUIRE_DOCKER=1`` (CI) they fail instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from docker.errors import DockerException

TEST_IMAGE = os.environ.get("GPUPOOL_TEST_IMAGE", "gpupool-test/busybox:1")
REASON_FILE = Path(__file__).resolve().parent.parent / "var" / "docker-up.txt"


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[docker.DockerClient]:
    """A client of the engine the tests use; skips (or, in CI, fails) when there is none."""
    client = None
    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except DockerException as exc:
        reason = f"the Docker Engine does not answer ({exc})"
    else:
        try:
            client.images.get(TEST_IMAGE)
            reason = ""
        except DockerException:
            reason = f"the test image {TEST_IMAGE} is missing"
    if reason or client is None:
        if REASON_FILE.exists():
            reason += f"; scripts/docker-up said: {REASON_FILE.read_text().strip()}"
        reason += " (run scripts/docker-up as root)"
        if os.environ.get("GPUPOOL_REQUIRE_DOCKER") == "1":
            pytest.fail(f"GPUPOOL_REQUIRE_DOCKER=1 but {reason}")
        pytest.skip(reason)
    yield client
    client.close()
