# Debian packages the node and its tests use on the host.
need_apt sqlite3 e2fsprogs iproute2 nftables iptables kmod cpio zstd \
    qemu-system-x86 qemu-utils debootstrap busybox-static fio \
    fuse3 libfuse3-dev pkg-config binutils xfsprogs gcc python3-dev \
    docker-registry skopeo umoci apache2-utils openssl tmux \
    redis-server nginx-light
# nginx-light is bench/proxy_overhead.py's reference reverse proxy (the bench starts its own instance as the
# current user); Debian's package starts a system-wide one on :80 where systemd runs: not wanted on a node.
if command -v systemctl >/dev/null && systemctl is-enabled nginx >/dev/null 2>&1; then
    systemctl disable --now nginx >/dev/null 2>&1 || true
fi
