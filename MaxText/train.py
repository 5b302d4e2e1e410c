"""Training entry point: `python -m MaxText.train [config.yml] key=value ...`.

config -> (XLA flags, jax.distributed) -> mesh -> state (resume / load / init) -> loop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

if __name__ == "__main__" and not __package__:  # `python MaxText/train.py ...`, upstream's older form
    import runpy

    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, not MaxText/
    runpy.run_module("MaxText.train", run_name="__main__", alter_sys=True)

_SECOND_SIGINT = "SIGINT again: exiting now; the newest durable checkpoint is kept"

if __name__ == "__main__":  # from the first import on, SIGTERM (a scheduler's) or Ctrl-C only asks the run to stop
    _EARLY_SIGNALS = []

    def _early(signum, _):
        _EARLY_SIGNALS.append(signum)
        if _EARLY_SIGNALS.count(signal.SIGINT) > 1:
            print(f"\n{_SECOND_SIGINT}", file=sys.stderr, flush=True)
            os._exit(130)

    signal.signal(signal.SIGINT, _early)  # SIGTERM last: Python catches SIGINT from its start, so a handler for
    signal.signal(signal.SIGTERM, _early)  # SIGTERM is what tells another process that both are this one's

from MaxText.config import storage
from MaxText.config.errors import ConfigError, error_line
from MaxText.config.load import apply_xla_flags, global_batch_size, load_config
from MaxText.config.storage import describe
from MaxText.config.xla_flags import check_flags
from MaxText.data import make_data, validate
from MaxText.data.records import DataError
from MaxText.planning import flops
from MaxText.parallel.distributed import maybe_initialize_distributed, process_count
from MaxText.trainer.run_lock import automatic_run_name, run_lock


def run_directories(cfg) -> tuple[str, str]:
    """(run directory, checkpoint directory) as MaxText lays them out: absolute local paths, or gs:// URLs."""
    run_dir = storage.resolve(storage.join(cfg.base_output_directory, cfg.run_name))
    return run_dir, storage.join(run_dir, "checkpoints")


class NonFiniteError(RuntimeError):
    """The loss or gradient norm of a step was NaN or infinite; its state was never checkpointed."""


