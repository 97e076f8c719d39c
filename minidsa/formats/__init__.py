"""Numbers and bytes: number formats and the checkpoint's on-disk layout. No nn.Modules here.

- ``fp8.py``: FP8 e4m3 with power-of-two scales and the Hadamard rotation (the indexer's numerics).
- ``mxfp4.py``: MXFP4 (E2M1 codes + E8M0 scales), its tables and its exact conversion to FP8.
- ``dtypes.py``: which dtype each named tensor has in memory and in the checkpoint.
- ``shards.py``: safetensors shards with an index JSON, written atomically and read back verified.
"""
