"""Pause / resume / snapshot / fork orchestration, snapshot chains and compaction (lands with the
pause issue)."""
