"""Mixture-of-Experts: one interface, implementations chosen by `moe_impl` alone.

    route(x_TD, gate_DE, cfg) -> Routing                      router.py, shared by every impl
    moe_ffn(x_TD, routing, ExpertWeights, cfg, rules) -> (y_TD, stats)   one function per impl

Shape legend: T tokens (B*L), D embed, F expert mlp, E experts, K experts per token (top-k),
G groups (sequences) of S tokens, C expert capacity per group.
"""
