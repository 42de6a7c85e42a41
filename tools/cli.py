"""The `distorefs` command: mount, umount, status, bench, demo, stage, seal, import, warmup (stats,
ls, inspect, verify, gc and export are in `inspection`; import's work is in `transfer`, warmup's
in `warmup`)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import click

from .mounts import find_mount, mounts


@click.group()
@click.version_option(package_name="distorefs")
def main() -> None:
    """distorefs: RL training data as files (replay buffers, ...) on a FUSE mount."""


def _parse_config(items: tuple[str, ...]) -> dict:
    config = {}
    for item in items:
        if item in ("ro", "rw"):  # mount(8)'s words: `-o ro` is --read-only (handled by the caller)
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--config")
        try:
            config[key] = json.loads(value)
        except ValueError:
            config[key] = value
    return config


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from "4096", "128M", "500G", "2T" (binary units; a trailing B or iB is allowed)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    try:
        value = float(t[:len(t) - len(unit)])
    except ValueError:
        raise click.BadParameter(f"not a size: {text!r} (e.g. 4096, 128M, 500G)") from None
    return int(value * _UNITS[unit])


def _parse_nvme_dir(text: str) -> dict:
    path, sep, size = text.rpartition(":")
    if not sep or "/" in size:
        path, size = text, ""
    return {"path": str(Path(path).resolve()), "capacity_bytes": parse_size(size) if size else 0}


@main.command()
@click.argument("store", type=click.Path(file_okay=False))
@click.argument("mountpoint", type=click.Path(file_okay=False))
@click.option("--foreground", "-f", is_flag=True, help="Stay attached; log to stderr.")
@click.option("--nvme-dir", "nvme_dirs", multiple=True, metavar="PATH[:SIZE]",
              help="A directory for segment files, with an optional capacity (e.g. /nvme1/seg:500G); repeat "
                   "for several. Added to the store's directories (default STORE/segments).")
@click.option("--allow-other", is_flag=True, help="Let other users access the mount (needs user_allow_other).")
@click.option("--config", "-o", "config", multiple=True, metavar="KEY=VALUE", help="Store setting, e.g. -o cache_bytes=1073741824.")
@click.option("--debug", is_flag=True, help="Debug logging (and FUSE request tracing).")
@click.option("--read-only", "read_only", is_flag=True,
              help="Serve an existing store without changing it, not even by recovery: a damaged store, or one "
                   "not closed cleanly that recovery refuses, serves what can be read; writes fail with EROFS.")
@click.option("--metrics-addr", metavar="[HOST:]PORT",
              help="Serve .distorefs/metrics over HTTP (GET /metrics, for Prometheus) at HOST:PORT; loopback "
                   "only unless --metrics-allow-remote. Off by default.")
@click.option("--metrics-allow-remote", is_flag=True, help="Let --metrics-addr name a host other than loopback.")
@click.option("--cluster", "cluster_url", metavar="redis://HOST:PORT",
              help="Join a store shared by several nodes on this Redis Cluster (any node of it): buffers/ and "
                   "banks/ are the cluster's; STORE is this node's own directory.")
@click.option("--cluster-store", default="main", show_default=True, metavar="NAME",
              help="Which shared store of the cluster to join.")
@click.option("--cluster-snapshot-every", default=100_000, show_default=True, metavar="RECORDS",
              help="Snapshot the shared store's log after this many records (and after at least as many as the "
                   "last snapshot held); the log is trimmed behind it.")
@click.option("--cluster-node-timeout", default=3600.0, show_default=True, metavar="SECONDS",
              help="A node not heard from this long no longer holds the log back from being trimmed (it then "
                   "rejoins with an empty STORE directory).")
@click.option("--ready-fd", type=int, hidden=True)
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for the mount to be ready.")
def mount(store, mountpoint, foreground, nvme_dirs, allow_other, config, debug, read_only, metrics_addr,
          metrics_allow_remote, cluster_url, cluster_store, cluster_snapshot_every, cluster_node_timeout, ready_fd,
          timeout) -> None:
    """Mount STORE (created if missing, unless --read-only) at MOUNTPOINT."""
    mnt = Path(mountpoint)
    if not mnt.is_dir():
        raise click.ClickException(f"mount point {mountpoint} is not a directory")
    cluster = None
    if cluster_url:
        from distorefs.clusterlog import ClusterSpec
        from distorefs.errors import InvalidArgument
        try:
            cluster = ClusterSpec(cluster_url, cluster_store, cluster_snapshot_every, cluster_node_timeout)
        except InvalidArgument as exc:
            raise click.ClickException(str(exc))
    metrics = None
    if metrics_addr:
        from distorefs.mount.metrics_http import parse_addr
        try:
            metrics = parse_addr(metrics_addr, metrics_allow_remote)
        except ValueError as exc:
            raise click.ClickException(str(exc))
    read_only = read_only or "ro" in config
    overrides = _parse_config(config)
    dirs = [_parse_nvme_dir(d) for d in nvme_dirs]
    # The daemon works from `/` like any daemon (it holds no directory busy, and imports
    # never see what the caller's directory holds): every path is made absolute first.
    store, mountpoint = os.path.abspath(store), os.path.abspath(mountpoint)
    if foreground:
        from distorefs.mount.daemon import serve
        os.chdir("/")
        handler = logging.StreamHandler() if ready_fd is None else logging.FileHandler(Path(store) / "daemon.log")
        logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, handlers=[handler],
                            format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
        try:
            serve(store, mountpoint, nvme_dirs=dirs, allow_other=allow_other, config=overrides or None,
                  ready_fd=ready_fd, debug_fuse=debug, read_only=read_only, metrics_addr=metrics,
                  cluster=cluster)
        except Exception as exc:
            raise click.ClickException(str(exc))
        return
    existing = find_mount(mountpoint)
    if existing is not None:
        raise click.ClickException(f"{mountpoint} is already a distorefs mount of {existing.store}")
    if read_only and not (Path(store) / "meta" / "data.mdb").is_file():
        raise click.ClickException(f"{store} holds no store to mount read-only")
    Path(store).mkdir(mode=0o700, parents=True, exist_ok=True)
    read_fd, write_fd = os.pipe()
    # -P (3.11+): the working directory is not put on sys.path, so a `distorefs/` folder there
    # (a checkout) cannot shadow the installed package; and the daemon starts in `/`.
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    cmd = [sys.executable, *safe_path, "-m", "distorefs.tools.cli", "mount", "--foreground", "--ready-fd",
           str(write_fd), str(store), str(mountpoint)]
    for d in dirs:
        cmd += ["--nvme-dir", f"{d['path']}:{d['capacity_bytes']}" if d["capacity_bytes"] else d["path"]]
    if allow_other:
        cmd.append("--allow-other")
    if debug:
        cmd.append("--debug")
    if read_only:
        cmd.append("--read-only")
    if metrics is not None:
        cmd += ["--metrics-addr", f"[{metrics[0]}]:{metrics[1]}", "--metrics-allow-remote"]
    if cluster is not None:
        cmd += ["--cluster", cluster.url, "--cluster-store", cluster.store,
                "--cluster-snapshot-every", str(cluster.snapshot_every),
                "--cluster-node-timeout", repr(cluster.node_timeout_s)]
    for item in config:
        cmd += ["--config", item]
    log_path = Path(store) / "daemon.log"
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(cmd, pass_fds=(write_fd,), stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=log_file, start_new_session=True, cwd="/")
    os.close(write_fd)
    message = _read_ready(read_fd, timeout)
    if message != "ready":
        if proc.poll() is None and not message:
            proc.terminate()
        raise click.ClickException(message.removeprefix("error: ")
                                   or f"the daemon did not get ready (see {log_path})")
    click.echo(f"mounted {Path(store).resolve()} at {Path(mountpoint).resolve()}{' read-only' if read_only else ''} "
               f"(daemon pid {proc.pid})")


def _read_ready(fd: int, timeout: float) -> str:
    import select
    deadline = time.monotonic() + timeout
    data = b""
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
            if data.endswith(b"\n"):
                break
    finally:
        os.close(fd)
    return data.decode(errors="replace").strip()


def _held_by_itself(mountpoint, pid: int) -> bool:
    """No process but the daemon `pid` holds the mount. (Holding none at all counts: between
    two directories of a listing the daemon holds nothing for a moment.)"""
    from .mounts import holders
    return all(h.pid == pid for h in holders(mountpoint))


@main.command()
@click.argument("mountpoint", type=click.Path())
@click.option("--lazy", "-z", is_flag=True, help="Detach now even if busy (fusermount3 -z).")
@click.option("--timeout", default=120.0, show_default=True, help="Seconds to wait for the daemon to flush and exit.")
@click.option("--force", is_flag=True, help="For a dead or hung daemon: abort its FUSE connection (calls in flight "
              "fail with ENOTCONN), then detach (root).")
def umount(mountpoint, lazy, timeout, force) -> None:
    """Unmount MOUNTPOINT cleanly: the daemon flushes everything before it exits."""
    info = find_mount(mountpoint)
    if info is None:
        raise click.ClickException(f"{mountpoint} is not a distorefs mount")
    pid = info.pid
    if force:
        from .mounts import abort_connection, fuse_connection
        conn = fuse_connection(info.mountpoint)
        if conn is None or not abort_connection(conn):
            raise click.ClickException(f"cannot abort the FUSE connection of {info.mountpoint} (needs root)")
        lazy = True
    cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [str(info.mountpoint)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    # Busy because of the daemon alone: it is listing names ahead of a declared order
    # (mount/namewarmer.py), seconds at most. Wait for that, not for other holders.
    until = time.monotonic() + 15
    while (result.returncode != 0 and "busy" in result.stderr.lower() and pid is not None
           and time.monotonic() < until and _held_by_itself(info.mountpoint, pid)):
        time.sleep(0.1)
        result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        from .mounts import holders
        if "busy" not in result.stderr.lower():
            raise click.ClickException(f"fusermount3 failed: {result.stderr.strip()}")
        held = holders(info.mountpoint)
        who = "; ".join(f"pid {h.pid} ({h.command}): {h.what}" for h in held[:10]) or "a process this user cannot see"
        raise click.ClickException(
            f"{info.mountpoint} is busy, held by {who}{' ...' if len(held) > 10 else ''}. Stop those, or "
            f"`distorefs umount --lazy {info.mountpoint}` to detach it now (the daemon flushes and exits once "
            f"the last of them lets go)")
    if pid is not None:
        deadline = time.monotonic() + timeout
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            try:
                if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                    break  # exited, not yet reaped by its parent
            except OSError:
                break
            time.sleep(0.05)
        if Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
            raise click.ClickException(f"daemon {pid} is still flushing after {timeout}s")
    click.echo(f"unmounted {info.mountpoint}")


@main.command()
@click.option("--timeout", default=5.0, show_default=True, help="Seconds to wait for each mount to answer.")
def status(timeout) -> None:
    """List mounted stores with their daemon PID, health and uptime. A mount that does not
    answer within --timeout (a hung or stopped daemon) is reported as not responding."""
    from .mounts import read_with_timeout
    found = mounts()
    if not found:
        click.echo("no distorefs mounts")
        return
    for m in found:
        try:
            stats = json.loads(read_with_timeout(m.mountpoint / ".distorefs" / "stats.json", timeout))
            health = "ok" if not stats.get("corrupt_reads") else f"{stats['corrupt_reads']} corrupt reads"
            uptime = f"{stats['uptime_s']:.0f}s"
        except TimeoutError:
            health, uptime = f"not responding (no answer in {timeout:g} s)", "-"
        except OSError as exc:
            health, uptime = f"unreachable ({exc.strerror})", "-"
        except ValueError:
            health, uptime = "unreadable stats", "-"
        click.echo(f"{m.mountpoint}  store={m.store}  pid={m.pid}  health={health}  uptime={uptime}")


@main.command()
@click.argument("mountpoint", type=click.Path(exists=True, file_okay=False))
@click.option("--actors", default=4, show_default=True)
@click.option("--seconds", default=5.0, show_default=True)
def demo(mountpoint, actors, seconds) -> None:
    """Run a short RL-style workload against a mounted store (what `make run` shows)."""
    from .workload import run_dataset_epoch, run_workload
    run_workload(Path(mountpoint), actors=actors, seconds=seconds)
    run_dataset_epoch(Path(mountpoint))


@main.command("demo-cluster")
@click.option("--workdir", default=None, type=click.Path(file_okay=False),
              help="Where the Redis servers' files and the two nodes' stores go (default: the temp directory).")
def demo_cluster(workdir) -> None:
    """Two nodes on one shared store on a Redis Cluster started for the demo (what `make run`
    shows next): inserts on one node sampled on the other, weights and a dataset shared."""
    from . import bench_buffers
    from .cluster_demo import run_cluster_demo
    from .interrupts import ends_on_signal

    with ends_on_signal(bench_buffers.unmount_all):  # a signal unwinds through the demo's own cleanup
        try:
            run_cluster_demo(Path(workdir) if workdir else None)
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            raise click.ClickException(str(exc))


@main.command("stage")
@click.argument("src", type=click.Path(exists=True))
@click.argument("dest", type=click.Path())
@click.option("--jobs", "-j", default=8, show_default=True, help="Batches in flight at once.")
@click.option("--no-seal", is_flag=True, help="Leave the dataset writable (seal later with `distorefs seal`).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--follow-symlinks", is_flag=True,
              help="Stage what every symlink names, even outside SRC (default: only links that stay inside).")
@click.option("--allow-outside", is_flag=True, help="Let a list file name files outside its own directory.")
def stage_cmd(src, dest, jobs, no_seal, quiet, follow_symlinks, allow_outside) -> None:
    """Copy SRC (a directory tree, a list of paths, or a CSV with a `path` column) into
    DEST = MNT/datasets/NAME, verifying every file; a rerun resumes. Then seal it.
    Sources are read with your rights; a rerun on a sealed dataset only compares."""
    from .stage import stage
    t0 = time.monotonic()
    try:
        report = stage(src, dest, jobs=jobs, seal=not no_seal, progress=not quiet,
                       follow_symlinks=follow_symlinks, allow_outside=allow_outside)
    except (OSError, RuntimeError) as exc:
        raise click.ClickException(str(exc))
    elapsed = time.monotonic() - t0
    if report.identical:
        click.echo(f"{dest}: already staged, identical ({report.files} files); sealed")
        return
    if report.sealed and (report.differs or report.errors):
        for line in (report.errors + report.differs)[:20]:
            click.echo(f"  differs: {line}", err=True)
        raise click.ClickException(f"{dest} is sealed and does not match {src} "
                                   f"({len(report.differs) + len(report.errors)} differences): stage into a new "
                                   f"dataset")
    click.echo(f"{report.files} files, {report.bytes / 1e6:.1f} MB in {elapsed:.1f} s "
               f"({report.bytes / 1e6 / max(elapsed, 1e-9):.1f} MB/s, {report.files / max(elapsed, 1e-9):.0f} files/s): "
               f"{report.ok} copied, {report.skipped} already staged, {len(report.errors)} failed"
               + ("; sealed" if report.sealed else ""))
    for line in report.errors[:20]:
        click.echo(f"  error: {line}", err=True)
    if report.errors:
        raise SystemExit(1)


@main.command("import")
@click.argument("src", type=click.Path(exists=True, file_okay=False))
@click.argument("dest", type=click.Path())
@click.option("--jobs", "-j", default=4, show_default=True, help="Files copied at once (weights, checkpoints, "
              "datasets; entries go one by one, in order).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def import_cmd(src, dest, jobs, quiet) -> None:
    """Load what `distorefs export` wrote (SRC) into DEST under a mount, of the same kind:
    a buffer or bank into MNT/buffers/NAME or MNT/banks/NAME (entries in order, priorities,
    times sampled), a weights tree under MNT/weights, a dataset into MNT/datasets/NAME
    (staged, then sealed), a run into MNT/checkpoints/RUN, or a whole mount into MNT. Every
    file is checked against the manifest's checksums; one that does not match is refused
    (exit 1)."""
    from .inspection import human
    from .transfer import ImportError_, import_tree
    t0 = time.monotonic()
    try:
        report = import_tree(Path(src), Path(dest), progress=not quiet, jobs=jobs)
    except (ImportError_, OSError, RuntimeError) as exc:
        raise click.ClickException(str(exc))
    elapsed = time.monotonic() - t0
    click.echo(f"imported {report.files} files, {human(report.bytes)} into {dest} in {elapsed:.1f} s"
               + (f"; {len(report.errors)} refused or failed" if report.errors else ""))
    for line in report.notes:
        click.echo(f"  note: {line}")
    for line in report.errors[:50]:
        click.echo(f"  error: {line}", err=True)
    if len(report.errors) > 50:
        click.echo(f"  ... {len(report.errors) - 50} more errors", err=True)
    if report.errors:
        raise SystemExit(1)


@main.command("warmup")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--jobs", "-j", default=4, show_default=True, help="Files warmed at once.")
@click.option("--no-memory", is_flag=True, help="Fill the page cache only (do not ask the daemon's memory tier).")
@click.option("--json", "as_json", is_flag=True, help="The summary as JSON.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def warmup_cmd(paths, jobs, no_memory, as_json, quiet) -> None:
    """Load files or trees of a mount (PATHS) into the daemon's memory tier, within its
    budget, and into the kernel's page cache, before a job reads them."""
    from .inspection import mount_root
    from .warmup import summary, warmup
    targets = [Path(p) for p in paths]
    roots = {mount_root(p) for p in targets}
    if None in roots or len(roots) != 1:
        raise click.ClickException("every PATH must be under one distorefs mount")
    report = warmup(targets, jobs=jobs, memory=not no_memory, progress=not quiet and not as_json)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2))
    else:
        for line in summary(report):
            click.echo(line)
        for line in report.errors[:20]:
            click.echo(f"  error: {line}", err=True)
    if report.errors:
        raise SystemExit(1)


