"""Workload analysis (``logctl analyze``): where a workload's job time goes, and whether a
serving-layer cache policy can win any of it back. Pure: timelines are folded from log events
or built from a trace (:mod:`.timeline`), and :func:`analyze` turns them into numbers and a
verdict (:mod:`.report`); reading the log and printing are the CLI's job (``cli/analyze.py``).
"""

from services.analysis.report import (
    NOT_WORTH_IT_SHARE,
    WORTH_IT_SHARE,
    Distribution,
    SessionReport,
    ToolReport,
    TurnReport,
    Verdict,
    VerdictAnswer,
    WorkloadReport,
    analyze,
)
from services.analysis.timeline import (
    CallSpan,
    GapSpan,
    SessionEnd,
    Timeline,
    TimelineFold,
    fold_timelines,
    from_trace,
)

__all__ = [
    "NOT_WORTH_IT_SHARE",
    "WORTH_IT_SHARE",
    "CallSpan",
    "Distribution",
    "GapSpan",
    "SessionEnd",
    "SessionReport",
    "Timeline",
    "TimelineFold",
    "ToolReport",
    "TurnReport",
    "Verdict",
    "VerdictAnswer",
    "WorkloadReport",
    "analyze",
    "fold_timelines",
    "from_trace",
]
