#!/opt/aenv/bin/busybox sh
# aenv minimal init: PID 1 of a sandbox booted with aenv.init=minimal (lives on the tools drive as
# /opt/aenv/init, so it needs nothing from the image: not even a shell).
#
# Mounts the API filesystems, sets the hostname, starts envd from the tools drive, prints
# "aenv: envd ready" on the console once envd answers /health, reaps zombies (the shell's wait reaps every
# child, including orphans re-parented to PID 1), restarts envd if it dies, and powers off cleanly on
# SIGTERM/SIGINT/SIGUSR2/SIGPWR (e.g. `kill -TERM 1`).
#
# Kernel command line: aenv.hostname=NAME (default "sandbox"), aenv.envd_port=49983,
#                      aenv.halt=poweroff|reboot (reboot for VMMs that exit on reset, e.g. Firecracker).
PATH=/opt/aenv/bb
AENV=/opt/aenv

mnt() { # mnt TYPE DIR OPTIONS: mount unless already mounted (the initramfs moves /dev here)
    mkdir -p "$2" 2>/dev/null
    grep -q "^[^ ]* $2 " /proc/mounts 2>/dev/null && return 0
    mount -t "$1" -o "$3" "$1" "$2" || echo "aenv-init: mounting $1 on $2 failed"
}
mnt proc /proc nosuid,nodev,noexec
mnt sysfs /sys nosuid,nodev,noexec
mnt devtmpfs /dev nosuid,mode=0755
mnt devpts /dev/pts nosuid,noexec,gid=5,mode=0620,ptmxmode=0666
mnt tmpfs /dev/shm nosuid,nodev,mode=1777
mnt tmpfs /run nosuid,nodev,mode=0755
mnt tmpfs /tmp nosuid,nodev,mode=1777
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
[ -e /dev/stdin ] || ln -s /proc/self/fd/0 /dev/stdin
[ -e /dev/stdout ] || ln -s /proc/self/fd/1 /dev/stdout
[ -e /dev/stderr ] || ln -s /proc/self/fd/2 /dev/stderr
[ -e /dev/ptmx ] || ln -s pts/ptmx /dev/ptmx

name=sandbox port=49983 halt=poweroff
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        aenv.hostname=*) name="${arg#aenv.hostname=}" ;;
        aenv.envd_port=*) port="${arg#aenv.envd_port=}" ;;
        aenv.halt=*) halt="${arg#aenv.halt=}" ;;
    esac
done
hostname "$name"
ip link set lo up 2>/dev/null

ENVD_PID=
start_envd() {
    cd /
    env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root USER=root LANG=C.UTF-8 \
        "$AENV/bin/python" -I -m envd --port "$port" --quiesce-path / </dev/null &
    ENVD_PID=$!
}

shutdown_now() {
    echo "aenv: shutting down"
    trap '' TERM INT USR2 PWR
    [ -n "$ENVD_PID" ] && kill -TERM "$ENVD_PID" 2>/dev/null
    kill -TERM -1 2>/dev/null
    i=0
    while [ "$i" -lt 20 ] && [ -n "$(jobs -p)" ]; do sleep 0.1; i=$((i + 1)); done
    kill -KILL -1 2>/dev/null
    sync
    umount -a -r 2>/dev/null
    if [ "$halt" = reboot ]; then reboot -f; else poweroff -f; fi
    exit 0
}
trap shutdown_now TERM INT USR2 PWR

# envd is up once its port is listening (state 0A in /proc/net/tcp*): no HTTP client needed (busybox's
# static wget crashes on some lookups) and nothing the image must provide.
port_hex=$(printf ':%04X ' "$port")
listening() { grep -q "$port_hex[0-9A-F:]* 0A " /proc/net/tcp /proc/net/tcp6 2>/dev/null; }

start_envd
while ! listening; do
    if ! kill -0 "$ENVD_PID" 2>/dev/null; then break; fi
    sleep 0.02
done
if kill -0 "$ENVD_PID" 2>/dev/null; then
    echo "aenv: envd ready"
else
    echo "aenv: envd failed to start"
fi

failures=0
while :; do
    # `wait PID` blocks in waitpid(-1): it reaps every child that dies meanwhile, orphans included.
    wait "$ENVD_PID"
    status=$?
    if kill -0 "$ENVD_PID" 2>/dev/null; then
        continue # interrupted by a trapped signal or an orphan's death; envd still runs
    fi
    failures=$((failures + 1))
    echo "aenv: envd exited with status $status; restarting ($failures)"
    [ "$failures" -gt 5 ] && sleep 5 || sleep 0.5
    start_envd
done
