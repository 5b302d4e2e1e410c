"""Multi-Token Prediction: target alignment and masking against explicit loops, loss composition, training."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from MaxText.layers.models import Transformer
from MaxText.layers.mtp import shift_left
from MaxText.step.train_step import loss_fn
from tests.tiny import tiny_config

B, L = 2, 16


def _packed_batch(vocab=64):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab, (B, L + 1)).astype(np.int32)
    split = 9  # row 0 packs two documents; row 1 is one document followed by 3 padding tokens
    segments = np.stack([np.where(np.arange(L) < split, 1, 2), np.where(np.arange(L) < L - 3, 1, 0)]).astype(np.int32)
    positions = np.stack([np.where(np.arange(L) < split, np.arange(L), np.arange(L) - split), np.arange(L)])
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "inputs_position": positions.astype(np.int32),
            "inputs_segmentation": segments, "targets_segmentation": segments}


def test_shift_left():
    x = jnp.arange(10).reshape(2, 5)
    np.testing.assert_array_equal(shift_left(x, 2), [[2, 3, 4, 0, 0], [7, 8, 9, 0, 0]])


def test_mtp_loss_matches_explicit_per_position_reference():
    """Depth k at position i sees token i+k and predicts targets[i+k], only inside one real document."""
    cfg = tiny_config("mtp_num_layers=2", "mtp_loss_scaling_factor=0.3")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    batch = {k: jnp.asarray(v) for k, v in _packed_batch().items()}
    mtp_loss, _ = model.mtp(model.hidden(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])[0],
                            batch, model.token_embedder)

    h = model.hidden(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])[0]
    inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
    segments = np.asarray(batch["inputs_segmentation"])
    depth_losses = []
    for k in (1, 2):
        depth = getattr(model.mtp, f"mtp_{k}")
        ahead = np.zeros_like(inputs)
        for b in range(B):
            for i in range(L - k):
                ahead[b, i] = inputs[b, i + k]
        joined = jnp.concatenate([depth.hidden_norm(h), depth.embedding_norm(model.token_embedder(ahead))], -1)
        h, _ = depth.layer(joined @ depth.projection[...], batch["inputs_position"], batch["inputs_segmentation"])
        log_probs = np.asarray(jax.nn.log_softmax(model.token_embedder.logits(depth.final_norm(h)), -1))
        terms = [-log_probs[b, i, targets[b, i + k]] for b in range(B) for i in range(L - k)
                 if segments[b, i + k] != 0 and segments[b, i + k] == segments[b, i]]
        depth_losses.append(np.mean(terms))
    np.testing.assert_allclose(mtp_loss, np.mean(depth_losses), rtol=1e-5)

    graphdef, params = nnx.split(model, nnx.Param)
    total, aux = loss_fn(nnx.to_pure_dict(params), batch, graphdef, cfg)
    np.testing.assert_allclose(total, aux["lm_loss"] + aux["moe_aux_loss"] + aux["moe_z_loss"] + 0.3 * mtp_loss,
                               rtol=1e-6)


def test_mtp_depth_routing_bias_is_updated():
    """With routed_bias, the MTP depth's MoE router is balanced too: its bias leaves zero after a step."""
    from MaxText.parallel import sharding
    from MaxText.step.state import create_state, state_spec
    from MaxText.step.train_step import jit_train_step

    cfg = tiny_config("mtp_num_layers=1", "routed_score_func=sigmoid", "routed_bias=true", "norm_topk_prob=true",
                      "routed_bias_update_rate=0.01", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2",
                      "ici_data_parallelism=2", "per_device_batch_size=0.5")
    mesh = sharding.create_mesh(cfg)
    spec = state_spec(cfg, mesh)
    with jax.set_mesh(mesh):
        state = create_state(cfg, mesh, spec)
        assert "mtp" in state["nnx_aux"], state["nnx_aux"].keys()
        rows = sharding.batch_sharding(mesh)
        batch = {k: jax.device_put(np.tile(v, (2, 1)), rows) for k, v in _packed_batch().items()}  # 4 data shards
        state, metrics = jit_train_step(cfg, spec, rows)(state, batch)
    assert np.abs(np.asarray(state["nnx_aux"]["mtp"]["mtp_1"]["layer"]["moe"]["bias"])).max() > 0
    assert np.abs(np.asarray(state["nnx_aux"]["moe_layers"]["layers"]["moe"]["bias"])).max() > 0
    assert np.isfinite(float(metrics["mtp_loss"]))
