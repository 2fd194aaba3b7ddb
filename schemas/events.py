"""Typed models of every event body on the log.

Each class here mirrors one ``schemas/avro/agentlog.<Name>.avsc`` file field for
field (name, type, default, doc); ``tests/unit/schemas/test_models_match_avsc.py``
fails when the two sides disagree. The ``.avsc`` files are the contract that
any Avro library decodes; these models are the Python view of it.

Events are immutable and named in the past tense. Identifiers are plain
strings on the wire; ``NewType`` aliases keep them apart in Python.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NewType

from pydantic import BaseModel, ConfigDict, Field

SessionId = NewType("SessionId", str)
CallId = NewType("CallId", str)
EngineId = NewType("EngineId", str)
CheckpointId = NewType("CheckpointId", str)


class Model(BaseModel):
    """Base of every schema model: frozen, no extra fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


# --------------------------------------------------------------------------- enums


class EffectClass(StrEnum):
    """What running a tool does to the world outside the log."""

    PURE = "PURE"
    IDEMPOTENT = "IDEMPOTENT"
    COMPENSATABLE = "COMPENSATABLE"
    IRREVERSIBLE = "IRREVERSIBLE"


class VoteDecision(StrEnum):
    """One voter's opinion on a proposed tool call."""

    APPROVE = "APPROVE"
    REJECT = "REJECT"
    ABSTAIN = "ABSTAIN"
    HOLD = "HOLD"


class KVTier(StrEnum):
    """Where a KV cache block lives."""

    GPU = "GPU"
    CPU = "CPU"
    DISK = "DISK"


class CacheAction(StrEnum):
    """What the cache manager decided for a session's KV cache."""

    PRESERVE = "PRESERVE"
    SWAP = "SWAP"
    DISCARD = "DISCARD"
    PREFETCH = "PREFETCH"
    RELEASE = "RELEASE"


class ResourceKind(StrEnum):
    """What a tool acquired through the executor (owned by its session, released at its end)."""

    DIRECTORY = "DIRECTORY"
    FILE = "FILE"
    PROCESS = "PROCESS"
    PORT = "PORT"
    CONTAINER = "CONTAINER"


class ApprovalDecision(StrEnum):
    """An operator's answer to a held or in-doubt tool call."""

    APPROVE = "APPROVE"
    DENY = "DENY"
    RETRY = "RETRY"
    MARK_DONE = "MARK_DONE"


# --------------------------------------------------------------- nested records


class Vote(Model):
    """One voter's vote on a proposed tool call, kept in the verdict."""

    voter: str = Field(description="Name of the voter (e.g. allow_list, arg_schema, rate_limit, human_approval).")
    decision: VoteDecision = Field(description="The voter's decision.")
    reason: str = Field(description="Why the voter decided so, for people reading the audit.")


class EffectRef(Model):
    """A tool call with an external effect, as listed in a checkpoint."""

    call_id: str = Field(description="The tool call's id within its session.")
    tool: str = Field(description="Name of the tool that ran.")
    effect_class: EffectClass = Field(description="Effect class the tool declared.")
    status: str = Field(description="Last known status: proposed, committed, started, completed, failed or in_doubt.")


# ------------------------------------------------------------- agent.actions


class SessionStarted(Model):
    """The planner began a session running an agent program."""

    program: str = Field(description="Name of the agent program (e.g. trace, react).")
    args_json: str = Field(description="The program's arguments as a JSON object.")
    parent_session_id: str | None = Field(
        default=None, description="Session this one was forked from, or null for a root session."
    )


class SessionFinished(Model):
    """The program returned its final answer; the session is done."""

    output_json: str = Field(description="The program's final output as JSON.")
    num_llm_calls: int = Field(description="LLM calls the session made in all.")
    num_tool_calls: int = Field(description="Tool calls the session made in all.")


class SessionFailed(Model):
    """The session stopped for good because of an error."""

    reason: str = Field(description="What went wrong, in words.")
    error_type: str = Field(description="Machine-readable error class (e.g. InvalidAction).")


