"""``logctl analyze --png DIR``: the report as three PNG plots (matplotlib, the ``plots`` extra).

- ``job_time.png``: each session's job time split into LLM calls (queue apart), tool gaps and
  the rest (the planner, verdicts, startup), the longest jobs first;
- ``tool_gaps.png``: the distribution (CDF) of tool-gap seconds, per tool;
- ``hits_per_turn.png``: per turn, the KV hit rate and the oracle's, and the tokens recomputed.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from cli.errors import CliError
from services.analysis import Timeline, WorkloadReport

_SESSIONS_PLOTTED = 40


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise CliError("--png needs matplotlib: pip install 'agentlog[plots]'") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def write_plots(report: WorkloadReport, timelines: list[Timeline], folder: Path) -> list[Path]:
    """Write the three plots into ``folder`` (created); their paths."""
    plt = _pyplot()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"cannot write plots into {folder}: {e.strerror}") from None
    paths = [_job_time(plt, timelines, folder), _tool_gaps(plt, timelines, folder), _turns(plt, report, folder)]
    return paths


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _job_time(plt: Any, timelines: list[Timeline], folder: Path) -> Path:
    longest = sorted(timelines, key=lambda t: (-t.job_s, t.session_id))[:_SESSIONS_PLOTTED]
    names = [t.session_id if len(t.session_id) <= 24 else "..." + t.session_id[-21:] for t in longest]
    queue = [sum(c.queue_s for c in t.calls) for t in longest]
    llm = [sum(c.duration_s for c in t.calls) - q for t, q in zip(longest, queue, strict=True)]
    gaps = [sum(g.duration_s for g in t.gaps) for t in longest]
    rest = [max(0.0, t.job_s - a - b - c) for t, a, b, c in zip(longest, queue, llm, gaps, strict=True)]
    fig, ax = plt.subplots(figsize=(9, max(3.0, 0.25 * len(longest) + 1.5)))
    left = [0.0] * len(longest)
    for values, label, color in (
        (llm, "LLM call", "tab:blue"),
        (queue, "queued (head-of-line)", "tab:red"),
        (gaps, "tool gap", "tab:orange"),
        (rest, "other", "lightgray"),
    ):
        ax.barh(names, values, left=left, label=label, color=color)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title("Where each session's job time goes (longest jobs)")
    ax.legend(loc="lower right", fontsize="small")
    return _save(plt, fig, folder / "job_time.png")


def _tool_gaps(plt: Any, timelines: list[Timeline], folder: Path) -> Path:
    by_tool: dict[str, list[float]] = defaultdict(list)
    for t in timelines:
        for g in t.gaps:
            by_tool[g.tool].append(g.duration_s)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for tool, values in sorted(by_tool.items(), key=lambda item: -len(item[1]))[:10]:
        ordered = sorted(values)
        ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=tool)
    if by_tool and min(min(v) for v in by_tool.values()) > 0:
        ax.set_xscale("log")
    ax.set_xlabel("tool gap (seconds)")
    ax.set_ylabel("fraction of gaps")
    ax.set_title("Tool-gap distribution per tool")
    if by_tool:
        ax.legend(fontsize="small")
    return _save(plt, fig, folder / "tool_gaps.png")


def _turns(plt: Any, report: WorkloadReport, folder: Path) -> Path:
    turns = [u.turn for u in report.turns]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(turns, [u.recomputed_tokens for u in report.turns], color="tab:red", alpha=0.4, label="tokens recomputed")
    ax.set_xlabel("turn")
    ax.set_ylabel("prompt tokens recomputed")
    rates = ax.twinx()
    rates.plot(turns, [u.hit_rate for u in report.turns], "o-", color="tab:blue", label="hit rate")
    rates.plot(turns, [u.oracle_hit_rate for u in report.turns], "s--", color="tab:green", label="oracle hit rate")
    rates.set_ylim(0, 1.05)
    rates.set_ylabel("share of prompt tokens from the cache")
    handles = ax.get_legend_handles_labels()[0] + rates.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="center right", fontsize="small")
    ax.set_title("KV cache hits per turn")
    return _save(plt, fig, folder / "hits_per_turn.png")
