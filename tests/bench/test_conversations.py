"""The REALTALK loader of ``bench/conversations.py``, on small chats written here (the real
set is not in this repository)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from bench.conversations import _ranker, load_realtalk, split
from torpor.memory.ranking import HybridRanker


def _chat(n: int, a: str, b: str) -> dict[str, Any]:
    return {
        "name": {"speaker_1": a, "speaker_2": b},
        "session_2": [
            {
                "clean_text": "back home now",
                "speaker": a,
                "date_time": "02.01.2024, 09:00:00",
                "dia_id": "D2:1",
            },
        ],
        "session_1": [
            {
                "clean_text": "I went skiing",
                "speaker": a,
                "date_time": "29.12.2023, 22:42:04",
                "dia_id": "D1:1",
            },
            {
                "clean_text": "",
                "speaker": b,
                "date_time": "29.12.2023, 22:43:00",
                "dia_id": "D1:2",
                "blip_caption": "a dog on a beach",
            },
        ],
        "qa": [
            {
                "question": f"What does {a} do in winter?",
                "evidence": ["D1:1", "D9:9"],
                "category": 1,
            },
            {"question": "When was the dog on the beach?", "evidence": ["D1:2"], "category": 2},
            {"question": "No evidence here", "evidence": ["D7:1"], "category": 3},
        ],
    }


@pytest.fixture
def data(tmp_path: Path) -> Path:
    (tmp_path / "data" / "locomo").mkdir(parents=True)
    for n, a, b in ((1, "Emi", "Elise"), (2, "Kevin", "Elise"), (10, "Fahim", "Akib")):
        (tmp_path / "data" / f"Chat_{n}_{a}_{b}.json").write_text(json.dumps(_chat(n, a, b)))
    # another set split into the same format: never read
    (tmp_path / "data" / "locomo" / "Chat_1_X_Y.json").write_text(json.dumps(_chat(1, "X", "Y")))
    return tmp_path


def test_realtalk_reads_its_chats_in_order_and_no_other_set(data: Path) -> None:
    convs = load_realtalk(data, None)
    assert [c.name for c in convs] == [
        "realtalk/Chat_1_Emi_Elise",
        "realtalk/Chat_2_Kevin_Elise",
        "realtalk/Chat_10_Fahim_Akib",
    ]
    assert [c.name for c in load_realtalk(data, 1)] == ["realtalk/Chat_1_Emi_Elise"]
    assert [c.name for c in split(convs, "dev")] == [convs[0].name, convs[2].name]
    assert [c.name for c in split(convs, "test")] == [convs[1].name]


def test_realtalk_turns_keep_speaker_time_session_and_captions(data: Path) -> None:
    conv = load_realtalk(data, 1)[0]
    assert [(t.role, t.session, t.text) for t in conv.turns] == [
        ("Emi", "session_1", "I went skiing"),
        ("Elise", "session_1", "[shares a photo: a dog on a beach]"),
        ("Emi", "session_2", "back home now"),
    ]
    assert conv.turns[0].at == datetime(2023, 12, 29, 22, 42, 4, tzinfo=UTC)
    assert [t.at for t in conv.turns] == sorted(t.at for t in conv.turns)
    # evidence maps to turn ids; unknown ids are dropped, a question left with none too
    assert [(q.ability, sorted(q.evidence)) for q in conv.questions] == [
        ("facts (multi-hop)", [0]),
        ("temporal", [1]),
    ]


def test_no_chats_is_an_exit_with_a_pointer(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"bench/README\.md"):
        load_realtalk(tmp_path, None)


def test_ranker_option_sets_hybrid_ranker_fields() -> None:
    assert _ranker("lexical=0.75,reply_top=10,tiered=false") == HybridRanker(
        lexical=0.75, reply_top=10, tiered=False
    )
    with pytest.raises(SystemExit, match="no field"):
        _ranker("nope=1")
