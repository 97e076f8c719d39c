"""Command line: ``python -m minidsa generate "prompt" [--config laptop] ...``, ``python -m minidsa params NAME``
and ``python -m minidsa check-checkpoint DIR [--config NAME]``."""

from __future__ import annotations

import argparse
import sys
import time

from .checkpoint import count_parameters, load
from .generate import generate
from .validator import check_checkpoint


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minidsa", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="continue a prompt with the (seeded, untrained) model")
    g.add_argument("prompt", help="text to continue ('' starts from bos alone)")
    g.add_argument("--config", default="tiny", help="preset name, config JSON path or checkpoint directory "
                                                    "(default: tiny)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="a PNG/JPEG image for the prompt (repeatable); placed before the text unless the prompt "
                        "marks its place with <|media_begin|>image<|media_content|><|media_pad|><|media_end|>")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    g.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-new-tokens (the untrained model samples eos at random)")
    c = sub.add_parser("params", help="count total and active parameters of a config (meta device, no memory)")
    c.add_argument("config", help="preset name, config JSON path or checkpoint directory")
    k = sub.add_parser("check-checkpoint", help="check a checkpoint's names, shapes and dtypes from its headers alone")
    k.add_argument("directory", help="checkpoint directory (config.json, index JSON, shards)")
    k.add_argument("--config", default=None, help="preset name or config JSON to check against "
                                                   "(default: the directory's config.json)")
    k.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "params":
        return _params(args.config)
    if args.command == "check-checkpoint":
        try:
            report = check_checkpoint(args.directory, args.config, progress=not args.no_progress)
        except (ValueError, TypeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(report)
        return 0 if report.ok else 1

    try:
        model = load(args.config)
        start = time.perf_counter()
        stream = generate(args.prompt, model, images=args.image, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                  stream=True, progress=not args.no_progress,
                                  stop_at_eos=not args.ignore_eos)
        pieces = list(stream)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    n = stream.num_generated
    print("".join(pieces))
    print(f"[{args.config}] {n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s "
          f"(time includes the prefill of {len(model.tokenizer.encode(args.prompt))} prompt tokens)", file=sys.stderr)
    return 0


def _params(config: str) -> int:
    try:
        counts = count_parameters(config)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{config}: {counts['total']:,} parameters in total, {counts['active']:,} active per token "
          f"({counts['total'] / 1e9:.2f} B / {counts['active'] / 1e9:.2f} B; "
          f"{counts['active_with_embedding_and_vision'] / 1e9:.2f} B counting the input embedding and vision path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
