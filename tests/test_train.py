"""The train loop end to end: meshes, falling loss, outputs, resume, and starting from a checkpoint."""

import os

import jax
import numpy as np
import pytest

from MaxText.trainer import checkpointing
from MaxText.parallel import sharding
from MaxText.config.load import load_config
from MaxText.step.state import state_spec
from tests.tiny import TINY, args, losses, train_records


def run(tmp_path, *overrides, base=TINY, devices=None):
    """Trains with `overrides` under tmp_path and returns the metrics records written by this run."""
    cfg = load_config(args(base, [f"base_output_directory={tmp_path}", "log_period=1"], overrides))
    return train_records(cfg, devices)


MESHES = {
    "data8": ["ici_data_parallelism=8", "ici_fsdp_parallelism=1"],
    "fsdp8": ["ici_fsdp_parallelism=8"],
    "fsdp2_expert4": ["ici_fsdp_parallelism=2", "ici_expert_parallelism=4"],
    "data2_fsdp2_tensor2": ["ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"],
}


@pytest.fixture(scope="module")
def single_device_losses(tmp_path_factory):
    """Three steps on a 1-device mesh: the numbers every mesh must reproduce."""
    tmp = tmp_path_factory.mktemp("one")
    cfg = load_config(args(TINY, [f"base_output_directory={tmp}", "run_name=one", "log_period=1", "steps=3",
                                  "enable_checkpointing=false", "per_device_batch_size=8"]))
    return losses(train_records(cfg, devices=jax.devices()[:1]))


@pytest.mark.parametrize("mesh", MESHES)
def test_train_step_runs_on_mesh_and_matches_one_device(mesh, tmp_path, single_device_losses):
    """Same data and init on every mesh: the first 3 losses equal the single-device run's."""
    records = run(tmp_path, f"run_name={mesh}", "steps=3", "enable_checkpointing=false",
                  "per_device_batch_size=1", *MESHES[mesh])
    np.testing.assert_allclose(losses(records), single_device_losses, rtol=2e-5, err_msg=f"mesh {mesh}")


def test_params_are_created_sharded():
    """Expert weights split over `expert`, dense weights over `fsdp`; no param is whole on every device."""
    cfg = load_config(args(TINY, MESHES["fsdp2_expert4"]))
    mesh = sharding.create_mesh(cfg)
    spec = state_spec(cfg, mesh)
    params = spec.shardings["params"]
    wi_0 = params["moe_layers"]["layers"]["moe"]["wi_0"]
    assert wi_0.spec == jax.sharding.PartitionSpec(None, "expert", "fsdp", "tensor"), wi_0.spec
    wq = params["dense_layers"]["layers"]["self_attention"]["wq"]
    assert wq.spec[1] == ("fsdp", "expert"), wq.spec
    # The optimizer moments follow the params.
    mu = spec.shardings["opt_state"][1][0].mu["moe_layers"]["layers"]["moe"]["wi_0"]
    assert mu.spec == wi_0.spec, mu.spec


