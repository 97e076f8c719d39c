"""Several projections of one input as one matrix product (docs/design.md §17).

A decode step is a few hundred small matrix products, most of them reading the same activations:
an MLA layer's input feeds q_a, kv_a, the indexer key, the indexer weights and the output gate; a KDA
layer's feeds q, k, v, the decay, beta and the output gate; an MoE layer's feeds the router, the latent
down projection and the shared expert. ``FusedLinears`` computes such a group as one product over the
rows of all its weights stacked, and splits the result.

The checkpoint does not change: each ``nn.Linear`` keeps its parameter and its name, and fusing only
moves the parameter's data into a row slice of the stacked matrix (``param.data = stacked[a:b]``), so
loading, saving, ``state_dict`` and optimisers see the same tensors as before and a copy into a
parameter writes the stacked matrix. Anything that gives a parameter new storage (``model.to``, a new
``nn.Parameter``, ``copy.deepcopy``) is noticed on the next call, which stacks the rows again.

Moving a parameter frees its old storage, and a captured CUDA graph keeps reading the address it
recorded: a stack built in a forward after the decode graphs were captured would leave every replay
reading freed memory. So the model stacks every group when its
weights are placed (``fuse_all``, from ``MiniDSA``'s constructor and ``_apply``), no forward moves a
parameter, and ``moves()`` counts the moves that do happen so that a graph can notice them.

Weights of different dtypes (a bf16 model keeps its router and the indexer weights in fp32) form one
product per dtype, each reading the input cast to that dtype, which is what the separate layers do.
Under autograd (a weight needs a gradient and grad mode is on) the stack is ``torch.cat`` of the live
parameters instead, so gradients reach each one; the product is the same, so a forward gives the same
bits with and without grad mode (which is per thread: a thread without ``no_grad`` must agree too).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..ops import cast

_MOVES = [0]  # parameter moves by any RowStack of the process (one int: a graph replay reads it per step)
K_MAJOR_ON_CPU = True  # the CPU's wide stacks are K-major copies; off, the CPU stacks as a GPU does (tests)


def moves() -> int:
    """How many times a stack has moved parameters into new storage in this process (any model)."""
    return _MOVES[0]


def _groups_of(module: nn.Module) -> list:
    """Every FusedLinears and RowStack held by ``module`` or its submodules (plain attributes, not submodules)."""
    return [v for m in module.modules() for v in vars(m).values() if isinstance(v, (FusedLinears, RowStack))]


def _weights(group) -> list[nn.Parameter]:
    return [l.weight for l in group.linears] if isinstance(group, FusedLinears) else [m.weight for m in group.modules]


def fuse_all(module: nn.Module) -> None:
    """Stack every group of ``module`` now, so that no later forward moves a parameter (module docstring).

    A parameter can be in two groups: an MoE layer's input product holds its shared expert's gate and up
    projections, whose own ``SituGluMLP.input_proj`` the layer never calls. The outer group, met first in
    the walk, keeps them; the inner one is left unbuilt, since building both would move the rows back and
    forth on every call (and each move would send captured CUDA graphs to capture again)."""
    owned: set[int] = set()
    for group in _groups_of(module):
        ids = {id(w) for w in _weights(group)}
        if ids & owned:
            continue
        owned |= ids
        group.fuse() if isinstance(group, FusedLinears) else group.stacked()


def stack_tensors(module: nn.Module) -> list[torch.Tensor | None]:
    """The stacks ``module``'s groups hold now (None: not built); identity changes when parameters moved."""
    out: list[torch.Tensor | None] = []
    for group in _groups_of(module):
        out += group.stacks() if isinstance(group, FusedLinears) else [group._stack]
    return out


