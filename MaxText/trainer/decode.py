"""Autoregressive decoding with a KV cache, upstream MaxText's decode command with its keys:

    python -m MaxText.decode [config.yml] key=value ... load_parameters_path=<items> prompt="I love to"
    python -m MaxText.decode [config.yml] key=value ... load_parameters_path=<items> --tokens rows.npy \\
        [--tokens_out out.npy]

The prompt (text through the configured tokenizer, after a BOS id with add_bos), or each row of --tokens (token
ids [B, L], a batch of prompts of one length), is prefilled in one pass, then continued one token a step for
1 + max_target_length - max_prefill_predict_length tokens (upstream's count: its prefill's token, then one per
position up to max_target_length), by decode_sampling_strategy (greedy, weighted, topk, nucleus, composite; with
decode_sampling_temperature, decode_sampling_top_k, decode_sampling_nucleus_p), the draws seeded by
init_weights_seed. A continuation stops after the tokenizer's EOS. Printed as upstream prints it, one line a row:
Input `<prompt>` -> `<continuation>`; autoregressive_decode_assert, when set, must begin the first row's (else
exit 1). --tokens_out writes the continuations' ids [B, N] (int32, nothing cut at EOS).

The KV cache (Transformer.decode): for GQA the keys (RoPE applied) and values of every layer, for MLA the
compressed cache (the normalised key-value latent and the shared rope key per position, attended in the latent
space as DeepSeek decodes). Sharded like training (the training mesh and param shardings; the rows and the cache
over the batch axes). The params (and MoE routing biases) come from load_parameters_path, a train state's
checkpoint (.../checkpoints/<step>) or an imported one; without it the model is a fresh init (said on the console).

Decoding computes what training computes, except: the dense GEMMs in the activation dtype (`quantization` is a
training precision; TE's quantized GEMMs take whole blocks of tokens), the routed experts on the pure-JAX dropless
path when moe_impl=te_dropless (TE's kernels and NCCL EP are sized for training batches; the routing and the
experts' arithmetic are the same) with worst-case receive buffers (a bounded ragged_buffer_factor could drop a
step's tokens), no batch split and no token chunks. The first two are said on the console when they apply.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from MaxText.config.errors import ConfigError, error_line
from MaxText.config.load import load_config, replace
from MaxText.config.storage import check_output
from MaxText.trainer.forward import encode, read_tokens


def decode_config(cfg, log=print):
    """The config decoding runs: training's, but for the departures the module doc lists, each logged."""
    changes = {}
    if cfg.quantization != "none":
        changes["quantization"] = "none"
        log(f"decode: the dense GEMMs in {cfg.dtype} (quantization={cfg.quantization} is a training precision)")
    if cfg.moe_impl == "te_dropless":
        changes.update(moe_impl="ragged", te_gmm_quantization="none", te_moe_block=None)
        log("decode: the routed experts on moe_impl=ragged (the same dropless routing and experts in pure JAX; TE's "
            "kernels and NCCL EP are sized for training batches)")
    if cfg.ragged_buffer_factor is not None and cfg.moe_impl != "dense":
        # a step's few tokens on bounded receive buffers could overflow; the worst case costs nothing at this size
        changes.update(ragged_buffer_factor=None, moe_dropless_fallback=None, retry_dropless_first_steps=0,
                       first_phase_ragged_buffer_factor=0.0)
    if cfg.use_batch_split_schedule:
        changes["use_batch_split_schedule"] = False
    for group in ("ici", "dcn"):  # a step's one token does not split: context parallelism's devices shard FSDP
        context, fsdp = cfg[f"{group}_context_parallelism"], cfg[f"{group}_fsdp_parallelism"]
        if context != 1:
            changes[f"{group}_context_parallelism"] = 1
            changes[f"{group}_fsdp_parallelism"] = -1 if context == -1 or fsdp == -1 else fsdp * context
            log(f"decode: {group}_context_parallelism={context} folded into {group}_fsdp_parallelism (a decode step's "
                "token does not split)")
    if cfg.num_moe_token_chunks > 1:  # a schedule of the exchange, the same numbers: a step has too few tokens
        changes["num_moe_token_chunks"] = 1
    return replace(cfg, **changes) if changes else cfg


