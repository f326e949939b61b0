"""The streaming step (docs/operation.md, "The streaming step") through the Python client: its
gradients equal the whole-batch step's in float64 whatever order the groups arrive in, with each
rank a separate process receiving its own stream; every rank gets the same number of
micro-batches, each exactly pack() of its rows; and every fault ends with its status and leaves
nothing held."""
import os
import random
import subprocess
import sys
import tempfile
import time

import grpc
import pytest
import torch
import torch.nn.functional as F

import packd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from train_packed import DIM, TinyLM, corpus  # noqa: E402
from step_receiver import Receiver  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUT = packd.Layout(shifts=((0, -100),))
GROUP = 4  # rows per group (a GRPO group's rollouts)


def groups_of(batch):
    tokens, mask, segments, loss_mask = batch
    return [list(range(g, g + GROUP)) for g in range(0, tokens.shape[0], GROUP)]


def submit(client, step_id, batch, rows, **kwargs):
    tokens, mask, segments, loss_mask = batch
    return client.submit_group(step_id, [tokens[rows], loss_mask[rows].to(torch.int64)],
                               mask[rows], segment_ids=segments[rows], loss_mask=loss_mask[rows],
                               **kwargs)


def whole_batch_gradients(client, batch, num_ranks, max_tokens):
    """The reference: one PackMicroBatches call over the whole batch, each micro-batch's summed
    token loss backpropagated, the sum divided by the plan's global_loss_tokens."""
    tokens, mask, segments, loss_mask = batch
    model = TinyLM(seed=0).double()
    step = client.pack_micro_batches([tokens, loss_mask.to(torch.int64)], mask, max_tokens,
                                     plan=packd.PlanOptions(num_ranks=num_ranks, cost=(DIM, 1)),
                                     layout=packd.Layout(shifts=[(0, -100)]), loss_mask=loss_mask,
                                     segment_ids=segments, with_position_ids=True)
    for mb in step:
        r = mb.result
        if r.total_active == 0:
            continue
        logits = model.packed(model.embed(r.packed[0]), r.position_ids, r.doc_cu_seqlens)
        token_loss = F.cross_entropy(logits, r.shifted[0].clamp(min=0),
                                     reduction="none") * r.packed[1].to(logits.dtype)
        token_loss.sum().backward()
    global_loss_tokens = step.plan.global_loss_tokens
    return {n: p.grad / global_loss_tokens for n, p in model.named_parameters()}, \
        global_loss_tokens


@pytest.mark.parametrize("order_seed", [1, 2, 3])
def test_gradients_equal_the_whole_batch_step_in_any_arrival_order(address, order_seed):
    num_ranks, max_tokens = 2, 96
    batch = corpus(seed=7, rows=24, seq=64)
    with packd.Client(address) as client:
        expected, expected_global = whole_batch_gradients(client, batch, num_ranks, max_tokens)
        groups = groups_of(batch)
        random.Random(order_seed).shuffle(groups)
        with tempfile.TemporaryDirectory() as tmp, client.open_step(
                max_tokens, plan=packd.PlanOptions(num_ranks=num_ranks, cost=(DIM, 1)),
                layout=LAYOUT, with_position_ids=True) as step:
            outs = [os.path.join(tmp, "rank%d.pt" % r) for r in range(num_ranks)]
            ranks = [subprocess.Popen([sys.executable, os.path.join(HERE, "stream_rank.py"),
                                       step.address, step.step_id, str(r), outs[r]])
                     for r in range(num_ranks)]
            try:
                step_rows = {}
                for rows in groups:
                    got = submit(packd.Client(step.address), step.step_id, batch, rows)
                    for k, row in enumerate(rows):
                        step_rows[got.first_row + k] = row
                summary = step.close()
            finally:
                for p in ranks:
                    assert p.wait(timeout=120) == 0
            results = [torch.load(o) for o in outs]
    assert summary.global_loss_tokens == expected_global
    assert summary.rows == 24 and summary.groups == len(groups)
    counts = {len(r["micro_batches"]) for r in results}
    assert counts == {summary.micro_batches_per_rank}, "every rank the same number"
    seen = sorted(step_rows[s] for r in results for mb in r["micro_batches"] for s in mb)
    assert seen == list(range(24)), "every row in exactly one micro-batch"
    for r in results:
        assert r["global_loss_tokens"] == expected_global
    for name, want in expected.items():
        # The ranks' all-reduce mean, scaled by world_size / global_loss_tokens.
        got = sum(r["grads"][name] for r in results) / num_ranks
        got = got * (num_ranks / summary.global_loss_tokens)
        scale = want.abs().max().clamp(min=1e-300)
        assert float((got - want).abs().max() / scale) <= 1e-12, name


