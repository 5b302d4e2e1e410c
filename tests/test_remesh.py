"""A checkpoint written under one mesh restores under another and training goes on as if uninterrupted.

Source mesh fsdp 2 x expert 4 (8 devices); targets fsdp 8, expert 8, and fsdp 4 on 4 devices. The expert
weights must land on the right experts: a known failure of other trainers when expert parallelism changes.
"""

import shutil

import jax
import numpy as np
import pytest

from MaxText.parallel import sharding
from MaxText.trainer.checkpointing import Checkpointer
from MaxText.config.load import load_config
from MaxText.step.state import state_spec
from tests.tiny import TINY, args, train_records

NUM_EXPERTS = 8  # so that an expert axis of 8 divides it
# ragged is the dropless expert-parallel path (shard_map with an all-to-all over `expert`), the one whose
# weight layout changes with the mesh. Two MoE layers and no dense one: the dense stack costs a third of
# each compile (5 here) and its weights shard like attention's. The schedule's length is pinned: by default
# it follows `steps`, which differs between the calls.
BASE = args(TINY, [f"num_experts={NUM_EXPERTS}", "moe_impl=ragged", "base_num_decoder_layers=2",
               "first_num_dense_layers=0", "learning_rate_schedule_steps=4", "log_period=1", "checkpoint_period=2"])
SOURCE_MESH = ["ici_fsdp_parallelism=2", "ici_expert_parallelism=4", "per_device_batch_size=1"]
# Target mesh -> (its overrides, how many devices). The global batch is per_device_batch_size x devices:
# the 4-device case takes 2 per device so that every run trains on the same 8 sequences per step.
TARGETS = {
    "fsdp8": (["ici_fsdp_parallelism=8", "per_device_batch_size=1"], 8),
    "expert8": (["ici_fsdp_parallelism=1", "ici_expert_parallelism=8", "per_device_batch_size=1"], 8),
    "fsdp4_on_4_devices": (["ici_fsdp_parallelism=4", "per_device_batch_size=2"], 4),
}


def config(tmp, run_name, *overrides):
    return load_config(args(BASE, [f"base_output_directory={tmp}", f"run_name={run_name}"], overrides))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(metrics records of 4 uninterrupted steps on fsdp 2 x expert 4, directory holding run `source`:
    those steps stopped after step 2, i.e. the run's directory without checkpoint 4). The step-2 checkpoint
    of the 4-step run is the state a 2-step run saves; taking it from there saves a compile."""
    tmp = tmp_path_factory.mktemp("remesh")
    reference = train_records(config(tmp, "reference", "steps=4", *SOURCE_MESH))
    assert [r["step"] for r in reference] == [1, 2, 3, 4]
    shutil.copytree(tmp / "reference", tmp / "source")
    shutil.rmtree(tmp / "source" / "checkpoints" / "4")
    return reference, tmp


@pytest.mark.parametrize("target", TARGETS)
def test_resume_under_another_mesh_continues_with_the_same_losses(target, source, tmp_path):
    reference, tmp = source
    shutil.copytree(tmp / "source", tmp_path / target)
    overrides, num_devices = TARGETS[target]
    records = train_records(config(tmp_path, target, "steps=4", *overrides), devices=jax.devices()[:num_devices])
    assert [r["step"] for r in records] == [3, 4], f"mesh {target}: resumed steps {[r['step'] for r in records]}"
    # The same float32 maths summed in another order (another split of the batch and of the weights' D
    # axis, experts computed locally instead of after an all-to-all). Measured on XLA:CPU: at most 1 ulp
    # apart (1.1e-7). 1e-6 is ~8 ulps, room for step 3's rounding to pass through one update into step 4;
    # experts rolled by one on restore moved the losses by 3e-3 to 2e-2, only their Adam moments rolled
    # 3e-3 at step 4, an input stream restarted from batch 0 by 0.13.
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in records], [r[key] for r in reference[2:]], rtol=1e-6,
                                   err_msg=f"mesh {target}: {key} of steps 3, 4 after resuming the fsdp2 x "
                                           "expert4 checkpoint differs from the uninterrupted run's")


def _restore(tmp, mesh_overrides):
    """(mesh, state) of the source run's step-2 checkpoint restored into the shardings of another mesh."""
    cfg = config(tmp, "source", *mesh_overrides)
    mesh = sharding.create_mesh(cfg)
    checkpointer = Checkpointer(cfg, f"{tmp}/source/checkpoints")  # what auto-resume restores with
    try:
        return mesh, checkpointer.restore(2, state_spec(cfg, mesh).abstract)[0]
    finally:
        checkpointer.close()


def _expert_leaves(state) -> dict:
    """{path: array} of the routed experts' weights wi_0, wi_1, wo [layers, E, ...] and their Adam moments."""
    found = {}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path)
        if any(name.endswith(f"['moe']['{w}']") for w in ("wi_0", "wi_1", "wo")):
            found[name] = x
    assert len(found) == 9, f"expected wi_0, wi_1, wo as params, mu and nu; found {sorted(found)}"
    return found


def _check_placement(mesh, name, arrays, want_arrays):
    """On every device: the expert slice its position e on the `expert` axis owns (experts e*E/N ...
    (e+1)*E/N - 1 of E), and there the values of those experts in want_arrays; all layers, whole D and F
    when `expert` is the only axis that splits the mesh."""
    axis = mesh.axis_names.index("expert")
    per_device = NUM_EXPERTS // mesh.shape["expert"]
    only_expert = mesh.shape["expert"] == mesh.devices.size
    for path, x in arrays.items():
        want = np.asarray(want_arrays[path])
        assert len(x.addressable_shards) == mesh.devices.size, f"{name} {path}: {len(x.addressable_shards)} shards"
        for shard in x.addressable_shards:
            e = int(np.argwhere(mesh.devices == shard.device)[0][axis])
            experts = slice(e * per_device, (e + 1) * per_device)
            where = f"{name} {path}: device {shard.device.id} at expert position {e}"
            assert shard.index[1] == experts, f"{where} holds experts {shard.index[1]}, not {experts}"
            expected = want[:, experts] if only_expert else want[shard.index]
            np.testing.assert_array_equal(np.asarray(shard.data), expected, err_msg=where)


def test_expert_weights_land_on_their_experts(source):
    """The step-2 checkpoint restored under expert 8 equals its restore under the mesh that wrote it,
    leaf for leaf; on both meshes each device holds the experts its `expert` coordinate owns, weights and
    Adam moments (under expert 8: the device at position e holds exactly expert e)."""
    _, tmp = source
    mesh_a, original = _restore(tmp, SOURCE_MESH)
    mesh_b, remeshed = _restore(tmp, TARGETS["expert8"][0])

    def equal(path, a, b):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"expert8 restore of "
                                      f"{jax.tree_util.keystr(path)} differs from the fsdp2 x expert4 restore")

    jax.tree_util.tree_map_with_path(equal, original, remeshed)
    original, remeshed = _expert_leaves(original), _expert_leaves(remeshed)
    _check_placement(mesh_a, "fsdp2_expert4", original, original)
    _check_placement(mesh_b, "expert8", remeshed, original)
