"""ringzero's GPU code paths under the strict CuPy stand-in (tests/cupy_standin/).

What these prove: every CuPy call ringzero makes is one CuPy accepts (no
``flags.writeable``, no implicit NumPy conversion, no NumPy operand in a
kernel, the stream synchronized before MPI sees a device buffer, async
``set`` not raced), and the device paths compute what the host paths do:
the Ring staged and device-direct bitwise against the NumPy Ring, the
engine on "cuda" at stages 0-3 and hybrid bitwise against the CPU engine,
the trainer and a checkpoint save/resume. What they do not prove: anything
about a real GPU's numerics or speed (see README, "GPU").
"""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import cupy_standin  # noqa: E402
from conftest import assert_all  # noqa: E402

pytestmark = pytest.mark.standin


@pytest.fixture
def cp(monkeypatch):
    return cupy_standin.install(monkeypatch)


# ---------------------------------------------------------------- the stand-in itself
def test_standin_is_as_strict_as_cupy(cp):
    a = cp.arange(6, dtype=cp.float32)
    assert not hasattr(a.flags, "writeable")
    with pytest.raises(KeyError):
        a.flags["WRITEABLE"]
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(a)
    for bad in (lambda: a + np.ones(6, np.float32), lambda: np.add(a, np.ones(6, np.float32)),
                lambda: a.__setitem__(slice(None), np.ones(6, np.float32)),
                lambda: cp.add(a, a, out=np.empty(6, np.float32))):
        with pytest.raises(TypeError, match="Unsupported type"):
            bad()
    with pytest.raises(TypeError, match="cannot be set"):
        a.set(np.zeros(6, np.float64))
    with pytest.raises(ValueError, match="Shape mismatch"):
        a.get(out=np.empty(5, np.float32))
    with pytest.raises(RuntimeError, match="unsynchronized"):
        a.__cuda_array_interface__                  # the arange kernel is still "in flight"
    cp.cuda.get_current_stream().synchronize()
    assert a.__cuda_array_interface__["data"][0] == a.data.ptr


def test_standin_set_is_async(cp):
    """set() from pinned memory reads the host array when the stream runs, as a DMA does."""
    import cupyx
    d = cp.zeros(4, cp.float32)
    h = cupyx.empty_pinned(4, np.float32)
    h[:] = 1
    d.set(h)
    h[:] = 7                                        # too early: the copy has not run yet
    assert d.get().tolist() == [7.0] * 4
    d.set(np.full(4, 2, np.float32))
    cp.cuda.get_current_stream().synchronize()
    assert d.get().tolist() == [2.0] * 4


def test_standin_freed_pinned_memory_is_pageable(cp):
    """Freed pinned memory is pinned no more (cudaFreeHost unpins): the NumPy array malloc puts at
    its address next is pageable, so ``set`` copies it before returning, as CUDA does, and the
    pointer's attributes say unregistered. (A stand-in that remembered dead pinned ranges turned
    --init-from's pageable staging buffer, reused at once, into an async DMA: every piece it set
    got the bytes of the last one, at 4 and 8 ranks, after other tests had freed pinned buffers.)"""
    import gc

    import cupyx
    rt = cp.cuda.runtime
    d = cp.zeros(1024, cp.float32)
    for _ in range(20):
        h = cupyx.empty_pinned(1024, np.float32)
        p = h.ctypes.data
        assert rt.pointerGetAttributes(p).type == rt.memoryTypeHost
        del h
        gc.collect()
        assert rt.pointerGetAttributes(p).type == rt.memoryTypeUnregistered
        a = np.empty(1024, np.float32)             # pageable; malloc hands it p again, mostly at once
        if a.ctypes.data == p:
            break
    else:
        pytest.skip("malloc did not reuse a freed pinned buffer's address in 20 tries")
    a[:] = 1
    d.set(a)
    a[:] = 7                                        # a pageable source may be reused at once
    cp.cuda.get_current_stream().synchronize()
    assert d.get().tolist() == [1.0] * 1024


