"""GPT-2 presets, the vocabulary rule and ``model_config``, against independent references.

- shapes: the published GPT-2 table (layers / width / heads / context), typed
  here from the paper, and Ψ from a closed form counted by hand below (not the
  layout table) against the published parameter counts of the HF checkpoints;
- vocab_for: brute force over every id (the smallest multiple of 64 above it);
- the model state per rank at Nd = 2 for gpt2 with a byte vocabulary: one
  shard of the real Layout per rank, counted in bytes class by class.
"""
import pytest

from ringzero.nn.gpt import PRESETS, GPTConfig, gpt_units, model_config, vocab_for
from ringzero.runtime import accounting as acc
from ringzero.runtime.flat import Layout

# (n_layer, n_embd, n_head), context 1024, vocab 50257: Radford et al. 2019, Table 2 + the released configs
PUBLISHED = {"gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16),
             "gpt2-large": (36, 1280, 20), "gpt2-xl": (48, 1600, 25)}
# parameters of the released checkpoints (tied head): HF `model.num_parameters()`
PUBLISHED_PSI = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168,
                 "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200}


def closed_form(L, C, V, T):
    """Ψ of a GPT-2 block stack, counted by hand: per block 2 layernorms (4C),
    qkv (3C² + 3C), proj (C² + C), fc (4C² + 4C), fc2 (4C² + C); plus wte, wpe, lnf."""
    return L * (4 * C + 3 * C * C + 3 * C + C * C + C + 4 * C * C + 4 * C + 4 * C * C + C) \
        + V * C + T * C + 2 * C


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_are_the_published_shapes(name):
    c = PRESETS[name]
    assert (c.n_layer, c.n_embd, c.n_head) == PUBLISHED[name]
    assert (c.block_size, c.vocab) == (1024, 50257)
    psi = Layout(gpt_units(c)).numel
    assert psi == closed_form(c.n_layer, c.n_embd, c.vocab, c.block_size) == PUBLISHED_PSI[name]


def test_vocab_for_brute_force():
    for top in list(range(0, 300)) + [50255, 50256, 50303, 50304, 65535]:
        want = next(v for v in range(64, 1 << 20, 64) if v > top)   # smallest multiple of 64 holding top
        assert vocab_for(top) == want
    assert vocab_for(50256) == 50304                                 # GPT-2's tokens, as nanoGPT pads them
    for top in (0, 65, 127, 255):
        assert vocab_for(top, byte_level=True) == 256                # bytes: all 256, whatever occurs
    assert vocab_for(10, multiple=1) == 11


@pytest.mark.parametrize("bad", [dict(max_id=-1), dict(max_id=2.5), dict(max_id=True),
                                 dict(max_id=256, byte_level=True), dict(max_id=3, multiple=0)])
def test_vocab_for_bad_input(bad):
    with pytest.raises(ValueError, match="expected|got"):
        vocab_for(**bad)


def test_model_config():
    c = model_config("gpt2", 256)
    assert c == GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab=256)
    # None means "not given": a trainer can pass every flag and keep the preset's shape
    assert model_config("gpt2-medium", 50304, n_layer=None, block_size=256) == \
        GPTConfig(n_layer=24, n_head=16, n_embd=1024, block_size=256, vocab=50304)
    assert model_config(None, 256, n_layer=4, n_embd=128, block_size=128) == \
        GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab=256)
    assert model_config("gpt2-xl").vocab == 50257                    # no data: the published vocab
    with pytest.raises(ValueError, match="unknown model 'gpt3'"):
        model_config("gpt3")
    with pytest.raises(ValueError, match="unknown GPTConfig field"):
        model_config("gpt2", 256, n_layers=3)
    with pytest.raises(ValueError, match="divisible"):
        model_config("gpt2", 256, n_head=7)


@pytest.mark.parametrize("stage", ["0", "1", "2", "3"])
def test_gpt2_bytes_model_state_at_nd2(stage):
    """Formula on the padded Ψ == the bytes a rank holds, counted from the Layout's shards."""
    lay = Layout(gpt_units(model_config("gpt2", vocab_for(255, byte_level=True))), shards=2)
    full, shard = lay.padded, lay.shard_numel
    held = {  # elements per class a stage keeps on each rank (the stage table, read off ZeRO §5)
        "0": dict(p=full, g=full, o=full), "1": dict(p=full, g=full, o=shard),
        "2": dict(p=full, g=shard, o=shard), "3": dict(p=shard, g=shard, o=shard)}[stage]
    want = 2 * held["p"] + 2 * held["g"] + (4 + 4 + 4) * held["o"]
    assert acc.model_state_total(stage, lay.padded, 2) == want
    assert lay.numel == closed_form(12, 768, 256, 1024)
