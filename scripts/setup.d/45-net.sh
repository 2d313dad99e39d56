# Tools the network slots (aenv_node/net) use on the host: ip (iproute2), nft (nftables), nsenter
# (util-linux, always present) and conntrack (to flush a slot's connection-tracking table when it is
# reused for another sandbox; without it the flush is skipped, see aenv_node/net/slot.py).
need_apt iproute2 nftables conntrack
