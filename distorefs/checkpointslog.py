"""checkpoints/ of a shared store: steps complete on one node, readable on every node.

A step belongs to the node that writes it until it is complete. Then (`completed`) that
node exports it in the background: the chunks of every file below it are copied into the
cluster (ValueLayer.copy_to_cluster: durable there when it returns), the export is recorded
in this node's catalog, and one record `cstep` is appended to the log by path
("checkpoints/RUN/STEP") with a manifest of the step: its attributes and every node below
it (name, kind, owner, times, size, chunk size, the cluster copies of its chunks, a link's
target). The writer's own records keep pointing at its local values; the copies are the
other nodes'. So a complete step survives the loss of the node that wrote it.

Every other node applies `cstep` (`ApplyStep`): the run made if missing, the step with its
subtree, complete at once (`RUN/latest` and retention treat it as a local step), marked with
its origin node, its id there and the export's nonce. An applied step is read-only (EROFS
naming the origin); removing it (rm -r, retention) removes this node's records only, never
the cluster copies (Checkpoints.drop_value). When the writer removes an exported step it
appends `cremove` and lets the copies expire after SHARED_GRACE_S (readers elsewhere finish);
every node then removes its applied copy of that export (and only of that one).

Export records, in the checkpoints db (keys big-endian):
  x + step id     JSON: state pending (recorded, `cstep` not yet appended: the manifest is
                  kept to append it again after a crash) or shared; nonce, path, the cluster
                  copies, and copies of an earlier export of the step still to expire
  y + nonce       an exported step removed here: its copies expire and `cremove` is
                  appended, then the record goes

Crash model: copies are made before anything records them, so a crash mid-copy leaves
unrecorded copies in the cluster (garbage; they were never announced) and the step is
exported again at the next start. The export record is committed before `cstep` is
appended, and a pending one is appended again at start (a node applies a nonce once). A
removal records `y` in its own transaction, so its `cremove` and the expiry happen even if
the node stops first (at the next start).

Ordering: appends of this node's records (exports and removals) take one lock in the order
their commits were made, so a step's `cremove` never precedes its `cstep` in the log.
"""

from __future__ import annotations

import json
import logging
import struct
import uuid
from typing import Callable

import trio

from .checkpoints import (CONTROL, DIR, FILE, LINK, ROOT_ID, RUN, STEP, Checkpoints, CDir, CFile, CLink, CNode,
                          CStep, RemoveTree, _ckey, _CkptChange, _may_hold, _remove_apply, _remove_txn, _subtree,
                          _Times)
from .clusterlog import Record, SharedLog
from .committer import Committer, Overlay
from .errors import Busy, DistorefsError, InvalidArgument, NotFound
from .fileattrs import modified, now_ns
from .values import StoredValue, ValueLayer
from .weights import SHARED_GRACE_S

log = logging.getLogger(__name__)

_ID = struct.Struct(">Q")
COPY_GROUP_BYTES = 256 << 20  # stored bytes copied per worker-thread hand-off
PENDING, SHARED = "pending", "shared"


def _xkey(step_id: int) -> bytes:
    return b"x" + _ID.pack(step_id)


def _ykey(nonce: str) -> bytes:
    return b"y" + nonce.encode()


def manifest_of(tree: Checkpoints, step: CStep) -> tuple[dict, list[StoredValue]]:
    """The step's manifest (chunks left empty) and its files' chunk values, in manifest order
    (event loop: metadata only). Nodes are listed parents first; `parent` is the index of
    the parent's entry (-1: the step)."""
    run = tree.nodes[step.parent]
    nodes: list[dict] = []
    values: list[StoredValue] = []

    def walk(d: CDir, parent: int) -> None:
        for name in sorted(d.children):
            n = tree.nodes[d.children[name]]
            entry: dict = {"parent": parent, "name": name.hex(), "kind": n.kind, "mode": n.mode, "uid": n.uid,
                           "gid": n.gid, "mtime_ns": n.mtime_ns}
            nodes.append(entry)
            if isinstance(n, CFile):
                entry.update(size=n.size, chunk_bytes=n.chunk_bytes, chunks=sorted(n.stored))
                values.extend(n.stored[i] for i in entry["chunks"])
            elif isinstance(n, CLink):
                entry["target"] = n.target.hex()
            elif isinstance(n, CDir):
                walk(n, len(nodes) - 1)

    walk(step, -1)
    manifest = {"run": {"name": run.name.hex(), "mode": run.mode, "uid": run.uid, "gid": run.gid},
                "name": step.name.hex(), "mode": step.mode, "uid": step.uid, "gid": step.gid,
                "mtime_ns": step.mtime_ns, "nodes": nodes}
    return manifest, values


