"""MaxText.preflight: every GPU recipe passes; each defect the recipes had, or a user could make, fails its
row with one line naming the key and the fix; the mesh builder keeps ICI blocks inside a slice."""

import glob
import os
import re

import numpy as np
import pytest

from MaxText.planning import preflight, steptime
from MaxText.parallel import sharding
from MaxText.config.parse import CONFIG_DIR
from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config
from MaxText.config.hardware import GPU_PROFILES, simulated_devices
from tests.tiny import tiny_config

GB200 = os.path.join(CONFIG_DIR, "gpu", "deepseek3-671b-gb200-128.yml")
RECIPES = sorted(glob.glob(os.path.join(CONFIG_DIR, "gpu", "*.yml")))
# The recipes leave the corpus and the tokenizer to the user.
DATA = ["dataset_name=c4/en:3.0.1", "dataset_path=/lustre/tfds", "tokenizer_path=/lustre/deepseek-v3/tokenizer.json"]


def _rows(result, status=None):
    return {r["check"]: r for r in result["rows"] if status is None or r["status"] == status}


@pytest.mark.parametrize("recipe", [os.path.basename(r) for r in RECIPES])
def test_every_gpu_recipe_passes(recipe):
    path = os.path.join(CONFIG_DIR, "gpu", recipe)
    result = preflight.preflight([path, *DATA])
    assert result["ok"], {k: r["detail"] for k, r in _rows(result, "fail").items()}
    assert {"profile", "devices", "mesh", "xla_flags", "data", "quantization", "nccl_ep", "hbm", "pinned_pool",
            "host_memory", "lowering"} <= set(_rows(result, "pass")), _rows(result)
    lowering = _rows(result)["lowering"]["detail"]
    assert re.search(r"TE FFI calls \([^)]*te_grouped_gemm", lowering) and "up to the first TE kernel" in lowering, lowering
    # a GPU's all-gathers per step: a few hundred GiB (the layers' weights, twice); the context-parallel recipes' once
    # were 22 TB (attention's chunk loop left to the partitioner re-gathered the keys in every trip)
    gathered = float(re.search(r"all-gather ([\d.]+) GiB", lowering).group(1))
    assert gathered < 1000, lowering
    # context parallelism's load balance: the queries and outputs the module permutes, as the step-time model has them
    cfg = load_config([path])
    shape = sharding.mesh_shape(cfg, cfg.num_devices)
    layout = steptime.layout_from_config(cfg, shape, cfg.num_devices)
    model = steptime.Model.from_config(cfg, 0.0)
    tokens = layout.global_batch * layout.seq / layout.devices
    want = steptime.balance_permute_bytes(model, layout, tokens) / 2 ** 30
    permuted = re.search(r"collective-permute ([\d.]+) GiB", lowering)
    if want:
        assert permuted and abs(float(permuted.group(1)) / want - 1) < 0.25, (want, lowering)
    # Without a corpus named, only the data row fails (the benchmark recipe generates its tokens).
    if load_config([path]).dataset_type == "tfds":
        assert set(_rows(preflight.preflight([path], lower=False), "fail")) == {"data"}


