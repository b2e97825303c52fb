"""Summarise py-spy's collapsed stacks (``py-spy record --format raw``): where the samples go.

    .venv/bin/python benchmarks/stacks.py /tmp/w.256 [--top 30] [--match streams/]

Prints, per function (``name (file:line)`` as py-spy names it, line numbers dropped so a function
is one entry), the share of samples in which it is on the stack (inclusive) and on top (self).
A sampling profiler does not slow short Python calls the way cProfile does, so the shares are
the ones to quote.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LINE = re.compile(r":\d+\)$")


def frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``, shortened to the package path."""
    frame = _LINE.sub(")", frame.strip())
    for marker in ("site-packages/", "/sparseety/", "/work/main/"):
        i = frame.find(marker)
        if i >= 0:
            start = frame.rfind("(", 0, i) + 1
            frame = frame[:start] + frame[i + len(marker) :]
            break
    return frame


def summarise(path: Path) -> tuple[int, Counter[str], Counter[str]]:
    """(samples, inclusive counts, self counts) over every stack in ``path``."""
    total = 0
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [frame_name(f) for f in stack.split(";")]
        total += n
        for name in set(frames):
            inclusive[name] += n
        own[frames[-1]] += n
    return total, inclusive, own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", type=Path)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--match", default="", help="only functions whose name contains this")
    args = ap.parse_args()
    total, inclusive, own = summarise(args.path)
    print(f"{total} samples")
    print(f"{'incl %':>7} {'self %':>7}  function")
    for name, n in inclusive.most_common():
        if args.match not in name:
            continue
        print(f"{100 * n / total:7.1f} {100 * own[name] / total:7.1f}  {name}")
        args.top -= 1
        if args.top <= 0:
            break


if __name__ == "__main__":
    main()