class LLMCallStarted(Model):
    """The planner sent a prompt to an inference engine."""

    call_id: str = Field(description="The LLM call's id within its session; deterministic per turn.")
    turn: int = Field(description="Zero-based turn number of this call in the session.")
    engine_id: str = Field(description="The engine instance that serves the call.")
    prompt_tokens: int = Field(description="Tokens in the whole prompt (the context so far).")
    max_output_tokens: int = Field(description="Upper bound on generated tokens.")
    prompt_digest: str = Field(description="SHA-256 hex digest of the prompt, to detect nondeterminism on replay.")
    # Program-level scheduling (services/scheduling.py): what the call was ranked by, so that replay,
    # audit and analyze can say why a call waited. All null on a record written before release 8.
    priority: int | None = Field(
        default=None,
        description="The priority the engine request carried (vLLM's scale, lower is served first: a virtual start "
        "time in milliseconds of log time, services.scheduling), or null: sent without one (scheduling off), or a "
        "record written before the field existed.",
        json_schema_extra={"since_release": 8},
    )
    priority_attained_ms: float | None = Field(
        default=None,
        description="The attained service the priority was computed from: prefill and decode milliseconds of the "
        "program's completed calls on its critical path, or null.",
        json_schema_extra={"since_release": 8},
    )
    priority_age_ms: float | None = Field(
        default=None,
        description="The recorded age the priority was computed from (engine and tool milliseconds of the program's "
        "critical path, before the cap): it anchors the call at its program's start; or null.",
        json_schema_extra={"since_release": 8},
    )
    priority_warm: bool | None = Field(
        default=None,
        description="Whether the priority had the warm credit (the cache manager preserved the session's KV when it "
        "was computed), or null.",
        json_schema_extra={"since_release": 8},
    )


class LLMCallCompleted(Model):
    """The engine returned the output of an LLM call."""

    call_id: str = Field(description="The LLM call's id within its session.")
    engine_id: str = Field(description="The engine instance that served the call.")
    prompt_tokens: int = Field(description="Tokens in the prompt as the engine counted them.")
    cached_tokens: int = Field(description="Prompt tokens served from the KV cache (not recomputed).")
    output_tokens: int = Field(description="Tokens generated.")
    output_text: str = Field(description="The generated text (may be synthetic for simulated engines).")
    finish_reason: str = Field(description="Why generation stopped (stop, length, ...).")
    queue_ms: float = Field(description="Milliseconds the request waited before it was scheduled.")
    prefill_ms: float = Field(description="Milliseconds spent computing the uncached prompt tokens.")
    decode_ms: float = Field(description="Milliseconds spent generating output tokens.")
    tool_calls_json: str | None = Field(
        default=None,
        description="The tool calls of a chat reply as a JSON list of {id, name, arguments} (arguments: the raw "
        "string the model emitted, malformed or not), or null: none, or a record written before the field existed.",
        json_schema_extra={"since_release": 3},
    )


class ToolCallProposed(Model):
    """The program asked to run a tool; nothing runs before a commit verdict."""

    call_id: str = Field(description="The tool call's id within its session; deterministic per turn.")
    tool: str = Field(description="Name of the tool to run.")
    arguments_json: str = Field(description="The tool's arguments as a JSON object.")
    effect_class: EffectClass = Field(description="Effect class the tool declares.")
    idempotency_key: str = Field(
        description="Key that makes retries of this call safe; derived from session and call id."
    )
    compensation_tool: str | None = Field(
        default=None, description="For compensatable tools: the tool that undoes this one, else null."
    )
    resource: str | None = Field(
        default=None, description="External resource the call touches (for merge conflict detection), or null."
    )


class CheckpointTaken(Model):
    """A consistent cut of the session and a digest of its folded state."""

    checkpoint_id: str = Field(description="Id of the checkpoint, unique within the session.")
    cut: dict[str, int] = Field(description="For each topic, the offset of the next record after the cut.")
    state_digest: str = Field(description="SHA-256 hex digest of the folded session state at the cut.")
    effects: list[EffectRef] = Field(description="Tool calls with external effects before the cut.")
    num_events: int = Field(description="Events of the session folded into this checkpoint.")