def check_decode(cfg) -> None:
    """One line for a sampling strategy without the parameter it needs (upstream raises ValueError there), or a
    prompt length past the sequence length."""
    strategy = cfg.decode_sampling_strategy
    if strategy in ("topk", "composite") and cfg.decode_sampling_top_k <= 0:
        raise ConfigError(f"decode_sampling_strategy={strategy} samples among the k likeliest tokens: set "
                          "decode_sampling_top_k to at least 1")
    if strategy in ("nucleus", "composite") and cfg.decode_sampling_nucleus_p is None:
        raise ConfigError(f"decode_sampling_strategy={strategy} samples from the likeliest tokens that reach a "
                          "probability p: set decode_sampling_nucleus_p in (0, 1]")
    if cfg.max_prefill_predict_length > cfg.max_target_length:
        raise ConfigError(f"max_prefill_predict_length={cfg.max_prefill_predict_length} is longer than "
                          f"max_target_length={cfg.max_target_length}: decoding continues a prompt of at most "
                          "max_prefill_predict_length tokens up to max_target_length; raise max_target_length")


def sample(logits_BV, key, cfg):
    """Next token ids [B] from float32 logits [B, V], upstream's sampling (inference_utils.sampling): greedy is the
    argmax; otherwise top-k, then top-p (the likeliest tokens until their probability reaches p, the one that
    crosses it included) narrow the untempered distribution, and one token is drawn from what is left with the
    logits divided by the temperature."""
    import jax
    import jax.numpy as jnp

    strategy = cfg.decode_sampling_strategy
    if strategy == "greedy":
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    keep = jnp.ones(logits_BV.shape, bool)
    if strategy in ("topk", "composite"):
        kth = jax.lax.top_k(logits_BV, cfg.decode_sampling_top_k)[0][:, -1:]
        keep &= logits_BV >= kth
    if strategy in ("nucleus", "composite"):
        narrowed = jnp.where(keep, logits_BV, -jnp.inf)
        ordered = -jnp.sort(-narrowed, axis=-1)
        before = jnp.sum(jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1) < cfg.decode_sampling_nucleus_p,
                         axis=-1, keepdims=True)
        keep &= narrowed >= jnp.take_along_axis(ordered, jnp.minimum(before, ordered.shape[-1] - 1), axis=-1)
    logits = jnp.where(keep, logits_BV, -jnp.inf) / cfg.decode_sampling_temperature
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generator(cfg, log=print):
    """(prompts [B, L] int32 -> continuations [B, N] int32 numpy) on this process's devices, the params loaded
    once; N = 1 + max_target_length - max_prefill_predict_length. Rows are padded to a multiple of the batch shards
    (copies of the first row) and dropped again."""
    # here, not at the top: JAX loads only after the arguments pass their checks
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from MaxText.layers.models import init_cache
    from MaxText.parallel import sharding
    from MaxText.step.state import state_spec
    from MaxText.trainer.forward import batch_shards, load_params_or_init

    cfg = decode_config(cfg, log)
    mesh = sharding.create_mesh(cfg)
    spec = state_spec(cfg, mesh)
    params, aux = load_params_or_init(cfg, mesh, spec, log)
    steps = 1 + cfg.max_target_length - cfg.max_prefill_predict_length

    def model(params, aux):
        return nnx.merge(spec.graphdef, params, aux) if aux else nnx.merge(spec.graphdef, params)

    def batch_sharded(tree):
        if mesh.empty or jax.sharding.get_abstract_mesh().empty:
            return tree
        return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(
            a, jax.sharding.PartitionSpec(*([None] * (a.ndim - 4)), sharding.DATA_AXES)), tree)

    @jax.jit
    def run(params, aux, prompts_BL, key):
        b, length = prompts_BL.shape
        m = model(params, aux)
        cache = batch_sharded(init_cache(cfg, b, length + steps))
        logits, cache = m.decode(prompts_BL, 0, cache)
        key, first = jax.random.split(key)
        token = sample(logits[:, -1], first, cfg)

        def step(carry, position):
            cache, token, key = carry
            logits, cache = m.decode(token[:, None], position, batch_sharded(cache))
            key, draw = jax.random.split(key)
            nxt = sample(logits[:, -1], draw, cfg)
            return (cache, nxt, key), nxt

        _, rest = jax.lax.scan(step, (cache, token, key), length + jnp.arange(steps - 1))
        return jnp.concatenate([token[:, None], rest.T], axis=1)

    shards = batch_shards(mesh)

    def generate(prompts_BL):
        b = prompts_BL.shape[0]
        padded = np.concatenate([prompts_BL, np.repeat(prompts_BL[:1], -b % shards, axis=0)]).astype(np.int32)
        started = time.perf_counter()
        with jax.set_mesh(mesh):
            out = np.asarray(jax.device_get(run(params, aux, padded, jax.random.key(cfg.init_weights_seed))))
        seconds = time.perf_counter() - started
        log(f"decoded {b} x {steps} tokens after a prompt of {prompts_BL.shape[1]} in {seconds:.2f} s (compilation "
            "included)")
        return out[:b]

    return generate


