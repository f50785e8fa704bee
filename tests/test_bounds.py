"""The size bounds and type checks of issue 42 below the CLI: bounded text reading, a full
disk as one error, bounded reprs in error messages, YAML alias expansion, field types."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from qnpu_jax.errors import QnpuError, shown
from qnpu_jax.fieldtypes import conforms, describe
from qnpu_jax.files import read_text, storage_full, storage_full_is_an_error
from qnpu_jax.limits import MAX_SEED, check_at_most, check_seed
from qnpu_jax.pipeline.config import load_yaml

TENSORSTORE = (
    'OUT_OF_RANGE: Error writing "x" in OCDBT database at local file "/r/": Failed writing: '
    "\"/r/d/f5\": Failed to write 9 bytes to file 4: {} [os_error_code='{}']"
)


def test_read_text_refuses_what_is_not_a_small_regular_text_file(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes it: reading it would block forever
    (tmp_path / "ok.txt").write_text("héllo")
    (tmp_path / "big.txt").write_text("x" * 11)
    (tmp_path / "nul.txt").write_bytes(b"a\0b")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    assert read_text(tmp_path / "ok.txt", limit=10) == "héllo"
    for path, message in (
        (fifo, r"fifo: it is a FIFO, not a regular file"),
        (Path("/dev/zero"), r"/dev/zero: it is a character device"),
        (tmp_path, r"it is a directory"),
        (tmp_path / "big.txt", r"big\.txt: it is larger than the 10 bytes .* \(11 bytes"),
        (tmp_path / "nul.txt", r"it holds NUL bytes"),
        (tmp_path / "latin1.txt", r"latin1\.txt: not UTF-8 text \(.* at byte 3\)"),
        (tmp_path / "missing.txt", r"data file .*missing\.txt does not exist"),
    ):
        with pytest.raises(QnpuError, match=message):
            read_text(path, what="data file", limit=10)


def test_storage_full_is_one_error_and_other_failures_pass_through() -> None:
    for error, reason in (
        (OSError(errno.ENOSPC, "No space left on device", "/d/f"), "no space left"),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "quota"),
        (OSError(errno.EFBIG, "File too large"), r"ulimit -f"),
        (ValueError(TENSORSTORE.format("No space left on device", 28)), "no space left"),
        (ValueError(TENSORSTORE.format("File too large", 27)), r"ulimit -f"),
    ):
        assert storage_full(error) is not None
        with (
            pytest.raises(QnpuError, match=f"writing failed: .*{reason}"),
            storage_full_is_an_error(),
        ):
            raise error
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert storage_full(wrapped) == "no space left on the device"
    for other in (OSError(errno.EACCES, "Permission denied"), ValueError("os_error_code='2'")):
        assert storage_full(other) is None
        with pytest.raises(type(other)), storage_full_is_an_error():
            raise other


def test_orbax_thread_logs_about_a_full_disk_are_dropped(caplog) -> None:
    absl = logging.getLogger("absl")
    with caplog.at_level(logging.ERROR, logger="absl"), storage_full_is_an_error():
        absl.error("_SignalingThread.run() raised: %s", TENSORSTORE.format("full", 28))
        try:
            raise ValueError(TENSORSTORE.format("File too large", 27))
        except ValueError:
            absl.exception("Save Finalize thread (save_finalize) failed.")
        absl.error("an unrelated failure")
    assert [r.getMessage() for r in caplog.records] == ["an unrelated failure"]
    assert not absl.filters  # removed on the way out


def test_shown_bounds_any_value() -> None:
    assert shown("abc") == "'abc'" and shown(10**23) == str(10**23)
    assert shown([1, "a"]) == "[1, 'a']"
    bomb: list = ["x"] * 9
    for _ in range(12):
        bomb = [bomb] * 9  # 9**13 leaves
    assert len(shown(bomb)) <= 200 and len(shown("y" * 10**6)) <= 200


def test_yaml_aliases_are_fine_until_they_expand_past_the_cap() -> None:
    assert load_yaml("a: &x {p: 1}\nb: *x", "f") == {"a": {"p": 1}, "b": {"p": 1}}
    with pytest.raises(QnpuError, match=r"f: more than 1048576 bytes of values once YAML"):
        load_yaml("&a [x, *a]", "f")  # recursive
    levels = "[x, x, x, x, x, x, x, x, x]"
    for i in range(9):
        levels = f"[&a{i} {levels}" + f", *a{i}" * 8 + "]"
    with pytest.raises(QnpuError, match=r"more than 1048576 bytes"):
        load_yaml(f"eval_data: {levels}", "f")


def test_field_types_and_seeds() -> None:
    assert conforms(3, int) and not conforms(True, int) and not conforms(3.0, int)
    assert conforms(3, float) and conforms(None, float | None) and not conforms("1", float | None)
    assert conforms(("a", "b"), tuple[str, ...]) and not conforms(("a", 1), tuple[str, ...])
    assert describe(float | None) == "null or a number"
    assert describe(tuple[str, ...]) == "a list of strings"
    assert check_seed(MAX_SEED) == MAX_SEED
    for bad in (-1, MAX_SEED + 1, 10**23, True, 1.0, "1"):
        with pytest.raises(QnpuError, match=r"seed must be an integer in 0\.\.4294967295"):
            check_seed(bad)
    assert check_at_most(4, 4, "n") == 4
    with pytest.raises(QnpuError, match=r"n must be at most 4, got 5 \(why\)"):
        check_at_most(5, 4, "n", "why")


def test_every_python_float_literal_is_a_number_and_non_finite_ones_are_refused(
    tmp_path: Path,
) -> None:
    """YAML 1.1 reads 1e-3 as a string: `--set stage1.lr_scale=1e-3` was refused (issue 55)."""
    from qnpu_jax.pipeline.config import load_config

    for text, value in (("1e-3", 1e-3), ("5E-4", 5e-4), ("1e6", 1e6), (".5", 0.5), ("-.5", -0.5),
                        ("1.5e3", 1500.0), ("3", 3), ("1_000", 1000)):  # fmt: skip
        assert load_yaml(f"a: {text}", "f") == {"a": value}, text
        assert type(load_yaml(f"a: {text}", "f")["a"]) is type(value), text
    assert load_config("quick", ["stage1.lr_scale=1e-3"]).stage1.lr_scale == 1e-3
    (tmp_path / "c.yaml").write_text("method: quantnpu\nstage1:\n  lr_scale: 5E-4\n")
    assert load_config(tmp_path / "c.yaml").stage1.lr_scale == 5e-4
    for word in ("inf", "nan"):  # words, not numbers
        with pytest.raises(QnpuError, match=f"lr_scale must be a number, got '{word}'"):
            load_config("quick", [f"stage1.lr_scale={word}"])
    for yaml_word in (".inf", "-.inf", ".nan"):  # YAML's own non-finite floats
        with pytest.raises(QnpuError, match="lr_scale must be a finite number, got"):
            load_config("quick", [f"stage1.lr_scale={yaml_word}"])
    with pytest.raises(QnpuError, match="shadow_keep must be a finite number, got inf"):
        load_config("quick", ["shadow_keep=.inf"])


def test_a_key_twice_in_a_mapping_is_refused_with_both_lines(tmp_path: Path) -> None:
    """A config with `w_bits: 4` and later `w_bits: 8` ran with one of them (issue 55)."""
    from qnpu_jax.pipeline.config import load_config

    (tmp_path / "c.yaml").write_text("method: rtn\nw_bits: 4\na_bits: 8\nw_bits: 8\n")
    with pytest.raises(QnpuError, match=r"c\.yaml: key 'w_bits' appears twice, on lines 2 and 4"):
        load_config(tmp_path / "c.yaml")
    rules = "rules:\n  - pattern: layers/q_proj\n    bits: 8\n    pattern: layers/k_proj\n"
    with pytest.raises(QnpuError, match=r"key 'pattern' appears twice, on lines 2 and 4"):
        load_yaml(rules, "f")
    with pytest.raises(QnpuError, match=r"key 'steps' appears twice, on lines 2 and 3"):
        load_yaml("stage1:\n  steps: 1\n  steps: 2\n", "f")
    # a YAML merge key may be overridden: that is what it is for
    merged = load_yaml("b: &b {x: 1, y: 2}\nc:\n  <<: *b\n  x: 3\n", "f")
    assert merged["c"] == {"x": 3, "y": 2}