class ForkCreated(Model):
    """This session was forked from a parent at one of its checkpoints."""

    parent_session_id: str = Field(description="The session forked from.")
    checkpoint_id: str = Field(description="The parent's checkpoint where the fork branches off.")
    cut: dict[str, int] = Field(description="The parent's cut, copied from the checkpoint, by reference.")


class RestoreApplied(Model):
    """The session was rewound to a checkpoint; later events are abandoned for the fold."""

    checkpoint_id: str = Field(description="Checkpoint the session was rewound to.")
    num_abandoned: int = Field(description="Events after the checkpoint that the fold now ignores.")
    compensated_call_ids: list[str] = Field(description="Tool calls whose compensations ran before the restore.")


class RestoreRefused(Model):
    """A restore was refused because an effect after the checkpoint cannot be undone."""

    checkpoint_id: str = Field(description="Checkpoint the operator asked to restore.")
    blocking_call_ids: list[str] = Field(description="Tool calls that block the restore.")
    reason: str = Field(description="Why the restore was refused, naming the blocking effect.")


class MergeApplied(Model):
    """Branch results were folded back into this (parent) session."""

    branch_session_ids: list[str] = Field(description="Branches that were merged.")
    results_json: str = Field(description="Each branch's final output, as a JSON object keyed by branch.")


class MergeConflict(Model):
    """A merge was not applied because branches conflict."""

    branch_session_ids: list[str] = Field(description="Branches that were asked to merge.")
    conflicts: list[str] = Field(description="Each conflict in words, naming the branches and calls.")
    resources: list[str] = Field(description="External resources touched by more than one branch.")


# ------------------------------------------------------------ agent.verdicts


class ToolCallCommitted(Model):
    """The decider allowed a proposed tool call to run."""

    call_id: str = Field(description="The tool call's id within its session.")
    votes: list[Vote] = Field(description="Every voter's vote.")
    policy: str = Field(description="The decision policy applied over the votes.")


class ToolCallAborted(Model):
    """The decider refused a proposed tool call; it never runs."""

    call_id: str = Field(description="The tool call's id within its session.")
    votes: list[Vote] = Field(description="Every voter's vote.")
    policy: str = Field(description="The decision policy applied over the votes.")
    reason: str = Field(description="Why the call was refused.")


# ------------------------------------------------------------- agent.effects


class ToolCallStarted(Model):
    """The executor is about to run a committed tool call."""

    call_id: str = Field(description="The tool call's id within its session.")
    tool: str = Field(description="Name of the tool.")
    idempotency_key: str = Field(description="Key passed to the tool so that a retry is not a second effect.")
    attempt: int = Field(description="1 for the first run, 2 for the first retry, and so on.")


class ToolCallCompleted(Model):
    """The tool returned a result."""

    call_id: str = Field(description="The tool call's id within its session.")
    result_json: str = Field(description="The tool's result as JSON.")
    result_tokens: int = Field(description="Tokens the result adds to the context.")
    duration_ms: float = Field(description="Milliseconds the tool ran.")


class ToolCallFailed(Model):
    """The tool raised or timed out."""

    call_id: str = Field(description="The tool call's id within its session.")
    error: str = Field(description="The error, in words.")
    error_type: str = Field(description="Machine-readable error class.")
    retryable: bool = Field(description="Whether running the call again may succeed.")
    duration_ms: float = Field(description="Milliseconds until the failure.")


class ToolCallInDoubt(Model):
    """An irreversible call started but never completed; an operator must resolve it."""

    call_id: str = Field(description="The tool call's id within its session.")
    tool: str = Field(description="Name of the tool.")
    effect_class: EffectClass = Field(description="Effect class of the tool (irreversible).")
    reason: str = Field(description="Why the outcome is unknown.")


# --------------------------------------------------------------- kv.events


class KVBlocksStored(Model):
    """The engine stored KV blocks of a session (vLLM BlockStored)."""

    engine_id: str = Field(description="The engine instance.")
    block_hashes: list[str] = Field(description="Hashes of the stored blocks, in prefix order, as hex strings.")
    parent_block_hash: str | None = Field(default=None, description="Hash of the block before the first one, or null.")
    num_tokens: int = Field(description="Tokens held by the stored blocks.")
    block_size: int = Field(description="Tokens per block.")
    tier: KVTier = Field(description="Tier the blocks were stored in.")


