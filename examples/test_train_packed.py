"""examples/train_packed.py as a test: three optimizer steps on packd's micro-batches equal the
unpacked model's, losses and gradients, in float64 to 1e-9 relative; a per-micro-batch mean
does not."""
import train_packed


def test_packed_training_equals_unpacked_training(client):
    lines = []
    worst_loss, worst_grad, bug = train_packed.train(client, steps=3, num_ranks=4,
                                                     max_tokens=96, check=True,
                                                     log=lines.append)
    print("\n".join(lines))
    assert len(lines) == 3
    assert worst_loss <= 1e-9, lines
    assert worst_grad <= 1e-9, lines
    # The quiet bug: dividing each micro-batch by its own token count is another loss.
    assert bug > 1e-3, lines
