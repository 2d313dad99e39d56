# The project's virtualenv with the package installed editable, plus the test extra (pytest, and the static
# checks `scripts/dev test` runs first: ruff, mypy and the type stubs mypy needs) and the bench extra (the
# plots and profiles of bench/run, whose smoke run is one of the tests).
PY="${AENV_PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv at $VENV with $PY"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
fi
stamp="$VENV/.aenv-installed"
hash="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
# re-installed when pyproject.toml changes, or when a tool `scripts/dev test` runs is missing
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$hash" ] || [ ! -x "$VENV/bin/ruff" ] || [ ! -x "$VENV/bin/mypy" ]; then
    log "pip install -e .[test,bench]"
    "$VENV/bin/pip" install -q -e "$ROOT[test,bench]"
    echo "$hash" > "$stamp"
fi