def test_default_config_loss_falls_and_outputs_are_written(tmp_path, monkeypatch):
    """40 steps of configs/base.yml (at half its batch) on one device, as the README's run on a CPU, learn the Python
    standard library's text: from about ln(512) = 6.2 to an eval loss under 3.0, well below the 3.25 nats/token of a
    model that knows only byte frequencies (`python -m MaxText.data.python_stdlib` measures it). Metrics,
    eval records, TensorBoard events and (async) checkpoints land where MaxText puts them, under the default
    relative `outputs` directory."""
    monkeypatch.chdir(tmp_path)
    # Half the default batch and eval_steps: the same learning on half the suite time (the README's full run
    # is measured by hand).
    cfg = load_config(["steps=40", "run_name=default", "checkpoint_period=20", "log_period=1",
                       "per_device_batch_size=4", "eval_steps=4"])
    assert cfg.base_output_directory == "outputs" and cfg.async_checkpointing
    assert cfg.dataset_type == "tfds" and cfg.dataset_name == "python_stdlib"
    records = train_records(cfg, devices=jax.devices()[:1])
    evals = [r for r in records if "eval_loss" in r]
    records = [r for r in records if "eval_loss" not in r]
    assert [r["step"] for r in evals] == [40], "eval_interval=100 evaluates at the last step only"
    assert evals[0]["eval_tokens"] == cfg.eval_steps * cfg.per_device_batch_size * cfg.max_target_length, evals
    assert evals[0]["eval_loss"] < 3.25 - 0.25, f"eval loss {evals[0]['eval_loss']} is not well below unigram"
    np.testing.assert_allclose(evals[0]["eval_perplexity"], np.exp(evals[0]["eval_loss"]), rtol=1e-6)
    tmp_path = tmp_path / "outputs"
    assert [r["step"] for r in records] == list(range(1, 41))
    loss = losses(records)
    assert loss[0] > 5.5, loss[:3]
    assert loss[-5:].mean() < 3.0, f"loss did not fall: first {loss[:3]}, last {loss[-5:]}"
    for key in ("step", "loss", "lm_loss", "moe_aux_loss", "grad_norm", "learning_rate", "step_time_s",
                "tokens_per_s_per_device", "tflops_per_device", "mfu"):
        assert key in records[-1], key
    assert records[-1]["mfu"] is None  # no known peak for a CPU
    assert records[-1]["tflops_per_device"] > 0
    run_dir = tmp_path / "default"
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(run_dir / "tensorboard"))
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["20", "40"]
    assert os.path.isdir(run_dir / "checkpoints" / "40" / "items")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Six steps in one go, checkpointing every 3 steps (the source for the load_* tests)."""
    tmp = tmp_path_factory.mktemp("full")
    return tmp, run(tmp, "run_name=full", "steps=6", "checkpoint_period=3", "learning_rate_schedule_steps=6")


def test_stop_and_rerun_continues_exactly(tmp_path, uninterrupted):
    """Stopping after 3 steps and rerunning the same run_name gives the uninterrupted run's losses."""
    _, full = uninterrupted
    # The schedule's length is pinned: by default it follows `steps`, which differs between the two calls.
    first = run(tmp_path, "run_name=split", "steps=3", "checkpoint_period=3", "learning_rate_schedule_steps=6")
    second = run(tmp_path, "run_name=split", "steps=6", "checkpoint_period=3", "learning_rate_schedule_steps=6")
    assert [r["step"] for r in first + second] == list(range(1, 7))
    np.testing.assert_allclose(losses(first + second), losses(full), rtol=1e-6)
    assert run(tmp_path, "run_name=split", "steps=6") == [], "a finished run must not train again"


def test_load_full_state_path_continues_the_source_run(tmp_path, uninterrupted):
    source, full = uninterrupted
    records = run(tmp_path, "run_name=from_full", "steps=6",
                  f"load_full_state_path={source}/full/checkpoints/3/items", "learning_rate_schedule_steps=6")
    assert [r["step"] for r in records] == [4, 5, 6]
    np.testing.assert_allclose(losses(records), losses(full)[3:], rtol=1e-6)


def test_load_parameters_path_restores_params_only(tmp_path, uninterrupted):
    """Params equal the checkpoint's; training starts at step 0 with a fresh optimizer."""
    source, full = uninterrupted
    item = f"{source}/full/checkpoints/3/items"
    cfg = load_config(TINY)
    spec = state_spec(cfg, sharding.create_mesh(cfg))
    params, bias = checkpointing.load_params(item, spec.abstract["params"], abstract_aux=spec.abstract.get("nnx_aux"))
    assert bias is None and "nnx_aux" not in spec.abstract  # TINY has no routing bias
    saved, saved_input = checkpointing.load_full_state(item, spec.abstract)
    assert saved_input == {"process_count": 1, "positions": [{"batches": 3}]}, saved_input
    jax.tree.map(np.testing.assert_array_equal, params, saved["params"])

    records = run(tmp_path, "run_name=from_params", "steps=2", f"load_parameters_path={item}")
    assert [r["step"] for r in records] == [1, 2]
    fresh = run(tmp_path, "run_name=fresh", "steps=1", "enable_checkpointing=false")
    assert records[0]["loss"] < fresh[0]["loss"] - 0.05, (records[0]["loss"], fresh[0]["loss"])