def test_standin_gemm_strided_batched_is_column_major(cp):
    """The cuBLAS emulation against NumPy: row-major C = A @ B^T via cuBLAS(B, A) with transa=T."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4, 5)), rng.standard_normal((3, 6, 5))
    da, db, dc = cp.asarray(a), cp.asarray(b), cp.empty((3, 4, 6), cp.float64)
    one, zero = np.ones(1), np.zeros(1)
    blas = cp.cuda.cublas
    blas.gemmStridedBatchedEx(cp.cuda.get_cublas_handle(), blas.CUBLAS_OP_T, blas.CUBLAS_OP_N, 6, 4, 5,
                              one.ctypes.data, db.data.ptr, 1, 5, 30, da.data.ptr, 1, 5, 20,
                              zero.ctypes.data, dc.data.ptr, 1, 6, 24, 3, blas.CUBLAS_COMPUTE_64F,
                              blas.CUBLAS_GEMM_DEFAULT)
    np.testing.assert_allclose(dc.get(), a @ b.transpose(0, 2, 1), rtol=1e-13)
    with pytest.raises(RuntimeError, match="outside any live device allocation"):
        blas.gemmStridedBatchedEx(1, 1, 0, 6, 4, 5, one.ctypes.data, db.data.ptr, 1, 5, 30, da.data.ptr,
                                  1, 5, 20, zero.ctypes.data, dc.data.ptr, 1, 6, 24, 4,
                                  blas.CUBLAS_COMPUTE_64F, -1)


def _on_thread(fn):
    """fn() on a new thread (its own current stream and device, as in CUDA); what it raised, or None."""
    import threading
    out = []

    def run():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (handed back to the test)
            out.append(e)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0] if out else None


def test_standin_orders_streams_by_events(cp):
    """Another thread's stream may hand a buffer to MPI only after waiting for its writer's event."""
    a = cp.zeros(8, cp.float32)
    cp.cuda.get_current_stream().synchronize()
    a[:] = 3                                        # a kernel on this thread's stream, not done
    ev = cp.cuda.Event()
    ev.record(cp.cuda.get_current_stream())
    s = cp.cuda.Stream(non_blocking=True)

    def unordered():
        with s:
            s.synchronize()
            a.__cuda_array_interface__

    def ordered():
        with s:
            s.wait_event(ev)
            s.synchronize()
            a.__cuda_array_interface__
    err = _on_thread(unordered)
    assert isinstance(err, RuntimeError) and "another stream" in str(err)
    assert _on_thread(ordered) is None
    assert a.__cuda_array_interface__           # this stream: done through the other's wait


def test_standin_device_is_per_thread(cp, monkeypatch):
    """A thread starts on device 0, as in CUDA: a kernel on device 1's arrays needs Device(1) there."""
    monkeypatch.setenv("RINGZERO_STANDIN_DEVICES", "2")
    with cp.cuda.Device(1):
        a = cp.ones(4, cp.float32)
        err = _on_thread(lambda: cp.add(a, a, out=a))
        assert isinstance(err, ValueError) and "device" in str(err)

        def on_one():
            with cp.cuda.Device(1):
                cp.add(a, a, out=a)
        assert _on_thread(on_one) is None


# ---------------------------------------------------------------- the Ring
def _data(rank, L, dtype, seed=0):
    rng = np.random.default_rng(seed + 97 * rank)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-1000, 1000, L).astype(dtype)
    return rng.standard_normal(L).astype(dtype)


