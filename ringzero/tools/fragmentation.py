"""``python -m ringzero.explain fragmentation``: "OOM with 30 % free", by experiment.

What it is
    Two allocation traces of the same training run (built by
    ringzero.tools.traces), replayed through the caching-allocator model of
    ringzero.tools.allocator:

    conventional  what an eager framework does (PyTorch DDP + mixed-precision
                  Adam): one tensor per parameter (fp16 weight, fp32 master),
                  Adam's m and v made lazily at the first step, one fp16
                  gradient per parameter made during backward and freed by
                  zero_grad(set_to_none=True); per block the activations the
                  model's forward keeps (the list ``unit_activations`` gives,
                  checked against the real GPT's caches in tests), freed in
                  reverse; transients (attention scores, logits, gradients of
                  activations, the fp32 unscaled gradient in the step) and a
                  temporary fp16 all-reduce bucket every ``bucket`` bytes of
                  ready gradients. The micro-batch shape changes from step to
                  step (sequence-length warm-up, varying batch shapes).
    ringzero      the runtime's plan: the flat state buffers and workspaces
                  ``ringzero.runtime.zero.Zero`` allocates at start-up
                  (``plan_buffers`` mirrors its sizes from the layout table;
                  checked against a real engine in tests), plus one activation
                  arena sized for the largest shape of the run. Allocated once,
                  never freed: every later step allocates nothing.

    It reports peak allocated against peak reserved, the largest free block,
    the smallest memory cap at which each trace runs (bisection), and at a
    smaller cap the first OOM: the request, and the share of memory free.

What it is not
    A measurement of PyTorch: the trace is written from the model's shapes,
    not recorded from torch. With a GPU and CuPy present, ``replay_cupy``
    replays the same trace through CuPy's real MemoryPool under a limit.
"""
from __future__ import annotations

import numpy as np

from ringzero.nn.gpt import GPTConfig, gpt_units
from ringzero.runtime.flat import Layout
from ringzero.tools import allocator as al
from ringzero.tools.traces import conventional_trace, ringzero_trace

MIB, GIB, GB = 1 << 20, 1 << 30, 10**9


