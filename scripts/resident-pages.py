#!/usr/bin/env python3
"""Which code of a running process is resident: each resident page of its binary's mappings
(/proc/PID/pagemap, bit 63) attributed to the symbols on it (`nm`), summed per crate.

    scripts/resident-pages.py PID [TOP]

Prints the resident KiB of each of the binary's mappings, then the TOP (25) crates by resident
KiB of text, a page shared by several crates' symbols counted once for each. Run as root (the
pagemap of another user's process) against a binary that kept its symbols (berth's release and
agent profiles strip debuginfo only). What it says is where the pages are, not why they were
touched: the kernel maps file pages around each fault (fault-around, 64 KiB by default), so a
page can be resident without any of its code having run.
"""
import collections
import os
import re
import struct
import subprocess
import sys

PAGE = os.sysconf("SC_PAGE_SIZE")


def mappings(pid, exe):
    """(start, end, perms, file offset) of each mapping of `exe`."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() in (exe, exe + " (deleted)"):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end, parts[1], int(parts[2], 16)))
    return out


def resident_pages(pid, start, end):
    """The addresses of the pages in [start, end) that are present."""
    with open(f"/proc/{pid}/pagemap", "rb") as f:
        f.seek(start // PAGE * 8)
        data = f.read((end - start) // PAGE * 8)
    return [
        start + i * PAGE
        for i, (entry,) in enumerate(struct.iter_unpack("<Q", data))
        if entry >> 63 & 1
    ]


def crate_of(symbol):
    """The crate a demangled Rust symbol belongs to (its first path segment), else `[C] name`."""
    s = symbol.lstrip("<&*")
    s = re.sub(r"^(dyn |impl |mut )", "", s)
    m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)::", s)
    if m:
        return m.group(1)
    return "[C/other]"


def main():
    pid = int(sys.argv[1])
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
    maps = mappings(pid, exe)
    if not maps:
        sys.exit(f"no mapping of {exe} in /proc/{pid}/maps")
    # A PIE's first mapping (file offset 0) is at its load bias.
    bias = min(start for start, _, _, off in maps if off == 0)
    print(f"{exe}: load bias {bias:#x}")
    text_pages = set()
    for start, end, perms, off in maps:
        pages = resident_pages(pid, start, end)
        print(f"  {perms} {len(pages) * PAGE // 1024:7d} KiB resident of {(end - start) // 1024:7d} KiB")
        if "x" in perms:
            text_pages.update(pages)

    nm = subprocess.run(
        ["nm", "--defined-only", "--demangle", "-S", exe],
        capture_output=True, text=True, check=True,
    ).stdout
    per_page = collections.defaultdict(set)
    sized = 0
    for line in nm.splitlines():
        parts = line.split(maxsplit=3)
        if len(parts) != 4 or parts[2] not in "tTwW":
            continue
        addr, size = int(parts[0], 16), int(parts[1], 16)
        if size == 0:
            continue
        sized += 1
        first = (bias + addr) // PAGE * PAGE
        last = (bias + addr + size - 1) // PAGE * PAGE
        crate = crate_of(parts[3])
        for page in range(first, last + PAGE, PAGE):
            if page in text_pages:
                per_page[page].add(crate)
    kib = collections.Counter()
    for crates in per_page.values():
        for c in crates:
            kib[c] += PAGE // 1024
    unattributed = len(text_pages) - len(per_page)
    print(f"text: {len(text_pages) * PAGE // 1024} KiB resident, {sized} sized code symbols;"
          f" {unattributed * PAGE // 1024} KiB on pages with no sized symbol")
    for crate, k in kib.most_common(top):
        print(f"  {k:6d} KiB  {crate}")


if __name__ == "__main__":
    main()
