"""Tiny checkpoints written by upstream MaxText 0.2.5 itself, with upstream's own logits.

    <python with maxtext==0.2.5> tests/upstream_written.py OUT_DIR [case ...]
    <python with maxtext==0.2.5> tests/upstream_written.py --logits CASE ITEMS ROWS.npy OUT.npy

For each case, upstream's trainer (python -m maxtext.trainers.pre_train.train, synthetic data, on CPU) trains one
step from its own initialisation and saves it; OUT_DIR/<case>/0/ is that step directory as upstream wrote it
(Orbax, OCDBT + zarr3: params, optimizer state, step, and nnx_aux with the RNG state and, for DeepSeek, the routing
biases, which routed_bias_update_rate=0.1 moved off zero). Then upstream's own model (model_creation_utils.
from_pretrained, the path of its load_parameters_path) is loaded from those params, its routing biases set from
the checkpoint's nnx_aux (from_pretrained restores params only), and run on OUT_DIR/<case>/rows.npy (int32 [2, 16],
vocabulary 64, fixed seed): OUT_DIR/<case>/logits.npy (float32 [2, 16, 64]). OUT_DIR/cases.json maps each case to
its model file, its command-line keys (the same keys build the model in this trainer), a description and, for a
model with MTP, upstream's MTP loss on those rows (targets: the next tokens, wrapping round; the per-token mean,
without mtp_loss_scaling_factor).
With --logits, upstream's logits of another item directory (an export of this trainer's) under a case's keys.

This file runs in upstream's interpreter (the repository's .venv-maxtext made by scripts/setup_maxtext.sh, or
MAXTEXT_PYTHON): it imports nothing from the project.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

VOCAB, BATCH, LENGTH = 64, 2, 16
ROWS_SEED = 4321
SMALL = ["override_model_config=true", "dtype=float32", f"vocab_size={VOCAB}", "base_emb_dim=32",
         "base_num_query_heads=4", "head_dim=8"]
MIXTRAL = ["model_name=mixtral-8x7b", *SMALL, "base_num_kv_heads=2", "base_mlp_dim=48", "base_moe_mlp_dim=48",
           "base_num_decoder_layers=2", "num_experts=4", "num_experts_per_tok=2"]
QWEN3 = ["model_name=qwen3-30b-a3b", *SMALL, "base_num_kv_heads=2", "base_mlp_dim=16", "base_moe_mlp_dim=16",
         "base_num_decoder_layers=2", "num_experts=8", "num_experts_per_tok=2"]
DEEPSEEK = ["model_name=deepseek3-tiny", *SMALL, "base_num_kv_heads=4", "base_mlp_dim=48", "base_moe_mlp_dim=16",
            "base_num_decoder_layers=3", "first_num_dense_layers=1", "q_lora_rank=16", "kv_lora_rank=8",
            "qk_nope_head_dim=8", "qk_rope_head_dim=8", "v_head_dim=8", "num_experts=8", "num_experts_per_tok=2",
            "n_routing_groups=2", "topk_routing_group=1", "routed_bias_update_rate=0.1"]
CASES = {
    "mixtral_scanned": (MIXTRAL + ["scan_layers=true"], "Mixtral, layers scanned (upstream's default)"),
    "mixtral_unscanned": (MIXTRAL + ["scan_layers=false"], "Mixtral, one entry per layer"),
    "qwen3_moe_scanned": (QWEN3 + ["scan_layers=true"], "Qwen3-MoE (qk norms), scanned"),
    "deepseek3_scanned": (DEEPSEEK + ["scan_layers=true", "mtp_num_layers=1"],
                          "DeepSeek-V3: MLA, a dense layer, shared expert, routing bias, group routing, one MTP depth"),
    "deepseek3_unscanned": (DEEPSEEK + ["scan_layers=false", "mtp_num_layers=0"],
                            "DeepSeek-V3 with one entry per layer, no MTP"),
}
# Upstream's run keys for a CPU step that saves: not model keys, so not recorded in cases.json.
RUN = ["hardware=cpu", "skip_jax_distributed_system=true", "tokenizer_type=tiktoken", "dataset_type=synthetic",
       f"max_target_length={LENGTH}", "per_device_batch_size=1", "steps=1", "enable_checkpointing=true",
       "checkpoint_period=1", "run_name=run"]


def _base_yml() -> str:
    import maxtext
    return os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")


def train_and_save(case_dir: str, keys: list[str]) -> str:
    """Upstream's trainer, one step, saving it; returns the step directory copied to case_dir/0."""
    with tempfile.TemporaryDirectory() as work:
        cmd = [sys.executable, "-m", "maxtext.trainers.pre_train.train", _base_yml(), *keys, *RUN,
               f"base_output_directory={work}"]
        done = subprocess.run(cmd, cwd=work, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                              text=True)
        if done.returncode:
            raise SystemExit(f"upstream's trainer failed for {keys[0]}:\n{done.stderr[-3000:]}")
        step = os.path.join(case_dir, "0")
        shutil.copytree(os.path.join(work, "run", "checkpoints", "0"), step)
    return step


