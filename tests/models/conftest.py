"""A real packd server for the model-family tests (PACKD_BINARY)."""
import os

import pytest

from packd_server import PackdServer


@pytest.fixture(scope="session")
def address():
    with PackdServer(os.environ["PACKD_BINARY"]) as address:
        yield address
