"""The committer's group commit (no FUSE): changes with work before their transaction
(compression) are prepared each once before the group's transaction, in the pool when they
have enough bytes between them, else in the committer's own thread; one whose preparation
fails fails alone."""

import threading


from distorefs.committer import Change
from distorefs.errors import DistorefsError
from store_runner import run


class Prepared(Change):
    """A change that records its preparation and checks it inside the transaction."""

    def __init__(self, log: list, fail: bool = False, size: int = 64 << 10) -> None:
        self.log, self.fail, self.size = log, fail, size
        self.prepared = 0
        self.thread: str | None = None

    def prepare_bytes(self) -> int:
        return self.size

    def prepare(self) -> None:
        self.prepared += 1
        self.thread = threading.current_thread().name
        if self.fail:
            raise DistorefsError("this one cannot be prepared")

    def txn(self, txn) -> None:
        assert self.prepared >= 1, "transaction before preparation"
        self.log.append(self)


def _commit_all(tmp_path, make) -> tuple[list, list, list]:
    """(the changes `make(log)` gives, the log their transactions wrote, their results)
    once committed together."""
    async def body(store):
        log: list = []
        changes = make(log)
        results = await store.committer.submit_all(changes)
        return changes, log, results
    return run(tmp_path / "s", body)


def test_a_group_prepares_every_change_once_in_the_pool_before_its_transaction(tmp_path):
    changes, log, results = _commit_all(tmp_path, lambda log: [Prepared(log) for _ in range(50)])
    assert results == [None] * 50
    assert all(c.prepared == 1 for c in changes)
    assert {id(c) for c in log} == {id(c) for c in changes}
    assert all(c.thread and c.thread.startswith("distorefs-prepare") for c in changes)


def test_small_changes_are_prepared_in_the_committers_thread_not_handed_to_the_pool(tmp_path):
    """Changes with little to compress between them (an actor's transitions) are prepared
    in the thread that runs the group's transaction: the pool's hand-offs would cost more."""
    changes, log, results = _commit_all(tmp_path, lambda log: [Prepared(log, size=300) for _ in range(20)])
    assert results == [None] * 20
    assert all(c.prepared == 1 for c in changes)
    assert {id(c) for c in log} == {id(c) for c in changes}
    assert {c.thread for c in changes} == {"distorefs-commit"}


def test_a_change_whose_preparation_fails_fails_alone(tmp_path):
    changes, log, results = _commit_all(tmp_path, lambda log: [Prepared(log, fail=(i == 7)) for i in range(20)])
    assert isinstance(results[7], DistorefsError)
    assert all(r is None for i, r in enumerate(results) if i != 7)
    assert changes[7] not in log
    assert all(c in log for i, c in enumerate(changes) if i != 7)


class Told(Change):
    """A change that records whether it was applied, and whether its transaction fails."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.applied = False

    def txn(self, txn) -> None:
        if self.fail:
            raise DistorefsError("this transaction fails")

    def apply(self) -> None:
        self.applied = True


def test_whoever_asked_is_told_in_the_committers_thread_before_the_change_is_applied(tmp_path):
    """`then` on a queued change's outcome: told 0 from the committer's thread as soon as
    the transaction committed (the change not applied yet), once; told the errno of a change
    that failed; told at once when asked after the outcome is known."""
    async def body(store):
        told: list = []
        main = threading.current_thread().name

        def tell(change):
            return lambda err: told.append((change, err, threading.current_thread().name, change.applied))

        good, bad = Told(), Told(fail=True)
        pending = [store.committer.enqueue(c) for c in (good, bad)]
        for p, c in zip(pending, (good, bad)):
            p.then(tell(c))
        for p in pending:
            try:
                await p.wait()
            except DistorefsError:
                pass
        late: list = []
        pending[0].then(late.append)
        pending[1].then(late.append)
        return told, late, main, good, bad
    told, late, main, good, bad = run(tmp_path / "s", body)
    assert [(c, err) for c, err, _, _ in told] == [(good, 0), (bad, 5)]  # EIO: a commit that failed
    (_, _, thread, applied), (_, _, bad_thread, _) = told
    assert thread != main and applied is False  # the committer's thread, before apply
    assert good.applied and not bad.applied
    assert late == [0, 5]
