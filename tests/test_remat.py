"""Remat policies proven by what they save: the residuals JAX keeps for the backward of the real model's loss
(jax.ad_checkpoint's saved_residuals), per policy and per tensor name, with their memory space, on an
fsdp 4 x expert 2 mesh so that the MoE names inside shard_map (and the EP dispatch's) are covered. Values
never show a remat policy at work; an ignored `offload` or a name lost inside shard_map shows here."""

import collections

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from MaxText.parallel import sharding
from MaxText.config.schema import REMAT_TENSOR_NAMES
from MaxText.layers.models import Transformer
from tests.tiny import tiny_config

B, L, D, H, KV, HEAD, MLP, MOE_F = 8, 16, 32, 4, 2, 8, 64, 48
# The tiny decoder: 1 dense layer, then a scanned stack of 2 MoE layers.
STACKS = {"dense": 1, "moe": 2}
ALL_REMAT = [f"{name}=remat" for name in REMAT_TENSOR_NAMES]


def residuals(*overrides) -> collections.Counter:
    """The saved residuals of the model's loss as a multiset of 'dtype<space>[shape]' strings."""
    cfg = tiny_config("remat_policy=custom", *ALL_REMAT, "scan_layers=true", "moe_impl=ragged",
                      f"base_moe_mlp_dim={MOE_F}", "ici_fsdp_parallelism=4", "ici_expert_parallelism=2", *overrides)
    mesh, rules = sharding.create_mesh(cfg), sharding.axis_rules(cfg)
    with jax.set_mesh(mesh):
        graphdef, params = nnx.split(Transformer(cfg, rules=rules, rngs=nnx.Rngs(0)))
        tokens = jnp.zeros((B, cfg.max_target_length), jnp.int32)

        def loss(params):
            logits, _ = nnx.merge(graphdef, params)(tokens)
            return jnp.sum(logits)

        return collections.Counter(str(aval) for aval, _ in saved_residuals(loss, params))


@pytest.fixture(scope="module")
def baseline():
    """custom with every name `remat`: the layer inputs and what no policy can drop."""
    return residuals()


def _parse(entry: str):
    """'float32<host>[2,8,16,4,8]' -> (on host, (2, 8, 16, 4, 8))."""
    head, dims = entry.rstrip("]").split("[")
    return "<host>" in head, tuple(int(d) for d in dims.split(",") if d)


# name -> the per-layer shape each stack's residual ends with, for the stacks that have the tensor.
EXPECTED = {
    "query_proj": {"dense": (B, L, H, HEAD), "moe": (B, L, H, HEAD)},
    "value_proj": {"dense": (B, L, KV, HEAD), "moe": (B, L, KV, HEAD)},
    "out_proj": {"dense": (B, L, D), "moe": (B, L, D)},
    "mlpwi_0": {"dense": (B, L, MLP)},
    "moe_mlpwi_0": {"moe": (MOE_F,)},   # [rows, F] inside shard_map: the rows depend on the EP buffers
    "moe_mlpwo": {"moe": (D,)},
    "moe_dispatch": {"moe": (D,)},      # the rows the EP all-to-all delivered, [rows, D]
}


@pytest.mark.parametrize("where", ["device", "offload"])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_named_tensor_is_kept_where_its_key_says(name, where, baseline):
    """One name set to device (or offload) adds exactly one residual per layer stack that has the tensor: its
    shape, stacked over the stack's layers, in HBM (or pinned host memory)."""
    added = residuals(f"{name}={where}") - baseline
    assert sum(added.values()) == len(EXPECTED[name]), (name, where, added)
    for entry in added:
        on_host, shape = _parse(entry)
        assert on_host == (where == "offload"), (name, where, entry)
        stack = next((s for s, tail in EXPECTED[name].items()
                      if shape[0] == STACKS[s] and shape[-len(tail):] == tail), None)
        assert stack is not None, (name, where, entry)


def test_mlpwo_is_no_residual(baseline):
    """The dense MLP's output only joins the residual stream, which no backward reads: `mlpwo: device` keeps
    nothing (the planner does not count it either)."""
    assert residuals("mlpwo=device") == baseline


def test_full_saves_no_named_tensor_and_minimal_saves_them_all(baseline):
    full = residuals("remat_policy=full")
    assert full == baseline
    minimal = residuals("remat_policy=minimal")
    every = collections.Counter()
    for name in EXPECTED:
        every += residuals(f"{name}=device") - baseline
    assert not every - (minimal - baseline), "minimal must keep every named tensor on device"
