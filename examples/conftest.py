"""What the examples' tests share: a packd server (PACKD_BINARY) and a client of it, the
examples importable by name, and the check of a training loop beside its reference."""
import os
import sys

import pytest

from packd_server import PackdServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import packd  # noqa: E402


@pytest.fixture(scope="module")
def client():
    with PackdServer() as address:
        with packd.Client(address) as c:
            yield c


@pytest.fixture
def trains_as_reference(client):
    """train(client, steps=3, check=True, log=..., **kwargs) of an example that trains beside
    its reference (train_packed.train_beside): its three steps' losses and gradients equal the
    reference's to 1e-9 relative, and a per-micro-batch mean's gradients are another."""

    def check(train, **kwargs):
        lines = []
        worst_loss, worst_grad, bug = train(client, steps=3, check=True, log=lines.append,
                                            **kwargs)
        print("\n".join(lines))
        assert len(lines) == 3
        assert worst_loss <= 1e-9, lines
        assert worst_grad <= 1e-9, lines
        # The quiet bug: dividing each micro-batch by its own token count is another loss.
        assert bug > 1e-3, lines

    return check
