"""`python -m chaos images build`: Redis and RabbitMQ images made from this machine's own.

Containers mode prefers the official images (`redis`, `rabbitmq`); where no registry can
be reached, these equivalents are built instead, with no network at all: a root filesystem
holding the host's `redis-server`, or its Erlang runtime and /usr/lib/rabbitmq, plus the
shared libraries `ldd` names and the few shell tools RabbitMQ's scripts call, written as
a tar and handed to `docker import`. The same versions as the private processes of
`chaos.stack`, so a scenario behaves alike in both modes.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path

from chaos.stack import StackError
from chaos.systems.redis_rabbitmq.stack import find_rabbitmq_server, find_redis_server

#: The images built here, by service; `chaos.systems.redis_rabbitmq.containers` falls back to them.
LOCAL_IMAGES = {"redis": "chaos-redis:local", "rabbitmq": "chaos-rabbitmq:local"}
#: Marks what this module built, so that CI can remove exactly that.
IMAGE_LABEL = "chaos.harness.image"

PATH = "/usr/lib/rabbitmq/bin:/usr/lib/erlang/bin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: What rabbitmq-server, rabbitmq-env, erl and rabbitmqctl run, and what RabbitMQ's disk
#: monitor (`df`) and `os:cmd` (`sh`) need.
SHELL_TOOLS = (
    "sh", "dash", "bash", "basename", "dirname", "env", "expr", "printf", "readlink",
    "realpath", "which", "test", "cat", "sed", "grep", "df", "uname", "id", "mkdir", "rm",
    "ls", "sleep", "head", "tr", "cut", "true", "false",
)  # fmt: skip
RABBIT_TREES = ("/usr/lib/rabbitmq", "/usr/lib/erlang")
_PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n"
_GROUP = "root:x:0:\nnogroup:x:65534:\n"


def _libraries(binaries: Iterable[str]) -> set[str]:
    """The shared libraries (and the loader) the ELF files `binaries` load, as named."""
    found: set[str] = set()
    for binary in binaries:
        result = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False)
        for line in result.stdout.splitlines():
            match = re.search(r"(/\S+)", line.split("=>")[-1])
            if match and Path(match.group(1)).exists():
                found.add(match.group(1))
    return found


def _elf_files(tree: str) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(tree):
        for name in files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                continue
            try:
                with open(path, "rb") as fh:
                    if fh.read(4) == b"\x7fELF":
                        out.append(path)
            except OSError:
                continue
    return out


class RootFs:
    """A root filesystem written straight into a tar: files as they are named (symlinks
    followed), whole trees as they are (their symlinks kept), every parent dir made."""

    def __init__(self, tar: tarfile.TarFile) -> None:
        self.tar = tar
        self.dirs: set[str] = set()
        self.files: set[str] = set()

    def _parents(self, path: str) -> None:
        parts = Path(path).parent.parts[1:]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d not in self.dirs:
                self.dirs.add(d)
                info = tarfile.TarInfo(d)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                self.tar.addfile(info)

    def file(self, path: str) -> None:
        if path in self.files:
            return
        self.files.add(path)
        self._parents(path)
        self.tar.add(os.path.realpath(path), arcname=path.lstrip("/"), recursive=False)

    def tree(self, path: str) -> None:
        self._parents(path)
        self.dirs.add(path.lstrip("/"))
        self.tar.add(path, arcname=path.lstrip("/"))

    def text(self, path: str, content: str, mode: int = 0o644) -> None:
        self._parents(path)
        data = content.encode()
        info = tarfile.TarInfo(path.lstrip("/"))
        info.size, info.mode = len(data), mode
        self.tar.addfile(info, io.BytesIO(data))

    def empty_dir(self, path: str, mode: int = 0o1777) -> None:
        self._parents(path)
        self.dirs.add(path.lstrip("/"))
        info = tarfile.TarInfo(path.lstrip("/"))
        info.type, info.mode = tarfile.DIRTYPE, mode
        self.tar.addfile(info)


def _base(fs: RootFs) -> None:
    fs.text("/etc/passwd", _PASSWD)
    fs.text("/etc/group", _GROUP)
    fs.empty_dir("/tmp")


def _redis_rootfs(fs: RootFs) -> None:
    server = find_redis_server()
    if server is None:
        raise StackError("cannot build the Redis image: redis-server is not installed")
    _base(fs)
    fs.file(server)
    fs.file("/usr/bin/redis-server")  # where the official image's PATH finds it too
    for lib in sorted(_libraries([server])):
        fs.file(lib)


def _rabbit_rootfs(fs: RootFs) -> None:
    if find_rabbitmq_server() is None or not all(Path(t).is_dir() for t in RABBIT_TREES):
        raise StackError(
            "cannot build the RabbitMQ image: rabbitmq-server is not installed "
            "(/usr/lib/rabbitmq, /usr/lib/erlang)"
        )
    _base(fs)
    for tree in RABBIT_TREES:
        fs.tree(tree)
    tools = [found for t in SHELL_TOOLS if (found := shutil.which(t))]
    for tool in tools:
        fs.file(tool)
    fs.file("/bin/sh")
    for lib in sorted(_libraries([*tools, *(e for t in RABBIT_TREES for e in _elf_files(t))])):
        fs.file(lib)


def build(service: str, client: object | None = None) -> str:
    """Build the local image of `service` ("redis" or "rabbitmq"); its tag."""
    import docker

    client = client or docker.from_env()
    tag = LOCAL_IMAGES[service]
    repository, _, version = tag.partition(":")
    try:
        old = client.images.get(tag).id  # type: ignore[attr-defined]
    except docker.errors.ImageNotFound:
        old = None
    with tempfile.TemporaryDirectory(prefix="chaos-image-") as tmp:
        archive = Path(tmp) / "rootfs.tar"
        with tarfile.open(archive, "w") as tar:
            (_redis_rootfs if service == "redis" else _rabbit_rootfs)(RootFs(tar))
        changes = [f"ENV PATH={PATH}", "ENV LANG=C.UTF-8", f"LABEL {IMAGE_LABEL}={service}"]
        client.api.import_image_from_file(  # type: ignore[attr-defined]
            str(archive), repository=repository, tag=version, changes=changes
        )
    if old is not None and old != client.images.get(tag).id:  # type: ignore[attr-defined]
        with contextlib.suppress(docker.errors.APIError):  # a container still runs it
            client.images.remove(old)  # type: ignore[attr-defined]
    return tag


def build_all() -> list[str]:
    return [build(service) for service in LOCAL_IMAGES]
