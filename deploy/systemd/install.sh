#!/usr/bin/env bash
# Install aenv-node's processes as systemd services on Debian 12 or Ubuntu 24.04 (as root), from this
# repository checkout:
#
#   deploy/systemd/install.sh node                 # a lone node, or a cluster node (name the scheduler in
#                                                  # /etc/aenv/config.toml, [cluster])
#   deploy/systemd/install.sh redis scheduler gateway   # a cluster's control host
#
# What it does, each step skipped when already done: the Debian packages the roles need; a copy of the
# source in PREFIX/src and a venv with the package in PREFIX/venv; for a node, Firecracker and its jailer
# (pinned by sha256), the seccomp helper and the guest kit (scripts/setup.d, the development set-up's own
# steps); /etc/aenv/config.toml and /etc/aenv/cluster.env (a new cluster key, 0600) when missing; the units,
# enabled and started (unless --no-start).
#
# Options: --prefix DIR (/opt/aenv-node), --etc DIR (/etc/aenv), --unit-dir DIR (/etc/systemd/system),
# --no-start (install only: for images and tests).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PREFIX=/opt/aenv-node ETC=/etc/aenv UNIT_DIR=/etc/systemd/system START=1
roles=()
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) PREFIX="$2"; shift 2 ;;
        --etc) ETC="$2"; shift 2 ;;
        --unit-dir) UNIT_DIR="$2"; shift 2 ;;
        --no-start) START=0; shift ;;
        node|scheduler|gateway|redis) roles+=("$1"); shift ;;
        *) echo "install.sh: unknown argument '$1' (roles: node scheduler gateway redis)" >&2; exit 2 ;;
    esac
done
[ ${#roles[@]} -gt 0 ] || { echo "install.sh: name at least one role: node scheduler gateway redis" >&2; exit 2; }
has() { local r; for r in "${roles[@]}"; do [ "$r" = "$1" ] && return 0; done; return 1; }

log() { printf '[install] %s\n' "$*" >&2; }
need_apt() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
export -f need_apt log

need_apt python3 python3-venv ca-certificates
has redis && need_apt redis-server
if has node; then
    need_apt sqlite3 e2fsprogs iproute2 nftables iptables conntrack kmod cpio zstd lz4 qemu-system-x86 \
        qemu-utils debootstrap busybox-static fuse3 gcc libc6-dev
fi

log "source in $PREFIX/src, venv in $PREFIX/venv"
mkdir -p "$PREFIX/src"
tar -C "$ROOT" --exclude=./.venv --exclude=./.git --exclude='*.pyc' --exclude=./node_modules -cf - \
    pyproject.toml README.md aenv_node migrations docs deploy | tar -C "$PREFIX/src" -xf -
[ -x "$PREFIX/venv/bin/python" ] || python3 -m venv "$PREFIX/venv"
"$PREFIX/venv/bin/pip" install -q "$PREFIX/src"

if has node; then
    export ROOT="$PREFIX/src" VENV="$PREFIX/venv" AENV_STATE_DIR="${AENV_STATE_DIR:-/var/lib/aenv}"
    for step in 25-seccomp-exec 30-firecracker 40-guest-kit; do
        # shellcheck source=/dev/null
        source "$HERE/../../scripts/setup.d/$step.sh"
    done
fi

mkdir -p "$ETC"
if [ ! -f "$ETC/config.toml" ]; then
    log "writing $ETC/config.toml"
    cat > "$ETC/config.toml" <<TOML
# aenv-node's configuration (docs/configuration.md). The API key is in cluster.env.
[api]
listen = "0.0.0.0:8000"

[cluster]
scheduler_url = ""      # a cluster node: the scheduler's URL (http://HOST:9090)
advertise_url = ""      # ... and where the gateways reach this node (http://THIS-HOST:8000)
TOML
fi
if [ ! -f "$ETC/cluster.env" ]; then
    log "writing $ETC/cluster.env (a new cluster key: copy this file to every host of the cluster)"
    (umask 077; printf 'AENV_API_API_KEY=%s\n' "$(python3 -c 'import secrets; print(secrets.token_hex(24))')" \
        > "$ETC/cluster.env")
fi

mkdir -p "$UNIT_DIR"
units=()
for role in "${roles[@]}"; do
    [ "$role" = redis ] && { units+=(redis-server.service); continue; }
    unit="aenv-$role.service"
    sed -e "s|/opt/aenv-node|$PREFIX|g" -e "s|/etc/aenv/|$ETC/|g" "$HERE/$unit" > "$UNIT_DIR/$unit"
    units+=("$unit")
done
if [ "$START" = 1 ]; then
    systemctl daemon-reload
    systemctl enable --now "${units[@]}"
    log "started: ${units[*]}"
else
    log "installed (not started): ${units[*]}"
fi
