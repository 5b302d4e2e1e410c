"""What a user's mistake becomes: ConfigError, and the one bounded line it is shown as (no JAX here).

    raise ConfigError(f"{key}={shown(value)} ... use ...")    # names the key and the fix
    print("error: " + error_line(e), file=sys.stderr)         # one line, at most ERROR_LINE_LIMIT characters
"""

from __future__ import annotations

import reprlib


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message names the key and the fix."""


def clip(text: str, limit: int = 80) -> str:
    """A user's value in an error line: at most `limit` characters of it, and its size when it is longer."""
    return text if len(text) <= limit else f"{text[:limit - 3]}... ({len(text)} characters)"


# repr of a user's value that never expands it whole (a YAML alias bomb is a small file and an endless repr).
_SHORT_REPR = reprlib.Repr(maxlevel=3, maxlist=4, maxtuple=4, maxdict=4, maxstring=60, maxother=60)


def shown(value) -> str:
    """A user's value (any YAML) in an error line: its repr, bounded however large or nested it is."""
    return clip(_SHORT_REPR.repr(value))


ERROR_LINE_LIMIT = 1000


def error_line(error: BaseException | str) -> str:
    """What follows `error: ` on stderr: the message on one line, the line (with `error: `) at most
    ERROR_LINE_LIMIT characters whatever a value in it held."""
    text = " ".join(str(error).split())
    room = ERROR_LINE_LIMIT - len("error: ")  # the whole line, prefix and size included, within the limit
    if len(text) > room:
        suffix = f"... ({len(text)} characters)"
        text = text[:room - len(suffix)] + suffix
    return text or type(error).__name__
