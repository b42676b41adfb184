"""Train (or load) the book's shared tiny model once, before the tests run in parallel.

Several chapters load the tiny TinyShakespeare model from `lib.tiny_model`; on a fresh cache the
first load trains it (about two minutes on one CPU thread), inside whichever chapter runs first.
Doing it here, before the tests, keeps that one-time cost out of any chapter's cell timings and
says plainly in the log what is happening.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib.tiny_model import tiny_shakespeare_run  # noqa: E402

if __name__ == "__main__":
    start = time.perf_counter()
    run = tiny_shakespeare_run()
    what = "trained" if run.trained else "found in the cache"
    print(f"tiny model {what} ({time.perf_counter() - start:.0f} s): {run.path}")
