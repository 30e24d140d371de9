# The two commands: `make demo` and `make test`. Each sets up .venv itself.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt

.PHONY: demo test sanitize gpu-report clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	touch $@

# The editable install builds the native kernel once: a change to its sources installs again.
INSTALL_INPUTS := pyproject.toml constraints.txt CMakeLists.txt $(wildcard csrc/*)

$(VENV)/.demo: $(VENV)/.created $(INSTALL_INPUTS)
	$(PIP) -e ".[torch,cpu]"
	touch $@

$(VENV)/.dev: $(VENV)/.created $(INSTALL_INPUTS)
	$(PIP) -e ".[dev]"
	touch $@ $(VENV)/.demo

demo: $(VENV)/.demo
	$(VENV)/bin/qkv demo

test: $(VENV)/.dev
	$(PY) -m pytest -q

# The native kernel built with AddressSanitizer and UndefinedBehaviorSanitizer, running its tests.
ASAN_VENV := .venv-asan
sanitize:
	$(PYTHON) -m venv $(ASAN_VENV)
	QKV_SANITIZE=ON $(ASAN_VENV)/bin/python -m pip install --disable-pip-version-check -q -c constraints.txt \
		--config-settings=build-dir=build/asan ".[dev]"
	cd tests && LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
		ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
		../$(ASAN_VENV)/bin/python -m pytest -q -p no:cacheprovider test_native.py test_tiles.py test_gradients.py \
		test_many_tiles.py test_correctness.py test_masks.py test_properties.py -k native

# On a machine with an NVIDIA GPU: the triton backend's tests compiled for the GPU, then the
# GPU benchmark table (qkv triton against torch's flash SDPA and flex_attention), also as JSON.
gpu-report: $(VENV)/.dev
	$(PY) -m pytest -q tests/test_triton.py
	$(VENV)/bin/qkv bench --device cuda --json gpu-bench.json

clean:
	rm -rf $(VENV) $(ASAN_VENV) build