def logits(keys: list[str], items: str, rows: np.ndarray) -> tuple[np.ndarray, float | None]:
    """(logits, MTP loss or None) of upstream's model loaded from items by its own from_pretrained, routing biases
    set from nnx_aux."""
    import jax
    import orbax.checkpoint as ocp
    from flax import nnx
    from maxtext.configs import pyconfig
    from maxtext.utils import model_creation_utils

    argv = ["upstream", _base_yml(), *keys, *RUN, f"base_output_directory={os.path.dirname(items)}",
            f"load_parameters_path={items}", "enable_checkpointing=false"]
    cfg = pyconfig.initialize(argv)
    model, _ = model_creation_utils.from_pretrained(cfg)  # (model, mesh)
    saved = ocp.PyTreeCheckpointer().restore(items)
    biases = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(saved.get("nnx_aux", {}).get("model", {}))[0]:
        if str(getattr(path[-1], "key", "")) == "bias":
            biases[jax.tree_util.keystr(path)] = np.asarray(leaf)
    state = nnx.state(model)
    set_count = 0
    for path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda n: isinstance(n, nnx.Variable))[0]:
        name = jax.tree_util.keystr(path)
        if name in biases:
            var.set_value(jax.numpy.asarray(biases[name], var.get_value().dtype))
            set_count += 1
    if set_count != len(biases):
        raise SystemExit(f"{len(biases)} routing biases in {items} ({sorted(biases)[:1]}), {set_count} found in "
                         f"upstream's model")
    nnx.update(model, state)
    positions = np.broadcast_to(np.arange(rows.shape[1], dtype=np.int32), rows.shape)
    out = model(decoder_input_tokens=rows, decoder_positions=positions, decoder_segment_ids=np.ones_like(rows),
                enable_dropout=False, decoder_target_tokens=targets(rows), decoder_target_mask=np.ones_like(rows))
    mtp = None
    if cfg.mtp_num_layers:  # upstream's own MTP loss (train.loss_fn's path), without its scaling factor
        from maxtext.layers import multi_token_prediction as mtp_lib

        sown = nnx.pop(model, mtp_lib.mtp_losses)
        mtp = float(mtp_lib.calculate_mtp_loss({"mtp_losses": sown.to_pure_dict()}, cfg)) / cfg.mtp_loss_scaling_factor
    return np.asarray(out, np.float32), mtp


def targets(rows: np.ndarray) -> np.ndarray:
    """The targets the MTP loss is computed against: the rows' next tokens, the last one wrapping round."""
    return np.roll(rows, -1, axis=1)


def main(out_dir: str, names: list[str]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    rows = np.random.default_rng(ROWS_SEED).integers(0, VOCAB, (BATCH, LENGTH)).astype(np.int32)
    cases = {}
    for name in names or CASES:
        keys, description = CASES[name]
        case_dir = os.path.join(out_dir, name)
        shutil.rmtree(case_dir, ignore_errors=True)
        os.makedirs(case_dir)
        step = train_and_save(case_dir, keys)
        np.save(os.path.join(case_dir, "rows.npy"), rows)
        out, mtp = logits(keys, os.path.join(step, "items"), rows)
        np.save(os.path.join(case_dir, "logits.npy"), out)
        cases[name] = {"keys": keys, "description": description, **({"mtp_loss": mtp} if mtp is not None else {})}
        print(f"{name}: {description}", flush=True)
    listed = os.path.join(out_dir, "cases.json")
    if os.path.exists(listed):  # the cases not written this time stay listed
        with open(listed) as f:
            cases = {**json.load(f), **cases}
    with open(listed, "w") as f:
        json.dump(dict(sorted(cases.items())), f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--logits":  # --logits CASE ITEMS ROWS.npy OUT.npy: upstream's logits of any items
        case, items, rows_path, out_path = sys.argv[2:6]
        np.save(out_path, logits(CASES[case][0], items, np.load(rows_path))[0])
    else:
        main(sys.argv[1], sys.argv[2:])
