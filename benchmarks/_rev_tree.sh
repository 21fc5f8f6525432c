# Sourced by the *_before_after.sh benchmarks. Not meant to be run.
#   before_after_setup USAGE "$@"
#                   REV [ROUNDS] [-- FLAGS...] read into REV, ROUNDS and the array FLAGS, each
#                   checked (one line and exit 2: before the venv is made, so a typo costs no
#                   install), then ensure_venv, and OLD set to REV's worktree (rev_tree)
#   rev_check REV   one line and status 2 unless REV names a commit of the checkout
#   rev_tree REV    after ensure_venv: prints the path of a git worktree of REV under
#                   ${TMPDIR:-/tmp}/ringzero-<short sha>, made once, with its C extensions built in
#                   place by this venv's Python. Code run from inside that tree (or with it first on
#                   PYTHONPATH) imports that tree's package, not the checkout's.
rev_check() {
    git -C "$ROOT" rev-parse --verify -q "$1^{commit}" >/dev/null \
        || { echo "$(basename "$0" .sh): '$1' is not a commit of $ROOT" >&2; return 2; }
}

rev_tree() {
    local rev="$1" old
    rev_check "$rev" || return 2
    old="${TMPDIR:-/tmp}/ringzero-$(git -C "$ROOT" rev-parse --short "$rev")"
    if [ ! -d "$old" ]; then
        git -C "$ROOT" worktree add -f --detach "$old" "$rev" >/dev/null
        (cd "$old" && "$PY" setup.py -q build_ext --inplace >/dev/null 2>&1) \
            || echo "$(basename "$0" .sh): no C extensions built in $old (its NumPy fallbacks run)" >&2
    fi
    echo "$old"
}

before_after_setup() {
    local usage="$1"
    shift
    [ $# -ge 1 ] || { echo "usage: $usage" >&2; exit 2; }
    REV="$1"
    ROUNDS="${2:-1}"
    shift $(( $# >= 2 ? 2 : 1 ))
    [ "${1:-}" = "--" ] && shift
    FLAGS=("$@")
    case "$ROUNDS" in
        ''|*[!0-9]*|0) echo "$(basename "$0" .sh): ROUNDS must be an integer >= 1, got '$ROUNDS'" >&2; exit 2 ;;
    esac
    rev_check "$REV" || exit 2
    ensure_venv
    OLD="$(rev_tree "$REV")" || exit 2
}
