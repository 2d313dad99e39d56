# Tools the network slots (aenv_node/net) use on the host: ip (iproute2), nft (nftables), nsenter
# (util-linux, always present), and conntrack: the node flushes a reused slot's table itself over netlink
# (aenv_node/net/conntrack.py); the tool lists a namespace's entries, for the tests and for operators.
need_apt iproute2 nftables conntrack
