"""Training entry point: `python -m MaxText.train [config.yml] key=value ...`.

config -> (XLA flags, jax.distributed) -> MaxText/trainer/loop.py's train: mesh -> state (resume / load / init)
-> loop. Exit status: 0 done or stopped by SIGTERM / Ctrl-C (with a checkpoint), 1 a failed run, 2 a user's
mistake (one line), 130 a second Ctrl-C.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # `python MaxText/train.py ...`, upstream's older form
    import runpy

    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, not MaxText/
    runpy.run_module("MaxText.train", run_name="__main__", alter_sys=True)

from MaxText.trainer.signals import EARLY, StopFlag  # noqa: E402 - stdlib only: the signals are caught next

if __name__ == "__main__":  # from here on, SIGTERM (a scheduler's) or Ctrl-C during the imports only asks to stop
    EARLY.catch()

from MaxText.config.errors import ConfigError, error_line  # noqa: E402
from MaxText.config.load import apply_xla_flags, load_config, replace  # noqa: E402
from MaxText.config.xla_flags import check_flags  # noqa: E402
from MaxText.data.records import DataError  # noqa: E402
from MaxText.parallel.distributed import maybe_initialize_distributed, process_count  # noqa: E402
from MaxText.trainer.run_lock import automatic_run_name  # noqa: E402


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
    from MaxText.trainer.loop import NonFiniteError, train

    try:
        maybe_initialize_distributed(cfg)
        if cfg.run_name is None:
            if processes > 1:
                raise ConfigError("run_name must be set for a multi-process run (each process would pick "
                                  "a different timestamp); add run_name=<name>")
            cfg = replace(cfg, run_name=automatic_run_name())
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
