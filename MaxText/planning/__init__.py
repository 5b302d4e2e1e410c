"""Predicting, never training: parameter counts (params), FLOPs and MFU (flops), memory and the plan
(plan), step time (steptime), the layout search, the compiled step's collectives (lowering, collectives), the
preflight and the CPU stand-in for TE's compiled extension (te_trace).
"""
