"""Long-running processes, one per role: consume -> decide -> append loops around ``services``.

The planner, decider and executor (``runtime.SessionWorker``), the cache manager, the
engine bridge (``engine_bridge``), the engines they reach (``engines``: the simulated
engine's server and vLLM), and the tools the executor runs.
"""
