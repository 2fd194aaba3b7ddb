"""The incremental cache manager: exact decisions, orders, ids and memory accounting."""

from __future__ import annotations

import itertools

import pytest

from schemas import events as ev
from schemas.events import CacheAction, KVTier, SessionId
from services.cache import CachePolicy
from services.cache.manager import RANKED_SCAN, CacheManager, Decided, Hold, ManagerConfig, decision_event_id
from services.cache.view import SessionView
from services.engine.cost import CostModel

pytestmark = pytest.mark.unit


class Feed:
    """Builds events for one manager and remembers their ids."""

    def __init__(
        self,
        *,
        gpu: int = 100,
        host: int = 0,
        headroom: int | None = 0,
        ranked_pins: bool = False,
        ranked_wait_factor: float = 1000.0,  # the tests' 5 s gaps are waited for unless a test says otherwise
    ) -> None:
        config = ManagerConfig(
            gpu_total_blocks=gpu,
            host_total_blocks=host,
            headroom_blocks=headroom,
            ranked_pins=ranked_pins,
            ranked_wait_factor=ranked_wait_factor,
        )
        self.manager = CacheManager(config)
        self.ids = itertools.count()
        self.last_id = ""

    def send(self, sid: str, body: ev.Event, at: float) -> list[Decided]:
        self.last_id = f"e{next(self.ids)}"
        return self.manager.apply(self.last_id, SessionId(sid), body, at)

    def llm(self, sid: str, at: float, prompt: int, *, output: int = 16, max_output: int = 16) -> list[Decided]:
        started = ev.LLMCallStarted(
            call_id="c", turn=0, engine_id="e", prompt_tokens=prompt, max_output_tokens=max_output, prompt_digest="d"
        )
        return self.send(sid, started, at)

    def done(self, sid: str, at: float, prompt: int, *, output: int = 16) -> list[Decided]:
        completed = ev.LLMCallCompleted(
            call_id="c",
            engine_id="e",
            prompt_tokens=prompt,
            cached_tokens=0,
            output_tokens=output,
            output_text="",
            finish_reason="stop",
            queue_ms=0,
            prefill_ms=1,
            decode_ms=1,
        )
        return self.send(sid, completed, at)

    def turn(self, sid: str, at: float, prompt: int) -> list[Decided]:
        """An LLM call of ``prompt + 16`` tokens from ``at`` to ``at + 0.1``."""
        return self.llm(sid, at, prompt) + self.done(sid, at + 0.1, prompt)

    def propose(self, sid: str, at: float, tool: str = "search") -> list[Decided]:
        proposed = ev.ToolCallProposed(
            call_id=f"t{at}", tool=tool, arguments_json="{}", effect_class=ev.EffectClass.PURE, idempotency_key="k"
        )
        return self.send(sid, proposed, at)

    def pinned(self, sid: str, at: float, prompt: int) -> Decided:
        """A turn then a tool proposal; returns the (single) gap decision."""
        assert self.turn(sid, at, prompt) == []
        (decided,) = self.propose(sid, at + 0.2)
        return decided


def actions(decided: list[Decided]) -> list[tuple[str, CacheAction, str]]:
    return [(d.session_id, d.decision.action, d.kind) for d in decided]


def test_a_gap_preserves_the_session_with_a_ttl_of_twice_its_next_reference_distance() -> None:
    feed = Feed()
    decided = feed.pinned("a", 0.0, 304)  # 304 + 16 tokens = 20 blocks
    d = decided.decision
    assert (d.action, d.num_blocks, d.next_reference_s, d.ttl_s) == (CacheAction.PRESERVE, 20, 5.0, 10.0)
    assert decided.kind == "gap" and decided.trigger_id == feed.last_id and decided.at == pytest.approx(0.2)
    assert decided.event_id == decision_event_id(feed.last_id, "gap", "a")
    assert feed.manager.hold(SessionId("a")) is Hold.PINNED
    assert feed.manager.gpu_used == 20
    event = decided.to_event("sim-0")
    assert (event.action, event.ttl_ms, event.next_reference_ms, event.num_blocks) == (
        CacheAction.PRESERVE,
        10_000,
        5000.0,
        20,
    )
    # log seconds per manager second: TTLs and distances go back to the log's clock
    assert decided.to_event("sim-0", time_scale=0.01).ttl_ms == 100


