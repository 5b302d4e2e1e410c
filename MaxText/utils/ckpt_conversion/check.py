"""Parity check of an imported checkpoint against Hugging Face transformers, the step between import and training:

    python -m MaxText.utils.ckpt_conversion.check configs/base.yml model_name=<out>/model.yml \\
        load_parameters_path=<out>/0/items hf_model_path=<hf dir> [hf_python=<python>] [check_rows=4] \\
        [check_length=32] [check_tokens=rows.npy] [check_stream=auto|true|false] [check_tolerance=...] \\
        [dtype=float32] [key=value ...]

Runs the same token rows (check_tokens, else check_rows seeded random rows of check_length tokens) through this
trainer's model (MaxText.forward, on this process's devices under the config's mesh) and through transformers'
own model of <hf dir> (MaxText/utils/ckpt_conversion/hf_reference.py, run by hf_python: this interpreter when it
has transformers and torch, else the repository's .venv-hf made by scripts/setup_hf.sh), and prints, per row,
the max |difference| of the logits over the row's largest |logit| (the relative error), how often the two agree
on the next token, and a verdict: PASS when every row is within check_tolerance (default 2e-4 in float32, 5e-2
in bfloat16), exit status 0; FAIL otherwise, exit status 1. A JSON line with the same numbers follows the table.

Memory: transformers' side streams (one decoder layer at a time, read from the safetensors, FP8 blocks
dequantized) when check_stream=true, or under auto when the checkpoint is larger than a third of this host's
memory; this trainer's side needs the devices a training run of the model needs (run it under the recipe's
launcher for a large model).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from MaxText.config.errors import ConfigError
from MaxText.config.load import load_config, tool_main
from MaxText.config.storage import shown_path
from MaxText.utils.ckpt_conversion.to_maxtext import check_family, read_hf_config

OPTIONS = {"hf_model_path": None, "hf_python": None, "check_rows": "4", "check_length": "32", "check_tokens": None,
           "check_stream": "auto", "check_tolerance": None}
REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_reference.py")
REPO_HF_PYTHON = os.path.join(os.path.dirname(REFERENCE), "..", "..", "..", ".venv-hf", "bin", "python")


def _has_transformers(python: str) -> bool:
    probe = "import importlib.util as u, sys; sys.exit(not (u.find_spec('transformers') and u.find_spec('torch')))"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_hf_python(given: str | None) -> str:
    """The interpreter that runs transformers: hf_python, else this one, else the repository's .venv-hf."""
    if given:
        if not _has_transformers(given):
            raise ConfigError(f"hf_python={shown_path(given)} cannot import transformers and torch; install them "
                              "there (pip install transformers torch) or point hf_python at a Python that has them")
        return given
    for candidate in (sys.executable, os.path.normpath(REPO_HF_PYTHON)):
        if os.path.exists(candidate) and _has_transformers(candidate):
            return candidate
    raise ConfigError("transformers is not installed here, so there is nothing to compare with: pip install "
                      "transformers torch, or bash scripts/setup_hf.sh (makes .venv-hf), or pass hf_python=<python>")


