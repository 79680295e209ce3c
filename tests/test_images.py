"""Image references (one grammar) and the format readers, against what umoci and skopeo
write: every form of the same image unpacks to the same tree, which is umoci's own."""
from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from karotte.images import (GRAMMAR, DigestMismatch, ImageError, ImageRef, ImageRefError, Store,
                            parse, parse_name)
from karotte import imageref as ref_module
from karotte.images.extract import manifest
from karotte.images.oci import host_arch

TOOLS = ("umoci", "skopeo", "zstd")


# -- the grammar --------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("host", ImageRef("host")),
    ("dir:/opt/rootfs", ImageRef("dir", path="/opt/rootfs")),
    ("dir:rel/a:b", ImageRef("dir", path="rel/a:b")),
    ("oci:/srv/layout", ImageRef("oci", path="/srv/layout")),
    ("oci:/srv/layout:chess-best-move", ImageRef("oci", path="/srv/layout", tag="chess-best-move")),
    ("oci:L:v1.2_rc", ImageRef("oci", path="L", tag="v1.2_rc")),
    ("oci-archive:/data/y.tar", ImageRef("oci-archive", path="/data/y.tar")),
    ("oci-archive:/data/y.tar:t", ImageRef("oci-archive", path="/data/y.tar", tag="t")),
    ("docker-archive:/data/x.tar", ImageRef("docker-archive", path="/data/x.tar")),
    ("docker-archive:x.tar:repo/x:t",
     ImageRef("docker-archive", path="x.tar", tag="repo/x:t")),
    ("docker-archive:x.tar:localhost:5000/tb/chess:20251031",
     ImageRef("docker-archive", path="x.tar", tag="localhost:5000/tb/chess:20251031")),
    ("debian:bookworm", ImageRef("debian", suite="bookworm")),
    ("debian:bookworm+python3", ImageRef("debian", suite="bookworm", packages=("python3",))),
    ("debian:trixie+python3-pytest,g++,git,git",
     ImageRef("debian", suite="trixie", packages=("g++", "git", "python3-pytest"))),
    ("tb/chess", ImageRef("name", name="tb/chess")),
    ("chess", ImageRef("name", name="chess")),
])
def test_every_form_of_the_grammar_parses_to_plain_data(text, expected):
    assert parse(text) == expected
    assert parse(str(expected)) == expected  # the canonical text parses back


@pytest.mark.parametrize("text, at, what", [
    ("", 0, "NAME is empty"),
    ("dir:", 4, "PATH is empty"),
    ("dir:a\0b", 5, "NUL"),
    ("oci:", 4, "PATH is empty"),
    ("oci::t", 4, "PATH is empty"),
    ("oci:L:", 6, "TAG is empty"),
    ("oci:L:bad tag", 9, "unexpected ' '"),
    ("oci-archive:", 12, "FILE is empty"),
    ("docker-archive:x.tar:repo", 25, "needs a tag"),
    ("docker-archive:x.tar:Repo/x:t", 21, "unexpected 'R'"),
    ("docker-archive:x.tar:repo/x:-t", 28, "unexpected '-'"),
    ("docker-archive:x.tar::t", 21, "REPO is empty"),
    ("debian:", 7, "SUITE is empty"),
    ("debian:Bookworm", 7, "unexpected 'B'"),
    ("debian:bookworm+", 16, "PKG is empty"),
    ("debian:bookworm+python3,,git", 24, "PKG is empty"),
    ("debian:bookworm+python3,Git", 24, "unexpected 'G'"),
    ("debian:bookworm+py thon", 18, "unexpected ' '"),
    ("docker:alpine", 0, "unknown kind 'docker'"),
    ("host:x", 0, "'host' takes no ':'"),
    ("name:x", 0, "'name' takes no ':'"),
    ("tb/../x", 3, "unexpected '.'"),
    ("TB/chess", 0, "unexpected 'T'"),
    ("/abs/path", 0, "a path needs its kind"),
    ("./x.tar", 0, "a path needs its kind"),
    ("tb/", 3, "an empty component"),
    ("tb//x", 3, "an empty component"),
])
def test_each_error_shows_the_grammar_and_points_at_what_is_wrong(text, at, what):
    with pytest.raises(ImageRefError) as info:
        parse(text)
    exc = info.value
    assert isinstance(exc, ValueError)
    assert exc.at == at and what in exc.what, (exc.at, exc.what)
    message = str(exc)
    assert f"\n    {text}\n    {' ' * at}^\n" in message
    assert GRAMMAR in message


