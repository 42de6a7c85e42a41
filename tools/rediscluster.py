"""A Redis Cluster on loopback ports for tests, benchmarks and the demo: `redis-server`
processes (masters, optionally replicas) in a directory of their own, joined with
`redis-cli --cluster create`, stopped (by PID) when done.

Settings are the ones a shared store's durability promise needs (README, Several nodes):
append-only file with `appendfsync always` on every node, and a short node timeout so a
replica takes over a killed master within seconds.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NODE_TIMEOUT_MS = 2000


def _die_with_parent() -> None:
    """In the child: SIGTERM when the process that started it dies, even by kill -9 (a
    timed-out test run), so no server outlives its cluster's owner."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """`n` ports whose cluster bus ports (port + 10000) are free as well."""
    ports: list[int] = []
    while len(ports) < n:
        p = random.randrange(20000, 30000)
        if p not in ports and _free(p) and _free(p + 10000):
            ports.append(p)
    return ports


@dataclass
class Node:
    port: int
    proc: subprocess.Popen
    dir: Path

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class LoopbackCluster:
    """Start with `start()`; `url` is what `distorefs mount --cluster` takes."""

    workdir: Path
    masters: int = 3
    replicas: int = 0
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://{self.nodes[0].addr}"

    def start(self, timeout: float = 30.0) -> "LoopbackCluster":
        if not shutil.which("redis-server") or not shutil.which("redis-cli"):
            raise RuntimeError("redis-server and redis-cli are needed (scripts/system-deps.sh installs them)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        for port in free_ports(self.masters * (1 + self.replicas)):
            self.nodes.append(self._spawn(port))
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            while self.cli(node.port, "ping", check=False).strip() != "PONG":
                self._check_alive(node, deadline)
                time.sleep(0.05)
        subprocess.run(["redis-cli", "--cluster", "create", *[n.addr for n in self.nodes],
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout)
        self.wait_ok(deadline - time.monotonic())
        return self

    def _spawn(self, port: int) -> Node:
        d = self.workdir / str(port)
        d.mkdir(parents=True, exist_ok=True)
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--appendonly", "yes",
                "--appendfsync", "always", "--save", "", "--daemonize", "no", "--logfile", "redis.log"]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True,  # a Ctrl-C of a test run is ours to pass on
                                preexec_fn=_die_with_parent)
        return Node(port, proc, d)

    def _check_alive(self, node: Node, deadline: float) -> None:
        if node.proc.poll() is not None:
            log = (node.dir / "redis.log")
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"redis-server on port {node.port} exited ({node.proc.returncode}): {tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"redis-server on port {node.port} did not answer")

    def cli(self, port: int, *args: str, check: bool = True) -> str:
        r = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=10)
        if check and r.returncode:
            raise RuntimeError(f"redis-cli -p {port} {' '.join(args)}: {r.stderr.strip()}")
        return r.stdout

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.proc.poll() is None]

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says the cluster is ok (all slots served)."""
        deadline = time.monotonic() + timeout
        while True:
            states = [self.cli(n.port, "cluster", "info", check=False) for n in self.live()]
            if all("cluster_state:ok" in s for s in states) and len(self.master_ports()) == self.masters:
                return  # (right after `create`, replicas still show as masters for a moment)
            if time.monotonic() > deadline:
                raise TimeoutError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def master_ports(self) -> list[int]:
        out = self.cli(self.live()[0].port, "cluster", "nodes")
        ports = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) > 2 and "master" in parts[2] and "fail" not in parts[2]:
                ports.append(int(parts[1].split("@")[0].rsplit(":", 1)[1]))
        return ports

    def master_of(self, key: str) -> int:
        """The port of the master serving `key`'s slot."""
        slot = int(self.cli(self.live()[0].port, "cluster", "keyslot", key).strip())
        out = self.cli(self.live()[0].port, "cluster", "slots")
        # redis-cli prints nested arrays one value per line: start, end, master ip, master port, ...
        lines = [x.strip() for x in out.splitlines() if x.strip()]
        i = 0
        while i + 3 < len(lines):
            if lines[i].isdigit() and lines[i + 1].isdigit() and int(lines[i]) <= slot <= int(lines[i + 1]) \
                    and lines[i + 3].isdigit():
                return int(lines[i + 3])
            i += 1
        raise RuntimeError(f"no master found for slot {slot}")

    def kill(self, port: int) -> None:
        """kill -9 of one node (a failover follows when it was a master with a replica)."""
        for n in self.nodes:
            if n.port == port:
                n.proc.send_signal(signal.SIGKILL)
                n.proc.wait(10)

    def stop(self) -> None:
        for n in self.nodes:
            if n.proc.poll() is None:
                n.proc.send_signal(signal.SIGTERM)
        for n in self.nodes:
            try:
                n.proc.wait(10)
            except subprocess.TimeoutExpired:
                n.proc.kill()
                n.proc.wait(10)
        self.nodes.clear()

    def __enter__(self) -> "LoopbackCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_cluster_forever(workdir: str, masters: int = 3, replicas: int = 0) -> None:  # pragma: no cover
    """`python -m distorefs.tools.rediscluster DIR`: a cluster for trying things by hand."""
    with LoopbackCluster(Path(workdir), masters, replicas) as c:
        print(c.url, flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":  # pragma: no cover
    import sys
    run_cluster_forever(sys.argv[1], *(int(a) for a in sys.argv[2:4]))
    os._exit(0)
