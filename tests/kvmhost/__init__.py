"""The KVM host VM: a QEMU TCG virtual machine that exposes SVM, loads KVM, and runs the node inside it.

This machine's /dev/kvm is PVM and cannot run a Linux guest, so the production path (Firecracker, or QEMU with
KVM, running Linux guests) is tested inside a TCG guest that acts as a real KVM host (nested KVM with nested
paging).  ``image`` builds its disk, cached by content hash; ``vm`` starts and stops it; ``scripts/kvmhost`` and
the ``kvmhost`` pytest fixture are the two ways in.
"""
