"""A real packd server for the Python client tests (PACKD_BINARY)."""

import pytest

from packd_server import PackdServer


@pytest.fixture(scope="session")
def address():
    with PackdServer() as address:
        yield address