def _fill(manifest: dict, copies: list[StoredValue]) -> None:
    """Each file's chunk indexes -> {index: its cluster copy}, in the order `manifest_of` listed them."""
    it = iter(copies)
    for entry in manifest["nodes"]:
        if entry["kind"] == FILE:
            entry["chunks"] = {str(i): next(it).to_json() for i in entry["chunks"]}


def _values(records: list[dict]) -> list[StoredValue]:
    return [StoredValue.from_json(d) for d in records]


class CheckpointsLog:
    """The shared side of one node's checkpoints/ (Checkpoints.sharing, and the follower's
    applier of checkpoints records)."""

    def __init__(self, tree: Checkpoints, shared: SharedLog, committer: Committer, values: ValueLayer,
                 origin: str, spawn: Callable[..., None]) -> None:
        """`origin`: this node's id; `spawn`: start a task in the store's nursery."""
        self.tree = tree
        self._spawn = spawn
        self.log = shared
        self.committer = committer
        self.values = values
        self.origin = origin
        self.exports: dict[int, dict] = {}  # step id -> its export record (x)
        self.retiring: dict[str, dict] = {}  # nonce -> an exported step removed here (y)
        self._lock = trio.Lock()  # this node's appends, in the order of their commits

    def load(self, txn) -> None:
        """The export records (at store open, after the tree's own load)."""
        for k, v in txn.cursor(self.tree_db):
            key = bytes(k)
            if key[:1] == b"x" and len(key) == 9:
                self.exports[_ID.unpack_from(key, 1)[0]] = json.loads(bytes(v))
            elif key[:1] == b"y":
                rec = json.loads(bytes(v))
                self.retiring[rec["nonce"]] = rec

    @property
    def tree_db(self) -> bytes:
        return _CkptChange.db

    # ----- StepSharing: what the tree tells us --------------------------------------------

    def started(self) -> None:
        self._spawn(self._resume)

    def completed(self, step: CStep) -> None:
        self._spawn(self._export, step, step.epoch)

    def removing(self, txn, steps: list[CStep]) -> None:
        for step in steps:
            rec = self.exports.get(step.id)
            if rec is not None:
                txn.delete(_xkey(step.id), db=self.tree_db)
                txn.put(_ykey(rec["nonce"]), json.dumps(_retired(rec)).encode(), db=self.tree_db)

    def removed(self, steps: list[CStep]) -> None:
        for step in steps:
            rec = self.exports.pop(step.id, None)
            if rec is not None:
                self.retiring[rec["nonce"]] = _retired(rec)
                self._spawn(self._retire, rec["nonce"])

    # ----- exporting ----------------------------------------------------------------------

    async def _resume(self) -> None:
        """At start: removals and announcements a stop cut short, then the complete steps of
        this node not yet exported (completed while the export was under way, or before)."""
        for nonce in list(self.retiring):
            await self._retire(nonce)
        for step_id, rec in list(self.exports.items()):
            if rec["state"] == PENDING:
                async with self._lock:
                    await self._announce(step_id, rec["nonce"])
        for step in sorted((n for n in self.tree.nodes.values() if isinstance(n, CStep)), key=lambda s: s.id):
            if step.complete and not step.origin and step.id not in self.exports:
                await self._export(step, step.epoch)

    def _current(self, step: CStep, epoch: int) -> bool:
        return step.attached and step.complete and step.epoch == epoch and not step.origin

    async def _export(self, step: CStep, epoch: int) -> None:
        """Copy the step's chunks into the cluster, record the export, announce it. A step
        written again or removed meanwhile is not exported (its copies are deleted)."""
        tree = self.tree
        async with self._lock:
            if not self._current(step, epoch):
                return
            path = tree.path_of(step)
            manifest, values = manifest_of(tree, step)
            copies: list[StoredValue] = []
            recorded = False
            try:
                await self._copy(values, copies, lambda: self._current(step, epoch))
                _fill(manifest, copies)
                nonce = uuid.uuid4().hex
                rec = {"state": PENDING, "path": path, "sid": step.id, "nonce": nonce,
                       "copies": [c.to_json() for c in copies], "retired": [], "manifest": manifest}
                await self.committer.submit(RecordExport(self, step, epoch, rec))
                recorded = True
            except Exception as exc:  # never lose the daemon to an export: the step stays this node's
                tree.counters["exports_abandoned"] += 1
                if isinstance(exc, DistorefsError):
                    log.info("%s not exported: %s", path, exc)
                else:
                    log.exception("exporting %s", path)
                return
            finally:
                if not recorded and copies:
                    with trio.CancelScope(shield=True):
                        await self._delete(copies, 0.0)
            await self._announce(step.id, nonce)

    async def _copy(self, values: list[StoredValue], out: list[StoredValue], current) -> None:
        group: list[StoredValue] = []
        held = 0

        async def flush() -> None:
            if not current():
                raise NotFound("written again or removed while it was being exported")
            # the copies land in `out` even if the wait is cancelled: they are deleted then
            await trio.to_thread.run_sync(lambda g: out.extend(self.values.copy_to_cluster(g)), list(group))

        for value in values:
            group.append(value)
            held += value.stored_size
            if held >= COPY_GROUP_BYTES:
                await flush()
                group, held = [], 0
        if group:
            await flush()

    async def _announce(self, step_id: int, nonce: str) -> None:
        """Append the `cstep` of a recorded export (lock held), expire the copies of the
        step's export before it, and mark it shared."""
        rec = self.exports.get(step_id)
        if rec is None or rec["nonce"] != nonce or rec["state"] != PENDING:
            return
        try:
            await trio.to_thread.run_sync(lambda: self.log.tree_change(
                self.origin, "cstep", rec["path"], sid=step_id, nonce=nonce, manifest=json.dumps(rec["manifest"])))
            await self._delete(_values(rec["retired"]), SHARED_GRACE_S)
            await self.committer.submit(SetExport(self, step_id, nonce))
        except DistorefsError as exc:  # appended again at the next start
            log.warning("%s: announcing its export failed (tried again at the next start): %s", rec["path"], exc)
            return
        self.tree.counters["steps_exported"] += 1
        log.info("%s exported to the cluster (%d chunk copies)", rec["path"], len(rec["copies"]))

    async def _retire(self, nonce: str) -> None:
        """An exported step was removed here: the other nodes remove it, its copies expire."""
        async with self._lock:
            rec = self.retiring.get(nonce)
            if rec is None:
                return
            try:
                await trio.to_thread.run_sync(lambda: self.log.tree_change(
                    self.origin, "cremove", rec["path"], sid=rec["sid"], nonce=nonce))
                await self._delete(_values(rec["copies"]), SHARED_GRACE_S)
                await self.committer.submit(DropRetired(self, nonce))
            except DistorefsError as exc:
                log.warning("%s: telling the cluster of its removal failed (tried again at the next start): %s",
                            rec["path"], exc)

    async def _delete(self, copies: list[StoredValue], grace: float) -> None:
        """Delete cluster copies (after `grace` seconds), in a worker thread."""
        if not copies:
            return

        def work() -> None:
            for c in copies:
                self.values.delete(None, c, grace=grace)  # type: ignore[arg-type]  # the cluster needs no txn

        try:
            await trio.to_thread.run_sync(work)
        except DistorefsError as exc:
            log.warning("deleting %d cluster copies of a checkpoint step: %s (left in the cluster)", len(copies), exc)

    # ----- another node's records ---------------------------------------------------------

    async def apply(self, rec: Record) -> None:
        f = rec.fields
        try:
            origin, nonce = f[b"origin"].decode(), f[b"nonce"].decode()
            change = ApplyStep(self.tree, origin, int(f[b"sid"]), nonce, json.loads(f[b"manifest"])) \
                if rec.op == "cstep" else None
        except (KeyError, ValueError) as exc:  # a record this version cannot read: never the follower's end
            raise InvalidArgument(f"a checkpoints {rec.op} record that does not parse: {exc!r}") from None
        if change is not None:
            await self.committer.submit(change)
            if not change.skip:
                self.tree.counters["steps_applied"] += 1
                self.tree.retention(change.run)  # retention here counts it as any complete step
        elif rec.op == "cremove":
            step = self._applied(origin, nonce)
            if step is None:
                return  # removed here already, or never applied
            try:
                await self.committer.submit(RemoveTree(self.tree, step, background=False, whole=True))
            except Busy:  # open here: no longer complete; retention takes it once closed
                await self.tree.mark_incomplete(step)
        else:
            log.warning("cluster log: checkpoints record %s of unknown op %r left alone", rec.id.decode(), rec.op)

    def _applied(self, origin: str, nonce: str) -> CStep | None:
        for n in self.tree.nodes.values():
            if isinstance(n, CStep) and n.origin == origin and n.nonce == nonce:
                return n
        return None