def test_a_gap_decision_is_what_the_policy_decides_for_that_session() -> None:
    feed = Feed()
    feed.pinned("a", 0.0, 304)
    feed.turn("b", 1.0, 1000)
    manager = feed.manager
    memory, delays = manager.memory(), manager.delays()  # as of the decision: b is not charged
    (decided,) = feed.propose("b", 1.3)
    view = manager.view(SessionId("b"))  # in the tool phase now
    (expected,) = CachePolicy(latency=manager.policy.latency).decide([view], 1.3, memory, delays)
    assert decided.decision == expected


def test_the_llm_call_charges_its_need_and_frees_it_when_done() -> None:
    feed = Feed()
    assert feed.llm("a", 0.0, 300, max_output=100) == []
    assert feed.manager.gpu_used == 25  # ceil(400 / 16)
    assert feed.manager.hold(SessionId("a")) is Hold.ACTIVE
    feed.done("a", 1.0, 300)
    assert feed.manager.gpu_used == 0  # vLLM frees blocks at the end of a call (LRU)


def test_memory_pressure_evicts_pinned_sessions_lowest_score_first_until_the_call_fits() -> None:
    feed = Feed(gpu=100)
    scores = {sid: feed.pinned(sid, at, prompt).decision.score for sid, at, prompt in
              (("a", 0.0, 304), ("b", 1.0, 624), ("c", 2.0, 144))}  # fmt: skip
    # 20, 40 and 10 blocks, same distance: a bigger context costs more to recompute per block
    assert scores["c"] < scores["a"] < scores["b"]
    assert feed.manager.gpu_used == 70
    decided = feed.llm("d", 3.0, 944)  # needs 60: 130 > 100, evict 30 blocks
    assert actions(decided) == [("c", CacheAction.RELEASE, "pressure"), ("a", CacheAction.RELEASE, "pressure")]
    assert [d.decision.num_blocks for d in decided] == [10, 20]
    assert all(d.trigger_id == feed.last_id for d in decided)
    assert decided[0].event_id == decision_event_id(feed.last_id, "pressure", "c")
    assert feed.manager.gpu_used == 100
    assert feed.manager.hold(SessionId("b")) is Hold.PINNED


def test_a_preserve_leaves_the_largest_call_room_else_the_lowest_scores_go() -> None:
    feed = Feed(gpu=100, headroom=None)  # headroom: the largest call so far
    feed.pinned("b", 0.0, 624)  # 40 blocks; largest call 40: 40 + 40 <= 100
    feed.pinned("a", 1.0, 304)  # 20 blocks: 60 + 40 <= 100
    assert feed.manager.headroom == 40 and feed.manager.gpu_used == 60
    assert feed.turn("c", 2.0, 144) == []  # 10 blocks
    decided = feed.propose("c", 2.3)  # pinned: 70 + 40 > 100, so the lowest score goes: c itself
    assert actions(decided) == [("c", CacheAction.PRESERVE, "gap"), ("c", CacheAction.RELEASE, "pressure")]
    assert decided[1].trigger_id == decided[0].trigger_id
    assert decided[1].event_id == decision_event_id(decided[0].trigger_id, "pressure", "c")
    assert feed.manager.gpu_used == 60
    assert feed.manager.hold(SessionId("c")) is Hold.RELEASED


