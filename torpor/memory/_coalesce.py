"""Concurrent single-record writes share one embedding batch (leader and followers).

``log()`` and ``remember()`` embed one text each. A model embeds a batch of texts several
times faster per text than one at a time (MiniLM here: about 440 texts/s batched against
about 120 one by one), and the HTTP server runs its sync routes in a thread pool, so
concurrent requests are the common case. :class:`EmbedBatcher` joins the texts of the calls
that arrive while the model is busy into the next model call:

* the first caller finds the model idle and embeds its own text at once (**a lone caller
  waits for nobody**: no timer, no extra thread);
* a caller that arrives while a batch runs queues its texts and waits;
* when a batch ends, its leader hands the lead to the oldest queued caller, which takes
  every queued text (up to :data:`MAX_TEXTS`) into one model call and does the same.

Only the embedding is shared: each caller then writes its own records in its own
transaction, so a call returns after its own records are committed, and a write error (a
quota, a bad key) reaches that call alone. If a shared model call fails, each of its callers'
texts is embedded again on its own, so an error reaches only the calls whose texts cause it.
Calls that bring more than :data:`FEW` texts are batches already and go straight to the model.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from torpor.memory.embeddings import Embedder

__all__ = ["FEW", "MAX_TEXTS", "EmbedBatcher", "batcher_for"]

#: calls with at most this many texts are joined; larger ones are batches already
FEW = 4
#: most texts one shared model call embeds
MAX_TEXTS = 64


class _Call:
    """One caller's texts, and what it gets back."""

    __slots__ = ("done", "error", "lead", "texts", "vectors")

    def __init__(self, texts: Sequence[str]) -> None:
        self.texts = list(texts)
        self.done = threading.Event()
        self.lead = False  # set with ``done`` when this caller is to run the next batch
        self.vectors: npt.NDArray[np.float32] | None = None
        self.error: BaseException | None = None


class EmbedBatcher:
    """Joins concurrent :meth:`embed` calls of few texts into shared model calls (see the
    module docstring). Thread-safe; one per embedder (:func:`batcher_for`)."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self._lock = threading.Lock()
        self._queue: list[_Call] = []
        self._busy = False
        #: model calls made and texts they embedded (for tests and the bench)
        self.model_calls = 0
        self.texts_embedded = 0

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """The embedder's vectors for ``texts``, possibly computed in one model call with
        other threads' texts. Raises what the embedder raises for these texts."""
        if len(texts) > FEW:
            return self._model(list(texts))
        call = _Call(texts)
        with self._lock:
            self._queue.append(call)
            lead = not self._busy
            self._busy = True
        if not lead:
            try:
                call.done.wait()
            except BaseException:  # interrupted while queued: leave, passing on any lead
                self._leave(call)
                raise
            lead = call.lead
        if lead:
            self._lead()
        if call.error is not None:
            raise call.error
        assert call.vectors is not None  # set with ``done`` by the batch that served it
        return call.vectors

    def _lead(self) -> None:
        """Run one batch from the head of the queue (this caller's own call is first), then
        hand the lead to the oldest call still queued, or mark the model idle."""
        with self._lock:
            batch: list[_Call] = []
            size = 0
            while self._queue and (not batch or size + len(self._queue[0].texts) <= MAX_TEXTS):
                batch.append(self._queue.pop(0))
                size += len(batch[-1].texts)
        try:
            self._serve(batch)
        finally:
            with self._lock:
                if self._queue:
                    nxt = self._queue[0]
                    nxt.lead = True
                    nxt.done.set()
                else:
                    self._busy = False
            for call in batch:
                if call.vectors is None and call.error is None:  # interrupted: never hang
                    call.error = RuntimeError("the shared embedding batch was interrupted")
                call.done.set()

    def _leave(self, call: _Call) -> None:
        """Take ``call`` out of the queue; if it had just been handed the lead, hand it on."""
        with self._lock:
            if call not in self._queue:
                return  # already served
            self._queue.remove(call)
            if not call.lead:
                return
            if self._queue:
                self._queue[0].lead = True
                self._queue[0].done.set()
            else:
                self._busy = False

    def _serve(self, batch: list[_Call]) -> None:
        """Embed every call's texts in one model call; if it fails, each call on its own."""
        texts = [t for call in batch for t in call.texts]
        try:
            vectors = self._model(texts)
        except Exception as exc:
            if len(batch) == 1:
                batch[0].error = exc
                return
            for call in batch:  # find whose texts fail: the others still get their vectors
                try:
                    call.vectors = self._model(call.texts)
                except Exception as own:
                    call.error = own
            return
        at = 0
        for call in batch:
            call.vectors = vectors[at : at + len(call.texts)]
            at += len(call.texts)

    def _model(self, texts: list[str]) -> npt.NDArray[np.float32]:
        out: npt.NDArray[np.float32] = np.asarray(self.embedder.embed(texts), dtype=np.float32)
        with self._lock:
            self.model_calls += 1
            self.texts_embedded += len(texts)
        return out


_batchers: weakref.WeakKeyDictionary[Any, EmbedBatcher] = weakref.WeakKeyDictionary()
_batchers_lock = threading.Lock()


def batcher_for(embedder: Embedder) -> EmbedBatcher:
    """The one batcher of ``embedder``, shared by every memory that writes with it (the
    server's tenants share one model). An embedder that cannot be weakly referenced or
    hashed gets a batcher of its own per call (no joining, same vectors)."""
    with _batchers_lock:
        try:
            found = _batchers.get(embedder)
            if found is None:
                found = _batchers[embedder] = EmbedBatcher(embedder)
        except TypeError:
            return EmbedBatcher(embedder)
        return found
