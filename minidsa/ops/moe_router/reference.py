"""Reference router choice (docs/design.md §6): DeepSeek-V3's aux-loss-free selection.

    s = sigmoid(logits)                            fp32 affinities [N, E]
    ids = top_k(s + bias)                          the bias only selects (ties -> lower expert id) ...
    w = s[ids] / (sum s[ids] + 1e-20) * scaling    ... the weights use s alone; a single expert keeps s
"""

from __future__ import annotations

import torch

from .._checks import acc_dtype, cast, check_tensor
from .._dispatch import op
from .._library import result_like

ROUTER_EPS = 1e-20  # guards the renormalisation when every chosen score underflows to 0


def check_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[int, int]:
    """(N, E) after checking logits [N, E] and bias [E] against top_k."""
    N, E = check_tensor("logits", logits, ndim=2, floating=True)
    check_tensor("bias", bias, shape=(E,), floating=True)
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be in 1..{E} (the number of experts)")
    return N, E


def route_weights(s: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor:
    """Affinities s [N, E] of the chosen experts ids [N, top_k], renormalised (only when top_k > 1, as
    released: a single expert keeps its sigmoid affinity, not a weight of 1) and scaled -> [N, top_k]."""
    chosen = s.gather(1, ids)
    if ids.shape[1] > 1:
        chosen = chosen / (chosen.sum(-1, keepdim=True) + ROUTER_EPS)
    return chosen * scaling


@op(kernel="route_triton", fake=lambda logits, bias, top_k, scaling: (
    result_like(logits, (logits.shape[0], top_k), torch.int64), result_like(logits, (logits.shape[0], top_k))))
def moe_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int,
                  scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] and the selection bias [E] -> (expert ids int64 [N, top_k] in descending order
    of s + bias, weights [N, top_k] fp32; fp64 for fp64 logits)."""
    check_route(logits, bias, top_k)
    s = torch.sigmoid(cast(logits, acc_dtype(logits)))
    biased = s + cast(bias, s.dtype)
    ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]
    return ids, route_weights(s, ids, scaling)


def check_plan(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> tuple[int, int]:
    """(N, top_k) after checking ``moe_plan``'s arguments."""
    N, K = check_tensor("ids", ids, ndim=2, integer=True)
    check_tensor("weights", weights, shape=(N, K), floating=True)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts = {num_experts!r} must be a positive int")
    return N, K


@op(kernel="plan_triton", fake=lambda ids, weights, num_experts: (
    result_like(ids, (min(ids.numel(), num_experts),), torch.int64),
    result_like(weights, (min(ids.numel(), num_experts), ids.shape[0])), result_like(ids, (), torch.int64)))
def moe_plan(ids: torch.Tensor, weights: torch.Tensor,
                 num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts a layer's tokens were routed to, as the slots of one expert batch, and their routing weights.

    Args:
        ids: integer [N, top_k] chosen experts, in [0, num_experts). A row repeats an id only with weight 0
            (under expert parallelism the other ranks' experts come as expert 0 with weight 0).
        weights: [N, top_k] their routing weights (``moe_route``'s).
        num_experts: E.
    Returns:
        experts: int64 [m], m = min(N * top_k, E), known from the shapes alone (no host sync): every routed
            expert in ascending id order, then unrouted ones in ascending order as placeholders;
        routing: [m, N] fp32 (fp64 for fp64 weights): the weight token n gives experts[j], 0 where none;
        num_routed: int64 [], how many of the m slots hold routed experts.
    """
    check_plan(ids, weights, num_experts)
    routed = torch.zeros(num_experts, dtype=torch.bool, device=ids.device).index_fill_(0, ids.reshape(-1), True)
    order = torch.sort((~routed).to(torch.int8), stable=True).indices
    experts = order[: min(ids.numel(), num_experts)]
    routing = ((ids.unsqueeze(0) == experts.view(-1, 1, 1)) * weights).sum(-1)  # one nonzero term at most
    return experts, cast(routing, acc_dtype(weights)), routed.sum()


# The plain references by the names the kernels' fallbacks and the tests call them.
moe_route_ref = moe_route.reference
moe_plan_ref = moe_plan.reference
