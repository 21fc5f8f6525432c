"""What ringzero's Llama (nn/llama.py) keeps in its buffer pool for one micro-batch of training.

What it is
    ``training_bytes(cfg, batch, seq, checkpointing, compute_bytes)``: the Llama
    counterpart of ``ringzero.tools.activations.training_bytes`` (which hands a
    LlamaConfig here), counted from the model's own buffers, in elements
    (N = b·s tokens, C width, W = (H + 2K)·D the q/k/v width, HD = H·D,
    F the MLP's width, att = H·s²·b the attention probabilities)::

        per block, kept      5·N·C + N·W + N·HD + 3·N·F + 2·N + att   the two RMSNorms' x̂, output and
                             1/rms (2 x (2·N·C + N)), q|k|v, the probabilities, the heads' output, proj's
                             output, [gate | up] and silu(gate)·up
        per block, always    2·N·C              the block's output and its input gradient (pool "unit{u}")
        one block's backward 4·N·C + 132·C + N·(2·HD + W) + att + C·(HD + W + 3F)
                             + W (q/k/v bias) + 3·N·F   shared by every block: the norms' dw and
                             column partials (2 x 66·C), dq|dk|dv, the group copy, the
                             probabilities' gradient, the weight-gradient staging, the SwiGLU's
        the ends             5·N·C + 3·N·V + V·C + 2·N + 66·C + s·D, and 2 index arrays of N (8 bytes)

    The norms, the SwiGLU and rotary counted as fused.c's kernels run them (a CPU run's path): the
    NumPy passes a build without the extension takes keep 3·N·C + N more per norm, N·F more per
    block, and rotary's two (H + K)·D/2 products a token (on a device too: rotary has no CuPy kernel).

    With checkpointing a block keeps only its 2·N·C; one block's "kept" is
    recomputed into shared buffers. Plus one block's "kept" of temporaries
    outside the pool (as the GPT's count allows). tests/test_llama_activations.py
    holds it against the pool's bytes after a real step.

What it is not
    A measurement (the trainer reports the engine's measured peak), nor the
    GPT's count (``ringzero.tools.activations``).
"""
from __future__ import annotations


def training_bytes(cfg, batch: int, seq: int, checkpointing: bool = False, compute_bytes: int = 4) -> int:
    """Bytes of the Llama's pool (and one block's temporaries) for a micro-batch (batch, seq)."""
    N, s = batch * seq, seq
    C, L, F, D, H = cfg.n_embd, cfg.n_layer, cfg.ffn, cfg.head_dim, cfg.n_head
    HD, W, V = H * D, cfg.qkv_width, cfg.n_tokens
    att = H * s * s * batch
    layer = 5 * N * C + N * W + N * HD + 3 * N * F + 2 * N + att
    kept = L * 2 * N * C + (layer if checkpointing else L * layer)
    backward = (4 * N * C + 132 * C + N * (2 * HD + W) + att + C * (HD + W + 3 * F)
                + (W if cfg.qkv_bias else 0) + 3 * N * F)
    ends = 5 * N * C + 3 * N * V + V * C + 2 * N + 66 * C + s * D
    return compute_bytes * (kept + backward + ends + layer) + 2 * 8 * N
