"""Shared CLI plumbing: config loading from flags, one-line errors, logging."""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Any, Callable, TypeVar, cast

import click

from ..config import Config, ConfigError, load_config

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["state_dir_option", "config_option", "build_config", "one_line_errors", "setup_logging"]

state_dir_option = click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="State directory (default /var/lib/aenv; env AENV_STATE_DIR).",
)
config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="TOML config file (env AENV_CONFIG; else /etc/aenv/config.toml if present).",
)


def build_config(config_path: Path | None, state_dir: Path | None, **api: Any) -> Config:
    overrides: dict[str, dict[str, Any]] = {}
    if state_dir is not None:
        overrides["node"] = {"state_dir": str(state_dir)}
    api = {k: v for k, v in api.items() if v is not None}
    if api:
        overrides["api"] = api
    return load_config(config_path, overrides=overrides)


def one_line_errors(fn: F) -> F:
    """Turn expected failures into one clear line and a non-zero exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except (ConfigError, OSError) as exc:
            raise click.ClickException(str(exc)) from None
        except Exception as exc:  # a last resort: never a traceback for a user error
            if getattr(exc, "user_facing", False) or type(exc).__module__.startswith("aenv_node"):
                raise click.ClickException(str(exc)) from None
            raise

    return cast(F, wrapper)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("hypercorn.access").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