def test_load_parameters_path_restores_the_routing_bias(tmp_path):
    """A DeepSeek-style model's routing biases come with its params (they used to restart at zero, re-routing
    every token at step 0), and the log line says so."""
    from MaxText.trainer.checkpointing import Checkpointer, load_full_state
    from MaxText.trainer.resume import initial_state

    keys = ["model_name=deepseek3-tiny", "override_model_config=true", "dtype=float32", "max_target_length=16",
            "per_device_batch_size=1",
            "dataset_type=synthetic", "eval_interval=-1", "enable_tensorboard=false", "routed_bias_update_rate=0.01",
            "base_num_decoder_layers=2", "mtp_num_layers=0", f"base_output_directory={tmp_path}"]
    train_records(load_config(keys + ["run_name=source", "steps=1"]))
    item = f"{tmp_path}/source/checkpoints/1/items"
    cfg = load_config(keys + ["run_name=target", f"load_parameters_path={item}"])
    mesh = sharding.create_mesh(cfg)
    spec = state_spec(cfg, mesh)
    lines = []
    checkpointer = Checkpointer(cfg, f"{tmp_path}/target/checkpoints", lines.append)
    state, _ = initial_state(cfg, mesh, spec, checkpointer, lines.append, lambda position: None)
    checkpointer.close()
    saved, _ = load_full_state(item, spec.abstract)
    leaves = jax.tree.leaves(saved["nnx_aux"])
    assert leaves and any(np.abs(np.asarray(b)).max() > 0 for b in leaves), "the source's bias never moved"
    jax.tree.map(np.testing.assert_array_equal, state["nnx_aux"], saved["nnx_aux"])
    assert int(state["step"]) == 0
    assert lines == [f"loaded the params and the MoE routing biases of {item} (step 0)"], lines


def test_load_parameters_path_names_the_real_cause_of_missing_arrays(tmp_path):
    """A checkpoint written with the other scan_layers layout names scan_layers; one with no MTP depth names
    mtp_num_layers; upstream MaxText's tree (params/params/decoder/...) says how to convert it. One line each."""
    import json as json_lib

    from MaxText.trainer import checkpointing
    from MaxText.config.errors import ConfigError

    keys = TINY + ["steps=1", f"base_output_directory={tmp_path}", "run_name=scanned", "scan_layers=true"]
    train_records(load_config(keys))
    item = f"{tmp_path}/scanned/checkpoints/1/items"

    def load(*extra):
        cfg = load_config(TINY + [f"load_parameters_path={item}", *extra])
        abstract = state_spec(cfg, sharding.create_mesh(cfg)).abstract
        return checkpointing.load_params(item, abstract["params"], cfg)

    with pytest.raises(ConfigError, match="written with scan_layers=true .*: set scan_layers=true") as info:
        load("scan_layers=false")
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="no Multi-Token Prediction depths: set mtp_num_layers=0"):
        load("mtp_num_layers=1")
    meta = f"{item}/_METADATA"  # the same arrays under upstream's names
    with open(meta) as f:
        tree = json_lib.load(f)
    for entry in tree["tree_metadata"].values():
        entry["key_metadata"] = [{"key": "params", "key_type": 2}, {"key": "decoder", "key_type": 2},
                                 *entry["key_metadata"][1:]]
    with open(meta, "w") as f:
        json_lib.dump(tree, f)
    with pytest.raises(ConfigError, match="is upstream MaxText's parameter tree .*convert it with python -m "
                       "MaxText.utils.ckpt_conversion.from_upstream"):
        load()


def test_num_devices_must_match_the_visible_devices(tmp_path):
    """A config laid out for N devices (a GPU recipe's num_devices) refuses to start on another count."""
    from MaxText.config.errors import ConfigError
    from MaxText.trainer.loop import train

    cfg = load_config(TINY + [f"base_output_directory={tmp_path}", "num_devices=128"])
    with pytest.raises(ConfigError, match="num_devices=128 but 8 devices are visible"):
        train(cfg, log=lambda *_: None)


