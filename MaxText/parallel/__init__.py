"""Parallelism: the device mesh from the ici_/dcn_ axes, the logical axis rules that place arrays on it
(sharding), every check of a config against its mesh's shape (checks), and the processes of a multi-node job
(distributed).
"""
