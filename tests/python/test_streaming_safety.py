"""The streaming step run as operators and rollout workers run it (docs/design.md §18, "Safety"):
two tenants on one packd (a step is its tenant's, and other tenants learn nothing of it), a
retry after a lost reply (a group is taken once), slow ranks (packd's memory stays within its
budget), a budget full of rows the planner holds back (the step still completes before its
close), and an empty group (refused)."""
import re
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

import packd
from packd_server import PackdServer
from step_receiver import Receiver


def group(rows, seq, lengths, seed=0):
    """Token ids [rows, seq] (int64) and a mask of `lengths` active tokens per row."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1 << 20, (rows, seq), generator=g)
    mask = torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]
    return tokens, mask


def tokens_file(tmp_path, name, token):
    path = tmp_path / name
    path.write_text(token + "\n")
    return packd.TokenOptions(file=str(path))


def test_another_tenant_cannot_submit_receive_open_or_learn_of_a_step(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("job-a:token-a\njob-b:token-b\nworkers:token-w\n")
    tokens_a, mask = group(2, 16, [10, 12], seed=1)
    with PackdServer("--auth_token_file=%s" % tokens) as address, \
            packd.Client(address, token=tokens_file(tmp_path, "a", "token-a")) as a, \
            packd.Client(address, token=tokens_file(tmp_path, "b", "token-b")) as b, \
            packd.Client(address, token=tokens_file(tmp_path, "w", "token-w")) as workers:
        with a.open_step(1 << 20, submitters=["workers"]) as step:
            assert re.fullmatch("step-[0-9a-f]{32}", step.step_id), step.step_id
            rank = Receiver(a, step.step_id, 0)
            a.submit_group(step.step_id, tokens_a, mask)
            workers.submit_group(step.step_id, tokens_a, mask)  # named at open
            answers = []
            with pytest.raises(packd.PackdError) as submit:
                b.submit_group(step.step_id, tokens_a, mask)
            answers.append(submit.value)
            for r in (0, 7):  # a rank of the step, and one outside it
                for client in (b, workers):
                    stream = client.receive_step(step.step_id, r)
                    with pytest.raises(packd.PackdError) as receive:
                        list(stream)
                    answers.append(receive.value)
            for e in answers:
                assert e.code == grpc.StatusCode.NOT_FOUND, e
            # Another tenant's own step of that id is its own: no ALREADY_EXISTS, nothing of a's.
            with b.open_step(1 << 20, step_id=step.step_id) as theirs:
                assert theirs.step_id == step.step_id
                theirs.cancel()
            summary = step.close()
        rank.join(30)
        assert rank.error is None
        assert summary.groups == 2 and summary.rows == 4, "b's group was never taken"
        assert sorted(s for mb in rank.micro_batches for s in mb.samples) == [0, 1, 2, 3]
        # The answer for a live step of another tenant is the answer for no step at all. b's own
        # step of that id ends as its controller's stream ends, which the replica learns a moment
        # later: until it forgets it, b hears of its own step's end (never of a's).
        deadline = time.monotonic() + 10
        while True:
            with pytest.raises(packd.PackdError) as gone:
                b.submit_group(step.step_id, tokens_a, mask)
            if gone.value.code != grpc.StatusCode.FAILED_PRECONDITION or \
                    time.monotonic() > deadline:
                break
            assert "controller stream ended" in gone.value.details, gone.value
            time.sleep(0.05)
        assert gone.value.code == grpc.StatusCode.NOT_FOUND, gone.value
        for e in answers:
            assert e.details == gone.value.details


class DropFirstReply(grpc.GenericRpcHandler):
    """A proxy for SubmitGroup that forwards every call to packd, and loses packd's reply to the
    first: it holds it until the client has given up on it."""

    def __init__(self, target, hold_seconds):
        self._channel = grpc.insecure_channel(target)
        self._hold = hold_seconds
        self._lock = threading.Lock()
        self.calls = 0

    def service(self, details):
        if not details.method.endswith("/SubmitGroup"):
            return None
        forward = self._channel.unary_unary(details.method)

        def handle(request, context):
            with self._lock:
                self.calls += 1
                first = self.calls == 1
            reply = forward(request, timeout=30)
            if first:
                time.sleep(self._hold)  # the client's attempt deadline passes meanwhile
            return reply

        return grpc.unary_unary_rpc_method_handler(handle)


def test_a_retry_after_a_lost_reply_is_taken_once(address):
    tokens, mask = group(4, 32, [20, 25, 30, 7], seed=2)
    proxy = DropFirstReply(address, hold_seconds=3.0)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((proxy,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with packd.Client(address) as client, \
                packd.Client("127.0.0.1:%d" % port, timeout=20) as worker:
            with client.open_step(1 << 20) as step:
                rank = Receiver(client, step.step_id, 0)
                got = worker.submit_group(step.step_id, tokens, mask, attempt_timeout=1.0)
                assert proxy.calls == 2, "the first reply was lost, and the call retried"
                assert (got.group, got.first_row) == (0, 0)
                # The same key again, as a worker restarted after a crash resubmits: its reply,
                # nothing taken; the key with other content is refused.
                again = client.submit_group(step.step_id, tokens, mask, group_key="g1")
                assert client.submit_group(step.step_id, tokens, mask, group_key="g1") == again
                with pytest.raises(packd.PackdError) as other:
                    client.submit_group(step.step_id, tokens[:2], mask[:2], group_key="g1")
                assert other.value.code == grpc.StatusCode.ALREADY_EXISTS
                summary = step.close()
            rank.join(30)
            assert rank.error is None
            assert summary.groups == 2 and summary.rows == 8
            assert summary.global_loss_tokens == 2 * int(mask.sum())
            assert rank.stream.global_loss_tokens == summary.global_loss_tokens
    finally:
        server.stop(0)


def test_an_empty_group_is_refused_and_the_step_goes_on(address):
    tokens, mask = group(2, 16, [5, 9])
    with packd.Client(address) as client:
        with client.open_step(1 << 20) as step:
            rank = Receiver(client, step.step_id, 0)
            with pytest.raises(packd.PackdError) as empty:
                client.submit_group(step.step_id, tokens[:0], mask[:0])
            assert empty.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "no rows" in empty.value.details
            client.submit_group(step.step_id, tokens, mask)
            summary = step.close()
        rank.join(30)
        assert rank.error is None and summary.groups == 1 and summary.rows == 2


def resident_bytes(pid, field="VmRSS"):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no %s for pid %d" % (field, pid))


BUDGET = 16 << 20
# What packd's memory may pass its budget by while ranks read slowly: one micro-batch being
# written per rank, gRPC's buffers of the calls in flight and of every stream's flow-control
# window, and the allocator's slack.
MARGIN = 32 << 20


def test_slow_ranks_hold_packd_within_its_budget():
    """Two ranks reading one micro-batch every half second while a rollout worker sends 250 MB
    of groups as fast as it can: packd refuses what does not fit (the worker retries later), and
    its resident memory stays within the budget and a stated margin."""
    seq = 8192
    tokens, mask = group(4, seq, [seq] * 4, seed=3)
    group_bytes = tokens.numel() * 9
    server = PackdServer("--max_inflight_bytes=%d" % BUDGET, "--keep_freed_memory=false")
    with server as address, packd.Client(address) as client:
        with client.open_step(32768, plan=packd.PlanOptions(num_ranks=2)) as step:
            ranks = [Receiver(client, step.step_id, r, seconds_each=0.5) for r in range(2)]
            time.sleep(0.2)
            before = resident_bytes(server.pid)
            taken = refused = 0
            for _ in range(250_000_000 // group_bytes):
                try:
                    client.submit_group(step.step_id, tokens, mask)
                    taken += 1
                except packd.PackdError as e:
                    assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    refused += 1
                grown = resident_bytes(server.pid) - before
                assert grown <= BUDGET + MARGIN, (
                    "packd grew by %d MB with %d groups taken" % (grown >> 20, taken))
            peak = resident_bytes(server.pid, "VmHWM") - before
            step.cancel()
        for r in ranks:
            r.join(30)
    assert refused > 0, "the budget refused what did not fit"
    assert taken * group_bytes < 100 << 20, "the ranks read slowly: few groups fit"
    assert peak <= BUDGET + MARGIN, "peak growth %d MB" % (peak >> 20)


def test_rows_the_planner_holds_back_never_stall_the_step():
    """A 16 MiB budget, micro-batches of 32768 tokens over two ranks reading at full speed, and
    groups of 4 rows of 14-16k tokens: one long row (15.5-16k) and three short ones (14-14.7k).
    A wave needs two micro-batches of 90% of the budget: a long row and a short one fill one,
    two short ones never do, so two short rows of every group stay in the planner's pool, and
    with the close's reserve they come to fill the budget. packd holds only their own bytes and
    sends them under-filled when the budget is full, instead of refusing every submit until the
    close: every group is taken, retried only while the ranks read."""
    seq = 16384
    num_groups = 60
    with PackdServer("--max_inflight_bytes=%d" % BUDGET) as address, \
            packd.Client(address) as client:
        with client.open_step(32768, plan=packd.PlanOptions(num_ranks=2)) as step:
            ranks = [Receiver(client, step.step_id, r) for r in range(2)]
            lengths = torch.Generator().manual_seed(4)
            expected = {}
            deadline = time.monotonic() + 120
            for g in range(num_groups):
                rows = (torch.randint(15500, 16001, (1,), generator=lengths).tolist()
                        + torch.randint(14000, 14701, (3,), generator=lengths).tolist())
                tokens, mask = group(4, seq, rows, seed=100 + g)
                while True:
                    try:
                        got = client.submit_group(step.step_id, tokens, mask)
                        break
                    except packd.PackdError as e:
                        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                        assert time.monotonic() < deadline, (
                            "group %d never fit: the step stalled" % g)
                        time.sleep(0.02)
                for k in range(4):
                    expected[got.first_row + k] = tokens[k][mask[k]]
            summary = step.close()
        for r in ranks:
            r.join(60)
            assert r.error is None
    assert summary.groups == num_groups and summary.rows == 4 * num_groups
    seen = {}
    for r in ranks:
        assert len(r.micro_batches) == summary.micro_batches_per_rank
        for mb in r.micro_batches:
            cu = mb.result.cu_seqlens.tolist()
            for j, row in enumerate(mb.samples):
                assert row not in seen, "row %d twice" % row
                seen[row] = mb.result.packed[0][cu[j]:cu[j + 1]]
    assert sorted(seen) == sorted(expected), "every row exactly once"
    for row, want in expected.items():
        assert torch.equal(seen[row], want), row
