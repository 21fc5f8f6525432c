#!/usr/bin/env bash
# The model's forward+backward alone in this tree and in an older commit's, alternated, on the
# same venv: the ratio that the main job's training-time ratio (train_before_after.sh) follows
# when every rank is compute-bound, each run beside its own GEMM floor.
#   benchmarks/model_before_after.sh REV [ROUNDS] [-- bench_model.py flags]
#   benchmarks/model_before_after.sh fb351df 3                  # width 128: the main job's model
#   benchmarks/model_before_after.sh fb351df 3 -- --n-embd 256
# Each run is this tree's benchmarks/bench_model.py (one BLAS thread, no torch, 20 repeats;
# it reads older trees through its ImportError fallbacks) with the tree under test first on
# PYTHONPATH, so it imports that tree's package. Prints per run the medians of fwd+bwd and of
# the GEMM floor (the same step's GEMMs alone, in the same process), their ratio and the load
# average before and after, then this tree's total over the older one's, each tree's mean
# ratio to its floor, and the quotient of those two: the host's speed drifts by 10-20 % between
# runs and moves a run's floor with it, so the quotient of the floor ratios is the steadier figure.
source "$(dirname "$0")/../launch/_env.sh"
source "$(dirname "$0")/_rev_tree.sh"
before_after_setup "model_before_after.sh REV [ROUNDS] [-- bench_model.py flags]" "$@"
BENCH="$ROOT/benchmarks/bench_model.py"
run_one() {   # tree label round
    local tree="$1" label="$2" round="$3" l0 l1 out ms floor
    l0="$(cut -d' ' -f1 /proc/loadavg)"
    out="$(cd "$tree" && PYTHONPATH="$tree" OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 900 \
           "$PY" "$BENCH" --n-embd 128 --no-torch --repeats 20 "${FLAGS[@]}" 2>&1)" \
        || { echo "model_before_after: the $label run failed:" >&2; echo "$out" | tail -5 >&2; exit 1; }
    l1="$(cut -d' ' -f1 /proc/loadavg)"
    ms="$(echo "$out" | awk '$1 == "ringzero" && $2 == "fwd+bwd:" {print $4}')"
    floor="$(echo "$out" | awk '$1 == "gemm-floor" && $2 == "fwd+bwd:" {print $4}')"
    [ -n "$ms" ] && [ -n "$floor" ] \
        || { echo "model_before_after: no medians in the $label run:" >&2; echo "$out" | tail -5 >&2; exit 1; }
    echo "$label $round $ms $floor $l0 $l1"
}
{
    for r in $(seq 1 "$ROUNDS"); do
        run_one "$ROOT" this "$r"
        run_one "$OLD" "$REV" "$r"
    done
} | awk -v rev="$REV" '
    { printf "%-8s round %s: fwd+bwd %7.1f ms, GEMM floor %7.1f ms, %.2fx the floor (load %s -> %s)\n",
             $1, $2, $3, $4, $3 / $4, $5, $6 }
    $1 == "this" {a += $3; fa += $3 / $4; na++} $1 != "this" {b += $3; fb += $3 / $4; nb++}
    END {if (na && nb) printf "this tree / %s: %.3fx the fwd+bwd time (%.1f ms against %.1f ms); " \
                              "%.2fx and %.2fx their GEMM floors, %.3fx of each other\n",
                              rev, a / b, a, b, fa / na, fb / nb, (fa / na) / (fb / nb)}'
