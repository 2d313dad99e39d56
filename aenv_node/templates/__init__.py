"""Template builds: the only place a sandbox machine cold-boots (``build``), the node's own ``base`` template
kept current with its guest kit and root filesystem (``base``), and templates built from recipes (``recipe``,
``recipe_build``): FROM an OCI image (``convert``: layers shared by chain, ``provision``) or another template,
then steps in a build VM (``steps``); what template names and tags mean (``names``);
when the build caches let go (``cache_expiry``); a VM without envd imported from its kernel (``import_vm``)."""

from .base import base_template_current, ensure_base_template
from .cache_expiry import expire_converted_layers, expired_files, touch
from .builtin import CODE_INTERPRETER, code_interpreter_recipe, prepare_code_interpreter_files
from .build import BuildResult, GuestDefaults, TemplateSource, build_template
from .convert import ConvertedImage, ImageConverter
from .errors import GuestExecError, GuestNotReady, ImageHasNoShell, KernelRefused, TemplateBuildError
from .import_vm import import_vm
from .machine import BuildMachine
from .names import (DEFAULT_TAG, NAME_PART, RESERVED_NAMES, NamedBuild, assign_tags, find_template, lookup,
                    remove_tags, split_name, tags_of)
from .recipe import BuildLog, LogEntry, Recipe, Step
from .recipe_build import RecipeInputs, build_recipe, parent_template
from .steps import StepFailed

__all__ = [
    "CODE_INTERPRETER",
    "DEFAULT_TAG",
    "RESERVED_NAMES",
    "NAME_PART",
    "NamedBuild",
    "assign_tags",
    "find_template",
    "lookup",
    "remove_tags",
    "split_name",
    "tags_of",
    "code_interpreter_recipe",
    "prepare_code_interpreter_files",
    "BuildMachine",
    "BuildLog",
    "BuildResult",
    "ConvertedImage",
    "GuestDefaults",
    "GuestExecError",
    "GuestNotReady",
    "KernelRefused",
    "import_vm",
    "ImageConverter",
    "ImageHasNoShell",
    "LogEntry",
    "Recipe",
    "RecipeInputs",
    "Step",
    "StepFailed",
    "TemplateBuildError",
    "TemplateSource",
    "base_template_current",
    "build_recipe",
    "build_template",
    "expire_converted_layers",
    "expired_files",
    "touch",
    "parent_template",
    "ensure_base_template",
]