def test_with_a_host_tier_a_preserve_keeps_no_room_ahead() -> None:
    # The engine's pressure valve moves a pin to the host when a call needs the room
    # (services.engine.control): the same pins as above all stay.
    feed = Feed(gpu=100, host=100, headroom=None)
    feed.pinned("b", 0.0, 624)
    feed.pinned("a", 1.0, 304)
    assert feed.manager.headroom == 0
    assert feed.turn("c", 2.0, 144) == []
    assert actions(feed.propose("c", 2.3)) == [("c", CacheAction.PRESERVE, "gap")]
    assert feed.manager.gpu_used == 70 and feed.manager.hold(SessionId("c")) is Hold.PINNED
    # A headroom given is kept whatever the tiers.
    assert Feed(gpu=100, host=100, headroom=40).manager.headroom == 40


def test_on_ranked_pins_pressure_only_swaps_and_keeps_no_room_ahead() -> None:
    # The engine's valve gives contexts up in the programs' order (services.engine.control):
    # of the pressure below (as in the test after this one), the manager makes only the swap.
    feed = Feed(gpu=100, host=25, headroom=None, ranked_pins=True)
    for sid, at, prompt in (("a", 0.0, 304), ("b", 1.0, 624), ("c", 2.0, 144)):
        assert feed.pinned(sid, at, prompt).decision.action is CacheAction.PRESERVE
    assert feed.manager.headroom == 0
    # a (20 blocks, the lowest score) goes to the host; c (10) would then be released, not fitting
    # in the 5 left, and b (40) too: both stay.
    assert actions(feed.llm("d", 3.0, 944)) == [("a", CacheAction.SWAP, "pressure")]
    assert feed.manager.hold(SessionId("c")) is Hold.PINNED and feed.manager.hold(SessionId("b")) is Hold.PINNED
    # The pins it left stay candidates: a's next call brings it back from the host, and the
    # pressure of that call swaps c into the room a left.
    assert actions(feed.llm("a", 4.0, 304)) == [("c", CacheAction.SWAP, "pressure")]
    assert feed.manager.host_used == 10 and feed.manager.hold(SessionId("b")) is Hold.PINNED


def test_without_a_host_tier_ranked_pins_release_nothing_under_pressure() -> None:
    feed = Feed(gpu=100, headroom=None, ranked_pins=True)
    for sid, at, prompt in (("a", 0.0, 304), ("b", 1.0, 624), ("c", 2.0, 144)):
        feed.pinned(sid, at, prompt)
    assert feed.llm("d", 3.0, 944) == []  # 130 blocks of 100: the engine's valve decides
    assert all(feed.manager.hold(SessionId(sid)) is Hold.PINNED for sid in "abc")


class CountingManager(CacheManager):
    """Counts the views it reads of sessions other than ``caller``: in one pressure eviction,
    the pins it looks at."""

    caller = SessionId("d")
    num_views = 0

    def view(self, session_id: SessionId) -> SessionView:
        if session_id != self.caller:
            self.num_views += 1
        return CacheManager.view(self, session_id)


def test_on_ranked_pins_a_pressure_eviction_stops_after_the_pins_it_may_not_swap() -> None:
    # 30 pins of 10 blocks and a host of 5: none may be swapped, so each eviction would read all
    # 30 at every event while the count stays above capacity; it reads RANKED_SCAN and leaves
    # every pin to the engine's valve, still a candidate for the next eviction.
    feed = Feed(gpu=300, host=5, headroom=None, ranked_pins=True)
    feed.manager = CountingManager(feed.manager.config)
    for i in range(30):
        assert feed.pinned(f"t{i:02d}", 0.01 * i, 144).decision.action is CacheAction.PRESERVE
    assert feed.manager.gpu_used == 300
    for at in (3.0, 3.5):
        feed.manager.num_views = 0
        assert feed.llm("d", at, 944) == []  # 60 blocks more than the GPU holds
        assert feed.manager.num_views == RANKED_SCAN < 30
        assert all(feed.manager.hold(SessionId(f"t{i:02d}")) is Hold.PINNED for i in range(30))
        feed.done("d", at + 0.1, 944)


