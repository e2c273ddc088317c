# Sourced by deploy/install.sh and deploy/install-user.sh (which define `say` and `die`).
#
# ensure_venv PYTHON DIR HINT: a venv at DIR that has pip, made with PYTHON when there is
# none. A venv without pip (an earlier run stopped half-way, e.g. `python3 -m venv` on a
# Debian without python3-venv leaves bin/python and no pip) is made again with --clear;
# a directory that is not a venv (no pyvenv.cfg) is never cleared. HINT says how to get
# the venv module when PYTHON lacks it (root can apt-get it; a user asks for it).
ensure_venv() {
    local python=$1 dir=$2 hint=$3
    if [ -x "$dir/bin/python" ] && "$dir/bin/python" -m pip --version >/dev/null 2>&1; then
        return 0
    fi
    # Debian's python3 only suggests python3-venv: without it `-m venv` fails after it has
    # made half a venv, and ensurepip is what it lacks.
    if ! "$python" -c 'import ensurepip, venv' >/dev/null 2>&1; then
        die "$python cannot make a virtual environment (its ensurepip/venv modules are missing; on Debian and Ubuntu they are the python3-venv package): $hint"
    fi
    local clear=()
    if [ -e "$dir/pyvenv.cfg" ]; then
        clear=(--clear)
        say "the venv $dir has no pip (an earlier run stopped half-way); making it again"
    fi
    local out
    if ! out=$("$python" -m venv "${clear[@]}" "$dir" 2>&1); then
        die "$python -m venv $dir failed: $(printf '%s' "$out" | tail -n 3 | tr '\n' ' ')"
    fi
    say "created the venv $dir"
}
