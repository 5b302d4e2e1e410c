"""`python -m MaxText.decode`: the KV cache (GQA's keys and values, MLA's compressed latent) gives the logits and the
greedy tokens of recomputing the whole sequence at every step; sharded like training; upstream's sampling
strategies; a model trained on a repetitive corpus continues it; the command's one-line errors."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from MaxText.config.load import load_config
from MaxText.layers.models import Transformer, init_cache
from MaxText.trainer import decode
from tests.tiny import TINY, args

MODELS = {  # name -> overrides of configs/base.yml: each attention and layer-stack kind
    "GQA, MoE, scanned": [*TINY, "moe_impl=ragged"],
    "GQA with qk_norm, unrolled": [*TINY, "qk_norm=true", "scan_layers=false", "num_experts=1",
                                   "num_experts_per_tok=1"],
    "MLA (deepseek3-tiny), YaRN, MoE with bias and groups": ["model_name=deepseek3-tiny", "dtype=float32",
                                                               "moe_impl=ragged", "max_target_length=32"],
}


def _config(name, *extra):
    return load_config(["configs/base.yml", *args(MODELS[name], ["weight_dtype=float32", *extra])])


def _greedy_uncached(model, prompt_BL, steps):
    """Each next token the argmax of the whole sequence's forward pass (no cache), and those logits."""
    tokens, logits = prompt_BL, []
    for _ in range(steps):
        out, _ = model(tokens)
        logits.append(out[:, -1])
        tokens = jnp.concatenate([tokens, jnp.argmax(out[:, -1], axis=-1)[:, None].astype(jnp.int32)], axis=1)
    return np.asarray(tokens[:, prompt_BL.shape[1]:]), np.stack(logits, axis=1)


def _fresh_model(cfg):
    """The model with the params the generator starts from without load_parameters_path (create_state's init)."""
    from MaxText.parallel import sharding
    from MaxText.step.state import create_state, state_spec

    mesh = sharding.create_mesh(cfg, jax.devices()[:1])
    spec = state_spec(cfg, mesh)
    state = create_state(cfg, mesh, spec)
    return nnx.merge(spec.graphdef, state["params"], *([state["nnx_aux"]] if "nnx_aux" in state else []))


@pytest.mark.parametrize("name", MODELS)
def test_cached_decoding_equals_recomputing_the_sequence(name):
    """Prefill then one token at a time through the cache: every step's logits within float32 rounding of the
    uncached forward pass over the whole sequence so far, and the same greedy tokens, token for token."""
    cfg = _config(name)
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    prompt = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, size=(2, 5)), jnp.int32)
    steps = 6
    want_tokens, want_logits = _greedy_uncached(model, prompt, steps)
    cache = init_cache(cfg, 2, 5 + steps)
    logits, cache = model.decode(prompt, 0, cache)
    got_tokens, got_logits = [], []
    for t in range(steps):
        got_logits.append(logits[:, -1])
        got_tokens.append(jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32))
        logits, cache = model.decode(got_tokens[-1][:, None], 5 + t, cache)
    np.testing.assert_array_equal(np.stack(got_tokens, axis=1), want_tokens, err_msg=name)
    np.testing.assert_allclose(np.stack(got_logits, axis=1), want_logits, rtol=0,
                               atol=1e-5 * np.abs(want_logits).max(), err_msg=name)
    assert len(set(want_tokens[0].tolist())) > 1, "a constant continuation proves little: pick another seed"


