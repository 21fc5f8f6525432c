"""ZeRO++ in the engine (runtime/zeropp.py): qwZ, hpZ and qgZ at stage 3, against references written here.

- The quantized run is bitwise the same run with the engine's QuantizedComm replaced by ``RefComm``
  below: MPI's own Allgather moves the raw values, and NumPy quantizes them as the format says
  (comm/quant.py's docstring: fp32 absmax / qmax, rint ties to even, clip, codes 0 on a zero or
  non-finite scale) and sums the dequantized chunks in float32 in the two-hop order
  (comm/quantized.py's docstring). Same codes, scales and sums: same losses, same master bits.
- hpZ changes no bit: hpz alone is bitwise the unquantized run, qwz+hpz bitwise qwz alone (the
  backward gets the forward's gathered bits from the secondary shard inside the node).
- The quantization is real: the quantized run's weights differ from the unquantized run's.
- Two runs are bitwise equal; a checkpoint of a quantized run is the fp32 master and resumes bitwise.
- The bytes sent across the emulated nodes per step equal the wire sizes written out here.
- Bad policies: one line each.

Node maps are emulated (``Zero(..., nodes=labels)``): 2 nodes x n/2 ranks where n is even and >= 4
(the two-hop schedules), else one node (the one-hop all-to-all).
"""
import numpy as np
import pytest
from conftest import assert_all
from test_zero import batches, engine, train

BLOCK = 64                     # several blocks a chunk, a short last one: the tiny model's units are ~1-2k
GRAD_BLOCK = 40                # qgZ's blocks: another size, so weights and gradients in each other's blocks fail


