"""Redis and RabbitMQ in containers, for `python -m chaos run --mode containers`.

The same services as `chaos.stack`'s private processes, with the same small interface
(`start`, `kill`, `terminate`, `restart`, `pause`, `resume`, `stop`, `alive`, `url`,
`dir`), so the runner's acts need no case of their own: `RedisContainer` and
`RabbitContainer` are `RedisServer` and `RabbitNode` whose process is a container started
through testcontainers. A kill is `docker kill` (SIGKILL), a clean stop `docker stop`, a
pause the cgroup freezer (`docker pause`), a restart `docker start` of the same container.

Containers share the host's network and bind the free loopback ports the harness picked,
exactly like the private processes: every byte stays on 127.0.0.1, and the proxies of
`chaos.links` sit in front of them unchanged. Their data lives in the instance's temp dir,
mounted at the same path, so a restarted container finds its append-only file or its
mnesia again (`redis.lose_last_writes` cuts that file as it does live).

Cleaning up: every container carries the owner mark of `chaos.stack` as a label and its
processes carry the marker in their environment, so an interrupt's SIGKILL sweep reaches
them; `remove_owned` removes this process's containers by label, `remove_dead_owners`
those whose runner died.

The images: the official `redis` and `rabbitmq` where they are here or can be pulled,
else the ones `python -m chaos images build` made from the host's own
(`chaos.systems.redis_rabbitmq.images`). `CHAOS_REDIS_IMAGE` / `CHAOS_RABBITMQ_IMAGE` name others.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from chaos.stack import MARKER_ENV, OWNER_ENV, StackError, _owner_alive, owner_token
from chaos.systems.redis_rabbitmq.images import LOCAL_IMAGES
from chaos.systems.redis_rabbitmq.stack import RabbitNode, RedisServer

#: What testcontainers needs here: no Ryuk (its image cannot be pulled; we remove our
#: containers by label ourselves), the engine on this machine, and no port mapping to
#: look up (host networking).
TESTCONTAINERS_ENV = {
    "TESTCONTAINERS_RYUK_DISABLED": "true",
    "TESTCONTAINERS_HOST_OVERRIDE": "127.0.0.1",
    "TESTCONTAINERS_CONNECTION_MODE": "docker_host",
}
for _name, _value in TESTCONTAINERS_ENV.items():
    os.environ.setdefault(_name, _value)

OWNER_LABEL = "chaos.harness.owner"
OFFICIAL_IMAGES = {"redis": "redis:7", "rabbitmq": "rabbitmq:3.13"}
IMAGE_ENV = {"redis": "CHAOS_REDIS_IMAGE", "rabbitmq": "CHAOS_RABBITMQ_IMAGE"}
NO_ENGINE = (
    "containers mode needs a Docker engine and none answers (DOCKER_HOST or "
    "/var/run/docker.sock); start one, e.g. apt-get install docker.io, then dockerd &"
)


def _client() -> Any:
    import docker

    return docker.from_env(timeout=30)


def engine_problem() -> str | None:
    """None when a Docker engine answers, else why containers mode cannot run (one line)."""
    try:
        import docker
        import testcontainers  # noqa: F401
    except ImportError:
        return (
            "containers mode needs the Python packages docker and testcontainers "
            "(pip install -e '.[containers]')"
        )
    try:
        client = docker.from_env(timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except Exception:
        return NO_ENGINE
    return None


def image_for(service: str) -> str:
    """The image `service` runs: named by the environment, else the official one if it is
    here, else the local build, else the official one pulled."""
    import docker

    named = os.environ.get(IMAGE_ENV[service])
    if named:
        return named
    client = _client()
    try:
        for tag in (OFFICIAL_IMAGES[service], LOCAL_IMAGES[service]):
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.get(tag)
                return tag
        try:
            client.images.pull(OFFICIAL_IMAGES[service])
        except docker.errors.APIError:
            raise StackError(
                f"no {service} image: {OFFICIAL_IMAGES[service]} cannot be pulled and "
                f"{LOCAL_IMAGES[service]} is not built (python -m chaos images build)"
            ) from None
        return OFFICIAL_IMAGES[service]
    finally:
        client.close()


def _host_network_container(image: str, labels: dict[str, str], **kwargs: Any) -> Any:
    """testcontainers' container on the host's network, labelled: no port is mapped, so
    its port look-ups answer the port itself, on 127.0.0.1."""
    from testcontainers.core.container import DockerContainer

    class HostNetworkContainer(DockerContainer):
        def get_container_host_ip(self) -> str:
            return "127.0.0.1"

        def get_exposed_port(self, port: int) -> int:
            return port

    return HostNetworkContainer(image, **kwargs).with_kwargs(network="host", labels=labels)


class _InContainer:
    """The life cycle of `chaos.stack._Service` carried out on a container."""

    service = ""  # the image's: "redis" or "rabbitmq"
    kind: str
    marker: str
    port: int
    start_timeout: float
    _dir: Any

    def __init__(self, *args: Any, image: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.image = image or image_for(self.service)
        self._container: Any = None  # testcontainers' DockerContainer, once created

    # -- what the container runs

    def container_command(self) -> list[str]:
        raise NotImplementedError

    def container_env(self) -> dict[str, str]:
        return {MARKER_ENV: self.marker, OWNER_ENV: owner_token(), "LANG": "C.UTF-8"}

    def _prepare(self) -> None:
        """Write what the service reads from its dir, before each start."""

    # -- `_Service`'s hooks

    @property
    def _docker(self) -> Any:
        """docker-py's container (testcontainers wraps it)."""
        return self._container.get_wrapped_container()

    def _state(self) -> dict[str, Any]:
        if self._container is None:
            return {}
        try:
            self._docker.reload()
        except Exception:  # removed from under us: gone
            return {}
        return self._docker.attrs.get("State", {})

    @property
    def pid(self) -> int | None:
        """The container's main process while it runs (paused too), else None."""
        state = self._state()
        return state.get("Pid") or None if state.get("Running") else None

    @property
    def paused(self) -> bool:
        return bool(self._state().get("Paused"))

    def _launch(self) -> None:
        assert self._dir is not None
        self._prepare()
        if self._container is not None:
            self._docker.start()  # the same container: its data, ports and name
            return
        os.chmod(self._dir, 0o777)  # the official images drop root for their own user
        container = _host_network_container(
            self.image,
            command=self.container_command(),
            env=self.container_env(),
            name=f"chaos-{self.kind}-{self.marker[:12]}",
            labels={OWNER_LABEL: owner_token()},
        )
        self._container = container.with_volume_mapping(str(self._dir), str(self._dir), "rw")
        try:
            self._container.start()
        except Exception as exc:
            raise StackError(f"{self.kind} container ({self.image}): {exc}") from None

    def _wait_ready(self, began: float) -> None:
        deadline = began + self.start_timeout
        while True:
            if self.pid is None:
                raise StackError(
                    f"{self.kind} container on 127.0.0.1:{self.port} exited during startup; "
                    f"log: {self._log_tail()}"
                )
            if self._ready():  # type: ignore[attr-defined]
                return
            if time.monotonic() > deadline:
                raise StackError(
                    f"{self.kind} container on 127.0.0.1:{self.port} not ready after "
                    f"{self.start_timeout:.0f}s; log: {self._log_tail()}"
                )
            time.sleep(0.05)

    def _log_tail(self, lines: int = 6) -> str:
        try:
            text = self._docker.logs(tail=lines).decode("utf-8", "replace")
        except Exception:
            return "(none)"
        return " | ".join(line.strip() for line in text.splitlines() if line.strip())[-1200:]

    def _terminate(self, timeout: float) -> None:
        if self.pid is not None:
            self.resume()  # a frozen container cannot take its SIGTERM
            self._docker.stop(timeout=max(1, round(timeout)))

    def _kill_all(self) -> None:
        if self.pid is None:
            return
        self.resume()
        with contextlib.suppress(Exception):  # it died meanwhile
            self._docker.kill()
        try:
            self._docker.wait(timeout=10)
        except Exception as exc:
            raise StackError(f"{self.kind} container survived docker kill: {exc}") from None

    def pause(self) -> None:
        """Freeze every process of the container (`docker pause`): it holds its sockets
        and answers nothing, as a stalled host would."""
        if self.pid is not None and not self.paused:
            self._docker.pause()

    def resume(self) -> None:
        if self.paused:
            self._docker.unpause()

    def _cleanup(self) -> None:
        container, self._container = self._container, None
        if container is not None:
            with contextlib.suppress(Exception):
                container.get_wrapped_container().remove(force=True, v=True)
        super()._cleanup()  # type: ignore[misc]


