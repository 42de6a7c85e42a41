"""The Python client beside the mount (distorefs.client) against its baselines, one run.

`distorefs bench client [--quick] [--out DIR] [--workdir DIR]` measures, each row through
the client and through the file path, with its baseline measured in the same run:

a) The DQN learner loop of `bench rl` (batch 64 of small .npz transitions + 64 priorities
   per step, 2 actors inserting): the client (read-ahead on, and off) and the file path,
   against the in-process learner (cpprb). Target: client >= 0.8x in-process.
b) sample(256) of 113 KB entries, one process: client and file path (np.load of
   batch/256.npz), against cpprb's sample of the same frames (which copies them). Target:
   >= 30,000 entries/s and >= 0.3x cpprb.
c) the same with 2 learner processes at once. Target: >= 1.6x one process.
d) inserts of 113 KB entries from 4 actor processes: the client (pipelined, a flush every
   32 inserts, as Reverb's writers are flushed) and the file path (np.save into entries/).
   Reverb's pipelined trajectory writers measured 9,322/s here (the issue's figure: Reverb
   is not installed on this machine, so it is not remeasured). Target: >= 1.0x Reverb.
   Beside it, the store's disk written durably (1 GiB, --quick 256 MiB, write + fdatasync)
   in 113 KB entries/s: a flush() returns once its inserts' bytes are on that disk.
e) one shuffled epoch of a dataset of 10 KB items (100,000; --quick 10,000), 4 reader
   processes, cold (with --drop-caches): MountedDataset reading the store's files (the
   order declared as EpochSampler does), MountedDataset through the mount, and the plain
   files on ext4. Target: client >= 1.0x ext4.

Client processes are started with `spawn`; numpy uses one thread per process. Writes
OUT/client.json and OUT/client.png; prints a table.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from .bench_buffers import DistorefsMount, print_report, remove_workdir, save_figure, start_run
from .bench_rl import FRAME, _dqn, _one_thread, _params, _Workers

REVERB_INSERTS = 9322.0  # 113 KB inserts/s by 4 actors with Reverb's trajectory writers (issue 13)
FLUSH_EVERY = 32


def _inserter(system: str, buf: str, seed: int, count: int, ready, result) -> None:
    _one_thread()
    out: dict[str, Any] = {"inserted": 0, "seconds": 0.0, "error": None}
    try:
        frame = np.random.default_rng(seed).integers(0, 256, size=FRAME, dtype=np.uint8)
        client = None
        if system == "client":
            from distorefs.client import open_buffer
            client = open_buffer(buf, direct=True)
        ready.wait(timeout=120)
        t0 = time.perf_counter()
        for n in range(count):
            frame[:8] = np.frombuffer(n.to_bytes(8, "little"), np.uint8)
            if client is not None:
                client.insert(f"w{seed}-{n:08d}", frame)
                if n % FLUSH_EVERY == FLUSH_EVERY - 1:  # as Reverb's flush(block_until_num_items=32)
                    client.flush(keep=FLUSH_EVERY)
            else:
                np.save(f"{buf}/entries/w{seed}-{n:08d}.npy", frame)
        if client is not None:
            client.flush()
            client.close()
        out.update(inserted=count, seconds=time.perf_counter() - t0)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
    result.put(out)


def _sampler(system: str, buf: str, n: int, seconds: float, ready, result) -> None:
    _one_thread()
    out: dict[str, Any] = {"entries": 0, "seconds": 0.0, "error": None}
    try:
        client = None
        if system == "client":
            from distorefs.client import open_buffer
            client = open_buffer(buf, direct=True)
        ready.wait(timeout=120)
        t0 = time.perf_counter()
        deadline = t0 + seconds
        while time.perf_counter() < deadline:
            if client is not None:
                frames = client.sample(n)["data"]
            else:
                with np.load(f"{buf}/batch/{n}.npz") as z:
                    frames = z["data"]
            assert frames.shape == (n, *FRAME)
            out["entries"] += n
        out["seconds"] = time.perf_counter() - t0
        if client is not None:
            client.close()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
    result.put(out)


def _cpprb(count: int, n: int, seconds: float, result) -> None:
    """cpprb's sample(n) of `count` 113 KB frames (its sample gathers, so copies, the frames)."""
    _one_thread()
    out: dict[str, Any] = {"entries": 0, "seconds": 0.0, "error": None}
    try:
        from cpprb import PrioritizedReplayBuffer
        rb = PrioritizedReplayBuffer(count, {"frame": {"shape": FRAME, "dtype": np.uint8}}, alpha=0.6)
        frame = np.random.default_rng(0).integers(0, 256, size=FRAME, dtype=np.uint8)
        for _ in range(count):
            rb.add(frame=frame)
        t0 = time.perf_counter()
        deadline = t0 + seconds
        while time.perf_counter() < deadline:
            s = rb.sample(n, beta=0.4)
            assert s["frame"].shape == (n, *FRAME)
            out["entries"] += n
        out["seconds"] = time.perf_counter() - t0
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    result.put(out)