@pytest.mark.parametrize("name,overrides,check,message", [
    # The recipe's first layout: EP across the two racks over DCN, 8 x 2 = 16 dcn slices, where the runtime
    # gives each NVL72 domain one slice (2).
    ("old GB200 layout", ["ici_expert_parallelism=1", "dcn_expert_parallelism=8"], "mesh",
     "dcn_*_parallelism multiply to 16 but there are 2 slices"),
    # A check of the config against its mesh (parallel/checks.py), said once, in the mesh row.
    ("NCCL EP buffer below 1", ["ragged_buffer_factor=0.5"], "mesh", "which NCCL EP's receive buffer does not take"),
    ("batch over the data shards", ["per_device_batch_size=0.5"], "mesh", "does not split over the 128 data shards"),
    ("offload over the pool", ["host_memory_limit_gb=64"], "pinned_pool", "set host_memory_limit_gb=88"),
    ("XLA's default pool", ["host_memory_limit_gb=null"], "pinned_pool", "(XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB)"),
    ("pool over host memory", ["host_memory_limit_gb=250"], "host_memory", "lower host_memory_limit_gb"),
    ("renamed XLA flag", ["xla_flags=--xla_gpu_enable_nccl_symmetric_buffers=true"], "xla_flags",
     "--xla_gpu_enable_nccl_symmetric_buffers"),
    ("mxfp8 on Hopper", ["gpu_profile=h100-sxm", "te_gmm_quantization=mxfp8"], "quantization",
     "te_gmm_quantization=mxfp8 needs a Blackwell GPU"),
    ("mxfp8 dense GEMMs on Hopper", ["gpu_profile=h100-sxm", "te_gmm_quantization=fp8_current",
                                     "quantization=te_mxfp8"], "quantization",
     "quantization=te_mxfp8 needs a Blackwell GPU"),
    ("nvfp4 dense GEMMs on Hopper", ["gpu_profile=h100-sxm", "te_gmm_quantization=fp8_current",
                                     "quantization=te_nvfp4"], "quantization",
     "quantization=te_nvfp4 needs a Blackwell GPU"),
    ("partial hosts", ["num_devices=126"], "devices", "use a multiple of 4"),
    ("no profile", ["gpu_profile=null"], "profile", "set gpu_profile"),
])
def test_a_defect_fails_its_row_with_one_line(name, overrides, check, message):
    result = preflight.preflight([GB200, *DATA, *overrides], lower=False)
    failed = _rows(result, "fail")
    assert not result["ok"] and check in failed, f"{name}: {failed}"
    detail = failed[check]["detail"]
    assert message in detail and "\n" not in detail, f"{name}: {detail!r}"
    assert sum(message in r["detail"] for r in result["rows"]) == 1, f"{name}: said more than once: {failed}"


def test_wrong_tasks_per_node_fails():
    result = preflight.preflight([GB200, *DATA], tasks_per_node=8, lower=False)
    assert "--ntasks-per-node=4" in _rows(result, "fail")["devices"]["detail"]
    assert preflight.preflight([GB200, *DATA], tasks_per_node=4, lower=False)["ok"]


