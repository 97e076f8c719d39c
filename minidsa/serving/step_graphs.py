"""Prefill and mixed steps replayed from CUDA graphs, one per step shape (docs/design.md §16).

A packed step launches a few thousand kernels, and eagerly the host's cost of launching them, not the GPU's
work, sets the time of every step shorter than a few thousand tokens. The forward asks the host nothing
(every shape-dependent choice is made from the step's metadata before it starts; the one exception is
below), so a step laid out to a fixed ``StepShape`` (cache/step.py) can be captured once and replayed: each later step
of that shape copies its metadata and token ids into the graph's input tensors (one upload each) and
replays. Shapes are rounded up so that few cover a workload:

    decode rows      0 or a power of two (up to the largest decode graph)
    prefill rows     a power of two, at most max_num_seqs
    their length     16, 24, 32, 48, 64, 96, ... (a power of two or 1.5 times one)
    block table      a power of two of blocks, at most max_seq_len's
    kept KDA states  0 or a power of two (the prefix cache's checkpoints inside the step's pieces)
    prefill tokens   16, 24, 32, 48, ... as the lengths, at most the rows times their length

The projections and the MoE see the packed tokens (at most 1.5 times the step's), the attention-like ops the
rectangle of rows (the chunk form skips its padding by whole chunks, the indexer's kernel by key tiles). A
step whose rectangle would hold more than MAX_PADDING times its prefill tokens (pieces of very different
lengths) runs eagerly; so does one with media or a trace. A shape is captured at its ``capture_after``-th step
(one eager warm-up run, then the capture: about two forwards) and kept; past ``max_graphs`` the least recently
used is dropped. Before that its steps run shaped but uncaptured: the same layout, the same kernels and the
same sparse prefill form as the graph (no kernel here sums in an order that varies between runs), so a step's
numbers do not depend on whether its shape was captured yet, and a shape met once (the first step that admits
a whole batch of prompts, say) costs one forward instead of a capture's two. In a graph the sparse MLA prefill
runs the form its shapes choose (the union form for tables within top-k, else the absorbed form): the cost model's
choice waits for counts from the GPU, which a capture cannot hold (ops/mla/prefill_form.py); an uncaptured
shaped step chooses the same way (``sync_free``).

Graphs share one memory pool. A graph's outputs would pin their memory in it, so every graph instead writes
its logits and its new KDA states into buffers that all graphs share, and holds no output of its own; the
runner reads them right after the replay, before any other graph runs. ``eager=True`` captures nothing and
runs each shaped step as it is (the CPU tests check the padded layouts that way).
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict

import torch

from .. import ops
from ..cache import PagedKVCache, StepShape, prepare_step
from ..model.minidsa import MiniDSA
from ..ops.mla.prefill_form import sync_free

MAX_PADDING = 4.0  # a shape's prefill rectangle may hold this many times the step's prefill tokens (plus a row)


def _round_len(n: int) -> int:
    """The smallest of 16, 24, 32, 48, 64, 96, ... that is >= n."""
    size = 16
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def _pow2(n: int, cap: int) -> int:
    return min(1 << max(0, n - 1).bit_length(), cap)


def step_logits(model: MiniDSA, step, h: torch.Tensor, trace=None) -> torch.Tensor:
    """The decoder over a step's packed embeddings h [1, N, d] -> the logits of its sampled rows (device): what
    an eager packed step, a warm-up and a captured step all run."""
    if model._workspace is not None:
        model._workspace.routed[1].zero_()  # this forward's conversion count
    with ops.use_backend(model.backend):
        hidden = model.language_model.model(h, step, trace)
        return model.language_model.lm_head(hidden[0, step.logits_indices])


class StepGraphs:
    """Captured steps with prefill rows, one per shape; ``run`` lays a step out to its shape and replays it."""

    def __init__(self, model: MiniDSA, cache: PagedKVCache, max_num_seqs: int, max_graphs: int = 64,
                 eager: bool = False, pool=None, capture_after: int = 2) -> None:
        self.model, self.cache, self.eager = model, cache, eager
        self.max_num_seqs, self.max_graphs, self.capture_after = max_num_seqs, max_graphs, capture_after
        # Decode rows beside prefill rows: powers of two (a padding decode row costs one token), so that fewer
        # shapes cover the steps of a running batch whose size drifts by one or two.
        self.decode_buckets = [0] + sorted({min(1 << i, max_num_seqs) for i in range(max_num_seqs.bit_length() + 1)})
        self.max_blocks = -(-model.config.max_seq_len // cache.block_size)
        self.graphs: OrderedDict[StepShape, tuple] = OrderedDict()
        self.pool = pool
        self.shared: dict = {}  # (name, ...) -> the output buffers every graph writes
        self.replays = self.captures = 0  # graph replays (with ``eager``: shaped runs), captures
        self.uncaptured = 0  # shaped runs of shapes not yet captured
        self.last = None  # how the last ``run`` ran: "replay" or "shaped" (uncaptured, or ``eager``)
        self.capture_seconds = 0.0  # host time spent capturing (warm-up forwards, capture, instantiation)
        self.failed: dict[StepShape, str] = {}  # shapes whose capture failed -> why
        self.sightings: dict[StepShape, int] = {}  # steps of each shape not yet captured

    def shape_for(self, seq_ids: list[int], num_tokens: list[int], num_kept: int = 0) -> StepShape | None:
        """The shape a step of these pieces (keeping ``num_kept`` KDA states inside them) replays in, or None
        when it should run eagerly."""
        d = next((i for i, n in enumerate(num_tokens) if n > 1), len(num_tokens))
        lengths = num_tokens[d:]
        if not lengths or d > self.decode_buckets[-1]:
            return None
        bs = self.cache.block_size  # the tables once the step's tokens are reserved (a table may already hold more)
        width = max(max(len(self.cache.block_table(s)), -(-(self.cache.seq_len(s) + n) // bs))
                    for s, n in zip(seq_ids, num_tokens))
        pieces, piece_len = _pow2(len(lengths), self.max_num_seqs), _round_len(max(lengths))
        shape = StepShape(next(b for b in self.decode_buckets if b >= d), pieces, piece_len, _pow2(width, self.max_blocks),
                          1 << (num_kept - 1).bit_length() if num_kept else 0,
                          min(_round_len(sum(lengths)), pieces * piece_len))
        if pieces * piece_len > MAX_PADDING * sum(lengths) + piece_len:
            return None
        return shape

    def ready(self, shape: StepShape) -> bool:
        """Whether a step of ``shape`` runs shaped (``run``): captured now at the shape's ``capture_after``-th step,
        uncaptured before it. A capture that fails (an op that waits for the GPU, say) is reported once and its
        shape runs as a plain eager step from then on."""
        if shape in self.graphs or self.eager:
            return True
        if shape in self.failed:
            return False
        self.sightings[shape] = self.sightings.get(shape, 0) + 1
        if self.sightings[shape] < self.capture_after:
            return True  # one shaped forward now; a capture costs about two
        start = time.perf_counter()
        try:
            self._capture(shape)
        except Exception as e:  # noqa: BLE001 -- the step still runs, eagerly
            self.failed[shape] = f"{type(e).__name__}: {e}"
            warnings.warn(f"no CUDA graph for {shape}; such steps run eagerly ({self.failed[shape]})", stacklevel=2)
            return False
        finally:
            self.capture_seconds += time.perf_counter() - start
        return True

    def run(self, shape: StepShape, seq_ids: list[int], num_tokens: list[int], ids: list[int],
            sample: list[int], keep: list[tuple[int, int]] = ()) -> tuple[torch.Tensor, list]:
        """One step of pieces ``seq_ids``/``num_tokens`` (decode pieces first) whose tokens are ``ids`` (packed, in
        piece order) -> (the logits [len(sample), V] of the last token of each piece listed in ``sample``, the
        KDA states ``keep`` asks for: ``StepContext.kept``, valid until the next replay). ``shape``:
        ``shape_for``'s, ``ready``."""
        m = self.model
        if self.eager or shape not in self.graphs:
            step = prepare_step(self.cache, seq_ids, num_tokens, m.device, m.config.max_seq_len, sample, shape,
                                keep=keep)
            try:
                with torch.inference_mode(), sync_free():  # the graph's sparse prefill form
                    logits = self._forward(step, self._ids(step, ids).to(m.device))
            except BaseException:
                step.rollback()
                raise
            step.publish()
            self.last = "shaped"
            if self.eager:
                self.replays += 1
            else:
                self.uncaptured += 1
            return logits[step.sampled], step.kept
        self.last = "replay"
        self.graphs.move_to_end(shape)
        graph, template, static_ids, staged, kept, logits = self.graphs[shape]
        step = prepare_step(self.cache, seq_ids, num_tokens, m.device, m.config.max_seq_len, sample, shape,
                            into=template, keep=keep)
        try:
            static_ids.copy_(self._ids(step, ids), non_blocking=True)
            graph.replay()
        except BaseException:
            step.rollback()
            raise
        self.replays += 1
        step.staged = staged
        step.publish()
        return logits[step.sampled], kept

    @staticmethod
    def _ids(step, ids: list[int]) -> torch.Tensor:
        """The token ids laid out on the step's axis (0 on padding), host."""
        out, at = [0] * step.num_tokens, 0
        for i, n in enumerate(step.lengths):
            a, b = step.span(i)
            out[a:b] = ids[at: at + n]
            at += n
        return torch.tensor(out, dtype=torch.long)

    def _forward(self, step, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings -> decoder -> lm_head of every row's last token (what a graph captures)."""
        return step_logits(self.model, step, self.model.language_model.model.embed_tokens(ids).unsqueeze(0))

    def _buffer(self, key, like: torch.Tensor, rows: int) -> torch.Tensor:
        """The shared output buffer ``key`` with room for ``rows`` (the most any shape may have) or more. A buffer
        too small for ``like`` is replaced; the graphs captured with the old one keep it."""
        buf = self.shared.get(key)
        if buf is None or buf.shape[0] < like.shape[0]:
            buf = self.shared[key] = like.new_empty((max(rows, like.shape[0]), *like.shape[1:]))
        return buf[: like.shape[0]]

    def _capture(self, shape: StepShape) -> None:
        dev = self.model.device
        if len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        template = prepare_step(self.cache, [], [], dev, shape=shape)  # every row padding
        static_ids = torch.zeros(shape.num_tokens, dtype=torch.long, device=dev)
        most = self.decode_buckets[-1] + self.max_num_seqs

        def fwd():
            template.staged.clear()  # a warm-up's outputs: a capture that copied them would read freed memory
            template.kept.clear()
            out = self._forward(template, static_ids)
            logits = self._buffer("logits", out, most)
            logits.copy_(out)
            staged, kept = [], []
            for layer, name, slots, value, decode in template.staged:
                buf = self._buffer((layer, name, decode), value, most)
                buf.copy_(value)
                staged.append((layer, name, slots, buf, decode))
            for layer, name, value in template.kept:
                buf = self._buffer((layer, name, "kept"), value, value.shape[0])
                buf.copy_(value)
                kept.append((layer, name, buf))
            return logits, staged, kept

        with torch.inference_mode(), sync_free():  # the sparse prefill's form chosen without a host wait
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                fwd()  # warm-up: kernels compiled, workspaces and the shared buffers made (one run does it)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                logits, staged, kept = fwd()
        template.staged.clear()  # the graph's own outputs: not kept
        template.kept.clear()
        self.graphs[shape] = (graph, template, static_ids, staged, kept, logits)
        self.captures += 1
