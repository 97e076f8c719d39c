"""The projections of a decode step: ``linear(x, weight)``.

reference.py: linear_ref (``F.linear``); gemv_triton.py: a matrix-vector kernel for one row of x, which
the cuBLAS kernels picked for a [1, K] input run with too few thread blocks at this model's widths.
"""