def test_cli_exit_codes_and_table(capsys):
    """The command line around preflight() (whose full-scale lowering test_every_gpu_recipe_passes runs)."""
    assert preflight.main([GB200, *DATA, "--no-lowering"]) == 0
    out = capsys.readouterr().out
    assert "ready to launch" in out and "mesh" in out and "lowering" in out
    assert preflight.main([GB200, *DATA, "host_memory_limit_gb=64", "ici_expert_parallelism=1",
                           "dcn_expert_parallelism=8"]) == 1  # two failing rows; the lowering then waits
    out = capsys.readouterr().out
    assert "2 check(s) fail" in out and "not run: fix the mesh" in out, out
    assert preflight.main([GB200, *DATA, "--no-lowering", "--tasks-per-node", "4"]) == 0
    out = capsys.readouterr().out
    assert "lowering      todo  not run (--no-lowering)" in out and "(todo rows not checked)" in out, out
    assert preflight.main([GB200, "gpu_profile=dgx-a100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: gpu_profile=dgx-a100") and err.count("\n") == 1


# ------------------------------------------------------------------------------------------- the mesh builder


def test_ici_blocks_stay_inside_a_slice_whatever_the_rank_order():
    """Two 8-GPU hosts whose processes a scheduler numbered round-robin (rank r on host r % 2): ordered by
    (slice, process, id), each ICI block (one fsdp group of 8) is one host; ordered by process alone it
    would mix hosts."""
    profile = GPU_PROFILES["h100-sxm"]
    devices = simulated_devices(profile, 16, hosts_order=[r % 2 for r in range(16)])
    cfg = tiny_config("num_experts=8", "ici_fsdp_parallelism=8", "dcn_fsdp_parallelism=2")
    grid = sharding.device_grid(cfg, devices)  # [data, fsdp, expert, tensor]
    fsdp = grid.reshape(16)
    for block in (fsdp[:8], fsdp[8:]):
        assert len({d.host for d in block}) == 1, [d.host for d in block]
    assert {d.process_index % 2 for d in fsdp[:8]} == {0}, "host 0 holds the even ranks"


def test_gb200_slices_are_nvlink_domains():
    """128 GB200 GPUs = 32 trays of 4, 16 in each of 2 NVL72 racks: 2 slices of 64; the fixed recipe's ICI
    fsdp 16 x expert 4 fills one, and EP (the inner part of the mesh) never leaves a rack."""
    cfg = load_config([GB200])
    devices = simulated_devices(GPU_PROFILES["gb200-nvl72"], 128)
    assert len({d.slice_index for d in devices}) == 2 and len({d.host for d in devices}) == 32
    grid = sharding.device_grid(cfg, devices)
    assert grid.shape == (1, 32, 1, 4, 1)  # data, fsdp, context, expert, tensor
    for fsdp in range(32):
        assert len({d.slice_index for d in grid[0, fsdp, 0, :, 0]}) == 1, f"expert group {fsdp} crosses racks"


def test_uneven_slices_are_refused():
    devices = simulated_devices(GPU_PROFILES["h100-sxm"], 16)[:12]  # 8 GPUs of host 0, 4 of host 1
    with pytest.raises(ConfigError, match="unequal sizes"):
        sharding.device_grid(tiny_config("num_experts=8"), devices)
    assert isinstance(sharding.device_grid(tiny_config("num_experts=8"), devices[:8]), np.ndarray)


def test_the_pool_reaches_xla_before_it_starts():
    """host_memory_limit_gb becomes XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (apply_xla_flags runs before JAX starts)."""
    from MaxText.config.load import apply_xla_flags

    environ = {}
    apply_xla_flags(load_config([GB200]), environ)
    assert environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] == "132" and "--xla_gpu_enable_command_buffer" in \
        environ["XLA_FLAGS"]
    environ = {"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "64"}
    apply_xla_flags(tiny_config(), environ)
    assert environ == {"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "64"}, "unset: the environment's (or XLA's) stays"


def test_a_recipe_without_a_corpus_stops_at_start_up_in_one_line(tmp_path):
    """The recipes name no dataset: the trainer's fail-fast data check says which keys to set."""
    from MaxText.data import validate

    with pytest.raises(ConfigError, match="dataset_name is not set") as raised:
        validate(load_config([GB200]))
    assert "\n" not in str(raised.value)
    # A corpus but no tokenizer: DeepSeek-V3's 129280 ids would be trained on 259 byte ids.
    with pytest.raises(ConfigError, match="tokenizer_path is not set.*vocab_size=129280") as raised:
        validate(load_config([GB200, *DATA[:2]]))
    assert "\n" not in str(raised.value)
    rows = {r.check: r for r in preflight.check_data(load_config([GB200, *DATA[:2]]))}
    assert rows["data"].status == "fail" and "tokenizer_path" in rows["data"].detail


def test_a_step_that_does_not_lower_fails_the_lowering_row():
    """The lowering process's own error becomes the row (here: a config it cannot load)."""
    rows = preflight.check_lowering([GB200, *DATA, "no_such_key=1"])
    assert rows[0].status == "fail" and "no_such_key" in rows[0].detail, rows


def test_a_retired_xla_flag_passes_with_its_successor_named():
    """The recipes' first flags (--xla_gpu_enable_pipelined_*) still start jaxlib 0.12 but are retired aliases."""
    rows = preflight.check_xla_flags(load_config([GB200, "xla_flags=--xla_gpu_enable_pipelined_all_gather=true"]))
    assert rows[0].status == "pass" and "retired alias of --xla_gpu_pipeline_all_gather" in rows[0].detail, rows


@pytest.mark.parametrize("recipe", ["deepseek3-671b-gb200-128.yml", "deepseek3-671b-h100-256.yml"])
def test_pre_training_recipes_train_as_deepseek_v3_did(recipe):
    """DeepSeek-V3's published pre-training: plain RoPE at 4K (YaRN came later), AdamW with bf16 first moment,
    clip 1.0, 2000 warmup steps to 2.2e-4, held, cosine to 2.2e-5 over the last 29%; checkpoints and
    evaluations in the thousands of steps. The recipes' first versions had YaRN at 4K and a 3e-3 peak."""
    from MaxText.step.optimizers import learning_rate_schedule

    cfg = load_config([os.path.join(CONFIG_DIR, "gpu", recipe)])
    assert cfg.rope_type == "default" and cfg.max_target_length == 4096
    assert (cfg.mu_dtype, cfg.gradient_clipping_threshold, cfg.adam_b2) == ("bfloat16", 1.0, 0.95)
    schedule, total = learning_rate_schedule(cfg), cfg.learning_rate_schedule_steps
    assert float(schedule(1000)) == pytest.approx(1.1e-4, rel=0.01)  # halfway up the 2000-step warmup
    assert float(schedule(2000)) == pytest.approx(2.2e-4, rel=2e-3)  # warmup_steps_fraction rounds to ~2000 steps
    assert float(schedule(int(0.7 * total))) == pytest.approx(2.2e-4)
    assert float(schedule(total)) == pytest.approx(2.2e-5)
    assert cfg.checkpoint_period >= 1000 and cfg.eval_interval >= 1000


@pytest.mark.parametrize("recipe,context", [("deepseek3-671b-16k-gb200-128.yml", 1),
                                            ("deepseek3-671b-32k-gb200-128.yml", 2),
                                            ("deepseek3-671b-128k-gb200-128.yml", 8)])
def test_the_context_extension_recipes_apply_yarn_beyond_4k(recipe, context):
    """DeepSeek-V3's extension phases (tech report 4.3): YaRN over the 4K original length, a constant 7.3e-6, and
    as many tokens as each of its phases read (1920 x 32K x 1000 = 480 x 128K x 1000 = 63B); 32K and 128K with each
    sequence split over a rack's GPUs."""
    from MaxText.step.optimizers import learning_rate_schedule

    cfg = load_config([os.path.join(CONFIG_DIR, "gpu", recipe)])
    assert cfg.rope_type == "yarn" and cfg.max_target_length > cfg.original_max_position_embeddings == 4096
    assert (cfg.rope_factor, cfg.beta_fast, cfg.beta_slow) == (40, 32, 1)
    schedule = learning_rate_schedule(cfg)
    assert [float(schedule(s)) for s in (0, cfg.steps // 2, cfg.steps - 1)] == pytest.approx([7.3e-6] * 3)  # constant
    mesh = sharding.mesh_shape(cfg, cfg.num_devices)
    assert mesh["context"] == context and cfg.learning_rate_schedule_steps == cfg.steps
    tokens = cfg.per_device_batch_size * cfg.num_devices * cfg.max_target_length * cfg.steps
    assert tokens == pytest.approx(1920 * 32768 * 1000, rel=1e-6)


def test_the_slurm_job_runs_the_preflight_first(tmp_path):
    """scripts/slurm.sbatch: one preflight task (CPU, the job's tasks per node, no lowering) before the trainer's
    srun; a failing preflight ends the job before any GPU starts; PREFLIGHT=0 skips it. srun is faked."""
    import subprocess

    log = tmp_path / "srun.log"
    fake = tmp_path / "srun"
    fake.write_text('#!/usr/bin/env bash\necho "$*" >> "$SRUN_LOG"\n'
                    'if [[ "$*" == *LAUNCH_MODULE=MaxText.preflight* ]]; then exit "${PREFLIGHT_RC:-0}"; fi\n')
    fake.chmod(0o755)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def job(**env):
        log.write_text("")
        environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "PREFLIGHT"}
        environ.update(PATH=f"{tmp_path}:{os.environ['PATH']}", SRUN_LOG=str(log), SLURM_NTASKS_PER_NODE="4(x32)",
                       **env)
        done = subprocess.run(["bash", "scripts/slurm.sbatch", GB200, "run_name=x"], cwd=root, env=environ,
                              capture_output=True, text=True)
        return done.returncode, log.read_text().splitlines()

    rc, calls = job()
    assert rc == 0 and len(calls) == 2, calls
    assert "--ntasks=1" in calls[0] and "JAX_PLATFORMS=cpu" in calls[0], calls[0]
    assert calls[0].endswith(f"{GB200} run_name=x --tasks-per-node 4 --no-lowering"), calls[0]
    assert "--kill-on-bad-exit=1" in calls[1] and calls[1].endswith(f"{GB200} run_name=x"), calls[1]
    rc, calls = job(PREFLIGHT_RC="1")
    assert rc == 1 and len(calls) == 1, calls
    rc, calls = job(PREFLIGHT="0")
    assert rc == 0 and len(calls) == 1 and "--kill-on-bad-exit=1" in calls[0], calls


def _lowered(*argv) -> dict:
    """MaxText.lowering's JSON for the arguments, in its own process (as the preflight runs it)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    done = subprocess.run([sys.executable, "-m", "MaxText.lowering", *argv], capture_output=True, text=True,
                          timeout=600, env=env, cwd=os.path.dirname(CONFIG_DIR))
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("block", [False, True], ids=["composed", "te_moe_block"])
def test_the_full_scale_lowering_holds_tes_ops_in_the_expected_counts(block):
    """NVIDIA's GB200 recipe lowered at full scale without remat (nothing recomputed), counted by name: DeepSeek-V3's
    three layer bodies (the dense layers, the MoE layers, the MTP depth; scanned, each traced once) hold MLA's five
    projections and a SwiGLU's three GEMMs (the dense MLP or the shared expert), 24 dense GEMMs through TE in FP8,
    each run forward, for the data gradient and for the weight gradient; the two MoE bodies' routed experts run
    three grouped GEMMs each way (composed) or TE's block's fused pair (two forward, four backward), and one NCCL
    EP prepare, dispatch, combine and each backward; the router's forward once more beside TE's block."""
    recipe = os.path.join(CONFIG_DIR, "gpu", "deepseek3-671b-nvidia-gb200-128.yml")
    result = _lowered(recipe, "remat_policy=none", *(["te_moe_block=true"] if block else []))
    assert result["ok"], result
    ops = result["te_ops"]
    bodies, moe_bodies = 3, 2
    assert ops["te_gemm_v2"] == 3 * bodies * (5 + 3), ops
    assert ops["te_grouped_gemm"] == moe_bodies * (6 if block else 9), ops
    for op in ("te_ep_prepare", "te_ep_dispatch", "te_ep_combine", "te_ep_dispatch_bwd", "te_ep_combine_bwd",
               "te_fused_topk_with_score_function_backward"):
        assert ops[op] == moe_bodies, (op, ops)
    assert ops["te_fused_topk_with_score_function_forward"] == moe_bodies * (2 if block else 1), ops
    if not block:  # quantization=none: no dense GEMM through TE, the routed experts' as they were
        bf16 = _lowered(recipe, "remat_policy=none", "quantization=none")["te_ops"]
        assert "te_gemm_v2" not in bf16 and bf16["te_grouped_gemm"] == ops["te_grouped_gemm"], bf16


def test_the_full_scale_nvfp4_lowering_holds_tes_quantizes_in_the_expected_counts():
    """quantization=te_nvfp4 on NVIDIA's GB200 recipe at full scale: the same 72 dense GEMMs through TE, each of the
    24 quantizing its input, weight and output gradient (72 quantizes), and the Hadamard transform's amax for the
    weight gradient's two operands of every GEMM whose widths are multiples of 128: 7 of each body's 8 (MLA's
    key-value down-projection, 7168 -> 576, runs without it, as the run's first lines say). With float32 master
    weights (the training recipes'), TE's dense weights are gathered in bf16: handed the cast weight, XLA's
    partitioner gathered the float32 one (58 of 268 GiB of all-gathers a GPU a step here); each is cast on its
    shards first now (linear._cast_and_gather). TE psums each dense weight's gradient whole; only our slice of it
    follows (a reduce-scatter on GPU): a second sharding constraint on the gathered weight had kept the all-reduce's
    whole result alive (28.7 GiB of bf16 all-reduces a GPU a step here)."""
    from MaxText.config import checks
    from MaxText.config.load import load_config

    recipe = os.path.join(CONFIG_DIR, "gpu", "deepseek3-671b-nvidia-gb200-128.yml")
    result = _lowered(recipe, "remat_policy=none", "quantization=te_nvfp4", "weight_dtype=float32")
    assert result["ok"], result
    gathers = result["collectives"]["per_device_per_step"]["all-gather"]
    assert gathers["dtypes"].get("f32", 0) < 0.01 * gathers["bytes"], gathers
    reduced = result["collectives"]["per_device_per_step"]
    assert reduced.get("all-reduce", {}).get("bytes", 0) < 0.01 * reduced["reduce-scatter"]["bytes"], reduced
    ops, bodies = result["te_ops"], 3
    assert checks.nvfp4_without_rht(load_config([recipe, "quantization=te_nvfp4"])) == [
        "MLA's key-value down-projection"]
    assert ops["te_gemm_v2"] == 3 * bodies * 8 and ops["te_dbias_quantize"] == 3 * bodies * 8, ops
    assert ops["te_rht_amax"] == 2 * bodies * 7, ops
