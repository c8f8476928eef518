"""Log tails quoted in errors are bounded and sanitized; a log a guest floods stays bounded."""

from __future__ import annotations

import os
from pathlib import Path

from torpor._tail import log_tail, trim_log


def test_a_tail_reads_only_the_end_of_a_huge_file(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    with open(log, "wb") as f:
        f.truncate(8 << 30)  # 8 GiB (sparse): reading it whole would take the memory with it
        f.seek(0, os.SEEK_END)
        f.write(b"booting\nkernel panic: the end\n")
    assert log_tail(log, 2).endswith("kernel panic: the end")
    assert len(log_tail(log, 10_000)) <= 16 * 1024


def test_a_tail_quotes_no_control_characters(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    log.write_bytes(b"ok\tline\n\x1b[2J\x1b]0;pwned\x07 clear screen\r\n")
    tail = log_tail(log, 5)
    assert "\x1b" not in tail and "\x07" not in tail and "\r" not in tail
    assert tail.splitlines()[0] == "ok\tline"
    assert log_tail(tmp_path / "missing.log") == ""


def test_a_flooded_log_is_cut_to_its_end(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    log.write_bytes(b"x" * 10_000 + b"\nlast words\n")
    assert not trim_log(log, limit=20_000, keep=100)  # under the limit: untouched
    assert trim_log(log, limit=5_000, keep=100)
    assert log.stat().st_size == 100
    assert log.read_bytes().endswith(b"last words\n")
    with open(log, "ab") as writer:  # a writer appending (QEMU: O_APPEND) lands at the new end
        writer.write(b"after\n")
    assert log.read_bytes().endswith(b"last words\nafter\n")
