"""Budgeted context: order, ids, and never over the budget (real tokenizer and estimate)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torpor.memory import Memory
from torpor.memory.context import build_context
from torpor.memory.embeddings import estimate_tokens, token_counter
from torpor.memory.models import Episode, Fact, Profile, from_us, new_id, now_us

SAMPLE = [
    "prefers weekly summaries about the quarterly billing reconciliation",
    "Jordan upgraded to the Pro plan on 2026-03-03 (invoice #4411).",
    "Can you send me summaries every week? Thanks!!",
    "naïve café résumé — ünïcödé text, emojis 🎉🎉 and CJK 記憶",
    "x" * 200,
    "a,b,c;d:e!f?g(h)i[j]k{l}",
]


def _fact(text: str) -> Fact:
    t = from_us(now_us())
    return Fact(id=new_id(), scope="app/a", text=text, created_at=t, valid_from=t)


def _episode(text: str) -> Episode:
    t = from_us(now_us())
    return Episode(id=new_id(), scope="app/a", text=text, created_at=t, valid_from=t)


def test_real_tokenizer_is_used_when_available() -> None:
    count = token_counter()
    assert count.__name__ == "wordpiece_tokens"
    assert count("hello world") == 2


@pytest.mark.parametrize("text", SAMPLE)
def test_estimate_is_conservative(text: str) -> None:
    assert estimate_tokens(text) >= token_counter()(text)


def test_sections_in_order_with_ids(mem: Memory) -> None:
    u = mem.scope(app="a", user="u")
    u.set_profile({"name": "Jordan", "plan": "pro"})
    f1 = u.remember("Jordan prefers daily summaries", key="cadence")
    f2 = u.remember("Jordan lives in Lisbon")
    e1 = u.log("user", "please write short summaries")
    ctx = u.context("write Jordan summaries", budget_tokens=400)
    text = ctx.text
    assert text.index("## Profile") < text.index("## Facts") < text.index("## Relevant history")
    assert ctx.ids[0] == f1.id and set(ctx.ids) == {f1.id, f2.id, e1.id}
    assert ctx.profile_used and ctx.tokens == token_counter()(text) <= 400


def test_tiny_budget_gives_a_fitting_block(mem: Memory) -> None:
    u = mem.scope(app="a", user="u")
    u.set_profile({"name": "Jordan"})
    u.remember("Jordan prefers daily summaries")
    for budget in (1, 3, 5, 8, 12):
        ctx = u.context("summaries", budget_tokens=budget)
        assert token_counter()(ctx.text) <= budget
    assert u.context("summaries", budget_tokens=1).text == ""


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budget=st.integers(min_value=1, max_value=200),
    facts=st.lists(st.text(min_size=1, max_size=80).filter(str.strip), max_size=12),
    episodes=st.lists(st.sampled_from(SAMPLE), max_size=6),
    profile=st.dictionaries(st.text(min_size=1, max_size=10), st.text(max_size=30), max_size=4),
)
def test_never_over_budget(
    budget: int, facts: list[str], episodes: list[str], profile: dict[str, str]
) -> None:
    for count in (token_counter(), estimate_tokens):
        ctx = build_context(
            budget_tokens=budget,
            count=count,
            profile=Profile(scope="app/a", data=profile, updated_at=from_us(now_us())),
            facts=[_fact(t) for t in facts],
            episodes=[_episode(t) for t in episodes],
        )
        assert count(ctx.text) <= budget
        assert ctx.tokens <= budget
        assert len(ctx.ids) == len(set(ctx.ids))


def test_non_additive_counter_still_fits() -> None:
    # a counter that charges for joins: the fast pass overshoots, the exact pass must fit
    def joiny(text: str) -> int:
        return len(text.split()) + 3 * text.count("\n")

    ctx = build_context(
        budget_tokens=20,
        count=joiny,
        profile=None,
        facts=[_fact(f"fact number {i}") for i in range(10)],
        episodes=[],
    )
    assert 0 < joiny(ctx.text) <= 20 and ctx.ids