class KVBlocksRemoved(Model):
    """The engine freed KV blocks (vLLM BlockRemoved)."""

    engine_id: str = Field(description="The engine instance.")
    block_hashes: list[str] = Field(description="Hashes of the removed blocks, as hex strings.")
    tier: KVTier = Field(description="Tier the blocks were removed from.")


class KVAllBlocksCleared(Model):
    """The engine dropped its whole prefix cache (vLLM AllBlocksCleared)."""

    engine_id: str = Field(description="The engine instance.")


class KVCacheHit(Model):
    """An LLM call found part of its prompt in the KV cache."""

    engine_id: str = Field(description="The engine instance.")
    call_id: str = Field(description="The LLM call that hit.")
    cached_tokens: int = Field(description="Prompt tokens served from the cache.")
    prompt_tokens: int = Field(description="Tokens in the whole prompt.")
    tier: KVTier = Field(description="Tier the hit was served from.")


class KVSwapCompleted(Model):
    """Blocks of a session finished moving between tiers."""

    engine_id: str = Field(description="The engine instance.")
    from_tier: KVTier = Field(description="Tier the blocks left.")
    to_tier: KVTier = Field(description="Tier the blocks arrived in.")
    num_blocks: int = Field(description="Blocks moved.")
    duration_ms: float = Field(description="Milliseconds the transfer took.")


# -------------------------------------------------------------- kv.decisions


class CacheDecisionMade(Model):
    """The cache manager decided what happens to a session's KV cache."""

    engine_id: str = Field(description="The engine that holds the session's cache.")
    action: CacheAction = Field(description="Preserve, swap, discard, prefetch or release.")
    ttl_ms: int | None = Field(
        default=None,
        description=(
            "Milliseconds until the manager decides again: for preserve and prefetch, the pin's TTL; for swap, "
            "when it looks again to prefetch; for release, only a loose hold (engines with ranked pins); else null."
        ),
    )
    score: float = Field(description="Survival score: expected benefit per byte-second of memory.")
    next_reference_ms: float | None = Field(
        default=None, description="Expected milliseconds until the session's next LLM call; null when infinite."
    )
    num_blocks: int = Field(description="KV blocks the decision applies to.")
    reason: str = Field(description="Why, in words.")


# ------------------------------------------------------------- ops.commands


class ApprovalGiven(Model):
    """An operator approved, denied, retried or marked done a tool call."""

    call_id: str = Field(description="The tool call concerned.")
    decision: ApprovalDecision = Field(description="The operator's decision.")
    author: str = Field(description="The person who decided.")
    reason: str = Field(description="Why, in the author's words.")


class SessionRequested(Model):
    """An operator (or logctl run) asked for a new session of a program; the planner starts it."""

    program: str = Field(description="Name of the agent program to run (e.g. trace, react).")
    args_json: str = Field(description="The program's arguments as a JSON object.")
    author: str = Field(description="The person or tool that asked.")


class CancelRequested(Model):
    """An operator asked to cancel a session."""

    author: str = Field(description="The person who asked.")
    reason: str = Field(description="Why.")


class CheckpointRequested(Model):
    """An operator asked for a checkpoint of a session."""

    author: str = Field(description="The person who asked.")
    checkpoint_id: str = Field(description="Id the checkpoint will take.")


class ForkRequested(Model):
    """An operator asked to fork a session at a checkpoint."""

    author: str = Field(description="The person who asked.")
    checkpoint_id: str = Field(description="The checkpoint to fork at.")
    fork_session_id: str = Field(description="Id of the new session.")


class RestoreRequested(Model):
    """An operator asked to rewind a session to a checkpoint."""

    author: str = Field(description="The person who asked.")
    checkpoint_id: str = Field(description="The checkpoint to restore.")
    dry_run: bool = Field(description="Only report what would happen.")


class MergeRequested(Model):
    """An operator asked to merge branches into a parent session."""

    author: str = Field(description="The person who asked.")
    branch_session_ids: list[str] = Field(description="Branches to merge into this session.")


