"""The training loop: `train(cfg)` sets a run up (devices, mesh, state, outputs), then runs its steps with
evaluation, checkpoints and step logging. MaxText/train.py is the command around it.

    set-up:  devices -> mesh -> state spec (checked to fit) -> run lock -> checkpointer -> state and input stream
    a step:  next batch -> dispatch -> the previous step's metrics (finite?) logged -> save / eval when due
"""

from __future__ import annotations

import contextlib
import time

import jax
import numpy as np
import tqdm

from MaxText.config import storage
from MaxText.config.errors import ConfigError
from MaxText.config.load import global_batch_size, plain
from MaxText.data import make_data, validate
from MaxText.data.records import DataError
from MaxText.layers.moe.te_runtime import check_available, moe_runtime
from MaxText.parallel import sharding
from MaxText.config.checks import nvfp4_without_rht
from MaxText.parallel.checks import nccl_ep_used
from MaxText.planning import flops
from MaxText.planning.plan import check_fits
from MaxText.step.state import state_spec
from MaxText.trainer import metrics as metrics_lib
from MaxText.trainer.checkpointing import Checkpointer
from MaxText.trainer.evaluation import Evaluator
from MaxText.trainer.profiler import Profiler
from MaxText.trainer.programs import StepPrograms
from MaxText.trainer.resume import initial_state
from MaxText.trainer.run_lock import run_lock
from MaxText.trainer.signals import StopFlag


class NonFiniteError(RuntimeError):
    """The loss or gradient norm of a step was NaN or infinite; its state was never checkpointed."""


def run_directories(cfg) -> tuple[str, str]:
    """(run directory, checkpoint directory) as MaxText lays them out: absolute local paths, or gs:// URLs."""
    run_dir = storage.resolve(storage.join(cfg.base_output_directory, cfg.run_name))
    return run_dir, storage.join(run_dir, "checkpoints")


class Repeat:
    """An input stream that yields its first batch forever (reuse_example_batch); state() is the stream's after
    that batch."""

    def __init__(self, data):
        self.data, self.batch = data, next(data)

    def __next__(self):
        return self.batch

    def state(self):
        return self.data.state()


def stopped_at(step: int, start: int, state, data, checkpointer) -> str:
    """After bad data: the last completed step checkpointed (with the input position before the batch given
    up) unless it already is, or nothing ran; the end of the run's one error line, saying which."""
    if step == start:
        return f"stopped before step {step + 1}" + (f" (resumed from step {start}, which is saved)" if start else "")
    if not checkpointer.enabled:
        return f"stopped after step {step} (enable_checkpointing=false: not saved)"
    if checkpointer.latest_step() != step:
        checkpointer.save(step, state, data.state())
    checkpointer.wait()
    return f"stopped after step {step}, saved in {checkpointer.directory}/{step}"


def train(cfg, log=print, devices=None, stop: StopFlag | None = None) -> dict | None:
    """Runs the training loop to cfg.steps on `devices` (default: all); returns the last logged metrics
    record (None if no step ran). SIGTERM or SIGINT at any moment from here on (from main()'s start when `stop` is
    main's) stops the run cleanly: during set-up (nothing to save), during a step or its compile (that step is
    checkpointed), during a save."""
    if stop is not None:
        return _train(cfg, log, devices, stop)
    with StopFlag() as stop:
        return _train(cfg, log, devices, stop)


def create_mesh(cfg, devices):
    """The run's mesh over `devices` (default: all) once the machine can run the config: GPUs where the config
    asks for them, TE where te_dropless needs it, the data and tokenizer in place, num_devices matched."""
    if cfg.hardware in ("gpu", "gpu_multiprocess") and jax.default_backend() != "gpu":
        raise ConfigError(f"hardware={cfg.hardware} but JAX found no GPU (its backend is {jax.default_backend()}); "
                          "check the CUDA install (jax[cuda]) and CUDA_VISIBLE_DEVICES, or set hardware=auto")
    check_available(cfg)  # te_dropless: TE and a suitable GPU, once, before the data and run directories
    validate(cfg)  # the dataset and tokenizer are there (python_stdlib: built if missing)
    visible = len(devices) if devices is not None else jax.device_count()
    if cfg.num_devices and cfg.num_devices != visible:
        raise ConfigError(f"num_devices={cfg.num_devices} but {visible} devices are visible; launch on "
                          f"{cfg.num_devices} or set num_devices=null")
    return sharding.create_mesh(cfg, devices)


