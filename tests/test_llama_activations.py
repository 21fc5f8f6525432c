"""ringzero.tools.llama_activations: the Llama's activation count against its pool's bytes after a real step.

The reference is the pool itself (every buffer the model made, counted by NumPy's nbytes)
after one forward and backward, with and without checkpointing and the q/k/v bias; the
count (plus its allowance of one block's temporaries) must cover it within 0.5 %.
"""
import numpy as np
import pytest

from ringzero.nn.llama import Llama, LlamaConfig
from ringzero.runtime.flat import Layout
from ringzero.tools.activations import training_bytes


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_count_covers_the_pool(ckpt, bias):
    cfg = LlamaConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=64, ffn=96, vocab=256, block_size=32,
                      qkv_bias=bias, tied=not bias)
    m = Llama(cfg, checkpoint=ckpt)
    L = Layout(m.units)
    buf = np.zeros(L.padded, np.float32)
    L.init_full(buf, 1)
    x = np.random.default_rng(0).integers(0, 256, (4, 32))
    m.loss_and_grad(L.views(buf), L.views(np.zeros_like(buf)), x, np.roll(x, -1, 1))
    pool = m.pool.nbytes
    N = 4 * 32
    temps = 4 * (5 * N * 64 + N * cfg.qkv_width + N * 64 + 3 * N * 96 + 2 * N + 4 * 32 * 32 * 4)   # one block's kept
    est = training_bytes(cfg, 4, 32, ckpt, 4)
    assert pool + temps <= est <= 1.005 * pool + temps, f"pool {pool:,} B, estimate {est:,} B"
