"""Step metrics and their writers (console, JSONL, TensorBoard); FLOPs and MFU are MaxText/planning/flops.py's."""

from __future__ import annotations

import json
import os
import secrets

import numpy as np

from MaxText.config.errors import ConfigError

def _scalar(value):
    if value is None:
        return None
    arr = np.asarray(value)
    return arr.item() if arr.ndim == 0 else arr.tolist()


# TensorBoard tags as upstream MaxText writes them (its metric_logger), so a MaxText dashboard shows a run as it
# is; a record key upstream has no tag for keeps its own name. Upstream counts steps from 0 (the first update is
# step 0, and an eval after it too), so events go at this trainer's step - 1; metrics.jsonl keeps our numbering.
TB_TAGS = {
    "loss": "learning/loss", "lm_loss": "learning/lm_loss", "mtp_loss": "learning/mtp_loss",
    "moe_aux_loss": "learning/moe_lb_loss", "moe_z_loss": "learning/z_loss", "grad_norm": "learning/grad_norm",
    "learning_rate": "learning/current_learning_rate", "step_time_s": "perf/step_time_seconds",
    "tokens_per_s_per_device": "perf/per_device_tokens_per_sec", "tflops_per_device": "perf/per_device_tflops_per_sec",
    "moe_dropless_fallback_layers": "learning/moe_dropless_fallback_layers",
    "eval_moe_dropless_fallback_layers": "eval/moe_dropless_fallback_layers", "eval_loss": "eval/avg_loss",
    "eval_perplexity": "eval/avg_perplexity", "eval_tokens": "eval/total_weights",
}


def tensorboard_scalars(record: dict) -> dict:
    """{tag: value} of a record's scalars as TensorBoard gets them: upstream's tags (TB_TAGS), plus upstream's
    learning/moe_max_load_ratio and _mean (the worst and the mean over MoE layers of max / mean expert load)."""
    out = {TB_TAGS.get(k, k): v for k, v in record.items() if k != "step" and v is not None}
    ratio = record.get("moe_load_max_over_mean")
    if ratio:
        out["learning/moe_max_load_ratio"] = float(np.max(ratio))
        out["learning/moe_max_load_ratio_mean"] = float(np.mean(ratio))
    return out


def save_config(path: str, config: dict) -> None:
    """The run's resolved config as YAML (every key; what MaxText.report reads the layer numbering from), written
    to a new file of an unpredictable name and renamed over `path`."""
    import yaml

    temporary = f"{path}.{secrets.token_hex(4)}.tmp"
    with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w") as f:
        yaml.safe_dump(config, f, sort_keys=True)
    os.replace(temporary, path)


class MetricsWriter:
    """Appends one JSON object per logged step to <run>/metrics/metrics.jsonl and mirrors the scalars to
    TensorBoard events under <run>/tensorboard. Only process 0 writes."""

    def __init__(self, run_dir: str, *, tensorboard: bool, primary: bool = True, config: dict | None = None):
        self.primary = primary
        self.tb = None
        if not primary:
            return
        os.makedirs(os.path.join(run_dir, "metrics"), exist_ok=True)
        if config is not None:
            save_config(os.path.join(run_dir, "metrics", "config.yml"), config)
        # Never through a symlink: the run's own file, not one it points elsewhere.
        path = os.path.join(run_dir, "metrics", "metrics.jsonl")
        try:
            self.jsonl = os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644), "a")
        except OSError as e:
            raise ConfigError(f"cannot append to {path}: {e.strerror} (the trainer never writes through a symlink); "
                              "remove it or choose another run_name") from None
        if tensorboard:
            from tensorboardX import SummaryWriter  # imported here: only the writing process needs it
            # A random suffix: the events file (opened "wb") has a name nobody can have placed a symlink at.
            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"), filename_suffix=f".{secrets.token_hex(4)}")

    def write(self, step: int, metrics: dict) -> dict:
        """Writes the metrics of `step`. Arrays become lists in JSON; in TensorBoard (upstream's tags and step
        count, TB_TAGS) a per-layer array [L] becomes scalars `<key>/layer_<i>` and a per-layer per-expert array
        [L, E] one histogram per layer."""
        record = {"step": int(step), **{key: _scalar(v) for key, v in metrics.items()}}
        if not self.primary:
            return record
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            at = int(step) - 1  # upstream's step count (TB_TAGS)
            for key, value in tensorboard_scalars(record).items():
                if not isinstance(value, list):
                    self.tb.add_scalar(key, value, at)
                    continue
                for layer, row in enumerate(value):
                    if isinstance(row, list):
                        self.tb.add_histogram(f"{key}/layer_{layer}", np.asarray(row), at)
                    else:
                        self.tb.add_scalar(f"{key}/layer_{layer}", row, at)
            self.tb.flush()
        return record

    def close(self):
        if self.primary:
            self.jsonl.close()
            if self.tb is not None:
                self.tb.close()


def _summary(value, reduce):
    return None if value is None else reduce(np.asarray(value))


def console_line(record: dict) -> str:
    """MaxText's log line: completed step, seconds, TFLOP/s/device, Tokens/s/device, losses, and a summary
    of the MoE layers (worst expert imbalance, mean dropped fraction, total overflow; with moe_dropless_fallback,
    the layers that ran worst-case this step (layer) or the steps rerun so far (step))."""
    record = {**record, "imbalance": _summary(record.get("moe_load_max_over_mean"), np.max),
              "dropped": _summary(record.get("moe_dropped_fraction"), np.mean),
              "overflow": _summary(record.get("moe_overflow"), np.sum)}
    parts = [f"completed step: {record['step']}"]
    for key, label, fmt in (("step_time_s", "seconds", ".3f"), ("tflops_per_device", "TFLOP/s/device", ".3f"),
                            ("tokens_per_s_per_device", "Tokens/s/device", ".1f"), ("mfu", "MFU", ".2%"),
                            ("loss", "loss", ".4f"), ("lm_loss", "lm_loss", ".4f"),
                            ("moe_aux_loss", "moe_lb_loss", ".4f"), ("mtp_loss", "mtp_loss", ".4f"),
                            ("grad_norm", "grad_norm", ".3f"),
                            ("learning_rate", "lr", ".3e"), ("imbalance", "max/mean expert load", ".2f"),
                            ("dropped", "dropped", ".3f"), ("overflow", "overflow", ".0f"),
                            ("moe_dropless_fallback_layers", "worst-case layers", ".0f"),
                            ("moe_step_replays", "replayed steps", "d")):
        if record.get(key) is not None:
            parts.append(f"{label}: {record[key]:{fmt}}")
    return ", ".join(parts)