def _retired(rec: dict) -> dict:
    """The record of an exported step removed here: the copies to expire, the path to announce."""
    return {"path": rec["path"], "sid": rec["sid"], "nonce": rec["nonce"],
            "copies": rec["copies"] + rec.get("retired", [])}


# ----- changes -------------------------------------------------------------------------------

class RecordExport(_CkptChange):
    """An export of a step whose copies are in the cluster (state pending); an earlier export
    of the same step leaves its copies to expire once this one is announced."""

    def __init__(self, shared: CheckpointsLog, step: CStep, epoch: int, record: dict) -> None:
        super().__init__(shared.tree)
        self.shared, self.step, self.epoch, self.record = shared, step, epoch, record

    def plan(self, overlay: Overlay) -> None:
        if not self.shared._current(self.step, self.epoch):
            raise NotFound(f"{self.tree.path_of(self.step)} was written again or removed before its export "
                           f"was recorded")
        old = self.shared.exports.get(self.step.id)
        if old is not None:
            self.record["retired"] = old["copies"] + old.get("retired", [])

    def txn(self, txn) -> None:
        txn.put(_xkey(self.step.id), json.dumps(self.record).encode(), db=self.db)

    def apply(self) -> None:
        self.shared.exports[self.step.id] = self.record


class SetExport(_CkptChange):
    """A pending export was announced: shared (its manifest and retired copies are done with)."""

    def __init__(self, shared: CheckpointsLog, step_id: int, nonce: str) -> None:
        super().__init__(shared.tree)
        self.shared, self.step_id, self.nonce = shared, step_id, nonce

    def plan(self, overlay: Overlay) -> None:
        rec = self.shared.exports.get(self.step_id)
        self.record = None
        if rec is not None and rec["nonce"] == self.nonce:
            self.record = {k: v for k, v in rec.items() if k not in ("manifest", "retired")}
            self.record.update(state=SHARED, retired=[])

    def txn(self, txn) -> None:
        if self.record is not None:
            txn.put(_xkey(self.step_id), json.dumps(self.record).encode(), db=self.db)

    def apply(self) -> None:
        if self.record is not None:
            self.shared.exports[self.step_id] = self.record


