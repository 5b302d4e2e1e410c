"""Every user mistake is one line: `python -m MaxText.train` exits 2 with a single `error:` line on stderr and no
traceback, for a table of bad inputs and misuses (run in-process through MaxText.train.main, the command's
own entry point; the ones that need a run get the tiny synthetic model)."""

import os

import pytest

from MaxText import train
from tests.tiny import TINY, args

QWEN_4K = ["model_name=qwen3-30b-a3b", "max_target_length=4096"]

# (label, argv, a phrase the error line must contain)
MISTAKES = [
    ("unknown key", ["stepz=10"], "unknown key 'stepz'"),
    ("zero steps", ["steps=0"], "steps=0 must be at least 1"),
    ("negative steps", ["steps=-5"], "steps=-5 must be at least 1"),
    ("a word for an int", ["steps=ten"], "steps='ten'"),
    ("hex int", ["steps=0x10"], "steps='0x10'"),
    ("base-60 int", ["steps=1:30"], "steps='1:30'"),
    ("float for an int", ["steps=2.5"], "steps='2.5'"),
    ("infinite learning rate", ["learning_rate=inf"], "learning_rate=inf must be a finite number"),
    ("nan learning rate", ["learning_rate=nan"], "must be a finite number"),
    ("negative learning rate", ["learning_rate=-1"], "learning_rate=-1.0 must be between 0 and 10"),
    ("beta1 of 1", ["adam_b1=1.0"], "adam_b1=1.0 must be in [0, 1)"),
    ("negative beta2", ["adam_b2=-0.1"], "adam_b2=-0.1 must be in [0, 1)"),
    ("zero epsilon", ["adam_eps=0"], "adam_eps=0.0 must be in (0, 1]"),
    ("negative seed", ["init_weights_seed=-1"], "init_weights_seed=-1 must be in [0, 2**32)"),
    ("huge seed", ["data_shuffle_seed=99999999999"], "data_shuffle_seed=99999999999 must be in"),
    ("absurd batch", ["per_device_batch_size=1e9"], "per_device_batch_size=1000000000.0 is absurd"),
    ("infinite batch", ["per_device_batch_size=inf"], "must be a finite number"),
    ("zero batch", ["per_device_batch_size=0"], "per_device_batch_size=0.0 must be greater than 0"),
    ("unknown impl", ["moe_impl=bogus"], "moe_impl=bogus is not one of"),
    ("unknown dtype", ["dtype=float8"], "dtype=float8 is not one of"),
    ("unknown remat policy", ["remat_policy=some"], "remat_policy=some is not one of"),
    ("run_name escaping", ["run_name=../x"], "run_name=../x must be a plain name"),
    ("run_name with a slash", ["run_name=a/b"], "must be a plain name"),
    ("unknown model", ["model_name=gpt5"], "model_name=gpt5: no file"),
    ("model_name escaping", ["model_name=../../x"], "is not a name under configs/models/"),
    ("missing model file", ["model_name=/nope/model.yml"], "no such file"),
    ("top-k over the experts", ["num_experts_per_tok=99"], "num_experts_per_tok=99 must not exceed num_experts"),
    ("two absorbing axes", ["ici_fsdp_parallelism=-1", "ici_expert_parallelism=-1"], "may be -1"),
    ("missing config file", ["configs/nope.yml"], "configs/nope.yml"),
    ("not key=value", ["steps"], "is not key=value"),
    ("a key twice", ["steps=5", "steps=6"], "steps is given twice"),
    ("yes for a bool", ["enable_checkpointing=yes"], "enable_checkpointing='yes'"),
    ("two checkpoint sources", ["load_parameters_path=/a", "load_full_state_path=/b"], "set only one of"),
    ("warmup over the schedule", ["warmup_steps_fraction=2"], "warmup_steps_fraction=2.0 must be between 0 and 1"),
    ("negative rank", ["kv_lora_rank=-1"], "kv_lora_rank=-1 must not be negative"),
    ("negative MTP depth", ["mtp_num_layers=-1"], "mtp_num_layers=-1 must not be negative"),
    ("zero capacity", ["capacity_factor=0"], "capacity_factor=0.0 must be greater than 0"),
    ("MXFP8 off TE", ["te_gmm_quantization=mxfp8"], "applies to moe_impl=te_dropless only"),
    ("FP8 dense GEMMs without a GPU", ["quantization=te_fp8_currentscaling"],
     "quantization=te_fp8_currentscaling needs an NVIDIA GPU and this machine has none"),
    ("MXFP8 on a width off its blocks", ["model_name=deepseek3-tiny", "quantization=te_mxfp8"],
     "MLA's key-value down-projection is 64 -> 24 wide and MXFP8 scales blocks of 32"),
    ("NVFP4 tokens off 64", ["model_name=deepseek3-tiny", "override_model_config=true", "quantization=te_nvfp4",
                            "q_lora_rank=64", "kv_lora_rank=64",
                            "qk_nope_head_dim=32", "qk_rope_head_dim=32", "v_head_dim=32", "max_target_length=32"],
     "TE's NVFP4 copies block the tokens by 16 in scale tiles of 4 blocks"),
    ("delayed FP8 scaling", ["quantization=te_fp8_delayedscaling"], "delayed scaling keeps an amax history"),
    ("bias with softmax", ["routed_bias=true"], "routed_bias=true needs routed_score_func=sigmoid"),
    ("TE's block on reference kernels", ["te_moe_block=true", "te_kernels=reference"], "has no pure-JAX stand-in"),
    ("FP8 in TE's block", ["te_moe_block=true", "te_gmm_quantization=fp8_current"], "in BF16 or MXFP8 only"),
    ("MXFP8 in TE's block off 128", ["te_moe_block=true", "te_gmm_quantization=mxfp8", "base_emb_dim=96"],
     "needs base_emb_dim and base_moe_mlp_dim to be multiples of 128"),
    ("weights TE's block does not compute", ["te_moe_block=true", "routed_score_func=sigmoid", "norm_topk_prob=false"],
     "TE's fused router weighs the chosen experts otherwise"),
    ("half of group routing", ["n_routing_groups=2"], "set both n_routing_groups and topk_routing_group"),
    ("quadratic dense masks", [*QWEN_4K, "moe_impl=dense"], "8.0 GiB per sequence"),
    ("unknown GPU profile", ["gpu_profile=dgx-a100"], "gpu_profile=dgx-a100 is not one of"),
    ("unknown XLA flag", ["xla_flags=--xla_gpu_made_up_flag=1"], "xla_flags: unknown XLA flag --xla_gpu_made_up_flag"),
    ("renamed XLA flag", ["xla_flags=--xla_gpu_enable_nccl_symmetric_buffers=true"],
     "did you mean --xla_gpu_experimental_enable_nccl_symmetric_buffers"),
    ("TE kernels without a GPU", args(TINY, ["moe_impl=te_dropless"]), "needs an NVIDIA GPU"),
    ("TE's block without a GPU", args(TINY, ["te_moe_block=true"]),
     "te_moe_block=true (TE's fused MoE block) needs an NVIDIA GPU"),
    ("no corpus named", args(TINY, ["dataset_type=tfds", "dataset_name=null"]), "dataset_name is not set"),
    ("missing tokenizer file", args(TINY, ["dataset_type=tfds", "tokenizer_path=/nope/tokenizer.json"]),
     "tokenizer_path=/nope/tokenizer.json does not exist"),
    ("a very long bad value", ["run_name=" + "y" * 5000], "must be a plain name"),
    ("output directory under a file", args(TINY, ["base_output_directory=README.md"]), "cannot use run directory"),
    ("checkpoint directory is a file", args(TINY, ["run_name=ckfile"]), "cannot write checkpoints to"),
    ("parameters from a non-checkpoint", args(TINY, ["load_parameters_path=configs"]), "is not an Orbax checkpoint"),
    ("full state from nowhere", args(TINY, ["load_full_state_path=/nope/items"]), "/nope/items does not exist"),
    ("a GPU asked for on a CPU machine", args(TINY, ["hardware=gpu"]), "hardware=gpu but JAX found no GPU"),
    ("too big for the device", args(TINY, ["hbm_gib=0.0001"]), "GiB per device (params, gradients and optimizer"),
    # Suggestions that help: case and '-' do not matter; nothing far from the input is suggested (see below).
    ("all-capitals key", ["PER_DEVICE_BATCH_SIZE=2"], "unknown key 'PER_DEVICE_BATCH_SIZE' (on the command line); "
     "did you mean 'per_device_batch_size'?"),
    ("dashes for underscores", ["per-device-batch-size=2"], "did you mean 'per_device_batch_size'?"),
    # An empty value is what a job script writes for an unset variable: never the key's default in silence.
    ("empty run_name", ["run_name="], "run_name= is empty on the command line"),
    ("empty path", ["load_parameters_path="], "load_parameters_path= is empty on the command line"),
    ("empty int", ["steps="], "steps= is empty on the command line"),
    # Both bounds: integers fit int32, ranges that make sense.
    ("steps beyond int32", ["steps=1000000000000"], "steps=1000000000000 is out of range: at most 2**31 - 1"),
    ("period beyond int32", ["checkpoint_period=2147483648"], "checkpoint_period=2147483648 is out of range"),
    ("timeout beyond int32", ["checkpoint_timeout_s=99999999999"], "checkpoint_timeout_s=99999999999 is out of"),
    ("vocabulary beyond int32", ["vocab_size=3000000000"], "vocab_size=3000000000 is out of range"),
    ("absurd learning rate", ["learning_rate=100"], "learning_rate=100.0 must be between 0 and 10"),
    ("final fraction over 1", ["cosine_learning_rate_final_fraction=2"], "must be between 0 and 1"),
    ("negative worker count", ["grain_worker_count=-1"], "grain_worker_count=-1 must be between 0 and 1024"),
    ("zero YaRN factor", ["rope_factor=0"], "rope_factor=0.0 must be at least 1e-06"),
    ("empty pinned pool", ["host_memory_limit_gb=0"], "host_memory_limit_gb=0 must be between 1 and"),
    ("epsilon over 1", ["adam_eps=2"], "adam_eps=2.0 must be in (0, 1]"),
    ("MLA without a KV rank", ["attention_type=mla", "kv_lora_rank=0"],
     "kv_lora_rank=0 must be at least 1 under attention_type=mla"),
    ("missing dataset path", args(TINY, ["dataset_type=tfds", "dataset_name=c4/en:3.0.1", "dataset_path=/nope",
                                         "vocab_size=512"]), "dataset_name=c4/en:3.0.1 in dataset_path /nope: Failed to construct"),
]