def _train(cfg, log, devices, stop) -> dict | None:
    if stop.before_first_step(log):
        return None
    mesh = create_mesh(cfg, devices)
    global_batch = global_batch_size(cfg, mesh.devices.size)
    primary = jax.process_index() == 0
    run_dir, checkpoint_dir = run_directories(cfg)
    xla_exchange = (cfg.moe_impl == "te_dropless" and cfg.te_kernels == "auto" and mesh.shape.get("expert", 1) > 1
                    and not nccl_ep_used(cfg, dict(mesh.shape)))
    log(f"run {cfg.run_name}: mesh {dict(mesh.shape)}, global batch {global_batch} x {cfg.max_target_length} "
        f"tokens, moe_impl={cfg.moe_impl}"
        + (" (TE's router and grouped GEMMs; the expert exchange over XLA's ragged all-to-all, as NCCL EP takes no "
           "moe_dropless_fallback)" if xla_exchange else "") + f", outputs in {run_dir}")
    no_rht = nvfp4_without_rht(cfg)
    if no_rht:
        log("quantization=te_nvfp4: without the Hadamard transform (a width not a multiple of 128): "
            + ", ".join(no_rht))
    spec = state_spec(cfg, mesh)
    check_fits(cfg, spec, dict(mesh.shape), mesh.devices.size, log)  # too big: one line, not a hang in XLA
    # One trainer per run directory: taken before anything is written there, held until the run returns.
    outputs = storage.RunOutputs(run_dir, jax.process_index(), primary, log)
    with run_lock(outputs.local, primary, jax.process_count(), name=run_dir), moe_runtime(cfg, mesh, global_batch), \
            contextlib.ExitStack() as cleanup:
        outputs.open()
        cleanup.callback(outputs.close)  # the last copy of a remote run's metrics, however the run ends
        # Each durable checkpoint: a remote run's metrics up to it are in the bucket too.
        checkpointer = Checkpointer(cfg, checkpoint_dir, log, on_durable=lambda _: outputs.sync(force=True))
        cleanup.callback(checkpointer.close)  # also when set-up fails: Orbax's threads must not outlive it
        state, data = initial_state(cfg, mesh, spec, checkpointer, log, lambda position: make_data(
            cfg, global_batch, jax.process_index(), jax.process_count(), state=position))
        if stop.before_first_step(log):  # a restore can take minutes
            return None
        start = int(jax.device_get(state["step"]))
        if start >= cfg.steps:
            log(f"run {cfg.run_name} is already at step {start} (steps={cfg.steps}); nothing to do")
            return None
        if cfg.reuse_example_batch:  # MaxText's benchmark mode: the first batch, every step
            data = Repeat(data)
        loop = Loop(cfg, spec, mesh, global_batch, outputs, checkpointer, stop, log, start)
        cleanup.callback(loop.close)
        if stop.before_first_step(log):
            return None
        if start == 0 and cfg.save_checkpoint_on_start and checkpointer.enabled and checkpointer.latest_step() is None:
            checkpointer.save(0, state, data.state())
        return loop.run(state, data)


