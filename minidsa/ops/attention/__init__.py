"""Sparse attention on dense tensors: the contract every sparse attention path is tested against.

reference.py: attention over listed key positions (sparse_attention_ref), the masked-dense form it equals
(masked_dense_attention, indices_to_mask) and the gather and softmax helpers the MLA references share
(gather_rows, attend);
checks.py: its argument checks.
"""
