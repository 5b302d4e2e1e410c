"""Run report: `python -m MaxText.report <run_dir> [--out DIR]` (either may be a gs:// URL).

Reads <run_dir>/metrics/metrics.jsonl and writes PNG plots beside it (or into --out), printing each path:

  loss.png         train loss, lm_loss and mtp_loss (when logged) over steps; eval_loss as markers
  throughput.png   tokens/s/device; TFLOP/s/device with MFU on a second axis (when the device's peak is known)
  expert_load.png  per MoE layer a heatmap (x = step, y = expert) of each expert's load over the layer's mean
                   load, on a log colour scale centred at 1 (balanced); below, max/mean load per layer
  moe_balance.png  per MoE layer (MTP depths last): dropped fraction, dropped slots, router entropy; eval as markers

Layers are named by their decoder layer (from 0, as checkpoints number them) or MTP depth, from the config the
trainer saved beside the metrics (metrics/config.yml).

A plot whose data the run did not log is skipped with a note (a dense model has no expert load). A resumed run
appends to the same file, so a step can appear more than once (the steps redone after the last checkpoint):
for each step the last record in the file wins, train and eval records separately.

Shape legend: L MoE layers, E experts, S logged steps.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys

import numpy as np

from MaxText.config import storage
from MaxText.config.errors import ConfigError, error_line

MATPLOTLIB_PIN = "matplotlib==3.11.2"


class ReportError(ValueError):
    """A run directory or metrics file the report cannot read; the message is one line for the user."""


def read_records(path: str) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of a metrics.jsonl, each sorted by step with one record per step: the
    last one in the file (a resumed run logs the steps it redoes again). Train records hold "loss", eval
    records "eval_loss"; other lines are ignored."""
    shown = storage.shown_path(path)
    if not storage.path(path).is_file():
        what = "is a directory, not a file" if storage.path(path).is_dir() else "does not exist"
        raise ReportError(f"{shown} {what}; is this a run directory written by MaxText.train?")
    train, evals, lines = {}, {}, 0
    with storage.path(path).open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ReportError(f"{shown}, line {number}: not UTF-8 text (byte {e.start + 1} is "
                                  f"0x{raw[e.start]:02x}); the file is damaged") from None
            if not line.strip():
                continue
            lines += 1
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ReportError(f"{shown}, line {number}: not JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:
                raise ReportError(f"{shown}, line {number}: not a metrics record (nested too deep)") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ReportError(f"{shown}, line {number}: not a metrics record (a JSON object with an integer "
                                  "\"step\")")
            if "eval_loss" in record:
                evals[record["step"]] = record
            elif "loss" in record:
                train[record["step"]] = record
    if not lines:
        raise ReportError(f"{shown} is empty: the run has not logged a step yet")
    if not train and not evals:
        raise ReportError(f"{shown} holds no train or eval records")
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of a scalar key over the records that logged it as a number (None and missing skipped)."""
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    steps, values = zip(*pairs) if pairs else ((), ())
    return np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64)


def layer_series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps [S], values [L, S]) of a per-MoE-layer key (a list over layers in each record)."""
    rows = [r for r in records if isinstance(r.get(key), list)]
    steps = np.asarray([r["step"] for r in rows], dtype=np.int64)
    width = {len(r[key]) for r in rows}
    if len(width) > 1:
        raise ReportError(f"{key} changes its number of layers within the run ({sorted(width)}); were two "
                          "different models logged into one run directory?")
    if not rows:
        return steps, np.zeros((0, 0))
    values = np.asarray([r[key] for r in rows], dtype=np.float64).reshape(len(rows), -1)
    return steps, values.T


def expert_load_matrix(records: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(steps [S], share [L, E, S]): each expert's share of its layer's token-slots at each logged step (load /
    total load of that layer at that step; every share is 1/E when balanced). Records without
    moe_expert_load are left out; a step where a layer routed nothing gets shares of 0."""
    rows = [r for r in records if isinstance(r.get("moe_expert_load"), list)]
    shapes = {np.shape(r["moe_expert_load"]) for r in rows}
    if len(shapes) > 1:
        raise ReportError(f"moe_expert_load changes shape within the run ({sorted(shapes)}); were two different "
                          "models logged into one run directory?")
    steps = np.asarray([r["step"] for r in rows], dtype=np.int64)
    if not rows:
        return steps, np.zeros((0, 0, 0))
    load_SLE = np.asarray([r["moe_expert_load"] for r in rows], dtype=np.float64)
    total_SL1 = load_SLE.sum(axis=-1, keepdims=True)
    share_SLE = np.divide(load_SLE, total_SL1, out=np.zeros_like(load_SLE), where=total_SL1 > 0)
    return steps, share_SLE.transpose(1, 2, 0)


def _figure(rows: int, *, row_height: float = 3.0):
    """A figure of `rows` panels in one column."""
    from matplotlib.figure import Figure

    # A bare Figure with the Agg canvas (no pyplot): nothing global is touched and no display is looked for.
    fig = Figure(figsize=(9.0, row_height * rows), layout="constrained")
    return fig, fig.subplots(rows, 1, squeeze=False)


def _save(fig, path: str) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    storage.path(path).write_bytes(png.getvalue())
    return path


def _edges(steps: np.ndarray) -> np.ndarray:
    """Cell edges around each step for pcolormesh: logged steps need not be evenly spaced (the last step,
    a resume between log_period multiples)."""
    if len(steps) == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    mid = (steps[1:] + steps[:-1]) / 2
    return np.concatenate([[2 * steps[0] - mid[0]], mid, [2 * steps[-1] - mid[-1]]])


def layer_names(run_config: dict | None, layers: int) -> list[str]:
    """The name of each MoE layer of the per-layer lists (decoder layers first, then the MTP depths'): its decoder
    layer, counted from 0 as checkpoints and Hugging Face number them (decoder layer 1 is DeepSeek's first MoE
    layer), or its MTP depth; from the run's metrics/config.yml, else "MoE layer <i>"."""
    if not run_config or run_config.get("num_experts", 1) <= 1:
        return [f"MoE layer {i}" for i in range(layers)]
    first = run_config.get("first_num_dense_layers", 0)
    decoder = run_config.get("base_num_decoder_layers", layers) - first
    return [f"decoder layer {first + i}" if i < decoder else f"MTP depth {i - decoder + 1}" for i in range(layers)]


def _plot_layers(ax, steps, values_LS, label: str, names=None):
    """One line per MoE layer; a legend for a few layers, else colour by layer depth with a colorbar."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    layers = values_LS.shape[0]
    names = names or layer_names(None, layers)
    cmap = colormaps["viridis"]
    for layer in range(layers):
        color = cmap(layer / max(layers - 1, 1)) if layers > 8 else None
        ax.plot(steps, values_LS[layer], marker="." if len(steps) < 30 else None, color=color,
                label=names[layer])
    ax.set_ylabel(label)
    if layers <= 8:
        ax.legend(fontsize="small", ncols=min(layers, 4))
    else:
        ax.figure.colorbar(ScalarMappable(Normalize(0, layers - 1), cmap), ax=ax, label="MoE layer")


def plot_loss(train: list[dict], evals: list[dict], path: str) -> str:
    """loss, lm_loss and mtp_loss (whichever were logged) over steps, eval_loss as markers."""
    fig, axes = _figure(1)
    ax = axes[0, 0]
    for key, style in (("loss", "-"), ("lm_loss", "--"), ("mtp_loss", ":")):
        steps, values = series(train, key)
        if len(steps):
            ax.plot(steps, values, style, label=f"train {key}")
    steps, values = series(evals, "eval_loss")
    if len(steps):
        ax.plot(steps, values, "o", color="black", label="eval_loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_throughput(train: list[dict], path: str) -> str:
    """tokens/s/device above; TFLOP/s/device below, with MFU on its right axis where it was logged."""
    fig, axes = _figure(2)
    steps, tps = series(train, "tokens_per_s_per_device")
    top = axes[0, 0]
    top.plot(steps, tps, ".-")
    top.set_ylabel("tokens/s/device")
    top.set_title("Throughput (a step's time includes compiling after a (re)start and evaluations before it)")
    bottom = axes[1, 0]
    steps, tflops = series(train, "tflops_per_device")
    bottom.plot(steps, tflops, ".-", label="TFLOP/s/device")
    bottom.set_ylabel("model TFLOP/s/device")
    steps, mfu = series(train, "mfu")
    if len(steps):
        right = bottom.twinx()
        right.plot(steps, 100 * mfu, ".--", color="tab:orange", label="MFU")
        right.set_ylabel("MFU (% of dense bf16 peak)")
        right.set_ylim(bottom=0)
        bottom.legend(handles=bottom.get_lines() + right.get_lines(), loc="lower right")
    for ax in (top, bottom):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    bottom.set_xlabel("step")
    return _save(fig, path)


def plot_expert_load(train: list[dict], path: str, run_config: dict | None = None) -> str:
    """A heatmap per MoE layer of each expert's load over the layer's mean load (share x E) on a log colour
    scale centred at 1, and below them every layer's max/mean load as a line over the same steps."""
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    steps, share_LES = expert_load_matrix(train)
    layers, experts, _ = share_LES.shape
    names = layer_names(run_config, layers)
    ratio_LES = share_LES * experts  # load / mean load: 1 = balanced, 2 = twice its fair share
    # Symmetric in log space (a cold expert at 1/r as deep a colour as a hot one at r), at least 1/2..2 so
    # that noise around balance stays pale, at most 1/16..16; beyond it (an expert with no tokens) clips.
    positive = ratio_LES[ratio_LES > 0]
    r = min(16.0, max(2.0, float(positive.max()), 1 / float(positive.min()))) if positive.size else 2.0
    norm = LogNorm(vmin=1 / r, vmax=r, clip=True)
    cols = 1 if layers <= 4 else 2 if layers <= 16 else 4
    rows = math.ceil(layers / cols)
    row_height = min(3.0, max(1.2, 0.25 * experts))
    fig = Figure(figsize=(9.0 + 3.0 * (cols - 1), row_height * rows + 3.0), layout="constrained")
    grid = fig.add_gridspec(rows + 1, cols, height_ratios=[row_height] * rows + [3.0])
    lines = fig.add_subplot(grid[rows, :])
    x_edges, y_edges = _edges(steps), np.arange(experts + 1) - 0.5
    heatmaps = []
    for layer in range(layers):
        ax = fig.add_subplot(grid[layer // cols, layer % cols])
        mesh = ax.pcolormesh(x_edges, y_edges, np.clip(ratio_LES[layer], 1 / r, r), norm=norm, cmap="RdBu_r")
        ax.set_title(names[layer], fontsize="medium")
        ax.set_ylabel("expert")
        ax.xaxis.set_major_locator(MaxNLocator(4 if cols > 1 else "auto", integer=True, steps=[1, 2, 5, 10]))
        if experts <= 16:
            ax.set_yticks(range(experts))
        heatmaps.append(ax)
    bar = fig.colorbar(mesh, ax=heatmaps, label="expert load / layer's mean load (log scale; 1 = balanced)",
                       shrink=0.9, aspect=max(20, 10 * rows))
    ticks = [2.0 ** k for k in range(-4, 5) if 1 / r <= 2.0 ** k <= r]
    bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
    bar.minorticks_off()
    _plot_layers(lines, steps, ratio_LES.max(axis=1), "max / mean expert load", names)
    lines.axhline(1.0, color="grey", lw=0.8)
    lines.set_xlim(x_edges[0], x_edges[-1])
    lines.set_xlabel("step")
    lines.grid(alpha=0.3)
    lines.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
    clipped = np.any((ratio_LES < 1 / r) | (ratio_LES > r))
    fig.suptitle(f"Expert load per MoE layer ({experts} experts"
                 + (f"; colours clip at 1/{r:.3g} and {r:.3g}, an expert with no tokens at 1/{r:.3g})" if clipped
                    else ")"))
    return _save(fig, path)


BALANCE_KEYS = (("moe_dropped_fraction", "dropped fraction of token-slots"),
                ("moe_overflow", "dropped token-slots"),
                ("moe_router_entropy", "router entropy (nats)"))


def plot_moe_balance(train: list[dict], path: str, evals: list[dict] = (),
                     run_config: dict | None = None) -> str | None:
    """Dropped fraction, dropped (overflowed) slots and router entropy per MoE layer (the MTP depths' layers
    last), every impl alike; evaluation's dropped fraction and slots (of the decoder's MoE layers: evaluation
    runs no MTP) as black markers. None when none of them was logged."""
    present = [(key, label) for key, label in BALANCE_KEYS if any(isinstance(r.get(key), list) for r in train)]
    if not present:
        return None
    fig, axes = _figure(len(present), row_height=2.6)
    for ax, (key, label) in zip(axes[:, 0], present):
        steps, values_LS = layer_series(train, key)
        _plot_layers(ax, steps, values_LS, label, layer_names(run_config, values_LS.shape[0]))
        eval_steps, eval_LS = layer_series(list(evals), "eval_" + key)
        for layer_values in eval_LS:
            ax.plot(eval_steps, layer_values, "o", color="black", markersize=3)
        if len(eval_steps):
            marker = ax.plot([], [], "o", color="black", markersize=3, label="eval (each layer)")[0]
            layers = values_LS.shape[0]  # a legend of the layers too when _plot_layers gave them one
            ax.legend(**({"ncols": min(layers + 1, 4)} if layers <= 8 else {"handles": [marker]}), fontsize="small")
        zero = not np.any(values_LS) and not np.any(eval_LS)
        ax.set_title(key + (" (zero at every step)" if zero else ""), fontsize="medium")
        if key != "moe_router_entropy":
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle("MoE balance per layer")
    return _save(fig, path)


def read_run_config(path: str) -> dict | None:
    """The run's resolved config as the trainer saved it (metrics/config.yml), or None (an older run)."""
    import yaml

    if not storage.path(path).is_file():
        return None
    try:
        data = yaml.safe_load(storage.path(path).read_text())
    except yaml.YAMLError as e:
        raise ReportError(f"{storage.shown_path(path)} is not valid YAML: {str(e).splitlines()[0][:200]}") from None
    return data if isinstance(data, dict) else None


def write_report(run_dir: str, out_dir: str | None = None, log=None) -> list[str]:
    """Writes the plots whose data <run_dir>/metrics/metrics.jsonl holds into out_dir (default: beside the
    metrics) and returns their paths; notes on skipped plots go to `log` (default: stderr)."""
    log = log or (lambda message: print(message, file=sys.stderr))
    if not storage.path(run_dir).is_dir():
        what = "is a file, not a directory" if storage.path(run_dir).exists() else "does not exist"
        raise ReportError(f"run directory {storage.shown_path(run_dir)} {what}; give <base_output_directory>/"
                          "<run_name> of a MaxText.train run")
    # before anything is read or drawn: a file, beneath one, unwritable (the PNGs go beside the metrics by default)
    out_dir = out_dir or storage.join(run_dir, "metrics")
    storage.check_output("--out", out_dir)
    metrics_path = storage.join(run_dir, "metrics", "metrics.jsonl")
    train, evals = read_records(metrics_path)
    run_config = read_run_config(storage.join(run_dir, "metrics", "config.yml"))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ReportError(f"the report needs matplotlib: pip install {MATPLOTLIB_PIN}") from None
    if not storage.is_remote(out_dir):  # a bucket has no directories to make
        os.makedirs(out_dir, exist_ok=True)
    written = [plot_loss(train, evals, storage.join(out_dir, "loss.png"))]
    if len(series(train, "tokens_per_s_per_device")[0]):
        written.append(plot_throughput(train, storage.join(out_dir, "throughput.png")))
    else:
        log("note: no throughput logged; throughput.png skipped")
    if len(expert_load_matrix(train)[0]):
        written.append(plot_expert_load(train, storage.join(out_dir, "expert_load.png"), run_config))
        balance = plot_moe_balance(train, storage.join(out_dir, "moe_balance.png"), evals, run_config)
        if balance:
            written.append(balance)
    else:
        log("note: no moe_expert_load logged (a dense model?); expert_load.png and moe_balance.png skipped")
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m MaxText.report", description=__doc__.split("\n")[2])
    parser.add_argument("run_dir", help="<base_output_directory>/<run_name> of a MaxText.train run")
    parser.add_argument("--out", help="directory for the PNGs (default: <run_dir>/metrics)")
    args = parser.parse_args(argv)
    try:
        paths = write_report(args.run_dir, args.out)
    except (ReportError, ConfigError) as e:  # ConfigError: storage.check_output's
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2
    print("\n".join(paths))
    return 0