def labels_of(n):
    return [r // (n // 2) for r in range(n)] if n >= 4 and n % 2 == 0 else [0] * n


def policy(spec, **kw):
    from ringzero.runtime.zeropp import ZeroPPPolicy
    return ZeroPPPolicy.parse(spec, block=BLOCK, **{"grad_block": GRAD_BLOCK, **kw})


# ------------------------------------------------------------- the reference
def ref_quant(x, bits, block, rnd=np.rint):
    """x (fp32, 1-D) -> its dequantized values, written from the format's definition."""
    qmax = np.float32(127 if bits == 8 else 7)
    nb = -(-len(x) // block)
    xp = np.zeros(nb * block, np.float32)
    xp[:len(x)] = x
    blocks = xp.reshape(nb, block)
    scale = (np.abs(blocks).max(axis=1).astype(np.float32) / qmax).astype(np.float32)
    ok = (scale != 0) & np.isfinite(scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.clip(rnd(blocks / np.where(ok, scale, 1)[:, None]), -qmax, qmax)
    codes[~ok] = 0
    vals = (codes.astype(np.float32) * scale[:, None]).astype(np.float32)
    vals[~ok] = np.where(np.isfinite(scale[~ok]), 0, np.nan)[:, None]
    return vals.reshape(-1)[:len(x)]


class RefComm:
    """The engine's QuantizedComm, redone from MPI's Allgather and ref_quant."""

    def __init__(self, qc, comm, order=1, rnd=np.rint):
        from ringzero.comm.qledger import QLedger
        self.comm, self.nodes, self.ledger = qc.comm, qc.nodes, QLedger()   # the shard group (hybrid: a node)
        self.wbits, self.gbits = qc.wq.spec.bits, qc.gq.spec.bits
        self.order, self.rnd = order, rnd       # the broken variants of test_reference_can_fail

    def _everyone(self, a):
        out = np.empty((self.comm.size, len(a)), np.float32)
        self.comm.Allgather(np.ascontiguousarray(a, np.float32), out)
        return out

    def all_gather(self, send, recv):
        for b, row in enumerate(self._everyone(send)):
            recv[b * len(send):(b + 1) * len(send)] = ref_quant(row, self.wbits, BLOCK, self.rnd).astype(recv.dtype)
        return recv

    def reduce_scatter(self, send, recv, op="sum", residual=None):
        n, m, r, nm = self.comm.size, len(recv), self.comm.rank, self.nodes
        x = np.asarray(send, np.float32).copy()
        if residual is not None:
            x = (x + residual).astype(np.float32)
            deq = np.concatenate([ref_quant(x[b * m:(b + 1) * m], self.gbits, GRAD_BLOCK, self.rnd) for b in range(n)])
            residual[...] = x - deq
        xs = self._everyone(x)
        v = lambda src, b: ref_quant(xs[src][b * m:(b + 1) * m], self.gbits, GRAD_BLOCK, self.rnd)   # noqa: E731
        if not nm.uniform:                               # one hop: rank order
            srcs = list(range(n))[::self.order]
            acc = v(srcs[0], r).copy()
            for src in srcs[1:]:
                acc += v(src, r)
        else:                                            # hop 1 in the node (local order), hop 2 node order
            at = {(nm.node_of[b], nm.local_of[b]): b for b in range(n)}
            acc = None
            for k in range(nm.count):
                loc = list(range(nm.ppn))[::self.order]
                part = v(at[k, loc[0]], r).copy()
                for i in loc[1:]:
                    part += v(at[k, i], r)
                q = ref_quant(part, self.gbits, GRAD_BLOCK, self.rnd)
                acc = q.copy() if acc is None else acc + q
        recv[...] = acc.astype(recv.dtype)
        return recv


def run(comm, spec, steps=4, ref=False, precision="fp16", broken=None, stage="3", eng_kw=None, **kw):
    """Train ``steps`` steps with --zeropp spec: (engine, losses, full master). ref: RefComm in place of the
    engine's QuantizedComm, every call blocking (RefComm has no started form; across the emulated nodes
    the engine's default is overlap, so the real run's started calls meet the blocking reference)."""
    eng_kw = dict(eng_kw or {}, **({"overlap": False} if ref else {}))
    eng = engine(comm, stage, precision=precision, **eng_kw, nodes=labels_of(comm.size),
                 zeropp=policy(spec, **kw) if spec else None)
    if ref:
        eng.topology.zeropp.qc = RefComm(eng.topology.zeropp.qc, comm, **(broken or {}))
    losses = train(eng, batches(comm, comm.size, comm.rank), steps=steps)
    return eng, losses, eng.full_state("master")


# ------------------------------------------------------------------ tests
@pytest.mark.mpi
@pytest.mark.parametrize("spec,kw,precision", [("qwz,qgz", {}, "fp16"), ("qwz,hpz,qgz", {}, "fp16"),
                                               ("qgz", {"error_feedback": True}, "fp16"),
                                               ("qwz,hpz,qgz", {"grad_bits": 8}, "bf16")])
def test_quantized_run_matches_numpy_reference(comm, spec, kw, precision):
    _, got, mg = run(comm, spec, precision=precision, **kw)
    _, want, mw = run(comm, spec, ref=True, precision=precision, **kw)
    _, plain, mp = run(comm, "", precision=precision)
    assert_all(comm, got == want, f"{spec}: losses {got} vs reference {want}")
    assert_all(comm, np.array_equal(mg, mw), f"{spec}: master differs from the reference's in "
               f"{int((mg != mw).sum())} elements")
    assert_all(comm, not np.array_equal(mg, mp), f"{spec}: the quantized run equals the unquantized one")


@pytest.mark.mpi
@pytest.mark.parametrize("spec,kw,eng_kw", [("qwz,hpz,qgz", {"error_feedback": True}, {}),
                                            ("qwz,hpz,qgz", {}, {"grad_accum": 2}),
                                            ("hpz", {}, {"prefetch": 2})])
def test_overlap_matches_numpy_reference(comm, spec, kw, eng_kw, monkeypatch):
    """With overlap (the nonblocking forms on the progress threads, prefetch starting each gather
    positions early) the run is bitwise the reference's, which runs every call blocking; every buffer
    the workspaces write is checked against the started calls (RINGZERO_CHECK_OWNERSHIP=1)."""
    monkeypatch.setenv("RINGZERO_CHECK_OWNERSHIP", "1")
    eng, got, mg = run(comm, spec, eng_kw={"overlap": True, **eng_kw}, **kw)
    ref = spec != "hpz"            # hpz alone has no quantized call: the unquantized blocking run is its reference
    _, want, mw = run(comm, spec if ref else "", ref=ref, eng_kw=dict(eng_kw, overlap=False, prefetch=None), **kw)
    assert_all(comm, eng.overlap and eng.prefetch == eng_kw.get("prefetch", 1), "the run did not overlap")
    assert_all(comm, got == want and np.array_equal(mg, mw), f"{spec} {eng_kw} with overlap: losses {got} vs "
               f"reference {want}, master differs in {int((mg != mw).sum())} elements")
    assert_all(comm, comm.size == 1 or eng.timeline["progress_cpu_s"] > 0,
               f"nothing ran on a progress thread: {eng.timeline}")


@pytest.mark.mpi
def test_hybrid_matches_numpy_reference(comm):
    """Hybrid (shard group = an emulated node, replicas all-reduced across): qwz and qgz inside the node."""
    if labels_of(comm.size)[-1] != 1:
        pytest.skip(f"needs 2 emulated nodes (an even world size >= 4), have {comm.size}")
    _, got, mg = run(comm, "qwz,qgz", stage="hybrid")
    _, want, mw = run(comm, "qwz,qgz", stage="hybrid", ref=True)
    _, plain, mp = run(comm, "", stage="hybrid")
    assert_all(comm, got == want and np.array_equal(mg, mw), f"hybrid: losses {got} vs reference {want}")
    assert_all(comm, not np.array_equal(mg, mp), "hybrid: the quantized run equals the unquantized one")


@pytest.mark.mpi
def test_reference_can_fail(comm):
    """The comparison above sees a wrong rounding (truncation instead of ties-to-even) and, where a
    sum has three or more terms (two commute exactly), a wrong order of the fp32 sums."""
    _, got, mg = run(comm, "qwz,qgz", precision="fp32")
    n = comm.size
    terms = n // 2 if labels_of(n)[-1] == 1 else n       # fp32 terms a sum adds (a + b == b + a: 3 needed)
    cases = [{"rnd": np.trunc}] + ([{"order": -1}] if terms >= 3 else [])
    for broken in cases:
        _, want, mw = run(comm, "qwz,qgz", ref=True, precision="fp32", broken=broken)
        assert_all(comm, not np.array_equal(mg, mw), f"the reference with {broken} still agrees")


@pytest.mark.mpi
def test_accumulation_matches_numpy_reference(comm):
    """grad_accum = 2: each micro-batch's gradient goes through qgZ into the fp32 shard accumulator."""
    kw = {"eng_kw": {"grad_accum": 2}}
    _, got, mg = run(comm, "qwz,hpz,qgz", **kw)
    _, want, mw = run(comm, "qwz,hpz,qgz", ref=True, **kw)
    assert_all(comm, got == want and np.array_equal(mg, mw), f"K=2: losses {got} vs reference {want}")


@pytest.mark.mpi
def test_offload_changes_no_bit(comm, tmp_path_factory):
    """--offload optimizer,params beside the switches (and ahead, beside qwz,qgz): the same bits as in RAM."""
    from test_checkpoint import shared_dir

    from ringzero.runtime.offload import OffloadPolicy
    d = shared_dir(comm, tmp_path_factory, "zppoff")
    off = OffloadPolicy(optimizer=True, params=True, dir=d, tile=1024)
    _, a, ma = run(comm, "qwz,hpz,qgz", eng_kw={"offload": off})
    _, b, mb = run(comm, "qwz,hpz,qgz")
    assert_all(comm, a == b and np.array_equal(ma, mb), f"offloaded {a} vs in RAM {b}")
    # the update beside the next forward (ahead): qwz, qgz (hpz is refused with it)
    ahead = OffloadPolicy(optimizer=True, params=True, dir=d, tile=1024, ahead=True)
    _, a, ma = run(comm, "qwz,qgz", eng_kw={"offload": ahead})
    _, b, mb = run(comm, "qwz,qgz")
    assert_all(comm, a == b and np.array_equal(ma, mb), f"offloaded ahead {a} vs in RAM {b}")


@pytest.mark.mpi
def test_hpz_changes_no_bit(comm):
    _, l0, m0 = run(comm, "")
    _, l1, m1 = run(comm, "hpz")
    _, l2, m2 = run(comm, "qwz")
    _, l3, m3 = run(comm, "qwz,hpz")
    assert_all(comm, l0 == l1 and np.array_equal(m0, m1), f"hpz alone: losses {l1} vs {l0}")
    assert_all(comm, l2 == l3 and np.array_equal(m2, m3), f"qwz+hpz: losses {l3} vs qwz {l2}")


@pytest.mark.mpi
def test_two_runs_bitwise_equal(comm):
    _, la, ma = run(comm, "qwz,hpz,qgz", error_feedback=True)
    _, lb, mb = run(comm, "qwz,hpz,qgz", error_feedback=True)
    assert_all(comm, la == lb and np.array_equal(ma, mb), f"losses {la} vs {lb}")


@pytest.mark.mpi
def test_checkpoint_is_full_precision_and_resumes(comm, tmp_path_factory):
    from test_checkpoint import shared_dir

    from ringzero.runtime import checkpoint as ck
    d = shared_dir(comm, tmp_path_factory, "zpp")
    data = batches(comm, comm.size, comm.rank)
    mk = lambda seed: engine(comm, "3", seed=seed, nodes=labels_of(comm.size),   # noqa: E731
                             zeropp=policy("qwz,hpz,qgz"))
    a = mk(3)
    train(a, data, steps=3)
    ck.save(a, d, 3)
    saved = a.full_state("master")
    ref = [a.step(*data.get(s), 3e-3).loss for s in range(3, 6)]
    b = mk(77)
    ck.load(b, "latest", d)
    ok = b.full_state("master").dtype == np.float32 and np.array_equal(b.full_state("master"), saved)
    got = [b.step(*data.get(s), 3e-3).loss for s in range(3, 6)]
    assert_all(comm, ok, "the loaded master is not the saved fp32 master")
    assert_all(comm, got == ref, f"resumed losses {got} vs {ref}")


def wire(m, bits, block):
    """(codes bytes padded to 4, scales bytes) of one quantized chunk of m elements."""
    codes = m if bits == 8 else -(-m // 2)
    return -(-codes // 4) * 4, 4 * -(-m // block)


@pytest.mark.mpi
def test_internode_bytes_are_the_wire_sizes(comm):
    n = comm.size
    if not (n >= 4 and n % 2 == 0):
        pytest.skip(f"needs an even world size >= 4 for 2 emulated nodes, have {n}")
    eng = engine(comm, "3", nodes=labels_of(n), zeropp=policy("qwz,hpz,qgz"))
    data = batches(comm, n, comm.rank)
    train(eng, data, steps=1)
    before = eng.topology.zeropp.qc.ledger.as_dict()
    eng.step(*data.get(1), 3e-3)
    after = eng.topology.zeropp.qc.ledger.as_dict()
    L = eng.layout
    codes = sum(wire(m, 8, BLOCK)[0] + wire(m, 4, GRAD_BLOCK)[0] for m in L.piece_numel)   # N - 1 = 1 peer across
    scales = sum(wire(m, 8, BLOCK)[1] + wire(m, 4, GRAD_BLOCK)[1] for m in L.piece_numel)
    got = {k: sum(after[op][k] - before[op][k] for op in after) for k in ("codes_inter", "scales_inter")}
    rep = eng.traffic_report()
    ok = got == {"codes_inter": codes, "scales_inter": scales}
    ok &= rep["measured_internode_bytes_per_step"] == codes + scales      # hpZ's ring: nothing across
    ok &= rep["by_op_internode"].get("all_gather@hpz", 0) == 0 and rep["by_op"].get("all_gather@hpz", 0) > 0
    # ZeRO++'s formula (0.5 + 1/32 + 0 + 0.25 + 1/20 at blocks 64 and 40) is the plan's within block padding
    ok &= abs(rep["zeropp_measured_psi"] - rep["zeropp_formula_psi"]) < 0.05
    mem = eng.memory_report()
    ok &= mem["hpz_secondary_bytes"] == mem["hpz_secondary_formula_bytes"] == 2 * L.padded // (n // 2)
    ok &= mem["hpz_itemsize"] == 2          # the printed formula reads 2Ψ/P at fp16 (4Ψ/P at fp32)
    # the memory check (app/memcheck.py) counts the secondary shard the engine allocated
    from ringzero.app import memcheck
    from ringzero.app.config import parse_config
    cfg, _ = parse_config(["--stage", "3", "--zeropp", "hpz", "--precision", "fp16"])
    ok &= memcheck.zeropp_bytes(cfg, L, eng.policy, n // 2, np.dtype(np.float16)) == mem["hpz_secondary_bytes"]
    assert_all(comm, ok, f"internode {got} vs codes {codes} scales {scales}; report "
               f"{rep['measured_internode_bytes_per_step']} psi {rep['zeropp_measured_psi']:.4f} vs "
               f"{rep['zeropp_formula_psi']:.4f}; hpz {mem['hpz_secondary_bytes']}")


@pytest.mark.mpi
def test_hpz_refuses_an_uneven_node_map(comm):
    from ringzero.runtime.zeropp import ZeroPPError
    if comm.size < 3:
        pytest.skip(f"an uneven map needs 3 ranks or more, have {comm.size}")
    with pytest.raises(ZeroPPError) as e:
        engine(comm, "3", nodes=[0] * (comm.size - 1) + [1], zeropp=policy("hpz"))
    assert "\n" not in str(e.value) and "the same number of ranks on every node" in str(e.value)


def test_policy_parse_and_refusals():
    from ringzero.runtime.policy import StagePolicy
    from ringzero.runtime.zeropp import ZeroPPPolicy, check
    p = ZeroPPPolicy.parse("qgz, qwz")
    assert (p.qwz, p.hpz, p.qgz, p.grads.bits, p.weights.bits, p.block) == (True, False, True, 4, 8, 2048)
    assert (p.weights.block, p.grads.block) == (2048, 256)
    assert not ZeroPPPolicy.parse("").enabled and not ZeroPPPolicy.parse("none").enabled
    bad = [lambda: ZeroPPPolicy.parse("qwz,zpp"), lambda: ZeroPPPolicy.parse("qgz", grad_bits=2),
           lambda: ZeroPPPolicy.parse("qgz", block=0), lambda: ZeroPPPolicy.parse("qgz", grad_block=0),
           lambda: ZeroPPPolicy.parse("qwz", error_feedback=True),
           lambda: check(p, StagePolicy.of("2")), lambda: check(ZeroPPPolicy(hpz=True), StagePolicy.of("hybrid")),
           lambda: check(p, StagePolicy.of("3"), overlap=True, host=False),
           lambda: check(p, StagePolicy.of("3"), prefetch=1, host=False)]
    for f in bad:
        with pytest.raises(ValueError) as e:
            f()
        assert "\n" not in str(e.value) and "expected" in str(e.value)
    check(p, StagePolicy.of("hybrid"))          # qwz, qgz run at hybrid
    check(p, StagePolicy.of("3"), overlap=True, prefetch=2)     # on the host: the nonblocking forms
    check(ZeroPPPolicy(), StagePolicy.of("0"))  # off: nothing to refuse


def test_memcheck_counts_zeropp():
    """The memory check's need grows by --zeropp's buffers: hpZ's 2Ψ/P, qgZ's 4Ψ residual and scratch."""
    from ringzero.app import memcheck
    from ringzero.app.config import parse_config
    from ringzero.nn import families
    base = ["--stage", "3", "--n-layer", "2", "--n-embd", "64", "--seq-len", "32"]
    plain, _ = parse_config(base)
    zpp, _ = parse_config(base + ["--zeropp", "qwz,hpz,qgz", "--zeropp-error-feedback"])
    model = families.build(memcheck_model_cfg(plain))
    run = memcheck.base_run(plain, 4, 2)
    a, b = memcheck.need_of(plain, model, run), memcheck.need_of(zpp, model, run)
    from ringzero.runtime.flat import Layout
    psi = Layout(model.units, shards=4).padded
    assert b.model_state - a.model_state >= 2 * psi // 2 + 4 * psi     # secondary (P = 2) + residual
    assert b.model_state - a.model_state < 2 * psi // 2 + 4 * psi + 16 * psi    # + scratch below a few Ψ


def memcheck_model_cfg(cfg):
    from ringzero.app.config import model_config
    return model_config(cfg, 256)


# ------------------------------------------------------------------ the trainer
@pytest.mark.parametrize("args, needle", [
    (["--zeropp", "qwz"], "expected --stage 3 or hybrid, got stage 2"),
    (["--zeropp", "qwz,fast", "--stage", "3"], "got 'fast'"),
    (["--zeropp", "hpz", "--stage", "hybrid"], "expected --stage 3 with hpz, got hybrid"),
    (["--zeropp", "qgz", "--zeropp-bits", "3", "--stage", "3"], "--zeropp-bits: expected 4 or 8, got 3"),
    (["--zeropp-bits", "8", "--stage", "3"], "--zeropp-bits is given without --zeropp"),
    (["--zeropp", "qwz", "--stage", "3", "--zeropp-error-feedback"], "expected --zeropp with qgz"),
    (["--zeropp", "qwz", "--stage", "3", "--zeropp-block", "0"], "--zeropp-block: expected an int >= 1"),
    (["--zeropp", "qgz", "--stage", "3", "--zeropp-grad-block", "-4"], "--zeropp-grad-block: expected an int >= 1"),
    (["--zeropp-grad-block", "512", "--stage", "3"], "--zeropp-grad-block is given without --zeropp"),
])
def test_bad_flags_one_line_exit_2(tmp_path, args, needle):
    from test_train import _check
    rc, err, new = _check(args + ["--metrics", str(tmp_path / "m.jsonl")], tmp_path)
    assert rc == 2 and len(err) == 1 and needle in err[0] and err[0].startswith("ringzero.train: error:"), err
    assert not new


@pytest.mark.mpi
def test_trainer_smoke_all_switches_two_emulated_nodes(comm, tmp_path_factory, monkeypatch):
    """4 ranks as 2 emulated nodes x 2, stage 3 with qwz,hpz,qgz: it learns, and each step's metrics
    record the bytes that crossed the nodes (codes and scales): the full figure (the forward's qwZ
    gathers + qgZ) after a step that updated, and qgZ's alone after a skipped one (fp16 overflow: the
    params did not change, so the secondary shard still holds them and the forward gathers from it)."""
    if comm.size != 4:
        pytest.skip("the smoke run is 4 ranks in 2 emulated nodes")
    import json
    import os

    from test_train import TINY, _text

    from ringzero.app.train import parse_config, run
    monkeypatch.setenv("RINGZERO_EMULATE_NODES", "2")
    d = comm.bcast(str(tmp_path_factory.mktemp("zpptrain")) if comm.rank == 0 else None)
    data = comm.bcast(_text(os.path.join(d, "corpus.txt")) if comm.rank == 0 else None)
    metrics = os.path.join(d, "m.jsonl")
    cfg, _ = parse_config(TINY + ["--data", data, "--stage", "3", "--steps", "30", "--lr", "1e-2", "--warmup", "5",
                                  "--eval-interval", "0", "--metrics", metrics, "--zeropp", "qwz,hpz,qgz",
                                  "--zeropp-block", "256"])
    summary = run(cfg, comm)
    ok, msg = True, ""
    if comm.rank == 0:
        lines = [json.loads(ln) for ln in open(metrics)]
        steps, summ = lines[:-1], lines[-1]
        net = [s["bytes_sent_internode"] for s in steps]
        first, last = np.mean([s["loss"] for s in steps[:5]]), np.mean([s["loss"] for s in steps[-5:]])
        tr = summ["traffic"]
        full = [net[i] for i in range(30) if i == 0 or not steps[i - 1]["skipped"]]
        rs = [net[i] for i in range(1, 30) if steps[i - 1]["skipped"]]
        ok = len(steps) == 30 and last < 0.9 * first and len(set(full)) == 1 and len(set(rs)) <= 1
        ok &= not rs or 0 < rs[0] < 0.5 * full[0]
        ok &= tr["nodes"] == 2 and net[-1] == tr["measured_internode_bytes_per_step"]
        ok &= tr["zeropp_measured_psi"] < 0.3 * 3       # the unquantized step sends 3 of these units
        msg = f"loss {first:.3f} -> {last:.3f}, internode {net}, skipped {[s['skipped'] for s in steps]}, {tr}"
    assert_all(comm, ok, msg)
    assert summary["eval_loss"] < summary["unigram_entropy"]


# ------------------------------------------------------------------ a device run (the CuPy stand-in)
def _device_run(comm, cp, spec, **kw):
    eng = engine(comm, "3", precision="fp32", device="cuda", nodes=labels_of(comm.size), zeropp=policy(spec, **kw))
    data, losses = batches(comm, comm.size, comm.rank), []
    for s in range(4):
        x, y = data.get(s)
        losses.append(eng.step(cp.asarray(x), cp.asarray(y), 3e-3).loss)
    return losses, eng.full_state("master")


@pytest.mark.mpi
@pytest.mark.standin
def test_device_run(comm, monkeypatch):
    """--device cuda under the strict CuPy stand-in (tests/cupy_standin/): the switches' device path
    (the collectives' CUDA kernels, staging through pinned host memory, hpZ's device secondary shard)
    runs; hpZ changes no bit there either; the run follows the host run (fp32, both computing in
    float32; the device's AdamW and kernels round differently from the host's C pass, and the BLAS under
    the stand-in picks its kernels by CPU: within 1e-5 relative after 4 steps, where qgZ's own error moves
    the loss by ~1e-3; 2.3e-6 was seen on an AVX-512 EPYC)."""
    import os
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    import cupy_standin
    _, host, _ = run(comm, "qwz,hpz,qgz", precision="fp32", error_feedback=True)
    cp = cupy_standin.install(monkeypatch)
    dev, _ = _device_run(comm, cp, "qwz,hpz,qgz", error_feedback=True)
    a, ma = _device_run(comm, cp, "qwz")
    b, mb = _device_run(comm, cp, "qwz,hpz")
    assert_all(comm, np.allclose(dev, host, rtol=1e-5, atol=0), f"device {dev} vs host {host}")
    assert_all(comm, a == b and np.array_equal(ma, mb), f"device qwz {a} vs qwz,hpz {b}")


@pytest.mark.mpi
def test_no_allocation_after_the_first_steps(comm):
    """The switches' buffers (hpZ's shard, qgZ's residual, the collectives' scratch) are made once, and
    a step keeps nothing: after 10 steps of warm-up, 10 more grow traced memory by less than 24 KiB and
    move no buffer. Counted after a gc.collect() (what is kept, not cyclic garbage the collector has yet
    to visit) over steps 20-30 and 30-40, the lesser of the two: the Ring's plan cache (an LRU, bounded)
    is still filling in the first 10-20 steps (at n = 8 it adds ~40 KB over the first 50 steps, most in
    the first 10, and then nothing in 350 more), and how many of a step's started calls are still
    listed at its end depends on the machine's load (a CI run at n = 8 read 16.6 KB over 10-20 and
    26.9 KB over 20-30; run alone, ~6 KB and ~3 KB over 20-30 and 30-40). A leak grows every window
    alike: the started calls' Pendings that the progress thread's list once kept (~5.5 KB a step at
    n = 8) gave ~55 KB in each."""
    import gc
    import tracemalloc
    eng = engine(comm, "3", nodes=labels_of(comm.size), zeropp=policy("qwz,hpz,qgz", error_feedback=True))
    data = batches(comm, comm.size, comm.rank)
    train(eng, data, 10)
    zpp = eng.topology.zeropp
    ptrs = (zpp.secondary.ctypes.data, zpp.residual.ctypes.data,
            sorted((k, v.ctypes.data) for k, v in zpp.qc._ws.items()))
    tracemalloc.start()
    at = []
    for s in range(10, 41):
        if s in (10, 20, 30, 40):
            gc.collect()
            at.append(tracemalloc.get_traced_memory()[0])
        if s < 40:
            eng.step(*data.get(s), 1e-3)
    tracemalloc.stop()
    first, grown = at[1] - at[0], min(at[2] - at[1], at[3] - at[2])
    now = (zpp.secondary.ctypes.data, zpp.residual.ctypes.data,
           sorted((k, v.ctypes.data) for k, v in zpp.qc._ws.items()))
    assert_all(comm, now == ptrs and grown < 24 * 1024,
               f"moved: {now != ptrs}; grew {at[2] - at[1]} B over steps 20-30 and {at[3] - at[2]} B over 30-40 "
               f"({first} B over 10-20)")
