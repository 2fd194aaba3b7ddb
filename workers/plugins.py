"""Plugins: the user's programs, tools and voters, loaded the same way by every process of a stack.

A process's registry (``services/registry.py``) holds the built-ins, then:

- every entry point of the installed packages in the groups ``agentlog.programs``,
  ``agentlog.tools`` and ``agentlog.voters`` (``name = "module:attribute"``; the
  entry point's name must be the object's name);
- every module (or ``module:attribute``) named by ``--plugins mod.a,mod.b``, else
  by ``AGENTLOG_PLUGINS``: a module contributes every SDK object (``@program``,
  ``@tool``, ``@voter``) among its attributes; it must contribute at least one.
  Modules are looked for in the current directory first, as ``python -m`` and
  uvicorn do, so ``logctl up --plugins my_agent`` works beside ``my_agent.py``.

``logctl up`` passes its ``--plugins`` to every process it starts as
``AGENTLOG_PLUGINS``, so the planner, the decider and the executor see the same
set. Nothing is skipped: an import error, an unknown module or attribute, an
entry point of the wrong kind, a duplicate name, or a tool whose schema does not
parse stops the process at start-up with one line naming the module.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from typing import Any

from services.programs import PROGRAMS
from services.registry import BUILTIN_SOURCE, Registry, RegistryError, Tool
from services.voters import BUILTIN_VOTERS

__all__ = ["ENTRY_POINT_GROUPS", "PluginError", "add_plugin_arguments", "builtin_registry", "load_registry"]

ENTRY_POINT_GROUPS = {"agentlog.programs": "program", "agentlog.tools": "tool", "agentlog.voters": "voter"}
ENV = "AGENTLOG_PLUGINS"


class PluginError(Exception):
    """A plugin that cannot be loaded; the message is one line and names the module."""


def builtin_registry() -> Registry:
    """The registry of a stack without plugins."""
    from workers.tools import BUILTIN_TOOLS

    registry = Registry()
    for program in PROGRAMS.values():
        registry.add_program(program, BUILTIN_SOURCE)
    for tool in BUILTIN_TOOLS:
        registry.add_tool(tool, BUILTIN_SOURCE)
    for name, factory in BUILTIN_VOTERS.items():
        registry.add_voter(name, factory, BUILTIN_SOURCE)
    return registry


def plugin_names(value: str | None) -> list[str]:
    """``"a.b, c:d"`` -> ``["a.b", "c:d"]``; ``None`` reads ``AGENTLOG_PLUGINS``."""
    text = os.environ.get(ENV, "") if value is None else value
    return [name.strip() for name in text.split(",") if name.strip()]


def load_registry(plugins: str | None = None, *, entry_points: bool = True) -> Registry:
    """The built-ins, the installed entry points, and the ``plugins`` modules (see the module docstring)."""
    registry = builtin_registry()
    try:
        if entry_points:
            _load_entry_points(registry)
        seen: set[int] = set()
        names = plugin_names(plugins)
        if names and os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        for name in names:
            _load_module(registry, name, seen)
        registry.check()
    except RegistryError as e:
        raise PluginError(f"plugin {e}") from None
    return registry


def _load_entry_points(registry: Registry) -> None:
    for group, kind in ENTRY_POINT_GROUPS.items():
        for entry in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name):
            source = f"{entry.value} (entry point {group}:{entry.name})"
            try:
                item = entry.load()
            except Exception as e:
                raise PluginError(f"plugin {source}: cannot be loaded: {type(e).__name__}: {e}") from None
            found = _kind(item)
            if found != kind:
                raise PluginError(f"plugin {source}: is {found or repr(item)}, not a {kind}")
            if getattr(item, "name", None) != entry.name:
                raise PluginError(f"plugin {source}: the entry point is named {entry.name!r}, its {kind} {item.name!r}")
            registry.add(item, source)


def _load_module(registry: Registry, name: str, seen: set[int]) -> None:
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            raise PluginError(f"plugin {module_name}: no such module (is it installed, or on PYTHONPATH?)") from None
        raise PluginError(f"plugin {module_name}: cannot be imported: ModuleNotFoundError: {e}") from None
    except Exception as e:
        raise PluginError(f"plugin {module_name}: cannot be imported: {type(e).__name__}: {e}") from None
    if attribute:
        if not hasattr(module, attribute):
            raise PluginError(f"plugin {name}: module {module_name} has no attribute {attribute!r}")
        value = getattr(module, attribute)
        items = list(value) if isinstance(value, list | tuple) else [value]
        if not items or any(_kind(item) is None for item in items):
            raise PluginError(f"plugin {name}: is not a program, a tool or a voter (nor a list of them)")
    else:
        items = [v for k, v in sorted(vars(module).items()) if not k.startswith("_") and _kind(v)]
        if not items:
            raise PluginError(f"plugin {module_name}: defines no program, tool or voter (@program, @tool, @voter)")
    for item in items:
        if id(item) not in seen:  # a module may import another's tool: the same object counts once
            seen.add(id(item))
            registry.add(item, name)


def _kind(item: Any) -> str | None:
    """What registering ``item`` would make it (None: not an SDK object)."""
    if isinstance(item, type):
        return None
    if isinstance(item, Tool):
        return "tool"
    if callable(getattr(item, "vote", None)) and isinstance(getattr(item, "name", None), str):
        return "voter"
    if callable(getattr(item, "next_action", None)) and isinstance(getattr(item, "name", None), str):
        return "program"
    return None


def add_plugin_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugins",
        default=None,
        help=f"comma-separated modules (or module:attribute) with programs, tools and voters (default: ${ENV})",
    )


def registry_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Registry:
    """The process's registry, or exit with the plugin's one-line error (status 2)."""
    try:
        return load_registry(args.plugins)
    except PluginError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
