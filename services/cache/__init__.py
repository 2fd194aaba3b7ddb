"""The cache manager's pure core: session views, tool latency model, survival-score policy.

``COMPILED`` are compiled together with mypyc by ``scripts/compile_native.py`` (``make
install``) into ``_native/``, which goes first on this package's path where it was built
from the current sources (``log.native.package_builds``; ``AGENTLOG_NATIVE=0`` turns it
off): the same code, its fold about 1.5x as fast (docs/benchmarks.md). So the code here is what
mypyc compiles: no subclasses of builtins, no attributes set on instances from outside.
"""

from pathlib import Path

from log.native import package_builds

COMPILED = ("latency", "view", "policy", "residents", "manager")
"""The modules of ``services.cache`` compiled as one group (they call each other)."""

__path__ = [*package_builds(Path(__file__).parent, COMPILED), *__path__]

# After the path: these are the builds where they are current.
from services.cache.latency import ToolLatencyModel  # noqa: E402
from services.cache.policy import CacheDecision, CachePolicy, Delays, MemoryState, PolicyConfig  # noqa: E402
from services.cache.view import CacheViewBuilder, Phase, SessionView  # noqa: E402

__all__ = [
    "COMPILED",
    "CacheDecision",
    "CachePolicy",
    "CacheViewBuilder",
    "Delays",
    "MemoryState",
    "Phase",
    "PolicyConfig",
    "SessionView",
    "ToolLatencyModel",
]