@pytest.mark.mpi
@pytest.mark.parametrize("aware", ["0", "1"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "int64"])
def test_ring_device_paths_bitwise_equal_host(comm, cp, monkeypatch, aware, dtype):
    """Staged (aware=0) and device-direct (aware=1: mpi4py takes the buffer
    through __cuda_array_interface__) give the NumPy Ring's bits; the NumPy
    Ring is checked against MPI's own sum in test_collectives."""
    from ringzero.comm.ring import Ring
    monkeypatch.setenv("RINGZERO_CUDA_AWARE", aware)
    n, r = comm.size, comm.rank
    bad = []
    for small in (0, 1 << 40):                      # ring schedule, then halving/doubling
        dev, host = Ring(comm), Ring(comm)
        for ring in (dev, host):
            ring.small_bytes = ring.tree_bytes = small
            ring.seg_bytes = 256                    # several segments per block
        for m in (0, 1, 7, 301):
            L = n * m + (r == 0 and 0)
            h = _data(r, L + 3, dtype)
            d = cp.asarray(h)
            dev.all_reduce(d)
            host.all_reduce(h)
            if not np.array_equal(d.get().view(np.uint8), h.view(np.uint8)):
                bad.append(f"all_reduce m={m} small={small}")
            if dtype != "int64":
                h = _data(r, L, dtype, 1)
                d = cp.asarray(h)
                dev.all_reduce(d, op="avg")
                host.all_reduce(h, op="avg")
                if not np.array_equal(d.get().view(np.uint8), h.view(np.uint8)):
                    bad.append(f"avg m={m}")
            hs = _data(r, L, dtype, 2)
            hp, dp = np.empty(m, dtype), cp.empty(m, dtype)
            dev.reduce_scatter(cp.asarray(hs), dp)
            host.reduce_scatter(hs, hp)
            hf, df = np.empty(L, dtype), cp.empty(L, dtype)
            dev.all_gather(dp, df)
            host.all_gather(hp, hf)
            if not (np.array_equal(dp.get().view(np.uint8), hp.view(np.uint8))
                    and np.array_equal(df.get().view(np.uint8), hf.view(np.uint8))):
                bad.append(f"RS/AG m={m} small={small}")
            # in place: recv is block `rank` of send
            d = cp.asarray(hs)
            dev.reduce_scatter(d, d[r * m:(r + 1) * m])
            if not np.array_equal(d[r * m:(r + 1) * m].get().view(np.uint8), hp.view(np.uint8)):
                bad.append(f"RS in place m={m}")
        staged = dev.staging.growths > 0
        if staged != (aware == "0"):
            bad.append(f"staging used: {staged}")
        for ring in (dev, host):
            ring.free()
    assert_all(comm, not bad, f"aware={aware} {dtype}: {bad}")


@pytest.mark.mpi
@pytest.mark.parametrize("aware", ["0", "1"])
def test_ring_started_calls_keep_the_callers_stream_order(comm, cp, monkeypatch, aware):
    """Started calls on device buffers, made while the caller's stream still has the producing
    kernels in flight and given more kernels before the wait, on a second device: the bits of
    the NumPy Ring; the call ran on the Ring's own stream, and the caller's stream waited for it."""
    from ringzero.comm.ring import Ring
    monkeypatch.setenv("RINGZERO_CUDA_AWARE", aware)
    monkeypatch.setenv("RINGZERO_STANDIN_DEVICES", "2")
    n, r = comm.size, comm.rank
    bad = []
    with cp.cuda.Device(1):
        dev, host = Ring(comm), Ring(comm)
        for m in (1, 301):
            L = n * m
            hs, ha = _data(r, L, "float32", 4), _data(r, L, "float32", 5)
            ds, da, dp, df = cp.zeros(L, cp.float32), cp.zeros(L, cp.float32), cp.empty(m, cp.float32), \
                cp.empty(L, cp.float32)
            other = cp.zeros(L, cp.float32)
            for _ in range(3):                      # the first two calls build and keep the plans
                cp.cuda.get_current_stream().synchronize()
                ds[...] = cp.asarray(hs)            # producers, still "in flight" at the start
                da[...] = cp.asarray(ha)
                p1 = dev.all_reduce_start(da)
                p2 = dev.reduce_scatter_start(ds, dp)
                other += 1                          # the caller's compute, queued after the starts
                p1.wait()
                p2.wait()
                me = cp.cuda.get_current_stream()
                if not any(src is dev._order.stream for _, src, _ in me._waits):
                    bad.append("the caller's stream did not wait for the Ring's")
                dev.all_gather_start(dp, df).wait()
            hp, hf = np.empty(m, np.float32), np.empty(L, np.float32)
            host.all_reduce(ha)
            host.reduce_scatter(hs, hp)
            host.all_gather(hp, hf)
            for name, d, h in (("all_reduce", da, ha), ("reduce_scatter", dp, hp), ("all_gather", df, hf)):
                if not np.array_equal(d.get().view(np.uint32), h.view(np.uint32)):
                    bad.append(f"{name} m={m}")
        if dev._order is None or dev._order.stream._queued == 0 or dev._order.device.id != 1:
            bad.append("the started calls did not run on the Ring's stream on device 1")
        for ring in (dev, host):
            ring.free()
    assert_all(comm, not bad, f"aware={aware}: {bad}")


