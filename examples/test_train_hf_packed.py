"""examples/train_hf_packed.py as a test: a transformers Qwen 3 trained three AdamW steps on
packd's micro-batches through packd_varlen equals the same model trained on the documents
padded (transformers' SDPA), losses and gradients, in float64 to 1e-9 relative; a
per-micro-batch mean does not. Needs transformers (PyPI's stack; Debian 12 has no package of
it, and the test skips there, saying so)."""
import train_hf_packed
from hf_families import needs_transformers

pytestmark = needs_transformers("the PyPI stack's run trains the model")


def test_a_transformers_model_trains_on_packd_as_on_the_padded_batch(trains_as_reference):
    trains_as_reference(train_hf_packed.train, num_ranks=4, max_tokens=96)