def test_scale_gradients_is_world_size_over_global_loss_tokens():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    p.grad = torch.full((3,), 6.0, dtype=torch.float64)
    packd.scale_gradients([p], world_size=4, global_loss_tokens=12)
    assert p.grad.tolist() == [2.0, 2.0, 2.0]


def test_each_micro_batch_is_exactly_pack_of_its_rows_and_idle_ranks_get_empty_ones(address):
    batch = corpus(seed=3, rows=8, seq=64)
    tokens, mask, segments, loss_mask = batch
    with packd.Client(address) as client:
        with client.open_step(1 << 20, plan=packd.PlanOptions(num_ranks=3), layout=LAYOUT, with_position_ids=True) \
                as step:
            receivers = [Receiver(client, step.step_id, r) for r in range(3)]
            submit(client, step.step_id, batch, [0, 1])
            summary = step.close()
        for r in receivers:
            r.join(30)
            assert r.error is None
            assert len(r.micro_batches) == summary.micro_batches_per_rank == 1
        busy = [r for r in receivers if r.micro_batches[0].samples]
        assert len(busy) == 2, "two ranks have a row each, the third an empty micro-batch"
        for r in receivers:
            mb = r.micro_batches[0]
            if not mb.samples:
                assert mb.result.total_active == 0
                assert mb.result.cu_seqlens.tolist() == [0]
                assert r.stream.global_loss_tokens == summary.global_loss_tokens
                continue
            rows = torch.tensor(mb.samples)
            want = client.pack([tokens[rows], loss_mask[rows].to(torch.int64)], mask[rows],
                               segment_ids=segments[rows], with_position_ids=True,
                               layout=packd.Layout(shifts=[(0, -100)]))
            for a, b in zip(mb.result.packed, want.packed):
                assert torch.equal(a, b)
            assert torch.equal(mb.result.shifted[0], want.shifted[0])
            assert torch.equal(mb.result.position_ids, want.position_ids)
            assert torch.equal(mb.result.doc_cu_seqlens, want.doc_cu_seqlens)
            assert torch.equal(mb.result.cu_seqlens, want.cu_seqlens)


def test_a_bad_group_is_refused_to_its_submitter_and_the_step_goes_on(address):
    batch = corpus(seed=4, rows=8, seq=32)
    tokens, mask, segments, loss_mask = batch
    with packd.Client(address) as client:
        with client.open_step(1 << 20, layout=LAYOUT) as step:
            receiver = Receiver(client, step.step_id, 0)
            with pytest.raises(packd.PackdError) as bad:
                client.submit_group(step.step_id, [tokens[:4, :16]], mask[:4])
            assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(packd.PackdError) as no_step:
                submit(client, "no-such-step", batch, [0])
            assert no_step.value.code == grpc.StatusCode.NOT_FOUND
            submit(client, step.step_id, batch, [0, 1, 2, 3])
            with pytest.raises(packd.PackdError) as other:  # another schema
                client.submit_group(step.step_id, [tokens[4:8]], mask[4:8])
            assert other.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "first group" in other.value.details
            summary = step.close()
        receiver.join(30)
        assert receiver.error is None
        assert summary.rows == 4
        assert sorted(s for mb in receiver.micro_batches for s in mb.samples) == [0, 1, 2, 3]


