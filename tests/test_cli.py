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
