# The two commands; each does all set-up on a fresh machine.
#   make run    install (CUTLASS's headers too), build, run `python -m fused_ops`: the four architectures eager, compiled and
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

# CUTLASS's headers (pinned), from the nvidia-cutlass wheel, also copied to third_party/cutlass (its
# include/ and tools/util/include/): conv_transpose3d_weight_grad's Hopper kernels (setup.py, CMakeLists.txt),
# the compile check (tools/check_cuda_compile.py), the CUTLASS baselines (bench/cutlass/)
cutlass:
	$(PYTHON) -c "import importlib.metadata as m; assert m.version('nvidia-cutlass') == '4.2.0.0'" 2>/dev/null || \
		$(PYTHON) -m pip install -q --no-deps nvidia-cutlass==4.2.0.0
	rm -rf third_party/cutlass && mkdir -p third_party/cutlass/tools/util
	source=$$($(PYTHON) -c "import cutlass_library as c, os; print(os.path.join(os.path.dirname(c.__file__), 'source'))") \
		&& cp -r $$source/include third_party/cutlass/ && cp -r $$source/tools/util/include third_party/cutlass/tools/util/

install: deps cutlass
	$(PYTHON) -m pip install -q --no-build-isolation .

test: install
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