def test_a_ref_that_is_no_str_is_an_error_naming_its_type():
    with pytest.raises(ImageRefError, match="not int"):
        parse(3)  # type: ignore[arg-type]


def test_host_is_no_name_and_a_name_has_the_name_grammar():
    assert parse_name("tb/chess") == "tb/chess"
    with pytest.raises(ImageRefError, match="'host' is the host's userland"):
        parse_name("host")
    with pytest.raises(ImageRefError, match="unexpected ':'"):
        parse_name("tb/chess:v1")


def test_ref_py_is_plain_data_importing_only_the_standard_library_and_karotte_errors():
    # karotte/spec.py (the floor of the layers) will import it.
    tree = ast.parse(Path(ref_module.__file__).read_text())
    imported = {(node.level, node.module) for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom)}
    imported |= {(0, alias.name) for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
    assert {m for level, m in imported if level} == {"errors"}
    assert {m for level, m in imported if not level} <= {"__future__", "re", "dataclasses"}


# -- images made by the real tools ----------------------------------------------------

def run(*argv: str | Path, cwd: Path | None = None) -> None:
    subprocess.run([str(a) for a in argv], check=True, cwd=cwd, capture_output=True)


def make_images(base: Path) -> dict[str, Path | str]:
    """One image in every form, made by umoci and skopeo: two layers (the second deletes a
    file the first made), an Env and a WorkingDir."""
    layout, bundle = base / "L", base / "B"
    run("umoci", "init", "--layout", layout)
    run("umoci", "new", "--image", f"{layout}:t")
    run("umoci", "config", "--image", f"{layout}:t", "--config.env", "A=1",
        "--config.workingdir", "/app", "--config.cmd", "/bin/sh")
    run("umoci", "unpack", "--rootless", "--image", f"{layout}:t", bundle)
    rootfs = bundle / "rootfs"
    (rootfs / "etc").mkdir()
    (rootfs / "usr/bin").mkdir(parents=True)
    (rootfs / "etc/hello").write_text("hello\n")
    (rootfs / "etc/gone").write_text("deleted by the second layer\n")
    (rootfs / "usr/bin/tool").write_bytes(os.urandom(300_000))  # some size to compress
    (rootfs / "usr/bin/tool").chmod(0o755)
    (rootfs / "usr/bin/link").symlink_to("/etc/hello")  # absolute target: kept
    os.link(rootfs / "etc/hello", rootfs / "etc/hello.hard")
    run("umoci", "repack", "--image", f"{layout}:t", bundle)
    shutil.rmtree(bundle)
    run("umoci", "unpack", "--rootless", "--image", f"{layout}:t", bundle)
    (bundle / "rootfs/etc/gone").unlink()
    (bundle / "rootfs/etc/two").write_text("two\n")
    run("umoci", "repack", "--image", f"{layout}:t", bundle)
    shutil.rmtree(bundle)
    run("umoci", "unpack", "--rootless", "--image", f"{layout}:t", bundle)  # the reference
    run("skopeo", "copy", f"oci:{layout}:t", f"docker-archive:{base / 'x.tar'}:repo/x:t")
    run("skopeo", "copy", f"oci:{layout}:t", f"oci-archive:{base / 'y.tar'}:t")
    run("skopeo", "copy", "--dest-compress-format", "zstd", f"oci:{layout}:t",
        f"oci:{base / 'Z'}:t")
    docker25(base / "x.tar", base / "y.tar", base / "d25.tar")
    return {"layout": layout, "rootfs": bundle / "rootfs", "x": base / "x.tar",
            "y": base / "y.tar", "zstd": base / "Z", "d25": base / "d25.tar"}


def docker25(legacy: Path, oci_archive: Path, out: Path) -> None:
    """The tar `docker save` writes since Docker 25, made from skopeo's two outputs: an OCI
    layout (oci-layout, index.json, blobs/sha256/) whose layers are uncompressed tars, plus
    Docker's manifest.json naming the blobs by path. The uncompressed layers are skopeo's
    docker-archive ones (named by their diff_id), the config is skopeo's OCI one, and the
    OCI manifest and index list them as Docker 25 does (layer media type v1.tar)."""
    with tarfile.open(legacy) as x, tarfile.open(oci_archive) as y:
        entry = json.load(x.extractfile("manifest.json"))[0]  # type: ignore[arg-type]
        layers = [x.extractfile(p).read() for p in entry["Layers"]]  # type: ignore[union-attr]
        config = x.extractfile(entry["Config"]).read()  # type: ignore[union-attr]
        layout = y.extractfile("oci-layout").read()  # type: ignore[union-attr]

    def digest(data: bytes) -> str:
        return "sha256:" + hashlib.sha256(data).hexdigest()

    oci_manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": digest(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": digest(layer), "size": len(layer)} for layer in layers],
    }).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": digest(oci_manifest), "size": len(oci_manifest),
        "annotations": {"io.containerd.image.name": "docker.io/repo/x:t",
                        "org.opencontainers.image.ref.name": "t"}}]}).encode()
    docker_manifest = json.dumps([{
        "Config": f"blobs/sha256/{digest(config)[7:]}", "RepoTags": ["repo/x:t"],
        "Layers": [f"blobs/sha256/{digest(layer)[7:]}" for layer in layers]}]).encode()
    members = [("oci-layout", layout), ("index.json", index), ("manifest.json", docker_manifest)]
    members += [(f"blobs/sha256/{digest(b)[7:]}", b) for b in [config, oci_manifest, *layers]]
    with tarfile.open(out, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    for tool in TOOLS:
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool} (scripts/setup installs it)")
    return make_images(tmp_path_factory.mktemp("images"))