# ---------------------------------------------------------------- agent.dlq


class RecordDeadLettered(Model):
    """A record that could not be decoded or validated, set aside with the reason."""

    source_topic: str = Field(description="Topic the bad record was read from.")
    source_partition: int = Field(description="Partition it was read from.")
    source_offset: int = Field(description="Offset it was read at.")
    source_session_id: str | None = Field(default=None, description="The record's key, when it had one.")
    error_type: str = Field(description="Exception class that rejected it (e.g. BrokenChain).")
    reason: str = Field(description="What is wrong with it, in words.")
    consumer_group: str = Field(description="Consumer group that found the problem.")
    raw_value: bytes = Field(description="The record's bytes, unchanged.")


# ------------------------------------------------------------- agent.gateway


class GatewayLLMCallServed(Model):
    """The gateway recorded an external agent's chat completion before the client saw it."""

    call_id: str = Field(description="The LLM call's id within its session (llm-<step>).")
    turn: int = Field(description="Zero-based number of this call among the session's LLM calls.")
    model: str = Field(description="The model the client asked for.")
    engine_id: str = Field(description="The engine instance that served the call.")
    request_digest: str = Field(
        description="SHA-256 hex of the request (model, messages, tools, options): same for a re-sent one."
    )
    idempotency_key: str | None = Field(default=None, description="The client's Idempotency-Key header, or null.")
    prompt_digest: str = Field(description="SHA-256 hex digest of the messages and tools.")
    prompt_tokens: int = Field(description="Tokens in the prompt as the engine counted them.")
    cached_tokens: int = Field(description="Prompt tokens served from the KV cache.")
    output_tokens: int = Field(description="Tokens generated.")
    max_output_tokens: int = Field(description="The client's max_tokens, or 0 when it gave none.")
    output_text: str = Field(description="The assistant message's text (may be empty when it only calls tools).")
    tool_calls_json: str = Field(
        description="The tool calls: a JSON list of {call_id (tool-<step>), id (the client's), name, arguments}."
    )
    finish_reason: str = Field(description="Why generation stopped (stop, length, tool_calls).")
    response_id: str = Field(description="The id of the completion the client got.")
    created: int = Field(description="The completion's created time (Unix seconds), as the client got it.")
    queue_ms: float = Field(
        description="Milliseconds the request waited in the engine (0 when the engine does not say)."
    )
    prefill_ms: float = Field(
        description="Milliseconds the engine spent on the uncached prompt (0 when it does not say)."
    )
    decode_ms: float = Field(description="Milliseconds the engine spent generating (0 when it does not say).")
    engine_ms: float = Field(description="Milliseconds from the gateway's request to the engine's last byte.")
    stream: bool = Field(description="Whether the client asked for server-sent events.")
    # Program-level scheduling, as on LLMCallStarted (which the planner's adoption copies it to).
    priority: int | None = Field(
        default=None,
        description=(
            "The priority the gateway gave the engine request (services.scheduling; it replaces the client's), or "
            "null: scheduling off, or a record written before the field existed."
        ),
        json_schema_extra={"since_release": 8},
    )
    priority_attained_ms: float | None = Field(
        default=None,
        description=("The attained service the priority was computed from (the session's recorded calls), or null."),
        json_schema_extra={"since_release": 8},
    )
    priority_age_ms: float | None = Field(
        default=None,
        description=(
            "The recorded age the priority was computed from (the session's calls and tool gaps, before the cap), "
            "or null."
        ),
        json_schema_extra={"since_release": 8},
    )
    priority_warm: bool | None = Field(
        default=None,
        description=("Whether the priority had the warm credit, or null."),
        json_schema_extra={"since_release": 8},
    )


class GatewayToolResultReported(Model):
    """An external agent reported the result of a tool call it ran itself (recorded, never run)."""

    call_id: str = Field(description="The tool call's id within its session (tool-<step>).")
    tool_call_id: str = Field(description="The id the client knows the call by.")
    result_json: str = Field(description="The tool message's content as JSON (a JSON string unless it was JSON).")
    result_tokens: int = Field(
        description="Estimated tokens the result adds to the context (characters / 4, rounded up)."
    )
    gap_ms: float = Field(
        description="Milliseconds from the call's release to the client until the client reported its result."
    )


