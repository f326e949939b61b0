"""What the examples' tests share: a packd server (PACKD_BINARY) and a client of it, and the
examples importable by name."""
import os
import sys

import pytest

from packd_server import PackdServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import packd  # noqa: E402


@pytest.fixture(scope="module")
def client():
    with PackdServer(os.environ["PACKD_BINARY"]) as address:
        with packd.Client(address) as c:
            yield c