@main.command("seal")
@click.argument("dataset", type=click.Path(exists=True, file_okay=False))
def seal_cmd(dataset) -> None:
    """Seal MNT/datasets/NAME: number its items, build index.npy, make it read-only."""
    from .stage import seal_dataset
    try:
        seal_dataset(dataset)
    except OSError as exc:
        raise click.ClickException(f"sealing {dataset}: {exc.strerror}")
    click.echo(f"sealed {dataset}")


@main.group()
def bench() -> None:
    """Benchmarks: each prints a table, writes JSON and a PNG chart."""


# name: (what it measures, what --quick does, what goes in --workdir)
BENCHMARKS = {
    "rl": ("A DQN learner fed by actors through the mount, in process (cpprb) and on Reverb; Reverb's own "
           "113 KB rows; the rate limiter holding fast actors to a slow learner.",
           "Shorter runs, smaller buffers (a smoke run).", "the stores and plain files"),
    "sequences": ("Sequence sampling: batch/32.npz of 80-step sequences of 10 KB steps (uniform, and prioritized with "
                  "per-step priorities written back) and the client's sample(32), vs an in-process numpy buffer slicing "
                  "the same sequences.", "4,000 steps, 3 s phases (a smoke run).", "the store"),
    "client": ("The Python client beside the mount: the DQN learner loop, sample(256) of 113 KB entries in 1 and "
               "2 processes, 113 KB inserts from 4 actors; client and file path vs in-process (cpprb).",
               "Shorter runs, fewer frames (a smoke run).", "the stores"),
    "ops": ("FUSE requests and daemon CPU per operation, every path, vs a minimal pyfuse3 filesystem and bindfs.",
            "Fewer operations and smaller files (a smoke run).", "the store, the floor and bindfs directories"),
    "buffers": ("Replay-buffer insert/sample/read throughput vs plain files, bindfs and cpprb.",
                "Smaller counts (a smoke run).", "stores and baseline directories"),
    "weights": ("One writer republishing a file while many readers read it: distorefs vs tmpfs vs ext4.",
                "Smaller file, fewer readers, shorter (a smoke run).", "the store and the ext4 baseline"),
    "datasets": ("Staging vs cp -r, and one cold shuffled epoch: distorefs vs ext4 vs bindfs.",
                 "5k small and 200 large items (a smoke run).", "the trees, the store and the copies"),
    "checkpoints": ("A 2 GiB checkpoint (close() vs durable) and a checkpointing training loop: distorefs vs "
                    "ext4 vs tmpfs.", "A 256 MiB checkpoint and a 30-step loop (a smoke run).",
                    "the store and the ext4 baseline"),
    "warmup": ("distorefs warmup vs cat, parallel cat and mmap-touch (vmtouch -t) of the same tree through a cold "
               "mount: 2,000 files of 100 KB and 3 of 100 MB.", "500 small and 2 files of 20 MB, one round.",
               "the source tree and the store"),
    "scale": ("A buffer of 20 GiB under 1 GiB of memory: insert, sample+read with compaction, RSS, space, mount "
              "time, vs cpprb.", "1 GiB under 256 MiB of memory, 10 s phases (a smoke run).",
              "the store and cpprb's memory-mapped file"),
    "cluster": ("Several nodes on one store on a Redis Cluster on loopback (3 masters with replicas): aggregate "
                "110 KB inserts with 1, 2 and 3 nodes, a learner's batch/64.npz alone and while the other nodes "
                "insert, bytes and CPU per insert (the model for real hardware), a dataset staged on one node read "
                "on another.", "3 s phases (a smoke run).",
                "the Redis servers' files and the nodes' stores"),
}