@pytest.mark.parametrize(("factor", "action"), [(160.0, CacheAction.PRESERVE), (150.0, CacheAction.RELEASE)])
def test_on_ranked_pins_a_session_is_pinned_only_if_it_returns_soon_enough_to_be_waited_for(
    factor: float, action: CacheAction
) -> None:
    # a's 20 blocks (320 tokens) recompute in 32.2 ms by the default cost model and it returns in
    # 5 s: 155 recomputes away, so a factor of 160 waits for it and one of 150 does not.
    recompute_s = CachePolicy().cost.recompute_ms(320) / 1000
    assert 150 < 5.0 / recompute_s < 160
    feed = Feed(gpu=100, headroom=None, ranked_pins=True, ranked_wait_factor=factor)
    d = feed.pinned("a", 0.0, 304).decision
    assert (d.action, d.num_blocks, d.next_reference_s) == (action, 20, 5.0)
    if action is CacheAction.RELEASE:  # sent to the engine as a release, held loose by the manager
        assert d.ttl_s == 10.0 and "released" in d.reason  # the PRESERVE's TTL: when it is decided again
    assert feed.manager.hold(SessionId("a")) is (Hold.PINNED if action is CacheAction.PRESERVE else Hold.LOOSE)
    assert feed.manager.gpu_used == 20  # its blocks stay cached, counted until the engine's LRU takes them
    # Without ranked pins nothing changes: the pin makes no call wait.
    plain = Feed(gpu=100, headroom=None, ranked_wait_factor=factor)
    assert plain.pinned("a", 0.0, 304).decision.action is CacheAction.PRESERVE


def test_a_loose_hold_is_swapped_under_pressure_and_decided_again_at_its_ttl_end() -> None:
    # On ranked pins with a host tier: a (20 blocks, 5 s away) is held loose; the pressure of d's
    # call moves it to the host like a pin (the manager's only eviction there), and b, pinned with
    # a factor that waits for it, stays for the engine's valve.
    feed = Feed(gpu=100, host=25, headroom=None, ranked_pins=True, ranked_wait_factor=150.0)
    assert feed.pinned("a", 0.0, 304).decision.action is CacheAction.RELEASE  # 155 recomputes away
    assert feed.pinned("b", 1.0, 624).decision.action is CacheAction.PRESERVE  # 40 blocks: 77 away
    assert feed.manager.gpu_used == 60
    assert actions(feed.llm("d", 3.0, 944)) == [("a", CacheAction.SWAP, "pressure")]
    assert feed.manager.hold(SessionId("a")) is Hold.SWAPPED and feed.manager.host_used == 20
    # Held loose again, then its TTL (10 s) ends: it is decided again, as a pin's would be.
    loose = Feed(gpu=100, ranked_pins=True, ranked_wait_factor=150.0)
    loose.pinned("a", 0.0, 304)
    (again,) = loose.propose("b", 10.5)  # the log's time passes a's TTL end (10.2 s)
    assert (again.session_id, again.kind, again.decision.action) == ("a", "ttl", CacheAction.RELEASE)
    assert loose.manager.hold(SessionId("a")) is Hold.LOOSE


def test_the_policy_must_price_the_engines_blocks() -> None:
    # A recompute of b blocks is b * block_size tokens: a cost model with other blocks would price
    # every decision (and the ranked wait factor) wrong by their ratio.
    config = ManagerConfig(gpu_total_blocks=10, block_size=32)
    with pytest.raises(
        ValueError, match=r"blocks of 16 tokens, the engine 32: give the policy CostModel\(block_size=32\)"
    ):
        CacheManager(config)
    assert CacheManager(config, CachePolicy(cost=CostModel(block_size=32))).config.block_size == 32


@pytest.mark.parametrize("factor", [0.0, -1.0, float("inf"), float("nan")])
def test_the_ranked_wait_factor_must_be_a_positive_finite_number(factor: float) -> None:
    with pytest.raises(ValueError, match="ranked_wait_factor"):
        ManagerConfig(gpu_total_blocks=10, ranked_wait_factor=factor)


