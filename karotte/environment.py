"""Environment: what a task author writes.

An environment is a class, importable as ``module:Name`` and constructible without
arguments. The trainer's process calls prompt(), workspace_files() and hidden_files();
grade() runs only inside the grading sandbox, a fresh sandbox that holds the hidden
files and a vetted copy of the agent's deliverables, never in the trainer and never
next to the agent.

    class Addition(Environment):
        deliverables = ("answer.txt",)

        def numbers(self, seed):  # every value comes from a named stream; the seed is never shown
            rng = random.Random(f"addition:{seed}")
            return rng.randint(1000, 9999), rng.randint(1000, 9999)

        def prompt(self, seed):
            a, b = self.numbers(seed)
            return f"Write {a} + {b} as a decimal integer to /workspace/answer.txt."

        def hidden_files(self, seed):
            return {"expected.txt": str(sum(self.numbers(seed)))}

        def grade(self, ctx):
            expected = (ctx.hidden / "expected.txt").read_text()
            answer = ctx.read_deliverable("answer.txt", limit=100)
            return 1.0 if answer is not None and answer.strip() == expected.encode() else 0.0

`seed` is not the trainer's: Karotte derives it with a key only the host holds
(karotte/seeding.py), so an agent cannot find it and run the public generator for the
hidden data. docs/examples.md says how a generator stays safe.

This module is imported inside the grading sandbox too (by the host's system Python with
only the standard library, or by a grader image's python3, 3.9 or newer): keep its imports
to spec and the standard library, and its code to what Python 3.9 runs.
"""
from __future__ import annotations

import importlib
import math
import numbers
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

from .spec import GiB, MiB, SandboxSpec, ScanLimits, SpecError

if TYPE_CHECKING:
    from .grader_runtime import GradeContext


@dataclass(frozen=True)
class File:
    """A file to place in the agent's workspace, with its mode."""

    content: bytes | str
    mode: int = 0o644

    def __post_init__(self):
        if not isinstance(self.content, (bytes, str)):
            raise TypeError(f"File content must be bytes or str, got "
                            f"{type(self.content).__name__}")
        if isinstance(self.mode, bool) or not isinstance(self.mode, int) \
                or not 0 <= self.mode <= 0o777:
            raise ValueError(f"File mode must be permission bits from 0 to 0o777 (no setuid, "
                             f"setgid or sticky bit: custody rejects them), got {self.mode!r}")

    def data(self) -> bytes:
        return self.content.encode() if isinstance(self.content, str) else self.content


@dataclass(frozen=True)
class Grade:
    """What grade() may return instead of a bare float."""

    reward: float
    details: Mapping[str, Any] = field(default_factory=dict)  # JSON-serialisable

    def __post_init__(self):
        # Any real number is a reward (a Fraction, a numpy float): sent as a float. What
        # is not one is left for the grader runtime to report as an invalid reward.
        if isinstance(self.reward, numbers.Real) and not isinstance(self.reward, bool):
            object.__setattr__(self, "reward", float(self.reward))


@dataclass(frozen=True)
class Network:
    """What the sandboxes of one phase of an episode may reach through the host-side
    egress proxy (docs/egress.md, "Networks of an environment"): an allow-list of
    karotte.egress.parse_policy's grammar, and named upstreams by URL. Plain data, parsed
    in the trainer's process only: this class's text is readable by the agent, so it holds
    no credential. An upstream's headers come from the trainer, as
    Episode(upstream_headers=...) or from the environment variables of the trainer's
    process that headers_from_env names; they never enter a sandbox."""

    allow: Sequence[str] = ()
    upstreams: Mapping[str, str] = field(default_factory=dict)  # name -> http(s) URL
    # upstream name -> header -> the NAME of a variable of the trainer's environment
    headers_from_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # "proxy" (the host-side proxy), or "ip": a veth and nftables rules by address and
    # port, for protocols that are not HTTP; root callers only, no upstreams (docs/network.md)
    mode: str = "proxy"

    def __post_init__(self):
        if self.mode not in ("proxy", "ip"):
            raise ValueError(f"Network.mode is 'proxy' or 'ip' (a veth with nftables rules, "
                             f"root only), got {self.mode!r}")
        if self.mode == "ip" and self.upstreams:
            raise ValueError("Network.upstreams are the proxy mode's (plain HTTP the host "
                             "sends on with TLS and credentials); the ip mode has none: "
                             "list the upstream's host:port in allow instead")
        if isinstance(self.allow, str) or not isinstance(self.allow, Sequence) or not all(
                isinstance(a, str) for a in self.allow):
            raise TypeError(f"Network.allow is a tuple of entries such as ('pypi.org', "
                            f"'*.pythonhosted.org'), got {self.allow!r}")
        if not (isinstance(self.upstreams, Mapping) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.upstreams.items())):
            raise TypeError("Network.upstreams maps a name to a URL as str "
                            "({'model': 'https://api.example.com/v1'}); its headers come "
                            f"from the trainer (headers_from_env), got {self.upstreams!r}")
        heads = self.headers_from_env
        if not (isinstance(heads, Mapping) and all(
                isinstance(h, Mapping) and all(isinstance(k, str) and isinstance(v, str)
                                               for k, v in h.items())
                for h in heads.values())):
            raise TypeError("Network.headers_from_env maps an upstream to {header: name of a "
                            "variable of the trainer's environment}, such as {'model': "
                            f"{{'Authorization': 'MODEL_AUTH'}}}}, got {heads!r}")
        unknown = sorted(set(heads) - set(self.upstreams))
        if unknown:
            raise ValueError(f"Network.headers_from_env names the upstreams {unknown}, which "
                             f"Network.upstreams does not declare ({sorted(self.upstreams)})")


