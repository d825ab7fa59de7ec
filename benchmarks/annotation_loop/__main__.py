"""``python -m benchmarks.annotation_loop [--real] ...``: the synthetic loop, or with ``--real`` the loop
on real documents (each mode's options: ``--help`` with or without ``--real``)."""

from __future__ import annotations

import sys

from benchmarks.annotation_loop import real, synthetic

if __name__ == "__main__":
    argv = sys.argv[1:]
    raise SystemExit(real.main(argv) if "--real" in argv else synthetic.main(argv))