def test_under_pressure_a_victim_is_swapped_while_the_host_has_room() -> None:
    feed = Feed(gpu=100, host=15)
    for sid, at, prompt in (("a", 0.0, 304), ("b", 1.0, 624), ("c", 2.0, 144)):
        feed.pinned(sid, at, prompt)
    decided = feed.llm("d", 3.0, 944)
    # c (10 blocks) fits in the host's 15, a (20) does not
    assert actions(decided) == [("c", CacheAction.SWAP, "pressure"), ("a", CacheAction.RELEASE, "pressure")]
    assert feed.manager.host_used == 10
    feed.turn("c", 4.0, 144)  # its next call swaps it back in
    assert feed.manager.host_used == 0


def test_a_candidate_whose_hold_changed_is_skipped_in_the_heap() -> None:
    feed = Feed(gpu=100)
    for sid, at, prompt in (("a", 0.0, 304), ("b", 1.0, 624), ("c", 2.0, 144)):
        feed.pinned(sid, at, prompt)
    feed.llm("c", 3.0, 144)  # c (lowest score) is back in a call: its heap entry is stale
    decided = feed.llm("d", 3.5, 944)  # 20 + 40 + 10 + 60 = 130: evict 30
    assert actions(decided) == [("a", CacheAction.RELEASE, "pressure"), ("b", CacheAction.RELEASE, "pressure")]


def test_a_ttl_end_decides_again_before_the_event_that_passes_it() -> None:
    feed = Feed()
    first = feed.pinned("a", 0.0, 304)  # PRESERVE at 0.2, TTL 10 s: ends at 10.2
    assert feed.turn("b", 10.0, 100) == []
    decided = feed.llm("b", 12.0, 100)
    (again,) = decided
    assert (again.kind, again.trigger_id) == ("ttl", first.event_id)
    assert again.at == 12.0  # as of the event that passed the TTL end
    assert again.event_id == decision_event_id(first.event_id, "ttl", "a")
    assert (again.decision.action, again.decision.ttl_s) == (CacheAction.PRESERVE, 10.0)
    assert feed.manager.hold(SessionId("a")) is Hold.PINNED


def test_a_jump_of_the_log_time_decides_a_pinned_session_once() -> None:
    feed = Feed()
    feed.pinned("a", 0.0, 304)  # TTL 10 s
    decided = feed.llm("b", 1000.0, 10)  # a hundred TTLs later
    assert [(d.session_id, d.kind, d.at) for d in decided] == [("a", "ttl", 1000.0)]


def test_ttl_ends_fire_in_order_of_end_then_session() -> None:
    feed = Feed()
    feed.pinned("c", 0.0, 304)  # TTL ends at 10.2
    feed.pinned("b", 1.0, 304)  # at 11.2
    feed.pinned("a", 1.0, 304)  # at 11.2 too
    decided = feed.llm("z", 15.0, 10)
    assert [(d.session_id, d.kind) for d in decided] == [("c", "ttl"), ("a", "ttl"), ("b", "ttl")]


def test_a_finished_session_is_discarded_and_frees_its_pin() -> None:
    feed = Feed()
    feed.pinned("a", 0.0, 304)
    feed.turn("a", 1.0, 400)
    decided = feed.send("a", ev.SessionFinished(output_json="{}", num_llm_calls=2, num_tool_calls=1), 1.5)
    assert actions(decided) == [("a", CacheAction.DISCARD, "end")]
    assert decided[0].decision.next_reference_s == float("inf")
    assert decided[0].to_event("sim-0").next_reference_ms is None
    assert feed.manager.gpu_used == 0
    assert feed.manager.hold(SessionId("a")) is Hold.DISCARDED


def test_a_session_with_no_blocks_gets_no_decision() -> None:
    feed = Feed()
    assert feed.propose("a", 0.0) == []
    assert feed.send("a", ev.SessionFailed(reason="x", error_type="E"), 1.0) == []


