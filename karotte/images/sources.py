"""Image sources made on this host, each into one uncompressed tar layer that the store
then imports like any other: `dir:` trees and `debian:` builds by mmdebstrap.

- A `dir:` tree is read without following links (tarfile.add, names sorted): the tree is
  hashed, not trusted, and the layer is unpacked under extract's rules, so a device node
  or a hard link out of the tree is refused there as in any image.
- A `debian:` build runs mmdebstrap (`--variant=apt --include=...`), in `unshare` mode
  when the caller is root, so that maintainer scripts run as no host root;
  `--skip=output/dev` keeps device nodes out of the tar. As root it runs in a network
  namespace whose only way out is the egress proxy, allowing Debian's archive and
  `$KAROTTE_BUILD_ALLOW` (karotte/build_network.py, EGRESS-BUILD-01).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tarfile

from ..build_network import run_build
from ..imageref import ImageRef
from .oci import ImageError

DEBIAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The image config's `config` of each kind (the layer is all there is of the image).
DIR_RUN = {"Env": [f"PATH={DEBIAN_PATH}"]}
DEBIAN_RUN = {"Env": [f"PATH={DEBIAN_PATH}"], "WorkingDir": "/"}


def dir_layer(path: str, out: str) -> None:
    """The tree at path as a tar layer written to out (new)."""
    if not os.path.isdir(path):
        raise ImageError(f"dir:{path} is not a directory; give the root of a tree")
    with tarfile.open(out, mode="x", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(os.listdir(path)):
            tar.add(os.path.join(path, entry), arcname=entry)


def debian_layer(ref: ImageRef, out: str) -> None:
    """The root filesystem mmdebstrap builds for ref, as a tar layer written to out."""
    mmdebstrap = shutil.which("mmdebstrap")
    if mmdebstrap is None:
        raise ImageError("debian: images are built by mmdebstrap, which is not installed: "
                         "apt-get install mmdebstrap (scripts/setup installs it)")
    argv = [mmdebstrap, "--quiet", "--variant=apt", "--skip=output/dev"]
    if os.geteuid() == 0:
        argv.append("--mode=unshare")  # maintainer scripts run as no host root
    if ref.packages:
        argv.append("--include=" + ",".join(ref.packages))
    argv += [str(ref.suite), out]
    # as root, its apt and hooks reach only Debian's archive (karotte/build_network.py)
    done = run_build(argv, stdin=subprocess.DEVNULL, capture_output=True)
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-5:]
        raise ImageError(f"mmdebstrap failed building {ref} (exit {done.returncode}): "
                         + " / ".join(tail) + "; check the suite and package names "
                         "and that Debian's archive is reachable")