class Environment:
    """Base class of a task. Override prompt() and grade(); the rest has defaults."""

    #: the agent's root filesystem: "host" (the host's userland, read-only) or an image
    #: reference of docs/images.md ("debian:bookworm+python3-pytest", "oci:/srv/task:v1",
    #: "docker-archive:/srv/task.tar", "dir:/srv/rootfs", a name given at import). The
    #: programs the grader runs with ctx.run run on it too.
    image: ClassVar[str] = "host"
    #: the grading sandbox's root filesystem; None (the default): the agent's image. The
    #: grader runs under its python3 (/usr/bin/python3, else the first on its PATH), 3.9
    #: or newer, with whatever it holds (pytest, numpy)
    grader_image: ClassVar[str | None] = None
    #: the agent's sandbox (its image is `image`)
    limits: ClassVar[SandboxSpec] = SandboxSpec()
    #: the grading sandbox (its image is `grader_image`); its timeout bounds the whole
    #: grading, nested runs included
    grader_limits: ClassVar[SandboxSpec] = SandboxSpec(memory=1 * GiB, pids=256, timeout=300.0,
                                                       disk=256 * MiB)
    #: paths that grade() reads: relative ones under /workspace; on an image also absolute
    #: ones outside it ("/etc/nginx/nginx.conf"), which are in the agent's diff of the
    #: image (ctx.changes). A violation on one (a symlink, a FIFO, a file over the size
    #: cap...) scores the bottom reward with a reason.
    deliverables: ClassVar[Sequence[str]] = ()
    #: what the agent's sandbox reaches through the host-side egress proxy (a Network);
    #: None (the default): loopback only
    network: ClassVar[Network | None] = None
    #: what the sandboxes of the grader's ctx.run reach, its own list; None: loopback only.
    #: The grading sandbox itself has no network
    grader_network: ClassVar[Network | None] = None
    #: the custody scan's budgets (docs/scan.md); tighten them to what the task needs
    scan_limits: ClassVar[ScanLimits] = ScanLimits()
    #: (bottom, top) of the rewards grade() returns; a give-up or a failure scores bottom
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    #: a deep task's reward does not saturate (a measured speedup): `karotte check` then
    #: asks the reference solution to beat the bottom, not to reach the top
    deep: ClassVar[bool] = False

    def prompt(self, seed: int) -> str:
        raise NotImplementedError(f"{type(self).__name__} must define prompt(seed)")

    def workspace_files(self, seed: int) -> Mapping[str, bytes | str | File]:
        """Files the agent starts with, by path relative to /workspace."""
        return {}

    def hidden_files(self, seed: int) -> Mapping[str, bytes | str]:
        """Files only the grader sees, at /hidden in the grading sandbox."""
        return {}

    def grade(self, ctx: "GradeContext") -> float | Grade:
        """Runs in the grading sandbox. ctx gives the vetted deliverables, the hidden files
        and ctx.run() for the agent's programs (in a sandbox nested under the grader's)."""
        raise NotImplementedError(f"{type(self).__name__} must define grade(ctx)")

    def reference_solution(self, seed: int) -> Sequence[str]:
        """Bash commands that solve the task, for `karotte run` and `karotte check`."""
        return ()


MAX_DELIVERABLE_BYTES = 255  # so that a cut path in a record still names it (scan.py)


