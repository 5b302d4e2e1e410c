"""The model's forward pass on given tokens, for parity checks and scoring:

    python -m MaxText.forward [config.yml] key=value ... load_parameters_path=<items> \\
        --tokens rows.npy --logits_out out.npy
    python -m MaxText.forward [config.yml] key=value ... load_parameters_path=<items> --text "some text"

--tokens: an .npy of int token ids [B, L] (a single row [L] is taken as B = 1); --logits_out writes the main
head's float32 logits [B, L, V] (no MTP head). Each row is one sequence at positions 0 .. L-1.
--text: the text through the configured tokenizer (tokenizer_path; add_bos), one sequence, and prints its
perplexity: exp of the mean cross-entropy of each token after the first given the ones before it.
The params (and MoE routing biases) come from load_parameters_path; without it the model is freshly
initialised from init_weights_seed (said on the console), which is what a parity check of the code alone needs.
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

from MaxText.config.errors import ConfigError, error_line
from MaxText.config.load import load_config
from MaxText.config.storage import check_output, shown_path


def read_tokens(path: str, vocab_size: int, key: str = "--tokens ") -> np.ndarray:
    """int32 [B, L] from an .npy file; one-line ConfigError (naming `key` and the path) for anything else."""
    where = f"{key}{shown_path(path)}"
    try:
        tokens = np.load(path, allow_pickle=False)
    except OSError as e:  # the file's own error, without its name (which may be long)
        raise ConfigError(f"{where}: cannot read it ({e.strerror or type(e).__name__})") from None
    except (ValueError, EOFError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"{where}: cannot read it as an .npy array ({reason})") from None
    if not isinstance(tokens, np.ndarray):  # an .npz archive
        raise ConfigError(f"{where}: an .npz archive, not an .npy array; save the rows with np.save")
    if tokens.ndim == 1:
        tokens = tokens[None, :]
    if tokens.ndim != 2 or tokens.size == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"{where}: need a non-empty integer array [B, L], got {tokens.dtype} "
                          f"{list(tokens.shape)}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ConfigError(f"{where}: ids must be in [0, vocab_size={vocab_size}), got {tokens.min()} .. "
                          f"{tokens.max()}")
    return tokens.astype(np.int32)


def load_params_or_init(cfg, mesh, spec, log=print):
    """(params, routing biases or None) in spec's shardings: load_parameters_path's, else a fresh init (said)."""
    # here, not at the top: JAX loads only after the arguments pass their checks (as in model_and_params)
    from MaxText.step.state import create_state
    from MaxText.trainer import checkpointing

    if cfg.load_parameters_path:
        params, aux = checkpointing.load_params(cfg.load_parameters_path, spec.abstract["params"], cfg,
                                                spec.abstract.get("nnx_aux"))
        log(f"params from {cfg.load_parameters_path}" + (" (with the MoE routing biases)" if aux is not None else ""))
        return params, aux
    state = create_state(cfg, mesh, spec)
    log(f"no load_parameters_path: a fresh init (init_weights_seed={cfg.init_weights_seed})")
    return state["params"], state.get("nnx_aux")


def batch_shards(mesh) -> int:
    """How many ways the batch splits on this mesh (rows are padded to a multiple of it)."""
    # here, not at the top: JAX loads only after the arguments pass their checks (as in model_and_params)
    from MaxText.parallel import sharding

    return math.prod(mesh.shape[a] for a in sharding.DATA_AXES)


def model_and_params(cfg, log=print):
    """(jitted tokens [B, L] -> float32 logits [B, L, V], params, routing biases or None) on this process's
    devices, params from load_parameters_path (else a fresh init)."""
    # here, not at the top: JAX loads only after the arguments pass their checks (a mistake is one line without JAX's
    # start-up)
    import jax
    from flax import nnx

    from MaxText.parallel import sharding
    from MaxText.step.state import state_spec

    mesh = sharding.create_mesh(cfg)
    spec = state_spec(cfg, mesh)
    params, aux = load_params_or_init(cfg, mesh, spec, log)

    @jax.jit
    def forward(params, aux, tokens_BL):
        model = nnx.merge(spec.graphdef, params, aux) if aux else nnx.merge(spec.graphdef, params)
        logits_BLV, _ = model(tokens_BL)
        return logits_BLV

    shards = batch_shards(mesh)

    def run(tokens_BL):
        """Rows padded (with copies of the first) to a multiple of the batch shards, then dropped again."""
        b = tokens_BL.shape[0]
        padded = np.concatenate([tokens_BL, np.repeat(tokens_BL[:1], -b % shards, axis=0)])
        with jax.set_mesh(mesh):
            return np.asarray(jax.device_get(forward(params, aux, padded)), np.float32)[:b]

    return run


def encode(tokenizer, text: str, add_bos: bool) -> np.ndarray:
    """int32 ids of a text through the tokenizer, after its BOS id with add_bos (when it has one)."""
    ids = np.asarray(tokenizer.encode(text), np.int32)
    if add_bos and tokenizer.bos_id is not None:
        ids = np.concatenate([np.asarray([tokenizer.bos_id], np.int32), ids])
    return ids


def perplexity(logits_BLV: np.ndarray, tokens_BL: np.ndarray) -> tuple[float, int]:
    """(exp of the mean next-token cross-entropy, number of predicted tokens) of each row's tokens 1 .. L-1."""
    logits = logits_BLV[:, :-1].astype(np.float64)
    target = tokens_BL[:, 1:]
    log_z = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    nll = log_z - np.take_along_axis(logits, target[..., None], -1)[..., 0]
    return float(math.exp(nll.mean())), int(target.size)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m MaxText.forward", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", help="an .npy of int token ids [B, L]")
    parser.add_argument("--logits_out", help="where to write the float32 logits [B, L, V] (.npy)")
    parser.add_argument("--text", help="a text to score (perplexity) through the configured tokenizer")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        if (args.tokens is None) == (args.text is None):
            raise ConfigError("give exactly one of --tokens <rows.npy> and --text <text>")
        if args.logits_out and args.tokens is None:
            raise ConfigError("--logits_out needs --tokens")
        if args.logits_out:  # before any work; np.save adds .npy to a name without it
            logits_out = args.logits_out if args.logits_out.endswith(".npy") else args.logits_out + ".npy"
            check_output("--logits_out", logits_out, file=True)
        cfg = load_config(rest)
        if args.text is not None:
            # here, not at the top: JAX loads only after the arguments pass their checks (a mistake is one line without
            # JAX's start-up)
            from MaxText.data.tokenizer import load_tokenizer

            ids = encode(load_tokenizer(cfg), args.text, cfg.add_bos)
            if len(ids) < 2:
                raise ConfigError("--text: need at least two tokens to score")
            tokens = np.asarray(ids, np.int32)[None, :]
        else:
            tokens = read_tokens(args.tokens, cfg.vocab_size)
        run = model_and_params(cfg)
        logits = run(tokens)
    except ConfigError as e:
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2
    if args.logits_out:
        np.save(args.logits_out, logits)
        print(f"wrote logits {list(logits.shape)} float32 to {args.logits_out}")
    if args.text is not None or not args.logits_out:
        ppl, count = perplexity(logits, tokens)
        print(f"perplexity {ppl:.4f} over {count} predicted tokens")
    return 0
