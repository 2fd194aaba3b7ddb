"""The worker's replay rules, on decoded events without a broker (``process`` does no I/O).

After a restart the worker re-reads the log from offset 0; up to the end offsets seen
at start, a decision is appended only when the previous run cannot have appended it:
it is missing from the log and decided after the last logged decision of its own
kv.decisions partition (see workers/cache_manager.py).
"""

from __future__ import annotations

import argparse
import asyncio

import pytest

from log import Draft, LoggedEvent, Position, SharedLog
from log.memory_backend import MemoryBackend
from schemas import events as ev
from schemas.events import CacheAction
from services.cache.manager import ManagerConfig
from tests.unit.services.helpers import envelope
from workers.cache_manager import CacheManagerWorker, in_time_order, scaled

pytestmark = pytest.mark.unit

ACTIONS = "agent.actions"


def memory_log(num_partitions: int, backend: MemoryBackend | None = None) -> SharedLog:
    """The cache manager's SharedLog, started, on a fresh in-memory log (call outside an event loop)."""
    log = SharedLog(backend or MemoryBackend(), actor="cache-manager")

    async def start() -> SharedLog:
        await log.backend.start()
        await log.backend.create_topics(num_partitions)
        return await log.start()

    return asyncio.run(start())


def worker(
    time_scale: float = 1.0,
    num_partitions: int = 1,
    backend: MemoryBackend | None = None,
    config: ManagerConfig | None = None,
) -> CacheManagerWorker:
    log = memory_log(num_partitions, backend)
    return CacheManagerWorker(log, config=config or ManagerConfig(gpu_total_blocks=1000), time_scale=time_scale)


def gap(session: str, offset: int, at_s: float, partition: int = 0) -> list[LoggedEvent]:
    """An LLM call and a tool proposal of ``session`` on a partition of agent.actions, from ``offset``."""
    bodies: list[ev.Event] = [
        ev.LLMCallStarted(call_id="c", turn=0, engine_id="e", prompt_tokens=300, max_output_tokens=20,
                          prompt_digest="d"),
        ev.LLMCallCompleted(call_id="c", engine_id="e", prompt_tokens=300, cached_tokens=0, output_tokens=20,
                            output_text="", finish_reason="stop", queue_ms=0, prefill_ms=1, decode_ms=1),
        ev.ToolCallProposed(call_id=f"t{offset}", tool="search", arguments_json="{}",
                            effect_class=ev.EffectClass.PURE, idempotency_key="k"),
    ]  # fmt: skip
    return [
        LoggedEvent(Position(ACTIONS, partition, offset + i), envelope(body, session=session, at_s=at_s + 0.1 * i))
        for i, body in enumerate(bodies)
    ]


def decision(draft: Draft) -> ev.CacheDecisionMade:
    assert isinstance(draft.body, ev.CacheDecisionMade)
    return draft.body


def test_live_events_are_appended_at_once() -> None:
    events = gap("a", 0, 0.0)
    drafts, ready = worker().process(events, received=1.0)
    assert [decision(d).action for d in drafts] == [CacheAction.PRESERVE]
    assert ready == [1.0]
    assert drafts[0].causation_id == events[2].envelope.event_id and drafts[0].session_id == "a"


def test_a_replay_with_nothing_logged_holds_every_decision_until_it_has_caught_up() -> None:
    w = worker()
    w._boundary = {(ACTIONS, 0): 6}
    drafts, _ = w.process(gap("a", 0, 0.0) + gap("b", 3, 1.0), received=0.0)
    assert drafts == []
    flushed = w._flush_pending()
    assert [d.session_id for d in flushed] == ["a", "b"]
    assert w.stats.num_recovered == 2