def check_path(path: object, what: str) -> str:
    """path as a file path relative to a root it must stay inside, or ValueError/TypeError
    naming the mistake: not a str, empty, absolute, with '.', '..' or an empty component,
    ending in '/', with a NUL byte."""
    if not isinstance(path, str):
        raise TypeError(f"{what} must be a relative path as a str, got "
                        f"{type(path).__name__} {path!r}")
    if "\0" in path:
        raise ValueError(f"{what} {path!r} contains a NUL byte")
    if not path or path.startswith("/"):
        raise ValueError(f"{what} {path!r} must be a relative path (say 'data/input.txt' for "
                         "data/input.txt under /workspace, or /hidden), not empty or absolute")
    if path.endswith("/"):
        raise ValueError(f"{what} {path!r} ends in '/': name a file; a directory is made for "
                         "the files in it")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise ValueError(f"{what} {path!r} has an empty, '.' or '..' component; write the "
                         "path plainly, inside the workspace")
    return path


def check_files(files: object, what: str, *, allow_file: bool) -> dict[str, bytes | str | File]:
    """What workspace_files() (allow_file: File values too) or hidden_files() returned, as
    a dict, or an error naming the bad entry and the fix."""
    if not isinstance(files, Mapping):
        raise TypeError(f"{what}() must return a mapping of relative path to content, got "
                        f"{type(files).__name__}")
    types = (bytes, str, File) if allow_file else (bytes, str)
    out: dict[str, bytes | str | File] = {}
    for path, content in files.items():
        check_path(path, f"a key of {what}()")
        if not isinstance(content, types):
            hint = "; File (with a mode) is for workspace_files only" \
                if isinstance(content, File) else ""
            raise TypeError(f"{what}()[{path!r}] must be " + (
                "bytes, str or File" if allow_file else "bytes or str") +
                f", got {type(content).__name__}{hint}")
        out[path] = content
    return out


def check_environment(env: object) -> Environment:
    """env itself if it is an Environment instance whose class attributes make sense, or an
    error naming the mistake and the fix. Called when an episode is made, so that a
    mistake fails there and not when the first agent is done."""
    if isinstance(env, type):
        raise TypeError(f"got the class {env.__qualname__}, not an instance of it; pass "
                        f"{env.__qualname__}() (or the string 'module:{env.__qualname__}')")
    if not isinstance(env, Environment):
        raise TypeError(f"an episode needs an Environment instance or its 'module:Name', got "
                        f"{type(env).__name__} {env!r}")
    name = type(env).__qualname__
    deliverables = env.deliverables
    if isinstance(deliverables, (str, bytes)) or not isinstance(deliverables, Sequence):
        raise TypeError(f"{name}.deliverables must be a tuple of paths, such as "
                        f"('answer.txt',), got {deliverables!r}")
    for d in deliverables:
        if isinstance(d, str) and d.startswith("/"):
            _check_absolute_deliverable(d, name, env.image)
        else:
            check_path(d, f"{name}.deliverables entry")
        if len(d.encode("utf-8", "surrogateescape")) > MAX_DELIVERABLE_BYTES \
                or not d.isprintable() or "\\" in d:
            raise ValueError(f"{name}.deliverables entry {d!r} must be printable text without "
                             f"a backslash, at most {MAX_DELIVERABLE_BYTES} bytes")
    for attr, kind in (("limits", SandboxSpec), ("grader_limits", SandboxSpec),
                       ("scan_limits", ScanLimits)):
        if not isinstance(getattr(env, attr), kind):
            raise TypeError(f"{name}.{attr} must be a {kind.__name__}, got "
                            f"{type(getattr(env, attr)).__name__}")
    _check_images(env, name)
    _check_networks(env, name)
    bounds = env.reward_range
    if not (isinstance(bounds, tuple) and len(bounds) == 2
            and all(isinstance(b, numbers.Real) and not isinstance(b, bool)
                    and math.isfinite(b) for b in bounds) and bounds[0] < bounds[1]):
        raise ValueError(f"{name}.reward_range must be (bottom, top), two finite numbers with "
                         f"bottom < top, got {bounds!r}")
    return env


# Where an absolute deliverable cannot be: mounts of every sandbox of their own, which
# are no part of the image's diff (docs/images.md, "Custody of the diff").
NOT_IN_DIFF = {"/workspace": "the workspace: name its files relative to it ('answer.txt')",
               "/tmp": "a tmpfs of the agent's sandbox, gone with it",
               "/home/agent": "a tmpfs of the agent's sandbox, gone with it",
               "/proc": "the sandbox's procfs", "/dev": "the sandbox's device nodes",
               "/sys": "not in any sandbox"}


