"""examples/train_grpo_shared.py as a test: GRPO groups packed with their prompt once train a
model exactly as the unshared rows do, in float64 to 1e-9 relative (losses and every
parameter's gradient, the embeddings' through RemotePackOp's Scatter of the stream), over
data-parallel ranks, with fewer tokens."""
import pytest

import train_grpo_shared


@pytest.mark.parametrize("ranks, max_tokens", [(1, 4096), (2, 160), (3, 96)])
def test_grpo_on_shared_prompts_equals_unshared_training(client, ranks, max_tokens):
    lines = []
    loss, grad, stats = train_grpo_shared.train(client, steps=3, num_ranks=ranks,
                                                max_tokens=max_tokens, check=True,
                                                log=lines.append)
    print("\n".join(lines))
    assert len(lines) == 3
    assert loss <= 1e-9 and grad <= 1e-9, lines
    assert 0 < stats["stream_rows"] < stats["active"], stats
