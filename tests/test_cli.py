"""The `qnpu` command: success writes a report; every bad input exits non-zero with a message."""

import json
import os
import subprocess
import sys

import pytest

from qnpu_jax.cli import main


def test_eval_writes_json_report(tmp_path, capsys):
    out = tmp_path / "reports" / "ppl.json"
    code = main(
        [
            "eval",
            "--model",
            "smollm2-135m",
            "--data",
            "wiki",
            "--seq-len",
            "64",
            "--max-windows",
            "2",
            "--batch-size",
            "2",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    for key in ("model", "data", "seq_len", "windows", "tokens", "ppl", "seconds"):
        assert key in report
    assert report["split"] == "eval" and report["windows"] == 2 and report["tokens"] == 2 * 63
    assert 1 < report["ppl"] < 100
    assert f"ppl {report['ppl']:.4f}" in capsys.readouterr().out
    assert [p.name for p in out.parent.iterdir()] == ["ppl.json"]  # no temporary left behind


def test_generate_command(capsys):
    assert (
        main(
            [
                "generate",
                "--model",
                "smollm2-135m",
                "--prompt",
                "The capital of France is",
                "--max-new-tokens",
                "3",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("The capital of France is Paris")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "nope-model", "--data", "wiki"], "unknown model 'nope-model'"),
        (["--model", "smollm2-135m", "--data", "/no/such/file.txt"], "unknown data"),
        (
            ["--model", "smollm2-135m", "--data", "wiki", "--split", "test"],
            "unknown Wikipedia split",
        ),
    ],
)
def test_eval_bad_input_exits_2(args, message, capsys):
    assert main(["eval", *args, "--seq-len", "64", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qnpu: error:") and message in err


@pytest.mark.parametrize(
    ("given", "missing"),
    [(["--data", "wiki"], "needs --seq-len,"), (["--seq-len", "64"], "needs --data,"),
     ([], "needs --data and --seq-len,")],
)  # fmt: skip
def test_eval_names_the_perplexity_flag_that_is_missing(given, missing, capsys):
    assert main(["eval", "--model", "smollm2-135m", *given, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qnpu: error: perplexity") and missing in err, err


def test_eval_empty_text_and_unsupported_architecture(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main(["eval", "--model", "smollm2-135m", "--data", str(empty), "--seq-len", "8"]) == 2
    assert "holds no text" in capsys.readouterr().err
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    text = tmp_path / "text.txt"
    text.write_text("Some words to evaluate on.")
    assert main(["eval", "--model", str(model_dir), "--data", str(text), "--seq-len", "8"]) == 2
    assert "unsupported model_type 'mamba'" in capsys.readouterr().err


def test_report_path_and_context_are_checked_before_the_run(tmp_path, capsys):
    args = ["eval", "--model", "smollm2-135m", "--data", "wiki", "--no-progress"]
    assert main([*args, "--seq-len", "64", "--json", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main([*args, "--seq-len", "64", "--json", str(blocker / "r.json")]) == 2
    assert "not a writable directory" in capsys.readouterr().err
    assert main([*args, "--seq-len", "9000"]) == 2
    assert "exceeds the model's context (8192 positions" in capsys.readouterr().err


def test_argument_errors_exit_non_zero():
    with pytest.raises(SystemExit) as e:
        main(["eval", "--model", "smollm2-135m", "--data", "wiki", "--seq-len", "0"])
    assert e.value.code == 2


@pytest.mark.parametrize("unbuffered", ["", "1"])
@pytest.mark.parametrize("argv", [["configs"], ["study"]])
def test_output_into_a_reader_that_left_ends_quietly(argv, unbuffered):
    """`qnpu configs | head -1`: the reader closes the pipe before anything is written; the
    command ends with the status a shell gives SIGPIPE (141), printing no error or traceback,
    whether the write fails inside the command (unbuffered) or at the final flush (output
    shorter than the buffer)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    done = subprocess.Popen(
        [sys.executable, "-c", "from qnpu_jax.cli import command; command()", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    assert done.stdout is not None
    done.stdout.close()  # before the child has imported anything, so every write fails
    _, err = done.communicate(timeout=120)
    assert done.returncode == 141, err
    assert err == b""


def test_a_broken_pipe_that_is_not_stdout_is_an_error(monkeypatch, capsys):
    """Only stdout's reader leaving is quiet: another pipe's failure is reported (exit 2)."""
    import qnpu_jax.cli as cli

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "cmd_configs", broken)
    assert cli.main(["configs"]) == 2
    assert "qnpu: error: [Errno 32] Broken pipe" in capsys.readouterr().err


def test_hub_id_offline_fails_fast_with_clear_message(tmp_path):
    """A real process, offline: a clear error and exit code 2, never a hang."""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "qnpu_jax.cli",
            "eval",
            "--model",
            "SomeOrg/some-model",
            "--data",
            "wiki",
            "--seq-len",
            "64",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "qnpu: error:" in proc.stderr and "SomeOrg/some-model" in proc.stderr
    assert "offline" in proc.stderr and "no local directory" in proc.stderr


def test_study_lists_refuses_and_helps(capsys):
    from qnpu_jax.studies import STUDIES

    assert main(["study"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == list(STUDIES)
    assert all(len(line.split()) > 1 for line in listed)  # each with its description
    assert main(["study", "no_such_study"]) == 2
    assert "unknown study 'no_such_study'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["study", "table_cost", "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: qnpu study table_cost")


def _parsers(parser):
    """`parser` and every subcommand parser under it, with their prog names."""
    import argparse

    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_flag_and_command_has_a_help_line():
    import argparse

    from qnpu_jax.cli import build_parser

    missing = []
    for parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._VersionAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                choices = action._choices_actions
                missing += [f"{parser.prog} {c.dest}" for c in choices if not c.help]
            elif not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []


def test_help_shows_defaults_and_what_seq_len_is(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: emulator)" in text and "(default: ppl)" in text
    assert "--seq-len N perplexity window length in tokens" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    with pytest.raises(SystemExit):
        main(["emulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tokens generated at most (default: 32)" in text


def test_version_and_study_help(capsys):
    from qnpu_jax import __version__
    from qnpu_jax.studies import STUDIES

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"qnpu {__version__}"
    for flag in ("--help", "-h"):
        assert main(["study", flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: qnpu study") and "studies:" in out
        assert all(f"  {name} " in out for name in STUDIES)


def test_configs_lists_whole_first_sentences(capsys):
    from qnpu_jax.cli import config_about
    from qnpu_jax.pipeline.config import shipped_configs

    assert main(["configs"]) == 0
    listed = " ".join(capsys.readouterr().out.split())
    for name, resource in shipped_configs().items():
        about = config_about(resource.read_text())
        assert about.endswith((".", ")")) and f"{name} {about}" in listed, name
    assert config_about("# One. Two\n# three.\nmodel: m\n# later.\n") == "One."
    assert config_about("# a sentence cut\n# over lines.\n") == "a sentence cut over lines."


def test_data_dir_flag_is_where_wikitext2_and_the_task_data_are_read(tmp_path, monkeypatch, capsys):
    """`qnpu --data-dir DIR` stands for $QNPU_DATA_DIR (and wins over it) for one command: the
    `wikitext2` spec and the zero-shot tasks are read from DIR. `eval --qdq` without --onnx fails
    right after the text is read, before any model loads: the cheapest command that reads it."""
    from qnpu_jax.data import load_documents
    from qnpu_jax.data.locations import DATA_DIR_ENV, data_dir_override
    from qnpu_jax.data.sources import wikitext_rows

    data = tmp_path / "data"
    (data / "wikitext-2-raw").mkdir(parents=True)
    raw = data / "wikitext-2-raw" / "wiki.test.raw"
    raw.write_text(" \n = Title = \n \n Some words of the test split . \n")
    elsewhere = tmp_path / "elsewhere"  # the variable's directory, which the flag overrides
    elsewhere.mkdir()
    monkeypatch.setenv(DATA_DIR_ENV, str(elsewhere))
    with data_dir_override(str(data)):
        assert os.environ[DATA_DIR_ENV] == str(data)
        assert load_documents("wikitext2") == wikitext_rows(raw.read_text())
    assert os.environ[DATA_DIR_ENV] == str(elsewhere)  # as before after the command

    ev = ["eval", "--model", "smollm2-135m", "--data", "wikitext2", "--seq-len", "8", "--qdq"]
    assert main(["--data-dir", str(data), *ev]) == 2
    assert "--qdq applies to --onnx only" in capsys.readouterr().err  # the text was read
    assert os.environ[DATA_DIR_ENV] == str(elsewhere)
    assert main(ev) == 2  # without the flag: the variable's directory, which lacks the file
    assert f"{elsewhere / 'wikitext-2-raw' / 'wiki.test.raw'} does not exist" in (
        capsys.readouterr().err
    )
    raw.write_text(" \n \n")  # read from DIR indeed: its (blank) text is refused
    assert main(["--data-dir", str(data), *ev]) == 2
    assert f"data 'wikitext:{raw}' holds no text" in capsys.readouterr().err

    tasks = ["eval", "--model", "smollm2-135m", "--tasks", "piqa"]
    assert main(["--data-dir", str(data), *tasks]) == 2  # checked before the model loads
    err = capsys.readouterr().err
    assert err.startswith("qnpu: error:") and f"not found: {data / 'piqa'}" in err

    monkeypatch.delenv(DATA_DIR_ENV)
    assert main(ev) == 2
    assert "QNPU_DATA_DIR is not set" in (err := capsys.readouterr().err) and "--data-dir" in err
    missing = tmp_path / "no-such-dir"
    assert main(["--data-dir", str(missing), *ev]) == 2
    assert capsys.readouterr().err == f"qnpu: error: --data-dir {missing}: no such directory\n"
    assert DATA_DIR_ENV not in os.environ
