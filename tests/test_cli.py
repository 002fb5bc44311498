"""The `pdd` command line: --version, defaults on every --help page, `pdd generate`'s prompts."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pddnet
from pddnet.bench.cli import BENCHES
from pddnet.cli import build_parser, main, walk_parsers
from pddnet.cli_format import DefaultsHelpFormatter

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
BOS = 256  # the byte vocabulary's BOS (ids 0..255 are the bytes, then BOS, EOS, PAD)


# -- pdd --version ---------------------------------------------------------------------------


def test_version_is_the_package_version(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"pddnet {importlib.metadata.version('pddnet')}\n"


def test_version_has_one_source() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert importlib.metadata.version("pddnet") == declared == pddnet.__version__


# -- defaults on every --help page -----------------------------------------------------------


def parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    return [(" ".join(path), p) for path, p in walk_parsers(build_parser())]


PARSERS = parsers()


def in_required_group(parser: argparse.ArgumentParser, action: argparse.Action) -> bool:
    return any(action in g._group_actions and g.required for g in parser._mutually_exclusive_groups)


def takes_value(action: argparse.Action) -> bool:
    return bool(action.option_strings) and action.nargs != 0 and action.help != argparse.SUPPRESS


def help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The lines --help prints for one option, joined into one line."""
    formatter = parser._get_formatter()
    formatter.add_argument(action)
    return " ".join(formatter.format_help().split())


def check_defaults(name: str, parser: argparse.ArgumentParser) -> None:
    text = parser.format_help()
    assert text.startswith("usage: ") and "%(" not in text, name
    assert "(default: None)" not in text and "(default: [])" not in text, name
    for action in parser._actions:
        if not takes_value(action) or action.required or in_required_group(parser, action):
            continue
        shown = help_of(parser, action)
        option = "/".join(action.option_strings)
        if action.default == []:
            continue  # a repeatable option given no times: nothing to say
        if action.default is None:
            if "deprecated" in shown.lower():
                continue  # an old spelling of another option: not given means not given
            # None means "something else": the help text says what
            assert "default" in shown.lower(), f"{name} {option}: say what no value means: {shown}"
        else:  # "(default: X)" from the formatter, or "(default X...)" written by hand
            assert re.search(r"\(default:? \S", shown), (
                f"{name} {option} hides its default: {shown}"
            )


def test_the_walk_finds_every_command() -> None:
    names = {name for name, _ in PARSERS}
    for expected in (
        "pdd generate",
        "pdd model export",
        "pdd wan proxy",
        "pdd wan set",
        "pdd wan packet",
        "pdd testbed up",
        "pdd testbed exec",
        "pdd up",
        "pdd serve",
        "pdd status",
        "pdd bench",
        "pdd demo",
        "pdd trace",
        "pdd sim run",
        "pdd sim plan",
        "pdd sim reproduce",
        "pdd sim calibrate",
    ):
        assert expected in names


@pytest.mark.parametrize("name,parser", PARSERS, ids=[name for name, _ in PARSERS])
def test_help_shows_defaults(name: str, parser: argparse.ArgumentParser) -> None:
    assert issubclass(parser.formatter_class, DefaultsHelpFormatter)
    check_defaults(name, parser)


def test_help_keeps_raw_descriptions() -> None:
    bench = dict(PARSERS)["pdd bench"]
    assert issubclass(bench.formatter_class, argparse.RawDescriptionHelpFormatter)
    assert "\n  ttft " in bench.format_help()  # the listing stays one benchmark a line


def test_sim_calibrate_checks_its_options_before_any_testbed(capsys, tmp_path: Path) -> None:
    assert main(["sim", "calibrate", "--target-util", "1"]) == 2
    assert "--target-util must be in (0, 1)" in capsys.readouterr().err
    assert main(["sim", "calibrate", "--sim-draws", "-1"]) == 2
    assert "--sim-draws must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no saved testbed run"):
        main(["sim", "calibrate", "--reuse", "--out", str(tmp_path)])
    (tmp_path / "calibration_runs.json").write_text(json.dumps({"args": {}, "run": {}}))
    with pytest.raises(SystemExit, match="not an interleaved run"):
        main(["sim", "calibrate", "--reuse", "--out", str(tmp_path)])


@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_bench_help_pages_render(bench: str) -> None:
    parser = BENCHES[bench].parser()
    assert parser.format_help().startswith(f"usage: pdd bench {bench}")
    if not issubclass(parser.formatter_class, DefaultsHelpFormatter):
        pytest.skip(
            "pddnet/bench/cli.py builds `pdd bench NAME` parsers with argparse's plain "
            "formatter (give them formatter_class=pddnet.cli_format.DefaultsHelpFormatter)"
        )
    check_defaults(f"pdd bench {bench}", parser)


