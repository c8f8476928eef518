"""Concurrent single-record writes share one embedding batch (leader and followers).

``log()`` and ``remember()`` embed one text each. A model embeds a batch of texts several
times faster per text than one at a time (MiniLM here: about 440 texts/s batched against
about 120 one by one), and the HTTP server runs its sync routes in a thread pool, so
concurrent requests are the common case. :class:`EmbedBatcher` joins the texts of the calls
that arrive while the model is busy into the next model call:

* a caller that finds a free lane (fewer than :data:`LANES` model calls running) embeds its
  own text at once, with whatever is queued (**a lone caller waits for nobody**: no timer,
  no extra thread);
* a caller that arrives while every lane runs a batch queues its texts and waits;
* when a batch ends, its leader hands the lane to the oldest queued caller, which takes the
  queued texts (up to :data:`MAX_TEXTS`) into one model call and does the same.

Why lanes, and why small joined batches: the default embedder embeds up to four texts on
one thread (through ONNX Runtime when it is installed; ``embeddings.py``), and its larger
batches on all cores (PyTorch). Measured on this 2-core machine, quiet, 480 short sentences,
texts/s: PyTorch's batch of all 303; one thread at 1 / 4 / 8 texts a call 185 / 305 / 357;
two such calls at once, 4 texts each, 568. So two lanes of joined batches that stay on the
one-thread path beat the model's own batch; one lane of up to 64 texts (before) gave 8
threads of ``log()`` 215/s against the batch's 455/s in ``bench.memory``.

Only the embedding is shared: each caller then writes its own records in its own
transaction, so a call returns after its own records are committed, and a write error (a
quota, a bad key) reaches that call alone. If a shared model call fails, each of its callers'
texts is embedded again on its own, so an error reaches only the calls whose texts cause it.
Calls that bring more than :data:`FEW` texts are batches already and go straight to the model.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from torpor.memory.embeddings import Embedder

__all__ = ["FEW", "LANES", "MAX_TEXTS", "EmbedBatcher", "batcher_for"]

#: calls with at most this many texts are joined; larger ones are batches already
FEW = 4
#: most texts one shared model call embeds: the embedder's one-thread path (module docstring)
MAX_TEXTS = FEW
#: shared model calls that may run at once: one per core, at most four
LANES = max(1, min(4, os.cpu_count() or 1))


class _Call:
    """One caller's texts, and what it gets back."""

    __slots__ = ("error", "lead", "served", "texts", "vectors", "wake")

    def __init__(self, texts: Sequence[str]) -> None:
        self.texts = list(texts)
        self.wake = threading.Event()  # served, or handed a lane
        self.served = threading.Event()  # ``vectors`` or ``error`` is set
        self.lead = False  # set with ``wake`` when this caller is to run the next batch
        self.vectors: npt.NDArray[np.float32] | None = None
        self.error: BaseException | None = None


class EmbedBatcher:
    """Joins concurrent :meth:`embed` calls of few texts into shared model calls, up to
    ``lanes`` at once (see the module docstring). Thread-safe; one per embedder
    (:func:`batcher_for`)."""

    def __init__(self, embedder: Embedder, *, lanes: int = LANES) -> None:
        self.embedder = embedder
        self.lanes = max(1, lanes)
        self._lock = threading.Lock()
        self._queue: list[_Call] = []
        self._running = 0  # lanes in use: callers running (or about to run) a batch
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
            if self._running < self.lanes:
                self._running += 1
                call.lead = True
        try:
            if not call.lead:
                call.wake.wait()
            if call.lead:
                self._lead(call)
            call.served.wait()  # by this caller's batch, or by another lane's
        except BaseException:  # interrupted: leave, passing on any lane it holds
            self._leave(call)
            raise
        if call.error is not None:
            raise call.error
        assert call.vectors is not None
        return call.vectors

    def _lead(self, own: _Call) -> None:
        """Run one batch of the oldest queued calls (``own`` first, unless another lane has
        taken it), then hand this lane to the oldest queued call without one, or free it."""
        with self._lock:
            batch: list[_Call] = []
            if own in self._queue:
                self._queue.remove(own)
                batch.append(own)
            size = sum(len(c.texts) for c in batch)
            while self._queue and (not batch or size + len(self._queue[0].texts) <= MAX_TEXTS):
                if self._queue[0].lead:  # holds a lane of its own: it runs itself
                    break
                batch.append(self._queue.pop(0))
                size += len(batch[-1].texts)
        try:
            if batch:
                self._serve(batch)
        finally:
            own.lead = False
            with self._lock:
                self._hand_on()
            for call in batch:
                if call.vectors is None and call.error is None:  # interrupted: never hang
                    call.error = RuntimeError("the shared embedding batch was interrupted")
                call.served.set()
                call.wake.set()

    def _leave(self, call: _Call) -> None:
        """Take ``call`` out of the queue; if it holds a lane, hand the lane on."""
        with self._lock:
            if call in self._queue:
                self._queue.remove(call)
            if call.lead:
                call.lead = False
                self._hand_on()

    def _hand_on(self) -> None:
        """Give a lane that ends to the oldest queued call without one, or free it (under
        ``_lock``)."""
        for nxt in self._queue:
            if not nxt.lead:
                nxt.lead = True
                nxt.wake.set()
                return
        self._running -= 1

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
