"""examples/train_trl_grpo.py as a test: packd.trl.PackedGRPOTrainer trains five optimizer steps
(a new generation batch each) from one seed exactly as TRL's own GRPOTrainer does: the same loss,
gradient norm and rewards at every step, in float64 to 1e-9 relative. Needs TRL (PyPI's stack;
Debian 12 has no package of it, and the test skips there, saying so)."""
import importlib.util

import pytest

import train_trl_grpo

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                       reason="TRL is on PyPI's stack only (deploy/pypi-constraints.txt)"),
    # TRL 1.16's configuration still sets a field transformers 5.24 renamed.
    pytest.mark.filterwarnings(
        r"ignore:`\w*gradient_checkpointing\w*` is deprecated:FutureWarning"),
]


def test_packd_trl_trains_as_trls_own_trainer(client):
    worst, complete = train_trl_grpo.check(client, 5)
    assert complete, "five steps logged by both trainers"
    assert worst <= 1e-9, worst


def test_the_example_trains_and_logs(client):
    logs = train_trl_grpo.train(client, 2)
    assert len(logs) == 2 and all(log["grad_norm"] > 0 for log in logs)