# ------------------------------------------------- agent.effects: resources


class ResourceAcquiring(Model):
    """The executor is about to create a resource for a tool call; logged before it exists, so that a
    crash between creating and logging it cannot leak it (recovery finds it by its location)."""

    resource_id: str = Field(description="Id of the resource within its session: <call_id>/<attempt>/<n>.")
    call_id: str = Field(description="The tool call that acquires it.")
    tool: str = Field(description="Name of the tool.")
    kind: ResourceKind = Field(description="Directory, file, process, port or container.")
    location: str = Field(
        description="Where it will be, derived from the resource id: a path, a container name, or the marker "
        "AGENTLOG_RESOURCE=<token> in a process's environment; empty for a port (the kernel picks it)."
    )


class ResourceAcquired(Model):
    """The resource exists and its session owns it until it is released."""

    resource_id: str = Field(description="Id of the resource within its session.")
    handle: str = Field(description="How to reach it: the path, the process id, the port number, the container id.")


class ResourceReleased(Model):
    """The resource is gone (released, or found gone); a release of a released resource appends nothing."""

    resource_id: str = Field(description="Id of the resource within its session.")
    reason: str = Field(description="Why it was released: the session ended, a restore abandoned its call, ...")
    detail: str = Field(description="What releasing it took, in words (e.g. killed with SIGKILL after SIGTERM).")


class ResourceReleaseFailed(Model):
    """A release attempt failed; the executor tries again after a backoff and never forgets the resource."""

    resource_id: str = Field(description="Id of the resource within its session.")
    attempt: int = Field(description="1 for the first failed attempt, 2 for the next, and so on.")
    reason: str = Field(description="Why it was being released.")
    error: str = Field(description="Why the release failed, in words.")
    retry_in_ms: float = Field(description="Milliseconds until the next attempt.")


class GatewaySessionEnded(Model):
    """The gateway ended an external agent's session: no request came for the idle timeout, or the client
    finished it. The planner records it as the session's SessionFinished; later requests are refused."""

    reason: str = Field(description="Why, in words (e.g. no request for 300 s, or finished by the client).")
    cause: str = Field(description="Machine-readable cause: idle or client.")
    num_llm_calls: int = Field(description="LLM calls the gateway recorded for the session.")


# ------------------------------------------------------------ routing (release 7)


class EngineRouted(Model):
    """The planner chose the engine (and the model size) for an LLM call, before asking it; a failover is a new
    route of the same call."""

    call_id: str = Field(description="The LLM call's id within its session.")
    request_id: str = Field(description="The engine request id (the same on every attempt of the call).")
    attempt: int = Field(description="0 for the call's first route, 1 for its first failover, and so on.")
    engine_id: str = Field(description="The engine the call is sent to.")
    reason: str = Field(description="Why this engine: only, round_robin, least_loaded, locality, load or failover.")
    detail: str = Field(description="The router's reason in words (the queue waits and cached tokens it compared).")
    router: str = Field(description="The routing policy that chose (round_robin, least_loaded, locality).")
    prompt_tokens: int = Field(description="Tokens in the call's prompt.")
    expected_cached_tokens: int = Field(
        description="Prompt tokens the planner believed the chosen engine holds for the session (from the log)."
    )
    expected_recompute_tokens: int = Field(description="Prompt tokens the router expects the chosen engine to compute.")
    model_size: str = Field(description="The model size chosen for the step: small or large.")
    size_reason: str = Field(
        description="Why that size (declared by the program, pinned by an operator, learned from the log, ...)."
    )
    failed_engine_id: str | None = Field(
        default=None, description="For a failover: the engine the call left (unreachable); else null."
    )


class ModelPinRequested(Model):
    """An operator pinned a session's LLM calls to one model size (or unpinned it); the planner obeys from its
    next call."""

    author: str = Field(description="The person who asked.")
    size: str | None = Field(default=None, description="small or large; null removes the pin.")
    reason: str = Field(description="Why, in the author's words.")


