# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on first use; re-runs reinstall nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
export ROS_AUTOMATIC_DISCOVERY_RANGE ?= LOCALHOST

.PHONY: demo test test-gpu bench bench-quick venv clean

venv: $(STAMP)

$(STAMP): setup.py requirements-dev.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -c constraints.txt -r requirements-dev.txt
	$(PIP) install --quiet -c constraints.txt -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gp-mapping replay bags/demo --out out

# One torch thread per process: the tests run the node and the test process side by side on small machines,
# where more threads per process oversubscribe the cores and make updates many times slower.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q test

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu test

# Benchmarks (engines vs baselines, latency, growth): results in bench/results/. The full run takes tens of minutes.
bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m gp_mapping.cli bench

bench-quick: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m gp_mapping.cli bench --quick --out bench/results/quick

clean:
	rm -rf $(VENV) out build *.egg-info
