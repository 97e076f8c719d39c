"""Decode steps captured in CUDA graphs, one per batch-size bucket, and replayed (docs/design.md §14, §16).

A decode step of B sequences runs in the graph of the smallest bucket >= B; the rows past B are padding
that must read and write nothing:
    position -1      -> the indexer has no causal candidate, so every selected index is -1 and the
                        attention of the row is zero (the sparse ops' contract for an all -1 row);
    slot -1          -> store_kv skips the row, so no KV plane changes;
    block table -1, context length 0 (int32, never 0 - 1 read as an unsigned 4e9);
    state slot 0     -> read only: new KDA states are written back for the real rows alone.
Every buffer the graph reads is static: the step's values are copied into it before each replay. The
same padded context runs eagerly on any device (``padded_decode_context``), which is how the CPU tests
check that padding changes nothing.

A graph also records the address of every weight it reads, so a weight must not move after capture: the
model stacks its fused projections when its weights are placed (model/fused.py), and should a parameter
move anyway (``model.to``, a parameter given new storage), ``run`` notices it from ``fused.moves()`` and
captures again rather than replay reads of freed memory.

With ``compile=True`` each bucket's step is first ``torch.compile``d (fullgraph) and the compiled step is
what the graph captures: Inductor fuses the elementwise glue between the kernels, which are custom ops
(ops/_library.py) it calls as they are. The batch size is left to Dynamo's automatic dynamic shapes: the
largest bucket compiles for its size, the next one once more with the batch dimensions symbolic, and
every later bucket reuses that code, but for one row, which a size-1 dimension always specialises: three
compiles at engine start, whatever the number of buckets (a cold compile takes minutes). It pays where
launches dominate a step (small batches on a GPU); the logits are the eager step's to rounding.
"""

from __future__ import annotations

import torch

from .. import ops
from ..cache import CacheContext, PagedKVCache
from ..model import fused
from ..model.minidsa import MiniDSA


def buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (and it)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return sorted(set(sizes))


def padded_decode_context(cache: PagedKVCache, seq_ids: list[int], rows: int, max_blocks: int,
                          device, into: CacheContext | None = None) -> CacheContext:
    """A one-token context for ``seq_ids`` (their blocks reserved) padded to ``rows`` rows, written into the
    tensors of ``into`` when given (a graph's static context)."""
    B = len(seq_ids)
    starts = [cache.seq_len(s) for s in seq_ids]
    table = torch.full((rows, max_blocks), -1, dtype=torch.int32)
    if B:
        own = cache.block_table_tensor(seq_ids, device="cpu")
        table[:B, : own.shape[1]] = own
    positions = torch.full((rows, 1), -1, dtype=torch.long)
    positions[:B, 0] = torch.tensor(starts, dtype=torch.long)
    kv_slots = torch.full((rows,), -1, dtype=torch.long)
    kv_slots[:B] = ops.paged_kv_slots(table[:B], positions[:B], cache.block_size).reshape(-1)
    lens = torch.zeros(rows, dtype=torch.int32)
    lens[:B] = torch.tensor([s + 1 for s in starts], dtype=torch.int32)
    state = torch.zeros(rows, dtype=torch.long)
    state[:B] = cache.state_slots(seq_ids)
    if into is None:
        return CacheContext(cache, list(seq_ids), starts, positions.to(device), kv_slots.to(device), table.to(device),
                            lens.to(device), state.to(device))
    for static, value in ((into.positions, positions), (into.kv_slots, kv_slots), (into.block_table, table),
                          (into.context_lens, lens), (into.state_slots, state)):
        static.copy_(value, non_blocking=True)
    into.seq_ids, into.starts = list(seq_ids), starts
    return into


def run_padded(model: MiniDSA, ids: torch.Tensor, ctx: CacheContext) -> torch.Tensor:
    """The decode forward on a prepared context: embeddings -> decoder -> lm_head (what a graph captures)."""
    with ops.use_backend(model.backend):
        return decode_logits(model, ids, ctx)


def decode_logits(model: MiniDSA, ids: torch.Tensor, ctx: CacheContext) -> torch.Tensor:
    """``run_padded`` under the backend in force: what ``torch.compile`` traces (Dynamo cannot trace the
    ContextVar that ``use_backend`` sets, so the caller enters it)."""
    lm = model.language_model
    if model._workspace is not None:
        model._workspace.routed[1].zero_()
    return lm.lm_head(lm.model(lm.model.embed_tokens(ids), ctx, None))


def publish_rows(ctx: CacheContext, num_rows: int) -> None:
    """Write the staged KDA states of the first ``num_rows`` rows and commit their new lengths."""
    cache = ctx.cache
    state_slots = ctx.state_slots[:num_rows]
    for (layer, name), value in ctx.staged.items():
        cache.write_state(layer, name, state_slots, value[:num_rows])
    for sid, start in zip(ctx.seq_ids, ctx.starts):
        cache.commit(sid, start + 1)


