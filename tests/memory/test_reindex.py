"""A store records the model its vectors come from: a writer with another model gets
Conflict, a lexical-only writer leaves records without vectors, and reindex fills them in."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from torpor.errors import Conflict, InvalidArgument
from torpor.memory import HashEmbedder, Memory
from torpor.memory.backends.base import RecordFilter
from torpor.memory.models import now_us


def _vectored(mem: Memory, query: str) -> set[str]:
    """Ids the vector search finds for ``query`` (every record of the tenant root's view)."""
    emb = HashEmbedder(64)
    flt = RecordFilter(scopes=["", "app/a"], now=now_us())
    return {r.id for r, _ in mem.store.vector_search(emb.embed([query])[0].tolist(), flt, 50)}


def test_store_records_the_model_and_refuses_a_writer_with_another(
    backend_spec: str, home: Path
) -> None:
    first = Memory(str(home), embedder=HashEmbedder(64), backend=backend_spec)
    fact = first.scope(app="a").remember("the deploy key rotates monthly")
    assert first.store.get_meta("embedding_model") == "hash:64"
    assert first.store.get_meta("embedding_dim") == "64"
    first.close()
    other = Memory(str(home), embedder=HashEmbedder(32), backend=backend_spec)
    with pytest.raises(Conflict, match="hash:64") as err:
        other.scope(app="a").remember("written with another model")
    assert err.value.data["stored"] == "hash:64" and err.value.data["embedder"] == "hash:32"
    with pytest.raises(Conflict):
        other.scope(app="a").log("user", "a turn with another model")
    with pytest.raises(Conflict):
        other.reindex()
    # nothing was written by the refused calls; reads still work, lexically
    assert [h.id for h in other.scope(app="a").recall("deploy key", 5)] == [fact.id]
    assert other.scope(app="a").recall("another model", 5) == []
    other.close()


def test_lexical_writer_leaves_records_that_reindex_embeds(backend_spec: str, home: Path) -> None:
    hashed = Memory(str(home), embedder=HashEmbedder(64), backend=backend_spec)
    with_vec = hashed.scope(app="a").remember("invoices are paid on fridays")
    hashed.close()
    lexical = Memory(str(home), embedder=None, backend=backend_spec)
    plain = lexical.scope(app="a").remember("the staging database is called nimbus")
    turn = lexical.scope(app="a").log("user", "nimbus was slow again today")
    assert lexical.store.get_meta("embedding_model") == "hash:64"  # untouched
    with pytest.raises(InvalidArgument, match="needs an embedder"):
        lexical.reindex()
    lexical.close()

    mem = Memory(str(home), embedder=HashEmbedder(64), backend=backend_spec)
    assert {r for r, _ in mem.store.without_vectors(10)} == {plain.id, turn.id}
    assert _vectored(mem, "nimbus") == {with_vec.id}
    with pytest.raises(InvalidArgument):
        mem.reindex(batch=0)
    assert mem.reindex(batch=1) == 2
    assert mem.store.without_vectors(10) == []
    assert _vectored(mem, "nimbus") == {with_vec.id, plain.id, turn.id}
    assert mem.reindex() == 0
    assert mem.audit_log(5)[0].action == "reindex"
    mem.close()


def test_reindex_on_a_fresh_store_records_the_model(backend_spec: str, home: Path) -> None:
    lexical = Memory(str(home), embedder=None, backend=backend_spec)
    lexical.scope(app="a").remember("only lexical so far")
    assert lexical.store.get_meta("embedding_model") is None
    lexical.close()
    mem = Memory(str(home), embedder=HashEmbedder(64), backend=backend_spec)
    assert mem.reindex() == 1
    assert mem.store.get_meta("embedding_model") == "hash:64"
    mem.close()


@pytest.mark.embeddings
def test_cli_writes_lexically_and_reindex_embeds_with_the_real_model(tmp_path: Path) -> None:
    from torpor.cli import _load, app

    _load()
    runner = CliRunner()
    home = tmp_path / "home"
    base = ["memory", "--home", str(home), "--scope", "app/a/user/u"]
    for text in ("my dog is called Rex", "I moved to Lisbon last spring"):
        assert runner.invoke(app, [*base, "remember", text]).exit_code == 0
    mem = Memory(str(home), embedder="default")
    assert len(mem.store.without_vectors(10)) == 2
    mem.close()
    result = runner.invoke(app, [*base, "--json", "reindex"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert '"reindexed": 2' in result.stdout
    mem = Memory(str(home), embedder="default")
    assert mem.store.without_vectors(10) == []
    # a paraphrase with no shared word is found through the vectors now
    hits = mem.scope(app="a", user="u").recall("what city does the user live in?", 1)
    assert hits and hits[0].text == "I moved to Lisbon last spring" and "vector" in hits[0].scores
    mem.close()
