# make run   - install what is missing, mount an embedded store, run a short RL workload
# make test  - install what is missing, type-check (mypy), run unit and integration tests (real FUSE mounts)
# make bench - the replay-buffer benchmark (table, JSON and PNG under bench-results/)

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
STORE := store
MNT := mnt

.PHONY: run test bench deps clean

deps: $(STAMP)

$(STAMP): pyproject.toml setup.py mount/_interpose.c distorefs/_sumtree.c distorefs/_batchfill.c distorefs/crc32.h scripts/system-deps.sh
	./scripts/system-deps.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench,torch]'
	touch $(STAMP)

test: deps
	PY=$(PY) ./scripts/typecheck.sh
	$(PY) -m pytest -q -p no:cacheprovider tests

run: deps
	./scripts/run-demo.sh $(STORE) $(MNT)

bench: deps
	$(VENV)/bin/distorefs bench buffers --out bench-results

clean:
	-fusermount3 -u $(MNT) 2>/dev/null
	rm -rf $(VENV) $(STORE) $(MNT) build *.egg-info bench-results