class DecodeGraphs:
    """One captured decode step per bucket, sharing one memory pool; ``run`` replays the right one.

    ``eager=True`` captures nothing: ``run`` runs the padded step of the bucket as it is, so the steps a graph
    would replay can be checked where there is no GPU (the doctor's engine rung on the CPU)."""

    def __init__(self, model: MiniDSA, cache: PagedKVCache, max_num_seqs: int, compile: bool = False,
                 eager: bool = False) -> None:
        self.model, self.cache, self.compile, self.eager = model, cache, compile, eager
        self.max_blocks = -(-model.config.max_seq_len // cache.block_size)
        self.buckets = buckets(max_num_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, CacheContext, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0
        self._moves, self._stacks = -1, []  # fused.moves() and the stacks' addresses the graphs recorded

    def capture(self) -> None:
        """Capture every bucket, largest first (its memory is then reused by the smaller ones)."""
        self._weights_moved()
        if self.eager:
            return
        if self.compile:  # lazy state (the expert workspace, say) made outside the trace: Dynamo cannot make it
            with torch.inference_mode(), ops.use_backend(self.model.backend):
                decode_logits(self.model, *self._padding(max(self.buckets)))
        for rows in sorted(self.buckets, reverse=True):
            self._capture(rows)

    def _weights_moved(self) -> bool:
        """Whether the model's fused weights lie elsewhere than when the graphs were captured (one int compare
        per step while nothing moved anywhere in the process); stacks every group first."""
        if fused.moves() == self._moves:
            return False
        fused.fuse_all(self.model)
        stacks = [0 if t is None else t.data_ptr() for t in fused.stack_tensors(self.model)]
        moved = stacks != self._stacks
        self._moves, self._stacks = fused.moves(), stacks
        return moved

    def _capture(self, rows: int) -> None:
        dev = self.model.device
        ids, ctx = self._padding(rows)
        step = self.step(ids, ctx)
        with torch.inference_mode(), ops.use_backend(self.model.backend):
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: compilation, autotuning, workspace allocation, lazy inits
                    step()
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = step()
        self.graphs[rows] = (graph, ids, ctx, logits)

    def _padding(self, rows: int) -> tuple[torch.Tensor, CacheContext]:
        """Token ids [rows, 1] and a context whose every row is padding: what a graph is captured on."""
        dev = self.model.device
        return (torch.zeros(rows, 1, dtype=torch.long, device=dev),
                padded_decode_context(self.cache, [], rows, self.max_blocks, dev))

    def step(self, ids: torch.Tensor, ctx: CacheContext, backend="inductor"):
        """The decode step of ``ids`` [rows, 1] on ``ctx`` that a graph captures: ``torch.compile``d with
        ``compile=True`` (by ``backend``; the tests count Dynamo's graphs with a backend of their own)."""
        step = lambda: decode_logits(self.model, ids, ctx)
        if not self.compile:
            return step
        ops.register_custom_ops()
        # Automatic dynamic shapes turn the batch dimensions symbolic at the second bucket (module docstring); Dynamo
        # keys its cache by this lambda's code, shared by every bucket. The limit leaves room should a guard still
        # split some buckets.
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 2 * len(self.buckets))
        compiled = torch.compile(step, fullgraph=True, backend=backend)

        def fresh():  # Dynamo guards on the staged dict the trace fills: every call must find it empty, as the
            ctx.staged.clear()  # first did, or each warm-up and capture after it compiles again
            return compiled()
        return fresh

    def fits(self, batch: int) -> bool:
        return batch <= self.buckets[-1]

    def run(self, seq_ids: list[int], tokens: list[int]) -> torch.Tensor:
        """Replay the decode step of ``seq_ids`` (each fed its token; blocks reserved) -> logits [B, 1, V]."""
        rows = next(b for b in self.buckets if b >= len(seq_ids))
        padded = torch.zeros(rows, 1, dtype=torch.long)
        padded[: len(tokens), 0] = torch.tensor(tokens, dtype=torch.long)
        if self.eager:
            ctx = padded_decode_context(self.cache, seq_ids, rows, self.max_blocks, self.model.device)
            logits = run_padded(self.model, padded.to(self.model.device), ctx)
        else:
            if self._weights_moved():  # each graph recorded the old addresses: capture again, bucket by bucket,
                self.graphs.clear()  # into a new pool (the old one is released with its last graph)
                self.pool = None
            if rows not in self.graphs:
                self._capture(rows)
            graph, ids, ctx, logits = self.graphs[rows]
            ids.copy_(padded, non_blocking=True)
            padded_decode_context(self.cache, seq_ids, rows, self.max_blocks, ids.device, into=ctx)
            graph.replay()
        self.replays += 1
        publish_rows(ctx, len(seq_ids))
        return logits[: len(seq_ids)].float()
