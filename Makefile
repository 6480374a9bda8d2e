# Two commands (README): `make demo` and `make test`. Both create .venv on first use.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
DURATION ?= 20
POLICY ?= semantic
BAG ?=
NVCC ?= $(shell command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)

# Large shared-memory segment for VGA images between processes (else ~half the frames drop), loopback only.
export FASTRTPS_DEFAULT_PROFILES_FILE := $(CURDIR)/config/fastdds_profile.xml
export RMW_IMPLEMENTATION ?= rmw_fastrtps_cpp
export ROS_AUTOMATIC_DISCOVERY_RANGE ?= LOCALHOST
export PYTHONUNBUFFERED := 1
# One BLAS thread: the numpy backend otherwise burns a second core that the ROS threads need (measured:
# 16 ms wall but 30 ms CPU per chunk with threads, 17 ms wall and CPU with one).
export OPENBLAS_NUM_THREADS ?= 1

.PHONY: venv demo demo-sim test test-cuda-compile sweep soak bench eval clean

$(VENV)/.installed: setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[ros-pypi,test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m vla_edge_ros.bench.demo --duration $(DURATION) --policy $(POLICY) --out results/demo.json

# closed loop: the simulated arm (MetaWorld, the `sim` extra) driven by CHECKPOINT through the runtime; per-episode
# lines, a summary, results/demo.json's closed_loop section and results/demo_episode.gif. CHECKPOINT: a directory or
# a shipped policy (vla_edge_ros/policies/: metaworld_mt3, trained for push, button-press-topdown, drawer-close);
# CHECKPOINT= (empty) runs the embedded random weights
TASK ?= push
EPISODES ?= 3
CHECKPOINT ?= metaworld_mt3
demo-sim: venv
	$(PY) -m vla_edge_ros.bench.demo --sim --task $(TASK) --episodes $(EPISODES) \
		$(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) --out results/demo.json

# The kernels' compile check is test/test_cuda_compile.py: each .cu compiled once, for sm_90 and the pre-Hopper
# architectures. Alone this target runs that file; as part of `make test` the suite runs it (not twice).
test-cuda-compile: venv
ifeq ($(filter test,$(MAKECMDGOALS)),)
	NVCC="$(NVCC)" $(PY) -m pytest -q -p no:cacheprovider test/test_cuda_compile.py
else
	@echo "test-cuda-compile: the kernels are compiled once, by test/test_cuda_compile.py in this make test"
endif

test: venv test-cuda-compile
	$(PY) -m pytest -q -p no:cacheprovider test

sweep: venv
	$(PY) -m vla_edge_ros.bench.sweep --duration $(or $(DURATION),20) $(if $(BAG),--bag $(BAG)) --out results/sweep

soak: venv
	$(PY) -m vla_edge_ros.bench.soak --duration $(DURATION) --out results/soak.json

# closed-loop evaluation through the real ROS processes (sim + runtime): QUICK=1 for the CI-sized run
eval: venv
	$(PY) -m vla_edge_ros.bench.eval $(if $(QUICK),--quick) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) --out results/eval

bench: venv
	$(PY) -m vla_edge_ros.bench.runtime_bench

clean:
	rm -rf $(VENV) results build install log *.egg-info
