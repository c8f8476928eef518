"""The wire format between the host and the guest agent (stdlib only: both sides import it).

A byte stream carries **frames**. Each frame is a fixed 16-byte prefix, a JSON header and a
raw binary payload (never base64)::

    magic "TPR1" | header_len u32 | payload_len u32 | crc32 u32 | header JSON | payload

``crc32`` covers the three lengths/magic and the header JSON (not the payload, which would cost
too much under TCG). It exists so a reader can *resynchronise*: after a hibernate the stream may
start in the middle of a frame, and the decoder then skips bytes up to the next valid prefix.
Headers are at most :data:`MAX_HEADER` bytes and payloads at most :data:`MAX_PAYLOAD`; larger
data is split into :data:`CHUNK`-sized frames.

Every header has ``"i"`` (the request id, chosen by the host) and ``"t"`` (the frame type):

``req``    host -> guest: ``{"op", "args", "more"}``; with ``"more": true`` the request's
           payload continues in ``data`` frames (file uploads, long code).
``data``   host -> guest continuation: ``{"more": bool}`` + a payload chunk;
           guest -> host: a chunk of a streamed result (``read`` sends the file this way).
``event``  guest -> host: ``{"s": "stdout" | "stderr"}`` + an output chunk, while a request runs
           (a ``pty`` request: ``"started"`` with the pid, then ``"pty"`` chunks; a ``tunnel``:
           ``"started"``, then ``"data"`` chunks).
``reply``  guest -> host, the last frame of a request: ``{"ok": true, "result": {...}}`` or
           ``{"ok": false, "error": {"type", "message", "data"}}``; ``type`` names a
           :mod:`torpor.errors` class, which the host raises. A large result is sent as
           ``data`` frames holding its JSON, and the reply says ``"result_in_data": true``.
``cancel`` host -> guest: stop request ``i`` (kill its command, interrupt its code).
``call``   guest -> host: an HTTP request made to the guest's ``localhost:7777`` (the memory
           relay, :mod:`relay`): ``{"method", "path", "headers"}`` + the body. Its ``i`` is
           chosen by the guest, apart from the host's ids (the types keep them apart).
``answer`` host -> guest, the one reply to call ``i``: ``{"status", "headers"}`` + the body.

Several requests may be in flight; frames of different requests interleave freely.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = [
    "ANSWER",
    "CALL",
    "CANCEL",
    "CHUNK",
    "DATA",
    "EVENT",
    "MAGIC",
    "MAX_HEADER",
    "MAX_PAYLOAD",
    "PREFIX",
    "PROTOCOL_VERSION",
    "REPLY",
    "REQ",
    "Frame",
    "FrameDecoder",
    "ProtocolError",
    "encode_frame",
    "encode_request",
    "error_dict",
]

PROTOCOL_VERSION = 1
MAGIC = b"TPR1"
#: magic, header length, payload length, crc32(magic + lengths + header)
PREFIX = struct.Struct(">4sIII")
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 20
#: payload bytes per frame when a sender splits large data
CHUNK = 256 * 1024
#: header bytes a decoder may check in candidate frames that turn out bad (crc or JSON)
#: before it skips such a candidate whole: this much, plus this many times the bytes fed
WASTE_ALLOWANCE = 4 * MAX_HEADER
WASTE_FACTOR = 4

REQ = "req"
DATA = "data"
EVENT = "event"
REPLY = "reply"
CANCEL = "cancel"
CALL = "call"
ANSWER = "answer"
_TYPES = frozenset({REQ, DATA, EVENT, REPLY, CANCEL, CALL, ANSWER})


class ProtocolError(ValueError):
    """A frame that cannot be encoded: too large (``size``, ``limit`` set) or not
    JSON-serialisable."""

    def __init__(self, message: str, *, size: int | None = None, limit: int | None = None) -> None:
        super().__init__(message)
        self.size, self.limit = size, limit


class Frame(NamedTuple):
    """One decoded frame: its JSON header and its raw payload."""

    header: dict[str, Any]
    payload: bytes

    @property
    def id(self) -> int:
        return int(self.header["i"])

    @property
    def type(self) -> str:
        return str(self.header["t"])


def _crc(header_len: int, payload_len: int, header: bytes) -> int:
    return zlib.crc32(header, zlib.crc32(struct.pack(">4sII", MAGIC, header_len, payload_len)))


def encode_frame(
    header: dict[str, Any], payload: bytes = b"", *, max_payload: int = MAX_PAYLOAD
) -> bytes:
    """Encode one frame. Raises :class:`ProtocolError` if the header or payload is too large."""
    try:
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"header is not JSON-serialisable: {exc}") from exc
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: a file name that is not UTF-8, as Python
        # decodes one (surrogateescape); JSON's \u escapes carry it as it is
        raw = json.dumps(header, separators=(",", ":")).encode("ascii")
    if len(raw) > MAX_HEADER:
        raise ProtocolError(
            f"frame header of {len(raw)} bytes is over {MAX_HEADER}",
            size=len(raw),
            limit=MAX_HEADER,
        )
    if len(payload) > max_payload:
        raise ProtocolError(
            f"frame payload of {len(payload)} bytes is over {max_payload}",
            size=len(payload),
            limit=max_payload,
        )
    prefix = PREFIX.pack(MAGIC, len(raw), len(payload), _crc(len(raw), len(payload), raw))
    return b"".join((prefix, raw, payload))


def encode_request(
    req_id: int, op: str, args: dict[str, Any], payload: bytes = b"", *, chunk: int = CHUNK
) -> Iterator[bytes]:
    """Yield the frames of one request: a ``req`` frame, then ``data`` frames for the rest
    of ``payload`` when it is larger than ``chunk``. Raises :class:`ProtocolError`."""
    view = memoryview(payload)
    first, rest = view[:chunk], view[chunk:]
    yield encode_frame(
        {"i": req_id, "t": REQ, "op": op, "args": args, "more": len(rest) > 0}, bytes(first)
    )
    while len(rest) > 0:
        part, rest = rest[:chunk], rest[chunk:]
        yield encode_frame({"i": req_id, "t": DATA, "more": len(rest) > 0}, bytes(part))


def error_dict(type_name: str, message: str, **data: Any) -> dict[str, Any]:
    """The wire shape of an error: ``{"type", "message", "data"}``."""
    return {"type": type_name, "message": message, "data": data}


class FrameDecoder:
    """Turn a byte stream into frames, incrementally.

    :meth:`feed` never raises on bad input: bytes that do not start a valid frame are skipped
    up to the next valid prefix (``skipped`` counts them), so a stream that resumes mid-frame
    recovers at the next frame boundary. :meth:`reset` drops a half-received frame.
    """

    def __init__(self, *, max_payload: int = MAX_PAYLOAD) -> None:
        self.max_payload = max_payload
        self.skipped = 0
        self._buf = bytearray()
        # (end, header) of a frame whose header checked out but whose payload is still
        # arriving: a 256 KiB payload comes in 4 KiB reads on a virtio port, and parsing
        # the header again for each of them costs a lot under TCG.
        self._hold: tuple[int, dict[str, Any]] | None = None
        # bytes fed, and header bytes checked in candidates that were not frames
        self._fed = 0
        self._wasted = 0

    def reset(self) -> None:
        """Forget any partial frame (the peer hung up)."""
        self._buf.clear()
        self._hold = None
        self._fed = self._wasted = 0

    @property
    def pending(self) -> int:
        """Bytes buffered but not yet part of a complete frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame]:
        """Add ``data``; return every frame that is now complete, in order."""
        self._buf += data
        self._fed += len(data)
        frames: list[Frame] = []
        while True:
            frame = self._next()
            if frame is None:
                return frames
            frames.append(frame)

    def _skip(self) -> None:
        # Drop the current (bad) start byte and everything up to the next magic.
        at = self._buf.find(MAGIC, 1)
        n = len(self._buf) - len(MAGIC) + 1 if at < 0 else at
        n = max(1, n)
        del self._buf[:n]
        self.skipped += n

    def _reject(self, hlen: int) -> None:
        # A prefix whose header (``hlen`` bytes, checked) is no frame's. Skipping to the next
        # magic lets a stream of fake prefixes, one every 16 bytes each claiming a long
        # header, cost that header's length per 16 bytes; past the budget the whole
        # candidate is skipped, so the work stays in proportion to the bytes fed.
        self._wasted += hlen
        if self._wasted <= WASTE_ALLOWANCE + WASTE_FACTOR * self._fed:
            self._skip()
            return
        n = PREFIX.size + hlen
        del self._buf[:n]
        self.skipped += n

    def _next(self) -> Frame | None:
        buf = self._buf
        if self._hold is not None:
            end, held = self._hold
            if len(buf) < end:
                return None
            self._hold = None
            return self._take(end, held)
        while True:
            if len(buf) < PREFIX.size:
                if buf and not MAGIC.startswith(bytes(buf[: len(MAGIC)])):
                    self._skip()
                    continue
                return None
            magic, hlen, plen, crc = PREFIX.unpack_from(buf)
            if magic != MAGIC or hlen > MAX_HEADER or plen > self.max_payload or hlen == 0:
                self._skip()
                continue
            if len(buf) < PREFIX.size + hlen:
                return None
            raw = bytes(buf[PREFIX.size : PREFIX.size + hlen])
            header = _parse_header(raw) if _crc(hlen, plen, raw) == crc else None
            if header is None:
                self._reject(hlen)
                continue
            end = PREFIX.size + hlen + plen
            if len(buf) < end:
                self._hold = (end, header)
                return None
            return self._take(end, header)

    def _take(self, end: int, header: dict[str, Any]) -> Frame:
        hlen = end - PREFIX.size - PREFIX.unpack_from(self._buf)[2]
        payload = bytes(self._buf[PREFIX.size + hlen : end])
        del self._buf[:end]
        return Frame(header, payload)


def _parse_header(raw: bytes) -> dict[str, Any] | None:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # too deeply nested too
        return None
    if (
        not isinstance(header, dict)
        or not isinstance(header.get("i"), int)
        or header.get("t") not in _TYPES
    ):
        return None
    return header
