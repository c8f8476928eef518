"""The host <-> guest framing: round trips, chunking, bounds and resynchronisation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torpor.sandbox.guest import protocol as proto

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
headers = st.builds(
    lambda i, t, extra: {**extra, "i": i, "t": t},
    st.integers(0, 2**48),
    st.sampled_from([proto.REQ, proto.DATA, proto.EVENT, proto.REPLY, proto.CANCEL]),
    st.dictionaries(st.text(min_size=2, max_size=8), json_values, max_size=4),
)
frames = st.lists(st.tuples(headers, st.binary(max_size=2000)), min_size=1, max_size=8)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@given(frames, st.lists(st.integers(0, 10**6), max_size=20))
@settings(max_examples=200, deadline=None)
def test_frames_survive_any_split(
    items: list[tuple[dict[str, object], bytes]], cuts: list[int]
) -> None:
    stream = b"".join(proto.encode_frame(h, p) for h, p in items)
    decoder = proto.FrameDecoder()
    out: list[proto.Frame] = []
    for piece in split(stream, cuts):
        out.extend(decoder.feed(piece))
    assert [(f.header, f.payload) for f in out] == items
    assert decoder.pending == 0 and decoder.skipped == 0


@given(st.binary(max_size=3000), frames)
@settings(max_examples=200, deadline=None)
def test_garbage_before_frames_is_skipped(
    garbage: bytes, items: list[tuple[dict[str, object], bytes]]
) -> None:
    # A stream that resumes mid-frame (after a hibernate) recovers at the next real frame,
    # as long as the garbage does not itself end in a frame's start.
    stream = b"".join(proto.encode_frame(h, p) for h, p in items)
    decoder = proto.FrameDecoder()
    out = decoder.feed(garbage.replace(proto.MAGIC, b"") + stream)
    assert [(f.header, f.payload) for f in out] == items


@given(st.binary(max_size=5000))
@settings(max_examples=300, deadline=None)
def test_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    decoder = proto.FrameDecoder()
    for frame in decoder.feed(data):
        assert isinstance(frame.header["i"], int)


def test_a_truncated_frame_then_a_good_one() -> None:
    good = proto.encode_frame({"i": 2, "t": proto.REPLY, "ok": True}, b"payload")
    cut = proto.encode_frame({"i": 1, "t": proto.EVENT, "s": "stdout"}, b"x" * 100)[:30]
    decoder = proto.FrameDecoder()
    assert decoder.feed(cut) == []
    decoder.reset()  # the agent does this when the host hangs up
    assert [f.id for f in decoder.feed(good)] == [2]


def test_a_corrupt_header_is_skipped() -> None:
    bad = bytearray(proto.encode_frame({"i": 1, "t": proto.REPLY}))
    bad[proto.PREFIX.size + 2] ^= 0xFF  # crc no longer matches
    good = proto.encode_frame({"i": 2, "t": proto.REPLY})
    decoder = proto.FrameDecoder()
    assert [f.id for f in decoder.feed(bytes(bad) + good)] == [2]
    assert decoder.skipped == len(bad)


@pytest.mark.parametrize(
    "size", [0, 1, proto.CHUNK - 1, proto.CHUNK, proto.CHUNK + 1, 3 * proto.CHUNK + 7]
)
def test_requests_are_chunked(size: int) -> None:
    payload = bytes(i % 251 for i in range(size))
    encoded = list(proto.encode_request(7, "write", {"path": "/x"}, payload))
    frames = proto.FrameDecoder().feed(b"".join(encoded))
    assert len(frames) == max(1, -(-size // proto.CHUNK))
    assert frames[0].header == {
        "i": 7,
        "t": proto.REQ,
        "op": "write",
        "args": {"path": "/x"},
        "more": len(frames) > 1,
    }
    assert all(
        f.header == {"i": 7, "t": proto.DATA, "more": n < len(frames) - 1}
        for n, f in enumerate(frames)
        if n > 0
    )
    assert b"".join(f.payload for f in frames) == payload
    assert all(len(f.payload) <= proto.CHUNK for f in frames)


def test_oversized_frames_are_refused() -> None:
    with pytest.raises(proto.ProtocolError):
        proto.encode_frame({"i": 1, "t": proto.DATA}, b"x" * (proto.MAX_PAYLOAD + 1))
    with pytest.raises(proto.ProtocolError):
        proto.encode_frame({"i": 1, "t": proto.REPLY, "blob": "y" * proto.MAX_HEADER})
    with pytest.raises(proto.ProtocolError):
        proto.encode_frame({"i": 1, "t": proto.REPLY, "bad": object()})


def test_decoder_refuses_a_length_over_its_bound() -> None:
    # A prefix that claims a huge payload is skipped, not waited for.
    big = proto.encode_frame({"i": 1, "t": proto.DATA}, b"z" * 100)
    good = proto.encode_frame({"i": 2, "t": proto.REPLY})
    decoder = proto.FrameDecoder(max_payload=50)
    assert [f.id for f in decoder.feed(big + good)] == [2]


def test_a_frame_waiting_for_its_payload_is_dropped_by_reset() -> None:
    big = proto.encode_frame({"i": 1, "t": proto.DATA, "more": False}, b"p" * 10_000)
    good = proto.encode_frame({"i": 2, "t": proto.REPLY})
    decoder = proto.FrameDecoder()
    for at in range(0, 8192, 4096):  # header checked, payload still arriving
        assert decoder.feed(big[at : at + 4096]) == []
    decoder.reset()
    assert decoder.pending == 0
    assert [f.id for f in decoder.feed(good)] == [2]


def test_a_deeply_nested_header_is_skipped() -> None:
    # json.loads raises RecursionError, not ValueError, past its nesting limit
    deep = b'{"i":1,"t":"reply","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    crc = proto._crc(len(deep), 0, deep)
    bad = proto.PREFIX.pack(proto.MAGIC, len(deep), 0, crc) + deep
    good = proto.encode_frame({"i": 2, "t": proto.REPLY})
    decoder = proto.FrameDecoder()
    assert [f.id for f in decoder.feed(bad + good)] == [2]


def test_fake_prefixes_claiming_long_headers_cost_linear_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A hostile guest writes a prefix every 16 bytes, each claiming a 1 MiB header: checked
    # one by one up to the next magic, 64 KiB of them cost 4 GiB of crc (the host's event
    # loop stood still for seconds per KiB). The work stays in proportion to the input.
    checked = 0
    crc = proto._crc

    def counting(header_len: int, payload_len: int, header: bytes) -> int:
        nonlocal checked
        checked += len(header)
        return crc(header_len, payload_len, header)

    monkeypatch.setattr(proto, "_crc", counting)
    fake = proto.PREFIX.pack(proto.MAGIC, proto.MAX_HEADER, 0, 0) * (64 * 1024 // 16)
    good = proto.encode_frame({"i": 7, "t": proto.REPLY})
    decoder = proto.FrameDecoder()
    frames = decoder.feed(fake) + decoder.feed(b"\0" * proto.MAX_HEADER) + decoder.feed(good)
    assert [f.id for f in frames] == [7]
    assert checked <= 16 * proto.MAX_HEADER