@pytest.mark.parametrize("label,argv,phrase", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistake_is_one_line_and_exit_2(label, argv, phrase, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # apply_xla_flags may edit it
    (tmp_path / "ckfile").mkdir()
    (tmp_path / "ckfile" / "checkpoints").write_text("not a directory")
    if not any(a.startswith("base_output_directory=") for a in argv):
        argv = [*argv, f"base_output_directory={tmp_path}"]
    code = train.main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert code == 2, (label, code, err[-1000:])
    assert len(errors) == 1 and "Traceback" not in err, (label, err[-1000:])
    assert phrase in errors[0], (label, errors[0])
    assert len(errors[0]) < 500, (label, len(errors[0]))


def test_the_table_is_big_enough():
    assert len(MISTAKES) >= 70


def test_a_key_far_from_every_known_one_gets_no_suggestion(capsys):
    assert train.main(["zzzzqqq=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: unknown key 'zzzzqqq' (on the command line)", err


def _alias_bomb(path):
    """A YAML file of a few hundred bytes whose one value expands to 9**6 strings."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 6)]
    path.write_text("steps: {" + ", ".join(lines) + "}\n")


# (label, writes the bad file at the path, argv given that path, phrase of the error line)
BAD_FILES = [
    ("config not UTF-8", lambda p: p.write_bytes(b"steps: 3\nrun_name: caf\xe9\n"), lambda p: [str(p)],
     "is not UTF-8 text: byte 22 is 0xe9; save it as UTF-8"),
    ("YAML alias bomb", _alias_bomb, lambda p: [str(p)], "characters) (in "),
    ("tokenizer.json that is not one", lambda p: p.write_text("not a tokenizer"),
     lambda p: args(TINY, ["dataset_type=tfds", f"tokenizer_path={p}"]), "is not a Hugging Face tokenizer file"),
    ("SentencePiece model that is not one", lambda p: p.write_bytes(b"\x00garbage"),
     lambda p: args(TINY, ["dataset_type=tfds", f"tokenizer_path={p}"]), "is not a SentencePiece tokenizer file"),
]


@pytest.mark.parametrize("label,write,argv,phrase", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_a_bad_file_is_one_line_at_start_up(label, write, argv, phrase, capsys, tmp_path, monkeypatch):
    """Files a run reads are opened and checked at start-up: a config file in another encoding used to be a
    UnicodeDecodeError, a tokenizer file that is not one the tokenizers library's own exception, and an alias
    bomb's error line 39 MB long."""
    suffix = {"tokenizer.json that is not one": ".json", "SentencePiece model that is not one": ".model"}
    path = tmp_path / f"bad{suffix.get(label, '.yml')}"
    write(path)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    code = train.main([*argv(path), f"base_output_directory={tmp_path}"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, (label, err[-1000:])
    assert phrase in errors[0] and str(path) in errors[0] and len(errors[0]) < 500, (label, errors[0][:1000])


@pytest.mark.parametrize("arg", ["base_output_directory=s3://bucket/runs", "base_output_directory=http://host/runs",
                                 "load_full_state_path=s3://b/run/checkpoints/5/items", "dataset_path=gs://b/tfds",
                                 "tokenizer_path=gs://b/tokenizer.model"])
def test_a_remote_url_is_refused_in_one_line_and_no_local_folder_appears(tmp_path, arg):
    """A URL that cannot be used is refused at start-up before anything is created: s3:// (Orbax writes buckets
    through gs:// only), other schemes, and any URL for the input pipeline (local files only). The trainer used to
    make a local folder named 'gs:' and fail at its first save; gs:// outputs work (tests/test_remote_storage.py)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-m", "MaxText.train", os.path.join(root, "configs", "base.yml"), arg],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=root))
    key = arg.split("=")[0]
    assert result.returncode == 2 and result.stderr.startswith(f"error: {key}="), result
    assert "mount the bucket" in result.stderr, result.stderr
    assert result.stderr.strip().count("\n") == 0 and os.listdir(tmp_path) == [], (result.stderr, os.listdir(tmp_path))
