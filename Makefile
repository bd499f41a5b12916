# The two commands; each does all set-up on a fresh machine.
#   make test   install, build, compile-check the CUDA sources, build the C++ library + ctest, run pytest
#   make bench  install, build, run the CUDA tests and time every fused op (on a GPU), table + JSON
PYTHON ?= python3
TORCH_PREFIX = $$($(PYTHON) -c "import torch; print(torch.utils.cmake_prefix_path)")

.PHONY: deps install test bench

deps:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -c "import pytest, ninja" 2>/dev/null || $(PYTHON) -m pip install -q pytest ninja

install: deps
	$(PYTHON) -m pip install -q --no-build-isolation .

test: install
	$(PYTHON) tools/check_cuda_compile.py
	command -v cmake >/dev/null || $(PYTHON) -m pip install -q cmake
	cmake -S . -B cmake-build -DCMAKE_PREFIX_PATH=$(TORCH_PREFIX) >/dev/null
	cmake --build cmake-build -j2
	ctest --test-dir cmake-build --output-on-failure
	$(PYTHON) -c "import torch; torch.ops.load_library('cmake-build/libfused_ops.so'); print('load_library:', torch.ops.fused_ops.avg_pool2d_sigmoid_sum.default)"
	cd tests && $(PYTHON) -m pytest -q -c ../pytest.ini --rootdir .. .

bench: install
	$(PYTHON) bench/run.py --skip-build
