#!/bin/sh
# aenv initramfs /init: load the virtio drivers, mount the sandbox root filesystem and the read-only tools
# drive, configure eth0, then switch root into our minimal init or the image's own init.
#
# Kernel command line (all optional):
#   root=/dev/vda  rootfstype=ext4  rootflags=OPTS  ro|rw (default rw)
#   aenv.tools=/dev/vdb          the tools drive, mounted read-only at /opt/aenv in the new root
#   aenv.init=minimal|image      minimal: /opt/aenv/init (starts envd); image: the image's own init
#   aenv.image_init=/sbin/init   the init to run with aenv.init=image (default: first of /sbin/init, /init)
#   aenv.ip=169.254.0.21/30  aenv.gw=169.254.0.22  aenv.net=off
#   aenv.debug=1                 trace this script on the console
#   MODULE.PARAM=VALUE           passed to insmod of MODULE (what modprobe would do), e.g. virtio_mmio.device=
export PATH=/bin:/sbin:/usr/bin:/usr/sbin

mount -t devtmpfs -o nosuid,mode=0755 devtmpfs /dev
mount -t proc -o nosuid,nodev,noexec proc /proc
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys

root=/dev/vda rootfstype=ext4 rootflags= rootmode=rw
tools=/dev/vdb init_mode=minimal image_init=
ip=169.254.0.21/30 gw=169.254.0.22 net=on debug=
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        root=*) root="${arg#root=}" ;;
        rootfstype=*) rootfstype="${arg#rootfstype=}" ;;
        rootflags=*) rootflags="${arg#rootflags=}" ;;
        ro) rootmode=ro ;;
        rw) rootmode=rw ;;
        aenv.tools=*) tools="${arg#aenv.tools=}" ;;
        aenv.init=*) init_mode="${arg#aenv.init=}" ;;
        aenv.image_init=*) image_init="${arg#aenv.image_init=}" ;;
        aenv.ip=*) ip="${arg#aenv.ip=}" ;;
        aenv.gw=*) gw="${arg#aenv.gw=}" ;;
        aenv.net=*) net="${arg#aenv.net=}" ;;
        aenv.debug=*) debug="${arg#aenv.debug=}" ;;
    esac
done
[ -n "$debug" ] && [ "$debug" != 0 ] && set -x

fail() {
    echo "aenv-initramfs: FATAL: $*" >/dev/console
    echo "aenv-initramfs: kernel command line: $(cat /proc/cmdline)" >/dev/console
    # Power off so the VMM exits instead of hanging (panic=-1 turns the init's death into a reboot).
    sync
    poweroff -f
    exit 1
}

# Load modules in dependency order (computed when the kit was built), with MODULE.PARAM=VALUE arguments
# from the kernel command line, as modprobe would.
kver="$(uname -r)"
while read -r mod; do
    [ -n "$mod" ] || continue
    name="${mod##*/}"; name="${name%.ko}"
    params=""
    for arg in $(cat /proc/cmdline); do
        case "$arg" in "$name".*=*) params="$params ${arg#"$name".}" ;; esac
    done
    # shellcheck disable=SC2086
    insmod "/lib/modules/$kver/$mod" $params || echo "aenv-initramfs: insmod $name failed" >/dev/console
done </lib/modules/load.list

wait_block() {
    i=0
    while [ ! -b "$1" ]; do
        i=$((i + 1))
        [ "$i" -gt 1000 ] && return 1
        sleep 0.01
    done
}

wait_block "$root" || fail "root device $root did not appear (is the disk attached as the first virtio-blk device?)"
mkdir -p /newroot
opts="$rootmode"
[ -n "$rootflags" ] && opts="$opts,$rootflags"
mount -t "$rootfstype" -o "$opts" "$root" /newroot || fail "cannot mount $root ($rootfstype, $opts) on /newroot"

if [ "$tools" != none ]; then
    wait_block "$tools" || fail "tools drive $tools did not appear"
    if [ ! -d /newroot/opt/aenv ]; then
        mkdir -p /newroot/opt/aenv || fail "the root filesystem has no /opt/aenv and is read-only"
    fi
    mount -t ext4 -o ro,noatime "$tools" /newroot/opt/aenv || fail "cannot mount tools drive $tools"
fi

if [ "$net" != off ]; then
    ip link set lo up
    if [ -e /sys/class/net/eth0 ]; then
        ip addr add "$ip" dev eth0 && ip link set eth0 up && ip route add default via "$gw" dev eth0 \
            || echo "aenv-initramfs: configuring eth0 ($ip via $gw) failed" >/dev/console
    else
        echo "aenv-initramfs: no eth0; continuing without network" >/dev/console
    fi
fi

case "$init_mode" in
    minimal)
        [ -x /newroot/opt/aenv/init ] || fail "aenv.init=minimal needs the tools drive (no /opt/aenv/init)"
        next=/opt/aenv/init ;;
    image)
        if [ -z "$image_init" ]; then
            for c in /sbin/init /init /bin/init /usr/sbin/init; do
                if [ -x "/newroot$c" ] || [ -L "/newroot$c" ]; then image_init="$c"; break; fi
            done
        fi
        [ -n "$image_init" ] || fail "aenv.init=image but the image has no /sbin/init (set aenv.image_init=)"
        next="$image_init" ;;
    *) fail "unknown aenv.init=$init_mode (use minimal or image)" ;;
esac

mount --move /dev /newroot/dev 2>/dev/null || umount /dev
umount /proc /sys
exec switch_root /newroot "$next"
