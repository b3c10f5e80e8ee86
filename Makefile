# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv on first use; re-runs reinstall nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TF2_MSGS := $(VENV)/.tf2_msgs
TF2_MSGS_SRC := $(wildcard interfaces/tf2_msgs/package.xml interfaces/tf2_msgs/CMakeLists.txt interfaces/tf2_msgs/msg/*.msg)
NAV2_MSGS := $(VENV)/.nav2_msgs
NAV2_MSGS_SRC := $(wildcard interfaces/nav2_msgs/package.xml interfaces/nav2_msgs/CMakeLists.txt interfaces/nav2_msgs/srv/*.srv)
TORCH := torch==2.13.0
export ROS_AUTOMATIC_DISCOVERY_RANGE ?= LOCALHOST

.PHONY: demo test test-gpu bench bench-quick venv clean

venv: $(STAMP) $(TF2_MSGS) $(NAV2_MSGS)

$(STAMP): setup.py requirements-dev.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -c constraints.txt -r requirements-dev.txt
	$(PIP) install --quiet -c constraints.txt -e .
	touch $(STAMP)

# Interface packages without a wheel, built from their definitions under interfaces/ with colcon and the rosidl
# generator wheels (requirements-dev.txt) into the venv's own ROS prefix (lib/, share/, site-packages, where the
# message wheels live): $(call build_interfaces,PACKAGE,PYTHON IMPORT THAT MUST WORK AFTERWARDS). Each package has
# its own build folder and log, $(VENV)/ros_build/PACKAGE and $(VENV)/ros_build/PACKAGE.log.
define build_interfaces
	rm -rf $(VENV)/ros_build/$(1)
	mkdir -p $(VENV)/ros_build
	PATH="$(abspath $(VENV))/bin:$$PATH" CMAKE_PREFIX_PATH="$(abspath $(VENV))" AMENT_PREFIX_PATH="$(abspath $(VENV))" \
	  $(PY) -m colcon --log-base $(VENV)/ros_build/$(1)/log build --base-paths interfaces/$(1) --packages-select $(1) \
	  --build-base $(VENV)/ros_build/$(1)/build --install-base $(VENV) --merge-install --event-handlers console_cohesion- \
	  --cmake-args -DPython3_EXECUTABLE="$(abspath $(PY))" -DBUILD_TESTING=OFF > $(VENV)/ros_build/$(1).log 2>&1 \
	  || { tail -40 $(VENV)/ros_build/$(1).log; exit 1; }
	$(PY) -c "$(2)"
endef

# tf2_msgs (TFMessage only, for pose_source: tf). About 20 s once; re-run only when interfaces/tf2_msgs changes.
$(TF2_MSGS): $(STAMP) $(TF2_MSGS_SRC)
	$(call build_interfaces,tf2_msgs,from tf2_msgs.msg import TFMessage)
	touch $@

# nav2_msgs (SaveMap and LoadMap only), so the tests call the node's nav2 map services (docs/node.md): on a robot
# nav2 brings nav2_msgs. About 20 s once; re-run only when interfaces/nav2_msgs changes. After tf2_msgs (never two
# colcon builds into the same prefix at once under make -j).
$(NAV2_MSGS): $(STAMP) $(NAV2_MSGS_SRC) | $(TF2_MSGS)
	$(call build_interfaces,nav2_msgs,from nav2_msgs.srv import LoadMap; from nav2_msgs.srv import SaveMap)
	touch $@

demo: $(STAMP)
	$(VENV)/bin/gp-mapping replay bags/demo --out out

# One torch thread per process: the tests run the node and the test process side by side on small machines,
# where more threads per process oversubscribe the cores and make updates many times slower. All of test/: unit/,
# integration/ (DDS, processes) and real_data/ (../shared/data); `pytest test/unit` runs one kind
# (docs/architecture.md "Tests"). One pytest worker per core (pytest-xdist, at most 8), each test file on one
# worker so that a module's fixture (the quick bench, the Solin fits) runs once: 15 min on 2 cores against 25 in
# one process; every worker speaks DDS on its own domain (test/conftest.py). test-gpu: the tests marked gpu,
# wherever they are.
test: $(STAMP) $(TF2_MSGS) $(NAV2_MSGS)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --maxprocesses 8 --dist loadfile test

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu test

# Benchmarks (engines vs baselines, latency, growth): results in bench/results/. The full run takes tens of minutes.
bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m gp_mapping.cli bench

bench-quick: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m gp_mapping.cli bench --quick --out bench/results/quick

clean:
	rm -rf $(VENV) out build *.egg-info
