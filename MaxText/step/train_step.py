"""The pure train step: loss, gradients, one optimizer update, and the step's metrics."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from MaxText.layers.linear import stochastic_rounding
from MaxText.layers.models import moe_load, update_moe_bias
from MaxText.layers.losses import cross_entropy
from MaxText.parallel.sharding import DATA_AXES
from MaxText.step.optimizers import learning_rate_schedule


def _model(graphdef, params, nnx_aux):
    return nnx.merge(graphdef, params, nnx_aux) if nnx_aux else nnx.merge(graphdef, params)


def loss_fn(params, batch, graphdef, cfg, nnx_aux=None, sr_key=None, micro_index=None):
    """Token-mean cross-entropy over real target tokens, plus the weighted MoE load-balance and z losses
    (summed over MoE layers: each router is balanced on its own) and the scaled Multi-Token Prediction loss.
    sr_key: NVFP4's stochastic rounding (linear.stochastic_rounding), a micro-batch's own with micro_index.

    Returns (loss, aux) with aux = {lm_loss, moe_aux_loss, moe_z_loss, mtp_loss, moe stats, mtp stats}.
    """
    if sr_key is not None:
        key = sr_key if micro_index is None else jax.random.fold_in(sr_key, micro_index)
        with stochastic_rounding(key):
            return loss_fn(params, batch, graphdef, cfg, nnx_aux)
    model = _model(graphdef, params, nnx_aux)
    h_BLD, moe_stats = model.hidden(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    weights_BL = (batch["targets_segmentation"] != 0).astype(jnp.float32)
    lm_loss = cross_entropy(h_BLD, batch["targets"], weights_BL, model.logits, cfg.num_vocab_tiling)
    mtp_loss, mtp_stats = jnp.zeros(()), {}
    if cfg.mtp_num_layers:
        mtp_loss, mtp_stats = model.mtp(h_BLD, batch, model.token_embedder)
    router_stats = [s for s in (moe_stats, mtp_stats) if s]
    moe_aux = cfg.load_balance_loss_weight * sum(jnp.sum(s["lb_loss"]) for s in router_stats) if router_stats \
        else jnp.zeros(())
    z_loss = cfg.router_z_loss_weight * sum(jnp.sum(s["z_loss"]) for s in router_stats) if router_stats \
        else jnp.zeros(())
    total = lm_loss + moe_aux + z_loss + cfg.mtp_loss_scaling_factor * mtp_loss
    return total, {"lm_loss": lm_loss, "moe_aux_loss": moe_aux, "moe_z_loss": z_loss, "mtp_loss": mtp_loss,
                   "moe": moe_stats, "mtp": mtp_stats}


def moe_metrics(stats) -> dict:
    """Expert-load statistics per MoE layer (arrays over layers; expert_load is [layers, E]); with
    moe_dropless_fallback=layer, the batch parts each layer ran with its worst-case buffers and their total."""
    load_LE = stats["load_E"]
    mean_L = jnp.mean(load_LE, axis=-1)
    return {
        "moe_expert_load": load_LE,
        "moe_load_max_over_mean": jnp.max(load_LE, axis=-1) / jnp.maximum(mean_L, 1e-9),
        "moe_load_min": jnp.min(load_LE, axis=-1),
        "moe_load_max": jnp.max(load_LE, axis=-1),
        "moe_router_entropy": stats["entropy"],
        "moe_dropped_fraction": stats["dropped_fraction"],
        "moe_overflow": stats["overflow"],
        "moe_bias_abs_mean": stats["bias_abs_mean"],
        **({"moe_fallback": stats["fallback"], "moe_dropless_fallback_layers": jnp.sum(stats["fallback"])}
           if "fallback" in stats else {}),
    }


def micro_batches(batch, steps: int):
    """A batch [B, ...] as `steps` micro-batches [steps, B / steps, ...]: micro-batch j holds rows j, j + steps,
    j + 2 steps, ..., so each device's rows of the batch (a contiguous block of B / shards, a multiple of steps)
    split into its rows of every micro-batch without moving (sharding.check_batch holds the multiple)."""
    def split(x):
        x = jnp.swapaxes(x.reshape(x.shape[0] // steps, steps, *x.shape[1:]), 0, 1)
        if jax.sharding.get_abstract_mesh().empty:
            return x
        return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(None, DATA_AXES))
    return jax.tree.map(split, batch)


# How each router statistic of a step combines over micro-batches: summed counts, else the micro-batch mean.
SUMMED_STATS = ("load_E", "overflow", "fallback")


def accumulated_loss_and_grads(params, batch, loss, cfg):
    """(loss, aux, grads) of the whole batch from gradient_accumulation_steps micro-batches, one at a time (a scan):
    the same update as one step over the batch. Each micro-batch's token-mean losses (cross-entropy, MTP, z-loss)
    weigh by its share of the batch's real target tokens, so the sum is the batch's token mean; the load-balance
    loss, a product of two batch means, is each micro-batch's own, averaged (as upstream MaxText does). Expert loads
    and overflow are summed (the bias update takes the sign of the whole step's load), the other router statistics
    averaged."""
    steps = cfg.gradient_accumulation_steps
    micro = micro_batches(batch, steps)
    tokens_M = jnp.sum((micro["targets_segmentation"] != 0).astype(jnp.float32), axis=(1, 2))
    share_M = tokens_M / jnp.maximum(jnp.sum(tokens_M), 1.0)

    def weighted(p, b, share, index):
        total, aux = loss(p, b, micro_index=index)
        lb = aux["moe_aux_loss"]
        return (total - lb) * share + lb / steps, aux

    grad_fn = jax.value_and_grad(weighted, has_aux=True)

    def body(carry, xs):
        b, share, index = xs
        (value, aux), grads = grad_fn(params, b, share, index)
        scale = {"lm_loss": share, "mtp_loss": share, "moe_z_loss": share, "moe_aux_loss": 1.0 / steps}
        aux = {k: (v * scale[k] if k in scale else v) for k, v in aux.items()}
        summed = jax.tree.map(jnp.add, carry, (value, grads, {k: aux[k] for k in scale}))
        return summed, {k: aux[k] for k in ("moe", "mtp")}

    zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params),
             {k: jnp.zeros(()) for k in ("lm_loss", "mtp_loss", "moe_z_loss", "moe_aux_loss")})
    (value, grads, losses), routers = jax.lax.scan(body, zeros, (micro, share_M, jnp.arange(steps)))
    combined = {part: {k: (jnp.sum(v, axis=0) if k in SUMMED_STATS else jnp.mean(v, axis=0)) for k, v in stats.items()}
                for part, stats in routers.items()}
    return value, {**losses, **combined}, grads


def train_step(state, batch, *, graphdef, cfg, tx, rollback: bool = False):
    """(state, batch) -> (new state, metrics). Pure; jit it with the state donated. With
    gradient_accumulation_steps > 1 the batch is taken in that many micro-batches (accumulated_loss_and_grads).
    With `rollback` (moe_dropless_fallback=step), a step in which any MoE layer overflowed returns the state it was
    given, unchanged (metrics["moe_overflowed"] says so), for the worst-case program to run it again."""
    nnx_aux = state.get("nnx_aux")
    # NVFP4 rounds gradients stochastically: a new key each step (the same step, rerun, rounds the same)
    sr_key = (jax.random.fold_in(jax.random.key(cfg.init_weights_seed), state["step"])
              if cfg.quantization.startswith("te_nvfp4") else None)
    loss = functools.partial(loss_fn, graphdef=graphdef, cfg=cfg, nnx_aux=nnx_aux, sr_key=sr_key)
    if cfg.gradient_accumulation_steps > 1:
        loss_value, aux, grads = accumulated_loss_and_grads(state["params"], batch, loss, cfg)
    else:
        (loss_value, aux), grads = jax.value_and_grad(loss, has_aux=True)(state["params"], batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    new_state = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                 "opt_state": opt_state}
    if nnx_aux:  # aux-loss-free balancing: the bias follows this step's measured load, outside the optimizer
        # The step's loads (summed over micro-batches) in the biases' tree: the model's structure, no compute.
        load = moe_load(_model(graphdef, state["params"], nnx_aux), aux["moe"].get("load_E"),
                        aux["mtp"].get("load_E") if aux["mtp"] else None)
        new_state["nnx_aux"] = update_moe_bias(nnx_aux, load, cfg.routed_bias_update_rate)
    metrics = {
        "loss": loss_value,
        "lm_loss": aux["lm_loss"],
        "moe_aux_loss": aux["moe_aux_loss"],
        "moe_z_loss": aux["moe_z_loss"],
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": learning_rate_schedule(cfg)(state["step"]),
    }
    if cfg.mtp_num_layers:
        metrics["mtp_loss"] = aux["mtp_loss"]
    routers = router_layers(aux)
    if routers:
        metrics.update(moe_metrics(routers))
    if rollback and routers:
        overflowed = jnp.sum(routers["overflow"]) > 0
        new_state = jax.tree.map(lambda new, old: jnp.where(overflowed, old, new), new_state, state)
        metrics["moe_overflowed"] = overflowed
    return new_state, metrics


def router_layers(aux) -> dict:
    """Every MoE layer's stats stacked on one leading axis: the decoder's MoE layers, then the Multi-Token
    Prediction depths' (their routers drop and overflow like any other); {} for a dense model."""
    parts = [s for s in (aux["moe"], aux["mtp"]) if s]
    if len(parts) < 2:
        return parts[0] if parts else {}
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=0), *parts)