def tree_manifest(path: str | Path) -> list[dict]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return [e.__dict__ for e in manifest(fd)]
    finally:
        os.close(fd)


def without_ids(entries: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k not in ("uid", "gid")} for e in entries]


FORMS = {
    "oci": lambda i: f"oci:{i['layout']}:t",
    "oci-untagged": lambda i: f"oci:{i['layout']}",
    "oci-archive": lambda i: f"oci-archive:{i['y']}:t",
    "docker-archive": lambda i: f"docker-archive:{i['x']}:repo/x:t",
    "docker-archive-untagged": lambda i: f"docker-archive:{i['x']}",
    "docker25": lambda i: f"docker-archive:{i['d25']}:repo/x:t",
    "zstd": lambda i: f"oci:{i['zstd']}:t",
}


@pytest.mark.parametrize("form", FORMS)
def test_every_form_unpacks_to_the_tree_umoci_unpacks(images, form, tmp_path):
    image = Store(str(tmp_path / "store")).import_image(FORMS[form](images))
    found = tree_manifest(image.tree)
    assert without_ids(found) == without_ids(tree_manifest(images["rootfs"]))
    paths = {e["path"] for e in found}
    assert {"etc/hello", "etc/two", "usr/bin/link"} <= paths
    assert "etc/gone" not in paths  # the second layer's whiteout
    assert next(e for e in found if e["path"] == "usr/bin/link")["target"] == "/etc/hello"
    assert image.config.env == ("A=1",) and image.config.working_dir == "/app"
    assert image.config.cmd == ("/bin/sh",)
    assert len(image.layers) == len(image.diff_ids) == 2


def test_the_zstd_layout_really_has_zstd_layers(images):
    index = json.loads((images["zstd"] / "index.json").read_text())
    blob = images["zstd"] / "blobs/sha256" / index["manifests"][0]["digest"][7:]
    types = [layer["mediaType"] for layer in json.loads(blob.read_text())["layers"]]
    assert types == ["application/vnd.oci.image.layer.v1.tar+zstd"] * 2


def test_all_forms_give_one_chain_id_and_one_tree(images, tmp_path):
    store = Store(str(tmp_path / "store"))
    chains = {store.import_image(make(images)).chain_id for make in FORMS.values()}
    assert len(chains) == 1
    assert len(os.listdir(tmp_path / "store/trees")) == 1


