# Debian packages the node and its tests use on the host.
need_apt sqlite3 e2fsprogs iproute2 nftables iptables kmod cpio zstd \
    qemu-system-x86 qemu-utils debootstrap busybox-static fio \
    fuse3 libfuse3-dev pkg-config binutils xfsprogs gcc python3-dev \
    docker-registry skopeo umoci apache2-utils openssl tmux \
    redis-server
