"""The experts backends' own Triton kernels, each file its torch spec beside its kernels.

``expert_gemm.py`` and ``expert_gemm_fp8.py``: the ``triton`` backend's grouped GEMMs (bf16/fp32
and fp8 block scales), sharing the Triton building blocks of ``expert_tile_parts.py``;
``expert_tiles.py``: their tile configs (the tuned table ``expert_tiles.json`` and a heuristic);
``expert_rows.py``: STANDARD's pairs sorted by expert and each row's slots summed;
``block_rows.py``: the rows in one padded block per expert, for the block-scaled fp8 GEMMs of
``scaled_mm`` and ``deepgemm``. The data path's ops (``KernelOps``) are ``ep_runtime/kernels/``.
"""