class DropRetired(_CkptChange):
    """A removed step's `cremove` is in the log and its copies expire: its record goes."""

    def __init__(self, shared: CheckpointsLog, nonce: str) -> None:
        super().__init__(shared.tree)
        self.shared, self.nonce = shared, nonce

    def txn(self, txn) -> None:
        txn.delete(_ykey(self.nonce), db=self.db)

    def apply(self) -> None:
        self.shared.retiring.pop(self.nonce, None)


class ApplyStep(_CkptChange):
    """Another node's complete step, made here from its manifest (the run too, if missing):
    complete, read-only, its chunks the cluster copies. A replay (the same export) changes
    nothing; a newer export of the same step replaces the older one; a step of that name
    made here or by another node is left alone."""

    def __init__(self, tree: Checkpoints, origin: str, sid: int, nonce: str, manifest: dict) -> None:
        super().__init__(tree)
        self.origin, self.sid, self.nonce, self.manifest = origin, sid, nonce, manifest
        self.skip = True
        self.run: CNode | None = None

    def plan(self, overlay: Overlay) -> None:
        tree, m = self.tree, self.manifest
        self.victims: list[CNode]
        self.made: list[CNode]
        self.skip, self.victims, self.made = True, [], []
        run_name, step_name = bytes.fromhex(m["run"]["name"]), bytes.fromhex(m["name"])
        if run_name in CONTROL:
            raise InvalidArgument(f"a run may not be named {run_name!r}")
        root = tree.nodes[ROOT_ID]
        run = tree.nodes.get(root.children.get(run_name, 0)) if isinstance(root, CDir) else None
        old = tree.nodes.get(run.children.get(step_name, 0)) if isinstance(run, CDir) else None
        if old is not None:
            if not (isinstance(old, CStep) and old.origin == self.origin and old.sid == self.sid):
                where = f"node {old.origin}" if isinstance(old, CStep) and old.origin else "this node"
                log.warning("%s, written on %s, is left alone: node %s shares a step of that name",
                            tree.path_of(old), where, self.origin)
                return
            if old.nonce == self.nonce:
                return  # applied already (a replay)
            self.victims = _subtree(tree, old)  # written again there: this export replaces it
        self.skip = False
        now = now_ns()
        times: _Times = {"atime_ns": now, "ctime_ns": now}
        if run is None:
            r = m["run"]
            run = CDir(tree.next_id, RUN, ROOT_ID, run_name, r["mode"], r["uid"], r["gid"], now, **times)
            tree.next_id += 1
            self.made.append(run)
        self.run = run
        step = CStep(tree.next_id, STEP, run.id, step_name, m["mode"], m["uid"], m["gid"], m["mtime_ns"],
                     complete=True, origin=self.origin, sid=self.sid, nonce=self.nonce, **times)
        tree.next_id += 1
        self.made.append(step)
        placed: list[CNode] = []
        for e in m["nodes"]:
            parent = step if e["parent"] < 0 else placed[e["parent"]]
            kind = e["kind"]
            if not _may_hold(parent.kind, kind) or kind not in (DIR, FILE, LINK):
                raise InvalidArgument(f"the manifest of {self.origin}'s step puts a {kind} in a {parent.kind}")
            args = (tree.next_id, kind, parent.id, bytes.fromhex(e["name"]), e["mode"], e["uid"], e["gid"],
                    e["mtime_ns"])
            tree.next_id += 1
            node: CNode
            if kind == FILE:
                node = CFile(*args, size=e["size"], chunk_bytes=e["chunk_bytes"], **times)
                node.stored = {int(i): StoredValue.from_json(c) for i, c in e["chunks"].items()}
            elif kind == LINK:
                node = CLink(*args, target=bytes.fromhex(e["target"]), **times)
            else:
                node = CDir(*args, **times)
            placed.append(node)
            self.made.append(node)
        self.now = now

    def txn(self, txn) -> None:
        if self.skip:
            return
        if self.victims:
            _remove_txn(self, txn, self.victims)
        for node in self.made:
            self._put(txn, node)
            if isinstance(node, CFile):
                for index, chunk in node.stored.items():
                    txn.put(_ckey(node.id, index), chunk.pack(), db=self.db)

    def apply(self) -> None:
        if self.skip:
            return
        tree = self.tree
        if self.victims:
            _remove_apply(tree, self.victims, getattr(self, "dropped", []))
            for listener in tree.listeners:  # the kernel forgets the replaced step's names
                try:
                    listener(self.victims[0])
                except Exception:
                    log.exception("checkpoint listener failed")
        for node in self.made:
            tree.nodes[node.id] = node
            parent = tree.nodes[node.parent]
            parent.children[node.name] = node.id  # type: ignore[attr-defined]
        parent = tree.nodes[self.made[0].parent]
        modified(parent, self.now)
        if isinstance(parent, CDir):
            tree.dir_changed(parent)
