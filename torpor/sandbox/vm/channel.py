"""The host's end of the guest agent: asyncio requests over the sandbox's ``agent.sock``.

QEMU listens on the unix socket behind the guest's virtio-serial port; :meth:`GuestChannel.connect`
connects and pings until the agent answers. Requests are framed by
:mod:`torpor.sandbox.guest.protocol` and multiplexed by id, so several can be in flight.
Errors the guest reports arrive as ``{type, message, data}`` and are raised as the matching
:mod:`torpor.errors` class. A dropped connection fails every in-flight request with
:class:`~torpor.errors.GuestError`; a request the guest does not answer in time raises
:class:`~torpor.errors.OperationTimeout`.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import inspect
import json
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

from pydantic import TypeAdapter, ValidationError

from torpor.config import LIMITS, Limits
from torpor.errors import (
    GuestError,
    InvalidArgument,
    OperationTimeout,
    PayloadTooLarge,
    QuotaExceeded,
    TorporError,
    from_wire,
)
from torpor.sandbox.guest import protocol as proto
from torpor.sandbox.models import CommandResult, EntryInfo, Execution
from torpor.sandbox.requests import CodeSpec, CommandSpec
from torpor.types import OutputCallback

__all__ = ["CLONE_FIRST_PING_RETRY", "MAX_CALLS", "CallHandler", "GuestChannel", "wake_split"]

#: answers a call the guest makes (an HTTP request to its ``localhost:7777``, see
#: :mod:`torpor.sandbox.guest.relay`): ``(method, path, headers, body) -> (status, headers,
#: body)``
CallHandler = Callable[
    [str, str, dict[str, str], bytes], Awaitable[tuple[int, dict[str, str], bytes]]
]

log = logging.getLogger(__name__)

_M = TypeVar("_M")

#: extra seconds the host waits past a command's own timeout (the guest enforces that one)
TIMEOUT_GRACE = 15.0
#: the first ping's first retry (seconds); later retries back off by 1.5x up to 1 s
FIRST_PING_RETRY = 0.02
#: the first retry for a fork's or a restore's child (a QEMU that just started on a frozen
#: guest): its guest answers after 50-350 ms of cold translation under TCG, nearly always
#: to the first ping, so retries from 20 ms only queued 2-6 pings each for it to serve; a
#: ping lost to the reconnect is sent again once the guest can have run its first steps
CLONE_FIRST_PING_RETRY = 0.1
#: seconds :meth:`GuestChannel.close` lets the guest take what the host still has to send
#: before the connection is dropped with it
CLOSE_GRACE = 1.0
#: a refresh done by connect() stands in for a refresh() this soon after, nothing between
FRESH_FOR = 2.0
#: ops the agent serves on its read loop, in arrival order (its ``INLINE_OPS``): a cancel
#: cannot stop one, so none is sent
INLINE_OPS = frozenset({"ping", "refresh"})
#: output bytes a request may get past its limit before the host refuses it: the guest
#: enforces the limit itself, but its last read of a command's pipes may add what they held
OUTPUT_SLACK = 4 << 20
#: calls of the guest (its memory relay) the host answers at once; more are refused (429)
MAX_CALLS = 64
#: bytes the host may hold for a guest that does not read them before it stops refusing the
#: guest's calls past :data:`MAX_CALLS` (each refusal would be more bytes it does not read)
REFUSALS_BACKLOG = 4 << 20
#: the output streams of a request that is not a terminal or a tunnel (``raw``)
_STREAMS = frozenset({"stdout", "stderr"})


@dataclass
class _Pending:
    op: str
    future: asyncio.Future[dict[str, Any]]
    last_activity: float
    data: bytearray = field(default_factory=bytearray)
    data_limit: int = 0
    #: bytes of output events received (kept in ``streams``)
    output_bytes: int = 0
    streams: dict[str, list[str]] = field(default_factory=lambda: {"stdout": [], "stderr": []})
    callbacks: dict[str, OutputCallback | None] = field(default_factory=dict)
    decoders: dict[str, codecs.IncrementalDecoder] = field(default_factory=dict)
    #: tasks of async callbacks still running: held here so none is collected mid-flight
    tasks: set[asyncio.Future[Any]] = field(default_factory=set)
    #: takes every event as raw bytes instead (a terminal): nothing decoded, nothing kept
    raw: Callable[[str, bytes], None] | None = None

    def on_output(self, stream: str, chunk: bytes, final: bool = False) -> None:
        decoder = self.decoders.get(stream)
        if decoder is None:
            decoder = self.decoders[stream] = codecs.getincrementaldecoder("utf-8")("replace")
        text = decoder.decode(chunk, final)
        if not text:
            return
        self.streams.setdefault(stream, []).append(text)
        callback = self.callbacks.get(stream)
        if callback is None:
            return
        try:
            outcome = callback(text)
            if inspect.isawaitable(outcome):
                task = asyncio.ensure_future(outcome)
                self.tasks.add(task)
                task.add_done_callback(self._callback_done)
        except Exception:  # a user's callback must not break the channel
            log.exception("%s callback failed", stream)

    def _callback_done(self, task: asyncio.Future[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s output callback failed", self.op, exc_info=task.exception())

    def text(self, stream: str) -> str:
        self.on_output(stream, b"", final=True)
        return "".join(self.streams.get(stream, []))


async def _until_started(started: asyncio.Future[int], task: asyncio.Task[int]) -> None:
    """Wait until the guest says a long request (a terminal, a tunnel) started, or it ended.
    A caller that gives up meanwhile cancels the request too, so the guest ends what it
    started for it instead of keeping it for nobody."""
    try:
        await asyncio.wait({started, task}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        started.cancel()
        task.cancel()
        raise


class GuestChannel:
    """One connection to one guest agent. Create it with :meth:`connect`."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        limits: Limits = LIMITS,
        op_timeout: float = 120.0,
        on_call: CallHandler | None = None,
    ) -> None:
        self._reader, self._writer = reader, writer
        self.on_call = on_call
        self._calls: set[asyncio.Task[None]] = set()
        self.limits = limits
        self.op_timeout = op_timeout
        self._pending: dict[int, _Pending] = {}
        # Ids start at random so a stale reply from before a hibernate cannot match.
        self._next_id = random.getrandbits(40)
        self._decoder = proto.FrameDecoder()
        self._closed: GuestError | None = None
        #: how :meth:`connect` reached the agent (benchmarks split a wake with it): seconds
        #: until the socket accepted (``socket_s``), ``pings`` sent, which one was
        #: ``answered`` (1: the first), seconds from the first ping to the answer
        #: (``answer_s``) and the answered ping's own round trip (``round_trip_s``)
        self.first_ping: dict[str, float] = {}
        #: the same connection seen from the guest: :meth:`connect`'s answer's ``marks``
        #: (the agent's CLOCK_MONOTONIC stamps) and ``answered_at``, this host's
        #: ``time.monotonic()`` when that answer arrived; :func:`wake_split` reads them
        self.guest_marks: dict[str, Any] = {}
        # (when, result) of the refresh connect() did, until another request is sent
        self._fresh: tuple[float, dict[str, Any]] | None = None
        self._read_task = asyncio.get_running_loop().create_task(self._read_loop())

    # -- connection ----------------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        socket_path: Path,
        *,
        timeout: float = 30.0,
        limits: Limits = LIMITS,
        op_timeout: float = 120.0,
        refresh: bool = True,
        reseed: bool = True,
        on_call: CallHandler | None = None,
        first_retry: float = FIRST_PING_RETRY,
    ) -> GuestChannel:
        """Connect to ``socket_path`` and wait until the agent answers a ping, retrying while
        the socket does not exist yet or refuses. With ``refresh`` (the default: every
        connection follows a boot, wake, fork or restore) the ping carries 64 fresh bytes of
        host entropy and the host's clock, so the guest is refreshed in the same round trip
        and a :meth:`refresh` right after is answered without another one. Without
        ``reseed`` (a plain wake of the machine that last ran on this RAM: no other guest
        shares its random state) the ping sets the clock only, and a :meth:`refresh` after
        it does go to the guest. ``first_retry``: seconds before the first ping is sent
        again (later retries back off by 1.5x up to 1 s).
        Raises :class:`OperationTimeout`, or :class:`GuestError` if the agent speaks another
        protocol version (a stale template)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout
        last_exc: BaseException | None = None
        while loop.time() < deadline:
            try:
                reader, writer = await asyncio.open_unix_connection(str(socket_path))
            except OSError as exc:
                last_exc = exc
                await asyncio.sleep(0.005)
                continue
            channel = cls(reader, writer, limits=limits, op_timeout=op_timeout, on_call=on_call)
            try:
                channel.first_ping["socket_s"] = loop.time() - started
                await channel._first_ping(deadline, refresh, reseed, first_retry)
                return channel
            except GuestError as exc:  # hung up before answering: try a new connection
                last_exc = exc
                await channel.close()
                await asyncio.sleep(0.02)
            except (OperationTimeout, _VersionMismatch) as exc:
                last_exc = exc
                await channel.close()
                if isinstance(exc, _VersionMismatch):
                    raise GuestError(str(exc), version=exc.version) from None
                break
            except BaseException:
                await channel.close()
                raise
        raise OperationTimeout(
            f"the guest agent at {socket_path} did not answer within {timeout} s",
            exc=last_exc,
            seconds=timeout,
            path=str(socket_path),
        )

    async def _first_ping(
        self, deadline: float, refresh: bool, reseed: bool, first_retry: float = FIRST_PING_RETRY
    ) -> None:
        # A ping can be lost: the guest discards what arrives before its agent opens the port
        # (boot), and right after a wake the agent may still be noticing the previous
        # connection's hang-up, which drops the replies of that moment. So ping again, first
        # every few ms (the agent polls a hung-up port every 10 ms; a wake must not wait a
        # whole retry interval for a lost ping), then more and more slowly. The agent serves
        # pings on its read loop, so the extra ones cost the waking guest little.
        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Task[dict[str, Any]]] = []
        interval = first_retry
        args: dict[str, Any] = {}
        entropy = b""
        # what makes the retries of this ping one refresh in the guest: its entropy, or a key
        once: dict[str, Any] = {}
        if refresh and reseed:
            entropy = os.urandom(64)
        elif refresh:
            once = {"key": os.urandom(8).hex(), "reseed": False}
        sent: list[float] = []  # when each ping went out
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise OperationTimeout("the guest agent did not answer a ping", seconds=left)
                if refresh:  # the clock as of this ping, not the first one
                    args = {"refresh": {"unix_time": time.time(), **once}}
                sent.append(loop.time())
                tasks.append(loop.create_task(self._request("ping", args, entropy, idle=None)))
                done, _ = await asyncio.wait(
                    tasks, timeout=min(interval, left), return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    info = task.result()  # a GuestError (hang-up) propagates
                    if info.get("version") != proto.PROTOCOL_VERSION:
                        raise _VersionMismatch(info.get("version"))
                    done_refresh = info.get("refresh")
                    if isinstance(done_refresh, dict):  # an older agent ignores the ask
                        self._fresh = (time.monotonic(), done_refresh)
                    now, answered = loop.time(), tasks.index(task)
                    marks = info.get("marks")
                    if isinstance(marks, dict):  # an older agent sends none
                        self.guest_marks = {**marks, "answered_at": time.monotonic()}
                    self.first_ping.update(
                        pings=len(tasks),
                        answered=answered + 1,
                        answer_s=now - sent[0],
                        round_trip_s=now - sent[answered],
                    )
                    return
                interval = min(interval * 1.5, 1.0)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def close(self) -> None:
        """Disconnect; in-flight requests fail with :class:`GuestError`, the guest's calls
        being answered are cancelled (and awaited), and what the guest has not read after
        :data:`CLOSE_GRACE` seconds is dropped. Idempotent."""
        self._fail_all(GuestError("the guest channel was closed"))
        self._read_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._read_task
        await asyncio.gather(*self._calls, return_exceptions=True)
        self._writer.close()
        # (a task: cancelling wait_closed() itself would cancel the stream's own close waiter)
        closing = asyncio.ensure_future(self._writer.wait_closed())
        if not (await asyncio.wait({closing}, timeout=CLOSE_GRACE))[0]:
            self._writer.transport.abort()  # the guest stopped reading: drop what it did not
        with contextlib.suppress(OSError):
            await asyncio.shield(closing)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _fail_all(self, error: GuestError) -> None:
        """Fail every request in flight with ``error`` and cancel the guest's calls: none of
        their answers could reach it any more."""
        if self._closed is None:
            self._closed = error
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(error)
        for call in self._calls:
            call.cancel()

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._reader.read(1 << 18)
                if not data:
                    break
                for frame in self._decoder.feed(data):
                    self._on_frame(frame)
            error = GuestError("the guest agent hung up")
        except OSError as exc:
            error = GuestError(f"the connection to the guest agent broke: {exc}", exc=exc)
        except Exception as exc:  # what the guest sent broke the host's reading of it
            log.exception("reading from the guest agent failed")
            error = GuestError(f"the guest agent sent what the host cannot read: {exc!r}", exc=exc)
        self._fail_all(error)

    def _on_frame(self, frame: proto.Frame) -> None:
        if frame.type == proto.CALL:  # the guest asks (the memory relay); its own ids
            if len(self._calls) >= MAX_CALLS:  # each holds its body until answered
                self._refuse_call(frame.id)
                return
            task = asyncio.get_running_loop().create_task(self._answer(frame))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
            return
        pending = self._pending.get(frame.id)
        if pending is None or pending.future.done():
            log.debug("dropping a frame for unknown request %s", frame.id)
            return
        pending.last_activity = time.monotonic()
        kind = frame.type
        if kind == proto.EVENT:
            stream = str(frame.header.get("s", "stdout"))
            if pending.raw is not None:
                try:
                    pending.raw(stream, frame.payload)
                except Exception:  # a user's callback must not break the channel
                    log.exception("%s event handler failed", pending.op)
            elif stream not in _STREAMS:  # a name of the guest's choosing: nothing to keep
                log.debug("dropping %s output on a stream the host does not know", pending.op)
            else:
                pending.output_bytes += len(frame.payload)
                if pending.output_bytes > pending.data_limit + OUTPUT_SLACK:
                    self._too_large(frame.id, pending, "printed", pending.output_bytes)
                    return
                pending.on_output(stream, frame.payload)
        elif kind == proto.DATA:
            pending.data += frame.payload
            if len(pending.data) > pending.data_limit:
                self._too_large(frame.id, pending, "returned", len(pending.data))
        elif kind == proto.REPLY:
            pending.future.set_result(frame.header)

    def _too_large(self, req_id: int, pending: _Pending, what: str, size: int) -> None:
        """Fail request ``req_id`` with PayloadTooLarge and tell the guest to stop it."""
        pending.future.set_exception(
            PayloadTooLarge(
                f"{pending.op} {what} over {pending.data_limit} bytes",
                size=size,
                limit=pending.data_limit,
            )
        )
        self._send_cancel(req_id)

    def _refuse_call(self, call_id: int) -> None:
        """Answer call ``call_id`` with 429: :data:`MAX_CALLS` are being answered already.
        Not while the guest leaves over :data:`REFUSALS_BACKLOG` bytes unread: its relay's
        own timeout answers the call."""
        if self._writer.transport.get_write_buffer_size() > REFUSALS_BACKLOG:
            log.debug("not refusing call %s: the guest does not read its answers", call_id)
            return
        error = QuotaExceeded(
            f"over {MAX_CALLS} memory calls from this sandbox at once", limit=MAX_CALLS
        )
        self._send_answer(call_id, error.http_status, _JSON, _error_body(error))

    def _send_answer(self, call_id: int, status: int, headers: dict[str, str], body: bytes) -> None:
        """Send the HTTP answer to the guest's call ``call_id`` (nothing once closed)."""
        if self._closed is None:
            answer = {"i": call_id, "t": proto.ANSWER, "status": status, "headers": headers}
            self._writer.write(proto.encode_frame(answer, body))

    async def _answer(self, frame: proto.Frame) -> None:
        """Answer one ``call`` of the guest with :attr:`on_call` (503 without one). The call
        counts against :data:`MAX_CALLS` until the guest has taken its answer."""
        header = frame.header
        status, headers, body = 503, _JSON, b""
        try:
            if self.on_call is None:
                body = _error_body(TorporError("this sandbox has no memory endpoint"))
            else:
                raw = header.get("headers")
                given = {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}
                status, headers, body = await self.on_call(
                    str(header.get("method", "GET")),
                    str(header.get("path", "/")),
                    given,
                    frame.payload,
                )
            if len(body) > proto.MAX_PAYLOAD:
                too_large = PayloadTooLarge(
                    f"an answer of {len(body)} bytes is over {proto.MAX_PAYLOAD}",
                    size=len(body),
                    limit=proto.MAX_PAYLOAD,
                )
                status, headers, body = 413, _JSON, _error_body(too_large)
        except Exception:  # the handler's bug: the guest gets a 500, the log the traceback
            log.exception("answering a guest call failed")
            status, headers = 500, _JSON
            body = _error_body(TorporError("internal server error"))
        self._send_answer(frame.id, status, headers, body)
        with contextlib.suppress(ConnectionError, OSError):
            await self._writer.drain()

    # -- requests ------------------------------------------------------------------------

    def _send_cancel(self, req_id: int) -> None:
        if self._closed is None:
            self._writer.write(proto.encode_frame({"i": req_id, "t": proto.CANCEL}))

    async def _request(
        self,
        op: str,
        args: dict[str, Any],
        payload: bytes = b"",
        *,
        deadline: float | None = None,
        idle: float | None = -1.0,
        data_limit: int = 0,
        stdout: OutputCallback | None = None,
        stderr: OutputCallback | None = None,
        pending_out: list[_Pending] | None = None,
        raw: Callable[[str, bytes], None] | None = None,
    ) -> dict[str, Any]:
        """Send one request and return its ``result``. ``deadline`` bounds the whole request
        (seconds from now), ``idle`` the silence between frames (-1: ``op_timeout``).
        Raises the guest's error, :class:`GuestError` or :class:`OperationTimeout`."""
        if self._closed is not None:
            raise GuestError(f"cannot {op}: {self._closed.message}")
        idle = self.op_timeout if idle is not None and idle < 0 else idle
        if op != "ping":
            self._fresh = None
        self._next_id += 1
        rid = self._next_id
        loop = asyncio.get_running_loop()
        pending = _Pending(
            op,
            loop.create_future(),
            time.monotonic(),
            data_limit=data_limit or self.limits.max_output_bytes,
            callbacks={"stdout": stdout, "stderr": stderr},
            raw=raw,
        )
        if pending_out is not None:
            pending_out.append(pending)
        self._pending[rid] = pending
        end = None if deadline is None else time.monotonic() + deadline
        try:
            for frame in proto.encode_request(rid, op, args, payload):
                self._writer.write(frame)
                await self._drain(op, idle)
                pending.last_activity = time.monotonic()
            while not pending.future.done():
                limits = [
                    t
                    for t in (end, None if idle is None else pending.last_activity + idle)
                    if t is not None
                ]
                wait = None if not limits else min(limits) - time.monotonic()
                if wait is not None and wait <= 0:
                    self._send_cancel(rid)
                    seconds = deadline if end is not None and time.monotonic() >= end else idle
                    raise OperationTimeout(
                        f"the guest agent did not answer {op} within {seconds} s",
                        seconds=seconds,
                        op=op,
                    )
                await asyncio.wait({pending.future}, timeout=wait)
            reply = pending.future.result()
        except asyncio.CancelledError:
            # The agent serves a ping in order on its read loop, so no cancel can stop one:
            # the first ping's spare retries (connect) would only be more frames for a waking
            # guest to read before its first real request.
            if op not in INLINE_OPS:
                self._send_cancel(rid)
            raise
        except proto.ProtocolError as exc:  # arguments that cannot be framed
            self._send_cancel(rid)
            if exc.size is not None:
                raise PayloadTooLarge(f"{op}: {exc}", size=exc.size, limit=exc.limit) from exc
            raise InvalidArgument(f"{op}: {exc}") from exc
        finally:
            del self._pending[rid]
        if not reply.get("ok"):
            raise _guest_error(reply.get("error"))
        if reply.get("result_in_data"):
            try:
                result = json.loads(bytes(pending.data))
            except (ValueError, RecursionError) as exc:  # not JSON, or nested too deep
                raise GuestError(f"the guest sent a corrupt {op} result", exc=exc) from exc
            pending.data.clear()
        else:
            result = reply.get("result")
        return result if isinstance(result, dict) else {}

    async def _drain(self, op: str, idle: float | None) -> None:
        try:
            await asyncio.wait_for(self._writer.drain(), idle)
        except TimeoutError as exc:
            raise OperationTimeout(
                f"the guest agent stopped reading during {op}", seconds=idle, op=op
            ) from exc
        except (ConnectionError, OSError) as exc:
            raise GuestError(f"the connection to the guest agent broke: {exc}", exc=exc) from exc

    async def ping(self) -> dict[str, Any]:
        """``{pid, boot_id, uptime, time, version}`` of the agent."""
        return await self._request("ping", {})

    async def run_command(
        self,
        command: CommandSpec | str,
        /,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        **fields: Any,
    ) -> CommandResult:
        """Run a command (a :class:`CommandSpec`, or ``cmd`` and its fields) with /bin/sh in
        the guest. A non-zero exit is a result, not an error. ``background=True`` returns at
        once with the pid (exit_code -1 while it runs). Raises InvalidArgument /
        PayloadTooLarge (a bad spec; output over the limit), OperationTimeout (the process
        group is killed), PathNotFound (``cwd`` missing). OperationTimeout carries the output
        printed before the kill in ``.stdout``/``.stderr``."""
        spec = CommandSpec.of(command, **fields)
        args = {
            **spec.model_dump(),
            "env": spec.env or {},
            "max_output": self.limits.max_output_bytes,
        }
        timeout = spec.timeout
        deadline = None if timeout is None else timeout + TIMEOUT_GRACE
        got: list[_Pending] = []
        try:
            result = await self._request(
                "run",
                args,
                deadline=deadline,
                idle=None,
                stdout=on_stdout,
                stderr=on_stderr,
                pending_out=got,
            )
        except OperationTimeout as exc:  # keep what the command printed before it was killed
            for stream in ("stdout", "stderr"):  # data keys are attributes too (TorporError)
                exc.data[stream] = got[0].text(stream)
                setattr(exc, stream, exc.data[stream])
            raise
        exit_code = result.get("exit_code")
        fields = {"exit_code": -1 if exit_code is None else exit_code, "pid": result.get("pid")}
        return _from_guest(
            CommandResult.model_validate,
            {**fields, "stdout": got[0].text("stdout"), "stderr": got[0].text("stderr")},
            "run",
        )

    async def run_code(
        self,
        code: CodeSpec | str,
        /,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        **fields: Any,
    ) -> Execution:
        """Run Python code (a :class:`CodeSpec`, or ``code`` and its ``timeout``) in the
        sandbox's long-lived interpreter. An exception in the code is ``Execution.error``.
        Raises OperationTimeout (the code was interrupted; the variables are kept),
        PayloadTooLarge (code or output over the limit)."""
        spec = CodeSpec.of(code, **fields)
        timeout = spec.timeout
        raw = spec.code.encode("utf-8")
        if len(raw) > self.limits.max_code_bytes:
            raise PayloadTooLarge(
                f"code of {len(raw)} bytes is over the limit",
                size=len(raw),
                limit=self.limits.max_code_bytes,
            )
        args = {
            "timeout": timeout,
            "max_output": self.limits.max_output_bytes,
            "max_bytes": self.limits.max_code_bytes,
        }
        deadline = None if timeout is None else timeout + TIMEOUT_GRACE
        got: list[_Pending] = []
        result = await self._request(
            "run_code",
            args,
            raw,
            deadline=deadline,
            idle=None,
            stdout=on_stdout,
            stderr=on_stderr,
            pending_out=got,
        )
        fields = {"results": result.get("results") or [], "error": result.get("error") or None}
        return _from_guest(
            Execution.model_validate,
            {**fields, "stdout": got[0].text("stdout"), "stderr": got[0].text("stderr")},
            "run_code",
        )

    async def pty_open(
        self,
        pty_id: str,
        cmd: str,
        on_data: Callable[[bytes], None],
        *,
        cols: int = 80,
        rows: int = 24,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> tuple[int, asyncio.Task[int]]:
        """Start ``cmd`` on a new terminal in the guest, called ``pty_id`` by the other
        ``pty_*`` calls. ``on_data`` gets its output as it comes. Returns its pid, once the
        guest has it running, and a task ending with its exit code (cancelling the task kills
        it). Raises PathNotFound (``cwd``), GuestError."""
        loop = asyncio.get_running_loop()
        started: asyncio.Future[int] = loop.create_future()

        def on_event(stream: str, chunk: bytes) -> None:
            if stream == "pty":
                on_data(chunk)
            elif stream == "started" and not started.done():
                try:
                    started.set_result(_from_guest(_INT, chunk.decode("utf-8", "replace"), "pty"))
                except GuestError as exc:
                    started.set_exception(exc)

        args = {"id": pty_id, "cmd": cmd, "cols": cols, "rows": rows, "env": env or {}}
        if cwd is not None:
            args["cwd"] = cwd

        async def run() -> int:
            result = await self._request("pty", args, idle=None, raw=on_event)
            return _from_guest(_INT, result.get("exit_code", -1), "pty")

        task = loop.create_task(run())
        await _until_started(started, task)
        if started.done() and (bad := started.exception()) is not None:  # a pid, not a number
            task.cancel()  # the guest ends the program it started for nobody
            await asyncio.gather(task, return_exceptions=True)
            raise bad
        if not started.done():  # it failed (or exited) before it said it started
            started.cancel()
            exc = task.exception()
            if isinstance(exc, InvalidArgument) and "unknown guest operation" in exc.message:
                raise InvalidArgument(
                    "this sandbox's guest agent has no terminals: it comes from a template "
                    "built by an older torpor (rebuild it: torpor template build python; "
                    "sandboxes created after that have them)"
                ) from exc
            if exc is not None:
                raise exc
            raise GuestError(f"the terminal {pty_id} ended before it started")
        return started.result(), task

    async def pty_input(self, pty_id: str, data: bytes) -> None:
        """Type ``data`` on terminal ``pty_id``. Raises NotFound (no such open terminal)."""
        await self._request("pty_input", {"id": pty_id}, data)

    async def pty_resize(self, pty_id: str, cols: int, rows: int) -> None:
        """Set terminal ``pty_id``'s size (its program gets SIGWINCH). Raises NotFound."""
        await self._request("pty_resize", {"id": pty_id, "cols": cols, "rows": rows})

    async def pty_kill(self, pty_id: str) -> None:
        """Kill the program on terminal ``pty_id`` and its session. Raises NotFound."""
        await self._request("pty_kill", {"id": pty_id})

    async def tunnel_open(
        self, tunnel_id: str, port: int, on_data: Callable[[bytes], None]
    ) -> asyncio.Task[int]:
        """Connect to ``127.0.0.1:port`` in the guest, a connection called ``tunnel_id`` by
        :meth:`tunnel_send` / :meth:`tunnel_close`. ``on_data`` gets what the guest's side
        sends. Returns, once connected, a task that ends when the guest's side closes
        (cancelling it drops the connection). Raises NotFound (nothing listens there),
        GuestError."""
        loop = asyncio.get_running_loop()
        started: asyncio.Future[int] = loop.create_future()

        def on_event(stream: str, chunk: bytes) -> None:
            if stream == "data":
                on_data(chunk)
            elif stream == "started" and not started.done():
                started.set_result(0)

        async def run() -> int:
            result = await self._request(
                "tunnel", {"id": tunnel_id, "port": port}, idle=None, raw=on_event
            )
            return _from_guest(_INT, result.get("bytes", 0), "tunnel")

        task = loop.create_task(run())
        await _until_started(started, task)
        if not started.done():
            started.cancel()
            exc = task.exception()
            if isinstance(exc, InvalidArgument) and "unknown guest operation" in exc.message:
                raise InvalidArgument(
                    "this sandbox's guest agent cannot reach its ports: it comes from a "
                    "template built by an older torpor (rebuild it: torpor template build "
                    "python; sandboxes created after that can)"
                ) from exc
            if exc is not None:
                raise exc
            raise GuestError(f"the tunnel to port {port} closed before it opened")
        return task

    async def tunnel_send(self, tunnel_id: str, data: bytes) -> None:
        """Send ``data`` to the guest's side of the tunnel. Raises NotFound (closed)."""
        await self._request("tunnel_send", {"id": tunnel_id}, data)

    async def tunnel_close(self, tunnel_id: str) -> None:
        """No more bytes for the guest's side (it reads EOF). Raises NotFound (closed)."""
        await self._request("tunnel_close", {"id": tunnel_id})

    async def restart_interpreter(self) -> None:
        """Kill the interpreter (its variables are lost); the next run starts a fresh one."""
        await self._request("restart_interpreter", {})

    async def read_file(self, path: str) -> bytes:
        """The bytes of ``path``. Raises PathNotFound, PayloadTooLarge, InvalidArgument
        (a directory)."""
        limit = self.limits.max_file_bytes
        got: list[_Pending] = []
        await self._request(
            "read", {"path": path, "max_bytes": limit}, data_limit=limit, pending_out=got
        )
        return bytes(got[0].data)

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write ``data`` (str as UTF-8) to ``path`` atomically, creating parent directories.
        Raises PayloadTooLarge (before sending anything), InvalidArgument, GuestError."""
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        if len(raw) > self.limits.max_file_bytes:
            raise PayloadTooLarge(
                f"{len(raw)} bytes for {path} is over the limit",
                size=len(raw),
                limit=self.limits.max_file_bytes,
            )
        await self._request("write", {"path": path, "max_bytes": self.limits.max_file_bytes}, raw)

    async def list_dir(self, path: str) -> list[EntryInfo]:
        """The entries of directory ``path``, sorted by name. Raises PathNotFound."""
        result = await self._request("list", {"path": path})
        return _from_guest(_ENTRIES, result.get("entries", []), "list")

    async def exists(self, path: str) -> bool:
        """Whether ``path`` exists (a dangling symlink counts)."""
        return bool((await self._request("exists", {"path": path})).get("exists"))

    async def remove(self, path: str) -> None:
        """Remove a file, a symlink or a whole tree. Raises PathNotFound."""
        await self._request("remove", {"path": path})

    async def make_dir(self, path: str) -> None:
        """Create ``path`` and its parents (no error if it is a directory already).
        Raises InvalidArgument when a file is in the way."""
        await self._request("make_dir", {"path": path})

    async def refresh(
        self, *, entropy: bytes | None = None, unix_time: float | None = None
    ) -> dict[str, Any]:
        """After a wake, fork or restore: mix host entropy into the guest's pool, set its
        clock and reseed its interpreter's ``random``. Defaults: 64 fresh bytes, now.

        When :meth:`connect` refreshed the guest less than :data:`FRESH_FOR` seconds ago and
        no request was sent since, and ``unix_time`` is "now" (None or within a second of the
        host's clock), that refresh's result is returned without a round trip: the guest
        already mixed 64 fresh host bytes (``entropy`` is then not sent: it could add nothing
        the guest does not have) and has the host's clock."""
        fresh = self._fresh
        if (
            fresh is not None
            and fresh[1].get("entropy_bytes")  # not a clock-only one (connect without reseed)
            and time.monotonic() - fresh[0] < FRESH_FOR
            and (unix_time is None or abs(unix_time - time.time()) < 1.0)
        ):
            return dict(fresh[1])
        entropy = os.urandom(64) if entropy is None else entropy
        unix_time = time.time() if unix_time is None else unix_time
        return await self._request("refresh", {"unix_time": unix_time}, entropy)

    async def sync(self) -> None:
        """Flush the guest's file systems to their disks."""
        await self._request("sync", {})

    async def mount(
        self, source: str, target: str, *, fstype: str | None = None, options: str | None = None
    ) -> None:
        """``mount [-t fstype] [-o options] source target`` in the guest (creates target).
        Raises GuestError with mount's message."""
        await self._request(
            "mount", {"source": source, "target": target, "fstype": fstype, "options": options}
        )

    async def umount(self, target: str) -> None:
        """``umount target`` in the guest. Raises GuestError."""
        await self._request("umount", {"target": target})


def wake_split(marks: dict[str, Any], resumed_at: float) -> dict[str, float]:
    """Where the wait for a woken guest's first answer went: milliseconds after the host's
    ``cont`` returned (``resumed_at``, its ``time.monotonic()``) at which the guest ran its
    agent's idle loop again (``first_turn``), saw the host connected (``host_seen``), read
    the first bytes (``data``), began serving the ping (``served``) and had its answer ready
    (``answered``), and when the host got it (``received``). From
    :attr:`GuestChannel.guest_marks`; empty without them.

    The guest's clock stands still while QEMU is stopped and runs at the host's pace after,
    so a guest stamp ``g`` is placed on the host's clock as ``received - (answered - g)``
    (the answer's own trip to the host, well under a millisecond when the guest is warm, is
    counted in the guest's last step). A step the guest took before ``cont`` (an idle turn
    before the hibernate) is left out."""
    try:
        received = float(marks["answered_at"])
        answered = float(marks["answered"])
    except (KeyError, TypeError, ValueError):
        return {}

    def at(g: float) -> float:
        return (received - (answered - g) - resumed_at) * 1000

    split: dict[str, float] = {}
    turns = [at(float(t)) for t in marks.get("turns") or []]
    after = [t for t in turns if t >= 0]
    if after:
        split["first_turn"] = after[0]
    for key in ("host_seen", "data", "served", "answered"):
        value = marks.get(key)
        if isinstance(value, int | float):
            split[key] = at(float(value))
    split["received"] = (received - resumed_at) * 1000
    return split


class _VersionMismatch(Exception):
    """Internal: the agent answered but speaks another protocol (raised as GuestError)."""

    def __init__(self, version: Any) -> None:
        super().__init__(
            f"the guest agent speaks protocol {version}, this host "
            f"{proto.PROTOCOL_VERSION}: rebuild the template"
        )
        self.version = version


#: a directory listing as the guest sends it, and a number it sends (a pid, an exit code)
_ENTRIES = TypeAdapter(list[EntryInfo]).validate_python
_INT = TypeAdapter(int).validate_python


def _from_guest(validate: Callable[[Any], _M], value: Any, op: str) -> _M:
    """``value``, part of the guest's answer to ``op``, read by ``validate`` (a model's
    ``model_validate``, an adapter's ``validate_python``). The guest is not trusted: raises
    GuestError when what it sent does not fit."""
    try:
        return validate(value)
    except ValidationError as exc:
        raise GuestError(f"the guest sent a malformed {op} result: {exc}", exc=exc) from None


#: the headers of an answer to a guest's call that is JSON
_JSON = {"content-type": "application/json"}


def _error_body(error: TorporError) -> bytes:
    """The body of an answer to a guest's call that is ``error`` (the server's wire form)."""
    return json.dumps({"error": error.to_wire()}).encode()


#: names a guest's error data may not set on the error it becomes (they are the error's own:
#: its message, cause, ``data``, ``http_status``, ``to_wire``, ``args``, dunders...)
_RESERVED = frozenset(dir(TorporError)) | {"message", "exc", "data"}


def _guest_error(payload: Any) -> TorporError:
    """The error a guest's reply reports, as the :mod:`torpor.errors` class it names (a
    GuestError for a name this host does not know). The guest is not trusted: data that is
    not an object is dropped, and so are keys that would overwrite the error's own
    attributes."""
    if not isinstance(payload, dict):
        return GuestError("the guest agent failed without saying why")
    data = payload.get("data")
    kept = (
        {k: v for k, v in data.items() if k not in _RESERVED and not k.startswith("_")}
        if isinstance(data, dict)
        else {}
    )
    error = from_wire({**payload, "data": kept})
    if type(error) is TorporError:  # a type name this host does not know
        return GuestError(error.message, **error.data)
    return error
