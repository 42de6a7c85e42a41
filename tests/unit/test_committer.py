"""The committer's group commit (no FUSE): changes with work before their transaction
(compression) are prepared in the pool, each once, before the group's transaction; one
whose preparation fails fails alone."""

import threading


from distorefs.committer import Change
from distorefs.errors import DistorefsError
from store_runner import run


class Prepared(Change):
    """A change that records its preparation and checks it inside the transaction."""

    def __init__(self, log: list, fail: bool = False) -> None:
        self.log, self.fail = log, fail
        self.prepared = 0
        self.thread: str | None = None

    def prepare(self) -> None:
        self.prepared += 1
        self.thread = threading.current_thread().name
        if self.fail:
            raise DistorefsError("this one cannot be prepared")

    def txn(self, txn) -> None:
        assert self.prepared >= 1, "transaction before preparation"
        self.log.append(self)


def test_a_group_prepares_every_change_once_in_the_pool_before_its_transaction(tmp_path):
    async def body(store):
        log: list = []
        changes = [Prepared(log) for _ in range(50)]
        results = await store.committer.submit_all(changes)
        return changes, log, results
    changes, log, results = run(tmp_path / "s", body)
    assert results == [None] * 50
    assert all(c.prepared == 1 for c in changes)
    assert {id(c) for c in log} == {id(c) for c in changes}
    assert all(c.thread and c.thread.startswith("distorefs-prepare") for c in changes)


def test_a_change_whose_preparation_fails_fails_alone(tmp_path):
    async def body(store):
        log: list = []
        changes = [Prepared(log, fail=(i == 7)) for i in range(20)]
        results = await store.committer.submit_all(changes)
        return changes, log, results
    changes, log, results = run(tmp_path / "s", body)
    assert isinstance(results[7], DistorefsError)
    assert all(r is None for i, r in enumerate(results) if i != 7)
    assert changes[7] not in log
    assert all(c in log for i, c in enumerate(changes) if i != 7)