# Benchmarks made of phases that can be run alone (`--only PHASE`, repeatable): their PHASES.
BENCH_PHASES = {"rl": ("dqn", "frames", "limiter"), "client": ("dqn", "frames", "dataset")}


def _bench_command(name: str, doc: str, quick_help: str, workdir_help: str) -> None:
    def command(out, quick, workdir, drop_caches, only=()) -> None:
        import importlib
        from . import bench_buffers
        from .interrupts import ends_on_signal
        bench_buffers.DROP_CACHES = drop_caches

        with ends_on_signal(bench_buffers.unmount_all):  # a signal unwinds through the benchmark's own cleanup
            module = importlib.import_module(f"{__package__}.bench_{name}")
            module.run(Path(out), quick=quick, workdir=Path(workdir) if workdir else None,
                       **({"only": tuple(only)} if only else {}))

    command.__doc__ = doc
    if name in BENCH_PHASES:
        command = click.option("--only", multiple=True, type=click.Choice(BENCH_PHASES[name]),
                               help="Run only this phase (repeat for several; default: all).")(command)
    command = click.option("--drop-caches", is_flag=True,
                           help="Drop the host's page cache before cold reads (root; every process on the host "
                                "loses its cache). Without it cold reads may be served from memory.")(command)
    command = click.option("--workdir", default=None, type=click.Path(file_okay=False),
                           help=f"Where {workdir_help} go (default: a temp dir under the current one).")(command)
    command = click.option("--quick", is_flag=True, help=quick_help)(command)
    command = click.option("--out", default="bench-results", show_default=True,
                           type=click.Path(file_okay=False))(command)
    bench.command(name)(command)


for _name, _texts in BENCHMARKS.items():
    _bench_command(_name, *_texts)


# verify, ls, inspect, export, gc, stats: tools/inspection.py
from .inspection import COMMANDS as _INSPECTION  # noqa: E402

for _command in _INSPECTION:
    main.add_command(_command)

if __name__ == "__main__":
    main()
