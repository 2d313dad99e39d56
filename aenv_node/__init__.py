"""aenv-node: a self-hosted node runtime for agent sandboxes.

Each sandbox is a microVM with its own kernel, filesystem and network namespace.
The layers of the package (dependencies point down only) are described in
``docs/architecture.md``:

    cli/ -> api/ -> runtime/ -> templates/ -> snapshot/ -> vmm/, net/, storage/, images/ -> state/
    guest/ runs inside the VM and imports nothing from the node.

This module deliberately imports nothing: ``aenv_node.guest`` is shipped into
guests on its own.
"""

__version__ = "0.1.0"
