"""The train state {step, params, opt_state[, nnx_aux]}: its abstract shape, shardings and sharded creation.

`nnx_aux` holds the model's non-parameter state (the MoE routing biases), present only when the model
has any; like MaxText, it sits beside the params in checkpoints and is never touched by the optimizer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from MaxText.parallel import sharding
from MaxText.layers.models import Transformer
from MaxText.layers.moe.block import MoeBias
from MaxText.step.optimizers import optimizer


class StateSpec(NamedTuple):
    graphdef: Any            # the model's static structure; nnx.merge(graphdef, params) rebuilds it
    abstract: Any            # ShapeDtypeStructs of the state, each with its NamedSharding
    shardings: Any           # NamedShardings of the state
    tx: optax.GradientTransformation


def _new_state(cfg, rules, tx, key):
    model = Transformer(cfg, rules, rngs=nnx.Rngs(params=key))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
    aux = nnx.to_pure_dict(nnx.state(model, MoeBias))
    if aux:
        state["nnx_aux"] = aux
    return state


def _split_model(cfg, rules):
    # Outside any mesh (a run builds its programs inside one): the variables' axes are logical names, which
    # nnx.eval_shape would otherwise read as the mesh's.
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        model = nnx.eval_shape(lambda: Transformer(cfg, rules, rngs=nnx.Rngs(0)))
    return nnx.split(model, nnx.Param, MoeBias)


def with_config(spec: StateSpec, cfg) -> StateSpec:
    """`spec` whose graphdef builds the model under `cfg`, a config that changes no parameter (another receive
    buffer: load.with_buffer): the same state, shapes and shardings."""
    return spec._replace(graphdef=_split_model(cfg, sharding.axis_rules(cfg))[0])


def state_spec(cfg, mesh: Mesh) -> StateSpec:
    """Shapes and shardings of the train state without allocating it (jax.eval_shape over the real model)."""
    rules = sharding.axis_rules(cfg)
    tx = optimizer(cfg)
    graphdef, param_vars, aux_vars = _split_model(cfg, rules)
    param_shardings = sharding.logical_sharding(nnx.to_pure_dict(nnx.get_partition_spec(param_vars)), mesh, rules)
    abstract = jax.eval_shape(lambda k: _new_state(cfg, rules, tx, k), jax.random.key(0))
    replicated = NamedSharding(mesh, P())
    # Optimizer moments mirror the params and take their shardings; counters are replicated.
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, abstract["opt_state"], param_shardings,
        transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, NamedSharding))
    shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_shardings}
    if "nnx_aux" in abstract:
        shardings["nnx_aux"] = sharding.logical_sharding(
            nnx.to_pure_dict(nnx.get_partition_spec(aux_vars)), mesh, rules)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return StateSpec(graphdef, abstract, shardings, tx)


def create_state(cfg, mesh: Mesh, spec: StateSpec):
    """Initialises the state directly into its shardings: no parameter is ever whole on one device."""
    rules = sharding.axis_rules(cfg)
    init = jax.jit(lambda k: _new_state(cfg, rules, spec.tx, k), out_shardings=spec.shardings)
    return init(jax.random.key(cfg.init_weights_seed))
