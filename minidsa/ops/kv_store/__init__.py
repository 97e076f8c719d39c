"""The paged KV store: each new token's row into its slot of a cache plane (-1 = no write).

reference.py: store_kv_ref, with no host sync on a device; store_triton.py: the tiled Triton store (store_kv);
checks.py: the argument checks both share.
"""