class _Recorder:
    """Wraps an input iterator, keeping a copy of every batch it hands out."""

    def __init__(self, data, seen):
        self.data, self.seen = data, seen

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.data)
        self.seen.append({k: v.copy() for k, v in batch.items()})
        return batch

    def state(self):
        return self.data.state()


@pytest.mark.parametrize("pipeline", ["tfds", "grain", "hf"])
def test_resumed_run_reads_exactly_the_batches_an_uninterrupted_run_reads(tmp_path, monkeypatch, pipeline):
    """Real text, packed, through each document pipeline (tfds: python_stdlib; grain and hf: the shared test
    corpus, read over several epochs): a run stopped after a checkpoint and resumed feeds the model the same
    token batches, element for element, as the uninterrupted run, and so reaches the same losses; every
    checkpoint holds the input position."""
    import json
    import shutil

    from tests import corpora

    from MaxText.trainer import loop

    seen = []
    make_data = loop.make_data

    def recording_make_data(*args, **kwargs):
        data = make_data(*args, **kwargs)
        return _Recorder(data, seen) if kwargs.get("split", "train") == "train" else data

    monkeypatch.setattr(loop, "make_data", recording_make_data)  # the training stream's maker
    if pipeline == "tfds":
        source = ["dataset_type=tfds", "dataset_name=python_stdlib"]
    else:
        corpora.write(pipeline, str(tmp_path / "corpus"))
        source = corpora.config_args(pipeline, str(tmp_path / "corpus"))
    text = [*source, "vocab_size=512", "max_target_length=32", "checkpoint_period=2", "steps=4",
            "learning_rate_schedule_steps=4"]
    full = run(tmp_path, "run_name=full", *text)
    full_batches, seen[:] = list(seen), []
    assert len(full_batches) == 4 and all(b["inputs"].shape == (16, 32) for b in full_batches)
    assert not np.array_equal(full_batches[2]["inputs"], full_batches[0]["inputs"])

    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")  # as if the run had been stopped at step 2
    resumed = run(tmp_path, "run_name=resumed", *text)
    assert [r["step"] for r in resumed] == [3, 4]
    assert len(seen) == 2, f"the resumed run read {len(seen)} batches for 2 steps"
    for step, (got, want) in enumerate(zip(seen, full_batches[2:]), start=3):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"step {step}: {key}")
    np.testing.assert_allclose(losses(resumed), losses(full)[2:], rtol=1e-6)
    for step in (2, 4):
        with open(tmp_path / "resumed" / "checkpoints" / str(step) / "input" / "metadata") as f:
            saved = json.load(f)
        assert saved["process_count"] == 1 and set(saved["positions"][0]) == {"epoch", "document", "offset"}, saved


def test_mu_dtype_keeps_the_first_moment_in_bf16_and_resumes_an_fp32_checkpoint(tmp_path, uninterrupted):
    """mu_dtype=bfloat16: Adam's first moment in bf16 (the second in the weights' fp32), and a checkpoint
    written with fp32 moments restores into it (cast on restore) and trains on to about the same losses."""
    cfg = load_config(TINY + ["mu_dtype=bfloat16"])
    opt = state_spec(cfg, sharding.create_mesh(cfg)).abstract["opt_state"]
    adam = next(s for s in jax.tree.leaves(opt, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu"))
    assert {a.dtype for a in jax.tree.leaves(adam.mu)} == {np.dtype("bfloat16")}
    assert {a.dtype for a in jax.tree.leaves(adam.nu)} == {np.dtype("float32")}
    source, full = uninterrupted
    records = run(tmp_path, "run_name=bf16_mu", "steps=6", "mu_dtype=bfloat16", "learning_rate_schedule_steps=6",
                  f"load_full_state_path={source}/full/checkpoints/3/items")
    assert [r["step"] for r in records] == [4, 5, 6]
    np.testing.assert_allclose(losses(records), losses(full)[3:], rtol=2e-3)
