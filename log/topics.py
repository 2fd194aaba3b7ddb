"""The topics of the log, who may write each, and which bodies belong where.

One topic per writing role (a privilege domain, DESIGN.md section 3). All are
keyed by session id and co-partitioned: partition p of every topic holds the
same sessions, so one consumer owning partition p sees a session's whole story.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from log.errors import UnknownTopic
from schemas import events as ev
from schemas.events import Model

ANY_ACTOR = "*"
READ_ONLY_ACTORS = frozenset({"auditor"})
"""Principals that write nothing at all, not even the dead-letter topic (the broker and the database refuse them)."""


@dataclass(frozen=True)
class Topic:
    """A topic, its only writer, and the body types it holds."""

    name: str
    owner: str
    bodies: tuple[type[Model], ...]
    infinite_retention: bool = True
    body_types: frozenset[type[Model]] = field(init=False, repr=False, compare=False)
    """``bodies`` as a set: a consumer checks every record's body, and ``isinstance`` against
    a tuple of pydantic models costs about 1 us (a call per class); the exact type is the
    common case, and a subclass still passes through ``isinstance``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "body_types", frozenset(self.bodies))
        if self.owner in READ_ONLY_ACTORS:  # ChainVerifier lets a topic's owner write it unasked
            raise ValueError(f"topic {self.name} cannot be owned by {self.owner!r}, which writes nothing")

    def allows_actor(self, actor: str) -> bool:
        if actor in READ_ONLY_ACTORS:
            return False
        return self.owner in (ANY_ACTOR, actor)


AGENT_ACTIONS = Topic(
    "agent.actions",
    "planner",
    (
        ev.SessionStarted,
        ev.SessionFinished,
        ev.SessionFailed,
        ev.LLMCallStarted,
        ev.LLMCallCompleted,
        ev.ToolCallProposed,
        ev.CheckpointTaken,
        ev.ForkCreated,
        ev.RestoreApplied,
        ev.RestoreRefused,
        ev.MergeApplied,
        ev.MergeConflict,
        ev.EngineRouted,
    ),
)
AGENT_VERDICTS = Topic("agent.verdicts", "decider", (ev.ToolCallCommitted, ev.ToolCallAborted))
AGENT_EFFECTS = Topic(
    "agent.effects",
    "executor",
    (
        ev.ToolCallStarted,
        ev.ToolCallCompleted,
        ev.ToolCallFailed,
        ev.ToolCallInDoubt,
        ev.ResourceAcquiring,
        ev.ResourceAcquired,
        ev.ResourceReleased,
        ev.ResourceReleaseFailed,
    ),
)
KV_EVENTS = Topic(
    "kv.events",
    "engine-bridge",
    (ev.KVBlocksStored, ev.KVBlocksRemoved, ev.KVAllBlocksCleared, ev.KVCacheHit, ev.KVSwapCompleted),
)
KV_DECISIONS = Topic("kv.decisions", "cache-manager", (ev.CacheDecisionMade,))
OPS_COMMANDS = Topic(
    "ops.commands",
    "operator",
    (
        ev.SessionRequested,
        ev.ApprovalGiven,
        ev.CancelRequested,
        ev.CheckpointRequested,
        ev.ForkRequested,
        ev.RestoreRequested,
        ev.MergeRequested,
        ev.ModelPinRequested,
    ),
)
AGENT_GATEWAY = Topic(
    "agent.gateway",
    "gateway",
    (ev.GatewayLLMCallServed, ev.GatewayToolResultReported, ev.GatewaySessionEnded, ev.GatewayEngineRouted),
)
"""What external agents did through the OpenAI-compatible gateway (workers/gateway): the gateway's
claims, which the planner (agent.actions) and the executor (agent.effects) adopt into the session's
story; docs/architecture.md says why the gateway writes nothing else."""
AGENT_DLQ = Topic("agent.dlq", ANY_ACTOR, (ev.RecordDeadLettered,), infinite_retention=False)

TOPICS: tuple[Topic, ...] = (
    AGENT_ACTIONS,
    AGENT_VERDICTS,
    AGENT_EFFECTS,
    KV_EVENTS,
    KV_DECISIONS,
    OPS_COMMANDS,
    AGENT_GATEWAY,
    AGENT_DLQ,
)
"""Every topic, in a fixed order (also the tie-break when merging topics by time)."""

SESSION_TOPICS: tuple[str, ...] = (AGENT_ACTIONS.name, AGENT_VERDICTS.name, AGENT_EFFECTS.name, OPS_COMMANDS.name)
"""The topics that hold a session's own story (the agent's steps, verdicts, effects and
operators' commands; not the KV cache's): what a session is folded from, what a checkpoint cuts,
and what the planner reads."""

BY_NAME: dict[str, Topic] = {t.name: t for t in TOPICS}
TOPIC_ORDER: dict[str, int] = {t.name: i for i, t in enumerate(TOPICS)}

DEFAULT_PARTITIONS = 4


def topic(name: str) -> Topic:
    """The topic called ``name``; raises UnknownTopic for anything else."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise UnknownTopic(f"{name!r} is not a topic of the log; topics are {', '.join(BY_NAME)}") from None


def topic_of(body: Model) -> Topic:
    """The one topic a body type belongs on."""
    for t in TOPICS:
        if isinstance(body, t.bodies):
            return t
    raise TypeError(f"{type(body).__name__} belongs on no topic")
