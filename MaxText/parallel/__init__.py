"""Parallelism: the device mesh from the ici_/dcn_ axes, the logical axis rules that place arrays on it
(sharding), and the processes of a multi-node job (distributed).
"""
