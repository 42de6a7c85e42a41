"""Prometheus scrapes over HTTP (`distorefs mount --metrics-addr HOST:PORT`): `GET /metrics`
answers what `MNT/.distorefs/metrics` shows.

An HTTP client is nobody in particular, so the answer is the view of a user with no rights
on any namespace (uid and gid `nobody`): namespaces whose mode lets others list them are
named, the others are left out, as `.distorefs/metrics` does for such a reader. Off unless
asked; a host other than loopback only with `--metrics-allow-remote`.

Hand-written on trio rather than prometheus-client: the text exposition is made already
(distorefs/metrics.py), and the daemon's loop is trio; prometheus-client's server is a
thread around its own registry of Python metric objects, which would have to be fed the same
numbers a second way. Every connection is bounded: a request head of at most 8 KiB within
5 s, then the answer, then the connection is closed.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import TYPE_CHECKING

import trio

from distorefs.metrics import prometheus_text
from distorefs.sources import Credentials

from .control import stats_for

if TYPE_CHECKING:
    from .operations import Filesystem

log = logging.getLogger(__name__)

NOBODY = Credentials(65534, 65534)
MAX_HEAD = 8192
HEAD_SECONDS = 5.0


def parse_addr(text: str, allow_remote: bool) -> tuple[str, int]:
    """HOST:PORT (or PORT: loopback) as given to --metrics-addr; ValueError saying why not."""
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"--metrics-addr {text!r}: expected HOST:PORT or PORT") from None
    if not 0 < port < 65536:
        raise ValueError(f"--metrics-addr {text!r}: port {port} is out of range")
    if not allow_remote and not _loopback(host):
        raise ValueError(f"--metrics-addr {text!r}: {host} is not a loopback address "
                         f"(add --metrics-allow-remote to serve metrics beyond this host)")
    return host, port


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve_metrics(fs: "Filesystem", host: str, port: int,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve GET /metrics on host:port until cancelled."""
    async def handle(stream: trio.SocketStream) -> None:
        try:
            await _answer(fs, stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.debug("metrics connection: %s", exc)
        finally:
            await stream.aclose()

    listeners = await trio.open_tcp_listeners(port, host=host)
    log.info("metrics served at http://%s:%d/metrics", host, port)
    task_status.started()
    await trio.serve_listeners(handle, listeners)


async def _answer(fs: "Filesystem", stream: trio.SocketStream) -> None:
    head = b""
    with trio.move_on_after(HEAD_SECONDS):
        while b"\r\n\r\n" not in head and b"\n\n" not in head and len(head) <= MAX_HEAD:
            chunk = await stream.receive_some(4096)
            if not chunk:
                break
            head += chunk
    parts = head.split(b"\r\n", 1)[0].split()
    if len(parts) < 2 or parts[0] not in (b"GET", b"HEAD"):
        await _send(stream, b"400 Bad Request", b"expected GET /metrics\n")
    elif parts[1].split(b"?", 1)[0] != b"/metrics":
        await _send(stream, b"404 Not Found", b"try /metrics\n")
    else:
        body = prometheus_text(stats_for(fs, NOBODY)).encode()
        await _send(stream, b"200 OK", body if parts[0] == b"GET" else b"", len(body),
                    b"text/plain; version=0.0.4; charset=utf-8")


async def _send(stream: trio.SocketStream, status: bytes, body: bytes, length: int | None = None,
                kind: bytes = b"text/plain; charset=utf-8") -> None:
    n = len(body) if length is None else length
    await stream.send_all(b"HTTP/1.0 " + status + b"\r\nContent-Type: " + kind +
                          b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % n + body)


__all__ = ["parse_addr", "serve_metrics"]
