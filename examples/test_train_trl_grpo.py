"""examples/train_trl_grpo.py as a test: packd.trl.PackedGRPOTrainer trains five optimizer steps
(a new generation batch each) from one seed exactly as TRL's own GRPOTrainer does: the same loss,
gradient norm and rewards at every step, in float64 to 1e-9 relative; and so it does with two
ranks, each its own process (accelerate's launcher, DDP over gloo on the CPU), its tokens placed
on the ranks more evenly than TRL's own slices of the batch. The streaming form trains on one
rank and on two, each rank its own micro-batches of every step (the proofs of its gradients:
tests/python/test_trl_streaming.py). Needs TRL (PyPI's stack;
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


def test_a_kl_penalty_trains_as_trls_own_trainer(client):
    """beta = 0.04 over five steps: the reference model runs packed; loss, gradient norm and
    rewards equal stock's with whole-group micro-batches, and with TRL's own slices
    (micro_batches="trl") the logged KL too (a mean over the micro-batches, which whole groups
    hold other rows than TRL's)."""
    worst, complete, _ = train_trl_grpo.check(client, 5, beta=0.04)
    assert complete and worst <= 1e-9, worst
    worst, complete, _ = train_trl_grpo.check(client, 5, ("loss", "grad_norm", "reward", "kl"),
                                              beta=0.04, micro_batches="trl")
    assert complete and worst <= 1e-9, worst


def test_the_example_trains_and_logs(client):
    logs = train_trl_grpo.train(client, 2)
    assert len(logs) == 2 and all(log["grad_norm"] > 0 for log in logs)


# A number as the example prints it: the ranks' processes share one pipe, and another rank's
# output may follow it on the same line.
NUMBER = r"-?[0-9.]+(?:e[-+][0-9]+)?"


def on_two_ranks(client, *args):
    """The example as `accelerate launch --multi_gpu --num_processes 2` starts it (torch's
    launcher; with use_cpu the ranks run on the CPU over gloo): its output."""
    example = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_trl_grpo.py")
    run = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
         "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         "--main_process_port", "0", example, "--address", client.address, *args],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    return run.stdout


def test_two_ranks_train_as_trls_own_trainer_and_even_out_their_tokens(client):
    out = on_two_ranks(client, "--check", "--steps", "3")
    worst = [float(w) for w in re.findall(r"worst relative difference (%s)" % NUMBER, out)]
    balance = re.findall(r"generation batch (\d+): .* over the mean (%s) \(TRL's slices: "
                         r"(%s)\)" % (NUMBER, NUMBER), out)
    print(out)
    assert len(worst) == 2 and max(worst) <= 1e-9, out  # each rank's check
    assert len(balance) == 2 * 3, out                   # each rank, each generation batch
    for _, ours, trls in balance:
        assert 1.0 <= float(ours) <= float(trls), out


def test_two_ranks_with_groups_straddling_trls_slices(client):
    """6 rows a micro-batch in groups of 4 on two ranks: 6 groups for 4 micro-batches, which
    TRL trains with groups straddling its slices and ranks: packd trains those slices."""
    out = on_two_ranks(client, "--check", "--steps", "3", "--uneven")
    worst = [float(w) for w in re.findall(r"worst relative difference (%s)" % NUMBER, out)]
    assert len(worst) == 2 and max(worst) <= 1e-9, out


def test_the_streaming_form_trains_on_one_rank(client):
    trainer = train_trl_grpo.train_streaming(client, 2)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(log["grad_norm"] > 0 for log in logs)
    assert [log["packd/groups"] for log in logs] == [4, 4]
    for streamed in trainer.streamed_steps:
        assert streamed["micro_batches"] and streamed["global_loss_tokens"] == sum(
            t for _, t, _ in streamed["micro_batches"])


def test_the_streaming_form_trains_on_two_ranks_each_its_own_micro_batches(client):
    out = on_two_ranks(client, "--streaming", "--steps", "2")
    print(out)
    lines = re.findall(r"rank (\d), step (\d): (\d+) micro-batches, global tokens (\d+); "
                       r"(loss %s, grad_norm %s, reward %s)" % (NUMBER, NUMBER, NUMBER),
                       out)
    assert sorted((r, s) for r, s, *_ in lines) == [("0", "1"), ("0", "2"), ("1", "1"),
                                                    ("1", "2")], out
    for step in ("1", "2"):
        ranks = [line for line in lines if line[1] == step]
        # The same count of micro-batches, the same global count and log on both ranks.
        assert len({line[2:] for line in ranks}) == 1, ranks
        assert int(ranks[0][2]) >= 1


def test_a_streamed_step_on_two_ranks_is_the_whole_batch_token_mean(client):
    """Each rank's gradients (DDP's one all-reduce of the summed micro-batch losses, scaled by
    the global count) against the token mean of the groups the step took, in float64."""
    out = on_two_ranks(client, "--streaming", "--check")
    worst = [float(w) for w in re.findall(r"token mean: worst relative difference (%s)" % NUMBER,
                                          out)]
    assert len(worst) == 2 and max(worst) <= 1e-12, out