class StopFlag:
    """Set by SIGTERM (what schedulers send before preemption) or SIGINT (Ctrl-C): the loop checkpoints at the
    next step boundary and returns. A second SIGINT exits at once (status 130), saving nothing more. Installed
    only in the main thread; the previous handlers come back on exit. Under `python -m MaxText.train` a signal
    that came during the imports, before main() ran, sets it too."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.set, self.name, self.interrupts, self.previous = False, "SIGTERM", 0, {}

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        for signum in globals().get("_EARLY_SIGNALS", ()):  # read after taking over: none is lost in between
            self._handle(signum, None)
        return self

    def _handle(self, signum, frame):
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                print(f"\n{_SECOND_SIGINT}", file=sys.stderr, flush=True)
                os._exit(130)
            print("\nSIGINT: stopping after this step with a checkpoint (Ctrl-C again exits at once)",
                  file=sys.stderr, flush=True)
        if not self.set:
            self.set, self.name = True, signal.Signals(signum).name

    def __exit__(self, *exc):
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)

    def before_first_step(self, log) -> bool:
        """True (and says so) when a stop signal came before the first step: there is nothing to save."""
        if self.set:
            log(f"{self.name} during set-up, before the first step: nothing to save; stopping")
        return self.set


def input_position(saved, step: int, log):
    """This process's input position from a checkpoint's saved positions; None (the input stream restarts)
    when there are none or they were written by a different number of processes."""
    import jax

    if saved is None:
        log(f"warning: the checkpoint of step {step} holds no input position; the input stream restarts from its "
            "beginning")
        return None
    if saved["process_count"] != jax.process_count():
        log(f"warning: the checkpoint of step {step} holds input positions for {saved['process_count']} processes "
            f"and this run has {jax.process_count()}; the input stream restarts from its beginning")
        return None
    return saved["positions"][jax.process_index()]


class _Resumed:
    """An input stream resumed at a checkpoint's position, its first batch already read (a position the
    pipeline cannot resume from fails while the checkpoint is restored, not at the first step); state() is the
    position before that batch until it is taken."""

    def __init__(self, data):
        self.data, self.began = data, data.state()
        self.first = next(data)

    def __next__(self):
        if self.first is None:
            return next(self.data)
        batch, self.first = self.first, None
        return batch

    def state(self):
        return self.began if self.first is not None else self.data.state()


def initial_state(cfg, mesh, spec, checkpointer, log, make_input):
    """(state, input stream) from this run's newest readable checkpoint whose input position the pipeline can
    resume, else load_full_state_path (with its input position when saved beside it) or load_parameters_path
    (input from its beginning), else a fresh init. make_input(position) makes the stream (position None: from
    its beginning)."""
    # here, not at the top: JAX loads only after apply_xla_flags (XLA reads XLA_FLAGS once, at its start)
    from MaxText.trainer import checkpointing
    from MaxText.step.state import create_state

    def resumed(step, restored):
        state, saved_input = restored
        position = input_position(saved_input, step, log)
        try:
            return state, (_Resumed(make_input(position)) if position is not None else make_input(None))
        except (ConfigError, DataError):
            raise
        except Exception as e:  # noqa: BLE001 - whatever the pipeline makes of a position it could not have saved
            raise ValueError(f"its input position cannot be resumed: {describe(e)}") from None

    latest = checkpointer.restore_latest(spec.abstract, log, resume=resumed, fatal=(DataError,))
    if latest is not None:
        step, (state, data) = latest
        log(f"resuming from {checkpointer.directory}/{step}")
        return state, data
    if cfg.load_full_state_path:
        log(f"loading the full state from {cfg.load_full_state_path}")
        state, saved_input = checkpointing.load_full_state(cfg.load_full_state_path, spec.abstract, cfg)
        try:
            return resumed(int(state["step"]), (state, saved_input))
        except DataError:
            raise
        except ValueError as e:
            raise ConfigError(f"load_full_state_path={cfg.load_full_state_path}: {e}; give a checkpoint this "
                              "input pipeline wrote") from None
    state = create_state(cfg, mesh, spec)
    if cfg.load_parameters_path:
        params, bias = checkpointing.load_params(cfg.load_parameters_path, spec.abstract["params"], cfg,
                                                 spec.abstract.get("nnx_aux"))
        state["params"] = params
        if bias is not None:
            state["nnx_aux"] = bias
        log("loaded the params" + (" and the MoE routing biases" if bias is not None else "")
            + f" of {cfg.load_parameters_path} (step 0"
            + ("; the checkpoint holds no routing bias: it starts at zero" if "nnx_aux" in spec.abstract
               and bias is None else "") + ")")
    return state, make_input(None)


class _Repeat:
    """An input stream that yields its first batch forever (reuse_example_batch); state() is the stream's after
    that batch."""

    def __init__(self, data):
        self.data, self.batch = data, next(data)

    def __next__(self):
        return self.batch

    def state(self):
        return self.data.state()


def _whole_split(data) -> list:
    """eval_steps=-1: this process's eval batches up to the first one that is padding on every process (the
    eval stream pads after one pass over its split), so that all processes run the same number."""
    import jax
    import numpy as np

    batches = []
    while True:
        batch = next(data)
        done = not np.any(batch["targets_segmentation"])
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            done = bool(np.all(multihost_utils.process_allgather(np.int32(done))))
        if done:
            return batches
        batches.append(batch)


class Evaluator:
    """eval_steps batches of eval_split, read once and kept on device (they are the same every time), and the
    token-weighted mean cross-entropy of a state over them."""

    def __init__(self, cfg, spec, batch_sharding, global_batch: int):
        # here, not at the top: JAX loads only after apply_xla_flags (XLA reads XLA_FLAGS once, at its start)
        import jax

        from MaxText.step.train_step import jit_eval_step

        data = make_data(cfg, global_batch, jax.process_index(), jax.process_count(), split="eval")
        local = [next(data) for _ in range(cfg.eval_steps)] if cfg.eval_steps != -1 else _whole_split(data)
        self.batches = [jax.make_array_from_process_local_data(batch_sharding, batch) for batch in local]
        self.step = jit_eval_step(cfg, spec, batch_sharding)

    def __call__(self, state) -> dict:
        import jax
        import numpy as np

        sums = jax.device_get([self.step(state, batch) for batch in self.batches])
        loss_sum, tokens = sum(s["loss_sum"] for s in sums), sum(s["tokens"] for s in sums)
        loss = float(loss_sum / max(tokens, 1.0))
        record = {"eval_loss": loss, "eval_perplexity": float(np.exp(loss)), "eval_tokens": int(tokens)}
        if "moe_overflow" in sums[0]:  # per MoE layer, over all eval batches
            overflow = np.sum([s["moe_overflow"] for s in sums], axis=0)
            slots = max(float(sum(s["moe_slots"] for s in sums)), 1.0)
            record.update(eval_moe_overflow=overflow.tolist(), eval_moe_dropped_fraction=(overflow / slots).tolist())
        return record


def _stopped_at(step: int, start: int, state, data, checkpointer) -> str:
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


def _train(cfg, log, devices, stop) -> dict | None:
    # here, not at the top: JAX loads only after apply_xla_flags (XLA reads XLA_FLAGS once, at its start)
    import jax
    import numpy as np
    import tqdm

    from MaxText.trainer import metrics as metrics_lib
    from MaxText.parallel import sharding
    from MaxText.trainer.checkpointing import Checkpointer
    from MaxText.trainer.profiler import Profiler
    from MaxText.layers.moe.te_kernels import check_available, moe_runtime
    from MaxText.step.state import state_spec
    from MaxText.step.train_step import jit_train_step

    if stop.before_first_step(log):
        return None
    if cfg.hardware in ("gpu", "gpu_multiprocess") and jax.default_backend() != "gpu":
        raise ConfigError(f"hardware={cfg.hardware} but JAX found no GPU (its backend is {jax.default_backend()}); "
                          "check the CUDA install (jax[cuda]) and CUDA_VISIBLE_DEVICES, or set hardware=auto")
    check_available(cfg)  # te_dropless: TE and a suitable GPU, before the data and run directories (moe_runtime too)
    validate(cfg)  # the dataset and tokenizer are there (python_stdlib: built if missing)
    visible = len(devices) if devices is not None else jax.device_count()
    if cfg.num_devices and cfg.num_devices != visible:
        raise ConfigError(f"num_devices={cfg.num_devices} but {visible} devices are visible; launch on "
                          f"{cfg.num_devices} or set num_devices=null")
    mesh = sharding.create_mesh(cfg, devices)
    num_devices = mesh.devices.size
    global_batch = global_batch_size(cfg, num_devices)
    sharding.check_batch(cfg, mesh, global_batch)
    primary = jax.process_index() == 0
    run_dir, checkpoint_dir = run_directories(cfg)
    log(f"run {cfg.run_name}: mesh {dict(mesh.shape)}, global batch {global_batch} x {cfg.max_target_length} "
        f"tokens, moe_impl={cfg.moe_impl}, outputs in {run_dir}")

    spec = state_spec(cfg, mesh)
    from MaxText.planning.plan import check_fits  # too big is a one-line error here, not a hang in XLA's allocator

    check_fits(cfg, spec, dict(mesh.shape), num_devices, log)
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
            data = _Repeat(data)
        batch_sharding = sharding.batch_sharding(mesh)
        step_fn = jit_train_step(cfg, spec, batch_sharding)
        evaluate = Evaluator(cfg, spec, batch_sharding, global_batch) if cfg.eval_interval != -1 else None
        writer = metrics_lib.MetricsWriter(outputs.local, tensorboard=cfg.enable_tensorboard, primary=primary,
                                           config=cfg.to_dict())
        peak = flops.peak_tflops(jax.devices()[0].device_kind)
        tokens_per_step = global_batch * cfg.max_target_length
        progress = tqdm.tqdm(total=cfg.steps, initial=start, disable=not primary, unit="step",
                             dynamic_ncols=True, leave=False)
        profiler = Profiler(cfg, outputs.local, start, log)
        if stop.before_first_step(log):
            progress.close()
            writer.close()
            return None
        if start == 0 and cfg.save_checkpoint_on_start and checkpointer.enabled and checkpointer.latest_step() is None:
            checkpointer.save(0, state, data.state())
        last_record, pending = None, None
        last_done = time.perf_counter()

        def finish(step, device_metrics):
            """Waits for step's metrics (the next step is usually already dispatched), stops the run on a
            non-finite loss or gradient, and logs them."""
            nonlocal last_done, last_record
            host = jax.device_get(device_metrics)
            if not (np.isfinite(host["loss"]) and np.isfinite(host["grad_norm"])):
                latest = checkpointer.latest_step()
                raise NonFiniteError(
                    f"step {step}: loss {host['loss']}, grad_norm {host['grad_norm']}; stopping. Its state is "
                    f"not saved; the newest checkpoint is " + (f"{checkpoint_dir}/{latest}" if latest is not None
                                                               else "none"))
            now = time.perf_counter()
            step_time, last_done = now - last_done, now
            progress.update(1)
            if step % cfg.log_period and step != cfg.steps:
                return
            tps, tflops, mfu = flops.throughput(cfg, tokens_per_step, num_devices, step_time, peak)
            host.update(step_time_s=step_time, tokens_per_s_per_device=tps, tflops_per_device=tflops, mfu=mfu)
            last_record = writer.write(step, host)
            progress.write(metrics_lib.console_line(last_record))
            outputs.sync()

        def settle():
            """Finishes the step still in flight, if any (before a save or an eval reads its state)."""
            nonlocal pending
            if pending is not None:
                finish(*pending)
                pending = None

        try:
            for step in range(start, cfg.steps):
                try:
                    local = next(data)
                except DataError as e:
                    settle()
                    raise DataError(f"{e}; {_stopped_at(step, start, state, data, checkpointer)}") from None
                batch = jax.make_array_from_process_local_data(batch_sharding, local)
                profiler.before_step(step)
                state, step_metrics = step_fn(state, batch)
                profiler.after_step(step, state)
                settle()
                pending = (step + 1, step_metrics)
                stopping = stop.set and step + 1 < cfg.steps
                if checkpointer.due(step + 1, last=step + 1 == cfg.steps) or (stopping and checkpointer.enabled):
                    settle()  # a state is saved only once its step is known to be finite
                    checkpointer.save(step + 1, state, data.state())  # logs when it is durable
                checkpointer.poll()
                if evaluate and ((step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.steps):
                    settle()  # the step's own record first
                    record = writer.write(step + 1, evaluate(state))
                    progress.write(f"eval at step {step + 1}: loss {record['eval_loss']:.4f}, perplexity "
                                   f"{record['eval_perplexity']:.2f} over {record['eval_tokens']} tokens"
                                   + (f", dropped {np.mean(record['eval_moe_dropped_fraction']):.3f}, overflow "
                                      f"{np.sum(record['eval_moe_overflow']):.0f}"
                                      if "eval_moe_overflow" in record else ""))
                if stopping:
                    log(f"{stop.name}: stopped after step {step + 1}")
                    break
            settle()
        finally:
            profiler.stop()
            progress.close()
            writer.close()
    return last_record


def main(argv=None) -> int:
    with StopFlag() as stop:  # SIGTERM or Ctrl-C from here on exits 0 (see train)
        return _main(sys.argv[1:] if argv is None else argv, stop)


def _main(argv, stop) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\nEvery key, with its default and meaning: configs/base.yml")
        return 0
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2
    if cfg.xla_flags:  # an unknown flag would abort XLA at start with a C++ fatal error: say it in one line
        problems = check_flags(cfg.xla_flags)
        if problems:
            print(f"error: xla_flags: {problems[0].message}", file=sys.stderr)
            return 2
    try:
        processes = process_count()  # the launcher's variables, checked before JAX starts
    except ConfigError as e:
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2
    apply_xla_flags(cfg)  # before anything starts the JAX backend
    # here, not at the top: JAX loads only after apply_xla_flags (XLA reads XLA_FLAGS once, at its start)
    from MaxText.trainer.checkpointing import CheckpointError, SaveTimeout

    try:
        maybe_initialize_distributed(cfg)
        if cfg.run_name is None:
            if processes > 1:
                raise ConfigError("run_name must be set for a multi-process run (each process would pick "
                                  "a different timestamp); add run_name=<name>")
            with cfg.unlocked():
                cfg.run_name = automatic_run_name()
        train(cfg, stop=stop)
    except ConfigError as e:
        print(f"error: {error_line(e)}", file=sys.stderr)
        sys.unraisablehook = lambda *_: None  # Orbax's abandoned coroutines would print tracebacks at exit
        return 2
    except DataError as e:  # a bad document met mid-run (what start-up cannot see without reading all the data)
        print(f"error: {error_line(e)}", file=sys.stderr)
        return 2
    except (NonFiniteError, CheckpointError) as e:
        print(f"error: {error_line(e)}", file=sys.stderr)
        if isinstance(e, SaveTimeout):  # Orbax's writer threads may be stuck for good: exit without joining them
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
