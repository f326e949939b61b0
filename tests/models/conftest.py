"""A real packd server for the model-family tests and the survey (PACKD_BINARY), and a client
of it."""

import pytest

from packd_server import PackdServer


@pytest.fixture(scope="session")
def address():
    with PackdServer() as address:
        yield address


@pytest.fixture(scope="module")
def client(address):
    import packd
    with packd.Client(address, shared_memory=packd.SharedMemoryOptions(threshold_bytes=0)) as c:
        yield c
