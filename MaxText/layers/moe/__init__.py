"""Mixture-of-Experts: route -> dispatch -> experts -> combine, the implementation chosen by `moe_impl` alone.

    block.py     MoeBlock: route, then MOE_FFNS[moe_impl](x_TD, routing, ExpertWeights, cfg, rules)
    router.py    route(x_TD, gate_DE, bias_E, cfg, topk) -> Routing, shared by every impl
    dropless.py  ragged and te_dropless: dispatcher.dispatch -> experts.expert_ffn -> dispatcher.combine, per
                 device in one shard_map (layout.py)
    dispatch.py  the dispatcher interface; LocalSort (ragged) and AlignedSort (TE's 128-row groups)
    ep.py        ExpertParallel: the exchange between devices on the `expert` axis, around a local dispatcher
    two_hop.py   TwoHop: the same across slices in two hops (ep_two_hop): a row per destination slice, then inside it
    nccl_ep.py   NcclEp: TE's NCCL EP dispatch and combine
    experts.py   the grouped expert FFN (SwiGLU) over a kernel set's grouped GEMM
    te_kernels.py  kernel sets: pure JAX (gmm.py: block-sparse on CPU, ragged_dot on GPU) or TE's
    te_runtime.py  TE availability, NCCL EP bootstrap, TE's mesh-axis names: once per run, at start-up
    dense.py     capacity-based dispatch with one-hot einsums (drops tokens), its own short path

Shape legend, one letter per dimension in array names (x_TD is [tokens, embed]) across the package:

    B  batch (sequences)                  L  tokens of a sequence (dense: of a group)
    T  tokens (B*L of the batch; a device's share inside shard_map)
    K  experts per token (top-k)          S  slots: a token's K copies, T*K, in token-major order
    E  experts (a device's local experts inside shard_map)
    D  model width (embed)                F  expert hidden width (mlp)
    R  rows of an expert buffer, the dispatcher's output: slots sorted by expert (LocalSort), the same in
       128-row-aligned groups (AlignedSort), or an NCCL EP rank's receive buffer
    N  devices on the `expert` mesh axis (EP peers; NCCL EP's ranks)
    Q  rows a token sends under EP (one per destination device)   J  slots a sent row carries
    U  rows a device sends, T*Q           X  rows a device receives from its peers, N x per-peer capacity
    W  width of the per-row payload sent beside x (2J: local expert ids and weights)
    I  blocks of the block-sparse grouped GEMM (gmm.py)           Z  rows of one such block
    G  groups (moe_impl=dense: one sequence each)                 C  slots per expert per group (capacity)

Selection order: `experts_TK` is best first under router.route's top-k, and in increasing id under TE's
fused router; every consumer treats the K choices as a set (the combine weights travel with them).
"""