def test_a_session_holds_its_last_calls_context_until_the_engine_reports_the_call() -> None:
    feed = Feed()
    feed.pinned("a", 0.0, 304)
    assert feed.manager.gpu_used == 20  # 320 tokens: estimated, no KV event yet
    hashes = [f"h{i}" for i in range(5)]
    stored = ev.KVBlocksStored(engine_id="e", block_hashes=hashes, num_tokens=80, block_size=16, tier=KVTier.GPU)
    feed.send("a", stored, 0.3)
    feed.send("a", stored, 0.3)  # the same hashes again: idempotent
    assert feed.manager.gpu_used == 20  # the call is not reported yet: its context stands
    hit = ev.KVCacheHit(engine_id="e", call_id="c", cached_tokens=240, prompt_tokens=304, tier=KVTier.GPU)
    feed.send("a", hit, 0.3)
    # 5 blocks of its own; the 15 it reused are another session's prefix, charged to that one
    assert feed.manager.gpu_used == 5
    feed.send("a", ev.KVBlocksRemoved(engine_id="e", block_hashes=hashes[3:], tier=KVTier.GPU), 0.5)
    assert feed.manager.gpu_used == 3  # the engine is taking it apart: what the log says is left
    assert feed.manager.view(SessionId("a")).gpu_blocks == 3


def test_a_shared_prefix_is_charged_once_not_per_session_that_reuses_it() -> None:
    feed = Feed()
    prefix = [f"p{i}" for i in range(15)]  # a 240-token system prompt, stored by "a"
    for sid, own in (("a", [*prefix, "a0", "a1", "a2", "a3", "a4"]), ("b", ["b0", "b1", "b2", "b3", "b4"])):
        feed.pinned(sid, 0.0, 304)
        stored = ev.KVBlocksStored(engine_id="e", block_hashes=own, num_tokens=16 * len(own), block_size=16,
                                   tier=KVTier.GPU)  # fmt: skip
        feed.send(sid, stored, 0.3)
        feed.send(sid, ev.KVCacheHit(engine_id="e", call_id="c", cached_tokens=240, prompt_tokens=304,
                                     tier=KVTier.GPU), 0.3)  # fmt: skip
    assert feed.manager.gpu_used == 20 + 5  # the prefix once, not twice (40)
    # b's next call: 20 + 8 blocks of context, of which the 15 of the prefix are a's
    feed.llm("b", 1.0, 432)
    assert feed.manager.gpu_used == 20 + (28 - 15)


def test_the_same_events_give_the_same_decisions_and_ids() -> None:
    runs = []
    for _ in range(2):
        feed = Feed(gpu=80, host=10)
        out: list[Decided] = []
        for i in range(12):
            sid = f"s{i % 5}"
            out += feed.turn(sid, i * 1.5, 100 + 64 * i)
            out += feed.propose(sid, i * 1.5 + 0.3)
        out += feed.llm("big", 40.0, 1200)
        runs.append(out)
    assert runs[0] == runs[1]
    assert len({d.event_id for d in runs[0]}) == len(runs[0])
    assert {d.kind for d in runs[0]} >= {"gap", "pressure", "ttl"}


def test_stale_heap_entries_are_compacted() -> None:
    feed = Feed(gpu=10_000)
    for i in range(400):
        feed.turn("a", i * 1.0, 100)  # each call makes the previous pin stale
        feed.propose("a", i * 1.0 + 0.5)
    assert len(feed.manager._candidates) <= 2 * 1 + 64 + 1
    assert len(feed.manager._expiries) <= 2 * 1 + 64 + 1


def test_bad_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="gpu_total_blocks > 0"):
        ManagerConfig(gpu_total_blocks=0)


def test_a_removal_read_before_the_calls_report_does_not_end_the_floor() -> None:
    feed = Feed()
    hashes = [f"h{i}" for i in range(4)]
    stored = ev.KVBlocksStored(engine_id="e", block_hashes=hashes, num_tokens=64, block_size=16, tier=KVTier.GPU)
    feed.send("a", stored, 0.0)
    feed.turn("a", 1.0, 304)  # the planner's events come first ...
    feed.send("a", ev.KVBlocksRemoved(engine_id="e", block_hashes=hashes, tier=KVTier.GPU), 0.1)  # ... an old one
    (decided,) = feed.propose("a", 1.2)
    assert decided.decision.num_blocks == 20  # the call left its 320 tokens on the GPU
    hit = ev.KVCacheHit(engine_id="e", call_id="c", cached_tokens=0, prompt_tokens=304, tier=KVTier.GPU)
    feed.send("a", hit, 1.3)
    assert feed.manager.gpu_used == 20
    feed.send("a", ev.KVBlocksRemoved(engine_id="e", block_hashes=[], tier=KVTier.GPU), 1.4)
    assert feed.manager.gpu_used == 0


