#!/usr/bin/env bash
# Owns: running the Python compute-manager test: a venv in target/pyvenv (made once),
# the pinned gRPC packages, the Rust binaries, then pytest. Extra arguments go to pytest.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="$repo/target/pyvenv"
python="${PYTHON:-python3}"

# Versions that exist on PyPI together (grpcio-tools bundles protoc and pulls in
# protobuf and googleapis-common-protos, which has google.rpc.status_pb2).
packages=(
    grpcio==1.85.1
    grpcio-tools==1.85.1
    grpcio-health-checking==1.85.1
    grpcio-reflection==1.85.1
    grpcio-status==1.85.1
    pytest==9.2.0
)

fail() {
    echo "tests/python/run.sh: $*" >&2
    exit 1
}

command -v "$python" >/dev/null || fail "$python not found: install Python 3 (apt-get install python3 python3-venv)"

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv" \
        || fail "cannot create a venv with '$python -m venv $venv': install the venv module (apt-get install python3-venv), then rerun"
fi
"$venv/bin/python" -m pip --version >/dev/null 2>&1 \
    || fail "the venv $venv has no pip: remove it and install python3-venv (apt-get install python3-venv), then rerun"

stamp="$venv/.installed"
want="${packages[*]}"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${packages[@]}" \
        || fail "pip could not install ${packages[*]} into $venv (no network, or no such version on PyPI?)"
    echo "$want" >"$stamp"
fi

(cd "$repo" && cargo build --bins)

cd "$repo"
exec "$venv/bin/python" -m pytest -p no:cacheprovider -q tests/python "$@"
