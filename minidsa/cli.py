"""Command line: ``python -m minidsa generate "prompt" [--config laptop] ...``, ``python -m minidsa params NAME``,
``python -m minidsa check-checkpoint DIR|default [--config NAME]``, ``python -m minidsa train [--config tiny] --out DIR``
(``--resume`` continues a run in legs), ``python -m minidsa eval [--checkpoint DIR] [--seed N] [--n N]`` and
``python -m minidsa doctor [--checkpoint DIR|default|PRESET] [--backend B] [--device D]`` (the Day-0 ladder).
``python -m minidsa serve [--checkpoint DIR] [--host H] [--port N]`` runs the OpenAI-compatible HTTP service,
serving the model under the --checkpoint value as given (and its config's name).

Every command runs on ``--threads`` CPU threads (default 1, see DEFAULT_THREADS). A user error (a bad
argument, an unreadable file, a damaged checkpoint) prints one line, ``error: ...``, and exits with
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from .acceptance import doctor
from .cache import OutOfKVBlocksError
from .checkpoint.loading import load
from .checkpoint.manifest import DEFAULT_MODEL, count_parameters
from .checkpoint.validator import check_checkpoint
from .distributed import rank_bytes
from .distributed.launch import init_from_env, load_rank
from .ops import BACKENDS
from .server import start_server
from .serving import bench
from .serving.generation import stream as open_stream
from .training import loop as training_loop
from .training.evaluation import evaluate, format_metrics
from .training.state import run_config

# Measured on the project's 2-core CPU (README, "Threads"): at these sizes one thread decodes about as
# fast as two on a quiet machine, and two collapse 10-30x as soon as another process wants a core
# (each op waits for the slower thread). The CLI owns its process, so it may set this; library calls
# such as minidsa.generate() leave torch's setting to the caller.
DEFAULT_THREADS = 1


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage and exit; one line, like every other user error
        raise ValueError(f"{self.prog}: {message} (see {self.prog} --help)")


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--threads", type=_positive_int, default=DEFAULT_THREADS,
                        help=f"CPU threads for torch (default: {DEFAULT_THREADS}; more help only for large configs "
                             f"on cores nothing else uses)")
    parser = _Parser(prog="python -m minidsa", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _generate_parser(sub, common)
    _params_parser(sub, common)
    k = sub.add_parser("check-checkpoint", parents=[common],
                       help="check a checkpoint's names, shapes and dtypes from its headers alone")
    k.add_argument("directory", help="checkpoint directory (config.json, index JSON, shards) or 'default' (the "
                                     "shipped model's)")
    k.add_argument("--config", default=None, help="'default' (the shipped model's config), a preset name or a "
                                                   "config JSON to check against (default: the directory's "
                                                   "config: its index's, which config.json must match)")
    k.add_argument("--no-progress", action="store_true", help="hide the progress bar (default: shown)")
    _train_parser(sub, common)
    _bench_parser(sub, common)
    _serve_parser(sub, common)
    _doctor_parser(sub, common)
    e = sub.add_parser("eval", parents=[common], help="accuracy, random-selection baseline and indexer recall on "
                                                      "held-out seeds of the synthetic tasks (one 'name: value' a line)")
    e.add_argument("--checkpoint", default=DEFAULT_MODEL, help=f"checkpoint directory, 'default' (the shipped "
                                                                f"model) or a preset name (default: {DEFAULT_MODEL})")
    e.add_argument("--seed", type=int, default=0, help="seed of the held-out evaluation split (default: 0)")
    e.add_argument("--n", type=_positive_int, default=64, help="samples per task (default: 64)")
    e.add_argument("--context", type=_positive_int, default=None, help="retrieval context in tokens "
                                                                        "(default: 16 x top-k, capped by max_seq_len)")
    e.add_argument("--distractors", type=int, default=0, help="extra pass-key passages per prompt (default: 0)")
    e.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    return parser


def _generate_parser(sub, common) -> None:
    """``generate``: sample a continuation (serving/generation.py)."""
    g = sub.add_parser("generate", parents=[common], help="continue a prompt (default: the shipped trained model)")
    g.add_argument("prompt", help="text to continue ('' starts from bos alone)")
    g.add_argument("--config", default=DEFAULT_MODEL, help="'default' (the shipped trained checkpoint), a preset "
                                                           "name (seeded, untrained), a config JSON path or a "
                                                           f"checkpoint directory (default: {DEFAULT_MODEL})")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate; fewer when eos comes first "
                                                                   "(default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass in (0, 1]; 1 keeps every token "
                                                             "(default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampler (default: %(default)s)")
    g.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="a PNG/JPEG image for the prompt (repeatable; default: none); placed before the text unless "
                        "the prompt marks its place with <|media_begin|>image<|media_content|><|media_pad|><|media_end|>")
    g.add_argument("--no-progress", action="store_true",
                   help="hide the progress bars (loading; generation shows one only when stdout is not a terminal) "
                        "(default: shown)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-new-tokens (the untrained model samples eos at random) "
                        "(default: off, stop at eos)")
    g.add_argument("--device", default="cpu", help="torch device of the model, e.g. cuda (default: %(default)s; with "
                                                   "--tp/--ep each rank's model is on the CPU)")
    g.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="the ops' backend; 'auto' takes the kernels on a GPU (on sm_90 the Gluon ones where they fit), "
                        "'triton' the Triton kernels alone (default: %(default)s)")
    g.add_argument("--tp", type=_positive_int, default=None, help="tensor-parallel degree, under torchrun (default: "
                                                                   "none: one process holds the whole model; 1 when "
                                                                   "only --ep is given)")
    g.add_argument("--ep", type=_positive_int, default=None, help="expert-parallel degree, under torchrun (default: "
                                                                   "none; 1 when only --tp is given)")


def _params_parser(sub, common) -> None:
    c = sub.add_parser("params", parents=[common],
                       help="count total and active parameters of a config (meta device, no memory); with --tp / "
                            "--ep, each rank's resident bytes")
    c.add_argument("config", help="'default' (the shipped model's config), a preset name, a config JSON path or a "
                                  "checkpoint directory")
    c.add_argument("--tp", type=_positive_int, default=None, help="tensor-parallel degree (attention heads, shared "
                                                                   "expert, dense MLP) for the per-rank table "
                                                                   "(default: none: no table; 1 when only --ep is "
                                                                   "given)")
    c.add_argument("--ep", type=_positive_int, default=None, help="expert-parallel degree (routed experts) for the "
                                                                   "per-rank table (default: none: no table; 1 when "
                                                                   "only --tp is given)")


TRAIN_INT_OPTIONS = ("seed", "dense_steps", "warmup_steps", "sparse_steps", "batch_size", "mm_batch_size", "context",
                     "num_distractors", "easy_key_steps", "lr_warmup", "eval_every", "eval_n", "save_every",
                     "leg_steps")
TRAIN_FLOAT_OPTIONS = ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "text_loss_weight", "focus_loss_weight",
                       "easy_key_frac", "max_minutes")


def _bench_parser(sub, common) -> None:
    """``bench``: the offline serving benchmark (serving/bench.py)."""
    b = sub.add_parser("bench", parents=[common], help="offline serving benchmark: seeded requests through the "
                                                       "engine, vllm-bench-serve figures, vs a sequential loop")
    b.add_argument("--config", default="laptop", help="checkpoint or preset (default: laptop, seeded weights)")
    b.add_argument("--num-requests", type=_positive_int, default=32, help="requests in the run (default: "
                                                                          "%(default)s)")
    b.add_argument("--input-len", type=_positive_int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"),
                   help="prompt lengths in tokens, drawn uniformly from [MIN, MAX] (default: 32 512)")
    b.add_argument("--output-len", type=_positive_int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"),
                   help="tokens to generate per request, drawn uniformly from [MIN, MAX] (default: 16 128)")
    b.add_argument("--shared-prefix", type=int, default=0, metavar="N", help="tokens every prompt starts with "
                                                                             "(default: %(default)s)")
    b.add_argument("--images", type=int, default=0, metavar="K", help="random 32x32 images per prompt "
                                                                      "(default: %(default)s)")
    b.add_argument("--seed", type=int, default=0, help="seed of the requests' lengths, tokens and sampling "
                                                       "(default: %(default)s)")
    b.add_argument("--max-num-seqs", type=_positive_int, default=None, help="requests decoded together "
                                                                            "(default: the config's max_sequences)")
    b.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help="token budget of one engine step (default: the config's max_seq_len, at least 512)")
    b.add_argument("--no-prefix-caching", action="store_true", help="turn off prompt-prefix reuse (default: on)")
    b.add_argument("--no-chunked-prefill", action="store_true", help="prefill each prompt whole in one step "
                                                                     "(default: chunked under the token budget)")
    b.add_argument("--no-sequential", action="store_true", help="skip the sequential generate() baseline "
                                                                "(default: run it)")
    b.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    b.add_argument("--compile-decode", action="store_true", help="torch.compile the decode step each CUDA graph "
                   "captures (CUDA only; three compiles at start, the batch symbolic) (default: off)")


def _doctor_parser(sub, common) -> None:
    """``doctor``: the Day-0 acceptance ladder (acceptance/ladder.py)."""
    d = sub.add_parser("doctor", parents=[common], help="walk the Day-0 acceptance ladder (checkpoint, operators, "
                                                        "layers, request, batch, multimodal, service); exit 1 at the "
                                                        "first failing gate")
    d.add_argument("--checkpoint", default=DEFAULT_MODEL, help=f"checkpoint directory, 'default' (the shipped model) "
                                                                f"or a preset name (default: {DEFAULT_MODEL})")
    d.add_argument("--backend", default="auto", choices=BACKENDS,
                   help="the ops' backend; 'triton' on the CPU runs the kernels in Triton's interpreter (slow) "
                        "(default: %(default)s)")
    d.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="torch device (default: %(default)s)")
    d.add_argument("--json", action="store_true", help="print the report as JSON instead of one line per gate "
                                                       "(default: one line per gate)")


def _serve_parser(sub, common) -> None:
    """``serve``: the OpenAI-compatible HTTP service (server/app.py)."""
    s = sub.add_parser("serve", parents=[common], help="OpenAI-compatible HTTP service: /v1/completions, "
                                                       "/v1/chat/completions, /v1/models, /health, /metrics")
    s.add_argument("--checkpoint", default=DEFAULT_MODEL, help="checkpoint directory, 'default' (the shipped "
                                                                "model) or a preset name; served under this value as "
                                                                "given (a directory: its path as typed, e.g. "
                                                                "runs/tiny) and under its config's name "
                                                                "(default: %(default)s)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1; the server has no "
                                                      "authentication, so widen it only on a trusted network)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000; 0 picks a free one)")
    s.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    s.add_argument("--backend", default="auto", choices=BACKENDS, help="the ops' backend (default: auto)")
    s.add_argument("--max-num-seqs", type=_positive_int, default=None, help="requests decoded together "
                                                                            "(default: the config's max_sequences)")
    s.add_argument("--served-model-name", default=None, help="the name /v1/models lists and clients pass as "
                                                              "'model', in place of --checkpoint's value (the "
                                                              "config's name is accepted too) (default: the "
                                                              "--checkpoint value)")


def _train_parser(sub, common) -> None:
    """``train``: every TrainConfig field as an option (defaults from TrainConfig)."""
    d = training_loop.TrainConfig()
    t = sub.add_parser("train", parents=[common], help="train on the synthetic tasks (dense, indexer warm-up, "
                                                       "sparse), saving a checkpoint; --resume continues a run")
    t.add_argument("--config", default=None, help=f"model preset or config JSON (default: {d.model})")
    t.add_argument("--out", default=d.out_dir, help=f"checkpoint directory of the run (default: {d.out_dir})")
    t.add_argument("--resume", action="store_true", help="continue the run in --out with its own options; only "
                                                          "leg options (--max-minutes, --leg-steps, ...) may be given "
                                                          "(default: off, a new run)")
    t.add_argument("--overwrite", action="store_true", help="start over in an --out that holds a run (default: off, "
                                                             "such an --out is refused)")
    t.add_argument("--recipe", default="shipped", choices=sorted(training_loop.RECIPES),
                   help="the field defaults: 'shipped' (the run behind the shipped model, about 65 min on 2 "
                        "cores) or 'quick' (pass-key retrieval learned in under 2 min on one thread) "
                        "(default: %(default)s)")
    # None = the recipe's value (with --resume, the run's own)
    for names, kind, metavar in ((TRAIN_INT_OPTIONS, int, "N"), (TRAIN_FLOAT_OPTIONS, float, "X")):
        for name in names:
            t.add_argument("--" + name.replace("_", "-"), type=kind, default=None, metavar=metavar,
                           help=_recipe_defaults(name))
    t.add_argument("--device", default=d.device, help=f"torch device (default: {d.device})")
    t.add_argument("--no-progress", action="store_true", help="hide the progress bar (default: shown)")


def _recipe_defaults(name: str) -> str:
    """'(default: the --recipe's value: shipped 4400, quick 400)': each recipe's value of a TrainConfig field."""
    values = ", ".join(f"{recipe} {getattr(training_loop.TrainConfig.from_recipe(recipe), name)}"
                       for recipe in training_loop.RECIPES)
    return f"(default: the --recipe's value: {values})"


HARD_EXIT = False  # set when the process must leave without Python's teardown (minidsa/__main__.py)


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        torch.set_num_threads(args.threads)
        return {"generate": _generate, "params": _params, "check-checkpoint": _check, "train": _train,
                "eval": _eval, "bench": _bench, "serve": _serve, "doctor": _doctor}[args.command](args)
    except (ValueError, TypeError, OutOfKVBlocksError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)  # one line, whatever the message holds
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `| head`: the reader left; stop quietly (and keep Python's exit flush quiet)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except ConnectionError as e:  # a rank of this job died (distributed/failures.py): one line, then no teardown
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        global HARD_EXIT
        HARD_EXIT = True  # a process group that lost a peer can abort the interpreter's exit (std::terminate)
        return 2
    except OSError as e:  # a file that cannot be read or written: one line naming it, not a traceback
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2


def _check_utf8(text: str, name: str) -> None:
    """Python decodes argv with surrogateescape, so bytes that are not UTF-8 arrive as lone surrogates; name
    the shell-side fix (the library's own message suggests a Python one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = os.fsencode(text[e.start:e.start + 8])
        raise ValueError(f"the {name} argument is not UTF-8 (it holds the bytes {raw!r}); pass UTF-8 text, e.g. "
                         f"set a UTF-8 locale (LANG=C.UTF-8) or convert it with iconv -t UTF-8") from None


def _generate(args) -> int:
    """Stream the continuation to stdout as it is sampled; the speed line goes to stderr."""
    _check_utf8(args.prompt, "prompt")
    rank = 0
    if args.tp is not None or args.ep is not None:  # one rank of a torchrun job: its slices of the model
        if args.device != "cpu":
            raise ValueError(f"--device {args.device} with --tp/--ep: the ranks run on the CPU; drop --device")
        par, rank, comm = init_from_env(args.tp or 1, args.ep or 1)
        model = load_rank(args.config, par, rank, comm)
    else:
        model = load(args.config, progress=not args.no_progress, device=args.device)
    model.set_backend(args.backend)
    if rank != 0:  # the other ranks step in lock-step with rank 0 and print nothing
        for _ in open_stream(args.prompt, model, images=args.image, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                             stop_at_eos=not args.ignore_eos):
            pass
        return 0
    terminal = sys.stdout.isatty()
    start = time.perf_counter()
    stream = open_stream(args.prompt, model, images=args.image, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                         progress=not args.no_progress and not terminal,  # on a terminal the text is the progress
                         stop_at_eos=not args.ignore_eos)
    try:
        for piece in stream:
            sys.stdout.write(printable(piece) if terminal else piece)
            sys.stdout.flush()
    finally:
        print()
    elapsed = time.perf_counter() - start
    n = stream.num_generated
    print(f"[{args.config}] {n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tokens/s "
          f"(time includes the prefill of {len(model.tokenizer.encode(args.prompt))} prompt tokens)", file=sys.stderr)
    return 0


def printable(text: str) -> str:
    """Non-printable characters as Python escapes (BEL -> \\x07, CR -> \\r, U+200B -> \\u200b), newlines and
    tabs kept: an untrained model's control bytes must not ring the bell or overwrite the line."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def _params(args) -> int:
    counts = count_parameters(args.config)
    print(f"{args.config}: {counts['total']:,} parameters in total, {counts['active']:,} active per token "
          f"({human_count(counts['total'])} / {human_count(counts['active'])}; "
          f"{human_count(counts['active_with_embedding_and_vision'])} counting the input embedding and vision path)")
    if args.tp is not None or args.ep is not None:
        print(rank_table(args.config, args.tp or 1, args.ep or 1))
    return 0


def rank_table(config, tp: int, ep: int) -> str:
    """Each rank's resident bytes under tp x ep (ranks with equal figures on one line)."""
    rows = rank_bytes(config, tp, ep)
    gib = lambda n: f"{n / 2**30:,.2f} GiB"  # noqa: E731
    lines = [f"tp={tp}, ep={ep}: {len(rows)} ranks (weights in memory dtypes, routed experts in MXFP4)",
             f"{'ranks':>9} | {'weights':>12} | {'of which experts':>16} | {'KV per token':>12} | "
             f"{'KDA state per seq':>17} | {'FP8 workspace':>13}"]
    groups: dict[tuple, list[int]] = {}
    for r in rows:
        groups.setdefault(tuple(v for k, v in r.items() if k != "rank"), []).append(r["rank"])
    for (weights, experts, kv, state, ws), ranks in groups.items():
        label = f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
        lines.append(f"{label:>9} | {gib(weights):>12} | {gib(experts):>16} | {kv / 2**10:>9,.1f} KiB | "
                     f"{state / 2**20:>13,.1f} MiB | {gib(ws):>13}")
    total = sum(r["weights"] for r in rows)
    lines.append(f"all ranks together hold {gib(total)} of weights")
    return "\n".join(lines)


def human_count(n: int) -> str:
    """Three significant digits in the unit that fits: 2.78 T, 104 B, 31.2 M, 640 K, 12."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def _check(args) -> int:
    report = check_checkpoint(args.directory, args.config, progress=not args.no_progress)
    print(report)
    return 0 if report.ok else 1



def _train(args) -> int:
    given = {k: v for k, v in vars(args).items() if k in TRAIN_INT_OPTIONS + TRAIN_FLOAT_OPTIONS and v is not None}
    run = {"out_dir": args.out, "device": args.device, "progress": not args.no_progress}
    if args.resume:
        cfg = _resumed_config(args, given, run)
    else:
        model = "tiny" if args.config is None else args.config  # '' is refused by name, not read as tiny
        cfg = training_loop.TrainConfig.from_recipe(args.recipe, **given, model=model, **run)
    result = training_loop.train(cfg, resume=args.resume, overwrite=args.overwrite)
    state = "finished" if result["done"] else "stopped (resume with --resume)"
    print(f"{state} at step {result['step']}; checkpoint in {result['out_dir']}")
    if result["evals"]:
        print(format_metrics(result["evals"][-1]))
    return 0


def _resumed_config(args, given: dict, run: dict) -> "training_loop.TrainConfig":
    """The run's own TrainConfig; only leg options may be given again (any other is fixed at the start)."""
    saved = run_config(Path(args.out))
    fixed = sorted(k for k in given if k not in training_loop.LEG_FIELDS)
    if fixed or args.config is not None and args.config != saved["model"]:
        what = ", ".join("--" + k.replace("_", "-") for k in fixed) or f"--config {args.config}"
        raise ValueError(f"{what} cannot change when resuming: the run in {args.out} was started with "
                         f"{ {k: saved[k] for k in fixed} if fixed else 'config ' + repr(saved['model'])}; drop "
                         f"it, or start a new run with another --out")
    return training_loop.TrainConfig(**{**saved, **given, **run})


def _bench(args) -> int:
    """The report, then exit 1 naming the requests that did not reach their output length (if any)."""
    model = load(args.config, progress=False, device=args.device)
    result = bench.benchmark(model, args.num_requests, tuple(args.input_len), tuple(args.output_len), args.seed,
                             args.shared_prefix, args.images, not args.no_sequential,
                             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             enable_prefix_caching=not args.no_prefix_caching,
                             enable_chunked_prefill=not args.no_chunked_prefill,
                             compile_decode=args.compile_decode)
    print(bench.format_report(result))
    failed = bench.failure(result)
    if failed:
        print("FAILED: " + failed, file=sys.stderr)
    return 1 if failed else 0


def _doctor(args) -> int:
    if args.backend == "triton" and args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read once, when triton is first imported: set it first
    report = doctor(args.checkpoint, backend=args.backend, device=args.device)
    print(report.to_json() if args.json else report)
    return 0 if report.ok else 1


def _serve(args) -> int:
    """Serve until Ctrl-C or SIGTERM; one line says where, once listening."""
    model = load(args.checkpoint, progress=False, device=args.device).set_backend(args.backend)
    engine_kw = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    # vLLM's rule: the model is served under what the user passed, so a client can name it the same way
    name = args.checkpoint if args.served_model_name is None else args.served_model_name
    if model.device.type == "cuda":  # a silent minute on a fresh machine would look like a hang
        print("starting the engine: CUDA graphs are captured and the Triton kernels compiled (on a fresh machine "
              "a minute or two; ~/.triton/cache keeps them for the next start)", file=sys.stderr, flush=True)
    with start_server(model, args.host, args.port, name, **engine_kw) as server:
        print(f"serving {server.model_name} at {server.url}/v1 (also /health, /metrics; Ctrl-C stops)", flush=True)
        server.wait_for_stop()
    return 0


def _eval(args) -> int:
    model = load(args.checkpoint, progress=False, device=args.device)
    print(format_metrics(evaluate(model, seed=args.seed, n=args.n, context=args.context,
                                  num_distractors=args.distractors)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
