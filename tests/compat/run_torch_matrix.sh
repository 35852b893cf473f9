#!/usr/bin/env bash
# Opt-in: run the test suite against other torch releases, each in its own fresh venv.
#   tests/compat/run_torch_matrix.sh 2.6.0 2.9.1 2.14.1
# On x86_64 Linux, PyPI's torch before 2.13.0+cpu is a CUDA build: each venv takes 3-5 GB and a few
# minutes to install (the code runs on the CPU all the same). Prints one line per version.
set -uo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
[ $# -gt 0 ] || { echo "usage: $0 TORCH_VERSION..." >&2; exit 2; }
work=$(mktemp -d "${TMPDIR:-/tmp}/dcpstudio-torch-matrix.XXXXXX")
trap 'rm -rf "$work"' EXIT
export QT_QPA_PLATFORM=offscreen PIP_DISABLE_PIP_VERSION_CHECK=1
status=0
summary=()
for version in "$@"; do
    venv="$work/torch-$version"
    python -m venv "$venv"
    if ! "$venv/bin/python" -m pip install --quiet "torch==$version" >"$work/$version.install.log" 2>&1 \
        || ! "$venv/bin/python" -m pip install --quiet -e "$repo[test]" >>"$work/$version.install.log" 2>&1; then
        summary+=("torch $version: install failed (see below)")
        tail -n 5 "$work/$version.install.log"
        status=1
        continue
    fi
    installed=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
    start=$(date +%s)
    if "$venv/bin/python" -m pytest -q -p no:cacheprovider >"$work/$version.log" 2>&1; then
        result="passed"
    else
        result="FAILED"
        status=1
        grep -E "^(FAILED|ERROR)" "$work/$version.log" | head -n 20
    fi
    summary+=("torch $installed: $result — $(tail -n 1 "$work/$version.log") ($(( $(date +%s) - start )) s)")
done
printf '%s\n' "${summary[@]}"
exit $status
