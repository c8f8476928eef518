"""Which pages of a running QEMU's RAM file changed since a moment: the kernel's soft-dirty bits.

A live snapshot must copy the guest's RAM file as it is at one instant, and the guest stands
still while that copy is made. Most of the file does not change in the ~100 ms a copy takes,
so :func:`~torpor.sandbox.vm.machine.QemuMachine.capture` copies it *while the guest runs*
(a pre-copy) and, once stopped, copies again only the pages written since the pre-copy
began. Linux tells which ones: writing ``4`` to ``/proc/<pid>/clear_refs`` clears the
soft-dirty bit of every page table entry of the process (and write-protects it); the next
write to a page sets the bit again, which ``/proc/<pid>/pagemap`` (one 64-bit entry per page
of the process's address space) reports as bit 55 (``Documentation/admin-guide/mm/soft-dirty.rst``).

The RAM file is a shared file mapping, so a page can also leave the page tables (reclaim
writes it back and unmaps it) and lose its bit. :class:`DirtyPages` therefore copies every
page whose whole entry changed since the clear, not only the soft-dirty ones: present or not,
which physical frame (visible to root), swapped, soft-dirty. A page written, reclaimed and
read back into the very same frame within the window is the one case this cannot see; with
the file's pages mapped by a running guest and the window a fraction of a second, the
kernel has no reason to reclaim them.

Where soft-dirty is unavailable (no ``CONFIG_MEM_SOFT_DIRTY``, no access to the process),
:meth:`DirtyPages.start` returns False and the caller copies the whole file while stopped.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from torpor.sandbox.vm.disk import copy_range

__all__ = ["PAGE", "DirtyPages", "copy_changed"]

log = logging.getLogger(__name__)

PAGE = os.sysconf("SC_PAGE_SIZE")
_ENTRY = 8  # bytes per pagemap entry
_BLOCK = 4096  # pagemap bytes compared at once (512 pages) before looking at single entries


@dataclass(frozen=True)
class _Mapping:
    start: int  # virtual address
    end: int
    offset: int  # file offset of ``start``


def _mappings(pid: int, path: Path) -> list[_Mapping]:
    """The process's mappings of ``path`` (from ``/proc/<pid>/maps``)."""
    target = str(path.resolve())
    found: list[_Mapping] = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or parts[5].strip() != target:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            found.append(_Mapping(lo, hi, int(parts[2], 16)))
    return found


class DirtyPages:
    """Soft-dirty tracking of process ``pid``'s mappings of file ``path`` (see the module).

    ``start()`` clears the bits and records every entry; ``changed()`` returns the file's
    byte ranges whose pages may differ from when ``start`` ran. Both raise OSError."""

    def __init__(self, pid: int, path: Path) -> None:
        self.pid = pid
        self.path = path
        self._maps: list[_Mapping] = []
        self._before: list[bytes] = []

    def _read(self, fd: int) -> list[bytes]:
        out = []
        for m in self._maps:
            size = (m.end - m.start) // PAGE * _ENTRY
            data = os.pread(fd, size, m.start // PAGE * _ENTRY)
            if len(data) != size:
                raise OSError(f"short pagemap read for pid {self.pid}")
            out.append(data)
        return out

    def start(self) -> bool:
        """Clear the soft-dirty bits and record the entries; False if this host cannot track
        (then nothing changed and the caller copies everything)."""
        try:
            self._maps = _mappings(self.pid, self.path)
            if not self._maps:
                return False
            with open(f"/proc/{self.pid}/clear_refs", "w") as f:
                f.write("4")
            fd = os.open(f"/proc/{self.pid}/pagemap", os.O_RDONLY)
            try:
                self._before = self._read(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            log.info("no soft-dirty tracking of pid %d: %r", self.pid, exc)
            return False
        return True

    def changed(self) -> list[tuple[int, int]]:
        """File byte ranges (start, end), merged and sorted, whose pages were written, or
        whose page table entries otherwise changed, since :meth:`start`. Raises OSError."""
        fd = os.open(f"/proc/{self.pid}/pagemap", os.O_RDONLY)
        try:
            after = self._read(fd)
        finally:
            os.close(fd)
        if _mappings(self.pid, self.path) != self._maps:
            raise OSError(f"the mappings of {self.path} changed in pid {self.pid}")
        ranges: list[tuple[int, int]] = []
        for m, old, new in zip(self._maps, self._before, after, strict=True):
            for base in range(0, len(new), _BLOCK):
                a, b = old[base : base + _BLOCK], new[base : base + _BLOCK]
                if a == b:
                    continue
                for i in range(0, len(b), _ENTRY):
                    if a[i : i + _ENTRY] != b[i : i + _ENTRY]:
                        page = (base + i) // _ENTRY
                        lo = m.offset + page * PAGE
                        if ranges and ranges[-1][1] == lo:
                            ranges[-1] = (ranges[-1][0], lo + PAGE)
                        else:
                            ranges.append((lo, lo + PAGE))
        ranges.sort()
        return ranges


def copy_changed(src: Path, dst: Path, ranges: list[tuple[int, int]]) -> int:
    """Copy the byte ``ranges`` of ``src`` over the same offsets of ``dst`` (a pre-copy of
    it); a range past the end of ``src`` is cut there. Returns the bytes copied. Raises
    OSError."""
    copied = 0
    with open(src, "rb") as fin, open(dst, "r+b") as fout:
        size = os.fstat(fin.fileno()).st_size
        if os.fstat(fout.fileno()).st_size != size:
            os.ftruncate(fout.fileno(), size)
        for lo, hi in ranges:
            hi = min(hi, size)
            if lo < hi:
                copy_range(fin.fileno(), fout.fileno(), lo, hi)
                copied += hi - lo
    return copied
