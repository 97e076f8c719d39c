"""Accuracy of a trained run before and after MXFP4: the float master weights of ``training_state.safetensors``
against the shipped checkpoint format (routed experts quantised to MXFP4 at save) of the same run.

    python benchmarks/diagnostics/quantisation_drop.py runs/tiny [--n 256] [--context 72]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import minidsa
from minidsa.training.evaluation import evaluate
from minidsa.training.forward import TrainingModel
from minidsa.training.state import load_state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="a training run directory (checkpoint + training_state.pt)")
    p.add_argument("--n", type=int, default=256, help="held-out samples per task")
    p.add_argument("--context", type=int, default=None, help="retrieval context (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    run = Path(args.run)
    masters = TrainingModel(minidsa.MiniDSA(minidsa.load_config(run / "config.json")))
    masters.load_state_dict(load_state(run)["model"])
    rows = {"float masters": evaluate(masters, seed=args.seed, n=args.n, context=args.context),
            "MXFP4 checkpoint": evaluate(minidsa.load(run, progress=False), seed=args.seed, n=args.n,
                                         context=args.context)}
    names = list(rows["float masters"])
    print(f"{'metric':40s} {'float masters':>14s} {'MXFP4 checkpoint':>17s} {'drop':>8s}")
    for k in names:
        a, b = rows["float masters"][k], rows["MXFP4 checkpoint"][k]
        print(f"{k:40s} {a:14.4f} {b:17.4f} {a - b:8.4f}")


if __name__ == "__main__":
    main()
