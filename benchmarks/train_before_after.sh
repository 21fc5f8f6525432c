#!/usr/bin/env bash
# The main job (`mpirun -n 8 python -m ringzero.train`) of this tree against the same job
# of an older commit, alternated in one run, on the same venv and mpirun flags.
#   benchmarks/train_before_after.sh REV [ROUNDS] [-- flags for ringzero.train]
#   benchmarks/train_before_after.sh fb351df 1            # the default 400 steps, once each
#   benchmarks/train_before_after.sh fb351df 2 -- --steps 60 --eval-interval 0
# The older tree is a git worktree under ${TMPDIR:-/tmp}/ringzero-REV with its C
# extensions built in place; `python -m ringzero.train` run from inside a tree imports
# that tree's package. Prints, per run, the training seconds and the final held-out
# loss the trainer reports, the load average before and after, then this tree's total
# over the older one's.
source "$(dirname "$0")/../launch/_env.sh"
source "$(dirname "$0")/_rev_tree.sh"
before_after_setup "train_before_after.sh REV [ROUNDS] [-- train flags]" "$@"
"$PY" -m ringzero.train --check 8 "${FLAGS[@]}" || exit $?
LOGS="$(mktemp -d)"
run_one() {   # tree label round [train flags]
    local tree="$1" label="$2" round="$3" l0 l1 secs loss
    shift 3
    local log="$LOGS/$label-$round.log"
    l0="$(cut -d' ' -f1 /proc/loadavg)"
    (cd "$tree" && timeout 1800 mpirun $(mpi_flags) -n 8 "$PY" -m mpi4py -m ringzero.train \
        --quiet --sample-chars 0 "$@" >"$log" 2>&1) \
        || { echo "train_before_after: the $label run failed:" >&2; tail -5 "$log" >&2; exit 1; }
    l1="$(cut -d' ' -f1 /proc/loadavg)"
    secs="$(grep -oE 'steps in [0-9.]+ s' "$log" | grep -oE '[0-9.]+ ' | tr -d ' ')"
    loss="$(grep -oE 'final held-out loss [0-9.]+' "$log" | grep -oE '[0-9.]+$')"
    echo "$label $round $secs $loss $l0 $l1"
}
{
    for r in $(seq 1 "$ROUNDS"); do
        run_one "$ROOT" this "$r" "${FLAGS[@]}"
        run_one "$OLD" "$REV" "$r" "${FLAGS[@]}"
    done
} | tee "$LOGS/table" | awk '{printf "%-8s round %s: %8.1f s of training, final held-out loss %s (load %s -> %s)\n", $1, $2, $3, $4, $5, $6}'
awk -v rev="$REV" '$1 == "this" {a += $3; la = $4} $1 != "this" {b += $3; lb = $4}
    END {r = b > 0 ? sprintf("%.3fx", a / b) : "no ratio (0 s)";
         printf "this tree / %s: %s the training time (%.1f s against %.1f s); final loss %s against %s (%+.2f%%)\n",
               rev, r, a, b, la, lb, 100 * (la - lb) / lb}' "$LOGS/table"
