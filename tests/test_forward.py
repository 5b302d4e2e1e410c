"""MaxText.forward: logits of given token rows from a checkpoint's params, perplexity of a text, one-line errors."""

import math

import jax
import numpy as np
import pytest

from MaxText.trainer import checkpointing, forward
from MaxText.parallel import sharding
from MaxText.config.load import load_config
from MaxText.step.state import state_spec
from MaxText.step.train_step import jit_eval_step
from tests.tiny import TINY, args, train_records


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fwd")
    train_records(load_config(args(TINY, [f"base_output_directory={tmp}", "run_name=src", "steps=2"])))
    return tmp, f"{tmp}/src/checkpoints/2/items"


def test_logits_and_perplexity_agree_with_the_eval_step(checkpoint, capsys):
    """The logits written for token rows give, through forward.perplexity, the same mean cross-entropy as the
    trainer's eval step on a batch whose inputs are those rows and whose targets are the next tokens."""
    tmp, item = checkpoint
    rng = np.random.default_rng(0)
    rows = rng.integers(3, 64, (2, 16)).astype(np.int64)
    np.save(tmp / "rows.npy", rows)
    argv = args(TINY, [f"load_parameters_path={item}"])
    assert forward.main([*argv, "--tokens", str(tmp / "rows.npy"), "--logits_out", str(tmp / "out.npy")]) == 0
    assert "wrote logits [2, 16, 64] float32" in capsys.readouterr().out
    logits = np.load(tmp / "out.npy")
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    ppl, count = forward.perplexity(logits, rows)
    assert count == 2 * 15

    cfg = load_config(argv)
    mesh = sharding.create_mesh(cfg, jax.devices()[:1])
    spec = state_spec(cfg, mesh)
    params, _ = checkpointing.load_params(item, spec.abstract["params"])
    state = {"params": params}
    mask = np.ones((2, 16), np.int32)
    mask[:, -1] = 0  # the last position has no next token
    batch = {"inputs": rows.astype(np.int32), "inputs_position": np.tile(np.arange(16, dtype=np.int32), (2, 1)),
             "inputs_segmentation": np.ones((2, 16), np.int32),
             "targets": np.concatenate([rows[:, 1:], rows[:, :1]], 1).astype(np.int32), "targets_segmentation": mask}
    params_only = spec._replace(shardings={"params": spec.shardings["params"]})  # eval reads params alone
    with jax.set_mesh(mesh):
        out = jax.device_get(jit_eval_step(cfg, params_only, sharding.batch_sharding(mesh))(state, batch))
    np.testing.assert_allclose(math.log(ppl), out["loss_sum"] / out["tokens"], rtol=1e-4)


def test_text_is_scored_through_the_tokenizer(capsys):
    """One row of 6 tokens (BOS + 5 bytes) on 8 devices: padded to the batch shards, scored over 5 predictions."""
    assert forward.main([*args(TINY, ["vocab_size=259"]), "--text", "hello"]) == 0
    out = capsys.readouterr().out
    assert "no load_parameters_path: a fresh init" in out and "perplexity " in out and "over 5 predicted tokens" in out


@pytest.mark.parametrize("content,phrase", [
    (np.zeros((2, 3), np.float32), "need a non-empty integer array [B, L], got float32"),
    (np.zeros((1, 2, 3), np.int32), "got int32 [1, 2, 3]"),
    (np.array([[1, 64]]), "ids must be in [0, vocab_size=64), got 1 .. 64"),
    (None, "cannot read it as an .npy array"),
])
def test_bad_token_files_are_one_line(tmp_path, capsys, content, phrase):
    path = tmp_path / "rows.npy"
    if content is None:
        path.write_text("not numpy")
    else:
        np.save(path, content)
    assert forward.main([*TINY, "--tokens", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --tokens") and phrase in err and "\n" not in err, err
