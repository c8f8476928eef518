"""A seeded generator of multi-session conversations with retrieval questions and gold answers.

The data set stands in for an assistant's memory of many users. Each user talks to the assistant
over several sessions spread across weeks; along the way they state facts about themselves
(single-valued slots such as the city they live in, some of which change later), preferences,
and things that accumulate (pets, hobbies, trips). Chit-chat turns, facts about other people and
mentions of the same vocabulary in unrelated contexts are hard negatives for lexical search.

Every statement produces two records, as an agent with a memory API would write them:

* an **episode** (the raw turn, with role, session and timestamp), and
* a **fact** (a short canonical sentence, keyed by slot for single-valued slots so that a later
  value supersedes the earlier one).

Questions come in six kinds (:data:`KINDS`): ``single`` (one fact stated once), ``multi`` (the
answer is spread over several sessions), ``update`` (gold = the current value only),
``temporal`` (what was true as of a date), ``preference`` (a request whose answer depends on a
stated preference, worded without the preference's words) and ``abstain`` (nothing stored is
relevant; gold is empty). Question wording comes from templates chosen to share few words with
the statements, so lexical overlap alone does not solve the set.

Gold answers are a tuple of *groups*: each group is the set of record ids (fact or episode) that
each carry one required piece of the answer. Recall@k of a ranked list is the share of groups
with at least one id in the top k (see :func:`recall_at_k`).

The output is a pure function of the :class:`GenConfig` (seed included): no clock, no global
random state.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from bench._slots import ABSTAIN_ONLY, FILLER, MULTI_SLOTS, SINGLE_SLOTS, Slot

__all__ = [
    "KINDS",
    "Dataset",
    "Fact",
    "GenConfig",
    "Question",
    "Turn",
    "generate",
    "recall_at_k",
    "synthetic_texts",
]

#: the question kinds, in report order
KINDS = ("single", "multi", "update", "temporal", "preference", "abstain")

_BASE = datetime(2025, 1, 6, 9, 0, tzinfo=UTC)
_ACKS = (
    "Got it, I'll keep that in mind.",
    "Thanks for telling me, noted.",
    "Understood.",
    "Okay, I've made a note of it.",
    "Good to know!",
)


@dataclass(frozen=True)
class GenConfig:
    """What to generate: ``users`` users with ``sessions`` sessions each, from ``seed``."""

    seed: int = 7
    users: int = 40
    sessions: tuple[int, int] = (4, 6)
    filler_turns: tuple[int, int] = (4, 8)
    calib_share: float = 0.3


@dataclass(frozen=True)
class Turn:
    """One conversational turn: an episode record."""

    id: str
    user: str
    session: str
    role: str
    text: str
    at: datetime


@dataclass(frozen=True)
class Fact:
    """A canonical fact extracted from a turn; ``key`` is set for single-valued slots."""

    id: str
    user: str
    session: str
    slot: str
    key: str | None
    value: str
    text: str
    at: datetime
    episode_id: str


@dataclass(frozen=True)
class Question:
    """A question with its gold answer groups (empty for ``abstain``).

    ``current_fact_id`` / ``stale_fact_ids`` are set for ``update`` questions (the keyed fact
    that must come first, and the superseded ones); ``as_of`` for ``temporal`` questions.
    ``split`` is ``"calib"`` (held out, used to calibrate abstention thresholds) or ``"test"``.
    """

    id: str
    user: str
    kind: str
    text: str
    gold: tuple[frozenset[str], ...]
    slot: str | None = None
    as_of: datetime | None = None
    current_fact_id: str | None = None
    stale_fact_ids: tuple[str, ...] = ()
    split: str = "test"

    @property
    def gold_ids(self) -> frozenset[str]:
        """Every id in every gold group."""
        return frozenset().union(*self.gold) if self.gold else frozenset()


@dataclass
class Dataset:
    """The generated conversations, facts and questions."""

    config: GenConfig
    users: list[str] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    facts: list[Fact] = field(default_factory=list)
    questions: list[Question] = field(default_factory=list)

    def fingerprint(self) -> str:
        """A hash of everything generated: equal fingerprints mean equal data sets."""
        h = hashlib.sha256()
        for t in self.turns:
            h.update(f"{t.id}|{t.role}|{t.text}|{t.at.isoformat()}\n".encode())
        for f in self.facts:
            h.update(f"{f.id}|{f.key}|{f.text}|{f.at.isoformat()}\n".encode())
        for q in self.questions:
            groups = sorted(",".join(sorted(g)) for g in q.gold)
            h.update(f"{q.id}|{q.kind}|{q.text}|{groups}|{q.split}\n".encode())
        return h.hexdigest()


def recall_at_k(ranked: Sequence[str], gold: tuple[frozenset[str], ...], k: int = 5) -> float:
    """The share of gold groups with at least one id in ``ranked[:k]`` (1.0 for no groups)."""
    if not gold:
        return 1.0
    top = set(ranked[:k])
    return sum(1 for group in gold if group & top) / len(gold)


class _UserBuilder:
    """Builds one user's sessions, facts and questions from one random stream."""

    def __init__(self, uid: str, rng: random.Random, cfg: GenConfig, start: datetime) -> None:
        self.uid, self.rng, self.cfg = uid, rng, cfg
        n_sessions = rng.randint(*cfg.sessions)
        # sessions 3-9 days apart, so "as of" dates fall between them
        days = [0]
        for _ in range(n_sessions - 1):
            days.append(days[-1] + rng.randint(3, 9))
        self.session_starts = [start + timedelta(days=d, hours=rng.randint(0, 8)) for d in days]
        # what is said in each session: (slot, value) statements
        self.plan: list[list[tuple[Slot, str]]] = [[] for _ in range(n_sessions)]
        self.turns: list[Turn] = []
        self.facts: list[Fact] = []
        self.chains: dict[str, list[Fact]] = {}  # slot name -> facts in time order
        self.used: set[str] = set()

    def plan_statements(self) -> None:
        rng, n = self.rng, len(self.plan)
        singles = rng.sample(SINGLE_SLOTS, k=min(len(SINGLE_SLOTS), rng.randint(6, 8)))
        for slot in singles:
            # a slot changes value once or twice for some users: the knowledge updates
            changes = rng.choices((0, 1, 2), weights=(4, 4, 2))[0] if n >= 3 else 0
            values = rng.sample(slot.values, k=min(len(slot.values), changes + 1))
            sessions = sorted(rng.sample(range(n), k=len(values)))
            for s, v in zip(sessions, values, strict=True):
                self.plan[s].append((slot, v))
            self.used.add(slot.name)
        for slot in rng.sample(MULTI_SLOTS, k=2):
            k = min(rng.randint(2, 3), n, len(slot.values))
            for s, v in zip(
                sorted(rng.sample(range(n), k=k)), rng.sample(slot.values, k=k), strict=True
            ):
                self.plan[s].append((slot, v))
            self.used.add(slot.name)

    def write_sessions(self) -> None:
        rng = self.rng
        for s_idx, statements in enumerate(self.plan):
            sid = f"{self.uid}-s{s_idx + 1}"
            lines: list[tuple[str, str, tuple[Slot, str] | None]] = []
            for _ in range(rng.randint(*self.cfg.filler_turns)):
                lines.append(("user", self._filler(), None))
                lines.append(("assistant", "Sure, happy to help with that.", None))
            for statement in statements:
                slot, value = statement
                pos = rng.randint(0, len(lines) // 2) * 2
                text = rng.choice(slot.statements).format(v=value)
                lines[pos:pos] = [("user", text, statement), ("assistant", rng.choice(_ACKS), None)]
            at = self.session_starts[s_idx]
            for t_idx, (role, text, st) in enumerate(lines):
                at = at + timedelta(seconds=rng.randint(20, 240))
                turn = Turn(f"{sid}-t{t_idx + 1}", self.uid, sid, role, text, at)
                self.turns.append(turn)
                if st is not None:
                    self._add_fact(st[0], st[1], turn)

    def _filler(self) -> str:
        rng = self.rng
        tpl = rng.choice(FILLER)
        pool = rng.choice(SINGLE_SLOTS + MULTI_SLOTS)
        return tpl.format(x=rng.choice(pool.values), n=rng.randint(2, 40))

    def _add_fact(self, slot: Slot, value: str, turn: Turn) -> None:
        fact = Fact(
            id=f"{self.uid}-f{len(self.facts) + 1}",
            user=self.uid,
            session=turn.session,
            slot=slot.name,
            key=slot.name if slot.keyed else None,
            value=value,
            text=slot.fact.format(v=value),
            at=turn.at,
            episode_id=turn.id,
        )
        self.facts.append(fact)
        self.chains.setdefault(slot.name, []).append(fact)

    def questions(self) -> list[Question]:
        rng = self.rng
        out: list[Question] = []
        by_name = {s.name: s for s in SINGLE_SLOTS + MULTI_SLOTS}

        def ask(kind: str, slot: Slot, text: str, gold: list[Fact], **kw: object) -> None:
            groups = tuple(frozenset({f.id, f.episode_id}) for f in gold)
            qid = f"{self.uid}-q{len(out) + 1}"
            out.append(Question(qid, self.uid, kind, text, groups, slot.name, **kw))  # type: ignore[arg-type]

        for name, chain in sorted(self.chains.items()):
            slot = by_name[name]
            if not slot.keyed:
                sessions = {f.session for f in chain}
                if len(sessions) >= 2:
                    ask("multi", slot, rng.choice(slot.questions), chain)
                continue
            kind = "preference" if slot.preference else "single"
            if len(chain) == 1:
                ask(kind, slot, rng.choice(slot.questions), chain)
                continue
            cur, stale = chain[-1], chain[:-1]
            ask(
                "update",
                slot,
                rng.choice(slot.questions),
                [cur],
                current_fact_id=cur.id,
                stale_fact_ids=tuple(f.id for f in stale),
            )
            if not slot.temporal:
                continue
            # a date strictly between two values: the earlier one was true then
            i = rng.randrange(len(chain) - 1)
            lo, hi = chain[i].at, chain[i + 1].at
            when = lo + (hi - lo) * rng.uniform(0.3, 0.7)
            text = rng.choice(slot.temporal).format(d=when.strftime("%B %-d, %Y"))
            ask("temporal", slot, text, [chain[i]], as_of=when)
        unused = [s for s in SINGLE_SLOTS if s.name not in self.used]
        for slot in rng.sample(unused, k=min(1, len(unused))) + rng.sample(ABSTAIN_ONLY, k=2):
            ask("abstain", slot, rng.choice(slot.questions), [])
        return out


def generate(cfg: GenConfig | None = None) -> Dataset:
    """Generate the data set for ``cfg`` (a pure function of it).

    Raises ``ValueError`` for a config with no users or an empty session range.
    """
    cfg = cfg or GenConfig()
    if cfg.users < 1 or cfg.sessions[0] < 1 or cfg.sessions[0] > cfg.sessions[1]:
        raise ValueError(f"bad generator config: {cfg}")
    master = random.Random(cfg.seed)
    ds = Dataset(cfg)
    for u in range(cfg.users):
        uid = f"u{u + 1:03d}"
        rng = random.Random(master.getrandbits(64))
        start = _BASE + timedelta(days=rng.randint(0, 20))
        b = _UserBuilder(uid, rng, cfg, start)
        b.plan_statements()
        b.write_sessions()
        ds.users.append(uid)
        ds.turns.extend(b.turns)
        ds.facts.extend(b.facts)
        ds.questions.extend(b.questions())
    split_rng = random.Random(cfg.seed * 7919 + 1)
    ds.questions = [
        _with_split(q, "calib" if split_rng.random() < cfg.calib_share else "test")
        for q in ds.questions
    ]
    return ds


def _with_split(q: Question, split: str) -> Question:
    return Question(
        q.id,
        q.user,
        q.kind,
        q.text,
        q.gold,
        q.slot,
        q.as_of,
        q.current_fact_id,
        q.stale_fact_ids,
        split,
    )


_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ren",
    "tu",
    "sa",
    "vel",
    "dor",
    "ni",
    "pa",
    "qui",
    "ber",
    "zo",
    "la",
    "mon",
    "tri",
    "ga",
    "ses",
    "fu",
    "ral",
    "po",
    "xen",
    "di",
    "nor",
    "ha",
    "lun",
    "te",
    "vis",
)
_STOP = ("the", "a", "of", "and", "to", "in", "my", "is", "for", "on")