@pytest.mark.mpi
def test_ring_mixing_host_and_device_is_type_error(comm, cp):
    from ringzero.comm.ring import Ring
    ring = Ring(comm)
    try:
        with pytest.raises(TypeError, match="all NumPy or all CuPy"):
            ring.all_gather(np.zeros(2, np.float32), cp.zeros(2 * comm.size, cp.float32))
    finally:
        ring.free()


# ---------------------------------------------------------------- the engine
TINY = dict(n_layer=2, n_head=2, n_embd=24, block_size=16, vocab=37)


def _batches(comm, n_world):
    from ringzero.app.data import Batches
    data = (np.arange(4096) * 7 % TINY["vocab"]).astype(np.uint8)
    return Batches(data, 2, 16, comm.rank, n_world, 5)


def _run(comm, stage, device, steps=3, precision="fp32", **kw):
    """Losses and the gathered master weights of a few steps on `device`."""
    from ringzero.comm.backend import xp_for
    from ringzero.nn.gpt import GPT, GPTConfig
    from ringzero.runtime.zero import Zero
    eng = Zero(GPT(GPTConfig(**TINY)), comm, stage, device=device, precision=precision, seed=3,
               timeout=60, **kw)
    xp = xp_for(device)
    data = _batches(comm, comm.size)
    losses = []
    for s in range(steps):
        x, y = data.get(s)
        res = eng.step(xp.asarray(x), xp.asarray(y), 3e-3)
        losses.append((res.loss, res.grad_norm, res.skipped))
    return losses, eng.full_state("master"), eng


@pytest.fixture
def same_host_arithmetic(monkeypatch):
    """The CPU reference uses the device's embedding-gradient sum (NumPy's
    default np.add.at differs from it in the last bits; see test_layers). The
    elementwise passes are the host's C kernels against the device's CuPy
    kernels (the same order of operations: tests/test_fused_cuda.py); where
    either cannot be built, both sides take the xp formulas. The host's 2-D
    GEMMs run in numpy.matmul, the stand-in's library, also where
    RINGZERO_BLAS picks MKL (a real device's cuBLAS matches neither)."""
    from cupy_standin import _kernel

    from ringzero.nn import fused, gemm, layers
    monkeypatch.setattr(layers.Embedding, "grad_sum", "segmented")
    monkeypatch.setattr(gemm, "_state", {"lib": None, "name": "numpy"})
    if not (fused.HAVE_C and fused._cuda is not None and _kernel.have_compiler()):
        monkeypatch.setattr(fused, "_c", None)
        monkeypatch.setattr(fused, "_cuda", None)


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [None, True], ids=["default", "overlap"])
@pytest.mark.parametrize("stage", ["0", "1", "2", "3", "hybrid"])
def test_engine_cuda_bitwise_equals_cpu(comm, cp, same_host_arithmetic, stage, overlap):
    """fp32: the device path does the host path's arithmetic, bit for bit; with overlap its
    collectives run on the progress thread's stream (and the CPU reference stays blocking)."""
    kw = {"ranks_per_node": 1 if comm.size % 2 else 2} if stage == "hybrid" else {}
    if stage == "hybrid" and comm.size == 1:
        kw = {"ranks_per_node": 1}
    l_gpu, m_gpu, eng = _run(comm, stage, "cuda", overlap=overlap, **kw)
    l_cpu, m_cpu, _ = _run(comm, stage, "cpu", **kw)
    same = l_gpu == l_cpu and np.array_equal(m_gpu.view(np.uint32), m_cpu.view(np.uint32))
    assert_all(comm, same, f"stage {stage}: cuda {l_gpu[-1]} vs cpu {l_cpu[-1]}")
    from ringzero.nn import fused, fused_cuda
    assert_all(comm, fused._cuda is None or len(fused_cuda._KERNELS) >= 8,
               f"the device run used only these kernels: {sorted(fused_cuda._KERNELS)}")
    assert_all(comm, eng.ring.scratch_growths + eng.ring.staging.growths > 0 or comm.size == 1,
               "the device run never touched the ring")


