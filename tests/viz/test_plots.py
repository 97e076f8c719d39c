"""The data behind the plots: what ``minidsa.viz`` draws is what the trace recorded."""

import pytest

import minidsa
from minidsa.viz.plots import selection_matrix


def test_selection_matrix_marks_exactly_the_selected_keys():
    _, trace = minidsa.generate("abcdefghijklmnop", max_new_tokens=3, temperature=0, return_trace=True,
                                stop_at_eos=False)
    layer = min(trace.selected)
    m = selection_matrix(trace, layer)
    sel = trace.selected[layer]
    assert m.shape == (len(trace.token_ids), len(trace.token_ids))
    for t in range(m.shape[0]):
        assert set(m[t].nonzero()[0].tolist()) == {int(s) for s in sel[t] if s >= 0}
    with pytest.raises(ValueError, match="not an MLA layer"):
        selection_matrix(trace, 0)