def _stream(choice: str, hf_dir: str) -> bool:
    if choice in ("true", "false"):
        return choice == "true"
    if choice != "auto":
        raise ConfigError(f"check_stream={shown_path(choice)} is not one of auto, true, false")
    size = sum(os.path.getsize(os.path.join(hf_dir, n)) for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return size > memory / 3


def reference_logits(python: str, hf_dir: str, tokens: np.ndarray, stream: bool) -> np.ndarray:
    """transformers' float32 logits [B, L, V] of the rows, from a subprocess (its own interpreter)."""
    with tempfile.TemporaryDirectory() as tmp:
        rows, out = os.path.join(tmp, "rows.npy"), os.path.join(tmp, "logits.npy")
        np.save(rows, tokens)
        cmd = [python, REFERENCE, "--hf_dir", hf_dir, "--tokens", rows, "--out", out] + (["--stream"] if stream else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()] or ["(no message)"]
            raise ConfigError(f"transformers could not run {shown_path(hf_dir)}: {lines[-1][:300]}")
        return np.load(out)


def compare(ours: np.ndarray, theirs: np.ndarray) -> list[dict]:
    """Per row: max |ours - theirs|, the row's max |theirs|, their ratio, and next-token agreement."""
    rows = []
    for b in range(theirs.shape[0]):
        diff = float(np.abs(ours[b] - theirs[b]).max())
        scale = float(np.abs(theirs[b]).max())
        agree = float(np.mean(ours[b].argmax(-1) == theirs[b].argmax(-1)))
        rows.append({"row": b, "max_abs_diff": diff, "max_abs_logit": scale, "rel_error": diff / max(scale, 1e-30),
                     "argmax_agreement": agree})
    return rows


def _options(argv: list[str]) -> tuple[dict, list[str]]:
    opts, rest = dict(OPTIONS), []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in opts:
            opts[key] = value
        else:
            rest.append(arg)
    if not opts["hf_model_path"]:
        raise ConfigError("hf_model_path=<directory> is required: the Hugging Face checkpoint directory the import "
                          "read")
    for key in ("check_rows", "check_length"):
        if not opts[key].isdigit() or int(opts[key]) < 1:
            raise ConfigError(f"{key}={shown_path(opts[key])} must be a whole number of at least 1")
    return opts, rest


def check(argv: list[str], log=print) -> bool:
    """Runs the check; True when every row is within the tolerance."""
    # here, not at the top: JAX loads only after the inputs pass their checks (a mistake is one line without JAX's
    # start-up)
    from MaxText.trainer import forward

    opts, rest = _options(argv)
    hf = read_hf_config(opts["hf_model_path"])  # a directory of a family imported here, before any work
    cfg = load_config(rest)
    check_family(cfg, hf["model_type"], str(cfg.model_name), opts["hf_model_path"])
    if not cfg.load_parameters_path:
        raise ConfigError("load_parameters_path=<out>/0/items is required (the imported params to check)")
    try:
        tolerance = float(opts["check_tolerance"] or (2e-4 if cfg.dtype == "float32" else 5e-2))
    except ValueError:
        raise ConfigError(f"check_tolerance={shown_path(opts['check_tolerance'])} is not a number") from None
    if opts["check_tokens"]:
        tokens = forward.read_tokens(opts["check_tokens"], cfg.vocab_size, key="check_tokens=")
    else:
        rng = np.random.default_rng(cfg.init_weights_seed)
        tokens = rng.integers(0, cfg.vocab_size, (int(opts["check_rows"]), int(opts["check_length"]))).astype(np.int32)
    stream = _stream(opts["check_stream"], opts["hf_model_path"])
    python = find_hf_python(opts["hf_python"])
    theirs = reference_logits(python, opts["hf_model_path"], tokens, stream)
    ours = np.asarray(forward.model_and_params(cfg, log=log)(tokens), np.float32)
    if ours.shape != theirs.shape:
        raise ConfigError(f"the logits differ in shape: this trainer's {list(ours.shape)}, transformers' "
                          f"{list(theirs.shape)}; check model_name against "
                          f"{shown_path(os.path.join(opts['hf_model_path'], 'config.json'))}")
    rows = compare(ours, theirs)
    log(f"{'row':>4} {'max |diff|':>12} {'max |logit|':>12} {'rel error':>10} {'argmax agree':>13}")
    for r in rows:
        log(f"{r['row']:>4} {r['max_abs_diff']:>12.3e} {r['max_abs_logit']:>12.3e} {r['rel_error']:>10.2e} "
            f"{r['argmax_agreement']:>12.1%}")
    worst = max(r["rel_error"] for r in rows)
    passed = worst <= tolerance
    log(f"{'PASS' if passed else 'FAIL'}: max relative logit error {worst:.2e} "
        f"{'within' if passed else 'above'} {tolerance:.0e} over {tokens.shape[0]} rows of {tokens.shape[1]} tokens "
        f"(transformers by {python}{', streamed' if stream else ''})")
    log(json.dumps({"passed": passed, "tolerance": tolerance, "rows": rows}))
    return passed


def main(argv=None) -> int:
    result = {}
    code = tool_main(lambda a: result.update(passed=check(a)), argv, __doc__)
    return code if code or not result else (0 if result["passed"] else 1)


if __name__ == "__main__":
    sys.exit(main())