class StepLog:
    """A step's metrics, waited for once the next step is dispatched: refused when not finite, then written (console
    line, JSONL, TensorBoard) every log_period steps with the step time, throughput and MFU."""

    def __init__(self, cfg, outputs, num_devices: int, global_batch: int, start: int, checkpointer):
        self.cfg, self.outputs, self.num_devices, self.checkpointer = cfg, outputs, num_devices, checkpointer
        self.writer = metrics_lib.MetricsWriter(outputs.local, tensorboard=cfg.enable_tensorboard,
                                                primary=outputs.primary, config=plain(cfg))
        self.peak = flops.peak_tflops(jax.devices()[0].device_kind)
        self.tokens_per_step = global_batch * cfg.max_target_length
        self.progress = tqdm.tqdm(total=cfg.steps, initial=start, disable=not outputs.primary, unit="step",
                                  dynamic_ncols=True, leave=False)
        self.last_record, self.last_done = None, time.perf_counter()

    def step(self, step: int, device_metrics) -> None:
        host = jax.device_get(device_metrics)
        if not (np.isfinite(host["loss"]) and np.isfinite(host["grad_norm"])):
            latest = self.checkpointer.latest_step()
            raise NonFiniteError(
                f"step {step}: loss {host['loss']}, grad_norm {host['grad_norm']}; stopping. Its state is not saved; "
                "the newest checkpoint is " + (f"{self.checkpointer.directory}/{latest}" if latest is not None
                                               else "none"))
        now = time.perf_counter()
        step_time, self.last_done = now - self.last_done, now
        self.progress.update(1)
        if step % self.cfg.log_period and step != self.cfg.steps:
            return
        tps, tflops, mfu = flops.throughput(self.cfg, self.tokens_per_step, self.num_devices, step_time, self.peak)
        host.update(step_time_s=step_time, tokens_per_s_per_device=tps, tflops_per_device=tflops, mfu=mfu)
        self.last_record = self.writer.write(step, host)
        self.progress.write(metrics_lib.console_line(self.last_record))
        self.outputs.sync()

    def evaluation(self, step: int, record: dict) -> None:
        record = self.writer.write(step, record)
        self.progress.write(f"eval at step {step}: loss {record['eval_loss']:.4f}, perplexity "
                            f"{record['eval_perplexity']:.2f} over {record['eval_tokens']} tokens"
                            + (f", dropped {np.mean(record['eval_moe_dropped_fraction']):.3f}, overflow "
                               f"{np.sum(record['eval_moe_overflow']):.0f}" if "eval_moe_overflow" in record else "")
                            + (f", {record['eval_moe_rerun_batches']} batches rerun worst-case"
                               if record.get("eval_moe_rerun_batches") else ""))

    def close(self) -> None:
        self.progress.close()
        self.writer.close()


class Loop:
    """Steps start..cfg.steps. Each is dispatched before the previous one's metrics are waited for (`pending`),
    so the host's logging overlaps the device's work; a save or an evaluation first settles the step in flight."""

    def __init__(self, cfg, spec, mesh, global_batch: int, outputs, checkpointer, stop, log, start: int):
        self.cfg, self.checkpointer, self.stop, self.log, self.start = cfg, checkpointer, stop, log, start
        self.batch_sharding = sharding.batch_sharding(mesh)
        self.programs = StepPrograms(cfg, spec, self.batch_sharding, start, log)
        self.evaluate = Evaluator(cfg, spec, self.batch_sharding, global_batch) if cfg.eval_interval != -1 else None
        self.steps = StepLog(cfg, outputs, mesh.devices.size, global_batch, start, checkpointer)
        self.profiler = Profiler(cfg, outputs.local, start, log)
        self.pending = None

    def settle(self) -> None:
        """Finishes the step still in flight, if any (before a save or an eval reads its state)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.steps.step(*pending)

    def run(self, state, data) -> dict | None:
        cfg, checkpointer = self.cfg, self.checkpointer
        self.steps.last_done = time.perf_counter()
        for step in range(self.start, cfg.steps):
            try:
                local = next(data)
            except DataError as e:
                self.settle()
                raise DataError(f"{e}; {stopped_at(step, self.start, state, data, checkpointer)}") from None
            batch = jax.make_array_from_process_local_data(self.batch_sharding, local)
            self.profiler.before_step(step)
            state, step_metrics = self.programs(step, state, batch)
            self.profiler.after_step(step, state)
            self.settle()
            self.pending = (step + 1, step_metrics)
            stopping = self.stop.set and step + 1 < cfg.steps
            if checkpointer.due(step + 1, last=step + 1 == cfg.steps) or (stopping and checkpointer.enabled):
                self.settle()  # a state is saved only once its step is known to be finite
                checkpointer.save(step + 1, state, data.state())  # logs when it is durable
            checkpointer.poll()
            if self.evaluate and ((step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps):
                self.settle()  # the step's own record first
                self.steps.evaluation(step + 1, self.evaluate(state))
            if stopping:
                self.log(f"{self.stop.name}: stopped after step {step + 1}")
                break
        self.settle()
        return self.steps.last_record

    def close(self) -> None:
        self.profiler.stop()
        self.steps.close()
