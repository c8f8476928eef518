"""A prompt-ready block of memory that never exceeds a token budget.

Order: the profile, then current facts (those relevant to the query first, then the most
recent others), then relevant episodes. Lines are added greedily while the block,
headers included, stays within ``budget_tokens`` as counted by
:func:`~torpor.memory.embeddings.token_counter` (MiniLM's WordPiece tokenizer, or a
conservative estimate). The finished block is counted whole, so the guarantee holds
whatever the tokenizer does at line joins (see :func:`build_context`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torpor.memory.models import Episode, Fact, Profile

__all__ = ["Context", "build_context"]


@dataclass
class Context:
    """The block (``text``, also ``str(context)``), its size and the ids it used."""

    text: str
    tokens: int
    budget_tokens: int
    ids: list[str] = field(default_factory=list)
    profile_used: bool = False

    def __str__(self) -> str:
        return self.text


def _profile_lines(profile: Profile) -> list[str]:
    out = []
    for key, value in profile.data.items():
        shown = value if isinstance(value, str) else json.dumps(value, default=str)
        out.append(f"- {key}: {shown}")
    return out


def _fact_line(f: Fact) -> str:
    key = f" ({f.key})" if f.key else ""
    return f"- {f.text}{key} [since {f.valid_from:%Y-%m-%d}]"


def _episode_line(e: Episode) -> str:
    return f"- {e.valid_from:%Y-%m-%d %H:%M} {e.role}: {e.text}"


def build_context(
    *,
    budget_tokens: int,
    count: Callable[[str], int],
    profile: Profile | None,
    facts: Sequence[Fact],
    episodes: Sequence[Episode],
) -> Context:
    """Fill the block from the three sections in order (see the module docstring).

    ``facts`` and ``episodes`` come best first; duplicates by id are skipped. Raises nothing.

    Lines are admitted on a running sum of their token counts (headers included): word-level
    tokenizers split at whitespace, so a joined block counts at most the sum of its parts and
    each line is tokenized once. The finished block is then counted whole; should a tokenizer
    count more than the sum, the block is rebuilt by counting it whole at every step.
    """
    ctx = _fill(budget_tokens, count, profile, facts, episodes, exact=False)
    if ctx.tokens > budget_tokens:
        ctx = _fill(budget_tokens, count, profile, facts, episodes, exact=True)
    return ctx


def _fill(
    budget_tokens: int,
    count: Callable[[str], int],
    profile: Profile | None,
    facts: Sequence[Fact],
    episodes: Sequence[Episode],
    *,
    exact: bool,
) -> Context:
    sections: list[tuple[str, list[str]]] = []
    ids: list[str] = []
    used: set[str] = set()
    profile_used = False
    total = 0

    def render(extra: tuple[str, str] | None = None) -> str:
        parts = []
        for title, lines in sections:
            body = list(lines)
            if extra is not None and extra[0] == title:
                body.append(extra[1])
            if body:
                parts.append("\n".join([f"## {title}", *body]))
        if extra is not None and extra[0] not in {t for t, _ in sections}:
            parts.append(f"## {extra[0]}\n{extra[1]}")
        return "\n\n".join(parts)

    def try_add(title: str, line: str) -> bool:
        nonlocal total
        is_new = title not in {t for t, _ in sections}
        if exact:
            fits = count(render((title, line))) <= budget_tokens
            cost = 0
        else:
            cost = count(line) + (count(f"## {title}") if is_new else 0)
            fits = total + cost <= budget_tokens
        if not fits:
            return False
        total += cost
        if is_new:
            sections.append((title, [line]))
        else:
            next(lines for t, lines in sections if t == title).append(line)
        return True

    if profile is not None:
        for line in _profile_lines(profile):
            if try_add("Profile", line):
                profile_used = True
    for f in facts:
        if f.id not in used and try_add("Facts", _fact_line(f)):
            used.add(f.id)
            ids.append(f.id)
    for e in episodes:
        if e.id not in used and try_add("Relevant history", _episode_line(e)):
            used.add(e.id)
            ids.append(e.id)
    text = render()
    return Context(
        text=text,
        tokens=count(text) if text else 0,
        budget_tokens=budget_tokens,
        ids=ids,
        profile_used=profile_used,
    )


def describe(ctx: Context) -> dict[str, Any]:
    """A JSON-ready summary (for the CLI and the HTTP API)."""
    return {
        "text": ctx.text,
        "tokens": ctx.tokens,
        "budget_tokens": ctx.budget_tokens,
        "ids": ctx.ids,
        "profile_used": ctx.profile_used,
    }