def test_the_host_is_charged_what_kv_events_put_there_whoever_decided_it() -> None:
    feed = Feed(gpu=100, host=15)
    on_host = ev.KVBlocksStored(
        engine_id="e", block_hashes=["x0", "x1", "x2", "x3", "x4", "x5"], num_tokens=96, block_size=16, tier=KVTier.CPU
    )
    feed.send("z", on_host, 0.0)  # a session we never swapped holds 6 host blocks
    assert feed.manager.host_used == 6
    for sid, at, prompt in (("a", 0.0, 304), ("b", 1.0, 624), ("c", 2.0, 144)):
        feed.pinned(sid, at, prompt)
    decided = feed.llm("d", 3.0, 944)
    # c (10 blocks) no longer fits in the 9 host blocks left: both are released
    assert actions(decided) == [("c", CacheAction.RELEASE, "pressure"), ("a", CacheAction.RELEASE, "pressure")]


def _swapped_c(feed: Feed) -> Decided:
    """a, b, c pinned; c's tool (search: 20 runs of 6 s seen) starts at 2.3; d's call at 3.0
    swaps c (10 blocks) out to the host and releases a. Returns c's SWAP."""
    for _ in range(20):
        feed.manager.policy.latency.observe("search", 6.0)
    for sid, at, prompt in (("a", 0.0, 304), ("b", 1.0, 624), ("c", 2.0, 144)):
        feed.pinned(sid, at, prompt)
    feed.send("c", ev.ToolCallStarted(call_id="t2.2", tool="search", idempotency_key="k", attempt=1), 2.3)
    swap, release = feed.llm("d", 3.0, 944)
    assert actions([swap, release]) == [("c", CacheAction.SWAP, "pressure"), ("a", CacheAction.RELEASE, "pressure")]
    feed.done("d", 3.1, 944)
    return swap


def test_a_swapped_session_is_prefetched_when_its_relook_time_passes() -> None:
    feed = Feed(gpu=100, host=15)
    swap = _swapped_c(feed)
    policy = feed.manager.policy
    # The SWAP says when to look again: half a margin inside the lead of c's predicted call.
    assert swap.decision.ttl_s == pytest.approx(policy.relook_s(10, swap.decision.next_reference_s))
    relook_at = 3.0 + (swap.decision.ttl_s or 0.0)
    assert 7.0 < relook_at < 8.0
    assert feed.turn("e", 5.0, 10) == []  # before the re-look: nothing
    decided = feed.llm("e", relook_at + 0.1, 10)  # the first event past it
    (prefetch,) = decided
    assert (prefetch.kind, prefetch.trigger_id, prefetch.at) == ("relook", swap.event_id, relook_at + 0.1)
    assert prefetch.event_id == decision_event_id(swap.event_id, "relook", "c")
    d = prefetch.decision
    assert (d.action, d.num_blocks) == (CacheAction.PREFETCH, 10)
    assert d.next_reference_s <= policy.lead_s(10)
    assert d.ttl_s == pytest.approx(max(1.0, 2 * d.next_reference_s))
    # Held like a PRESERVE: pinned, charged its 10 blocks (b's 40 and e's call too), off the host.
    assert feed.manager.hold(SessionId("c")) is Hold.PINNED
    assert (feed.manager.gpu_used, feed.manager.host_used) == (40 + 10 + 2, 0)
    # Its TTL end re-decides it like any pin.
    (again,) = feed.done("e", relook_at + 0.2 + d.ttl_s, 10)
    assert (again.session_id, again.kind, again.trigger_id) == ("c", "ttl", prefetch.event_id)