def _vocabulary(size: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words: dict[str, None] = {}
    while len(words) < size:
        words["".join(rng.choices(_SYLLABLES, k=rng.randint(2, 4)))] = None
    return list(words)


def synthetic_texts(n: int, seed: int = 1, vocab: int = 20_000) -> Iterator[str]:
    """``n`` random one-line records for the scale tests, fast (about 1M in 10-20 s).

    Words come from a ``vocab``-word pseudo-vocabulary with a Zipf-Mandelbrot frequency
    (``1 / (rank + 50)``: the commonest word is in about 3% of records), after one common
    English stop word, so a query term's selectivity resembles real text
    (a few very common words, a long tail of rare ones) rather than a uniform bag.
    """
    import numpy as np

    words = _vocabulary(vocab, seed=vocab)
    weights = 1.0 / (np.arange(1, vocab + 1) + 50.0)
    cdf = np.cumsum(weights / weights.sum())
    gen = np.random.default_rng(seed)
    chunk = 10_000
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        lengths = gen.integers(6, 15, size=m)
        picks = np.searchsorted(cdf, gen.random(int(lengths.sum())))
        stops = gen.integers(0, len(_STOP), size=m)
        pos = 0
        for i in range(m):
            ln = int(lengths[i])
            idx = picks[pos : pos + ln]
            pos += ln
            yield f"{_STOP[stops[i]]} " + " ".join(words[j] for j in idx)
