"""Renamed public names keep working, each with a :class:`DeprecationWarning` naming its
replacement."""

from __future__ import annotations

import warnings

import pytest

import torpor.memory
from torpor.memory import Memory


@pytest.mark.parametrize("name", ["Memory", "ScopedMemory"])
def test_api_module_names_still_resolve_with_a_warning(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"import {name} from torpor.memory"):
        from torpor.memory import api

        value = getattr(api, name)
    assert value is getattr(torpor.memory, name)


def test_api_module_from_import_warns() -> None:
    with pytest.warns(DeprecationWarning, match="torpor.memory.api is deprecated"):
        from torpor.memory.api import Memory
    assert Memory is torpor.memory.Memory


def test_api_module_has_no_other_names() -> None:
    from torpor.memory import api

    with pytest.raises(AttributeError):
        _ = api.recall


def test_rank_weights_is_the_hybrid_ranker_with_a_warning() -> None:
    from torpor.memory import recall

    with pytest.warns(DeprecationWarning, match=r"use torpor\.memory\.HybridRanker"):
        weights = recall.RankWeights
    assert weights is torpor.memory.HybridRanker
    assert weights(tiered=False) == torpor.memory.HybridRanker(tiered=False)


def test_recall_module_has_no_other_names() -> None:
    from torpor.memory import recall

    with pytest.raises(AttributeError):
        _ = recall.Weights


def test_scoped_profile_warns_and_still_returns_the_document(mem: Memory) -> None:
    u = mem.scope(app="a", user="u")
    with pytest.warns(DeprecationWarning, match=r"use get_profile\(\)"):
        assert u.profile() is None
    u.set_profile({"plan": "pro"})
    with pytest.warns(DeprecationWarning, match=r"use get_profile\(\)"):
        doc = u.profile()
    assert doc is not None and doc.data == {"plan": "pro"} == u.get_profile()


def test_get_profile_and_context_do_not_warn(mem: Memory) -> None:
    u = mem.scope(app="a", user="u")
    u.set_profile({"plan": "pro"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert u.get_profile() == {"plan": "pro"}
        assert "pro" in u.context("which plan?").text
