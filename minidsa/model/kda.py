"""The Kimi Delta Attention layer of K3 (docs/design.md §5).

    q, k, v = SiLU(causal depthwise conv4(W_{q,k,v} x))   q, k L2-normalised per head
    g       = lb * sigmoid(exp(A_log[h]) * (W_fb W_fa x + dt_bias))   log-decay in (lb, 0), lb = -5, h < H
    beta    = sigmoid(W_b x)                                           one per head
    o       = KDA(q, k, v, g, beta)    recurrent state [H, K, V] in fp32, no KV cache
    y       = W_o [ RMSNorm_per_head(o) * sigmoid(W_g x) ]

KDA carries position information for the whole model (the MLA layers use no rotary embedding).
Its per-sequence state is the recurrent state plus the last conv_size-1 projected inputs of each
short conv; prefill (chunked form) hands both to decode (recurrent form). The new state is staged
in the cache context and written only when the whole forward succeeds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..cache import CacheContext, StepContext
from ..config import ModelConfig
from ..ops import acc_dtype, cast, causal_conv
from .fused import FusedLinears, RowStack
from .norm import RMSNorm


class KimiDeltaAttention(nn.Module):
    STATE_NAMES = ("recurrent", "conv")
    parallel = None  # a distributed Comm when the heads are split over ranks (minidsa/distributed)

    def __init__(self, cfg: ModelConfig, layer_idx: int, cache_layer: int) -> None:
        super().__init__()
        kc = cfg.kda
        self.layer_idx = layer_idx  # position in the decoder
        self.cache_layer = cache_layer  # index among KDA layers: which state tensors of the cache are this layer's
        self.num_heads, self.head_dim, self.conv_size = kc.num_heads, kc.head_dim, kc.conv_size
        self.lower_bound, self.chunk_size = kc.decay_lower_bound, kc.chunk_size
        d, HK = cfg.hidden_size, kc.num_heads * kc.head_dim
        self.q_proj = nn.Linear(d, HK, bias=False)
        self.k_proj = nn.Linear(d, HK, bias=False)
        self.v_proj = nn.Linear(d, HK, bias=False)
        self.q_conv1d = nn.Conv1d(HK, HK, kc.conv_size, groups=HK, bias=False)  # weight [HK, 1, W]
        self.k_conv1d = nn.Conv1d(HK, HK, kc.conv_size, groups=HK, bias=False)
        self.v_conv1d = nn.Conv1d(HK, HK, kc.conv_size, groups=HK, bias=False)
        self.f_a_proj = nn.Linear(d, kc.decay_rank, bias=False)
        self.f_b_proj = nn.Linear(kc.decay_rank, HK, bias=False)
        # Stored as the release stores it, [a_log_size] with zeros after the first num_heads entries;
        # only those first entries are read (docs/design.md §9).
        self.A_log = nn.Parameter(torch.zeros(kc.a_log_size))
        self.dt_bias = nn.Parameter(torch.zeros(HK))
        self.b_proj = nn.Linear(d, kc.num_heads, bias=False)
        self.g_proj = nn.Linear(d, HK, bias=False)
        self.o_norm = RMSNorm(kc.head_dim, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(HK, d, bias=False)
        # every projection of the layer input as one product: q, k, v side by side feed the one conv call
        self.input_proj = FusedLinears((self.q_proj, self.k_proj, self.v_proj), self.f_a_proj, self.b_proj,
                                       self.g_proj)
        self.decay_up = FusedLinears(self.f_b_proj)  # a single layer too: the CPU layout (model/fused.py)
        self.conv_weight = RowStack(self.q_conv1d, self.k_conv1d, self.v_conv1d)  # [3HK, 1, W], one conv call

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-sequence state tensors (all fp32) for the cache's state slots: the recurrent state and the last
        W-1 projected inputs of the three short convs, q, k and v channels side by side (one tensor, one
        conv call: the three convs are depthwise, so concatenating their channels changes nothing)."""
        H, K, W = self.num_heads, self.head_dim, self.conv_size
        return {"recurrent": (H, K, K), "conv": (W - 1, 3 * H * K)}

    def forward(self, x: torch.Tensor, ctx: CacheContext | None = None, trace=None) -> torch.Tensor:
        """x [B, T, d] (already normalised) -> [B, T, d]. ``ctx`` (a CacheContext) supplies and
        receives the per-sequence state; without it the sequence starts from a zero state."""
        B, T, _ = x.shape
        acc = acc_dtype(x)
        if isinstance(ctx, StepContext):
            return self._forward_step(x, ctx)
        if ctx is not None and T == 1:  # decode: one fused step reading the states from their cache slots
            return self._decode(x, ctx)
        if ctx is None:
            state = {n: torch.zeros((B,) + s, dtype=acc, device=x.device) for n, s in self.state_shapes().items()}
        else:
            state = {n: ctx.cache.read_state(self.cache_layer, n, ctx.state_slots) for n in self.STATE_NAMES}
        (q, k, v, g, beta), new_state, gate = self.inputs_and_gate(x, state)
        if T == 1:  # one step without a cache: the recurrence (chosen at run time from the query count)
            o, new_state["recurrent"] = ops.kda_recurrent(q, k, v, g, beta, None, state["recurrent"])
        else:
            o, new_state["recurrent"] = ops.kda_chunk(q, k, v, g, beta, None, state["recurrent"], self.chunk_size)
        if ctx is not None:
            for n, value in new_state.items():
                ctx.stage_state(self.cache_layer, n, value)
        return self.output(o, x, gate)

    def _decode(self, x: torch.Tensor, ctx: CacheContext) -> torch.Tensor:
        """One token per sequence: the input products, then ``ops.kda_decode`` (short convs, decay projection,
        norms, gates and the recurrent step; one kernel on a GPU), which reads both states from the cache's
        pools at the sequences' slots."""
        B = x.shape[0]
        projected, f_a, b, gate = self.input_proj(x.reshape(B, -1))
        o = self._decode_rows(ctx, projected, f_a, b)
        return self.output(o.view(B, 1, self.num_heads, self.head_dim), x, gate.unsqueeze(1))

    def _decode_rows(self, ctx: CacheContext, projected, f_a, b) -> torch.Tensor:
        """The fused decode step of B rows from their input products ([B, ...]) -> o [B, H*K]; stages both states."""
        pools = ctx.cache.state[self.cache_layer]
        o, recurrent, conv = ops.kda_decode(projected, f_a, b, self.conv_weight.tensor(), self.f_b_proj.weight,
                                            self.A_log, self.dt_bias, self.lower_bound, pools["conv"],
                                            pools["recurrent"], ctx.state_slots)
        ctx.stage_state(self.cache_layer, "recurrent", recurrent)
        ctx.stage_state(self.cache_layer, "conv", conv)
        return o

    def _forward_step(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        """One packed engine step (x [1, N, d]): the input products once over all N tokens, the decode rows
        through the fused step together, then every prefill piece at once through the chunk form, as one
        [P', T_max] rectangle from the pieces' own states (zero where a piece starts its sequence: a new
        sequence's slot is zeroed). -> [1, N, d]."""
        n = step.num_decode
        projected, f_a, b, gate = self.input_proj(x)
        parts = [self._decode_rows(step.decode_part(), projected[0, :n], f_a[0, :n], b[0, :n]).view(
            1, n, self.num_heads, self.head_dim)] if n else []
        if step.prefill_rows:
            parts.append(step.unpad(self._prefill_rect(step, projected, f_a, b)))
        return self.output(torch.cat(parts, 1), x, gate)

    def _prefill_rect(self, step: StepContext, projected, f_a, b) -> torch.Tensor:
        """The prefill pieces of a step as one [P', T_max] chunk-form call -> o [P', T_max, H, K]; stages both
        states. Padding past a piece's end must leave its states as the piece left them: the chunk form is
        given each row's length (it ignores the rest and skips its whole chunks), and the conv state is read
        at each piece's own end."""
        acc, ctx = acc_dtype(projected), step.prefill_part()
        state = {name: ctx.cache.read_state(self.cache_layer, name, ctx.state_slots) for name in self.STATE_NAMES}
        first = step.query_start[step.num_decode]  # the first prefill token
        inputs = step.pad(projected[:, first:])  # [P', T_max, 3HK]
        # ragged rows: the chunk form skips the padding (whole chunks of it), the conv state is read at each
        # row's own end
        lengths = step.prefill_lengths if step.ragged else None
        qkv, conv = ops.short_conv(inputs, self.conv_weight.tensor(), state["conv"], lengths)
        P, T = qkv.shape[:2]
        qkv = qkv.view(P, T, 3, self.num_heads, self.head_dim)
        z = self.decay_up(f_a[:, first:])[0]  # the decay's up-projection over the prefill tokens only
        # z and b padded in the model's dtype: the op upcasts them as it reads
        q, k, v, g, beta = ops.kda_step_inputs(qkv, step.pad(z), step.pad(b[:, first:]), self.A_log, self.dt_bias,
                                               self.lower_bound)
        o, recurrent, *kept = ops.kda_chunk(q, k, v, g, beta, None, state["recurrent"], self.chunk_size, step.keep,
                                            lengths)
        ctx.stage_state(self.cache_layer, "recurrent", recurrent)
        ctx.stage_state(self.cache_layer, "conv", conv)
        if kept:  # states inside the pieces that the prefix cache keeps: the step stays one forward
            step.kept.append((self.cache_layer, "recurrent", kept[0]))
            full = torch.cat([cast(state["conv"], acc), cast(inputs, acc)], 1)  # each row's state, then its inputs
            kept_conv = ops.conv_states_at(full, state["conv"].shape[1], *step.keep.unbind(1))
            step.kept.append((self.cache_layer, "conv", kept_conv))
        return o

    def recurrence_inputs(self, x: torch.Tensor, state: dict[str, torch.Tensor]):
        """x [B, T, d] and the conv state -> ((q, k [B, T, H, K], v [B, T, H, K], g [B, T, H, K], beta [B, T, H]),
        {"conv": the new conv state}). The training path reuses it (training/forward.py)."""
        return self.inputs_and_gate(x, state)[:2]

    def projections(self, x: torch.Tensor, conv_state: torch.Tensor):
        """x [B, T, d], the conv state -> (qkv [B, T, 3, H, K] = SiLU of the short convs, z [B, T, H*K] the decay's
        pre-activation W_fb W_fa x, b [B, T, H] beta's logits, the output gate's W_g x [B, T, H*K], the new conv
        state), all but the gate in the accumulation dtype."""
        B, T, _ = x.shape
        acc = acc_dtype(x)
        projected, f_a, b, gate = self.input_proj(x)
        y, conv_state = causal_conv(cast(projected, acc), self.conv_weight.tensor(), conv_state)
        qkv = F.silu(y).view(B, T, 3, self.num_heads, self.head_dim)
        return qkv, cast(self.decay_up(f_a)[0], acc), cast(b, acc), gate, conv_state

    def inputs_and_gate(self, x: torch.Tensor, state: dict[str, torch.Tensor]):
        """``recurrence_inputs`` plus the output gate's pre-activation W_g x [B, T, H*K] (same product)."""
        qkv, z, b, gate, conv_state = self.projections(x, state["conv"])
        inputs = ops.kda_step_inputs(qkv, z, b, self.A_log, self.dt_bias, self.lower_bound)
        return inputs, {"conv": conv_state}, gate

    def output(self, o: torch.Tensor, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """o [B, T, H, K] from the recurrence, x [B, T, d] the layer input -> W_o[RMSNorm_head(o) * sigmoid(W_g x)]
        (``gate``: W_g x when already computed)."""
        gate = self.g_proj(x) if gate is None else gate
        o = ops.output_gate(o, gate, self.o_norm.weight, self.o_norm.eps, self.o_proj.weight.dtype)
        out = ops.linear(o, self.o_proj.weight)
        return out if self.parallel is None else self.parallel.tp_all_reduce(out)  # this rank's heads: partial
