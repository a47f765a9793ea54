# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# torch==2.13.0 goes in first (a CPU build on disk); every later pip call is constrained to it,
# so no dependency can pull a CUDA build of torch.

VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.arbor-installed

.PHONY: install demo test fuzz lint model kernels clean

install: $(STAMP) model kernels

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

model: $(STAMP)
	$(VENV)/bin/arbor make-test-model --preset tiny --arch llama

# The native CPU kernels (a C++ extension, about a minute; a no-op when already built). A failed
# build warns and leaves the torch reference kernels in charge; it never fails the install.
kernels: $(STAMP)
	$(PY) -m kernels.cpu_native

demo: install
	$(VENV)/bin/arbor demo

test: install
	$(PY) -m pytest -q

# The fuzz suite (tests/fuzz) for ARBOR_FUZZ_SECONDS (default 600) instead of its bounded slice.
fuzz: install
	ARBOR_FUZZ_SECONDS=$${ARBOR_FUZZ_SECONDS:-600} $(PY) -m pytest -q tests/fuzz

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info
