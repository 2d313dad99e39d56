# The official E2B JS SDK (npm `e2b`) for the tests that drive envd and the node with it.
# Needs Node.js >= 20 (present on these machines); installed into tests/js/node_modules.
if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then
    stamp="$ROOT/tests/js/node_modules/.aenv-installed"
    want="$(sha256sum "$ROOT/tests/js/package.json" | cut -d' ' -f1)"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        log "npm install (E2B JS SDK) in tests/js"
        (cd "$ROOT/tests/js" && npm install --no-audit --no-fund --silent >/dev/null)
        echo "$want" > "$stamp"
    fi
else
    log "node/npm not found: the E2B JS SDK tests will fail (install Node.js 20)"
fi