@pytest.mark.mpi
def test_engine_cuda_fp16_stages_bitwise_equal(comm, cp):
    """fp16 on the device (fp16 compute, fp32 gradient workspace): stages 0-3 give the same bits."""
    runs = {st: _run(comm, st, "cuda", steps=3, precision="fp16")[:2] for st in ("0", "1", "2", "3")}
    l0, m0 = runs["0"]
    bad = [st for st, (loss, m) in runs.items()
           if loss != l0 or not np.array_equal(m.view(np.uint32), m0.view(np.uint32))]
    assert_all(comm, not bad and all(np.isfinite(x[0]) for x in l0), f"stages differing from 0: {bad}")


@pytest.mark.mpi
def test_checkpoint_save_resume_on_device(comm, cp, tmp_path_factory):
    """Save after 2 steps, resume into a fresh device engine, 2 more steps == 4 straight steps."""
    from ringzero.nn.gpt import GPT, GPTConfig
    from ringzero.runtime import checkpoint as ck
    from ringzero.runtime.zero import Zero
    d = comm.bcast(str(tmp_path_factory.mktemp("ck")) if comm.rank == 0 else None)
    data = _batches(comm, comm.size)

    def steps(eng, a, b):
        return [eng.step(cp.asarray(data.get(s)[0]), cp.asarray(data.get(s)[1]), 3e-3).loss for s in range(a, b)]
    straight = Zero(GPT(GPTConfig(**TINY)), comm, "3", device="cuda", seed=3, timeout=60)
    want = steps(straight, 0, 4)
    first = Zero(GPT(GPTConfig(**TINY)), comm, "3", device="cuda", seed=3, timeout=60)
    steps(first, 0, 2)
    ck.save(first, d, 2)
    again = Zero(GPT(GPTConfig(**TINY)), comm, "3", device="cuda", seed=99, timeout=60)
    ck.load(again, os.path.join(d, ck.step_dir_name(2)))
    got = steps(again, 2, 4)
    same = got == want[2:] and np.array_equal(again.full_state("master"), straight.full_state("master"))
    assert_all(comm, same, f"resumed {got} vs straight {want[2:]}")


@pytest.mark.mpi
def test_trainer_runs_on_device(comm, cp, tmp_path_factory):
    """python -m ringzero.train --device cuda, a few steps, through run()."""
    from ringzero.app import train
    d = comm.bcast(str(tmp_path_factory.mktemp("tr")) if comm.rank == 0 else None)
    cfg, _ = train.parse_config(["--device", "cuda", "--steps", "3", "--n-layer", "1", "--n-embd", "32",
                                 "--n-head", "2", "--seq-len", "16", "--batch", "2", "--eval-interval", "0",
                                 "--eval-batches", "1", "--sample-chars", "8", "--quiet", "--stage", "3",
                                 "--save-every", "2", "--save-dir", d])
    summ = train.run(cfg, comm)
    assert_all(comm, np.isfinite(summ["train_loss"]) and np.isfinite(summ["eval_loss"]), str(summ))


@pytest.mark.mpi
@pytest.mark.parametrize("stage", ["0", "3"])
def test_engine_device_pool_does_not_grow_after_step_one(comm, cp, stage):
    """The caching pool's high-water mark is reached in step 1 (the gpu-check target:
    0 bytes of growth after step 1); per-step temporaries are reused blocks."""
    from ringzero.nn.gpt import GPT, GPTConfig
    from ringzero.runtime.zero import Zero
    eng = Zero(GPT(GPTConfig(**TINY)), comm, stage, device="cuda", seed=3, timeout=60)
    data = _batches(comm, comm.size)
    highs = []
    for s in range(4):
        x, y = data.get(s)
        eng.step(cp.asarray(x), cp.asarray(y), 3e-3)
        highs.append(cp.get_default_memory_pool().total_bytes())
    assert_all(comm, highs[1:] == [highs[0]] * 3, f"pool high-water per step {highs}")


