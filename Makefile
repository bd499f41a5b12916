# The two commands; each does all set-up on a fresh machine.
#   make run    install, build, run `python -m fused_ops`: the four architectures eager, compiled and
#               fused, checked and timed; table, JSON and chart in fused_ops_results/ (ARGS="..." for options)
#   make test   install, build, compile-check the CUDA sources, build the C++ library + ctest, run pytest
# and the benchmark:
#   make bench  install, build, run the CUDA tests, time every fused op and the four whole models (on a GPU),
#               tables + JSON
PYTHON ?= python3
TORCH_PREFIX = $$($(PYTHON) -c "import torch; print(torch.utils.cmake_prefix_path)")

.PHONY: deps cutlass install run test bench

deps:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -c "import pytest, ninja" 2>/dev/null || $(PYTHON) -m pip install -q pytest ninja
	$(PYTHON) -c "import matplotlib" 2>/dev/null || $(PYTHON) -m pip install -q matplotlib

# CUTLASS's headers (pinned), for the compile check of the CUTLASS baselines (bench/cutlass/)
cutlass:
	$(PYTHON) -c "import importlib.metadata as m; assert m.version('nvidia-cutlass') == '4.2.0.0'" 2>/dev/null || \
		$(PYTHON) -m pip install -q --no-deps nvidia-cutlass==4.2.0.0

install: deps
	$(PYTHON) -m pip install -q --no-build-isolation .

test: install cutlass
	$(PYTHON) tools/check_cuda_compile.py
	command -v cmake >/dev/null || $(PYTHON) -m pip install -q cmake
	cmake -S . -B cmake-build -DCMAKE_PREFIX_PATH=$(TORCH_PREFIX) >/dev/null
	cmake --build cmake-build -j2
	ctest --test-dir cmake-build --output-on-failure
	$(PYTHON) -c "import torch; torch.ops.load_library('cmake-build/libfused_ops.so'); print('load_library:', torch.ops.fused_ops.avg_pool2d_sigmoid_sum.default)"
	cd tests && $(PYTHON) -m pytest -q -c ../pytest.ini --rootdir .. .

# From /, so that Python imports the installed package and not the ./fused_ops sources.
run: install
	cd / && $(PYTHON) -m fused_ops --out $(CURDIR)/fused_ops_results $(ARGS)

bench: install
	$(PYTHON) bench/run.py --skip-build