# ---- the experiment ---------------------------------------------------------------------
def analyse(trace, policy=al.PYTORCH, scan: int = 24) -> dict:
    """Peaks at an ample cap, the smallest cap that runs, and the first OOM at
    ``scan`` caps from the peak of live bytes (where a perfect allocator runs)
    up to the smallest cap: the one with the most memory free is the headline."""
    live = al.peak_live(trace, policy)
    q = 512 if policy.exact_segments else 2 * MIB
    ample = al.replay(trace, 1 << 60, policy)
    need = al.smallest_cap(trace, policy, quantum=q)
    ooms = []
    for k in range(scan):
        cap = -(-(live + (need - live) * k // scan) // q) * q
        if cap < need:
            o = al.replay(trace, cap, policy)["oom"]
            if o:
                ooms.append({"cap": cap, **o})
    worst = max(ooms, key=lambda o: o["free_share"], default=None)
    return {"policy": policy.name, "peak_live": live, "peak_allocated": ample["peak_allocated"],
            "peak_reserved": ample["peak_reserved"], "largest_free_block": ample["largest_free_block"],
            "smallest_cap": need, "runs_at_smallest": al.replay(trace, need, policy)["oom"] is None,
            "fails_below": al.replay(trace, need - q, policy)["oom"] is not None,
            "ooms": ooms, "worst_oom": worst}


# GPT-2 medium with activation checkpointing, sequence-length warm-up 128 -> 1024
# at 8 sequences per micro-batch (DeepSpeed's curriculum "seqlen" schedule).
DEMO_CFG = GPTConfig(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab=50257)
DEMO_SHAPES = [(8, t) for t in range(128, 1025, 128)]


def demo(cfg: GPTConfig = DEMO_CFG, shapes=DEMO_SHAPES, checkpoint: bool = True,
         policies=("pytorch", "cupy")) -> dict:
    conv = conventional_trace(cfg, shapes, checkpoint=checkpoint)
    rz = ringzero_trace(cfg, shapes, checkpoint=checkpoint)
    out = {"cfg": cfg, "shapes": list(shapes), "checkpoint": checkpoint,
           "psi": Layout(gpt_units(cfg)).numel, "plan": {e[3]: e[2] for e in rz},
           "planned_bytes": sum(e[2] for e in rz), "events": len(conv), "by_policy": {}}
    for name in policies:
        pol = al.POLICIES[name]
        c, r = analyse(conv, pol), analyse(rz, pol, scan=0)
        w = c["worst_oom"]
        r["at_worst_cap"] = al.replay(rz, w["cap"], pol)["oom"] is None if w else None
        r["segment_bytes"] = sum(pol.segment_size(pol.round(e[2])) for e in rz)
        out["by_policy"][name] = {"conventional": c, "ringzero": r}
    cap = None
    if out["by_policy"].get("cupy", {}).get("conventional", {}).get("worst_oom"):
        cap = out["by_policy"]["cupy"]["conventional"]["worst_oom"]["cap"]
    out["cupy_device"] = replay_cupy(conv, cap) if cap else None
    return out


def replay_cupy(trace, cap: int) -> dict | None:
    """The trace through CuPy's real MemoryPool limited to ``cap``; None without a GPU."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:
        return None
    pool = cupy.cuda.MemoryPool()
    pool.set_limit(size=cap)
    live, oom = {}, None
    with cupy.cuda.using_allocator(pool.malloc):
        for i, ev in enumerate(trace):
            if ev[0] == "alloc":
                try:
                    live[ev[1]] = cupy.empty(ev[2], cupy.uint8)
                except cupy.cuda.memory.OutOfMemoryError:
                    oom = {"event": i, "request": ev[2], "used": pool.used_bytes(),
                           "total": pool.total_bytes(), "free_share": (cap - pool.used_bytes()) / cap}
                    break
            else:
                del live[ev[1]]
    out = {"cap": cap, "oom": oom, "total_bytes": pool.total_bytes()}
    live.clear()
    pool.free_all_blocks()
    return out


def _b(x) -> str:
    return f"{x / GIB:.3f} GiB"


def print_fragmentation(r: dict, f=None):
    import sys
    p = lambda *a: print(*a, file=f or sys.stdout)  # noqa: E731
    c = r["cfg"]
    p(f"GPT {c.n_layer}L C={c.n_embd} H={c.n_head} V={c.vocab} (Ψ = {r['psi']:,}), one rank, "
      f"fp16 weights/grads/activations, fp32 master and Adam"
      + (", activation checkpointing" if r["checkpoint"] else ""))
    p("micro-batch (B, T) per step: " + ", ".join(f"({b}, {t})" for b, t in r["shapes"]))
    p(f"conventional: {r['events']:,} alloc/free events (a tensor per parameter, gradient and "
      "Adam state; activations freed in reverse; 25 MiB fp16 all-reduce buckets)")
    p("ringzero: " + ", ".join(f"{k} {v / MIB:,.1f}" for k, v in r["plan"].items())
      + f" MiB, allocated once = {r['planned_bytes']:,} B ({_b(r['planned_bytes'])})")
    for name, d in r["by_policy"].items():
        cv, rz = d["conventional"], d["ringzero"]
        p(f"\nallocator model: {name}")
        p(f"  {'allocation':<13}{'peak live':>12}{'peak alloc':>12}{'peak reserved':>15}"
          f"{'largest free':>14}{'smallest cap':>14}{'cap / live':>11}")
        for k, x in (("conventional", cv), ("ringzero", rz)):
            p(f"  {k:<13}{_b(x['peak_live']):>12}{_b(x['peak_allocated']):>12}"
              f"{_b(x['peak_reserved']):>15}{_b(x['largest_free_block']):>14}{_b(x['smallest_cap']):>14}"
              f"{x['smallest_cap'] / x['peak_live']:>10.4f}x")
        p(f"  smallest caps found by bisection: each runs, one {'512 B' if name == 'cupy' else '2 MiB'}"
          f" less does not ({'yes' if cv['fails_below'] and rz['fails_below'] else 'NO'})")
        p(f"  ringzero's smallest cap = its {len(r['plan'])} buffers, each rounded to the allocator's "
          f"segment: {rz['segment_bytes']:,} B "
          f"({'equal' if rz['segment_bytes'] == rz['smallest_cap'] else 'DIFFERENT'})")
        p("  first OOM of the conventional step at caps between its peak of live bytes and its smallest cap:")
        p(f"    {'cap':>11}{'event':>8}  {'request':<26}{'allocated':>11}{'reserved':>11}"
          f"{'largest free':>13}{'free':>7}")
        for o in cv["ooms"]:
            req = f"{o['request'] / MIB:.1f} MiB {o['tag']}"
            p(f"    {_b(o['cap']):>11}{o['event']:>8}  {req:<26}{_b(o['allocated']):>11}"
              f"{_b(o['reserved']):>11}{o['largest_free_block'] / MIB:>9.1f} MiB{100 * o['free_share']:>6.1f}%")
        w = cv["worst_oom"]
        if w:
            p(f"  => at {_b(w['cap'])} (>= its {_b(cv['peak_live'])} of live bytes) the conventional step "
              f"OOMs with {100 * w['free_share']:.1f} % of memory free: no cached block fits the "
              f"{w['request'] / MIB:.0f} MiB request (largest {w['largest_free_block'] / MIB:.0f} MiB) and "
              f"the device's unreserved {w['device_free'] / MIB:.0f} MiB cannot hold its segment; "
              f"ringzero's plan at that cap: {'runs' if rz['at_worst_cap'] else 'does NOT fit'} (it needs "
              f"{rz['smallest_cap'] / rz['peak_live']:.4f}x its own {_b(rz['peak_live'])} of live bytes, "
              f"the conventional step {cv['smallest_cap'] / cv['peak_live']:.4f}x its)")
    if r.get("cupy_device"):
        d = r["cupy_device"]
        p(f"\nCuPy's real MemoryPool at {_b(d['cap'])}: "
          + (f"OOM at event {d['oom']['event']} with {100 * d['oom']['free_share']:.1f} % free"
             if d["oom"] else "runs"))
    else:
        p("\n(CuPy's real MemoryPool: skipped, needs cupy and a GPU)")


def plot_usage(cfg, shapes, out: str, checkpoint: bool = True, policy=al.PYTORCH) -> str:
    """PNG: allocated, reserved and the largest free block over the trace (no cap), for
    the conventional step and ringzero's plan, with the conventional trace's worst OOM cap."""
    from ringzero.tools.plot import _plt
    conv = conventional_trace(cfg, shapes, checkpoint=checkpoint)
    rz = ringzero_trace(cfg, shapes, checkpoint=checkpoint)
    u = al.replay(conv, 1 << 60, policy, record=True)["usage"]
    worst = analyse(conv, policy)["worst_oom"]
    plan = al.replay(rz, 1 << 60, policy)["peak_reserved"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=110)
    x = np.arange(len(u))
    for k, (name, color) in enumerate((("allocated (live tensors)", "tab:blue"),
                                       ("reserved (segments held)", "tab:orange"),
                                       ("largest free block", "tab:gray"))):
        ax.plot(x, [e[k] / GIB for e in u], color=color, lw=1, label="conventional: " + name)
    ax.axhline(plan / GIB, color="tab:green", lw=2, label=f"ringzero's plan: {plan / GIB:.3f} GiB, every step")
    if worst:
        ax.axhline(worst["cap"] / GIB, color="tab:red", ls="--", lw=1,
                   label=f"cap {worst['cap'] / GIB:.3f} GiB: conventional OOMs with "
                         f"{100 * worst['free_share']:.1f} % free")
        ax.plot([worst["event"]], [worst["allocated"] / GIB], "rx", ms=9)
    ax.set_xlabel("allocator event (8 steps, T = 128 .. 1024)" if shapes == DEMO_SHAPES else "allocator event")
    ax.set_ylabel("GiB")
    ax.set_title(f"GPT {cfg.n_layer}L C={cfg.n_embd}, {policy.name} allocator model, no cap", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


# ---- CLI (``python -m ringzero.explain fragmentation``) ---------------------------------
def parse_shapes(text: str) -> list:
    """'8x128,8x256' -> [(8, 128), (8, 256)]."""
    out = []
    for part in str(text).split(","):
        b, _, t = part.strip().lower().partition("x")
        if not (b.isdigit() and t.isdigit() and int(b) > 0 and int(t) > 0):
            raise ValueError(f"cannot read shape {part.strip()!r}: expected BxT with B, T >= 1, "
                             f"e.g. 8x128,8x256")
        out.append((int(b), int(t)))
    return out


def add_args(ap):
    from ringzero.nn.gpt import PRESETS
    ap.add_argument("--model", choices=sorted(PRESETS), default="gpt2-medium",
                    help="GPT shape whose layout is traced (default gpt2-medium)")
    ap.add_argument("--shapes", default=",".join(f"{b}x{t}" for b, t in DEMO_SHAPES),
                    help="micro-batch BxT of each step (default: seq-length warm-up 8x128 .. 8x1024)")
    ap.add_argument("--no-checkpoint", action="store_true", help="keep every activation (no recompute)")
    ap.add_argument("--policy", choices=("pytorch", "cupy", "both"), default="both")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the report")
    ap.add_argument("--plot", help="PNG: memory over the trace (pytorch policy), with the OOM cap")


def run(a) -> int:
    import json
    import sys

    from ringzero.nn.gpt import PRESETS
    cfg = PRESETS[a.model]
    try:
        shapes = parse_shapes(a.shapes)
        bad = [t for _, t in shapes if t > cfg.block_size]
        if bad:
            raise ValueError(f"sequence length must be <= block_size={cfg.block_size}, got {bad[0]}")
    except ValueError as e:
        print(f"python -m ringzero.explain fragmentation: error: {e}", file=sys.stderr)
        return 2
    pols = ("pytorch", "cupy") if a.policy == "both" else (a.policy,)
    r = demo(cfg, shapes, checkpoint=not a.no_checkpoint, policies=pols)
    if a.json:
        r = {**r, "cfg": dict(cfg.__dict__)}
        print(json.dumps(r, indent=1))
    else:
        print_fragmentation(r)
    if a.plot:
        plot_usage(cfg, shapes, a.plot, checkpoint=not a.no_checkpoint)
        print(f"wrote {a.plot}")
    return 0