def test_a_relook_beyond_the_lead_asks_for_the_next_one() -> None:
    feed = Feed(gpu=100, host=15)
    swap = _swapped_c(feed)
    relook_at = 3.0 + (swap.decision.ttl_s or 0.0)
    # c's tool runs longer than every run seen: the estimate falls back to the prior (5 s), beyond
    # the lead: no prefetch; the next look is asked for 4.5 s (less the transfer) later.
    assert feed.turn("e", 9.0, 10) == []
    assert relook_at < 9.0 and feed.manager.hold(SessionId("c")) is Hold.SWAPPED
    completed = ev.ToolCallCompleted(call_id="t2.2", result_json="{}", result_tokens=0, duration_ms=7700.0)
    assert feed.send("c", completed, 10.0) == []  # its next call is imminent now, but no one looks yet
    assert feed.turn("e", 13.0, 10) == []  # 9.0 + 4.49: not yet
    ttl_b, prefetch = feed.llm("e", 13.6, 10)  # b's TTL (ends at 13.2) first, in time order
    assert (ttl_b.session_id, ttl_b.kind) == ("b", "ttl")
    assert (prefetch.session_id, prefetch.decision.action, prefetch.kind) == ("c", CacheAction.PREFETCH, "relook")
    assert prefetch.decision.ttl_s == 1.0  # D = the queueing delay (0): the minimum TTL


def test_a_swapped_session_stays_on_the_host_when_the_gpu_has_no_room_at_its_relook() -> None:
    feed = Feed(gpu=100, host=15)
    swap = _swapped_c(feed)
    relook_at = 3.0 + (swap.decision.ttl_s or 0.0)
    assert feed.llm("e", 7.0, 864) == []  # 55 blocks: with b's 40 pinned, 5 are left
    assert feed.done("e", relook_at + 0.1, 864) == []  # the re-look (before e's end): no room for 10
    assert feed.manager.hold(SessionId("c")) is Hold.SWAPPED
    # Its call is within the lead now: no later re-look is asked for (it returns on its own call).
    assert feed.turn("f", relook_at + 5.0, 10) == [] and feed.manager.hold(SessionId("c")) is Hold.SWAPPED


def test_under_pressure_a_victim_displaces_a_host_resident_worth_less_when_the_host_is_full() -> None:
    # The policy's one eviction rule (CachePolicy.evict), as decide() applies it under a deficit:
    # before, the manager released a victim whenever its blocks did not fit the host's free ones.
    feed = Feed(gpu=100, host=10)
    assert feed.turn("h", 0.0, 144) == []  # 10 blocks, then a human: a long way to its next call
    (pin_h,) = feed.propose("h", 0.2, tool="human")
    pin_s = feed.pinned("s", 1.0, 144)  # 10 blocks, then a search tool: back soon
    assert pin_h.decision.score < pin_s.decision.score
    assert feed.llm("d", 3.0, 1264) == []  # needs 80: 100 used, no eviction
    decided = feed.llm("e", 3.5, 144)  # needs 10: 110 > 100, h goes first; the host has room
    assert actions(decided) == [("h", CacheAction.SWAP, "pressure")]
    assert feed.manager.host_used == 10
    decided = feed.llm("f", 4.0, 144)  # needs 10: s goes, and the host is full
    # h's blocks on the host are worth less per byte-second than s's would be (h returns much
    # later), and discarding them loses less than releasing s: h is displaced, s swapped out.
    assert actions(decided) == [("h", CacheAction.DISCARD, "pressure"), ("s", CacheAction.SWAP, "pressure")]
    assert decided[0].event_id == decision_event_id(feed.last_id, "pressure", "h")
    assert feed.manager.hold(SessionId("h")) is Hold.DISCARDED
    assert feed.manager.hold(SessionId("s")) is Hold.SWAPPED
    assert feed.manager.host_used == 10
