"""Every code block of the README, run as a newcomer would run it.

The serve block goes through `shoal`'s own command line (parsed, turned into the server's
config) and its server runs in this process, on a tiny model with SmolLM2's tokenizer whose
every answer ends at once, with a long context and cheap to prefill (Codex's and Claude Code's
prompts pass SmolLM2's 8,192 tokens): the blocks check the protocol, not the words. Before a
block runs, the test fills in what only it knows:

- `http://127.0.0.1:8000` -> the live server's URL (a free port);
- `SmolLM2-135M-Instruct.Q4_1` (the bundled model's id) -> the tiny model's id;
- `.venv/bin/` -> this interpreter's bin folder;
- the serve command also gets `--model <the tiny model> --data-dir <a temporary folder>
  --kv-cache-gib 0.25 --host-kv-gib 0.25`.

Python blocks run in this process as scripts (`__name__ == "__main__"`); shell blocks under
`bash -e -o pipefail` in a fresh git checkout (Codex works in one), with HOME a fresh folder
holding the README's configuration files (a TOML block whose first line names `~/...`) and
the agent CLIs on the PATH. Each must reach the server (its count of finished requests
grows). The set-up block (`make run`, `make test`) is checked with `make -n`: running it would
reinstall and run this very suite. A block whose client cannot be installed here is skipped,
saying which; a block of a kind this test does not know fails it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import agent_clients
import httpx
import pytest
from server_harness import LiveServer, serve_in_thread
from server_tiny_model import build_terse_smollm2_model

REPO = Path(__file__).resolve().parents[1]
URL, MODEL = "http://127.0.0.1:8000", "SmolLM2-135M-Instruct.Q4_1"
SERVE_EXTRA = ["--kv-cache-gib", "0.25", "--host-kv-gib", "0.25"]
AGENT_CLIS = {
    "codex": ("Codex CLI", "codex", agent_clients.codex),
    "claude": ("Claude Code", "claude-code", agent_clients.claude_code),
}


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int

    @property
    def kind(self) -> str:
        if re.search(r"^make (run|test)\b", self.code, re.M):
            return "setup"
        if "shoal serve" in self.code:
            return "serve"
        if self.lang == "toml":
            return "file"
        if self.lang in ("python", "bash"):
            return self.lang
        return "unknown"


def readme_blocks() -> list[Block]:
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").parse((REPO / "README.md").read_text())
    return [
        Block((t.info.split() or [""])[0], t.content, t.map[0] + 1 if t.map else 0)
        for t in tokens
        if t.type == "fence"
    ]


BLOCKS = readme_blocks()


@dataclass
class Readme:
    live: LiveServer
    home: Path
    work: Path

    def fill(self, code: str) -> str:
        code = code.replace(URL, self.live.url).replace(MODEL, self.live.model)
        return code.replace(".venv/bin/", f"{Path(sys.executable).parent}/")

    def finished(self) -> float:
        text = httpx.get(f"{self.live.url}/metrics", timeout=30).text
        return sum(float(v) for v in re.findall(r"^shoal_requests_total\{.*\} (\S+)$", text, re.M))


def config_path(block: Block) -> Path:
    """The file a configuration block is: its first line, `# ~/...`."""
    first = block.code.splitlines()[0]
    assert first.startswith("# ~/"), f"README.md:{block.line}: name its file as `# ~/...`"
    return Path(first.removeprefix("# ~/").split()[0])


@pytest.fixture(scope="module")
def readme(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Readme]:
    from shoal.cli import build_parser
    from shoal.cli.serve import server_config

    (serve,) = [b for b in BLOCKS if b.kind == "serve"]
    argv = shlex.split(serve.code, comments=True)
    assert Path(argv[0]).name == "shoal", serve.code
    model = build_terse_smollm2_model(
        tmp_path_factory.mktemp("readme-model"), max_positions=65536, num_layers=1, num_heads=2
    )
    data = tmp_path_factory.mktemp("readme-data")
    args = build_parser().parse_args(
        [*argv[1:], "--model", str(model), "--data-dir", str(data), *SERVE_EXTRA]
    )
    assert (args.command, args.host, args.port) == ("serve", "127.0.0.1", 8000)  # what URL says
    config = server_config(args)
    assert config is not None
    live = serve_in_thread(config)  # on a free port: 8000 may be taken here
    home, work = tmp_path_factory.mktemp("home"), tmp_path_factory.mktemp("work")
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    state = Readme(live, home, work)
    for block in BLOCKS:
        if block.kind == "file":
            path = home / config_path(block)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(state.fill(block.code))
    yield state
    live.stop()


def _check_setup(block: Block) -> None:
    targets = re.findall(r"^make (\S+)", block.code, re.M)
    done = subprocess.run(
        ["make", "-n", *targets], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "pytest" in done.stdout and "mkdocs build --strict" in done.stdout, done.stdout


def _run_python(readme: Readme, block: Block) -> None:
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else node.names[0].name) or ""
        for node in ast.walk(ast.parse(block.code))
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    for module in sorted(imported):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.skip(f"{module} is not installed here (pip install -e '.[dev]')")
    code = compile(readme.fill(block.code), f"README.md:{block.line}", "exec")
    exec(code, {"__name__": "__main__"})


def _run_bash(readme: Readme, block: Block) -> None:
    path = [str(Path(sys.executable).parent)]
    for program, (name, target, find) in AGENT_CLIS.items():
        if re.search(rf"^{program}\b", block.code, re.M):
            found = find()
            if found is None:
                pytest.skip(agent_clients.NOT_INSTALLED.format(name, target))
            path.append(str(Path(found).parent))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_"))}
    env.pop("CODEX_HOME", None)
    env.update(
        HOME=str(readme.home),
        PATH=os.pathsep.join([*path, env.get("PATH", "")]),
        PYTHONPATH=str(REPO),
        # No network here: Claude Code's update checks and telemetry stay off.
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_AUTOUPDATER="1",
    )
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", readme.fill(block.code)],
        cwd=readme.work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, f"README.md:{block.line}\n{output}"


@pytest.mark.parametrize("block", BLOCKS, ids=[f"line{b.line}-{b.kind}" for b in BLOCKS])
def test_readme_block_runs(block: Block, request: pytest.FixtureRequest) -> None:
    if block.kind == "setup":
        _check_setup(block)
        return
    readme: Readme = request.getfixturevalue("readme")
    if block.kind == "serve":
        models = httpx.get(f"{readme.live.url}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == [readme.live.model]
    elif block.kind == "file":
        path = readme.home / config_path(block)
        assert tomllib.loads(path.read_text()) == tomllib.loads(readme.fill(block.code))
    elif block.kind in ("python", "bash"):
        before = readme.finished()
        (_run_python if block.kind == "python" else _run_bash)(readme, block)
        assert readme.finished() > before, "the block never reached the server"
    else:
        pytest.fail(f"README.md:{block.line}: a ```{block.lang} block this test cannot run")


def test_every_client_has_a_block() -> None:
    """The quickstart covers what the README promises, each with code a test runs."""
    code = "\n".join(b.code for b in BLOCKS)
    for needle in (
        "chat.completions.create",
        "responses.create",
        "Anthropic(",
        "from agents import",
        "wire_api",
        "ANTHROPIC_BASE_URL",
        "ChatOpenAI",
        "curl ",
    ):
        assert needle in code, needle
