"""The MoE router's choice: sigmoid affinities, the selection bias, top-k, renormalised weights; and the
plan that turns the choice into the slots of one expert batch with their routing weights.

reference.py: moe_route_ref (sort-based, ties to the lower expert id) and moe_plan_ref; route_triton.py:
one program per few tokens doing all of the routing in registers (a decode step's routing in one launch
instead of several); plan_triton.py: the plan of a decode-sized call in one launch instead of nine.
"""
