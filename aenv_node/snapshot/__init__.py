"""Pause, snapshot, fork and resume of running sandboxes, and the snapshots they make.

``operations`` orchestrates the four operations on top of ``capture`` (a running sandbox into an
incremental snapshot) and restores through the runtime's ``Launcher``; the snapshot store (``store``,
``source``, ``compaction``, ``gc``) loads, retires, bounds and collects committed snapshots; ``publish``
and ``manifest`` put them in the shared repository and take them from it (one writer per sandbox across
nodes). ``machine`` assembles one sandbox machine (disk, NBD, slot, VMM); ``envd`` is the node's side of the
in-guest daemon. Its errors are in ``errors``.
"""
