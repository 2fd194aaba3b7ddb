"""Loading plugins (workers/plugins.py) from import paths: what loads, and every way it refuses to."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.registry import BUILTIN_SOURCE
from workers.plugins import PluginError, builtin_registry, load_registry

GOOD = """
from services.sdk import approve, program, tool, voter

@program(name="hello")
async def hello(ctx):
    return {"hi": (await ctx.tool("shout", {"text": "x"}))}

@tool(name="shout", effect="pure", schema={"type": "object", "properties": {"text": {"type": "string"}}})
def shout(args, ctx):
    return args["text"].upper()

@voter(name="always")
def always(proposal):
    return approve("fine")
"""


@pytest.fixture
def modules(tmp_path: Path) -> Iterator[Path]:
    sys.path.insert(0, str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name in set(sys.modules) - before:
        del sys.modules[name]


def write(folder: Path, name: str, text: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(text))


def test_the_builtins_are_registered_like_plugins() -> None:
    registry = builtin_registry()
    assert set(registry.programs) == {"trace", "react", "script"}
    assert {"echo", "payment", "book", "cancel_booking"} <= set(registry.tools)
    assert registry.sources[("tool", "payment")] == BUILTIN_SOURCE
    assert registry.plugin_voters() == []


def test_a_module_contributes_every_sdk_object_it_defines(modules: Path) -> None:
    write(modules, "good_plugin", GOOD)
    write(modules, "reexport", "from good_plugin import shout, hello\n")
    registry = load_registry("good_plugin, reexport:shout", entry_points=False)
    assert "hello" in registry.programs and "shout" in registry.tools
    assert registry.plugin_voters() == ["always"]
    assert registry.sources[("tool", "shout")] == "good_plugin"  # the same object once, from its first module


@pytest.mark.parametrize(
    ("files", "plugins", "message"),
    [
        ({}, "no_such_plugin", "plugin no_such_plugin: no such module (is it installed, or on PYTHONPATH?)"),
        (
            {"broken": "import json\nraise RuntimeError('no config file')\n"},
            "broken",
            "plugin broken: cannot be imported: RuntimeError: no config file",
        ),
        (
            {"deps": "import not_installed_dependency\n"},
            "deps",
            "plugin deps: cannot be imported: ModuleNotFoundError: No module named 'not_installed_dependency'",
        ),
        ({"empty": "X = 1\n"}, "empty", "plugin empty: defines no program, tool or voter (@program, @tool, @voter)"),
        (
            {"good_plugin": GOOD},
            "good_plugin:nope",
            "plugin good_plugin:nope: module good_plugin has no attribute 'nope'",
        ),
        ({"notsdk": "X = 1\n"}, "notsdk:X", "plugin notsdk:X: is not a program, a tool or a voter"),
        (
            {"dup": "from services.sdk import tool\necho = tool(name='echo', effect='pure')(lambda a, c: a)\n"},
            "dup",
            "plugin dup: tool 'echo' is registered twice (already by agentlog (built-in))",
        ),
        (
            {"schema": "from services.sdk import tool\nt = tool(name='t', effect='pure', schema={'type': 3})(print)\n"},
            "schema",
            "plugin schema: tool 't' has an argument schema that is not a valid JSON schema",
        ),
        (
            {
                "comp": "from services.sdk import tool\n"
                "b = tool(name='b', effect='compensatable', compensation='unb')(print)\n"
            },
            "comp",
            "plugin comp: tool 'b' names compensation 'unb', which is not a tool",
        ),
    ],
    ids=["unknown", "import-error", "missing-dependency", "empty", "attribute", "not-sdk", "duplicate", "schema",
         "compensation"],
)  # fmt: skip
def test_a_bad_plugin_is_one_clear_error_naming_its_module(
    modules: Path, files: dict[str, str], plugins: str, message: str
) -> None:
    for name, text in files.items():
        write(modules, name, text)
    with pytest.raises(PluginError) as error:
        load_registry(plugins, entry_points=False)
    assert str(error.value).startswith(message), str(error.value)
    assert "\n" not in str(error.value)
