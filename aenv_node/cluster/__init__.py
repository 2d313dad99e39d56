"""Gateway and scheduler for multi-node deployments (later)."""
