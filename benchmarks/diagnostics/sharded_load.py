"""One rank's sharded load of a saved checkpoint, with and without the checksum verification it does
(each shard it reads hashed whole, once), alternated in one process:

    PYTHONPATH=. python benchmarks/diagnostics/sharded_load.py [DIR] [--reps 15]

DIR (default: a temporary folder) gets the laptop checkpoint when it holds none. Prints, per layout, rank 0's
resident bytes and the best and median load times both ways; docs/benchmarks.md, "Sharded load".
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import minidsa
from minidsa.distributed import Comm, Parallelism, load_rank
from minidsa.formats import shards


def timed_load(directory: Path, par: Parallelism) -> tuple[float, int]:
    t0 = time.perf_counter()
    model = load_rank(str(directory), par, 0, Comm(par, 0))
    seconds = time.perf_counter() - t0
    return seconds, sum(t.numel() * t.element_size() for t in model.checkpoint_tensors().values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", nargs="?", default=None, help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--reps", type=int, default=15, help="alternating runs per mode (default: 15)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(args.directory or tmp)
        if not (directory / shards.INDEX_NAME).is_file():
            minidsa.load("laptop").save_pretrained(directory)
        files = sorted(set(shards.read_index(directory)[0].values()))
        print(f"{directory}: {len(files)} shard(s), {sum((directory / f).stat().st_size for f in files) / 1e6:.1f} MB")
        verify = shards.verify_checksum
        for tp, ep in [(2, 1), (1, 2), (2, 2)]:
            par, times = Parallelism(tp, ep), {"verified": [], "unverified": []}
            for _ in range(args.reps):
                for mode in times:
                    shards.verify_checksum = verify if mode == "verified" else (lambda path, expected: None)
                    try:
                        seconds, resident = timed_load(directory, par)
                    finally:
                        shards.verify_checksum = verify
                    times[mode].append(seconds)
            row = ", ".join(f"{m} {min(t):.3f} / {statistics.median(t):.3f} s" for m, t in times.items())
            print(f"rank 0 of tp={tp}, ep={ep}: {resident / 1e6:.1f} MB resident; best / median: {row}")


if __name__ == "__main__":
    main()
