"""A cached decode step never reads its tensors back on the host (docs/design.md §14), so on a GPU it
needs no synchronisation and can be captured in a CUDA graph. Checked here on the CPU by watching
every aten op of the step: no scalar read-back (.item(), int(t), bool(t)), no nonzero/unique, and no
boolean-mask indexing (which runs nonzero inside). Data checks that only run on CPU tensors are
switched off for the measurement: on a GPU they do not run at all."""

import pytest
import torch
from conftest import tiny_config, with_indexer
from torch.utils._python_dispatch import TorchDispatchMode

import minidsa
from minidsa.ops import _checks

READ_BACK = {"aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim",
             "aten::unique_consecutive", "aten::is_nonzero", "aten::equal", "aten::masked_select"}


class HostReads(TorchDispatchMode):
    """Collects the names of ops that would need the data on the host."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        bool_index = name in ("aten::index.Tensor", "aten::index", "aten::index_put", "aten::index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ())
        if name in READ_BACK or bool_index:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def decode_reads(model, batch=2):
    cache = model.new_cache()
    sids = [cache.add_sequence() for _ in range(batch)]
    with torch.inference_mode():
        for b, sid in enumerate(sids):  # prefill may read back what it needs
            model(torch.randint(0, 256, (1, 5 + 7 * b)), cache=cache, seq_ids=[sid])
        mode = HostReads()
        with mode:
            model(torch.randint(0, 256, (batch, 1)), cache=cache, seq_ids=sids)
    return mode.seen


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_step_reads_nothing_back(monkeypatch, fp8):
    monkeypatch.setattr(_checks, "CHECK_VALUES_ON_HOST", False)
    cfg = tiny_config()
    if fp8:
        cfg = with_indexer(cfg, fp8=True, hadamard=True)
    assert decode_reads(minidsa.MiniDSA(cfg)) == []


def test_the_watcher_sees_host_reads():
    """The same watch catches the value checks when they are on, and a boolean-mask gather."""
    assert "aten::is_nonzero" in decode_reads(minidsa.MiniDSA(tiny_config()))
    x = torch.arange(4.0)
    mode = HostReads()
    with mode:
        x[x > 1]
    assert mode.seen
