"""Shared prompts through the Python client (docs/design.md §14), against references written
from the rules with torch: one varlen attention over the stream equals every row's own causal
attention; targets and their Scatter; RemotePackOp's backward in stream mode equal to torch
autograd; PackMicroBatches keeping groups whole; varlen_kwargs(style="shared"); the errors,
each a ValueError naming the field, the server serving after each."""
import random

import pytest
import torch

import packd
from torch_reference import reference_shared


@pytest.fixture
def client(address):
    with packd.Client(address, shared_memory=packd.SharedMemoryOptions(threshold_bytes=0)) as c:
        yield c


def grpo_batch(seed, groups=((3, 5), (1, 4), (2, 0), (4, 7)), S=16, vocab=50):
    """GRPO rows: for each (members, prompt length), one random prompt and each member's
    random response after it, right-padded to S; the rows shuffled, and the group ids not in
    row order. Returns tokens [B, S], mask, group ids and prefix lengths (one per row)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for g, (members, P) in enumerate(groups):
        prompt = torch.randint(0, vocab, (P,), generator=gen)
        for _ in range(members):
            R = rng.randint(0, S - P)
            tokens = torch.zeros(S, dtype=torch.int64)
            tokens[:P] = prompt
            tokens[P:P + R] = torch.randint(0, vocab, (R,), generator=gen)
            rows.append((tokens, P + R, 100 - 7 * g, P))
    rng.shuffle(rows)
    tokens = torch.stack([r[0] for r in rows])
    mask = torch.arange(S)[None, :] < torch.tensor([r[1] for r in rows])[:, None]
    return tokens, mask, [r[2] for r in rows], [r[3] for r in rows]


def stream_rows(mask, groups, prefix):
    rows, targets = reference_shared(mask, groups, prefix)
    return torch.tensor(rows, dtype=torch.int64), targets


def attention(q, k, v):
    """Causal attention aligned bottom-right: query i sees keys j <= i + len(k) - len(q)."""
    Lq, Lk = q.shape[0], k.shape[0]
    scores = q @ k.T / q.shape[1] ** 0.5
    allowed = torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + (Lk - Lq)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("seed", range(4))
def test_one_varlen_attention_over_the_stream_is_each_rows_own(client, seed):
    tokens, mask, groups, prefix = grpo_batch(seed)
    B, S = mask.shape
    torch.manual_seed(seed)
    embed, wq, wk, wv = (torch.randn(50, 8, dtype=torch.float64),
                         *[torch.randn(8, 8, dtype=torch.float64) for _ in range(3)])
    # Unshared: every row's causal attention over its own active tokens.
    h = embed[tokens]
    dense = torch.zeros(B, S, 8, dtype=torch.float64)
    for b in range(B):
        n = int(mask[b].sum())
        x = h[b, :n]
        dense[b, :n] = attention(x @ wq, x @ wk, x @ wv)
    # Shared: one stream, its keys gathered by kv_index, as flash_attn_varlen_func takes them.
    shared = packd.SharedPrefix(groups, prefix, same_inputs=(0,))
    r = client.pack(tokens, mask, layout=packd.Layout(shared_prefix=shared), with_position_ids=True)
    kw = packd.varlen_kwargs(r, style="shared")
    x = embed[r.packed]
    q, k, v = x @ wq, (x @ wk)[kw["kv_index"]], (x @ wv)[kw["kv_index"]]
    cu_q, cu_k = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
    out = torch.cat([attention(q[cu_q[n]:cu_q[n + 1]], k[cu_k[n]:cu_k[n + 1]],
                               v[cu_k[n]:cu_k[n + 1]]) for n in range(len(cu_q) - 1)])
    assert kw["max_seqlen_q"] == max(b - a for a, b in zip(cu_q, cu_q[1:]))
    assert kw["max_seqlen_k"] == max(b - a for a, b in zip(cu_k, cu_k[1:]))
    # Every stream row's output is its token's in its own row (a prompt's, its first row's).
    rows, _ = stream_rows(mask, groups, prefix)
    assert torch.equal(r.packed, tokens.reshape(-1)[rows])
    assert torch.allclose(out, dense.reshape(B * S, 8)[rows], rtol=1e-12, atol=1e-12)
    # Position ids are each token's position in its own row (RoPE as unshared).
    assert torch.equal(r.position_ids, (torch.arange(S).repeat(B))[rows])
    # Stream rows back to the batch: prompts land on each group's first row.
    back = client.scatter(out, mask, layout=packd.Layout(shared_prefix=shared))
    expected = torch.zeros(B * S, 8, dtype=torch.float64)
    expected[rows] = out
    assert torch.equal(back.reshape(B * S, 8), expected)


@pytest.mark.parametrize("seed", range(4))
def test_flex_attention_mask_from_seq_idx_and_segments_is_the_segments_keys(client, seed):
    """docs/client.md's FlexAttention rule (same group, kv <= q, a prompt key or the query's
    own segment) allows exactly the keys of each segment, causal bottom-right."""
    groups = ((3, 5), (1, 4), (2, 0), (4, 7), (2, 16))
    tokens, mask, group_ids, prefix = grpo_batch(seed, groups=groups)
    shared = packd.SharedPrefix(group_ids, prefix)
    r = client.pack(tokens, mask, layout=packd.Layout(shared_prefix=shared, with_seq_idx=True),
                    with_position_ids=True)
    s = r.shared
    N = r.total_active
    segment = torch.repeat_interleave(torch.arange(s.segment_row.numel()),
                                      s.cu_seqlens_q.diff())
    prompt_length = torch.tensor(shared.prefix_lengths)[s.segment_row][segment]
    group, prompt = r.seq_idx, r.position_ids < prompt_length
    q, kv = torch.arange(N)[:, None], torch.arange(N)[None, :]
    rule = (group[q] == group[kv]) & (kv <= q) & (prompt[kv] | (segment[q] == segment[kv]))
    keys = torch.zeros(N, N, dtype=torch.bool)
    cu_q, cu_k = s.cu_seqlens_q.tolist(), s.cu_seqlens_k.tolist()
    for n in range(len(cu_q) - 1):
        Lq, Lk = cu_q[n + 1] - cu_q[n], cu_k[n + 1] - cu_k[n]
        k_rows = s.kv_index[cu_k[n]:cu_k[n + 1]]
        for i in range(Lq):
            keys[cu_q[n] + i, k_rows[:i + Lk - Lq + 1]] = True
    assert torch.equal(rule, keys)


def test_targets_are_predicted_by_pred_index_and_scatter_back(client):
    tokens, mask, groups, prefix = grpo_batch(7)
    B, S = mask.shape
    shared = packd.SharedPrefix(groups, prefix)
    r = client.pack([tokens], mask, layout=packd.Layout(shared_prefix=shared, shifts=[(0, -100)]))
    rows, targets = stream_rows(mask, groups, prefix)
    flat = [t for row in targets for t in row]
    s = r.shared
    assert s.target_cu_seqlens.tolist() == [0] + torch.tensor(
        [len(t) for t in targets]).cumsum(0).tolist()
    # Labels in target space: the token at each target's dense position.
    assert torch.equal(r.shifted[0], tokens.reshape(-1)[flat])
    # The row that predicts a target holds the token just before it in the target's row.
    stream_tokens = r.packed[0]
    assert torch.equal(stream_tokens[s.pred_index], tokens.reshape(-1)[[t - 1 for t in flat]])
    # The first token of every response is predicted by its prompt's last row (P > 0).
    for b, P in enumerate(prefix):
        if P and int(mask[b].sum()) > P:
            t = int(s.target_cu_seqlens[b])  # its first target is the token at P
            assert int(s.pred_index[t]) == rows.tolist().index(
                groups.index(groups[b]) * S + P - 1)
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        values = torch.randint(0, 2, (len(flat), 3)).to(dtype)
        dense = client.scatter(values, mask, layout=packd.Layout(shared_prefix=shared),
                               targets=True)
        expected = torch.zeros(B * S, 3, dtype=dtype)
        expected[flat] = values
        assert dense.dtype == dtype and torch.equal(dense.reshape(B * S, 3), expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_remote_pack_op_backward_is_scatter_in_stream_mode(client, dtype):
    tokens, mask, groups, prefix = grpo_batch(3)
    B, S = mask.shape
    layout = packd.Layout(shared_prefix=packd.SharedPrefix(groups, prefix))
    op = packd.RemotePackOp(client, layout=layout)
    x = torch.randn(B, S, 4, dtype=torch.float64).to(dtype).requires_grad_()
    packed, cu = op(x, mask)
    rows, _ = stream_rows(mask, groups, prefix)
    w = torch.randn(len(rows), 4, dtype=torch.float64).to(dtype)
    (packed * w).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    reference = x_ref.reshape(B * S, 4)[rows]
    (reference * w).sum().backward()
    assert torch.equal(packed.detach(), reference.detach())
    assert torch.equal(x.grad, x_ref.grad)  # prompt rows' gradient on each group's first row
    assert cu.tolist() == op.pack(x, mask).shared.cu_seqlens_q.tolist()


def test_pack_micro_batches_keeps_groups_whole(client):
    tokens, mask, groups, prefix = grpo_batch(11, groups=((4, 6), (2, 3), (3, 1), (1, 5),
                                                            (2, 8)), S=20)
    B, S = mask.shape
    loss_mask = torch.rand(B, S, generator=torch.Generator().manual_seed(1)) < 0.8
    shared = packd.SharedPrefix(groups, prefix, same_inputs=(0,))
    step = client.pack_micro_batches([tokens], mask, 40, plan=packd.PlanOptions(num_ranks=2),
                                     layout=packd.Layout(shared_prefix=shared, shifts=[(0, -100)]),
                                     loss_mask=loss_mask, with_position_ids=True)
    _, targets = stream_rows(mask, groups, prefix)
    flat_loss = loss_mask.reshape(-1)
    assert step.plan.global_loss_tokens == sum(int(flat_loss[t].sum()) for t in targets)
    seen = []
    for mb in step:
        rows = mb.samples
        seen += rows
        assert {groups[b] for b in rows}.isdisjoint(
            {groups[b] for b in range(B) if b not in rows}), "a group was split"
        sub = packd.SharedPrefix([groups[b] for b in rows], [prefix[b] for b in rows], (0,))
        alone = client.pack([tokens[rows]], mask[rows], with_position_ids=True,
                            layout=packd.Layout(shared_prefix=sub, shifts=[(0, -100)]))
        assert torch.equal(mb.result.packed[0], alone.packed[0])
        assert torch.equal(mb.result.shifted[0], alone.shifted[0])
        assert torch.equal(mb.result.position_ids, alone.position_ids)
        for name in ("kv_index", "cu_seqlens_k", "pred_index", "segment_row"):
            assert torch.equal(getattr(mb.result.shared, name), getattr(alone.shared, name))
    assert sorted(seen) == list(range(B))


def test_errors_name_the_field_and_change_nothing(client):
    tokens, mask, groups, prefix = grpo_batch(5)
    B = mask.shape[0]
    bad_prompt = tokens.clone()
    first = groups.index(groups[0])
    member = [b for b in range(B) if groups[b] == groups[first] and b != first][0]
    bad_prompt[member, 2] += 1
    cases = [
        (dict(shared_prefix=packd.SharedPrefix(groups[:-1], prefix)),
         "shared_prefix.groups has %d entries but the batch has %d rows" % (B - 1, B)),
        (dict(shared_prefix=packd.SharedPrefix(groups, prefix, (0,)), pad_multiple=4),
         "shared_prefix with pad_multiple 4 is not defined"),
        (dict(shared_prefix=packd.SharedPrefix(groups, prefix, (3,))),
         "shared_prefix.same_inputs[0] is 3, which names no input"),
        (dict(shared_prefix=packd.SharedPrefix(groups, prefix, targets=True)),
         "shared_prefix.targets is Scatter's"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            client.pack(tokens, mask, layout=packd.Layout(**kwargs))
    with pytest.raises(ValueError, match=r"inputs\[0\] differs across group %d: row %d's "
                       r"prompt token 2" % (groups[first], member)):
        client.pack(bad_prompt, mask,
                    layout=packd.Layout(shared_prefix=packd.SharedPrefix(groups, prefix, (0, ))))
    with pytest.raises(ValueError, match="the shared stream has"):
        client.scatter(torch.zeros(3, 2), mask,
                       layout=packd.Layout(shared_prefix=packd.SharedPrefix(groups, prefix)))
    with pytest.raises(ValueError, match="targets=True is for a scatter with shared_prefix"):
        client.scatter(torch.zeros(3, 2), mask, targets=True)
    with pytest.raises(ValueError, match="style=\"shared\" is for a pack with shared_prefix"):
        packd.varlen_kwargs(client.pack(tokens, mask), style="shared")
    # The server serves on, and the good call is unchanged by the bad ones before it.
    r = client.pack(tokens, mask,
                    layout=packd.Layout(shared_prefix=packd.SharedPrefix(groups, prefix, (0, ))))
    rows, _ = stream_rows(mask, groups, prefix)
    assert torch.equal(r.packed, tokens.reshape(-1)[rows])
