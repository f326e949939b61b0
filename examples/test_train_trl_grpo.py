"""examples/train_trl_grpo.py as a test: packd.trl.PackedGRPOTrainer trains five optimizer steps
(a new generation batch each) from one seed exactly as TRL's own GRPOTrainer does: the same loss,
gradient norm and rewards at every step, in float64 to 1e-9 relative; and so it does with two
ranks, each its own process (accelerate's launcher, DDP over gloo on the CPU), its tokens placed
on the ranks more evenly than TRL's own slices of the batch. Needs TRL (PyPI's stack;
Debian 12 has no package of it, and the test skips there, saying so)."""
import importlib.util
import os
import re
import subprocess
import sys

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
    worst, complete, _ = train_trl_grpo.check(client, 5)
    assert complete, "five steps logged by both trainers"
    assert worst <= 1e-9, worst


def test_the_example_trains_and_logs(client):
    logs = train_trl_grpo.train(client, 2)
    assert len(logs) == 2 and all(log["grad_norm"] > 0 for log in logs)


def test_two_ranks_train_as_trls_own_trainer_and_even_out_their_tokens(client):
    """Two processes, as `accelerate launch --multi_gpu --num_processes 2` starts them (torch's
    launcher; with use_cpu the ranks run on the CPU over gloo)."""
    example = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_trl_grpo.py")
    run = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
         "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         "--main_process_port", "0", example, "--address", client.address, "--check",
         "--steps", "3"], capture_output=True, text=True, timeout=600)
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-4000:]
    worst = [float(w) for w in re.findall(r"worst relative difference (\S+)", out)]
    balance = re.findall(r"generation batch (\d+): .* over the mean (\S+) \(TRL's slices: "
                         r"(\S+)\)", out)
    print(out)
    assert len(worst) == 2 and max(worst) <= 1e-9, out  # each rank's check
    assert len(balance) == 2 * 3, out                   # each rank, each generation batch
    for _, ours, trls in balance:
        assert 1.0 <= float(ours) <= float(trls), out