def test_a_replay_appends_only_what_follows_the_last_logged_event_of_a_partition() -> None:
    first = worker()
    events = gap("a", 0, 0.0) + gap("b", 3, 1.0) + gap("c", 6, 2.0)
    drafts, _ = first.process(events, received=0.0)
    ids = {d.session_id: str(d.event_id) for d in drafts}
    assert set(ids) == {"a", "b", "c"}

    # The previous run logged b's decision, not a's (it decided otherwise for a) nor c's (it died).
    second = worker()
    second._boundary = {(ACTIONS, 0): 9}
    second._logged = {ids["b"]: decision(drafts[1])}
    assert second.process(events, received=0.0)[0] == []
    assert [d.event_id for d in second._flush_pending()] == [ids["c"]]
    stats = second.stats
    assert (stats.num_replayed, stats.num_diverged, stats.num_recovered, stats.num_adopted) == (1, 1, 1, 0)


def test_a_decision_missing_from_its_partition_is_recovered_when_a_later_one_landed_in_another() -> None:
    """The reviewer's case: one poll's decisions go to two kv.decisions partitions, and the
    append that carried them died half-way, leaving the later one (``d``'s, partition 1)
    and not the earlier one (``a``'s, partition 0). Kafka orders partitions, not batches:
    ``a``'s decision never landed and must be appended (the old rule, which tracked the
    triggering events' agent.actions partition, counted it as diverged and lost it)."""
    first = worker(num_partitions=2)
    assert (first.log.partition_for("a"), first.log.partition_for("d")) == (0, 1)
    events = gap("a", 0, 0.0) + gap("d", 3, 1.0)  # one poll, one agent.actions partition
    drafts, _ = first.process(events, received=0.0)
    ids = {d.session_id: str(d.event_id) for d in drafts}
    assert list(ids) == ["a", "d"]

    second = worker(num_partitions=2)
    second._boundary = {(ACTIONS, 0): 6}
    second._logged = {ids["d"]: decision(drafts[1])}
    assert second.process(events, received=0.0)[0] == []  # held until the replay ends
    assert [d.event_id for d in second._flush_pending()] == [ids["a"]]
    stats = second.stats
    assert (stats.num_replayed, stats.num_diverged, stats.num_recovered) == (1, 0, 1)


def test_a_ttl_decision_lost_in_a_torn_append_is_recovered() -> None:
    """A TTL end is decided for ``a`` (kv.decisions partition 0) when an event of ``d``
    (agent.actions partition 1) passes it, and ``d``'s own PRESERVE (partition 1) follows;
    the append kept ``d``'s and lost ``a``'s. The old rule saw a logged decision after the
    TTL's trigger in the trigger's input partition and dropped the TTL decision."""
    events = gap("a", 0, 0.0, partition=0) + gap("d", 0, 20.0, partition=1)  # a's 10 s TTL ends at 10
    drafts, _ = worker(num_partitions=2).process(events, received=0.0)
    gap_a, ttl_a, gap_d = drafts
    assert (gap_a.session_id, ttl_a.session_id, gap_d.session_id) == ("a", "a", "d")
    assert ttl_a.causation_id == str(gap_a.event_id)  # the TTL end's trigger is the pin
    assert ttl_a.event_id != gap_a.event_id

    second = worker(num_partitions=2)
    second._boundary = {(ACTIONS, 0): 3, (ACTIONS, 1): 3}
    second._logged = {str(d.event_id): decision(d) for d in (gap_a, gap_d)}
    assert second.process(events, received=0.0)[0] == []
    assert [d.event_id for d in second._flush_pending()] == [ttl_a.event_id]
    assert (second.stats.num_replayed, second.stats.num_diverged, second.stats.num_recovered) == (2, 0, 1)


