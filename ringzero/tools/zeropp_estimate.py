"""``estimate --zeropp``: ZeRO++'s switches at stage 3 in bytes, memory per rank and bytes across nodes.

What it is
    ``zeropp_estimate(psi, nd, ppn, policy, precision)`` -> a dict (estimate's --json key "zeropp"),
    ``print_zeropp(p, d)`` its lines. For Nd ranks in N = Nd/P nodes of P ranks:

        hpZ's secondary shard    Ψ/P elements in the storage dtype (2Ψ/P bytes at fp16)
        qgZ's error feedback     4Ψ bytes (fp32 residual; only with --zeropp-error-feedback)
        across nodes per step    (N-1)/Nd · Ψ · storage bytes per phase, times the switch's factor
                                 (comm/qledger.zeropp_volume: qwZ (1 + 4/block)/b on each gather,
                                 hpZ 0 on the backward's, qgZ (bits/8 + 4/block)/b on the
                                 reduce-scatter; b = the storage dtype's bytes): 3 -> 0.759 at fp16

What it is not
    The engine's measurement (the trainer's closing report prints that beside this formula) or
    a time (``simulate --zeropp`` times it).
"""
from __future__ import annotations

from ringzero.comm.qledger import zeropp_volume
from ringzero.runtime import accounting as acc


def add_args(ap):
    ap.add_argument("--zeropp", default="", help="ZeRO++ at stage 3: any of qwz,hpz,qgz; needs --ranks-per-node "
                                                 "(P ranks per node): hpZ's memory and the bytes across nodes")
    ap.add_argument("--zeropp-block", type=int, default=2048, help="--zeropp qwz: elements per fp32 scale")
    ap.add_argument("--zeropp-grad-block", type=int, default=256, help="--zeropp qgz: elements per fp32 scale")
    ap.add_argument("--zeropp-bits", type=int, default=4, help="--zeropp qgz: 4 or 8")
    ap.add_argument("--zeropp-error-feedback", action="store_true", help="--zeropp qgz: count the 4Ψ residual")


def from_args(a, psi: int):
    """estimate's --zeropp flags -> zeropp_estimate's dict, or None without them (ValueError: one line)."""
    if not (a.zeropp or a.zeropp_error_feedback):
        return None
    from ringzero.runtime.zeropp import ZeroPPPolicy
    pol = ZeroPPPolicy.parse(a.zeropp, block=a.zeropp_block, grad_bits=a.zeropp_bits,
                             error_feedback=a.zeropp_error_feedback, grad_block=a.zeropp_grad_block)
    if not a.ranks_per_node:
        raise ValueError("--zeropp needs --ranks-per-node (P ranks per node: hpZ's shard and what crosses)")
    return zeropp_estimate(psi, a.nd, a.ranks_per_node, pol, a.precision)


def zeropp_estimate(psi: int, nd: int, ppn: int, policy, precision: str = "fp16") -> dict:
    eb = acc.storage_bytes(precision)
    if nd % ppn:
        raise ValueError(f"--zeropp: --ranks-per-node must divide --nd, got nd={nd}, ranks-per-node={ppn}")
    N = nd // ppn
    vol = zeropp_volume(policy.qwz, policy.hpz, policy.qgz, policy.weights, policy.grads, elem_bytes=eb)
    unit = (N - 1) * psi * eb / nd
    extra = {"hpz_secondary": psi * eb / ppn if policy.hpz else 0,
             "qgz_residual": 4 * psi if policy.error_feedback else 0}
    stage3 = acc.model_state_total("3", psi, nd, None, precision)
    return {"switches": policy.describe(), "nodes": N, "ranks_per_node": ppn, "phases_psi": vol,
            "internode_bytes_per_step": vol["total"] * unit, "internode_bytes_unquantized": 3 * unit,
            "extra_bytes": extra, "stage3_bytes": stage3, "stage3_with_zeropp_bytes": stage3 + sum(extra.values())}


def print_zeropp(p, d: dict):
    GB = 1e9
    v = d["phases_psi"]
    p(f"\nZeRO++ {d['switches']} at stage 3, {d['nodes']} nodes x {d['ranks_per_node']} ranks:")
    p(f"  across nodes per step per rank: {v['forward_all_gather']:.4f} + {v['backward_all_gather']:.4f} + "
      f"{v['reduce_scatter']:.4f} = {v['total']:.4f} (unquantized 3) x (N-1)/Nd·Ψ·bytes = "
      f"{d['internode_bytes_per_step'] / GB:.4g} GB (unquantized {d['internode_bytes_unquantized'] / GB:.4g} GB)")
    e = d["extra_bytes"]
    p(f"  memory per rank: stage 3 {d['stage3_bytes'] / GB:.4g} GB + hpZ's secondary shard (Ψ/P in the storage "
      f"dtype) {e['hpz_secondary'] / GB:.4g} GB + qgZ's residual (4Ψ) {e['qgz_residual'] / GB:.4g} GB = "
      f"{d['stage3_with_zeropp_bytes'] / GB:.4g} GB")
