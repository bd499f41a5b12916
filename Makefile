# The two commands; each does all set-up on a fresh machine.
#   make run    install (CUTLASS's headers too), build, run `python -m fused_ops`: the four architectures eager, compiled and
#               fused, checked and timed; table, JSON and chart in fused_ops_results/ (ARGS="..." for options)
#   make test   install, build, compile-check the CUDA sources, build the C++ library + ctest (which runs
#               the scripted drop-ins in C++), run pytest
# and the benchmark:
#   make bench  install, build, run the CUDA tests, time every fused op and the four whole models (on a GPU),
#               tables + JSON; then the README's and docs/' result tables from that JSON (tools/results_tables.py)
#   make kernelbench  KernelBench's four problem files that the drop-ins replace, for bench/kernelbench.py
PYTHON ?= python3
# (pip's warning about running as root, a fresh CI machine's user: noise in a build that prints no warnings)
export PIP_ROOT_USER_ACTION := ignore
TORCH_PREFIX = $$($(PYTHON) -c "import torch; print(torch.utils.cmake_prefix_path)")

.PHONY: deps cutlass install run test bench kernelbench

# (onnx, onnxscript, onnxruntime, pinned: ONNX export run by onnxruntime, tests/test_onnx_torchscript.py)
deps:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -c "import pytest, ninja" 2>/dev/null || $(PYTHON) -m pip install -q pytest ninja
	$(PYTHON) -c "import matplotlib" 2>/dev/null || $(PYTHON) -m pip install -q matplotlib
	$(PYTHON) -c "import importlib.metadata as m; assert [m.version(p) for p in ('onnx', 'onnxscript', 'onnxruntime')] \
		== ['1.23.2', '0.7.2', '1.32.0']" 2>/dev/null || \
		$(PYTHON) -m pip install -q onnx==1.23.2 onnxscript==0.7.2 onnxruntime==1.32.0

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
	cmake -S . -B cmake-build -DCMAKE_PREFIX_PATH=$(TORCH_PREFIX) -DPython3_EXECUTABLE=$$(command -v $(PYTHON)) >/dev/null
	cmake --build cmake-build -j2
	ctest --test-dir cmake-build --output-on-failure
	$(PYTHON) -c "import torch; torch.ops.load_library('cmake-build/libfused_ops.so'); print('load_library:', torch.ops.fused_ops.avg_pool2d_sigmoid_sum.default)"
	cd tests && $(PYTHON) -m pytest -q -c ../pytest.ini --rootdir .. .

# From /, so that Python imports the installed package and not the ./fused_ops sources.
run: install
	cd / && $(PYTHON) -m fused_ops --out $(CURDIR)/fused_ops_results $(ARGS)

bench: install
	$(PYTHON) bench/run.py --skip-build
	$(PYTHON) tools/results_tables.py

# KernelBench's (ScalingIntelligence/KernelBench) four level-2 problem files that the drop-ins replace (A 8, B 78,
# C 65, D 77), at a pinned commit, into third_party/kernelbench/ (with COMMIT) for bench/kernelbench.py: from
# GitHub, or without network from a local clone or bare git directory (KERNELBENCH_REPO=<its path>).
KERNELBENCH_COMMIT = 423217d9fda91e0c2d67e4a43bf62f96f6d104f1
KERNELBENCH_PROBLEMS = 8_Conv3d_Divide_Max_GlobalAvgPool_BiasAdd_Sum 78_ConvTranspose3d_Max_Max_Sum \
	65_Conv2d_AvgPool_Sigmoid_Sum 77_ConvTranspose3d_Scale_BatchNorm_GlobalAvgPool
KERNELBENCH_REPO ?=

kernelbench:
	rm -rf third_party/kernelbench.part && mkdir -p third_party/kernelbench.part
	for problem in $(KERNELBENCH_PROBLEMS); do \
		file=KernelBench/level2/$$problem.py; \
		if [ -n "$(KERNELBENCH_REPO)" ]; then \
			git -C "$(KERNELBENCH_REPO)" show $(KERNELBENCH_COMMIT):$$file > third_party/kernelbench.part/$$problem.py; \
		else \
			curl -fsSL -o third_party/kernelbench.part/$$problem.py \
				https://raw.githubusercontent.com/ScalingIntelligence/KernelBench/$(KERNELBENCH_COMMIT)/$$file; \
		fi || exit 1; \
	done
	echo $(KERNELBENCH_COMMIT) > third_party/kernelbench.part/COMMIT
	rm -rf third_party/kernelbench && mv third_party/kernelbench.part third_party/kernelbench
