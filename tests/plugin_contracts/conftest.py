"""The Ray cluster the in-process runs of this package share (`tests/helpers/in_process.py`), stopped at its end."""

import pytest

from tests.helpers.in_process import stop_shared_cluster


@pytest.fixture(scope="package", autouse=True)
def shared_ray_cluster():
    yield
    stop_shared_cluster()
