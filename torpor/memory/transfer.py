"""Export, import and fork: a scope subtree as JSON lines, and copies between scopes.

The JSONL stream starts with a header line, then one line per record, profile and policy::

    {"type": "torpor-memory", "version": 1, "tenant": "t", "scope": "app/a",
     "embedding_model": "..."}
    {"type": "fact", "record": {...}, "embedding": [...] | null}
    {"type": "episode", "record": {...}, "embedding": null}
    {"type": "profile", "profile": {...}}
    {"type": "policy", "scope": "app/a", "policy": {...}}

Importing re-roots the records from the exported scope onto the importing scope. Ids are kept
when the scope is unchanged (re-importing is then idempotent); otherwise fresh ids are made,
with ``superseded_by`` links remapped, so an import never collides with its own source.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Iterable, Iterator
from typing import Any

from pydantic import ValidationError

from torpor.errors import InvalidArgument, PayloadTooLarge
from torpor.memory import _validate as check
from torpor.memory.backends.base import AnyRecord, TenantStore
from torpor.memory.models import (
    Episode,
    Fact,
    Policy,
    Profile,
    canonical_path,
    new_id,
    path_within,
)

log = logging.getLogger(__name__)

__all__ = ["FORMAT_VERSION", "Bundle", "export_lines", "parse_lines", "reroot"]

FORMAT_VERSION = 1

#: what reading a bad line raises (RecursionError: a line nested too deep for json)
_BAD_LINE = (ValueError, KeyError, TypeError, RecursionError, ValidationError, InvalidArgument)


def export_lines(store: TenantStore, prefix: str, embedding_model: str | None) -> Iterator[str]:
    """The JSONL lines of everything at ``prefix`` or below (expired records included: an
    export is a backup, GC decides what goes)."""
    yield json.dumps(
        {
            "type": "torpor-memory",
            "version": FORMAT_VERSION,
            "tenant": store.tenant,
            "scope": prefix,
            "embedding_model": embedding_model,
        }
    )
    for rec, vec in store.iter_records(prefix):
        yield json.dumps(
            {"type": rec.kind, "record": rec.model_dump(mode="json"), "embedding": vec}
        )
    for profile in store.iter_profiles(prefix):
        yield json.dumps({"type": "profile", "profile": profile.model_dump(mode="json")})
    for scope, policy in store.iter_policies(prefix):  # a scope's own, records or not
        yield json.dumps(
            {"type": "policy", "scope": scope, "policy": policy.model_dump(mode="json")}
        )


class Bundle:
    """The parsed content of an export."""

    def __init__(self) -> None:
        self.scope = ""
        self.embedding_model: str | None = None
        self.records: list[AnyRecord] = []
        self.vectors: list[list[float] | None] = []
        self.profiles: list[Profile] = []
        self.policies: list[tuple[str, Policy]] = []


def parse_lines(lines: Iterable[str]) -> Bundle:
    """Parse an export. Raises :class:`InvalidArgument` naming the first bad line (nothing is
    written before the whole stream has parsed)."""
    bundle = Bundle()
    header = False
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj: dict[str, Any] = json.loads(line)
            kind = obj["type"]
            if kind == "torpor-memory":
                if obj.get("version") != FORMAT_VERSION:
                    raise ValueError(f"unsupported export version {obj.get('version')}")
                bundle.scope = _scope(obj.get("scope") or "", "")
                bundle.embedding_model = obj.get("embedding_model")
                header = True
            elif not header:
                raise ValueError("missing the torpor-memory header line")
            elif kind in ("fact", "episode"):
                model = Fact if kind == "fact" else Episode
                bundle.records.append(_record(model.model_validate(obj["record"]), bundle.scope))
                bundle.vectors.append(_vector(obj.get("embedding")))
            elif kind == "profile":
                profile = Profile.model_validate(obj["profile"])
                _scope(profile.scope, bundle.scope)
                check.time(profile.updated_at, "updated_at")
                check.storable_json(profile.json_schema, "json_schema")
                with contextlib.suppress(PayloadTooLarge):  # merges grow past one call's limit
                    check.metadata(profile.data, "profile")
                bundle.profiles.append(profile)
            elif kind == "policy":
                bundle.policies.append(
                    (_scope(obj["scope"], bundle.scope), Policy(**obj["policy"]))
                )
            else:
                raise ValueError(f"unknown line type {kind!r}")
        except _BAD_LINE as exc:
            raise InvalidArgument(f"import line {n}: {exc}") from None
    if not header:
        raise InvalidArgument("not a torpor memory export (no header line)")
    return bundle


def _scope(path: object, within: str) -> str:
    """``path`` if it is a scope path (in its one spelling) at ``within`` or below."""
    path = canonical_path(path)
    if not path_within(path, within):
        raise ValueError(f"scope {path!r} is outside the export's scope {within!r}")
    return path


def _record(rec: AnyRecord, within: str) -> AnyRecord:
    """``rec`` if it passes what :meth:`remember` and :meth:`log` check of their input (its
    times too: within years 1-9999 in UTC, or every later read of it would fail)."""
    _scope(rec.scope, within)
    for name in ("created_at", "valid_from", "valid_to", "expires_at"):
        check.time(getattr(rec, name), name)
    if rec.id in ("", ".", "..") or "/" in rec.id or not check.storable(rec.id):
        raise ValueError(f"record id {rec.id!r} is no id a store keeps and a URL names")
    check.text(rec.text)
    check.metadata(rec.metadata)
    if isinstance(rec, Fact):
        check.key(rec.key)
        cited = () if rec.source is None else rec.source.model_dump().values()
        if not all(check.storable(v) for v in (rec.source_hash, *cited) if isinstance(v, str)):
            raise ValueError("source must be valid UTF-8 without NUL characters")
    else:
        check.text(rec.role, "role")
        if rec.session is not None:
            check.text(rec.session, "session")
    return rec


def _vector(value: object) -> list[float] | None:
    """None, or a list of finite numbers (its length is checked against the importing
    tenant's embedder when the vectors are kept)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in value
    ):
        raise ValueError("embedding must be null or a list of finite numbers")
    return [float(x) for x in value]