def _disk_write(root: Path, nbytes: int = 1 << 30) -> dict:
    """The store's disk, written as a durable insert writes it: 1 MiB writes of incompressible
    bytes then fdatasync (dd conv=fdatasync). 113 KB inserts acknowledged by flush() cannot
    outrun it for long: their bytes are on this disk when flush() returns."""
    block = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    path = root / "disk-write.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(nbytes // len(block)):
            os.write(fd, block)
        os.fdatasync(fd)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    mb_per_s = nbytes / 1e6 / seconds
    return {"mb_per_s": round(mb_per_s, 1), "entries_per_s": round(mb_per_s * 1e6 / float(np.prod(FRAME)), 1),
            "mib": nbytes >> 20}


def _run_procs(workers: _Workers, ctx, target, argsets: list[tuple], timeout: float) -> list[dict]:
    """Start one process per argument tuple (each gets `ready` and `result` appended), let
    them go together, and gather their results."""
    ready = ctx.Barrier(len(argsets) + 1)
    result = ctx.Queue()
    procs = [workers.start(target, *args, ready, result) for args in argsets]
    ready.wait(timeout=120)
    outs = [result.get(timeout=timeout) for _ in procs]
    workers.finish(procs)
    return outs


def _frames(system: str, root: Path, p: dict, ctx, errors: list[str]) -> dict:
    """d) 4 inserting processes, then b) one sampler, c) two samplers."""
    mount = DistorefsMount(root / f"store-{system}", root / f"mnt-{system}")
    workers = _Workers(ctx)
    res: dict[str, Any] = {}
    try:
        mount.mount()
        buf = mount.mnt / "buffers" / "frames"
        buf.mkdir()
        # A replay buffer at its capacity, as an actor's inserts meet one: each insert evicts
        # the oldest entry (Reverb's tables have a max_size too). Each actor inserts as many
        # as the buffer holds, so the rate is that of the steady state, not of a first fill.
        (buf / "config.json").write_text(json.dumps({"capacity": p["frames"], "sampler": "prioritized"}))
        per = p["frames"]
        outs = _run_procs(workers, ctx, _inserter, [(system, str(buf), 100 + i, per) for i in range(4)],
                          timeout=900)
        errors.extend(f"insert {system}: {o['error']}" for o in outs if o["error"])
        slowest = max(o["seconds"] for o in outs) or 1e-9
        res["inserts_4_actors_per_s"] = round(sum(o["inserted"] for o in outs) / slowest, 1)
        for label, procs in (("sample_256_1_process", 1), ("sample_256_2_processes", 2)):
            outs = _run_procs(workers, ctx, _sampler, [(system, str(buf), 256, p["seconds"])] * procs,
                              timeout=p["seconds"] + 300)
            errors.extend(f"{label} {system}: {o['error']}" for o in outs if o["error"])
            res[label] = round(sum(o["entries"] / (o["seconds"] or 1e-9) for o in outs), 1)
        return res
    finally:
        workers.kill_all()
        mount.umount()


