"""RL workloads end to end: a DQN learner fed by actors, through the mount and in process.

`distorefs bench rl [--quick] [--only PHASE] [--out DIR] [--workdir DIR]` runs, in one go
(or only the phases named: dqn, frames, limiter):

a) The DQN loop: 2 actor processes step a small environment, insert each transition
   (obs, action, reward, next_obs, done) and re-read the published Q-network every 200
   steps, paced at 100 environment steps per second each (as a simulator would pace them:
   an unpaced actor would measure how fast a queue fills, not a learner); one learner draws prioritized batches of 64, takes a gradient step of a numpy
   MLP, writes 64 priorities back, publishes its weights every 100 steps and saves a
   checkpoint every 1,000. Learner steps per second:
   - distorefs: entries/ via np.savez, batch/64.npz via np.load, a `priorities` write per
     step, weights/ and checkpoints/ on the mount;
   - in-process: the learner owns a cpprb PrioritizedReplayBuffer, actors send their
     transitions through multiprocessing queues, weights and checkpoints are files on the
     same disk (the fastest a single-node learner gets);
   - Reverb (dm-reverb, when installed: `pip install 'distorefs[reverb]'`): a prioritized
     table in a server on localhost, actors with trajectory writers (flushed every 32
     items, as Reverb asks), the learner reads batches from a TrajectoryDataset as Acme
     does (about twice Client.sample()'s rate) and mutates priorities with its client.
   - files on tmpfs (the file API's own cost, no store and no sampling): actors write
     their transitions as .npz files into a tmpfs directory, the learner np.loads one
     batch/64.npz saved from the distorefs run and writes its priorities to a tmpfs file:
     what any file system would leave of the in-process rate, measured in the same run.
   Beside the rates: the daemon's CPU (all its threads) over the learner's timed steps, in
   cores and per learner step, a figure the machine's spread moves less than steps/s.
   Target (issue 12): distorefs >= 0.5x in-process.

b) Reverb's own ground, 113 KB uint8 entries in a prioritized buffer: `sample 256`
   idle, the same while 4 writer processes insert, and a learner loop (sample 64 +
   priority updates) while 2 writers insert; distorefs (np.save into entries/, np.load of
   batch/N.npz, a `priorities` write per step) against Reverb. Target: >= 1.0x Reverb.
   Beside it, np.load of one batch/256.npz saved from the mount onto tmpfs (idle): what
   that file format costs its reader on the fastest file system (zipfile checks each
   member's CRC-32 as it reads).

c) The rate limiter (samples_per_insert 8, error_buffer 256, min_size_to_sample 256): 2
   unpaced DQN actors (an environment step of no cost) inserting transitions and a learner
   whose step takes 20 ms (batch 64), through files without and with the limiter, and
   through the client with it; then actors paced at 50 steps/s and a learner without a
   step (the learner held back): the
   samples per insert observed over time, the error `inserts * 8 - samples` against the
   range the limiter keeps it in, each side's rate and the time each side waited. Goal:
   with the limiter the error stays within error_buffer of its target.

Client processes are started with `spawn`; numpy uses one thread per process. Writes
OUT/rl.json, OUT/rl.png (a, b) and OUT/rl-limiter.png (c); prints a table.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .bench_buffers import DistorefsMount, _proc_cpu, print_report, remove_workdir, save_figure, start_run

OBS = 8
ACTIONS = 4
HIDDEN = 512  # a 1.35 ms gradient step here: in process ~630 steps/s, as the DQN issue 12 measured
BATCH = 64
FRAME = (113_024 - 128,)  # uint8: a 113 KB .npy, as in Reverb's measurement
REVERB_IN_FLIGHT = 32  # items a Reverb writer leaves unconfirmed before flush() waits (Reverb asks writers to flush)


def _params(quick: bool) -> dict:
    if quick:
        return {"seconds": 4.0, "warmup": 300, "env_cost": 20, "actor_hz": 100, "reverb_seconds": 3.0, "frames": 600,
                "limit_seconds": 5.0}
    return {"seconds": 20.0, "warmup": 1000, "env_cost": 20, "actor_hz": 100, "reverb_seconds": 10.0, "frames": 3000,
            "limit_seconds": 15.0}


def _one_thread() -> None:
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow (under Reverb) prints its banner per process


# ----- the agent (plain numpy) ----------------------------------------------------------------

class QNet:
    """A 2-layer MLP Q-network with a target copy, trained by SGD on weighted TD errors."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.w1 = (rng.standard_normal((OBS, HIDDEN)) / np.sqrt(OBS)).astype(np.float32)
        self.w2 = (rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
        self.w3 = (rng.standard_normal((HIDDEN, ACTIONS)) / np.sqrt(HIDDEN)).astype(np.float32)
        self.target = self.weights()

    def weights(self) -> np.ndarray:
        return np.concatenate([self.w1.ravel(), self.w2.ravel(), self.w3.ravel()])

    def load(self, flat: np.ndarray) -> None:
        a, b = OBS * HIDDEN, OBS * HIDDEN + HIDDEN * HIDDEN
        self.w1 = flat[:a].reshape(OBS, HIDDEN)
        self.w2 = flat[a:b].reshape(HIDDEN, HIDDEN)
        self.w3 = flat[b:].reshape(HIDDEN, ACTIONS)

    def q(self, obs: np.ndarray, flat: np.ndarray | None = None) -> np.ndarray:
        w1, w2, w3 = (self.w1, self.w2, self.w3) if flat is None else self._split(flat)
        return np.maximum(np.maximum(obs @ w1, 0) @ w2, 0) @ w3

    def _split(self, flat):
        a, b = OBS * HIDDEN, OBS * HIDDEN + HIDDEN * HIDDEN
        return flat[:a].reshape(OBS, HIDDEN), flat[a:b].reshape(HIDDEN, HIDDEN), flat[b:].reshape(HIDDEN, ACTIONS)

    def step(self, obs, action, reward, next_obs, done, weights, lr: float = 1e-3) -> np.ndarray:
        """One SGD step on importance-weighted TD errors; returns the TD errors."""
        h1 = np.maximum(obs @ self.w1, 0)
        h2 = np.maximum(h1 @ self.w2, 0)
        q = h2 @ self.w3
        target = reward + 0.99 * (1 - done) * self.q(next_obs, self.target).max(axis=1)
        idx = np.arange(len(action))
        td = (q[idx, action] - target).astype(np.float32)
        g = np.zeros_like(q)
        g[idx, action] = td * weights / len(action)
        gw3 = h2.T @ g
        g2 = (g @ self.w3.T) * (h2 > 0)
        gw2 = h1.T @ g2
        g1 = (g2 @ self.w2.T) * (h1 > 0)
        gw1 = obs.T @ g1
        self.w1 -= lr * gw1
        self.w2 -= lr * gw2
        self.w3 -= lr * gw3
        return td


def _env_step(rng: np.random.Generator, state: np.ndarray, action: int, cost: int) -> tuple[np.ndarray, float, bool]:
    """A toy environment whose step costs some CPU, as a simulator's does."""
    for _ in range(cost):
        state = np.tanh(state * 1.01 + 0.01 * (action - 1.5))
    nxt = (state + rng.standard_normal(OBS).astype(np.float32) * 0.1).astype(np.float32)
    return nxt, float(-np.abs(nxt).sum()), bool(rng.random() < 0.01)


def _npz(**arrays) -> bytes:
    import io
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


# ----- the DQN loop: actors and learner per system --------------------------------------------

def _actor(system: str, cfg: dict, stop, counter, errors) -> None:
    _one_thread()
    try:
        rng = np.random.default_rng(cfg["seed"])
        net = QNet(1)
        flat = net.weights()
        state = rng.standard_normal(OBS).astype(np.float32)
        writer = _Writer(system, cfg)
        n = 0
        period = 1.0 / cfg["actor_hz"]
        due = time.perf_counter()
        while not stop.is_set():
            due += period
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            if n % 200 == 0:
                flat = writer.weights() if n else flat
            q = net.q(state[None, :], flat)[0]
            action = int(q.argmax()) if rng.random() > 0.1 else int(rng.integers(ACTIONS))
            nxt, reward, done = _env_step(rng, state, action, cfg["env_cost"])
            writer.insert(n, state, action, reward, nxt, done)
            state = rng.standard_normal(OBS).astype(np.float32) if done else nxt
            n += 1
            with counter.get_lock():
                counter.value += 1
        writer.close()
    except Exception as exc:
        errors.put(f"actor {system}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")


class _Writer:
    """How an actor of each system hands over a transition and reads the weights."""

    def __init__(self, system: str, cfg: dict) -> None:
        self.system, self.cfg = system, cfg
        if system == "reverb":
            import reverb
            self.client = reverb.Client(f"localhost:{cfg['port']}")
            self.writer = self.client.trajectory_writer(num_keep_alive_refs=1)
        elif system == "client":
            from distorefs.client import open_buffer
            self.buffer = open_buffer(cfg["buffer"], direct=True)

    def insert(self, n: int, obs, action, reward, nxt, done) -> None:
        cfg = self.cfg
        if self.system == "client":  # pipelined, acknowledged every REVERB_IN_FLIGHT, as Reverb's writers
            self.buffer.insert(f"a{cfg['seed']}-{n:08d}", {"obs": obs, "action": np.int64(action),
                                                          "reward": np.float32(reward), "next_obs": nxt,
                                                          "done": np.float32(done)})
            if n % REVERB_IN_FLIGHT == REVERB_IN_FLIGHT - 1:
                self.buffer.flush(keep=REVERB_IN_FLIGHT)
        elif self.system == "distorefs":
            with open(f"{cfg['buffer']}/entries/a{cfg['seed']}-{n:08d}.npz", "wb") as f:
                f.write(_npz(obs=obs, action=np.int64(action), reward=np.float32(reward), next_obs=nxt,
                             done=np.float32(done)))
        elif self.system == "tmpfs":
            with open(f"{cfg['entries']}/a{cfg['seed']}-{n:08d}.npz", "wb") as f:
                f.write(_npz(obs=obs, action=np.int64(action), reward=np.float32(reward), next_obs=nxt,
                             done=np.float32(done)))
        elif self.system == "in-process":
            cfg["queue"].put((obs, action, reward, nxt, done))
        else:
            self.writer.append({"obs": obs, "action": np.int64(action), "reward": np.float32(reward),
                                "next_obs": nxt, "done": np.float32(done)})
            self.writer.create_item("dqn", priority=1.0, trajectory={
                k: self.writer.history[k][-1] for k in ("obs", "action", "reward", "next_obs", "done")})
            self.writer.flush(block_until_num_items=REVERB_IN_FLIGHT)

    def weights(self) -> np.ndarray:
        return np.load(self.cfg["weights"])

    def close(self) -> None:
        if self.system == "reverb":
            self.writer.flush()
            self.writer.close()
        elif self.system == "client":
            self.buffer.flush()
            self.buffer.close()


def _learner(system: str, cfg: dict, result) -> None:
    _one_thread()
    out: dict[str, Any] = {"steps": 0, "seconds": 0.0, "error": None}
    try:
        net = QNet(0)
        source = _Source(system, cfg)
        source.wait_for(cfg["warmup"])
        np.save(cfg["weights"], net.weights())
        daemon = cfg.get("daemon_pid")  # distorefs: its CPU over the timed steps (all its threads)
        daemon_cpu0 = _proc_cpu(daemon)
        t0 = time.perf_counter()
        deadline = t0 + cfg["seconds"]
        steps = 0
        spent = {"sample": 0.0, "train": 0.0, "priorities": 0.0, "publish+checkpoint": 0.0}
        t = time.perf_counter()
        while t < deadline:
            b = source.sample(BATCH)
            t1 = time.perf_counter()
            td = net.step(b["obs"], b["action"].astype(np.int64), b["reward"], b["next_obs"], b["done"],
                          b["weights"].astype(np.float32))
            t2 = time.perf_counter()
            source.update(b["keys"], np.abs(td) + 1e-3)
            t3 = time.perf_counter()
            steps += 1
            if steps % 100 == 0:
                net.target = net.weights()
                source.publish(net.weights(), cfg["weights"])
            if steps % 1000 == 0:
                source.checkpoint(steps, net.weights())
            t4 = time.perf_counter()
            spent["sample"] += t1 - t
            spent["train"] += t2 - t1
            spent["priorities"] += t3 - t2
            spent["publish+checkpoint"] += t4 - t3
            t = t4
        out.update(steps=steps, seconds=time.perf_counter() - t0, inserted=source.inserted(),
                   step_ms={k: round(v / max(steps, 1) * 1e3, 3) for k, v in spent.items()})
        daemon_cpu1 = _proc_cpu(daemon)
        if daemon_cpu0 is not None and daemon_cpu1 is not None and steps:
            used = daemon_cpu1 - daemon_cpu0
            out.update(daemon_cores=round(used / out["seconds"], 3), daemon_cpu_ms_per_step=round(used / steps * 1e3, 3))
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
    result.put(out)


class _Source:
    """How the learner of each system samples, updates priorities, publishes, checkpoints."""

    def __init__(self, system: str, cfg: dict) -> None:
        self.system, self.cfg = system, cfg
        if system == "in-process":
            from cpprb import PrioritizedReplayBuffer
            self.rb = PrioritizedReplayBuffer(100_000, {"obs": {"shape": OBS, "dtype": np.float32},
                                                        "action": {"dtype": np.int64},
                                                        "reward": {"dtype": np.float32},
                                                        "next_obs": {"shape": OBS, "dtype": np.float32},
                                                        "done": {"dtype": np.float32}}, alpha=0.6)
            self.added = 0
        elif system == "reverb":
            import reverb
            self.client = reverb.Client(f"localhost:{cfg['port']}")
            self.batches: Iterator[Any] | None = None  # Reverb batches as numpy, made at the first sample
        elif system == "client":
            from distorefs.client import open_buffer
            self.buffer = open_buffer(cfg["buffer"], direct=True, read_ahead=cfg.get("read_ahead", True))

    def _drain(self) -> None:
        q = self.cfg["queue"]
        while True:
            try:
                obs, action, reward, nxt, done = q.get_nowait()
            except queue.Empty:
                return
            self.rb.add(obs=obs, action=action, reward=reward, next_obs=nxt, done=float(done))
            self.added += 1

    def wait_for(self, n: int) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.system == "in-process":
                self._drain()
                have = self.added
            elif self.system in ("distorefs", "client"):
                have = json.loads(Path(self.cfg["buffer"], "stats.json").read_bytes())["entries"]
            elif self.system == "tmpfs":
                have = len(os.listdir(self.cfg["entries"]))
            else:
                have = self.client.server_info()["dqn"].current_size
            if have >= n:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{self.system}: fewer than {n} transitions after 120 s")

    def sample(self, n: int) -> dict:
        if self.system == "client":
            return self.buffer.sample(n)
        if self.system in ("distorefs", "tmpfs"):
            path = f"{self.cfg['buffer']}/batch/{n}.npz" if self.system == "distorefs" else self.cfg["batch_file"]
            with np.load(path) as z:
                return {k: z[k] for k in ("obs", "action", "reward", "next_obs", "done", "keys", "weights")}
        if self.system == "in-process":
            self._drain()
            s = self.rb.sample(n, beta=0.4)
            return {"obs": s["obs"], "action": s["action"].ravel(), "reward": s["reward"].ravel(),
                    "next_obs": s["next_obs"], "done": s["done"].ravel(), "keys": s["indexes"],
                    "weights": s["weights"]}
        if self.batches is None:
            self.batches = _reverb_batches(self.cfg["port"], "dqn", {
                "obs": ("float32", (OBS,)), "action": ("int64", ()), "reward": ("float32", ()),
                "next_obs": ("float32", (OBS,)), "done": ("float32", ())}, n)
        s = next(self.batches)
        w = (n * s.info.probability) ** -0.4
        return {**s.data, "keys": s.info.key.tolist(), "weights": w / w.max()}

    def update(self, keys, priorities: np.ndarray) -> None:
        if self.system == "client":
            self.buffer.update_priorities(keys, priorities)
        elif self.system in ("distorefs", "tmpfs"):
            path = f"{self.cfg['buffer']}/priorities" if self.system == "distorefs" else self.cfg["priorities_file"]
            with open(path, "w") as f:
                f.write("".join(f"{k} {p:.6g}\n" for k, p in zip(keys, priorities.tolist())))
        elif self.system == "in-process":
            self.rb.update_priorities(keys, priorities)
        else:
            self.client.mutate_priorities("dqn", updates=dict(zip(keys, priorities.tolist())))

    def publish(self, flat: np.ndarray, path: str) -> None:
        tmp = path + ".tmp.npy" if self.system not in ("distorefs", "client") else None
        if tmp:  # a plain file system: write then rename, or actors read torn weights
            np.save(tmp, flat)
            os.replace(tmp, path)
        else:
            np.save(path, flat)  # published whole at close

    def checkpoint(self, step: int, flat: np.ndarray) -> None:
        d = Path(self.cfg["checkpoints"]) / f"step-{step:07d}"
        d.mkdir(parents=True, exist_ok=True)
        np.save(d / "q.npy", flat)

    def inserted(self) -> int:
        if self.system == "in-process":
            return self.added
        return 0


def _dqn(system: str, root: Path, p: dict, ctx, **extra: Any) -> dict:
    """The DQN loop of `system`: in-process, distorefs (files), tmpfs (`extra` batch_file, a
    batch/64.npz of the distorefs run: the file API alone), client (distorefs.client:
    `extra` read_ahead) or reverb. A distorefs run leaves one of its batch files at
    root/batch-64.npz."""
    cfg: dict[str, Any] = {"seconds": p["seconds"], "warmup": p["warmup"], "env_cost": p["env_cost"],
                           "actor_hz": p["actor_hz"], **extra}
    mount = server = None
    workers = _Workers(ctx)
    try:
        if system in ("distorefs", "client"):
            mount = DistorefsMount(root / "store", root / "mnt")
            mount.mount()
            buf = mount.mnt / "buffers" / "dqn"
            buf.mkdir()
            (buf / "config.json").write_text(json.dumps({"capacity": 100_000, "sampler": "prioritized"}))
            (mount.mnt / "weights" / "dqn").mkdir(parents=True)
            (mount.mnt / "checkpoints" / "dqn").mkdir(parents=True)
            cfg.update(buffer=str(buf), weights=str(mount.mnt / "weights" / "dqn" / "q.npy"),
                       checkpoints=str(mount.mnt / "checkpoints" / "dqn"), daemon_pid=mount.pid)
        elif system == "tmpfs":
            (root / "entries").mkdir(parents=True)
            cfg.update(entries=str(root / "entries"), weights=str(root / "q.npy"), checkpoints=str(root / "ckpt"),
                       priorities_file=str(root / "priorities"))
        else:
            (root / "plain").mkdir(parents=True, exist_ok=True)
            cfg.update(weights=str(root / "plain" / "q.npy"), checkpoints=str(root / "plain" / "ckpt"))
            if system == "in-process":
                cfg["queue"] = ctx.Queue()
            else:
                server = _ReverbServer(ctx, {"dqn": "prioritized"}, 100_000)
                cfg["port"] = server.port
        np.save(cfg["weights"], QNet(0).weights())
        stop, counter, errors, result = ctx.Event(), ctx.Value("q", 0), ctx.Queue(), ctx.Queue()
        actors = [workers.start(_actor, system, {**cfg, "seed": i}, stop, counter, errors) for i in range(2)]
        learner = workers.start(_learner, system, cfg, result)
        out = result.get(timeout=p["seconds"] + 240)
        stop.set()
        workers.finish(actors + [learner])
        errs = []
        while not errors.empty():
            errs.append(errors.get())
        if out["error"]:
            errs.append(out["error"])
        if system == "distorefs" and not out["error"]:
            shutil.copyfile(Path(cfg["buffer"]) / "batch" / f"{BATCH}.npz", root / f"batch-{BATCH}.npz")
        steps_s = out["steps"] / out["seconds"] if out["seconds"] else 0.0
        res = {"learner_steps_per_s": round(steps_s, 1), "steps": out["steps"], "seconds": round(out["seconds"], 2),
               "actor_steps": counter.value, "learner_ms_per_step": out.get("step_ms")}
        if "daemon_cores" in out:  # (a spread of steps/s hides what the daemon's CPU shows)
            res.update(daemon_cores=out["daemon_cores"], daemon_cpu_ms_per_step=out["daemon_cpu_ms_per_step"])
        if system == "distorefs" and mount is not None and not out["error"]:
            try:  # an aside: its failure must not cost the run its figures
                res["round_trips"] = _round_trips(mount.mnt, Path(cfg["buffer"]))
            except Exception as exc:
                errs.append(f"counting the learner's requests: {type(exc).__name__}: {exc}")
        if errs:
            res["errors"] = errs[:3]
        return res
    finally:
        _end_phase(workers, mount, server)


STEPS_COUNTED = 100
PRIORITIES_OPEN_REQUESTS = 4  # OPEN, GETXATTR (O_TRUNC), GETATTR (Python's fstat), IOCTL (isatty): the front's


def _round_trips(mnt: Path, buf: Path) -> dict:
    """What a learner's step costs in requests to the daemon, the actors stopped: the
    requests the kernel sends for one step that the learner waits for (its RELEASEs come
    after close() returns), counted by the mount over STEPS_COUNTED steps of the learner's
    file calls; and how long one takes when the daemon answers it in C without Python: the
    learner's `open(priorities, "w")`, four requests the library's front answers, timed.
    Batches of BATCH - 1: the learner process just looked BATCH up, and a name another
    process asked for is looked up at every open for a while (mount/nodes.py DrawDir)."""
    def requests() -> dict:
        return json.loads((mnt / ".distorefs" / "stats.json").read_bytes())["mount"]["requests"]

    opens: list[float] = []

    def steps() -> None:
        for _ in range(STEPS_COUNTED):
            with np.load(buf / "batch" / f"{BATCH - 1}.npz") as z:
                keys = z["keys"]
            t = time.perf_counter()
            f = open(buf / "priorities", "w")
            opens.append(time.perf_counter() - t)
            with f:
                f.write("".join(f"{k} 1\n" for k in keys))

    def during(fn) -> dict:
        before = requests()
        fn()
        after = requests()
        return {k: after[k] - before.get(k, 0) for k in after}

    counted, idle = during(steps), during(lambda: None)  # less what reading the counts costs
    per_step = {k: (n - idle.get(k, 0)) / STEPS_COUNTED for k, n in counted.items() if k not in ("release", "forget")}
    per_step = {k: round(v, 2) for k, v in sorted(per_step.items()) if v >= 0.05}
    trip_us = float(np.median(opens)) * 1e6 / PRIORITIES_OPEN_REQUESTS
    total = sum(per_step.values())
    return {"requests_per_step": per_step, "waited_requests_per_step": round(total, 2),
            "round_trip_us": round(trip_us, 1), "round_trips_ms_per_step": round(total * trip_us / 1000, 2)}


def _dqn_on_tmpfs(batch: Path, p: dict, ctx, errors: list[str]) -> dict:
    """The DQN loop through files on tmpfs, the learner loading `batch` (a distorefs batch
    file) at every step."""
    shm = _tmpfs_dir()
    if shm is None:
        return {"error": "no tmpfs at /dev/shm"}
    try:
        shutil.copyfile(batch, shm / "batch.npz")
        out = _dqn("tmpfs", shm / "run", p, ctx, batch_file=str(shm / "batch.npz"))
        print(f"  DQN loop {'tmpfs':10s}: {out}", flush=True)
        return out
    except Exception as exc:
        errors.append(f"DQN tmpfs: {type(exc).__name__}: {exc}")
        return {}
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _end_phase(workers: "_Workers", mount, server) -> None:
    """Whatever happened in a phase: its processes killed, its mount unmounted, its Reverb
    server stopped."""
    workers.kill_all()
    if mount is not None:
        mount.umount()
    if server is not None:
        server.stop()


class _Workers:
    """The processes a phase starts; whatever happens to the phase, none outlives it."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.procs: list = []

    def start(self, target, *args):
        proc = self.ctx.Process(target=target, args=args, daemon=True)
        self.procs.append(proc)
        proc.start()
        return proc

    def finish(self, procs: list, timeout: float = 60) -> None:
        for proc in procs:
            proc.join(timeout=timeout)
            if proc.is_alive():
                proc.kill()  # our own worker

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()  # our own worker, left by a phase that failed
            proc.join(timeout=10)


class _ReverbServer:
    """A Reverb server in a process of its own (its C++ threads then compete for the cores
    as a separate server would)."""

    def __init__(self, ctx, tables: dict[str, str], max_size: int) -> None:
        ready = ctx.Queue()
        self.proc = ctx.Process(target=_reverb_server, args=(tables, max_size, ready))
        self.proc.start()
        self.port = ready.get(timeout=120)

    def stop(self) -> None:
        self.proc.terminate()  # our own server process
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)


def _reverb_batches(port: int, table: str, spec: dict[str, tuple[str, tuple]], n: int):
    """Batches of n items as a Reverb learner reads them (Acme's way): a TrajectoryDataset,
    streaming samples ahead, batched by tf.data; about twice Client.sample()'s rate here."""
    import reverb
    import tensorflow as tf
    ds = reverb.TrajectoryDataset(server_address=f"localhost:{port}", table=table,
                                  dtypes={k: tf.dtypes.as_dtype(d) for k, (d, _) in spec.items()},
                                  shapes={k: tf.TensorShape(shape) for k, (_, shape) in spec.items()},
                                  max_in_flight_samples_per_worker=2 * n)
    return ds.batch(n, drop_remainder=True).prefetch(1).as_numpy_iterator()


def _reverb_server(tables: dict[str, str], max_size: int, ready) -> None:
    import reverb
    made = []
    for name, sampler in tables.items():
        made.append(reverb.Table(name=name, sampler=reverb.selectors.Prioritized(0.6) if sampler == "prioritized"
                                 else reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
                                 max_size=max_size, rate_limiter=reverb.rate_limiters.MinSize(1)))
    server = reverb.Server(tables=made)
    ready.put(server.port)
    server.wait()


def _have_reverb() -> str | None:
    try:
        import reverb  # noqa: F401
        return None
    except Exception as exc:  # not installed, or its TensorFlow cannot load
        return f"{type(exc).__name__}: {exc}"


# ----- b) Reverb's own ground: 113 KB entries --------------------------------------------------

def _frames_writer(system: str, cfg: dict, stop, counter, errors, ready=None) -> None:
    _one_thread()
    try:
        rng = np.random.default_rng(cfg["seed"])
        frame = rng.integers(0, 256, size=FRAME, dtype=np.uint8)
        if system == "reverb":
            import reverb
            client = reverb.Client(f"localhost:{cfg['port']}")
            writer = client.trajectory_writer(num_keep_alive_refs=1)
        if ready is not None:  # the fill is timed from when every writer is connected (TensorFlow imports slowly)
            ready.wait(timeout=300)
        n = 0
        while not stop.is_set() and n < cfg.get("cap", 1 << 40):
            frame[:8] = np.frombuffer(n.to_bytes(8, "little"), np.uint8)
            if system == "distorefs":
                np.save(f"{cfg['buffer']}/entries/w{cfg['seed']}-{n:08d}.npy", frame)
            else:
                writer.append({"frame": frame})
                writer.create_item("frames", priority=1.0, trajectory={"frame": writer.history["frame"][-1]})
                writer.flush(block_until_num_items=REVERB_IN_FLIGHT)
            n += 1
            with counter.get_lock():
                counter.value += 1
        if system == "reverb":
            writer.flush()
            writer.close()
    except Exception as exc:
        errors.put(f"writer {system}: {type(exc).__name__}: {exc}")


def _frames_reader(system: str, cfg: dict, result) -> None:
    _one_thread()
    out: dict[str, Any] = {"entries": 0, "steps": 0, "seconds": 0.0, "error": None}
    try:
        n, update = cfg["n"], cfg["update"]
        if system == "reverb":
            import reverb
            client = reverb.Client(f"localhost:{cfg['port']}")
            batches = _reverb_batches(cfg["port"], "frames", {"frame": ("uint8", FRAME)}, n)
        t0 = time.perf_counter()
        deadline = t0 + cfg["seconds"]
        while time.perf_counter() < deadline:
            if system in ("distorefs", "tmpfs"):
                with np.load(cfg["file"] if system == "tmpfs" else f"{cfg['buffer']}/batch/{n}.npz") as z:
                    frames, keys = z["data"], z["keys"]
                if update:
                    with open(f"{cfg['buffer']}/priorities", "w") as f:
                        f.write("".join(f"{k} {1.0 + (i % 7)}\n" for i, k in enumerate(keys)))
            else:
                s = next(batches)
                frames = s.data["frame"]
                if update:
                    client.mutate_priorities("frames", updates={k: 1.0 + (i % 7)
                                                                for i, k in enumerate(s.info.key.tolist())})
            assert frames.shape[0] == n
            out["entries"] += n
            out["steps"] += 1
        out["seconds"] = time.perf_counter() - t0
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
    result.put(out)


def _frames(system: str, root: Path, p: dict, ctx) -> dict:
    """sample 256 idle / with 4 writers / learner loop 64 + priorities with 2 writers."""
    mount = server = None
    workers = _Workers(ctx)
    res: dict[str, Any] = {}
    try:
        cfg: dict[str, Any] = {}
        if system == "distorefs":
            mount = DistorefsMount(root / "store-frames", root / "mnt-frames")
            mount.mount()
            buf = mount.mnt / "buffers" / "frames"
            buf.mkdir()
            (buf / "config.json").write_text(json.dumps({"capacity": 1_000_000, "sampler": "prioritized"}))
            cfg["buffer"] = str(buf)
        else:
            server = _ReverbServer(ctx, {"frames": "prioritized"}, 1_000_000)
            cfg["port"] = server.port
        stop, counter, errors = ctx.Event(), ctx.Value("q", 0), ctx.Queue()
        per = p["frames"] // 4
        ready = ctx.Barrier(5)
        fill = [workers.start(_frames_writer, system, {**cfg, "seed": 100 + i, "cap": per}, stop, counter, errors,
                              ready) for i in range(4)]
        ready.wait(timeout=300)
        t0 = time.perf_counter()
        for w in fill:
            w.join(timeout=600)
        res["fill_entries_per_s"] = round(counter.value / (time.perf_counter() - t0), 1)
        for label, writers, n, update in (("sample_256_idle", 0, 256, False),
                                          ("sample_256_with_4_writers", 4, 256, False),
                                          ("learner_64_with_2_writers", 2, 64, True)):
            stop = ctx.Event()
            counter = ctx.Value("q", 0)
            ws = [workers.start(_frames_writer, system, {**cfg, "seed": 200 + i}, stop, counter, errors)
                  for i in range(writers)]
            result = ctx.Queue()
            c0 = counter.value
            reader = workers.start(_frames_reader, system, {**cfg, "n": n, "update": update,
                                                            "seconds": p["reverb_seconds"]}, result)
            out = result.get(timeout=p["reverb_seconds"] + 240)
            inserted = counter.value - c0
            stop.set()
            workers.finish(ws + [reader])
            secs = out["seconds"] or 1e-9
            res[label] = {"entries_per_s": round(out["entries"] / secs, 1), "steps_per_s": round(out["steps"] / secs, 1),
                          "writer_inserts_per_s": round(inserted / secs, 1)}
            if out["error"]:
                res[label]["error"] = out["error"]
            if system == "distorefs" and label == "sample_256_idle":
                res["np_load_on_tmpfs"] = _frames_on_tmpfs(Path(cfg["buffer"]) / "batch" / f"{n}.npz", n, p, ctx,
                                                           workers)
        errs = []
        while not errors.empty():
            errs.append(errors.get())
        if errs:
            res["errors"] = errs[:3]
        return res
    finally:
        _end_phase(workers, mount, server)


def _tmpfs_dir() -> Path | None:
    """A fresh directory on a tmpfs (/dev/shm), or None where there is none."""
    shm = Path("/dev/shm")
    try:
        if shm.is_dir() and any(line.split()[1] == str(shm) and line.split()[2] == "tmpfs"
                                for line in Path("/proc/mounts").read_text().splitlines()):
            return Path(tempfile.mkdtemp(prefix="distorefs-bench-", dir=shm))
    except OSError:
        pass
    return None


def _frames_on_tmpfs(batch: Path, n: int, p: dict, ctx, workers: "_Workers") -> dict:
    """The idle reader's loop on one batch file copied onto tmpfs: np.load's own cost."""
    shm = _tmpfs_dir()
    if shm is None:
        return {"error": "no tmpfs at /dev/shm"}
    try:
        shutil.copyfile(batch, shm / "batch.npz")
        result = ctx.Queue()
        reader = workers.start(_frames_reader, "tmpfs", {"file": str(shm / "batch.npz"), "n": n, "update": False,
                                                         "seconds": p["reverb_seconds"]}, result)
        out = result.get(timeout=p["reverb_seconds"] + 240)
        workers.finish([reader])
        secs = out["seconds"] or 1e-9
        return {"entries_per_s": round(out["entries"] / secs, 1), **({"error": out["error"]} if out["error"] else {})}
    finally:
        shutil.rmtree(shm, ignore_errors=True)


# ----- c) the rate limiter: fast actors, a slow learner ------------------------------------------

LIMIT_SPI = 8.0  # samples_per_insert the limited runs hold the actors to
LIMIT_ERROR = 256.0  # error_buffer: four batches of 64 of slack either side
LIMIT_MIN_SIZE = 256  # min_size_to_sample
LIMIT_STEP_S = 0.02  # the learner's training step: a GPU learner's pace, slower than the actors
LIMIT_SLOW_ACTOR_HZ = 50  # inserts per second of each actor in the run where the learner is ahead
UNPACED = 1e9  # steps per second of an actor that runs as fast as its inserts go
# (label, system, limited, actors' steps per second, the learner's step in seconds)
LIMIT_RUNS = (("files, no limiter", "distorefs", False, UNPACED, LIMIT_STEP_S),
              ("files, limiter", "distorefs", True, UNPACED, LIMIT_STEP_S),
              ("client, limiter", "client", True, UNPACED, LIMIT_STEP_S),
              ("slow actors, limiter", "distorefs", True, LIMIT_SLOW_ACTOR_HZ, 0.0))


def _limited_learner(system: str, cfg: dict, result) -> None:
    """A learner whose step takes cfg["step_s"]: samples a batch, trains, and again."""
    _one_thread()
    out: dict[str, Any] = {"steps": 0, "seconds": 0.0, "sampling_seconds": 0.0, "error": None}
    try:
        source = _Source(system, cfg)
        t0 = time.perf_counter()
        deadline = t0 + cfg["seconds"]
        while time.perf_counter() < deadline:
            s0 = time.perf_counter()
            batch = source.sample(BATCH)  # waits while the learner is ahead (and for min_size_to_sample)
            out["sampling_seconds"] += time.perf_counter() - s0
            assert len(batch["keys"]) == BATCH
            time.sleep(cfg["step_s"])
            out["steps"] += 1
        out["seconds"] = time.perf_counter() - t0
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
    result.put(out)


def _limiter(root: Path, p: dict, ctx) -> dict:
    """2 unpaced actors and a learner of LIMIT_STEP_S steps, without and with the rate limiter
    (through files, and through the client), then slow actors and a fast learner (the other
    side held back): the samples per insert observed over time, the error (inserts *
    samples_per_insert - samples) against its range, each side's rate and the time each side
    waited."""
    mount = None
    workers = _Workers(ctx)
    res: dict[str, Any] = {"samples_per_insert": LIMIT_SPI, "error_buffer": LIMIT_ERROR,
                           "min_size_to_sample": LIMIT_MIN_SIZE, "learner_step_s": LIMIT_STEP_S, "runs": {}}
    try:
        mount = DistorefsMount(root / "store", root / "mnt")
        mount.mount()
        weights = mount.mnt / "weights" / "limiter" / "q.npy"  # what the DQN actors re-read every 200 steps
        weights.parent.mkdir(parents=True)
        np.save(weights, QNet(0).weights())
        for i, (label, system, limited, actor_hz, step_s) in enumerate(LIMIT_RUNS):
            buf = mount.mnt / "buffers" / f"limit{i}"
            buf.mkdir()
            config: dict[str, Any] = {"capacity": 1_000_000, "min_size_to_sample": LIMIT_MIN_SIZE}
            if limited:
                config.update(samples_per_insert=LIMIT_SPI, error_buffer=LIMIT_ERROR)
            (buf / "config.json").write_text(json.dumps(config))
            cfg = {"buffer": str(buf), "weights": str(weights), "seconds": p["limit_seconds"], "read_ahead": False,
                   "actor_hz": actor_hz, "env_cost": 0, "step_s": step_s}
            res["runs"][label] = _limited_run(system, cfg, p, ctx, workers)
            print(f"  limiter {label:20s}: " + json.dumps({k: v for k, v in res["runs"][label].items()
                                                           if k != "series"}), flush=True)
        return res
    finally:
        _end_phase(workers, mount, None)


def _limited_run(system: str, cfg: dict, p: dict, ctx, workers: "_Workers") -> dict:
    buf = Path(cfg["buffer"])
    stop, counter, errors, result = ctx.Event(), ctx.Value("q", 0), ctx.Queue(), ctx.Queue()
    actors = [workers.start(_actor, system, {**cfg, "seed": 300 + i}, stop, counter, errors) for i in range(2)]
    learner = workers.start(_limited_learner, system, cfg, result)
    series = []  # (seconds, inserts, samples) of the buffer, from its stats.json
    t0 = time.perf_counter()
    out = None
    while out is None:
        s = json.loads((buf / "stats.json").read_bytes())
        series.append((round(time.perf_counter() - t0, 3), s["inserts"], s["sampled_entries"]))
        try:
            out = result.get(timeout=0.25)
        except queue.Empty:
            if time.perf_counter() - t0 > p["limit_seconds"] + 240:
                raise RuntimeError("the learner did not finish")
    stats = json.loads((buf / "stats.json").read_bytes())
    stop.set()
    (buf / "config.json").write_text(json.dumps({"samples_per_insert": 0}))  # actors held back go, and stop
    workers.finish(actors + [learner])
    limiter = stats.get("rate_limiter") or {}
    offset = LIMIT_MIN_SIZE * LIMIT_SPI
    errors_seen = [ins * LIMIT_SPI - smp - offset for _, ins, smp in series if ins >= LIMIT_MIN_SIZE]
    secs = out["seconds"] or 1e-9
    inserted, sampled = stats["inserts"], stats["sampled_entries"]
    half = next((s for s in series if s[0] >= series[-1][0] / 2), series[-1])
    steady = (sampled - half[2]) / (inserted - half[1]) if inserted > half[1] else None
    run = {"seconds": round(secs, 2), "inserts_per_s": round(inserted / secs, 1),
           "samples_per_s": round(sampled / secs, 1), "learner_steps_per_s": round(out["steps"] / secs, 1),
           "samples_per_insert": round(sampled / inserted, 3) if inserted else None,
           "samples_per_insert_second_half": round(steady, 3) if steady is not None else None,
           "error_min": round(min(errors_seen), 1) if errors_seen else None,
           "error_max": round(max(errors_seen), 1) if errors_seen else None,
           "learner_sampling_s": round(out["sampling_seconds"], 2),
           "insert_wait_s": (limiter.get("insert") or {}).get("wait_seconds", 0.0),
           "sample_wait_s": (limiter.get("sample") or {}).get("wait_seconds", 0.0),
           "insert_waits": (limiter.get("insert") or {}).get("waits", 0),
           "sample_waits": (limiter.get("sample") or {}).get("waits", 0),
           "series": series}
    errs = []
    while not errors.empty():
        errs.append(errors.get())
    if out["error"]:
        errs.append(out["error"])
    if errs:
        run["errors"] = errs[:3]
    return run


# ----- report ---------------------------------------------------------------------------------

def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


def format_table(res: dict) -> str:
    parts = [_systems_table(res)] if res.get("dqn") or res.get("frames") else []
    if (res.get("limiter") or {}).get("runs"):
        parts.append(_limiter_table(res["limiter"]["runs"]))
    return "\n\n".join(parts)


def _systems_table(res: dict) -> str:
    lines = [f"{'measure':58s} {'distorefs':>10s} {'in-process':>11s} {'Reverb':>9s} {'vs base':>8s} {'target':>8s}"]
    dqn = res.get("dqn", {})
    d = (dqn.get("distorefs") or {}).get("learner_steps_per_s")
    i = (dqn.get("in-process") or {}).get("learner_steps_per_s")
    r = (dqn.get("reverb") or {}).get("learner_steps_per_s")

    def cell(v, fmt="{:,.1f}"):
        return "-" if v is None else fmt.format(v)
    lines.append(f"{'DQN learner, batch 64 + 64 priorities, 2 actors (steps/s)':58s} {cell(d):>10s} {cell(i):>11s} "
                 f"{cell(r):>9s} {cell(_ratio(d, i), '{:.2f}x'):>8s} {'>= 0.5x':>8s}")
    for system in ("in-process", "distorefs", "tmpfs", "reverb"):
        split = (dqn.get(system) or {}).get("learner_ms_per_step")
        if split:
            lines.append(f"  {system} learner, ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
    daemon = dqn.get("distorefs") or {}
    if "daemon_cores" in daemon:
        lines.append(f"  distorefs daemon while the learner ran: {daemon['daemon_cores']:.2f} cores, "
                     f"{daemon['daemon_cpu_ms_per_step']:.2f} ms of CPU per learner step (the actors' inserts included)")
    trips = (dqn.get("distorefs") or {}).get("round_trips")
    if trips:
        lines.append(f"  distorefs learner, requests it waits for per step: {trips['waited_requests_per_step']} "
                     f"({', '.join(f'{k} {v}' for k, v in trips['requests_per_step'].items())}); one the daemon "
                     f"answers in C, timed in the learner's open(priorities), actors stopped: "
                     f"{trips['round_trip_us']} us, so {trips['round_trips_ms_per_step']} ms a step in round trips")
    t = (dqn.get("tmpfs") or {}).get("learner_steps_per_s")
    if t:
        lines.append(f"  files on tmpfs (np.load of a saved batch/64.npz, priorities to a file; no store, no "
                     f"sampling): {t:,.1f} steps/s, {_ratio(t, i)}x in-process: the file API's own ceiling")
    frames = res.get("frames", {})
    for label, key, text in (("sample_256_idle", "entries_per_s", "sample 256 of 113 KB, idle (entries/s)"),
                             ("sample_256_with_4_writers", "entries_per_s",
                              "sample 256 of 113 KB, 4 writers inserting (entries/s)"),
                             ("learner_64_with_2_writers", "steps_per_s",
                              "learner 64 + priorities, 2 writers (steps/s)")):
        dv = ((frames.get("distorefs") or {}).get(label) or {}).get(key)
        rv = ((frames.get("reverb") or {}).get(label) or {}).get(key)
        lines.append(f"{text:58s} {cell(dv):>10s} {'-':>11s} {cell(rv):>9s} {cell(_ratio(dv, rv), '{:.2f}x'):>8s} "
                     f"{'>= 1.0x':>8s}")
    floor = ((frames.get("distorefs") or {}).get("np_load_on_tmpfs") or {}).get("entries_per_s")
    if floor:
        rv = ((frames.get("reverb") or {}).get("sample_256_idle") or {}).get("entries_per_s")
        lines.append(f"  np.load of a saved batch/256.npz on tmpfs, idle: {floor:,.1f} entries/s"
                     + (f", {_ratio(floor, rv)}x Reverb" if rv else "") + ": the npz format's own ceiling")
    for system in ("distorefs", "reverb"):
        f = frames.get(system) or {}
        if f:
            lines.append(f"  {system} fill: {f.get('fill_entries_per_s')} inserts/s of 113 KB by 4 writers; writers "
                         f"during the sampling rows: " + ", ".join(
                             f"{k}: {(f.get(k) or {}).get('writer_inserts_per_s')}/s"
                             for k in ("sample_256_with_4_writers", "learner_64_with_2_writers")))
    return "\n".join(lines)


def _limiter_table(runs: dict) -> str:
    lines = [f"rate limiter: samples_per_insert {LIMIT_SPI:g}, error_buffer {LIMIT_ERROR:g}, min_size_to_sample "
             f"{LIMIT_MIN_SIZE}; 2 unpaced actors and a learner of batch {BATCH} and {LIMIT_STEP_S * 1000:.0f} ms "
             f"steps, then 2 actors of {LIMIT_SLOW_ACTOR_HZ}/s and a learner without a step",
             f"{'run':22s} {'inserts/s':>10s} {'samples/s':>10s} {'steps/s':>8s} {'samples/ins':>11s} "
             f"{'2nd half':>8s} {'error vs target':>17s} {'insert wait s':>13s} {'sample wait s':>13s}"]
    for label, v in runs.items():
        band = "-" if v.get("error_min") is None else f"{v['error_min']:g}..{v['error_max']:g}"
        lines.append(f"{label:22s} {v['inserts_per_s']:>10,.1f} {v['samples_per_s']:>10,.1f} "
                     f"{v['learner_steps_per_s']:>8,.1f} {v['samples_per_insert'] or 0:>11.3f} "
                     f"{v['samples_per_insert_second_half'] or 0:>8.2f} {band:>17s} "
                     f"{v['insert_wait_s']:>13.1f} {v['sample_wait_s']:>13.1f}")
    return "\n".join(lines)


def _plot(res: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    systems = ["distorefs", "in-process", "reverb"]
    vals = [((res.get("dqn") or {}).get(s) or {}).get("learner_steps_per_s") or 0 for s in systems]
    ax1.bar(systems, vals, color=["#1f77b4", "#7f7f7f", "#d62728"])
    ax1.set_title("DQN learner loop (steps/s)")
    labels = ["sample_256_idle", "sample_256_with_4_writers", "learner_64_with_2_writers"]
    x = np.arange(len(labels))
    for j, s in enumerate(("distorefs", "reverb")):
        f = (res.get("frames") or {}).get(s) or {}
        v = [((f.get(label) or {}).get("entries_per_s") or 0) for label in labels]
        ax2.bar(x + (j - 0.5) * 0.4, v, 0.4, label=s)
    ax2.set_xticks(x, ["sample 256\nidle", "sample 256\n4 writers", "learner 64\n2 writers"])
    ax2.set_title("113 KB entries (entries/s)")
    ax2.legend()
    save_figure(fig, path, title)


PHASES = ("dqn", "frames", "limiter")


def _recent_ratio(series: list, i: int, window: float = 1.0) -> float:
    """Entries sampled per entry inserted over the `window` seconds up to series[i]."""
    t, ins, smp = series[i]
    j = i
    while j > 0 and series[j - 1][0] >= t - window:
        j -= 1
    back = series[j - 1] if j > 0 else (0.0, 0, 0)
    return (smp - back[2]) / (ins - back[1]) if ins > back[1] else float("nan")


def _plot_limiter(res: dict, path: Path, title: str) -> None:
    """Samples per insert over time, the error against the limiter's range, each side's rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = res["limiter"]["runs"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    offset = LIMIT_MIN_SIZE * LIMIT_SPI
    for label, v in runs.items():
        series = v["series"]
        t = [s[0] for s in series]
        ax1.plot(t, [_recent_ratio(series, i) for i in range(len(series))], label=label)
        if "no limiter" not in label:
            ax2.plot(t, [s[1] * LIMIT_SPI - s[2] - offset if s[1] >= LIMIT_MIN_SIZE else float("nan")
                         for s in v["series"]], label=label)
    ax1.axhline(LIMIT_SPI, color="k", linestyle="--", linewidth=1, label=f"target {LIMIT_SPI:g}")
    ax1.set_title("samples per insert over the last second")
    ax1.set_xlabel("seconds")
    ax1.legend()
    for y in (-LIMIT_ERROR, LIMIT_ERROR):
        ax2.axhline(y, color="r", linestyle="--", linewidth=1)
    ax2.set_ylim(-2 * LIMIT_ERROR, 2 * LIMIT_ERROR)
    ax2.set_title(f"inserts*{LIMIT_SPI:g} - samples - target (range +-{LIMIT_ERROR:g})")
    ax2.set_xlabel("seconds")
    ax2.legend()
    labels = list(runs)
    x = np.arange(len(labels))
    ax3.bar(x - 0.2, [runs[k]["inserts_per_s"] * LIMIT_SPI for k in labels], 0.4, label=f"inserts/s x {LIMIT_SPI:g}")
    ax3.bar(x + 0.2, [runs[k]["samples_per_s"] for k in labels], 0.4, label="samples/s")
    ax3.set_xticks(x, [k.replace(", ", "\n") for k in labels])
    ax3.set_title("each side's rate")
    ax3.legend()
    save_figure(fig, path, title)


def run(out: Path, quick: bool = False, workdir: Path | None = None, only: tuple[str, ...] = ()) -> dict:
    """Run the phases named in `only` (every phase when empty)."""
    phases = [ph for ph in PHASES if not only or ph in only]
    r = start_run(out, workdir)
    out, root, notes, machine = r.out, r.root, r.notes, r.machine
    p = _params(quick)
    _one_thread()  # before the workers start: numpy sets its thread pool up when imported
    ctx = mp.get_context("spawn")
    reverb_missing = _have_reverb()
    if reverb_missing:
        notes.append(f"Reverb not measured ({reverb_missing}); install it with pip install 'distorefs[reverb]'")
    print(f"distorefs bench rl{' --quick' if quick else ''}: workdir {root}, {machine['cpus']} CPUs", flush=True)
    res: dict[str, Any] = {"dqn": {}, "frames": {}, "limiter": {}}
    errors: list[str] = []
    others = () if reverb_missing else ("reverb",)
    try:
        for system in ("in-process", "distorefs") + others if "dqn" in phases else ():
            try:
                res["dqn"][system] = _dqn(system, root / f"dqn-{system}", p, ctx)
                print(f"  DQN loop {system:10s}: {res['dqn'][system]}", flush=True)
            except Exception as exc:
                errors.append(f"DQN {system}: {type(exc).__name__}: {exc}")
            if system == "distorefs" and (root / f"dqn-distorefs/batch-{BATCH}.npz").exists():
                res["dqn"]["tmpfs"] = _dqn_on_tmpfs(root / f"dqn-distorefs/batch-{BATCH}.npz", p, ctx, errors)
        for system in ("distorefs",) + others if "frames" in phases else ():
            try:
                res["frames"][system] = _frames(system, root / f"frames-{system}", p, ctx)
                print(f"  113 KB {system:10s}: {res['frames'][system]}", flush=True)
            except Exception as exc:
                errors.append(f"113 KB {system}: {type(exc).__name__}: {exc}")
        if "limiter" in phases:
            try:
                res["limiter"] = _limiter(root / "limiter", p, ctx)
            except Exception as exc:
                errors.append(f"limiter: {type(exc).__name__}: {exc}")
    finally:
        remove_workdir(root, errors)
    for part in ("dqn", "frames"):
        for system, v in res[part].items():
            errors.extend(f"{part} {system}: {e}" for e in v.get("errors", []))
    for label, v in (res["limiter"].get("runs") or {}).items():
        errors.extend(f"limiter {label}: {e}" for e in v.get("errors", []))
    goals = []
    if "dqn" in phases:
        d = (res["dqn"].get("distorefs") or {}).get("learner_steps_per_s")
        i = (res["dqn"].get("in-process") or {}).get("learner_steps_per_s")
        goals.append({"goal": "DQN learner loop via files >= 0.5x in-process", "value": f"{_ratio(d, i)}x",
                      "met": None if (q := _ratio(d, i)) is None else q >= 0.5})
    if "frames" in phases:
        for label, key in (("sample_256_idle", "entries_per_s"), ("sample_256_with_4_writers", "entries_per_s"),
                           ("learner_64_with_2_writers", "steps_per_s")):
            dv = ((res["frames"].get("distorefs") or {}).get(label) or {}).get(key)
            rv = ((res["frames"].get("reverb") or {}).get(label) or {}).get(key)
            goals.append({"goal": f"{label.replace('_', ' ')} >= 1.0x Reverb", "value": f"{_ratio(dv, rv)}x",
                          "met": None if (q := _ratio(dv, rv)) is None else q >= 1.0})
    if "limiter" in phases:
        goals.append(_limiter_goal(res["limiter"]))
    table = format_table(res)
    result = {"benchmark": "rl", "quick": quick, "params": p, "machine": machine, "results": res, "goals": goals,
              "notes": notes, "errors": errors, "table": table}
    (out / "rl.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    title = f"({machine['cpus']} CPUs{', quick' if quick else ''})"
    figures = []
    for name, wanted, plot in (("rl.png", {"dqn", "frames"}, _plot), ("rl-limiter.png", {"limiter"}, _plot_limiter)):
        if wanted & set(phases):
            try:
                plot(res, out / name, f"distorefs RL workloads {title}" if name == "rl.png" else
                     f"distorefs rate limiter: 2 actors, a learner of {LIMIT_STEP_S * 1000:.0f} ms steps {title}")
                figures.append(str(out / name))
            except Exception as exc:
                errors.append(f"plot {name}: {exc}")
    print_report(table, goals, notes, errors)
    print(f"wrote {out / 'rl.json'}" + "".join(f" and {f}" for f in figures))
    return result


def _limiter_goal(lim: dict) -> dict:
    """With the limiter, the error stays within error_buffer of its target (files and client)."""
    limited = [v for label, v in (lim.get("runs") or {}).items() if "no limiter" not in label]
    spread = [max(-v["error_min"], v["error_max"]) for v in limited if v.get("error_min") is not None]
    worst = max(spread) if spread else None
    return {"goal": f"rate limiter holds inserts*{LIMIT_SPI:g} - samples within +-{LIMIT_ERROR:g} of its target",
            "value": "-" if worst is None else f"worst {worst:g}",
            "met": None if worst is None or len(spread) < len(limited) else worst <= LIMIT_ERROR}
