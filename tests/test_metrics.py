"""The metrics writer (ringzero/metrics.py): each line reaches the file when written.

Not the trainer's records (tests/test_train.py): only the writer's buffering, read back
by a second, independent file handle while the writer is still open."""
from ringzero.metrics import MetricsWriter, read_metrics


def test_each_step_line_is_on_disk_while_the_writer_is_open(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(str(path)) as w:
        for step in range(3):
            w.step(step=step, loss=1.0 + step, lr=0.1, loss_scale=1.0, grad_norm=0.5, tokens_per_s=1.0,
                   step_time_s=0.1, bytes_sent=10, skipped=False)
            with open(path) as fh:            # another reader, as `tail -f` is
                lines = fh.read().splitlines()
            assert len(lines) == step + 1, f"expected {step + 1} lines on disk after step {step}, got {len(lines)}"
        w.summary({"params": 1})
        steps, summ = read_metrics(str(path))
        assert [s["step"] for s in steps] == [0, 1, 2] and summ == {"summary": True, "params": 1}