def test_the_generator_shards_like_training_and_decodes_what_one_device_does():
    """MaxText.decode's generator on fsdp 2 x expert 4 (the params and the rows sharded as in training; 3 rows
    padded to the batch shards and dropped again) gives one device's greedy tokens, which are the uncached
    model's."""
    name = "MLA (deepseek3-tiny), YaRN, MoE with bias and groups"
    prompts = np.random.default_rng(1).integers(3, 500, size=(3, 6)).astype(np.int32)
    extra = ["max_prefill_predict_length=6", "max_target_length=12"]  # 7 new tokens
    one = decode.generator(_config(name, *extra), log=lambda *_: None)(prompts)
    eight = decode.generator(_config(name, *extra, "ici_fsdp_parallelism=2", "ici_expert_parallelism=4"),
                             log=lambda *_: None)(prompts)
    assert one.shape == (3, 7)
    np.testing.assert_array_equal(eight, one)
    want, _ = _greedy_uncached(_fresh_model(_config(name, *extra)), jnp.asarray(prompts), 7)
    np.testing.assert_array_equal(one, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoding_on_a_gpu_gives_the_uncached_greedy_tokens(dtype):
    """On the GPU (scripts/gpu_check.sh's kernel part): MLA's and GQA's caches against recomputing the sequence,
    float32 token for token; bfloat16 (the training dtype) at least 5 of the first 6 tokens alike (bf16 rounding
    may flip a near tie, after which the two continuations part)."""
    for name in ("MLA (deepseek3-tiny), YaRN, MoE with bias and groups", "GQA, MoE, scanned"):
        cfg = _config(name, f"dtype={dtype}", "max_prefill_predict_length=5", "max_target_length=10")
        got = decode.generator(cfg, log=lambda *_: None)(np.arange(3, 13, dtype=np.int32).reshape(2, 5))
        want, _ = _greedy_uncached(_fresh_model(cfg), jnp.arange(3, 13, dtype=jnp.int32).reshape(2, 5), 6)
        if dtype == "float32":
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            assert (got[:, 0] == want[:, 0]).all() and (got == want).mean() >= 5 / 6, (name, got, want)


def test_decode_runs_training_recipes_as_decoding_needs():
    """NVIDIA's GB200 recipe (te_dropless on NCCL EP with bounded buffers, MXFP8 grouped GEMMs; MXFP8 dense GEMMs
    added) decodes on the pure-JAX dropless path with worst-case buffers and bf16 GEMMs, and the console says so;
    everything else (the routing, the weights, the mesh) is the recipe's."""
    lines = []
    recipe = load_config(["configs/gpu/deepseek3-671b-nvidia-gb200-128.yml", "quantization=te_mxfp8"])
    cfg = decode.decode_config(recipe, log=lines.append)
    assert (cfg.moe_impl, cfg.quantization, cfg.ragged_buffer_factor, cfg.use_batch_split_schedule) == (
        "ragged", "none", None, False)
    changed = {k for k in recipe if recipe[k] != cfg[k]}
    assert changed == {"moe_impl", "quantization", "ragged_buffer_factor", "te_gmm_quantization"}, changed
    assert len(lines) == 2 and "quantization=te_mxfp8 is a training precision" in lines[0], lines


# ------------------------------------------------------------------------------------------- sampling


def _sampling(strategy, **keys):
    return load_config(["configs/base.yml", f"decode_sampling_strategy={strategy}",
                        *(f"decode_sampling_{k}={v}" for k, v in keys.items())])


def _draws(cfg, logits, n=2000):
    keys = jax.random.split(jax.random.key(0), n)
    return np.asarray(jax.vmap(lambda k: decode.sample(logits, k, cfg))(keys))[:, 0]


LOGITS = jnp.log(jnp.asarray([[0.05, 0.4, 0.1, 0.3, 0.15]]))


def test_greedy_is_the_argmax_and_weighted_draws_the_softmax():
    assert int(decode.sample(LOGITS, jax.random.key(0), _sampling("greedy"))[0]) == 1
    counts = np.bincount(_draws(_sampling("weighted"), LOGITS), minlength=5) / 2000
    np.testing.assert_allclose(counts, np.exp(LOGITS[0]), atol=0.03)
    hot = np.bincount(_draws(_sampling("weighted", temperature=0.25), LOGITS), minlength=5) / 2000
    assert hot[1] > 0.6, hot  # a low temperature sharpens toward the likeliest


@pytest.mark.parametrize("strategy,keys,allowed", [
    ("topk", dict(top_k=2), {1, 3}),
    ("nucleus", dict(nucleus_p=0.6), {1, 3}),       # 0.4, then 0.3 crosses 0.6: both kept
    ("nucleus", dict(nucleus_p=0.3), {1}),
    ("composite", dict(top_k=3, nucleus_p=0.85), {1, 3, 4}),  # within the top 3: 0.47, 0.82, then 1 crosses .85
])
def test_topk_and_nucleus_draw_only_from_what_they_keep(strategy, keys, allowed):
    """Upstream's narrowing on the untempered distribution: top-k, then the likeliest tokens until their probability
    reaches p (the one that crosses it included; composite measures p within the top k), then a weighted draw."""
    drawn = set(_draws(_sampling(strategy, **keys), LOGITS).tolist())
    assert drawn == allowed, drawn


# ------------------------------------------------------------------------------------------- the command

REPEATED = "the cat sat on the mat. "


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """TINY trained on documents of one sentence repeated (byte tokenizer), its last checkpoint."""
    from tests.corpora import write_parquet
    from tests.tiny import train_records

    root = tmp_path_factory.mktemp("repeated")
    write_parquet(str(root / "train-00000-of-00001.parquet"), [REPEATED * 8] * 64)
    cfg = load_config(args(TINY, ["dataset_type=hf", "hf_path=parquet", f"hf_train_files={root}/train-*.parquet",
                                  "vocab_size=259", "max_target_length=48", "steps=150", "learning_rate=0.01",
                                  "enable_checkpointing=true", "checkpoint_period=150", "run_name=repeated",
                                  f"base_output_directory={root}", "per_device_batch_size=4"]))
    records = train_records(cfg, devices=jax.devices()[:1])
    assert records[-1]["loss"] < 0.5, records[-1]
    return os.path.join(root, "repeated", "checkpoints", "150")


def _decode(trained, *extra):
    keys = [e for e in extra if "=" in e and not e.startswith("--")]
    flags = [e for e in extra if e not in keys]
    return decode.main(["configs/base.yml", *args(TINY, ["vocab_size=259", f"load_parameters_path={trained}",
                                                         "max_prefill_predict_length=16", "max_target_length=40"],
                                                   keys), *flags])


def test_a_model_trained_on_a_repeated_sentence_continues_it(trained, capsys):
    """prompt="the cat sat" on the checkpoint of a model trained on that sentence repeated: upstream's line,
    `Input `the cat sat` -> ` on the mat. the cat sat ``, and autoregressive_decode_assert holds (exit 1 when it
    does not)."""
    assert _decode(trained, "prompt=the cat sat", "autoregressive_decode_assert= on the mat. the cat") == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out == "Input `the cat sat` -> ` on the mat. the cat sat `", out  # 1 + 40 - 16 = 25 tokens
    assert _decode(trained, "prompt=the cat sat", "autoregressive_decode_assert= on the rug") == 1
    assert "autoregressive_decode_assert=' on the rug'" in capsys.readouterr().err


def test_token_rows_decode_as_a_batch(trained, tmp_path, capsys):
    """--tokens rows.npy: each row its own prompt, the batch decoded together, --tokens_out the continuations."""
    rows = np.asarray([list(b"the mat. the"), list(b" cat sat on ")], np.int32) + 3  # the byte tokenizer's ids
    np.save(tmp_path / "rows.npy", rows)
    assert _decode(trained, "--tokens", str(tmp_path / "rows.npy"), "--tokens_out", str(tmp_path / "out.npy")) == 0
    out = np.load(tmp_path / "out.npy")
    assert out.shape == (2, 1 + 40 - 16), out.shape
    texts = [bytes((out[i] - 3).clip(0, 255).astype(np.uint8)).decode("latin-1") for i in range(2)]
    assert texts[0].startswith(" cat sat on the mat.") and texts[1].startswith("the mat. the cat"), texts
    assert capsys.readouterr().out.count("Input `[") == 2


@pytest.mark.parametrize("extra,message", [
    (["decode_sampling_strategy=topk"], "decode_sampling_strategy=topk samples among the k likeliest tokens"),
    (["decode_sampling_strategy=nucleus"], "set decode_sampling_nucleus_p in (0, 1]"),
    (["max_prefill_predict_length=4"],
     "the prompt is 12 tokens (BOS and 11 bytes), longer than max_prefill_predict_length=4"),
    (["max_prefill_predict_length=64", "max_target_length=32"], "is longer than max_target_length=32"),
    (["--tokens", "/nonexistent/rows.npy"], "--tokens /nonexistent/rows.npy: cannot read it"),
])
def test_a_decode_mistake_is_one_line(capsys, extra, message):
    keys = [e for e in extra if "=" in e]
    flags = [e for e in extra if e not in keys]
    base = ["prompt=the cat sat", "vocab_size=259", "max_target_length=80"]
    assert decode.main(["configs/base.yml", *args(TINY, base, keys), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err
