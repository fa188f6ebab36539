"""What a split epoch's data state costs as the data and the cluster grow, on synthetic
manifests of ImageNet's size (1,282 shards of ~1,000 samples) and LAION-400M's (400,000 shards
of ~1,000), each rank with 8 loader workers, stopped with every slot half-way through a shard
(tests/plan/test_scale.py makes the same measures and holds them to their bounds):

- the bytes a rank all-reduces at each checkpoint and epoch end (the tally's shards x 3 int32
  table), and the flags of the shards in flight all ranks gather;
- the data position each checkpoint keeps (`Position.to_state()`, pickled);
- one loader worker's pickled stages (what a forkserver worker is sent each epoch);
- seconds and peak Python memory (tracemalloc, in a second run) of a rank's resume plan and of
  its tally.

"Before" is what the design before per-shard positions moved by construction: an int32 per
sample of the split all-reduced, a bit per sample kept.

    .venv/bin/python benchmarks/state_scale.py            # the table in docs/performance.md
    .venv/bin/python benchmarks/state_scale.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "plan"))  # the measures, as the tests keep them

from test_scale import measure


def mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    args = parser.parse_args()
    cases = [(1282, 8), (1282, 512), (400_000, 512), (400_000, 4096)]
    if args.quick:
        cases = [(1282, 8), (20_000, 64)]
    print(
        "| shards x ranks (x 8 workers) | all-reduced per checkpoint: before / now | gathered, all ranks "
        "| position kept: before / now | one worker's stages | resume plan | tally |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for count, ranks in cases:
        m = measure(count, ranks)
        print(
            f"| {count:,} x {ranks:,} | {mb(4 * m['samples'])} / {mb(m['reduced'])} | {mb(m['gathered'])} "
            f"| {mb(m['samples'] / 8)} / {mb(m['state'])} | {mb(m['worker'])} "
            f"| {m['plan_s']:.2f} s, {mb(m['plan_peak'])} | {m['tally_s']:.3f} s, {mb(m['tally_peak'])} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