def continuation(ids, eos_id) -> list[int]:
    """A row's ids up to and including the first EOS (all of them without one)."""
    ids = [int(i) for i in ids]
    return ids[:ids.index(eos_id) + 1] if eos_id is not None and eos_id in ids else ids


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m MaxText.decode", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", help="an .npy of int token ids [B, L]: prompts given as ids (else `prompt`)")
    parser.add_argument("--tokens_out", help="where to write the continuations' ids [B, N] (.npy)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.tokens_out:  # before any work; np.save adds .npy to a name without it
            tokens_out = args.tokens_out if args.tokens_out.endswith(".npy") else args.tokens_out + ".npy"
            check_output("--tokens_out", tokens_out, file=True)
        cfg = load_config(rest)
        check_decode(cfg)
        from MaxText.data.tokenizer import load_tokenizer  # noqa: PLC0415  (JAX-free, but only needed from here)

        tokenizer = load_tokenizer(cfg)
        if args.tokens is not None:
            prompts = read_tokens(args.tokens, cfg.vocab_size)
            shown, described = [str(row.tolist()) for row in prompts], ""
        else:
            ids = encode(tokenizer, cfg.prompt, cfg.add_bos)
            bos = int(cfg.add_bos and tokenizer.bos_id is not None)  # encode put one in front
            described = (f" ({'BOS and ' if bos else ''}{len(ids) - bos} "
                         f"{'bytes' if cfg.tokenizer_path is None else 'tokens of the text'})")
            if len(ids) == 0:
                raise ConfigError("prompt is empty and add_bos adds nothing: give a prompt")
            prompts, shown = ids[None, :], [cfg.prompt]
        if prompts.shape[1] > cfg.max_prefill_predict_length:
            raise ConfigError(f"the prompt is {prompts.shape[1]} tokens{described}, longer than "
                              f"max_prefill_predict_length={cfg.max_prefill_predict_length}; raise it (and "
                              "max_target_length with it)")
        out = generator(cfg)(prompts)
    except ConfigError as e:
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2
    if args.tokens_out:
        np.save(args.tokens_out, out)
        print(f"wrote the continuations' ids {list(out.shape)} int32 to {args.tokens_out}")
    texts = []
    for prompt, row in zip(shown, out, strict=True):
        ids = continuation(row, tokenizer.eos_id)
        texts.append(tokenizer.decode(ids) if args.tokens is None else str(ids))
        print(f"Input `{prompt}` -> `{texts[-1]}`")
    want = cfg.autoregressive_decode_assert
    if want and not texts[0].startswith(want):
        print(f"error: autoregressive_decode_assert={want!r}: the continuation is {texts[0][:200]!r}", file=sys.stderr)
        return 1
    return 0