def test_device_fp16_gradients_accumulate_in_fp32(cp):
    """Item 5: on the device (fp16 compute) a unit's gradient is summed in an fp32
    workspace and rounded to fp16 once: the engine's fp16 gradient equals the model's
    gradient accumulated in fp32 (loss_and_grad into an fp32 buffer) cast once."""
    from mpi4py import MPI

    from ringzero.nn.gpt import GPT, GPTConfig
    from ringzero.runtime.zero import Zero
    eng = Zero(GPT(GPTConfig(**TINY)), MPI.COMM_SELF, "0", device="cuda", seed=3, timeout=60)
    assert eng.work["grad_compute"][0].dtype == np.float32
    x, y = _batches(MPI.COMM_SELF, 1).get(0)
    eng.forward_backward(cp.asarray(x), cp.asarray(y))
    got = eng.state.grads.get()
    L = eng.layout
    g = cp.zeros(L.padded, np.float32)
    GPT(GPTConfig(**TINY)).loss_and_grad(L.views(eng.state.params), L.views(g), cp.asarray(x), cp.asarray(y),
                                         scale=eng.scaler.scale)
    want = g.get().astype(np.float16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.mpi
def test_engine_device_step_blocks_on_the_device_twice(comm, cp, monkeypatch):
    """Item 4: a device step reads the device from the host twice (the loss and the
    per-piece squared norms, one copy), whatever the number of units or pieces: no
    token range reductions, no float(dot) per unit per piece. (Device-direct ring,
    so the staged path's copies are not counted.)"""
    import cupy_standin

    from ringzero.nn.gpt import GPT, GPTConfig
    from ringzero.runtime.zero import Zero
    monkeypatch.setenv("RINGZERO_CUDA_AWARE", "1")
    reads = {}
    for n_layer in (1, 3):
        eng = Zero(GPT(GPTConfig(**{**TINY, "n_layer": n_layer})), comm, "0", device="cuda", seed=3, timeout=60)
        data = _batches(comm, comm.size)
        for s in range(2):
            x, y = data.get(s)
            x, y = cp.asarray(x), cp.asarray(y)
            before = cupy_standin.stats()["host_reads"]
            eng.step(x, y, 3e-3)
            reads[n_layer] = cupy_standin.stats()["host_reads"] - before
    assert_all(comm, reads == {1: 2, 3: 2}, f"device->host reads per step by n_layer: {reads}")


# ---------------------------------------------------------------- the trainer's checks
def test_check_device_cuda_without_cupy_is_one_line_exit_2():
    """`python -m ringzero.train --check 2 --device cuda` on a machine without a usable
    CuPy: exit 2 and one line, before any mpirun. (Where CuPy and a GPU are there: 0.)"""
    import subprocess

    from ringzero.comm.backend import cupy_or_none
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    p = subprocess.run([sys.executable, "-m", "ringzero.train", "--check", "2", "--device", "cuda"],
                       capture_output=True, text=True, timeout=120, env=env)
    if cupy_or_none() is not None:
        assert p.returncode == 0, p.stderr
        return
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "--device cuda" in lines[0] and "HINT" in lines[0], p.stderr


def test_check_device_cuda_passes_with_cupy(cp, capsys):
    from ringzero.app import train
    assert train.main(["--check", "2", "--device", "cuda", "--steps", "1"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.mpi
@pytest.mark.parametrize("stage", ["0", "3"])
def test_gpt2_import_on_device(comm, cp, tmp_path_factory, stage):
    """--init-from on "cuda": each master piece is read into the host staging buffer and set
    on the device (interop/hf_import.py), giving the host import's bits, at every world size (the
    host import is checked against transformers by test_hf_interop)."""
    from hf_files import write_gpt2

    from ringzero.interop.hf_import import HFSource
    from ringzero.nn.gpt import GPT
    from ringzero.runtime.zero import Zero
    d = comm.bcast(str(tmp_path_factory.mktemp("gpt2")) if comm.rank == 0 else None)
    if comm.rank == 0:
        write_gpt2(d, prefix=True)
    comm.Barrier()
    got = {}
    for device in ("cuda", "cpu"):
        src = HFSource(d)
        eng = Zero(GPT(src.cfg), comm, stage, device=device, precision="fp32", init=src.fill_master, timeout=60)
        src.close()
        got[device] = (eng.full_state("master"), src.error)
    (m_gpu, e_gpu), (m_cpu, e_cpu) = got["cuda"], got["cpu"]
    assert_all(comm, e_gpu is None and e_cpu is None and m_cpu.any()
               and np.array_equal(m_gpu.view(np.uint32), m_cpu.view(np.uint32)),
               f"stage {stage}: device import differs from the host's (errors: {e_gpu}, {e_cpu})")