def test_a_missing_decision_before_a_logged_one_of_its_partition_diverged_whatever_the_input_partition() -> None:
    """``a`` and ``b`` are read from two agent.actions partitions but decided into the same
    kv.decisions partition: ``b``'s is logged and came later, so ``a``'s (missing) was not
    decided by the previous run and is not appended late."""
    first = worker(num_partitions=2)
    assert first.log.partition_for("a") == first.log.partition_for("b") == 0
    events = gap("a", 0, 0.0, partition=0) + gap("b", 0, 1.0, partition=1)
    drafts, _ = first.process(events, received=0.0)
    ids = {d.session_id: str(d.event_id) for d in drafts}

    second = worker(num_partitions=2)
    second._boundary = {(ACTIONS, 0): 3, (ACTIONS, 1): 3}
    second._logged = {ids["b"]: decision(drafts[1])}
    assert second.process(events, received=0.0)[0] == []
    assert second._flush_pending() == []
    assert (second.stats.num_replayed, second.stats.num_diverged, second.stats.num_recovered) == (1, 1, 0)


def test_a_logged_decision_that_differs_is_adopted() -> None:
    events = gap("a", 0, 0.0)
    (draft,) = worker().process(events, received=0.0)[0]
    w = worker()
    w._boundary = {(ACTIONS, 0): 3}
    released = decision(draft).model_copy(update={"action": CacheAction.RELEASE, "ttl_ms": None})
    w._logged = {str(draft.event_id): released}
    assert w.process(events, received=0.0)[0] == []
    assert w.stats.num_adopted == 1
    assert w.manager.hold("a").value == "released"  # type: ignore[arg-type]


def adopting(
    config: ManagerConfig, events: list[LoggedEvent], draft: Draft, logged: ev.CacheDecisionMade
) -> CacheManagerWorker:
    """A worker that replays ``events`` and finds ``logged`` in the log under ``draft``'s id."""
    w = worker(config=config)
    w._boundary = {(ACTIONS, 0): len(events)}
    w._logged = {str(draft.event_id): logged}
    assert w.process(events, received=0.0)[0] == []
    return w


def test_a_logged_loose_release_on_ranked_pins_is_adopted_as_a_loose_hold() -> None:
    # A run with a smaller wait factor sent a's PRESERVE as a RELEASE with its TTL (held loose);
    # this run would pin it. Adopting the log's decision holds a loose, as the live run did: its
    # blocks counted, decided again at its TTL end. A RELEASE without a TTL is a plain release.
    ranked = ManagerConfig(gpu_total_blocks=1000, ranked_pins=True, ranked_wait_factor=1e6)
    events = gap("a", 0, 0.0)
    (draft,) = worker(config=ranked).process(events, received=0.0)[0]
    assert decision(draft).action is CacheAction.PRESERVE and decision(draft).ttl_ms == 10_000
    released = decision(draft).model_copy(update={"action": CacheAction.RELEASE, "ttl_ms": None})
    plain = adopting(ranked, events, draft, released)
    assert (plain.stats.num_adopted, plain.manager.hold("a").value, plain.manager.gpu_used) == (1, "released", 0)  # type: ignore[arg-type]

    loose = adopting(ranked, events, draft, decision(draft).model_copy(update={"action": CacheAction.RELEASE}))
    assert (loose.stats.num_adopted, loose.manager.hold("a").value, loose.manager.gpu_used) == (1, "loose", 20)  # type: ignore[arg-type]
    # Its TTL end (10.2 s) passes before b's events at 11 s: a is decided again, as in the live run.
    drafts = loose.process(gap("b", 3, 11.0), received=11.0)[0]
    assert [(d.session_id, decision(d).action) for d in drafts if d.session_id == "a"] == [("a", CacheAction.PRESERVE)]


def test_times_and_ttls_follow_the_time_scale() -> None:
    compressed = worker(time_scale=0.01)  # 1 log second = 100 simulated seconds
    (draft,) = compressed.process(gap("a", 0, 0.0), received=0.0)[0]
    (plain,) = worker().process(gap("a", 0, 0.0), received=0.0)[0]
    assert decision(plain).ttl_ms == 10_000  # twice the prior's 5 s
    assert decision(draft).ttl_ms == 100  # the same 10 simulated seconds, in log time
    completed = ev.ToolCallCompleted(call_id="t", result_json="{}", result_tokens=0, duration_ms=30)
    assert scaled(completed, 0.01).duration_ms == pytest.approx(3000)  # type: ignore[attr-defined]


