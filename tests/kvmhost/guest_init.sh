#!/bin/bash
# PID 1 of the KVM host VM, second stage (copied onto the project drive by vm.py; the image's first stage
# mounted /proc, /sys, /run, /tmp and this drive): kernel modules, the data drive, then aenv-node. It stays
# the parent of everything (bash reaps orphans) and powers the VM off when the node exits. The node's output
# goes to the serial console (the host's console.log) as well as to /var/lib/aenv/node.log.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
hostname kvmhost
ln -sfn /proc/self/fd /dev/fd  # devtmpfs has no /dev/fd: bash's process substitution needs it
off() { sync; busybox poweroff -f; }  # minbase has no systemd: busybox's poweroff
# KVM for the nested guests; tap, veth and NAT for the network slots; ublk, FUSE and loop for the disks
for m in kvm_amd tun veth nf_tables nft_chain_nat nft_masq nft_nat nft_ct nft_reject_inet nft_fib_inet \
         iptable_nat iptable_filter ip_tables xt_MASQUERADE br_netfilter ublk_drv fuse loop vhost_net overlay; do
    modprobe "$m" 2>/dev/null || echo "kvmhost: no module $m"
done
echo 1 > /proc/sys/net/ipv4/ip_forward
mkdir -p /var/lib/aenv
mount -o noatime /dev/vdb /var/lib/aenv || { echo "kvmhost: FATAL: no data drive"; off; }
# this host's apt lists: the node resolves the guest kit's package versions offline (they are in its hash)
[ -d /var/lib/aenv/apt/lists ] && mount --bind /var/lib/aenv/apt/lists /var/lib/apt/lists
[ -d /var/lib/aenv/apt/etc ] && cp -r /var/lib/aenv/apt/etc/. /etc/apt/
ls -l /dev/kvm /dev/ublk-control /dev/fuse /dev/net/tun 2>&1 | sed 's/^/kvmhost: /'
grep -q -m1 -w svm /proc/cpuinfo && echo "kvmhost: cpu has svm"
if grep -qw kvmhost.shell=1 /proc/cmdline; then
    # `scripts/kvmhost sh CMD` (port forwarded from 127.0.0.1 on the host only): a root shell per connection
    (while true; do busybox nc -l -p 2222 -e /bin/bash; done) >/dev/null 2>&1 &
    echo "kvmhost: debug shell on :2222"
fi
export AENV_CONFIG=/var/lib/aenv/config.toml
while true; do
    echo "kvmhost: starting aenv-node"
    /usr/local/bin/aenv-node serve > >(tee -a /var/lib/aenv/node.log | sed -u 's/^/node: /' > /dev/console) 2>&1 &
    node=$!
    echo "$node" > /run/kvmhost-node.pid
    echo "KVMHOST-NODE-PID $node"
    while kill -0 "$node" 2>/dev/null; do wait "$node"; done
    # a restart asked for by the host (vm.py restart_node); otherwise the VM powers off with its node. With
    # "dataplane" in the marker (switch_vmm: a new config) the data plane goes too, so that the next node
    # starts one with the new config
    [ -e /var/lib/aenv/restart ] || break
    if grep -q dataplane /var/lib/aenv/restart; then
        /usr/local/bin/aenv-node dataplane stop 2>&1 | sed 's/^/kvmhost: /'
    fi
    rm -f /var/lib/aenv/restart
    echo "KVMHOST-NODE-RESTART"
done
echo "KVMHOST-NODE-EXITED"
umount /var/lib/aenv; off