def test_a_stale_group_is_refused_by_name(address):
    batch = corpus(seed=5, rows=4, seq=32)
    with packd.Client(address) as client:
        with client.open_step(1 << 20, policy_version=5, max_staleness=1) as step:
            with pytest.raises(packd.PackdError) as stale:
                submit(client, step.step_id, batch, [0, 1], policy_version=3)
            assert stale.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "policy version 3" in stale.value.details
            submit(client, step.step_id, batch, [2, 3], policy_version=4)
            step.cancel()


def test_a_rank_that_leaves_ends_the_step_for_every_rank_naming_it(address):
    batch = corpus(seed=6, rows=16, seq=64)
    with packd.Client(address) as client:
        step = client.open_step(64, plan=packd.PlanOptions(num_ranks=2), layout=LAYOUT)
        staying = Receiver(client, step.step_id, 0)
        leaving = client.receive_step(step.step_id, 1)
        for rows in groups_of(batch):
            submit(client, step.step_id, batch, rows)
        next(iter(leaving))  # attached, and received a micro-batch
        leaving.cancel()
        staying.join(30)
        assert staying.error is not None
        assert staying.error.code == grpc.StatusCode.UNAVAILABLE
        assert "rank 1" in staying.error.details
        with pytest.raises(packd.PackdError) as closed:
            step.close()
        assert closed.value.code == grpc.StatusCode.UNAVAILABLE


def test_the_controller_leaving_ends_the_step_and_frees_it(address):
    batch = corpus(seed=8, rows=4, seq=32)
    with packd.Client(address) as client:
        step = client.open_step(1 << 20, layout=LAYOUT)
        receiver = Receiver(client, step.step_id, 0)
        submit(client, step.step_id, batch, [0, 1])
        step.cancel()
        receiver.join(30)
        assert receiver.error is not None
        assert receiver.error.code == grpc.StatusCode.CANCELLED
        deadline = time.monotonic() + 10
        while True:  # the replica forgets the step once the controller's stream is done
            try:
                submit(client, step.step_id, batch, [2, 3])
            except packd.PackdError as e:
                if e.code == grpc.StatusCode.NOT_FOUND:
                    break
                assert e.code == grpc.StatusCode.FAILED_PRECONDITION
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_step_past_its_timeout_ends_deadline_exceeded(address):
    with packd.Client(address) as client:
        step = client.open_step(1 << 20, timeout_seconds=1)
        receiver = Receiver(client, step.step_id, 0)
        receiver.join(30)
        assert receiver.error is not None
        assert receiver.error.code == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(packd.PackdError) as late:
            step.close()
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_second_controller_of_a_live_step_id_is_refused(address):
    with packd.Client(address) as client:
        with client.open_step(1 << 20, step_id="shared-id") as first:
            with pytest.raises(packd.PackdError) as second:
                client.open_step(1 << 20, step_id="shared-id")
            assert second.value.code == grpc.StatusCode.ALREADY_EXISTS
            assert first.step_id == "shared-id"
            first.cancel()


def test_a_receiver_outside_the_step_or_twice_is_refused(address):
    with packd.Client(address) as client:
        with client.open_step(1 << 20, plan=packd.PlanOptions(num_ranks=2)) as step:
            outside = Receiver(client, step.step_id, 2)
            outside.join(30)
            assert outside.error.code == grpc.StatusCode.INVALID_ARGUMENT
            first = Receiver(client, step.step_id, 0)
            time.sleep(0.2)
            twice = Receiver(client, step.step_id, 0)
            twice.join(30)
            assert twice.error.code == grpc.StatusCode.ALREADY_EXISTS
            step.cancel()
            first.join(30)


