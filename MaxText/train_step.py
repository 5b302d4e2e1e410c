"""The pure train step: loss, gradients, one optimizer update, and the step's metrics."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from MaxText.optimizers import learning_rate_schedule


def loss_fn(params, batch, graphdef, cfg):
    """Token-mean cross-entropy over real target tokens plus the weighted MoE load-balance loss.

    Returns (loss, aux) with aux = {lm_loss, moe_aux_loss, moe stats per MoE layer}.
    """
    model = nnx.merge(graphdef, params)
    logits_BLV, moe_stats = model(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    xent_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch["targets"])
    weights_BL = (batch["targets_segmentation"] != 0).astype(jnp.float32)
    lm_loss = jnp.sum(xent_BL * weights_BL) / jnp.maximum(jnp.sum(weights_BL), 1.0)
    # Summed over MoE layers: each layer's router is balanced on its own.
    moe_aux = cfg.load_balance_loss_weight * jnp.sum(moe_stats["lb_loss"]) if moe_stats else jnp.zeros(())
    return lm_loss + moe_aux, {"lm_loss": lm_loss, "moe_aux_loss": moe_aux, "moe": moe_stats}


def train_step(state, batch, *, graphdef, cfg, tx):
    """(state, batch) -> (new state, metrics). Pure; jit it with the state donated."""
    grad_fn = jax.value_and_grad(functools.partial(loss_fn, graphdef=graphdef, cfg=cfg), has_aux=True)
    (loss, aux), grads = grad_fn(state["params"], batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {
        "loss": loss,
        "lm_loss": aux["lm_loss"],
        "moe_aux_loss": aux["moe_aux_loss"],
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": learning_rate_schedule(cfg)(state["step"]),
    }
    if aux["moe"]:
        metrics["moe_dropped_fraction"] = jnp.mean(aux["moe"]["dropped_fraction"])
        metrics["moe_expert_load"] = aux["moe"]["load_E"]  # [MoE layers, E] token-slots per expert
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics


def jit_train_step(cfg, spec, batch_sharding):
    """train_step jitted with explicit shardings (state in/out, batch in) and the old state donated."""
    step = functools.partial(train_step, graphdef=spec.graphdef, cfg=cfg, tx=spec.tx)
    return jax.jit(step, in_shardings=(spec.shardings, batch_sharding),
                   out_shardings=(spec.shardings, None), donate_argnums=(0,))
