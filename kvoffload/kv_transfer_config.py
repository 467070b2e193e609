"""The bounded reader of vLLM's ``--kv-transfer-config``: JSON text, or a JSON or TOML file, to a mapping.

The input is hostile until checked: a config file is read only if it is a regular file of
at most ``MAX_CONFIG_BYTES`` (``--config /dev/zero`` or a FIFO would never end), and JSON or
TOML nested past the recursion limit or holding an integer longer than Python converts is
a ``ConfigError`` naming the key and the fix, like every other failure here.

What the mapping says is not checked here: ``kvoffload.settings`` reads its keys. This
module knows nothing of offloading and imports only the standard library and
``kvoffload.errors``.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvoffload.errors import ConfigError

#: A configuration is a few hundred bytes; anything past this is not one (``/dev/zero``).
MAX_CONFIG_BYTES = 1 << 20

_MIB_TEXT = f"{MAX_CONFIG_BYTES >> 20} MiB"
_TOO_DEEP = "nested too deeply to be a configuration"
_TOO_DEEP_FIX = "a configuration is objects a few levels deep"
#: The fix for a number too long to be a setting (the settings' checks give it too).
DIGITS_FIX = "no setting needs more than 20 digits"


def parse_kv_transfer_config(raw: str | Mapping[str, Any]) -> Mapping[str, Any]:
    """vLLM's ``--kv-transfer-config`` (JSON text, or an already-parsed mapping) as a mapping."""
    if isinstance(raw, str):
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                "kv_transfer_config",
                f"{len(raw)} characters is more than the {_MIB_TEXT} a configuration may have",
                fix="give vLLM's --kv-transfer-config JSON, a few hundred bytes",
            )
        raw = _decode_json(raw, "kv_transfer_config", fix="quote the JSON in single quotes in the shell")
    if not isinstance(raw, Mapping):
        raise ConfigError("kv_transfer_config", "must be a JSON object")
    return raw


def _too_many_digits() -> str:
    return f"holds an integer longer than {sys.get_int_max_str_digits()} digits"


def _decode_json(text: str, key: str, *, prefix: str = "", fix: str) -> Any:
    """``json.loads(text)``, every failure a ``ConfigError(key, ...)``: syntax, depth, digits."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            key, f"{prefix}malformed JSON at line {e.lineno} column {e.colno}: {e.msg}", fix=fix
        ) from None
    except RecursionError:
        raise ConfigError(key, f"{prefix}JSON {_TOO_DEEP}", fix=_TOO_DEEP_FIX) from None
    except ValueError:  # int() past sys.get_int_max_str_digits(); JSONDecodeError is caught above
        raise ConfigError(key, f"{prefix}JSON {_too_many_digits()}", fix=DIGITS_FIX) from None


def read_kv_transfer_config(path: Path | str) -> Mapping[str, Any]:
    """Parse ``path`` as TOML when it ends in ``.toml``, else as JSON; ``ConfigError`` if it is not
    a regular file of at most ``MAX_CONFIG_BYTES`` holding a configuration."""
    path = Path(path)
    text = _read_config_text(path)
    if path.suffix.lower() == ".toml":
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(
                "--config", f"{path}: malformed TOML: {e}", fix="correct the TOML there"
            ) from None
        except RecursionError:
            raise ConfigError("--config", f"{path}: TOML {_TOO_DEEP}", fix=_TOO_DEEP_FIX) from None
        except ValueError:  # int() past sys.get_int_max_str_digits()
            raise ConfigError("--config", f"{path}: TOML {_too_many_digits()}", fix=DIGITS_FIX) from None
    else:
        data = _decode_json(text, "--config", prefix=f"{path}: ", fix="name a TOML file *.toml")
    if not isinstance(data, Mapping):
        raise ConfigError(
            "--config",
            f"{path}: the top level must be a JSON object",
            fix='write vLLM\'s JSON: {"kv_connector": "OffloadingConnector", ...}',
        )
    return data


def _read_fix(code: int | None) -> str:
    """Permission is one reason a file cannot be read; a loop of links or a failing disk are others."""
    if code in (errno.EACCES, errno.EPERM):
        return "give a file this user can read"
    if code == errno.ELOOP:
        return "the path is a loop of symbolic links: give the file's real path"
    if code == errno.EIO:
        return "the storage under the file failed (see dmesg): give a copy on a working disk"
    if code == errno.ENOTDIR:
        return "a component of the path is a file, not a directory: check the path"
    return "give a regular file this user can read"


def _read_config_text(path: Path) -> str:
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer before the
    # fstat below could refuse it. The type is checked on the open fd, not by a stat of
    # the path, so a swap between the check and the read changes nothing.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError("--config", f"{path} does not exist", fix="check the file's name") from None
    except OSError as e:
        raise ConfigError(
            "--config", f"cannot read {path}: {e.strerror or e}", fix=_read_fix(e.errno)
        ) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ConfigError(
                "--config",
                f"{path} is {_file_kind(mode)}, not a regular file",
                fix='give a JSON or TOML file (for a pipe: --kv-transfer-config "$(cat ...)")',
            )
        # fstat's size may lie (procfs says 0) or change under us: read one byte past the bound.
        data = b""
        while len(data) <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as e:
        raise ConfigError(
            "--config", f"cannot read {path}: {e.strerror or e}", fix=_read_fix(e.errno)
        ) from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            "--config",
            f"{path} is larger than the {_MIB_TEXT} a configuration may have",
            fix="give vLLM's --kv-transfer-config JSON (or its TOML), a few hundred bytes",
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            "--config",
            f"cannot read {path}: not UTF-8 ({e.reason} at byte {e.start})",
            fix="save it as UTF-8",
        ) from None


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a file")