# -- what does not match is refused, the digest named ------------------------------------

def manifest_of(layout: Path) -> tuple[Path, dict]:
    index = json.loads((layout / "index.json").read_text())
    path = layout / "blobs/sha256" / index["manifests"][0]["digest"][7:]
    return path, json.loads(path.read_text())


def flip_byte(path: Path, at: int) -> None:
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("which", ["layer", "config", "manifest"])
def test_IMG_DIGEST_01_a_blob_whose_digest_does_not_match_is_refused_naming_it(images, tmp_path, which):
    layout = tmp_path / "L"
    shutil.copytree(images["layout"], layout)
    manifest_path, data = manifest_of(layout)
    digest = {"layer": data["layers"][1]["digest"], "config": data["config"]["digest"],
              "manifest": "sha256:" + manifest_path.name}[which]
    flip_byte(layout / "blobs/sha256" / digest[7:], 30)
    store = Store(str(tmp_path / "store"))
    with pytest.raises(DigestMismatch) as info:
        store.import_image(f"oci:{layout}:t", name="bad")
    assert info.value.expected == digest and digest in str(info.value)
    assert os.listdir(tmp_path / "store/trees") == []  # nothing was left half-made
    assert os.listdir(tmp_path / "store/tmp") == [] and store.ls() == ()


def test_IMG_DIGEST_01_a_layer_whose_diff_id_does_not_match_is_refused_naming_it(images, tmp_path):
    # The layer blob is rewritten with one byte of a file changed and its descriptor and
    # the manifest updated, so every blob digest holds: only the diff_id catches it.
    layout = tmp_path / "L"
    shutil.copytree(images["layout"], layout)
    manifest_path, data = manifest_of(layout)
    old = layout / "blobs/sha256" / data["layers"][1]["digest"][7:]
    tar = subprocess.run(["gzip", "-dc", old], capture_output=True, check=True).stdout
    tar = tar.replace(b"two\n", b"twO\n", 1)
    blob = subprocess.run(["gzip", "-c"], input=tar, capture_output=True, check=True).stdout
    new_digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    (layout / "blobs/sha256" / new_digest[7:]).write_bytes(blob)
    data["layers"][1].update(digest=new_digest, size=len(blob))
    body = json.dumps(data).encode()
    manifest_digest = hashlib.sha256(body).hexdigest()
    (layout / "blobs/sha256" / manifest_digest).write_bytes(body)
    index = json.loads((layout / "index.json").read_text())
    index["manifests"][0].update(digest=f"sha256:{manifest_digest}", size=len(body))
    (layout / "index.json").write_text(json.dumps(index))
    config = json.loads((layout / "blobs/sha256" / data["config"]["digest"][7:]).read_text())
    diff_id = config["rootfs"]["diff_ids"][1]
    with pytest.raises(DigestMismatch) as info:
        Store(str(tmp_path / "store")).import_image(f"oci:{layout}:t")
    assert info.value.expected == diff_id and "diff_id" in str(info.value)
    assert info.value.actual == "sha256:" + hashlib.sha256(tar).hexdigest()
    assert os.listdir(tmp_path / "store/trees") == []


def test_IMG_DIGEST_01_a_corrupt_layer_in_a_legacy_docker_archive_is_caught_by_its_diff_id(images, tmp_path):
    # Legacy layers are named by path, not by digest: the diff_id is the only check.
    archive = tmp_path / "x.tar"
    shutil.copy(images["x"], archive)
    data = archive.read_bytes()
    flip_byte(archive, data.index(b"two\n"))
    with pytest.raises(DigestMismatch, match="diff_id"):
        Store(str(tmp_path / "store")).import_image(f"docker-archive:{archive}")


def test_a_corrupt_zstd_layer_is_refused(images, tmp_path):
    layout = tmp_path / "Z"
    shutil.copytree(images["zstd"], layout)
    _, data = manifest_of(layout)
    digest = data["layers"][0]["digest"]
    flip_byte(layout / "blobs/sha256" / digest[7:], 40)
    with pytest.raises(DigestMismatch, match=digest):
        Store(str(tmp_path / "store")).import_image(f"oci:{layout}:t")