def test_generate_help_page(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(--prompt TEXT | --prompt-file PATH | --prompt-ids ID,ID,...)" in out
    assert "tokens to generate (default: 32)" in out
    assert "(default: small)" in out and "torch threads (default: 1)" in out


# -- pdd generate --prompt | --prompt-file | --prompt-ids ----------------------------------


def generate(capsys, *args: str) -> dict:
    rc = main(["generate", "--model", "tiny", "--max-tokens", "3", "--json", *args])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)


def generate_error(capsys, *args: str) -> str:
    rc = main(["generate", "--model", "tiny", "--max-tokens", "3", *args])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    return captured.err


def test_prompt_text(capsys) -> None:
    out = generate(capsys, "--prompt", "hi")
    assert out["prompt_token_ids"] == [BOS, *b"hi"]
    assert len(out["token_ids"]) == 3


def test_prompt_file_holds_any_bytes_nul_included(capsys, tmp_path: Path) -> None:
    data = b"a\x00b\xff\n"  # NUL, a byte that is not UTF-8, and the final newline: all kept
    (tmp_path / "prompt").write_bytes(data)
    out = generate(capsys, "--prompt-file", str(tmp_path / "prompt"))
    assert out["prompt_token_ids"] == [BOS, 97, 0, 98, 255, 10]


def test_prompt_file_equals_the_same_text_and_the_same_ids(capsys, tmp_path: Path) -> None:
    (tmp_path / "prompt").write_text("Hello, PDD")
    by_file = generate(capsys, "--prompt-file", str(tmp_path / "prompt"))
    by_text = generate(capsys, "--prompt", "Hello, PDD")
    ids = ",".join(map(str, by_text["prompt_token_ids"]))
    by_ids = generate(capsys, "--prompt-ids", ids)
    assert by_file["prompt_token_ids"] == by_text["prompt_token_ids"] == by_ids["prompt_token_ids"]
    assert by_file["token_ids"] == by_text["token_ids"] == by_ids["token_ids"]  # greedy


def test_prompt_ids_are_used_as_given(capsys) -> None:
    out = generate(capsys, "--prompt-ids", " 104, 0,105 ,")  # no BOS added; spaces, trailing comma
    assert out["prompt_token_ids"] == [104, 0, 105]


def test_prompt_from_stdin(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"x\x00y")))
    out = generate(capsys, "--prompt-file", "-")
    assert out["prompt_token_ids"] == [BOS, 120, 0, 121]


def test_prompt_from_a_real_pipe() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pddnet.cli",
            "generate",
            "--model",
            "tiny",
            "--max-tokens",
            "1",
            "--json",
            "--prompt-file",
            "-",
        ],
        input=b"\x00\x01 pipe",
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["prompt_token_ids"] == [BOS, 0, 1, *b" pipe"]


@pytest.mark.parametrize(
    "ids,message",
    [
        ("1,259", "--prompt-ids: 259 outside the vocabulary of tiny (ids 0..258)"),
        ("1,x,3", "--prompt-ids: item 2 ('x') is not an integer token id"),
        ("1,-4", "--prompt-ids: item 2 (-4) is negative"),
        ("", "--prompt-ids: no token ids given"),
        ("1,,2", "--prompt-ids: item 2 ('') is not an integer token id"),
    ],
)
def test_bad_prompt_ids(capsys, ids: str, message: str) -> None:
    assert message in generate_error(capsys, "--prompt-ids", ids)


def test_missing_prompt_file(capsys, tmp_path: Path) -> None:
    err = generate_error(capsys, "--prompt-file", str(tmp_path / "nope"))
    assert f"--prompt-file: cannot read {tmp_path / 'nope'}: No such file" in err


@pytest.mark.parametrize(
    "args,message",
    [
        ((), "one of the arguments --prompt --prompt-file --prompt-ids is required"),
        (
            ("--prompt", "a", "--prompt-ids", "1"),
            "argument --prompt-ids: not allowed with argument --prompt",
        ),
        (
            ("--prompt-file", "-", "--prompt", "a"),
            "argument --prompt: not allowed with argument --prompt-file",
        ),
    ],
)
def test_exactly_one_prompt(capsys, args: tuple[str, ...], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", "tiny", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_checkpoint_tokenizer_takes_the_file_as_utf8(capsys, tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from pddnet.model import ModelConfig, init_random, save_hf

    folder = tmp_path / "ckpt"
    save_hf(init_random(ModelConfig.preset("tiny"), seed=1), folder)  # vocab 259, BOS 256
    backend = Backend(models.WordLevel({"hello": 0, "pdd": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(folder / "tokenizer.json"))
    (tmp_path / "ok").write_text("hello pdd\n")
    rc = main(
        [
            "generate",
            "--model",
            str(folder),
            "--max-tokens",
            "1",
            "--json",
            "--prompt-file",
            str(tmp_path / "ok"),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert json.loads(captured.out)["prompt_token_ids"] == [BOS, 0, 1]
    (tmp_path / "bad").write_bytes(b"hello \xff")
    rc = main(["generate", "--model", str(folder), "--prompt-file", str(tmp_path / "bad")])
    assert rc == 2
    assert "--prompt-file: not UTF-8 at byte 6" in capsys.readouterr().err
