"""How a trainer's episode seed becomes the seed an environment sees: through a key the host holds.

An environment's generators are public: its source is on the trainer's disk, often on the
internet, and the agent may have been trained on it. If prompt(), workspace_files() and
hidden_files() got the trainer's seed (0, 1, 2, ...), an agent could find it from what it
sees (try every small seed until the visible files match), run the public generator for
the hidden inputs and ship a table of their answers; an RL policy that meets the same seeds
again would simply remember them. So the environment never gets the trainer's seed. It gets

    HMAC-SHA256(key, "karotte-episode-seed", module:Class, seed), as a 63-bit integer,

with a key that only the host holds: nothing the agent sees, plus the public source,
predicts the hidden data. The same key and seed give the same episode (reproducible);
another key gives other episodes.

The key, first found of:
1. ``key=`` given to Episode / AsyncEpisode (bytes or str, at least 16 bytes);
2. the environment variable KAROTTE_KEY (text, at least 16 bytes);
3. the file named by KAROTTE_KEY_FILE, else ``$XDG_CONFIG_HOME/karotte/episode-key``
   (``~/.config/karotte/episode-key``), made with 32 random bytes, mode 0600, on first use.
   Sandboxes never see the trainer's home. Give every machine of a cluster the same key
   (KAROTTE_KEY, or the same file) to get the same episodes everywhere.

If that file can be neither read nor made, the process uses a random key of its own and
warns once: its episodes are then not reproducible in another process.

Standard library only: the grading sandbox imports nothing of this.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import warnings
from pathlib import Path

from .errors import KarotteError

KEY_ENV = "KAROTTE_KEY"
KEY_FILE_ENV = "KAROTTE_KEY_FILE"
MIN_KEY_BYTES = 16
SEED_BITS = 63  # fits a signed 64-bit integer: numpy, bash arithmetic, int64_t
_DOMAIN = b"karotte-episode-seed\0"

_lock = threading.Lock()
_process_key: bytes | None = None  # when no key file can be read or made


class EpisodeKeyError(KarotteError):
    """The episode key is unusable (too short, unreadable)."""


def key_file() -> Path:
    """Where the host's episode key lives (KAROTTE_KEY_FILE, else the XDG config dir)."""
    if os.environ.get(KEY_FILE_ENV):
        return Path(os.environ[KEY_FILE_ENV])
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "karotte" / "episode-key"


def _checked(key: bytes, where: str) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise EpisodeKeyError(
            f"the episode key from {where} is {len(key)} bytes; at least {MIN_KEY_BYTES} are "
            "needed, or an agent could guess it and predict the hidden data (make one with "
            "`python3 -c 'import secrets; print(secrets.token_hex(32))'`)")
    return key


def _read_or_make(path: Path) -> bytes:
    """The key in path; made first (atomically: a second process reads the first's)."""
    try:
        return path.read_bytes().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process made it first: take theirs
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return path.read_bytes().strip()


def host_key() -> bytes:
    """The host's episode key: KAROTTE_KEY, else the key file (made on first use)."""
    global _process_key
    text = os.environ.get(KEY_ENV)
    if text:
        return _checked(text.encode(), f"${KEY_ENV}")
    path = key_file()
    try:
        return _checked(_read_or_make(path), str(path))
    except OSError as exc:
        with _lock:
            if _process_key is None:
                _process_key = secrets.token_bytes(32)
                warnings.warn(
                    f"karotte: the episode key file {path} can be neither read nor made "
                    f"({exc.strerror}); this process uses a random key, so its episodes are "
                    f"not reproducible elsewhere. Set {KEY_ENV} (or {KEY_FILE_ENV}) to fix "
                    "that.", RuntimeWarning, stacklevel=2)
            return _process_key


def as_key(key: bytes | str | None) -> bytes:
    """A caller's key= (bytes or str), or the host's key for None."""
    if key is None:
        return host_key()
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"key must be bytes or str, got {type(key).__name__}")
    return _checked(bytes(key), "key=")


def env_name(env: object) -> str:
    """module:Class of an environment (its class's), the name the seed is derived under."""
    cls = env if isinstance(env, type) else type(env)
    return f"{cls.__module__}:{cls.__qualname__}"


def env_seed(env: object, seed: int, key: bytes | str | None = None) -> int:
    """The seed env's methods get for the trainer's `seed`: a 63-bit number that only a
    holder of the key can compute."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"an episode seed must be an int, got {type(seed).__name__} {seed!r}")
    message = _DOMAIN + env_name(env).encode() + b"\0" + str(seed).encode()
    digest = hmac.new(as_key(key), message, hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)
