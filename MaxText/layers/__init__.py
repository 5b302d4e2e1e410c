"""Model layers (Flax NNX). Code here names logical axes only; sharding.py maps them onto the mesh.

Shape suffixes: B batch, L length, D embed, F mlp, H query heads, N kv heads, K head dim (in attention)
or top-k (in MoE), V vocab, E experts, T tokens (B*L).
"""
