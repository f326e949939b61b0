"""examples/train_packed.py as a test: three optimizer steps on packd's micro-batches equal the
unpacked model's, losses and gradients, in float64 to 1e-9 relative; a per-micro-batch mean
does not."""
import train_packed


def test_packed_training_equals_unpacked_training(trains_as_reference):
    trains_as_reference(train_packed.train, num_ranks=4, max_tokens=96)


def test_streaming_training_equals_unpacked_training(trains_as_reference):
    trains_as_reference(train_packed.train, num_ranks=4, max_tokens=96, streaming=True)
