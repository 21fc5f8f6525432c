"""runtime/param_reads.py: stage 3's params piece read from its file on an I/O thread, ahead of the gather.

- every params read after a pass's first, from the second pass of a kind on, runs on the
  rz-offload-params thread (the reads of the file recorded by thread), and the run is bitwise the
  run in RAM (stage 3 and hybrid, K = 1 and 2 with overlap; the update blocking and running ahead);
- an eval (a forward alone) between steps records its own order and leaves the steps' alone; the
  memory report counts the staging buffer;
- a take of another unit than the one recorded reads it where it is taken, the right bytes, and
  stops reading ahead for that pass.
"""
import threading

import numpy as np
import pytest
from conftest import assert_all
from test_offload import CLASSES, engine, policy, run, skip_hybrid
from test_zero import batches

pytestmark = pytest.mark.mpi


def record_params_reads(monkeypatch):
    """[(thread name), ...] of every read of a params file from now on."""
    from ringzero.runtime.offload import FileStore
    seen, real = [], FileStore.read

    def read(self, start, out):
        if self.name == "params":
            seen.append(threading.current_thread().name)
        return real(self, start, out)
    monkeypatch.setattr(FileStore, "read", read)
    return seen


@pytest.mark.parametrize("stage", ["3", "hybrid"])
@pytest.mark.parametrize("ahead", [False, True], ids=["blocking", "ahead"])
@pytest.mark.parametrize("accum_overlap", [(1, False), (2, True)], ids=["k1-blocking", "k2-overlap"])
def test_params_reads_run_on_the_io_thread_and_stay_bitwise(comm, stage, ahead, accum_overlap, tmp_path,
                                                             monkeypatch):
    skip_hybrid(comm, stage)
    k, ov = accum_overlap
    kw = dict(precision="fp32", grad_accum=k, overlap=ov)      # fp32: every step updates
    ram = run(comm, stage, **kw)
    eng = engine(comm, stage, offload=policy(tmp_path, params=True, ahead=ahead), **kw)
    run(comm, stage, steps=1, eng=eng, **kw)                   # the first pass records the order
    pr = eng.workspaces.param_reads
    seen = record_params_reads(monkeypatch)
    before = pr.ahead, pr.now
    off = run(comm, stage, steps=2, start=1, eng=eng, **kw)
    monkeypatch.undo()
    ahead_n, now_n = pr.ahead - before[0], pr.now - before[1]
    passes = 2 * k                                             # 2 steps of K passes: one read now in each
    on_io = sum(1 for t in seen if t.startswith("rz-offload-params"))
    ok = (now_n == passes and ahead_n > passes and on_io == ahead_n and len(seen) >= ahead_n + now_n
          and off[0] == ram[0][1:] and off[2] == ram[2] and not off[4] and not ram[4])
    assert_all(comm, ok, f"stage {stage} ahead={ahead} K={k}: reads ahead {ahead_n}, now {now_n} ({passes} passes), "
                         f"on the I/O thread {on_io} of {len(seen)}; losses {off[0]} vs {ram[0][1:]}, classes equal "
                         f"{[off[2][c] == ram[2][c] for c in CLASSES]}; {off[4]}")
    eng.close()
    ram[3].close()


def test_an_eval_between_steps_keeps_both_orders(comm, tmp_path):
    kw = dict(precision="fp32")
    ram = run(comm, "3", **kw)
    eng = engine(comm, "3", offload=policy(tmp_path, params=True), **kw)
    data = batches(comm, comm.size, comm.rank)
    x, y = data.get(0)
    losses, evals = [], []
    for s in range(3):
        losses.append(eng.step(*data.get(s), 3e-3).loss)
        evals.append(eng.eval_loss(x, y))
    ram_evals = [ram[3].eval_loss(x, y)]
    pr = eng.workspaces.param_reads
    ok = losses == ram[0] and evals[-1] == ram_evals[0] and pr.ahead > 0 and set(pr._orders) == {"train", "forward"}
    # the memory report counts the staging buffer (one piece of the storage dtype) with the offload buffers
    staged = eng.memory_report()["offload_buffers"] - eng.offload_stream.nbytes()
    ok &= staged == max(eng.layout.piece_numel) * eng.state.params.dtype.itemsize
    assert_all(comm, ok, f"losses {losses} vs {ram[0]}, eval {evals[-1]} vs {ram_evals[0]}, ahead {pr.ahead}, "
                         f"staging counted {staged} B")
    eng.close()
    ram[3].close()


def test_another_unit_than_recorded_is_read_where_taken(comm, tmp_path):
    eng = engine(comm, "3", offload=policy(tmp_path, params=True), precision="fp32")
    pr, L = eng.workspaces.param_reads, eng.layout
    want = {w: L.unit_shard(eng.state.params, w).read() for w in range(len(L.units))}
    U = len(L.units)
    pr.begin("test")
    for w in range(U):                                 # records 0, 1, ..., U-1
        pr.take(w, np.empty(L.piece_numel[w], want[w].dtype))
    pr.begin("test")
    got, n0 = [], pr.now
    for w in (0, U - 1, 1):                            # 0 as recorded (1 is read ahead), then U-1: not recorded
        out = np.empty(L.piece_numel[w], want[w].dtype)
        pr.take(w, out)
        got.append(out.tobytes() == want[w].tobytes())
    ok = U >= 3 and all(got) and pr.now - n0 == 3 and pr._pending is None
    assert_all(comm, ok, f"U {U}, bytes right {got}, read now {pr.now - n0} of 3")
    eng.close()