def jit_train_step(cfg, spec, batch_sharding, rollback: bool = False):
    """train_step jitted with explicit shardings (state in/out, batch in) and the old state donated."""
    step = functools.partial(train_step, graphdef=spec.graphdef, cfg=cfg, tx=spec.tx, rollback=rollback)
    return jax.jit(step, in_shardings=(spec.shardings, batch_sharding),
                   out_shardings=(spec.shardings, None), donate_argnums=(0,))


def eval_step(state, batch, *, graphdef, cfg):
    """The summed cross-entropy of a batch's real target tokens and their number (so that batches with
    different amounts of padding average right); no router or MTP losses. With MoE layers, also the
    token-slots each dropped (`moe_overflow`, per layer) and the real slots routed (`moe_slots`)."""
    model = _model(graphdef, state["params"], state.get("nnx_aux"))
    h_BLD, moe_stats = model.hidden(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    weights_BL = (batch["targets_segmentation"] != 0).astype(jnp.float32)
    tokens = jnp.sum(weights_BL)
    mean = cross_entropy(h_BLD, batch["targets"], weights_BL, model.logits, cfg.num_vocab_tiling)
    out = {"loss_sum": mean * jnp.maximum(tokens, 1.0), "tokens": tokens}
    if moe_stats:
        out["moe_overflow"] = moe_stats["overflow"]
        if "fallback" in moe_stats:
            out["moe_fallback"] = moe_stats["fallback"]
        out["moe_slots"] = jnp.sum(batch["inputs_segmentation"] != 0).astype(jnp.float32) * cfg.num_experts_per_tok
    return out


def jit_eval_step(cfg, spec, batch_sharding):
    """eval_step jitted with the train state's shardings (nothing donated)."""
    step = functools.partial(eval_step, graphdef=spec.graphdef, cfg=cfg)
    return jax.jit(step, in_shardings=(spec.shardings, batch_sharding), out_shardings=None)
