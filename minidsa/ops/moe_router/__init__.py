"""The MoE router's choice: sigmoid affinities, the selection bias, top-k, renormalised weights.

reference.py: moe_route_ref (sort-based, ties to the lower expert id); route_triton.py: one program per
few tokens doing all of it in registers (a decode step's routing in one launch instead of several).
"""
