# The project's virtualenv with the package installed editable (plus test extras).
PY="${AENV_PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv at $VENV with $PY"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
fi
stamp="$VENV/.aenv-installed"
hash="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$hash" ]; then
    log "pip install -e .[test]"
    "$VENV/bin/pip" install -q -e "$ROOT[test]"
    echo "$hash" > "$stamp"
fi