def test_groups_held_count_against_the_memory_budget_until_their_rows_are_sent():
    from packd_server import PackdServer
    batch = corpus(seed=9, rows=12, seq=64)
    # A 4-row group holds about 5.4 KB (mask, token ids, loss mask, segment ids): two fit.
    with PackdServer("--max_inflight_bytes=12000") as address, \
            packd.Client(address) as client:
        for attempt in range(2):  # the second step finds the budget whole again
            with client.open_step(1 << 20, layout=LAYOUT) as step:
                receiver = Receiver(client, step.step_id, 0)
                submit(client, step.step_id, batch, [0, 1, 2, 3])
                submit(client, step.step_id, batch, [4, 5, 6, 7])
                with pytest.raises(packd.PackdError) as full:
                    submit(client, step.step_id, batch, [8, 9, 10, 11])
                assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "--max_inflight_bytes" in full.value.details
                summary = step.close()  # the step went on
            receiver.join(30)
            assert receiver.error is None, attempt
            assert summary.rows == 8


def test_a_group_in_shared_memory_is_copied_in_and_packed_as_inline(address):
    from multiprocessing import shared_memory
    from packd._tensors import TO_WIRE
    from packd.v1 import pack_service_pb2 as pb, pack_service_pb2_grpc as pb_grpc

    def inline(t):
        return pb.Tensor(dtype=TO_WIRE[t.dtype], shape=list(t.shape),
                         data=t.contiguous().numpy().tobytes())
    batch = corpus(seed=10, rows=4, seq=32)
    tokens, mask, segments, loss_mask = batch
    with packd.Client(address) as client:
        stub = pb_grpc.PackServiceStub(grpc.insecure_channel(address))
        key = stub.GetServerInfo(pb.GetServerInfoRequest()).shm_key_prefix + "stream-%d" % os.getpid()
        raw = tokens.numpy().tobytes()
        seg = shared_memory.SharedMemory(name=key.lstrip("/"), create=True, size=len(raw))
        try:
            seg.buf[:len(raw)] = raw
            stub.RegisterSystemRegion(pb.RegisterSystemRegionRequest(
                name="stream-tokens", key=key, offset=0, byte_size=len(raw)))
            with client.open_step(1 << 20, layout=LAYOUT) as step:
                receiver = Receiver(client, step.step_id, 0)
                request = pb.SubmitGroupRequest(
                    step_id=step.step_id, mask=inline(mask), segment_ids=inline(segments),
                    loss_mask=inline(loss_mask),
                    inputs=[pb.Tensor(dtype=TO_WIRE[tokens.dtype], shape=list(tokens.shape),
                                      region=pb.RegionSlice(region="stream-tokens", offset=0,
                                                            byte_size=len(raw))),
                            inline(loss_mask.to(torch.int64))])
                stub.SubmitGroup(request)
                seg.buf[:len(raw)] = bytes(len(raw))  # the step holds its own copy
                step.close()
            receiver.join(30)
            assert receiver.error is None
            stub.UnregisterRegion(pb.UnregisterRegionRequest(name="stream-tokens"))
        finally:
            seg.close()
            seg.unlink()
        (mb,) = receiver.micro_batches
        rows = torch.tensor(mb.samples)
        want = client.pack([tokens[rows], loss_mask[rows].to(torch.int64)], mask[rows],
                           segment_ids=segments[rows], layout=packd.Layout(shifts=[(0, -100)]))
        assert torch.equal(mb.result.packed[0], want.packed[0])
        assert torch.equal(mb.result.shifted[0], want.shifted[0])


def test_a_malformed_group_raises_the_exported_value_error(address):
    batch = corpus(seed=11, rows=4, seq=32)
    tokens, mask, segments, loss_mask = batch
    with packd.Client(address) as client:
        with client.open_step(1 << 20) as step:
            with pytest.raises(packd.PackdValueError):
                client.submit_group(step.step_id, [tokens[:, :8]], mask)
            step.cancel()