class GatewayEngineRouted(Model):
    """The gateway chose the engine for an external agent's LLM call (its claim, on agent.gateway; the planner
    adopts it as the session's EngineRouted); a failover is a new route of the same call."""

    call_id: str = Field(description="The LLM call's id within its session.")
    request_id: str = Field(description="The engine request id (the same on every attempt of the call).")
    attempt: int = Field(description="0 for the call's first route, 1 for its first failover, and so on.")
    engine_id: str = Field(description="The engine the call is sent to.")
    reason: str = Field(description="Why this engine: only, round_robin, least_loaded, locality, load or failover.")
    detail: str = Field(description="The router's reason in words (the queue waits and cached tokens it compared).")
    router: str = Field(description="The routing policy that chose (round_robin, least_loaded, locality).")
    prompt_tokens: int = Field(description="Tokens in the call's prompt.")
    expected_cached_tokens: int = Field(
        description="Prompt tokens the gateway believed the chosen engine holds for the session (from its own records)."
    )
    expected_recompute_tokens: int = Field(description="Prompt tokens the router expects the chosen engine to compute.")
    model_size: str = Field(
        description="The model size of the call: the size of the engines serving the model the client asked for "
        "(large by default)."
    )
    size_reason: str = Field(description="Why that size (the model the client asked for, or the default).")
    failed_engine_id: str | None = Field(
        default=None, description="For a failover: the engine the call left (unreachable); else null."
    )


EVENT_TYPES: tuple[type[Model], ...] = (
    SessionStarted,
    SessionFinished,
    SessionFailed,
    LLMCallStarted,
    LLMCallCompleted,
    ToolCallProposed,
    CheckpointTaken,
    ForkCreated,
    RestoreApplied,
    RestoreRefused,
    MergeApplied,
    MergeConflict,
    ToolCallCommitted,
    ToolCallAborted,
    ToolCallStarted,
    ToolCallCompleted,
    ToolCallFailed,
    ToolCallInDoubt,
    KVBlocksStored,
    KVBlocksRemoved,
    KVAllBlocksCleared,
    KVCacheHit,
    KVSwapCompleted,
    CacheDecisionMade,
    ApprovalGiven,
    CancelRequested,
    CheckpointRequested,
    ForkRequested,
    RestoreRequested,
    MergeRequested,
    RecordDeadLettered,
    SessionRequested,
    GatewayLLMCallServed,
    GatewayToolResultReported,
    ResourceAcquiring,
    ResourceAcquired,
    ResourceReleased,
    ResourceReleaseFailed,
    GatewaySessionEnded,
    EngineRouted,
    ModelPinRequested,
    GatewayEngineRouted,
)
"""Every body type, in the order of the envelope's ``body`` union (new types go at the end)."""

NESTED_TYPES: tuple[type[Model], ...] = (Vote, EffectRef)
ENUM_TYPES: tuple[type[StrEnum], ...] = (
    EffectClass,
    VoteDecision,
    KVTier,
    CacheAction,
    ApprovalDecision,
    ResourceKind,
)

Event = (
    SessionStarted
    | SessionFinished
    | SessionFailed
    | LLMCallStarted
    | LLMCallCompleted
    | ToolCallProposed
    | CheckpointTaken
    | ForkCreated
    | RestoreApplied
    | RestoreRefused
    | MergeApplied
    | MergeConflict
    | ToolCallCommitted
    | ToolCallAborted
    | ToolCallStarted
    | ToolCallCompleted
    | ToolCallFailed
    | ToolCallInDoubt
    | KVBlocksStored
    | KVBlocksRemoved
    | KVAllBlocksCleared
    | KVCacheHit
    | KVSwapCompleted
    | CacheDecisionMade
    | ApprovalGiven
    | CancelRequested
    | CheckpointRequested
    | ForkRequested
    | RestoreRequested
    | MergeRequested
    | RecordDeadLettered
    | SessionRequested
    | GatewayLLMCallServed
    | GatewayToolResultReported
    | ResourceAcquiring
    | ResourceAcquired
    | ResourceReleased
    | ResourceReleaseFailed
    | GatewaySessionEnded
    | EngineRouted
    | ModelPinRequested
    | GatewayEngineRouted
)
"""Any event body."""