class RowStack:
    """The ``weight`` parameters of ``modules`` (one dtype and device, same trailing shape) stacked along
    dim 0 into one tensor, each parameter's data moved into its row slice. ``tensor()`` returns the stack;
    under autograd ``torch.cat`` of the parameters instead (the same values, the same layout), so gradients
    reach them. ``k_major`` (2-d weights): the stack [sum(out), in] is a copy stored transposed, [in, sum(out)]
    contiguous, the layout a CPU matrix-vector product streams twice as fast (docs/design.md §17). The
    parameters then keep their own storage (a non-contiguous parameter would make an optimiser's CPU
    update take another loop, with other rounding), and the copy is rebuilt whenever one of them has
    changed (its version counter moves on every in-place write)."""

    def __init__(self, *modules: nn.Module, k_major: bool = False) -> None:
        self.modules, self.k_major = modules, k_major
        self._stack: torch.Tensor | None = None
        self._seen: list = []  # _key of the parameters when the stack was built

    def _cat(self, weights: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([w.t() for w in weights], dim=1).t() if self.k_major else torch.cat(weights)

    def tensor(self) -> torch.Tensor:
        weights = [m.weight for m in self.modules]
        if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
            return self._cat(weights)
        return self.stacked()

    def stacked(self) -> torch.Tensor:
        """The stack, built now if missing or stale, whatever the grad mode (``fuse_all`` calls it)."""
        weights = [m.weight for m in self.modules]
        if self._stack is not None and (torch.compiler.is_compiling() or self._key(weights) == self._seen):
            return self._stack
        return self._restack(weights)

    def _restack(self, weights: list[torch.Tensor]) -> torch.Tensor:
        if weights[0].device.type == "meta":  # nothing to move yet: to_empty gives the real storage later
            return self._cat(weights)
        with torch.no_grad(), torch.inference_mode(False):  # a normal tensor, kept across forwards
            stack = self._cat([w.detach() for w in weights])
            start = 0
            for w in weights if not self.k_major else ():
                w.data = stack[start: start + w.shape[0]]
                start += w.shape[0]
        if not self.k_major:
            _MOVES[0] += 1
        self._stack, self._seen = stack, self._key(weights)
        return stack

    def _key(self, weights: list[torch.Tensor]) -> list:
        """What must not change for the stack to stand: where each parameter lies, and for a copy, its values."""
        return [(w.data_ptr(), w._version if self.k_major else 0) for w in weights]


class FusedLinears:
    """``FusedLinears(a, b, (c, d))(x) -> [a(x), b(x), cat(c(x), d(x))]`` for bias-free ``nn.Linear`` layers
    of one input width, computed as one product per weight dtype (a tuple: layers of one dtype whose
    outputs are wanted side by side). x [..., d] -> outputs [..., out_i] (views of the product). Not an
    ``nn.Module``: it owns no parameters, it only arranges the layers' own."""

    def __init__(self, *parts: nn.Linear | tuple[nn.Linear, ...]) -> None:
        self.parts = [p if isinstance(p, tuple) else (p,) for p in parts]
        self.linears = [l for p in self.parts for l in p]
        widths = {l.in_features for l in self.linears}
        if len(widths) != 1 or any(l.bias is not None for l in self.linears):
            raise ValueError(f"FusedLinears needs bias-free layers of one input width, got widths {sorted(widths)}")
        self._groups: list[tuple[RowStack, list[int], list[int]]] | None = None  # (stack, part ids, widths)
        self._dtypes: list = []

    def _stacks(self) -> list[tuple[RowStack, list[int], list[int]]]:
        """One RowStack per weight dtype and device, regrouped when the layers' dtypes change."""
        dtypes = [(p[0].weight.dtype, p[0].weight.device) for p in self.parts]
        if self._groups is None or not (torch.compiler.is_compiling() or dtypes == self._dtypes):
            self._regroup(dtypes)
        return self._groups

    def _regroup(self, dtypes: list) -> None:
        if any(len({(l.weight.dtype, l.weight.device) for l in p}) > 1 for p in self.parts):
            raise ValueError("the layers of a tuple part must share one dtype and device (their outputs are one slice)")
        by_dtype: dict[tuple, list[int]] = {}
        for i, key in enumerate(dtypes):
            by_dtype.setdefault(key, []).append(i)
        groups = []
        for (_, device), ids in by_dtype.items():
            widths = [sum(l.out_features for l in self.parts[i]) for i in ids]
            # a CPU matrix-vector product streams a wide stack faster K-major and a narrowing one (a down
            # projection) slower (docs/benchmarks.md, CPU figures), so only the wide stacks take it
            k_major = K_MAJOR_ON_CPU and device.type == "cpu" and sum(widths) > self.linears[0].in_features
            groups.append((RowStack(*[l for i in ids for l in self.parts[i]], k_major=k_major), ids, widths))
        self._groups = groups
        self._dtypes = dtypes

    def fuse(self) -> None:
        """Stack the rows now, in any grad mode (``fuse_all``); calls do it when needed."""
        for stack, _, _ in self._stacks():
            stack.stacked()

    def stacks(self) -> list[torch.Tensor | None]:
        """The current stacks (None where not built), without building any: what ``moves`` watchers compare."""
        return [stack._stack for stack, _, _ in self._groups or ()]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(self.parts)
        for stack, ids, widths in self._stacks():
            weight = stack.tensor()
            for i, y in zip(ids, ops.linear(cast(x, weight.dtype), weight).split(widths, dim=-1)):
                out[i] = y
        return out