def _ds_reader(root: str, items: list[int], direct: bool, barrier, results) -> None:
    from distorefs.loader import MountedDataset
    data = MountedDataset(root, direct=direct)
    barrier.wait()
    t0 = time.perf_counter()
    total = sum(len(data[i]) for i in items)
    results.put((time.perf_counter() - t0, len(items), total))


def _dataset(root: Path, p: dict, notes: list[str]) -> dict:
    """e) a cold shuffled epoch, 4 readers: client, mount, ext4."""
    from .bench_buffers import _drop_caches
    from .bench_datasets import _epoch, _generate, timed_readers
    from distorefs.loader import MountedDataset
    src = root / "ds-src"
    _generate(src, p["ds_items"], 10 << 10, 0, seed=7)
    mount = DistorefsMount(root / "store-ds", root / "mnt-ds")
    res: dict[str, Any] = {"items": p["ds_items"], "item_bytes": 10 << 10}
    try:
        mount.mount()
        ds = mount.mnt / "datasets" / "epoch"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "distorefs.tools.cli", "stage", "-q", str(src), str(ds)], check=True,
                       capture_output=True, timeout=3600)
        res["stage_seconds"] = round(time.perf_counter() - t0, 1)
        data = MountedDataset(ds, direct=False)
        order = np.random.default_rng(1).permutation(len(data))
        for label, direct in (("client", True), ("files", False)):
            _drop_caches(notes)
            data.declare(order)  # as EpochSampler does before the first read
            res[label] = timed_readers(_ds_reader, [(str(ds), order[k::4].tolist(), direct) for k in range(4)])
        _drop_caches(notes)
        base = os.fsencode(src) + b"/"
        res["ext4"] = _epoch([base + bytes(data.index["path"][j]) for j in order.tolist()], 4)  # the same order
        return res
    finally:
        mount.umount()
        shutil.rmtree(src, ignore_errors=True)


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


def format_table(res: dict) -> str:
    def cell(v, fmt="{:,.1f}"):
        return "-" if v is None else fmt.format(v)
    dqn, frames = res.get("dqn", {}), res.get("frames", {})
    c, f = frames.get("client") or {}, frames.get("files") or {}
    inproc = (dqn.get("in-process") or {}).get("learner_steps_per_s")
    rows = [
        ("DQN learner 64 + priorities, 2 actors (steps/s)",
         (dqn.get("client") or {}).get("learner_steps_per_s"), (dqn.get("files") or {}).get("learner_steps_per_s"),
         inproc, "in-process", ">= 0.8x"),
        ("  same, client without read-ahead (steps/s)",
         (dqn.get("client-no-read-ahead") or {}).get("learner_steps_per_s"), None, inproc, "in-process", ""),
        ("sample 256 of 113 KB, 1 process (entries/s)", c.get("sample_256_1_process"),
         f.get("sample_256_1_process"), (res.get("cpprb") or {}).get("entries_per_s"), "cpprb", ">= 0.3x"),
        ("sample 256 of 113 KB, 2 processes (entries/s)", c.get("sample_256_2_processes"),
         f.get("sample_256_2_processes"), c.get("sample_256_1_process"), "client, 1 process", ">= 1.6x"),
        ("inserts of 113 KB, 4 actor processes (entries/s)", c.get("inserts_4_actors_per_s"),
         f.get("inserts_4_actors_per_s"), REVERB_INSERTS, "Reverb (issue's figure)", ">= 1.0x"),
        ("  the store's disk, write + fdatasync (113 KB/s)", None, None,
         (res.get("disk") or {}).get("entries_per_s"), f"{(res.get('disk') or {}).get('mib')} MiB in 1 MiB writes", ""),
        ("dataset epoch, 10 KB items, 4 readers, cold (items/s)",
         ((res.get("dataset") or {}).get("client") or {}).get("items_per_s"),
         ((res.get("dataset") or {}).get("files") or {}).get("items_per_s"),
         ((res.get("dataset") or {}).get("ext4") or {}).get("items_per_s"), "ext4 files", ">= 1.0x"),
    ]
    lines = [f"{'measure':50s} {'client':>9s} {'files':>9s} {'baseline':>9s} {'client/base':>11s} {'target':>8s}  baseline"]
    for text, cv, fv, bv, base, target in rows:
        lines.append(f"{text:50s} {cell(cv):>9s} {cell(fv):>9s} {cell(bv):>9s} "
                     f"{cell(_ratio(cv, bv), '{:.2f}x'):>11s} {target:>8s}  {base}")
    return "\n".join(lines)


