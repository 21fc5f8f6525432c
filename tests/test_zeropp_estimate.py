"""estimate and simulate with ZeRO++'s switches, against the byte counts written out here.

- ``estimate --zeropp``: hpZ's shard is Ψ·2/P bytes at fp16; what crosses the nodes per step per
  rank is (N-1)/Nd·Ψ·2 times 0.5 + 2/block (qwZ, each gather), 0 (hpZ, the backward gather) and
  0.25 + 2/block (qgZ, int4), against 3 unquantized.
- ``simulate``'s cross-node bytes at stage 3 with the switches: each phase's share of the
  unquantized figure, per unit, from the Ring's rule (comm.schedule.internode_bytes) on the
  wire bytes written out here (codes + one fp32 scale per block); hpZ's backward gathers stay
  inside the node; the step with the switches is faster on a slow network.
"""
import json

import pytest

from ringzero.comm.schedule import internode_bytes
from ringzero.nn.gpt import GPTConfig, gpt_units
from ringzero.runtime.flat import Layout
from ringzero.runtime.zeropp import ZeroPPPolicy
from ringzero.tools import simulate as sm


def test_estimate_zeropp_json(capsys):
    from ringzero.tools.estimate import main
    assert main(["--params", "1B", "--nd", "8", "--ranks-per-node", "4", "--zeropp", "qwz,hpz,qgz",
                 "--zeropp-error-feedback", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["zeropp"]
    psi, nd, P, N, blk, gblk = 10 ** 9, 8, 4, 2, 2048, 256  # the weights' and the gradients' blocks
    one = (N - 1) / nd * psi * 2                           # one unquantized phase, fp16
    want = one * ((0.5 + 2 / blk) + 0 + (0.25 + 2 / gblk))
    assert r["internode_bytes_per_step"] == pytest.approx(want, rel=1e-12)
    assert r["internode_bytes_unquantized"] == pytest.approx(3 * one, rel=1e-12)
    assert r["extra_bytes"] == {"hpz_secondary": psi * 2 / P, "qgz_residual": 4 * psi}


def test_estimate_zeropp_bad_input_one_line(capsys):
    from ringzero.tools.estimate import main
    for args, needle in ((["--zeropp", "qwz"], "--zeropp needs --ranks-per-node"),
                         (["--zeropp", "qwz,x", "--ranks-per-node", "2"], "got 'x'")):
        with pytest.raises(SystemExit) as e:
            main(["--params", "1B", "--nd", "8", *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and needle in err[-1], err


def wire(S_elems, bits, block):
    """Bytes of S elements quantized: codes (bits/8 each) + one fp32 scale per block (no padding)."""
    return S_elems * bits / 8 + 4 * S_elems / block


@pytest.mark.parametrize("spec", ["qwz", "hpz", "qgz", "qwz,hpz,qgz"])
def test_simulate_internode_bytes_per_switch(spec):
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab=256)
    L = Layout(gpt_units(cfg))
    nd, N, pol = 4, 2, ZeroPPPolicy.parse(spec)
    Ls = Layout(gpt_units(cfg), shards=nd)
    base = sm.internode_per_step(L, "3", nd, N)
    got = sm.internode_per_step(L, "3", nd, N, zeropp=pol)
    # the step's ops, written out: stage 3 gathers each unit in the forward and again in the backward
    # (the last unit once), reduce-scatters each once; first gathers carry qwZ's bytes, the later ones
    # hpZ's (nothing across), the reduce-scatters qgZ's
    want, U = 0.0, len(Ls.units)
    for u in range(U):
        S = Ls.unit_padded[u]
        g = round(wire(S, 8, 2048)) if pol.qwz else 2 * S
        want += internode_bytes("all_gather", nd, g, N)                                      # forward
        if u != U - 1:
            want += 0 if pol.hpz else internode_bytes("all_gather", nd, g, N)               # backward
        rs = round(wire(S, 4, 256)) if pol.qgz else 2 * S                  # the gradients' blocks: 256
        want += internode_bytes("reduce_scatter", nd, rs, N)
    assert got == pytest.approx(want, rel=1e-9), (spec, got, want, base)
    assert got < base


def test_simulate_zeropp_is_faster_on_a_slow_network():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab=256)
    L = Layout(gpt_units(cfg))
    comp = sm.flops_compute(cfg, 2, 32, 1e12)
    links, nodes = sm.Links.given(1e-5, 1e10), sm.Nodes(2, 5e-6, 1.25e7)
    plain = sm.step_time(L, "3", 4, comp, links, nodes=nodes)
    zpp = sm.step_time(L, "3", 4, comp, links, nodes=nodes, zeropp=ZeroPPPolicy.parse("qwz,hpz,qgz"))
    assert zpp["stage"] == "3+zpp" and zpp["comm"] < 0.5 * plain["comm"]
    assert zpp["internode_bytes"] < 0.3 * plain["internode_bytes"]


def test_explain_traffic_knows_the_switches(tmp_path, capsys):
    """explain traffic --nodes 2 --zeropp: the bytes across nodes written out; --metrics of a --zeropp run:
    its measured Ψ-multiple beside the formula."""
    from test_explain import _metrics

    from ringzero.tools import explain as ex
    assert ex.main(["traffic", "--params", "1B", "--nd", "4", "--nodes", "2", "--zeropp", "qwz,hpz,qgz"]) == 0
    out = capsys.readouterr().out
    want = (2 - 1) / 4 * 10 ** 9 * 2 * ((0.5 + 2 / 2048) + (0.25 + 2 / 256)) / 1e9     # blocks 2048 and 256
    assert f"= {want:.4g} GB (unquantized {3 * 10 ** 9 * 2 / 4 / 1e9:.4g} GB)" in out, out[-600:]
    path, _ = _metrics(tmp_path, psi=1024, n=4, stage="3")
    lines = [json.loads(x) for x in open(path)]
    lines[-1]["traffic"].update(nodes=2, node_ppn=2, measured_internode_bytes_per_step=390,
                                formula_internode_bytes_per_step=1536, internode_formula="3(Ψ/P)(N-1)/N",
                                zeropp="qwz,hpz,qgz (block 256, grads int4)", zeropp_measured_psi=0.7617,
                                zeropp_formula_psi=0.765625, zeropp_formula_internode_bytes_per_step=392)
    open(path, "w").write("\n".join(json.dumps(x) for x in lines) + "\n")
    ex.main(["traffic", "--metrics", path])
    out = capsys.readouterr().out
    assert "ZeRO++ qwz,hpz,qgz (block 256, grads int4): across nodes measured 0.7617" in out
    assert "formula 0.7656 (comm.qledger.zeropp_volume; unquantized 3) = 392 B" in out
    with pytest.raises(SystemExit) as e:
        ex.main(["traffic", "--params", "1B", "--nd", "4", "--zeropp", "qwz"])
    assert e.value.code == 2
