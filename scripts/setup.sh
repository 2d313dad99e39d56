#!/usr/bin/env bash
# Idempotent set-up of a development / CI machine (Debian 12, root).
#
# Runs every step in scripts/setup.d/ in name order. Each step owns one concern
# (apt packages, the venv, Firecracker, the guest kit, ...) and must be cheap to
# re-run: it checks what is already there before doing work.  Steps can use the
# helpers below.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export ROOT
export VENV="${AENV_VENV:-$ROOT/.venv}"
export AENV_STATE_DIR="${AENV_STATE_DIR:-/var/lib/aenv}"

log() { printf '[setup] %s\n' "$*" >&2; }

_apt_updated=0
# need_apt PKG...: install the Debian packages that are missing.
need_apt() {
    local missing=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$_apt_updated" = 0 ]; then
        log "apt-get update"
        apt-get update -qq
        _apt_updated=1
    fi
    log "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
export -f need_apt log

for step in "$ROOT"/scripts/setup.d/*.sh; do
    # shellcheck source=/dev/null
    source "$step"
done
log "ready"