# -- choosing the image in a source --------------------------------------------------------

def test_a_tag_not_in_the_source_is_refused_listing_the_tags(images, tmp_path):
    store = Store(str(tmp_path / "store"))
    with pytest.raises(ImageError, match=r"no image tagged 'nope'; tags: t"):
        store.import_image(f"oci:{images['layout']}:nope")
    with pytest.raises(ImageError, match=r"no image tagged 'repo/y:t'; tags: docker.io/repo/x:t"):
        store.import_image(f"docker-archive:{images['x']}:repo/y:t")


def test_a_layout_with_several_tags_needs_one_named(images, tmp_path):
    layout = tmp_path / "L"
    shutil.copytree(images["layout"], layout)
    run("umoci", "tag", "--image", f"{layout}:t", "u")
    store = Store(str(tmp_path / "store"))
    with pytest.raises(ImageError, match=r"several images \(t, u\); name one with :TAG"):
        store.import_image(f"oci:{layout}")
    assert store.import_image(f"oci:{layout}:u").tree


def _index_blob(layout: Path, manifests: list[dict]) -> dict:
    body = json.dumps({"schemaVersion": 2, "manifests": manifests}).encode()
    digest = hashlib.sha256(body).hexdigest()
    (layout / "blobs/sha256" / digest).write_bytes(body)
    return {"mediaType": "application/vnd.oci.image.index.v1+json",
            "digest": f"sha256:{digest}", "size": len(body)}


def test_a_nested_index_resolves_to_this_hosts_platform(images, tmp_path):
    # index.json -> an index naming an arm64 image (a dangling digest: never read) and
    # umoci's manifest as this host's platform, as multi-platform images are laid out.
    layout = tmp_path / "L"
    shutil.copytree(images["layout"], layout)
    top = json.loads((layout / "index.json").read_text())
    ours = dict(top["manifests"][0], platform={"os": "linux", "architecture": host_arch()})
    other = dict(ours, digest="sha256:" + "0" * 64,
                 platform={"os": "linux", "architecture": "s390x" if host_arch() != "s390x"
                           else "arm64"})
    inner = _index_blob(layout, [other, ours])
    outer = _index_blob(layout, [inner])
    top["manifests"] = [dict(outer, annotations={"org.opencontainers.image.ref.name": "multi"})]
    (layout / "index.json").write_text(json.dumps(top))
    image = Store(str(tmp_path / "store")).import_image(f"oci:{layout}:multi")
    assert without_ids(tree_manifest(image.tree)) == without_ids(tree_manifest(images["rootfs"]))

    (layout / "index.json").write_text(json.dumps(dict(top, manifests=[dict(
        _index_blob(layout, [other]), annotations={"org.opencontainers.image.ref.name": "m"})])))
    with pytest.raises(ImageError, match=f"no image for linux/{host_arch()}"):
        Store(str(tmp_path / "store2")).import_image(f"oci:{layout}:m")


def test_IMG_DIGEST_01_a_blob_digest_that_is_no_sha256_is_refused_before_any_path_is_made(images, tmp_path):
    layout = tmp_path / "L"
    shutil.copytree(images["layout"], layout)
    top = json.loads((layout / "index.json").read_text())
    top["manifests"][0]["digest"] = "sha256:../../../../etc/passwd"
    (layout / "index.json").write_text(json.dumps(top))
    with pytest.raises(ImageError, match="is not sha256:<64 hex digits>"):
        Store(str(tmp_path / "store")).import_image(f"oci:{layout}:t")


def test_sources_that_are_not_images_are_refused_naming_the_fix(tmp_path):
    store = Store(str(tmp_path / "store"))
    with pytest.raises(ImageError, match="cannot open the OCI layout"):
        store.import_image(f"oci:{tmp_path / 'missing'}")
    (tmp_path / "x.tar.gz").write_bytes(b"\x1f\x8b" + b"\0" * 100)
    with pytest.raises(ImageError, match="not an uncompressed tar"):
        store.import_image(f"docker-archive:{tmp_path / 'x.tar.gz'}")
    with pytest.raises(ImageError, match="not an image source"):
        store.import_image("host")
