"""Sparse MLA over the paged latent cache: decode and prefill attention at the indexer's positions (docs/design.md §4).

reference.py: the decode and prefill references and their checks (sparse_mla_decode_ref, sparse_mla_prefill_ref, decompress_kv);
latent_triton.py: the absorbed (MQA) attention kernel over the selected latent rows (sparse_mla_decode, the absorbed prefill);
latent_rows_triton.py: the pass that turns selected positions into plane row numbers before the attention kernel;
latent_gluon.py: the same latent attention on Hopper (sm_90) in Gluon, warp groups with explicit roles;
prefill_triton.py: the prefill op (sparse_mla_prefill), running the union form or the absorbed one;
prefill_form.py: which form a prefill call runs (union or absorbed), from their costs;
prefill_union_triton.py: per query tile, the sorted union of selected positions and each query's bits over it;
prefill_attn_triton.py: FlashAttention in decompressed (MHA) form over each tile's union, masked per query;
prefill_gluon.py: that union attention on Hopper (sm_90) in Gluon;
sm90_gluon.py: both ops' sm_90 forms (the backend "gluon"): the Gluon kernels where they fit, else the Triton ones.
"""
