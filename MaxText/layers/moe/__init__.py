"""Mixture-of-Experts: one interface, implementations chosen by `moe_impl` alone.

    route(x_TD, gate_DE, cfg) -> Routing                      router.py, shared by every impl
    moe_ffn(x_TD, routing, ExpertWeights, cfg, rules) -> (y_TD, stats)   one function per impl

Shape legend, one letter per dimension in array names (x_TD is [tokens, embed]) across the package:

    T  tokens (B*L of the batch; a device's share inside shard_map)
    K  experts per token (top-k)          S  slots: a token's K copies, T*K, in token-major order
    E  experts (a device's local experts inside shard_map)
    D  model width (embed)                F  expert hidden width (mlp)
    N  peers on the `expert` mesh axis    P  expert-parallel ranks holding one buffer each (NCCL EP)
    R  rows of an expert buffer: the slots sorted by expert, or the rows received from the peers
    A  rows of a 128-row-aligned expert buffer (te_dropless: each expert's group padded to 128)
    B  rows of one block of the block-sparse grouped GEMM (gmm.py)
    G  groups (moe_impl=dense: one sequence each)  L  tokens of a group (the sequence length)
    C  slots per expert per group (dense's capacity)

Selection order: `experts_TK` is best first under router.route's top-k, and in increasing id under TE's
fused router; every consumer treats the K choices as a set (the combine weights travel with them).
"""
