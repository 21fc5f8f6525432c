"""``python -m ringzero.estimate --model zero-100b``: the ZeRO paper's ~60 GB of
checkpointed activations, against the formula 2 B x b·s·h·L written out here."""
from ringzero.tools import estimate as est


def test_zero_100b_checkpoints(capsys):
    assert est.main(["--model", "zero-100b", "--nd", "1"]) == 0
    out = capsys.readouterr().out
    b, s, h, L = 32, 1024, 8192, 125
    ckpt = 2 * b * s * h * L                       # one fp16 layer input per layer
    assert ckpt == 67_108_864_000
    assert f"{ckpt:,} B" in out and "62.5 GiB" in out
    assert "micro-batch 32 x seq 1024" in out      # the paper's batch, by default
    # Ψ: 12Lh² + 13Lh + (V + T)h + 2h, the GPT-2 closed form
    psi = 12 * L * h * h + 13 * L * h + (50257 + 1024) * h + 2 * h
    assert f"Ψ = {psi:,}" in out
    # and the number sits within 15 % of the paper's ~60 (GB or GiB)
    assert abs(ckpt / 2**30 - 60) / 60 < 0.05 and abs(ckpt / 1e9 - 60) / 60 < 0.15


def test_llama_presets(capsys):
    """A Llama-family preset: Ψ is the released checkpoint's parameter count (the model cards / transformers'
    num_parameters: SmolLM2-135M 134,515,008; TinyLlama 1,100,048,384), and a width flag re-derives head_dim."""
    for name, psi in (("smollm2-135m", 134_515_008), ("tinyllama-1.1b", 1_100_048_384)):
        assert est.main(["--model", name, "--nd", "2"]) == 0
        assert f"Ψ = {psi:,}" in capsys.readouterr().out
    # 2 layers of width 72 (9 heads of 8, 3 KV heads), MLP 1536, vocab 256, tied:
    # per block 2·72 (norms) + 72·(9+6)·8 (q|k|v) + 72·72 (proj) + 3·72·1536 (gate, up, down); wte; lnf
    C = 72
    psi = 2 * (2 * C + C * 15 * 8 + C * C + 3 * C * 1536) + 256 * C + C
    assert est.main(["--model", "smollm2-135m", "--n-layer", "2", "--n-embd", "72", "--vocab", "256",
                     "--nd", "1"]) == 0
    assert f"Ψ = {psi:,}" in capsys.readouterr().out