def _move(path: str, old: str, new: str) -> str:
    """``path`` (at ``old`` or below) moved onto ``new``. Raises :class:`InvalidArgument`
    when the result is no scope path (``app/a/user/v`` from ``app/a`` onto ``app/b/agent/g``
    or ``app/b/user/w``: a level out of order or twice)."""
    if not old:
        rest = path
    elif path == old:
        rest = ""
    else:
        rest = path[len(old) + 1 :]
    moved = "/".join(p for p in (new, rest) if p)
    try:
        return canonical_path(moved)
    except InvalidArgument:
        raise InvalidArgument(
            f"scope {path!r} of the export (of {old!r}) has no place under {new!r}: "
            f"it would be {moved!r}"
        ) from None


def reroot(bundle: Bundle, new_prefix: str) -> Bundle:
    """The bundle moved from its scope onto ``new_prefix`` (new ids if the scope changes).
    Raises :class:`InvalidArgument` when a scope of the bundle has no place there."""
    if bundle.scope == new_prefix:
        return bundle
    ids = {r.id: new_id() for r in bundle.records}
    out = Bundle()
    out.scope, out.embedding_model, out.vectors = new_prefix, bundle.embedding_model, bundle.vectors
    for rec in bundle.records:
        update: dict[str, Any] = {
            "id": ids[rec.id],
            "scope": _move(rec.scope, bundle.scope, new_prefix),
        }
        if isinstance(rec, Fact) and rec.superseded_by is not None:
            update["superseded_by"] = ids.get(rec.superseded_by)
        out.records.append(rec.model_copy(update=update))
    out.profiles = [
        p.model_copy(update={"scope": _move(p.scope, bundle.scope, new_prefix)})
        for p in bundle.profiles
    ]
    out.policies = [(_move(s, bundle.scope, new_prefix), p) for s, p in bundle.policies]
    return out
