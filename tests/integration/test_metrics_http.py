"""`distorefs mount --metrics-addr`: Prometheus scrapes `GET /metrics` over HTTP (issue 17),
off by default, loopback only unless asked, naming only what any user may list."""

from __future__ import annotations

import socket
import subprocess
import urllib.error
import urllib.request

from distorefs_it import CLI, is_mounted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, "", ""


def test_metrics_are_served_over_http_as_any_user_may_see_them(fresh_mount):
    m = fresh_mount()
    m.umount()
    port = _free_port()
    m.mount(flags=("--metrics-addr", f"127.0.0.1:{port}"))
    (m.mnt / "buffers" / "shared").mkdir()
    (m.mnt / "buffers" / "secret").mkdir()
    (m.mnt / "buffers" / "secret").chmod(0o700)
    status, kind, text = _get(port, "/metrics")
    assert status == 200 and kind.startswith("text/plain; version=0.0.4"), (status, kind)
    assert "# TYPE distorefs_" in text
    assert (m.mnt / ".distorefs" / "metrics").read_text().count("\n") > 10
    assert 'shared' in text and 'secret' not in text  # nobody may list a 0700 buffer
    assert _get(port, "/")[0] == 404
    m.umount()
    assert _get_refused(port)  # the endpoint goes with the daemon


def _get_refused(port: int) -> bool:
    try:
        _get(port, "/metrics")
    except (urllib.error.URLError, ConnectionError):
        return True
    return False


def test_metrics_beyond_loopback_and_on_a_busy_port_are_refused(fresh_mount, tmp_path):
    m = fresh_mount()
    m.umount()
    res = subprocess.run(CLI + ["mount", "--metrics-addr", "0.0.0.0:9", str(m.store), str(m.mnt)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "--metrics-allow-remote" in res.stderr, res
    assert not is_mounted(m.mnt)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run(CLI + ["mount", "--metrics-addr", f"127.0.0.1:{port}", str(m.store), str(m.mnt)],
                             capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "cannot serve metrics" in res.stderr, res
    assert not is_mounted(m.mnt)
    m.mount()  # the store is fine: the failed start left it closed
