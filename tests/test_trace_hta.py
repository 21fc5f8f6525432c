"""An independent reader of --trace: Holistic Trace Analysis (HTA) parses 2- and 4-rank traces and agrees with
``python -m ringzero.trace summary`` (skipped cleanly where ``holistictraceanalysis`` is not installed).

HTA is built around GPU kernels on streams; comm/trace.py presents the CPU run as a device (compute spans of
the main thread as kernels on stream 7, collectives as ncclKernel_* on stream 13, ProfilerStep#N per step).
Checked: HTA's computation/communication overlap (get_comm_comp_overlap) against summary's overlap, and
HTA's compute time (get_temporal_breakdown) against summary's compute over the recorded steps, within 5 %.
"""
import pytest
import trainer_cli as cli

pytest.importorskip("hta.trace_analysis")
from hta.trace_analysis import TraceAnalysis  # noqa: E402

from ringzero.tools import trace_summary as ts  # noqa: E402


@pytest.mark.parametrize("n", [2, 4])
def test_hta_reads_the_traces_and_agrees_with_summary(tmp_path, n):
    d = tmp_path / "t"
    args = cli.TINY + ["--steps", "6", "--trace-steps", "2:5", "--stage", "3", "--overlap", "--trace", str(d),
                       "--data", cli.corpus(tmp_path / "c.txt")]
    rcs, out, err = cli.run(args, tmp_path, n=n)
    assert rcs == {r: 0 for r in range(n)}, cli.tail(out, err)
    hta = TraceAnalysis(trace_dir=str(d), include_last_profiler_step=True)
    assert sorted(hta.t.traces) == list(range(n))
    docs = ts.load(str(d))
    ov = hta.get_comm_comp_overlap(visualize=False).set_index("rank")["comp_comm_overlap_pctg"] / 100
    tb = hta.get_temporal_breakdown(visualize=False).set_index("rank")["compute_time(us)"]
    bd = ts.breakdown(docs)
    for r, doc in enumerate(docs):
        ours = ts.overlap(doc)
        assert abs(ov[r] - ours) <= 0.05 * max(ours, 0.1), f"rank {r}: HTA overlap {ov[r]:.4f}, summary {ours:.4f}"
        comp = sum(rows[r]["compute"] for rows in bd.values())
        assert abs(tb[r] - comp) <= 0.05 * comp, f"rank {r}: HTA compute {tb[r]} µs, summary {comp:.0f} µs"