class RedisContainer(_InContainer, RedisServer):
    """`RedisServer` in a container: its command line, its data dir mounted."""

    service = "redis"

    def __init__(self, *, persistence: bool = False, image: str | None = None) -> None:
        super().__init__(persistence=persistence, binary="redis-server", image=image)

    def container_command(self) -> list[str]:
        return self.argv()


class RabbitContainer(_InContainer, RabbitNode):
    """`RabbitNode` in a container: its environment, config files and mnesia in its dir
    (mounted), so a restarted container keeps durable queues and persistent messages."""

    service = "rabbitmq"

    def __init__(self, *, image: str | None = None, start_timeout: float = 90.0) -> None:
        super().__init__(
            binary="rabbitmq-server", epmd="epmd", image=image, start_timeout=start_timeout
        )

    def container_env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in self.node_env().items()
            if k.startswith(("RABBITMQ_", "ERL_")) or k == "HOME"
        }
        return {**env, **super().container_env()}

    def container_command(self) -> list[str]:
        return ["rabbitmq-server"]

    def _prepare(self) -> None:
        self._write_files()

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """`rabbitmqctl -n NODE args...` inside the container."""
        if self.pid is None:
            raise StackError(f"rabbit node {self.node_name} is not running")
        result = self._docker.exec_run(
            ["rabbitmqctl", "-n", self.node_name, *args], environment=self.container_env()
        )
        output = result.output.decode("utf-8", "replace")
        if result.exit_code != 0:
            raise StackError(f"rabbitmqctl {' '.join(args)} failed ({result.exit_code}): {output}")
        return output


def _remove_where(keep: Any) -> list[str]:
    """Remove the harness's containers whose owner `keep` selects; their names."""
    if engine_problem() is not None:
        return []
    client = _client()
    removed = []
    try:
        for container in client.containers.list(all=True, filters={"label": OWNER_LABEL}):
            if keep(container.labels.get(OWNER_LABEL, "")):
                with contextlib.suppress(Exception):
                    container.remove(force=True, v=True)
                    removed.append(container.name)
    finally:
        client.close()
    return removed


def remove_owned(token: str | None = None) -> list[str]:
    """Remove every container this process (or `token`) started, whatever it tracked."""
    token = token or owner_token()
    return _remove_where(lambda owner: owner == token)


def remove_dead_owners() -> list[str]:
    """Remove the containers of runs whose runner died without cleaning up."""
    return _remove_where(lambda owner: not _owner_alive(owner))