def test_events_read_again_after_a_rebalance_are_not_folded_twice() -> None:
    w = worker()
    events = gap("a", 0, 0.0)
    assert len(w.process(events, received=0.0)[0]) == 1
    assert w.process(events, received=0.0)[0] == []  # the partition came back and was read from 0
    assert (w.stats.num_events, w.stats.num_skipped) == (3, 3)
    assert w.manager.builder.view("a").turns == 1  # type: ignore[arg-type]


def test_a_polls_partitions_are_folded_in_time_order_each_in_offset_order() -> None:
    early = gap("a", 0, 0.0)  # agent.actions[0] at 0.0 .. 0.2
    late = [LoggedEvent(Position("agent.effects", 1, i), e.envelope) for i, e in enumerate(gap("b", 0, 5.0))]
    assert [e.session_id for e in in_time_order(late + early)] == ["a"] * 3 + ["b"] * 3
    assert list(in_time_order(early)) == early  # one partition: as it came
    # a partition whose clock stepped back keeps its offset order (the fold relies on it)
    backwards = [LoggedEvent(Position("kv.events", 2, i), e.envelope) for i, e in enumerate(gap("c", 0, 9.0)[::-1])]
    merged = list(in_time_order(late + backwards))
    assert [e.position.offset for e in merged if e.position.topic == "kv.events"] == [0, 1, 2]


@pytest.mark.parametrize(
    ("argv", "env", "ranked"), [([], "0", False), ([], "1", True), (["--no-ranked-pins"], "1", False)]
)
def test_the_worker_knows_an_engine_with_ranked_pins_from_the_launchers_announcement(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: str, ranked: bool
) -> None:
    monkeypatch.setenv("AGENTLOG_CACHE_RANKED_PINS", env)  # what the vLLM launcher's endpoints() announce
    parser = argparse.ArgumentParser()
    CacheManagerWorker.add_arguments(parser)
    parser.add_argument("--group", default="g")
    parser.add_argument("--instance-id", default=None)
    args = parser.parse_args(argv)
    w = asyncio.run(CacheManagerWorker.create(memory_log(1, None), args))
    assert w.config.ranked_pins is ranked


def parsed(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cache-manager")
    CacheManagerWorker.add_arguments(parser)
    parser.add_argument("--group", default="g")
    parser.add_argument("--instance-id", default=None)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "env", "factor"), [([], None, 10.0), ([], "4", 4.0), (["--ranked-wait-factor", "2.5"], "4", 2.5)]
)
def test_the_ranked_wait_factor_comes_from_its_flag_else_the_environment(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: str | None, factor: float
) -> None:
    if env is None:
        monkeypatch.delenv("AGENTLOG_CACHE_RANKED_WAIT_FACTOR", raising=False)
    else:
        monkeypatch.setenv("AGENTLOG_CACHE_RANKED_WAIT_FACTOR", env)
    w = asyncio.run(CacheManagerWorker.create(memory_log(1, None), parsed(["--ranked-pins", *argv])))
    assert w.config.ranked_wait_factor == factor


def test_the_workers_policy_prices_the_engines_blocks() -> None:
    w = asyncio.run(CacheManagerWorker.create(memory_log(1, None), parsed(["--block-size", "32"])))
    assert w.config.block_size == 32 and w.manager.policy.cost.block_size == 32


@pytest.mark.parametrize("bad", ["0", "-1", "inf", "nan", "soon"])
def test_a_bad_ranked_wait_factor_is_refused_by_the_parser(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parsed(["--ranked-wait-factor", bad])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line == f"cache-manager: error: argument --ranked-wait-factor: invalid wait_factor value: '{bad}'"
