"""Template builds: the only place a sandbox machine cold-boots (``build``), and the node's own ``base``
template kept current with its guest kit and root filesystem (``base``)."""

from .base import BaseTemplateInputs, base_template_current, ensure_base_template
from .build import BuildResult, TemplateSource, build_template

__all__ = [
    "BaseTemplateInputs",
    "BuildResult",
    "TemplateSource",
    "base_template_current",
    "build_template",
    "ensure_base_template",
]
