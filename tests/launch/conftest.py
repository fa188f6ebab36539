"""Fixtures of the launch tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from raycluster import HeadNode, in_process_ray


@pytest.fixture(scope="package")
def local_ray(user_cluster: HeadNode) -> Iterator[None]:
    """One local Ray in this process for the Ray Train and Ray Data plane tests of this folder
    (test_ray.py, test_raydata.py), started once: 4 logical CPUs on 2, room for 3 training workers
    and the plane's decode tasks."""
    with in_process_ray("rwt-", num_cpus=4):
        yield