def _plot(res: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    dqn = res.get("dqn", {})
    names = ["in-process", "client", "client-no-read-ahead", "files"]
    axes[0].bar(names, [(dqn.get(s) or {}).get("learner_steps_per_s") or 0 for s in names])
    axes[0].set_title("DQN learner (steps/s)")
    axes[0].tick_params(axis="x", rotation=20)
    frames = res.get("frames", {})
    labels = ["sample_256_1_process", "sample_256_2_processes"]
    x = np.arange(len(labels))
    for j, s in enumerate(("client", "files")):
        axes[1].bar(x + (j - 0.5) * 0.4, [(frames.get(s) or {}).get(label) or 0 for label in labels], 0.4, label=s)
    axes[1].axhline((res.get("cpprb") or {}).get("entries_per_s") or 0, color="grey", linestyle="--", label="cpprb")
    axes[1].set_xticks(x, ["sample 256\n1 process", "sample 256\n2 processes"])
    axes[1].set_title("113 KB entries sampled (entries/s)")
    axes[1].legend()
    axes[2].bar(["client", "files", "Reverb\n(issue)"], [(frames.get("client") or {}).get("inserts_4_actors_per_s") or 0,
                                                        (frames.get("files") or {}).get("inserts_4_actors_per_s") or 0,
                                                        REVERB_INSERTS])
    axes[2].set_title("113 KB inserts, 4 actors (entries/s)")
    save_figure(fig, path, title)


PHASES = ("dqn", "frames", "dataset")


def run(out: Path, quick: bool = False, workdir: Path | None = None, only: tuple[str, ...] = ()) -> dict:
    phases = [ph for ph in PHASES if not only or ph in only]
    r = start_run(out, workdir)
    out, root, notes, machine = r.out, r.root, r.notes, r.machine
    p = _params(quick)
    p["frames"] = 800 if quick else 3000
    p["ds_items"] = 10_000 if quick else 100_000
    _one_thread()
    ctx = mp.get_context("spawn")
    print(f"distorefs bench client{' --quick' if quick else ''}: workdir {root}, {machine['cpus']} CPUs", flush=True)
    res: dict[str, Any] = {"dqn": {}, "frames": {}}
    errors: list[str] = []
    notes.append(f"Reverb is not remeasured (not installed here): its 113 KB insert rate is the issue's "
                 f"figure, {REVERB_INSERTS:,.0f}/s")
    try:
        for label, system, extra in (("in-process", "in-process", {}), ("client", "client", {"read_ahead": True}),
                                     ("client-no-read-ahead", "client", {"read_ahead": False}),
                                     ("files", "distorefs", {})) if "dqn" in phases else ():
            try:
                res["dqn"][label] = _dqn(system, root / f"dqn-{label}", p, ctx, **extra)
                print(f"  DQN loop {label:22s}: {res['dqn'][label]}", flush=True)
            except Exception as exc:
                errors.append(f"DQN {label}: {type(exc).__name__}: {exc}")
        for system in ("client", "files") if "frames" in phases else ():
            try:
                res["frames"][system] = _frames(system, root, p, ctx, errors)
                print(f"  113 KB {system:8s}: {res['frames'][system]}", flush=True)
            except Exception as exc:
                errors.append(f"113 KB {system}: {type(exc).__name__}: {exc}")
        if "frames" in phases:
            res["disk"] = _disk_write(root, (256 if quick else 1024) << 20)
            print(f"  the store's disk: {res['disk']}", flush=True)
            result = ctx.Queue()
            workers = _Workers(ctx)
            try:
                workers.start(_cpprb, min(p["frames"], 3000), 256, p["seconds"], result)
                o = result.get(timeout=p["seconds"] + 300)
            finally:
                workers.kill_all()
            if o["error"]:
                errors.append(f"cpprb: {o['error']}")
            res["cpprb"] = {"entries_per_s": round(o["entries"] / (o["seconds"] or 1e-9), 1)}
            print(f"  cpprb sample 256: {res['cpprb']}", flush=True)
        if "dataset" in phases:
            try:
                res["dataset"] = _dataset(root, p, notes)
                print(f"  dataset epoch: {res['dataset']}", flush=True)
            except Exception as exc:
                errors.append(f"dataset: {type(exc).__name__}: {exc}")
    finally:
        remove_workdir(root, errors)
    for v in res["dqn"].values():
        errors.extend(v.get("errors", []))
    c = res["frames"].get("client") or {}
    dq = res["dqn"]
    client_dqn = (dq.get("client") or {}).get("learner_steps_per_s")
    inproc = (dq.get("in-process") or {}).get("learner_steps_per_s")
    one, two = c.get("sample_256_1_process"), c.get("sample_256_2_processes")
    cpprb = (res.get("cpprb") or {}).get("entries_per_s")
    ins = c.get("inserts_4_actors_per_s")
    dc = ((res.get("dataset") or {}).get("client") or {}).get("items_per_s")
    de = ((res.get("dataset") or {}).get("ext4") or {}).get("items_per_s")

    def goal(text, value, met):
        return {"goal": text, "value": value, "met": met}
    goals = [
        goal("DQN learner loop via the client >= 0.8x in-process", f"{_ratio(client_dqn, inproc)}x",
             None if (q := _ratio(client_dqn, inproc)) is None else q >= 0.8),
        goal("sample(256) of 113 KB, 1 process >= 30,000 entries/s", f"{one}",
             None if one is None else one >= 30_000),
        goal("sample(256) of 113 KB, 1 process >= 0.3x cpprb", f"{_ratio(one, cpprb)}x",
             None if (q := _ratio(one, cpprb)) is None else q >= 0.3),
        goal("sample(256), 2 processes >= 1.6x one process", f"{_ratio(two, one)}x",
             None if (q := _ratio(two, one)) is None else q >= 1.6),
        goal("113 KB inserts, 4 actors >= 1.0x Reverb (9,322/s, the issue's figure)", f"{_ratio(ins, REVERB_INSERTS)}x",
             None if (q := _ratio(ins, REVERB_INSERTS)) is None else q >= 1.0),
        goal("dataset epoch, 10 KB items, 4 readers, cold: client >= 1.0x ext4", f"{_ratio(dc, de)}x",
             None if (q := _ratio(dc, de)) is None else q >= 1.0),
    ]
    table = format_table(res)
    result_doc = {"benchmark": "client", "quick": quick, "params": p, "machine": machine, "results": res,
                  "goals": goals, "notes": notes, "errors": errors, "table": table}
    (out / "client.json").write_text(json.dumps(result_doc, indent=2, default=str) + "\n")
    try:
        _plot(res, out / "client.png", f"distorefs.client ({machine['cpus']} CPUs{', quick' if quick else ''})")
    except Exception as exc:
        errors.append(f"plot: {exc}")
    print_report(table, goals, notes, errors)
    print(f"wrote {out / 'client.json'} and {out / 'client.png'}")
    return result_doc
