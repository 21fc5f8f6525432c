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
