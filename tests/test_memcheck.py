"""The trainer's memory check and allocation failures, under a limit the kernel enforces (prlimit --data).

Each case is a real ``mpirun -n N prlimit --data=... python -m mpi4py -m ringzero.train``
(or the shell's ``ulimit -d`` where prlimit cannot run: limits.data_limit_prefix) job (trainer_cli
reads every rank's own exit code):
- the issue's case: stage 0 of an 8 x 512 GPT at Nd = 4 under 500M per rank is refused in one line with
  both numbers and a hint; the run the hint names then trains under the same limit (the kernel is the
  judge of the estimate, not the code under test);
- the same run with the check off (--no-mem-check): the allocation fails in the kernel, and each rank it
  fails on prints one line naming the buffer, its bytes and the limit, exit 4, no traceback.
Serial (each job starts its own mpirun).
"""
import re
import subprocess

import trainer_cli as cli

from ringzero.runtime import limits
from ringzero.sizes import parse_size

MODEL = ["--n-layer", "8", "--n-head", "8", "--n-embd", "512", "--seq-len", "32", "--batch", "2",
         "--eval-batches", "1", "--sample-chars", "0", "--quiet", "--eval-interval", "0", "--warmup", "1"]
LIMIT = "500M"

def _run(args, tmp_path, n):
    cmd = cli.command(args, n)
    i = cmd.index("sh")                     # each rank: prlimit --data=... (or ulimit -d) sh -c 'python ...'
    cmd[i:i] = limits.data_limit_prefix(parse_size(LIMIT))
    p = subprocess.Popen(cmd, cwd=tmp_path, env=cli._clean_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    return cli.finish(p)


def test_refused_up_front_then_the_hint_trains(tmp_path):
    data = cli.corpus(tmp_path / "corpus.txt")
    base = MODEL + ["--data", data, "--steps", "2"]
    rcs, out, err = _run(base + ["--stage", "0"], tmp_path, 4)
    assert rcs == {r: 2 for r in range(4)}, cli.tail(out, err)
    ours = [ln for ln in err.splitlines() if ln.startswith("ringzero")]
    assert len(ours) == 1 and "Traceback" not in err + out, cli.tail(out, err)
    line = ours[0]
    m = re.search(r"stage 0 needs ([\d,.]+) MiB per rank .* RLIMIT_DATA leaves ([\d,.]+) MiB "
                  r"\(limit 500\.0 MiB, ([\d,.]+) MiB in use\)", line)
    assert m, line
    need, room, used = (float(g.replace(",", "")) for g in m.groups())
    assert need > room and abs(room + used - 500) < 0.2, line
    hint = re.search(r"HINT: (.*?) fits", line)
    assert hint and "nodes" not in hint.group(1), line
    flags = hint.group(1).split()
    rcs, out, err = _run(base + ["--stage", "0"] + flags, tmp_path, 4)
    assert rcs == {r: 0 for r in range(4)}, f"the hint {flags} did not train under {LIMIT}:\n" + cli.tail(out, err)


def test_allocation_failure_one_line_per_rank(tmp_path):
    data = cli.corpus(tmp_path / "corpus.txt")
    rcs, out, err = _run(MODEL + ["--data", data, "--steps", "2", "--stage", "0", "--no-mem-check"], tmp_path, 2)
    lines = [ln for ln in err.splitlines() if ln.startswith("ringzero")]
    assert lines and "Traceback" not in err + out, cli.tail(out, err)
    assert set(rcs.values()) <= {4} and 4 in rcs.values(), cli.tail(out, err)   # others: ended by mpirun
    for ln in lines:
        assert re.match(r"ringzero\.train: error: rank \d: cannot allocate ((params|grads|master|adam_m|adam_v) "
                        r"\([\d,]+ x float(16|32)\)|the initial weights .*?): [\d,.]+ MiB \([\d,]+ B\); "
                        r"RLIMIT_DATA leaves", ln), ln
        assert "limit 500.0 MiB" in ln
