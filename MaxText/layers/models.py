"""The decoder-only Transformer: embed -> dense layers -> MoE layers -> norm -> logits."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from MaxText.config.load import layer_counts
from MaxText.layers.decoder import LayerStack, remat_policy
from MaxText.layers.embed import Embed
from MaxText.layers.moe.router import bias_update
from MaxText.layers.mtp import MultiTokenPrediction
from MaxText.layers.norms import RMSNorm
from MaxText.layers.params import dtype_of


class Transformer(nnx.Module):
    """Layers 0 .. first_num_dense_layers-1 have a dense MLP; the rest routed experts (when num_experts > 1)."""

    def __init__(self, cfg, rules=None, *, rngs: nnx.Rngs):
        cfg = ml_collections.FrozenConfigDict(cfg)  # hashable: module attributes end up in the graphdef
        kw = dict(dtype=dtype_of(cfg.dtype), weight_dtype=dtype_of(cfg.weight_dtype), rules=rules, rngs=rngs)
        moe = cfg.num_experts > 1
        num_dense, num_moe = layer_counts(cfg)
        self.token_embedder = Embed(cfg, dtype=kw["dtype"], weight_dtype=kw["weight_dtype"], rngs=rngs)
        if num_dense:
            self.dense_layers = LayerStack(cfg, num_dense, moe=False, scan=cfg.scan_layers, **kw)
        if num_moe:
            self.moe_layers = LayerStack(cfg, num_moe, moe=True, scan=cfg.scan_layers, **kw)
        self.decoder_norm = RMSNorm(cfg.base_emb_dim, epsilon=cfg.normalization_layer_epsilon,
                                    dtype=kw["dtype"], weight_dtype=kw["weight_dtype"], rngs=rngs)
        if cfg.mtp_num_layers:
            self.mtp = MultiTokenPrediction(cfg, moe=moe, **kw)
        self.num_dense, self.num_moe = num_dense, num_moe
        self.remat = cfg.remat_policy != "none"
        self.policy = remat_policy(cfg) if self.remat else None

    def __call__(self, tokens_BL, positions_BL=None, segment_ids_BL=None):
        """float32 logits [B, L, V] and MoE stats per MoE layer ({} for a dense model)."""
        h_BLD, stats = self.hidden(tokens_BL, positions_BL, segment_ids_BL)
        return self.logits(h_BLD), stats

    def logits(self, h_BLD):
        return self.token_embedder.logits(self.decoder_norm(h_BLD))

    def hidden(self, tokens_BL, positions_BL=None, segment_ids_BL=None):
        """The final hidden state before the decoder norm [B, L, D], and the MoE stats."""
        if positions_BL is None:
            positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
        if segment_ids_BL is None:
            segment_ids_BL = jnp.ones_like(tokens_BL)
        x = self.token_embedder(tokens_BL)
        if self.num_dense:
            x, _ = self.dense_layers(x, positions_BL, segment_ids_BL, self.policy, self.remat)
        stats = {}
        if self.num_moe:
            x, stats = self.moe_layers(x, positions_BL, segment_ids_BL, self.policy, self.remat)
        return x, stats


def update_moe_bias(aux: dict, load_LE, rate: float, mtp_load_KE=None) -> dict:
    """Moves every MoE routing bias by its layer's load. `aux` is the model's MoeBias state as a pure dict
    (state.py selects it by type, so every leaf is a bias, whatever the modules holding it are called):
    the biases under `mtp` follow mtp_load_KE [K, E], the others load_LE [L, E]. A scanned stack keeps one
    [L, E] bias that takes the whole load; unrolled layers keep one [E] bias each, which take the load's rows
    in the order of the layer indices in their names (layers_2 before layers_10). Biases and load rows must
    match one to one: a mismatch raises instead of leaving a bias unmoved."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(aux)
    groups: dict[bool, list[int]] = {False: [], True: []}
    for i, (path, _) in enumerate(flat):
        groups[getattr(path[0], "key", None) == "mtp"].append(i)
    new = [bias for _, bias in flat]
    for is_mtp, members in groups.items():
        if not members:
            continue
        load = mtp_load_KE if is_mtp else load_LE
        name = "mtp_load_KE" if is_mtp else "load_LE"
        members = sorted(members, key=lambda i: [int(n) for k in flat[i][0]
                                                 for n in re.findall(r"\d+", str(getattr(k, "key", k)))])
        count = sum(b.shape[0] if b.ndim == 2 else 1 for b in (flat[i][1] for i in members))
        if load is None or load.shape[0] != count:
            raise ValueError(f"update_moe_bias: {count} MoE routing bias rows but {name} has "
                             f"{None if load is None else load.shape[0]}")
        for row, i in enumerate(members):  # a scanned stack's one [L, E] bias takes the whole load
            bias = flat[i][1]
            new[i] = bias_update(bias, load if bias.ndim == 2 else load[row], rate)
    return jax.tree_util.tree_unflatten(treedef, new)