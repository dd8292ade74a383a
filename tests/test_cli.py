"""The `shoal` command line: argument handling, `generate` on a tiny model and the bundled one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import shoal.llm
from shoal import LLM, SamplingParams
from shoal.cli import main


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir) -> Path:
    return tiny_model_dir("llama", tokenizer=True)


class NoModel:
    def __init__(self, *a: Any, **kw: Any) -> None:
        raise AssertionError("no model should be loaded")


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "generate" in out and "bench" in out


def test_bad_option_values_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--max-tokens", "many"])
    assert e.value.code == 2


def test_stored_responses_bounds_reach_the_server_config(monkeypatch, capsys):
    import shoal.server.app

    seen = []
    monkeypatch.setattr(shoal.server.app, "run_server", lambda config, *a, **k: seen.append(config))
    assert main(["serve", "--responses-keep", "10", "--responses-max-age-days", "0.5"]) == 0
    assert (seen[0].responses_keep, seen[0].responses_max_age_s) == (10, 43200.0)
    assert main(["serve", "--responses-keep", "0"]) == 2
    assert "--responses-keep" in capsys.readouterr().err


def test_generate_without_prompts_exits_2_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(shoal.llm, "LLM", NoModel)
    assert main(["generate"]) == 2
    assert "prompt" in capsys.readouterr().err


def test_generate_json_raw_on_a_tiny_model(tiny_tok, capsys):
    args = ["generate", "w1 w2", "w3", "--model", str(tiny_tok), "--dtype", "float64"]
    assert main([*args, "--raw", "--json", "--max-tokens", "4", "--block-size", "4"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["prompt"] for x in lines] == ["w1 w2", "w3"]
    llm = LLM(str(tiny_tok), dtype="float64", kv_cache_bytes=8 << 20)
    ref = llm.generate(["w1 w2", "w3"], SamplingParams(temperature=0, max_tokens=4))
    assert [x["text"] for x in lines] == [o.text for o in ref]
    assert [x["finish_reason"] for x in lines] == [o.finish_reason for o in ref]


def test_generate_applies_the_chat_template_and_reads_files(tiny_tok, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6\n\nw7\n")
    assert main(["generate", "--file", str(prompts), "--model", str(tiny_tok), "--dtype",
                 "float64", "--max-tokens", "3"]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    llm = LLM(str(tiny_tok), dtype="float64", kv_cache_bytes=8 << 20)
    ref = [
        llm.chat([{"role": "user", "content": p}], SamplingParams(temperature=0, max_tokens=3))[0]
        for p in ("w5 w6", "w7")
    ]
    assert out == [o.text.strip() for o in ref]


def test_generate_on_the_bundled_model(bundled_llm, monkeypatch, capsys):
    """`shoal generate "..." --max-tokens 4` with no --model: the bundled SmolLM2, chat-style.

    The session's already loaded bundled engine stands in for a second load.
    """
    seen: dict[str, Any] = {}

    def reuse(model: Any = None, **kw: Any) -> LLM:
        seen.update(model=model, **kw)
        return bundled_llm

    monkeypatch.setattr(shoal.llm, "LLM", reuse)
    assert main(["generate", "What is the capital of France?", "--max-tokens", "4"]) == 0
    assert seen["model"] is None and seen["dtype"] == "float32"
    text = capsys.readouterr().out.strip()
    (ref,) = bundled_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=4),
    )
    assert text == ref.text.strip() and text.startswith("The capital")


def test_the_installed_command_runs(tiny_tok):
    """End to end through the console script, in a fresh process."""
    exe = Path(sys.executable).with_name("shoal")
    cmd = [str(exe), "generate", "w9 w10", "--model", str(tiny_tok), "--raw", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, "--max-tokens", "2"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    result = json.loads(line)
    assert result["prompt"] == "w9 w10" and result["finish_reason"] in ("stop", "length")
    assert len(result["text"].split()) <= 2


def _made_llms(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The `LLM`s the command line makes, in order (so a test can read their config)."""
    made: list[Any] = []
    original = shoal.llm.LLM

    def spy(*a: Any, **kw: Any) -> Any:
        made.append(original(*a, **kw))
        return made[-1]

    monkeypatch.setattr(shoal.llm, "LLM", spy)
    return made


def test_speculation_flag_reaches_the_engine_and_changes_no_output(tiny_tok, monkeypatch, capsys):
    args = ["generate", "w5 w6 w5 w6 w5", "--model", str(tiny_tok), "--dtype", "float64"]
    args += ["--raw", "--json", "--max-tokens", "12"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    made = _made_llms(monkeypatch)
    assert main([*args, "--num-speculative-tokens", "3"]) == 0
    assert made[0].engine.config.num_speculative_tokens == 3
    assert json.loads(capsys.readouterr().out)["text"] == plain["text"]


def test_device_flags_reach_the_engine_config():
    from shoal.cli import build_parser
    from shoal.cli.engine_args import engine_config

    args = build_parser().parse_args(["generate", "hi"])
    config = engine_config(args)
    assert (config.device, config.enforce_eager, config.cuda_graph_sizes) == ("cpu", False, None)
    flags = ["--device", "cuda:1", "--enforce-eager", "--cuda-graph-sizes", "1", "8", "32"]
    config = engine_config(build_parser().parse_args(["serve", *flags]))
    assert (config.device, config.enforce_eager) == ("cuda:1", True)
    assert config.cuda_graph_sizes == (1, 8, 32)


LEAF_COMMANDS = [
    ["generate"],
    ["bench"],
    ["serve"],
    ["sessions"],
    ["batchify"],
    ["quota", "serve"],
    ["cluster", "deploy"],
]


@pytest.mark.parametrize("command", LEAF_COMMANDS, ids=" ".join)
def test_each_command_s_help_is_a_reference(command, capsys):
    """Grouped options, each explained, with its default shown, and examples to copy."""
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "\nexamples:\n  shoal " + " ".join(command) in out
    assert "(default: " in out


def test_serve_help_shows_its_defaults_in_groups(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for group in ("HTTP:", "model:", "KV cache and its tiers", "replicas on Ray Serve"):
        assert group in out
    assert "port to listen on (default: 8000)" in " ".join(out.split())
    assert "(default: None)" not in out and "(default: False)" not in out


def test_every_option_is_explained_and_in_the_reference():
    """The docs' configuration page is rendered from these parsers: nothing is left out."""
    from shoal.cli import build_parser
    from shoal.cli.reference import _commands, markdown

    parser = build_parser()
    page = markdown(parser)
    for path, command in _commands(parser, ("shoal",)):
        assert f"## `{' '.join(path)}`" in page
        for action in command._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, f"{' '.join(path)} {action.option_strings[-1]} has no help"
            assert f"`{action.option_strings[-1]}" in page, action.option_strings
    assert "| `--port N` | `8000` | port to listen on |" in page


def test_quantization_flags_reach_the_engine(tiny_tok, monkeypatch, capsys):
    made = _made_llms(monkeypatch)
    args = ["generate", "w5 w6", "--model", str(tiny_tok), "--raw", "--max-tokens", "2"]
    assert main([*args, "--quantization", "int8", "--quantized-activations", "int8"]) == 0
    config, model = made[0].engine.config, made[0].engine.runner.model
    assert (config.quantization, config.quantized_activations) == ("int8", "int8")
    assert model.quantized and model.activation_levels == 1
