"""The live build view: the node's structured build log lines become progress rows (no node needed: the rows
are drawn from log entries as the status route returns them; following a real build is tested against a real
node in tests/templates/test_build_api.py)."""

from __future__ import annotations


def test_build_progress_rows() -> None:
    from aenv_node.cli.aenv.build_progress import BuildView

    view = BuildView(live=True)
    with view:
        for message in ["pulling sha256:aa… (8.0 MiB)", "pulling sha256:bb… (1.0 MiB)",
                        "pulled sha256:aa… (8.0 MiB) in 0.1s", "sha256:cc… already present (2.0 MiB)",
                        "layer 1/2 sha256:aa… (8.0 MiB): 8 entries applied in 0.3s -> block layer 8.2 MiB",
                        "step 1/3 RUN a: cached", "step 2/3 RUN b", "something else"]:
            view.entry({"timestamp": "2026-01-01T00:00:00.000Z", "level": "info", "message": message})
    tasks = {t.description: (t.completed, t.total) for t in view.progress.tasks}
    assert tasks["pulled sha256:aa… (8.0 MiB) in 0.1s"] == (1, 1)
    assert tasks["pull sha256:bb… (1.0 MiB)"] == (0, None)
    assert tasks["step 2/3 RUN b"] == (1, 3)
    assert any(d.startswith("layer 1/2") and v == (1, 2) for d, v in tasks.items())