def _check_absolute_deliverable(path: str, name: str, image: object) -> None:
    """An absolute deliverable: on an image only, a file or directory of the agent's diff
    (karotte/custody.py), written plainly and outside the sandbox's own mounts."""
    what = f"{name}.deliverables entry {path!r}"
    if image == "host":
        raise ValueError(f"{what} is absolute: on the host's userland the agent can change "
                         "/workspace only, so a deliverable is a path relative to it; absolute "
                         f"paths are for an image's diff (declare {name}.image, "
                         "docs/images.md)")
    if "\0" in path:
        raise ValueError(f"{what} contains a NUL byte")
    parts = path[1:].split("/")
    if path == "/" or path.endswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{what} must name one file or directory plainly: no '.', '..' or "
                         "empty component, not '/' itself, no '/' at the end")
    for top, why in NOT_IN_DIFF.items():
        if path == top or path.startswith(top + "/"):
            raise ValueError(f"{what} is under {top}, {why}; an absolute deliverable is a "
                             "path of the image that the agent changes (/etc/..., /usr/..., "
                             "/app/...)")


def _check_images(env: Environment, name: str) -> None:
    """image and grader_image in the grammar of image references, and no image set in the
    limits themselves: the image of each sandbox is declared in one place."""
    for attr, value in (("image", env.image), ("grader_image", env.grader_image)):
        if value is None and attr == "grader_image":
            continue
        try:
            SandboxSpec(image=value)
        except SpecError as exc:
            raise ValueError(f"{name}.{attr} must be {exc.requirement}, got {value!r}") from None
    for attr, declared in (("limits", "image"), ("grader_limits", "grader_image")):
        spec = getattr(env, attr)
        if spec.image != "host":
            raise ValueError(f"{name}.{attr} names the image {spec.image!r}; declare it as "
                             f"{name}.{declared} = {spec.image!r} instead (the limits take "
                             f"their image from there)")


def _check_networks(env: Environment, name: str) -> None:
    """network and grader_network are Networks or None, and no network is set in the
    limits themselves: each phase's network is declared in one place, as plain data."""
    for attr in ("network", "grader_network"):
        value = getattr(env, attr)
        if value is not None and not isinstance(value, Network):
            raise TypeError(f"{name}.{attr} must be a karotte.environment.Network "
                            f"(Network(allow=('pypi.org',))) or None, got {value!r}")
    for attr, declared in (("limits", "network"), ("grader_limits", "grader_network")):
        if getattr(env, attr).network != "none":
            raise ValueError(f"{name}.{attr} sets a network; declare it as {name}.{declared} "
                             f"= Network(allow=(...)) instead (the grader imports this class, "
                             "and the credentials come from the trainer)")


def grader_image_of(env: Environment) -> str:
    """The grading sandbox's image: grader_image, or the agent's image when it is None."""
    return env.image if env.grader_image is None else env.grader_image


def agent_spec(env: Environment) -> SandboxSpec:
    """The agent's sandbox: env.limits on env.image (on "host", env.limits itself)."""
    return env.limits if env.image == "host" else replace(env.limits, image=env.image)


def grader_spec(env: Environment) -> SandboxSpec:
    """The grading sandbox: env.grader_limits on the grader's image."""
    image = grader_image_of(env)
    return env.grader_limits if image == "host" else replace(env.grader_limits, image=image)


def load(target: str) -> type[Environment]:
    """'package.module:Name', or 'package.module' holding exactly one Environment."""
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    if attr:
        cls = getattr(module, attr, None)
        if cls is None:
            raise ValueError(f"{module_name} has no attribute {attr!r}")
    else:
        found = [v for v in vars(module).values() if isinstance(v, type)
                 and issubclass(v, Environment) and v is not Environment
                 and v.__module__ == module.__name__]
        if len(found) != 1:
            raise ValueError(f"{module_name} defines {len(found)} Environment classes; "
                             f"name one as {module_name}:Name")
        cls = found[0]
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"{target} is not an Environment subclass")
    return cls


def target_of(env: Environment) -> str:
    """The 'module:Name' that loads env's class again (in the grading sandbox)."""
    cls = type(env)
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise ValueError(f"{cls.__qualname__} must be defined at the top level of an importable "
                         "module: the grader imports it again inside its sandbox")
    return f"{cls.__module__}:{cls.__qualname__}"
