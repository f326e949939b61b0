"""The leak probe (packd/integrations/probe.py): a family no table of packd's knows, whose layer
mixes tokens outside attention, is refused at first use (packd.hf.packed_row, PackedGRPOTrainer), naming the
layer; a family packd serves passes it, once per configuration; and it catches an attention left
outside packd_varlen. The made-up layer is a cumulative sum over tokens added to Llama's MLP,
under a class name no table has."""
import pytest
import torch

import packd
from packd.integrations import probe as _probe
from packd.hf import LeakFound, packed_row, probe_model, register_varlen_attention
from survey import transformers

pytestmark = [
    pytest.mark.skipif(transformers is None, reason="transformers is not installed (Debian 12 "
                       "has no package of it); the PyPI stack's run tests"),
    # TRL 1.16's configuration still sets a field transformers 5.24 renamed.
    pytest.mark.filterwarnings(
        r"ignore:`\w*gradient_checkpointing\w*` is deprecated:FutureWarning"),
]


class TokenMixer(torch.nn.Module):
    """A Llama MLP plus a running sum over the row's tokens: state carried across tokens, in a
    layer no packd table names."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, hidden_states):
        return self.mlp(hidden_states) + 0.1 * hidden_states.cumsum(dim=1)


def tiny_llama(dtype=torch.float32, attention="packd_varlen"):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    register_varlen_attention()
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, attn_implementation=attention)
    return LlamaForCausalLM(config).to(dtype)


@pytest.fixture(autouse=True)
def fresh():
    _probe.forget()
    yield
    _probe.forget()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_a_made_up_stateful_layer_is_refused_naming_it(client, dtype):
    model = tiny_llama(dtype)
    model.model.layers[1].mlp = TokenMixer(model.model.layers[1].mlp)
    row = torch.randint(4, 64, (1, 12))
    r = client.pack([row], torch.ones_like(row, dtype=torch.bool),
                    segment_ids=torch.tensor([[0] * 5 + [1] * 7]), with_position_ids=True)
    with pytest.raises(LeakFound, match=r"first in model\.layers\.1\.mlp \(TokenMixer\)"):
        with packed_row(r, model):
            pass


def test_a_family_packd_serves_passes_once_per_configuration(client):
    model = tiny_llama()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    probe_model(model)
    probe_model(model, shared=True)
    first = len(calls)
    # Each row packed and its documents alone: (5, 1), (4, 1, 6), then with the shared prefix
    # the same again and the prefix's row with its continuations' three.
    assert first == (1 + 2) + (1 + 3) + (1 + 2) + (1 + 3) + (1 + 3)
    probe_model(model)
    probe_model(tiny_llama())  # the same class and configuration: not again
    assert len(calls) == first


def test_an_attention_left_outside_packd_varlen_is_refused_on_a_shared_stream():
    """sdpa keeps documents apart on a packed row (transformers finds them from the position
    ids), but not a shared prefix's continuations (packd's kv_index): the leak TRL's
    reference model had."""
    probe_model(tiny_llama(attention="sdpa"))
    with pytest.raises(LeakFound, match=r"first in model\.layers\.0\.self_attn"):
        probe_model(tiny_llama(attention="sdpa"), shared=True)


def test_the_trainer_probes_each_model_it_serves(address, tmp_path):
    """PackedGRPOTrainer runs the probe (with a shared prefix) on the policy: the made-up layer
    is refused before training; leak_probe=False skips it (and the first-use check would then
    be what catches it)."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from packd.trl import PackedGRPOTrainer
    model = tiny_llama()
    model.model.layers[0].mlp = TokenMixer(model.model.layers[0].mlp)
    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, "<unk>")),
                                  pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=4, use_cpu=True,
                          report_to=[], beta=0.0)
    kwargs = dict(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                  args=args, train_dataset=Dataset.from_dict({"prompt": ["<unk>"] * 4}),
                  processing_class=tok, packd_address=address)
    with pytest.raises(LeakFound, match=r"model\.layers\.0\.mlp \(TokenMixer\)"):
        PackedGRPOTrainer(**kwargs)
    PackedGRPOTrainer(leak_probe=False, **kwargs)  # refused only by the probe


class ConvolvedMLP(torch.nn.Module):
    """A Llama MLP after a causal depthwise convolution over the tokens (kernel 4)."""

    def __init__(self, mlp, width):
        super().__init__()
        self.mlp = mlp
        self.conv = torch.nn.Conv1d(width, width, 4, groups=width, padding=3)

    def forward(self, hidden_states):
        mixed = self.conv(hidden_states.transpose(1, 2))[..., :hidden_states.shape[1]]
        return self.mlp(mixed.transpose(1, 2))


class Recurrent(torch.nn.Module):
    """A layer that takes a recurrent cache, as Mamba's mixers do, under another name."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, hidden_states, cache_params=None):
        return self.mlp(hidden_states)


def test_a_layer_that_carries_state_by_its_structure_is_refused_before_it_runs():
    from packd.hf import check_model
    model = tiny_llama()
    model.model.layers[0].mlp = ConvolvedMLP(model.model.layers[0].mlp, 32)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.conv \(Conv1d\) carries state "
                       r"across tokens \(a causal convolution\)"):
        check_model(model)
    model = tiny_llama()
    model.model.layers[1].mlp = Recurrent(model.model.layers[1].mlp)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp \(Recurrent\) carries state "
                       r"across tokens \(its forward takes cache_params\)"):
        check_model(model)
