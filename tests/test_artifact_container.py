"""The on-disk artifact container: int4 packing, round trips, determinism, and every refusal."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qnpu_jax.errors import QnpuError
from qnpu_jax.export import artifact as art
from qnpu_jax.export.artifact import pack_int4, read_artifact, unpack_int4, write_artifact

TOKENIZER = b'{"model": {"type": "BPE"}}\n'


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "embed.weight": rng.integers(-128, 128, size=(5, 4), dtype=np.int8),
        "layers.0.q_proj.weight": rng.integers(-8, 8, size=(3, 7), dtype=np.int8),  # int4, odd
        "layers.0.k_proj.weight": rng.integers(-8, 8, size=(2, 3, 6), dtype=np.int8),  # int4, even
        "layers.0.v_proj.weight": rng.integers(-8, 8, size=(1,), dtype=np.int8),  # int4, n=1
        "rope.cos": rng.integers(-(2**15), 2**15, size=(4, 2), dtype=np.int16),
        "lut.exp": np.arange(256, dtype=np.uint8),
        "lut.u16": np.array([0, 1, 65535], dtype=np.uint16),
        "bias": np.array([np.iinfo(np.int32).min, 0, np.iinfo(np.int32).max], dtype=np.int32),
        "mult": np.array([[np.iinfo(np.int64).min], [np.iinfo(np.int64).max]], dtype=np.int64),
        "shift": np.array(7, dtype=np.int32),  # 0-d
        "empty": np.zeros((0, 3), dtype=np.int16),
        "big_endian": np.array([1, -2, 300], dtype=">i4"),
        "fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
    }


INT4 = ("layers.0.q_proj.weight", "layers.0.k_proj.weight", "layers.0.v_proj.weight")
MANIFEST: dict[str, Any] = {"model": {"name": "tiny", "layers": 1}, "graph": [{"op": "matmul"}]}


def _write(out: Path) -> Path:
    return write_artifact(out, MANIFEST, _tensors(), int4=INT4, files={"tokenizer.json": TOKENIZER})


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _load_manifest(root: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((root / "manifest.json").read_text())
    return doc


def _save_manifest(root: Path, doc: dict[str, Any], *, reseal: bool = True) -> None:
    """Write an edited manifest; `reseal` gives it a matching digest again, so that the checks
    behind the digest (entries, paths, hashes, .npy headers) are what a test reaches."""
    from qnpu_jax.integrity import seal

    doc = seal(doc) if reseal else doc
    (root / "manifest.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def _rehash(root: Path, name: str) -> None:
    """Make the manifest's sha256/nbytes of tensor `name` match its file again."""
    doc = _load_manifest(root)
    entry = doc["tensors"][name]
    data = (root / entry["file"]).read_bytes()
    entry["sha256"], entry["nbytes"] = hashlib.sha256(data).hexdigest(), len(data)
    _save_manifest(root, doc)


@pytest.fixture
def artifact_dir(tmp_path: Path) -> Path:
    return _write(tmp_path / "art")


# ------------------------------------------------------------------------------------ int4


def test_pack_int4_nibble_layout() -> None:
    packed = pack_int4(np.array([1, -1, 7], dtype=np.int8))
    assert packed.dtype == np.uint8
    assert packed.tolist() == [0xF1, 0x07]  # element 0 low, element 1 high, odd n padded with 0
    assert pack_int4(np.array([[-8, 0], [3, -2]])).tolist() == [[0x08], [0xE3]]
    assert unpack_int4(packed, 3).tolist() == [1, -1, 7]


@pytest.mark.parametrize("shape", [(1,), (2,), (7,), (8,), (3, 5), (2, 3, 4), (4, 0)])
def test_pack_unpack_round_trip(shape: tuple[int, ...]) -> None:
    codes = np.random.default_rng(1).integers(-8, 8, size=shape, dtype=np.int8)
    packed = pack_int4(codes)
    assert packed.shape == (*shape[:-1], (shape[-1] + 1) // 2)
    back = unpack_int4(packed, shape[-1])
    assert back.dtype == np.int8
    np.testing.assert_array_equal(back, codes)


def test_pack_int4_covers_every_code() -> None:
    codes = np.arange(-8, 8, dtype=np.int8)
    np.testing.assert_array_equal(unpack_int4(pack_int4(codes), 16), codes)


@pytest.mark.parametrize(
    ("codes", "fragment"),
    [
        (np.array([8], dtype=np.int8), "[-8, 7]"),
        (np.array([-9, 0], dtype=np.int16), "[-8, 7]"),
        (np.array([0.0, 1.0]), "integer"),
        (np.array(3, dtype=np.int8), "axis"),
    ],
)
def test_pack_int4_refuses(codes: np.ndarray, fragment: str) -> None:
    with pytest.raises(QnpuError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        pack_int4(codes)


def test_unpack_int4_refuses_bad_input() -> None:
    with pytest.raises(QnpuError, match="last axis"):
        unpack_int4(np.zeros(3, dtype=np.uint8), 3)
    with pytest.raises(QnpuError, match="uint8"):
        unpack_int4(np.zeros(2, dtype=np.int8), 3)
    with pytest.raises(QnpuError, match="padding nibble"):
        unpack_int4(np.array([0xF1, 0x17], dtype=np.uint8), 3)


# ------------------------------------------------------------------------------ round trip


def test_round_trip(artifact_dir: Path) -> None:
    a = read_artifact(artifact_dir)
    expected = _tensors()
    assert set(a.tensors) == set(expected)
    for name, want in expected.items():
        got = a.tensor(name)
        assert got.shape == want.shape, name
        assert got.dtype == want.dtype.newbyteorder("="), name
        np.testing.assert_array_equal(got, want, err_msg=name)
    for name in INT4:
        assert a.tensor(name).dtype == np.int8
    assert a.files == {"tokenizer.json": TOKENIZER}
    assert a.manifest["model"] == MANIFEST["model"]
    assert a.manifest["graph"] == MANIFEST["graph"]
    assert a.path == artifact_dir


def test_manifest_layout(artifact_dir: Path) -> None:
    text = (artifact_dir / "manifest.json").read_text()
    doc = json.loads(text)
    assert text == json.dumps(doc, indent=1, sort_keys=True) + "\n"
    assert doc["format"] == "qnpu-int-artifact" and doc["version"] == 2
    from qnpu_jax.integrity import manifest_digest

    assert doc["digest"] == manifest_digest(doc)  # one digest over the manifest's content
    q = doc["tensors"]["layers.0.q_proj.weight"]
    assert q["file"] == "tensors/layers.0.q_proj.weight.npy"
    assert (q["dtype"], q["shape"], q["packing"]) == ("int8", [3, 7], "int4")
    stored = np.load(artifact_dir / q["file"])
    assert stored.dtype == np.uint8 and stored.shape == (3, 4)
    be = doc["tensors"]["big_endian"]
    assert (be["dtype"], be["packing"]) == ("int32", "none")
    assert np.load(artifact_dir / be["file"]).dtype.str == "<i4"
    assert not np.load(artifact_dir / "tensors/fortran.npy").flags.f_contiguous
    for entry in doc["tensors"].values():
        data = (artifact_dir / entry["file"]).read_bytes()
        assert data[:8] == b"\x93NUMPY\x01\x00"  # .npy format 1.0
        assert entry["nbytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert doc["files"] == {
        "tokenizer.json": {
            "sha256": hashlib.sha256(TOKENIZER).hexdigest(),
            "nbytes": len(TOKENIZER),
        }
    }


def test_rewrite_is_byte_identical(tmp_path: Path) -> None:
    first = _snapshot(_write(tmp_path / "a"))
    assert first == _snapshot(_write(tmp_path / "b"))
    assert first == _snapshot(_write(tmp_path / "a"))  # overwriting in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temp dirs left


def test_overwrite_previous_artifact_and_empty_dir(tmp_path: Path) -> None:
    out = _write(tmp_path / "art")
    write_artifact(out, {"model": "v2"}, {"x": np.array([1, 2], dtype=np.int8)})
    a = read_artifact(out)
    assert list(a.tensors) == ["x"] and a.manifest["model"] == "v2" and a.files == {}
    assert not (out / "tokenizer.json").exists()
    (tmp_path / "empty").mkdir()
    write_artifact(tmp_path / "empty", {}, {"x": np.array([1], dtype=np.int8)})
    assert read_artifact(tmp_path / "empty").tensor("x").tolist() == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "empty"]


def test_missing_tensor_name(artifact_dir: Path) -> None:
    with pytest.raises(QnpuError, match=r"has no tensor nope"):
        read_artifact(artifact_dir).tensor("nope")


def test_unlisted_files_are_ignored(artifact_dir: Path) -> None:
    (artifact_dir / "tensors" / "stray.npy").write_bytes(b"not an npy at all")
    (artifact_dir / "notes.txt").write_text("hi")
    a = read_artifact(artifact_dir)
    assert "stray" not in a.tensors and "notes.txt" not in a.files


def test_artifact_module_does_not_import_jax() -> None:
    code = "import qnpu_jax.export.artifact, sys; assert 'jax' not in sys.modules, 'jax imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ----------------------------------------------------------------------------- read refusals


def test_flipped_byte(artifact_dir: Path) -> None:
    path = artifact_dir / "tensors" / "embed.weight.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(QnpuError, match=r"embed\.weight\.npy: hash mismatch.*tampered or corrupt"):
        read_artifact(artifact_dir)


def test_truncated_file(artifact_dir: Path) -> None:
    path = artifact_dir / "tensors" / "rope.cos.npy"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(QnpuError, match=r"rope\.cos\.npy: size mismatch \(truncated\)"):
        read_artifact(artifact_dir)


def test_truncated_file_with_fixed_hash(artifact_dir: Path) -> None:
    path = artifact_dir / "tensors" / "rope.cos.npy"
    path.write_bytes(path.read_bytes()[:-2])
    _rehash(artifact_dir, "rope.cos")
    with pytest.raises(QnpuError, match=r"rope\.cos\.npy: array data is"):
        read_artifact(artifact_dir)


def test_manifest_dtype_changed(artifact_dir: Path) -> None:
    doc = _load_manifest(artifact_dir)
    doc["tensors"]["embed.weight"]["dtype"] = "int16"  # hash and size still match the file
    _save_manifest(artifact_dir, doc)
    with pytest.raises(QnpuError, match=r"embed\.weight\.npy: dtype mismatch.*int8.*int16"):
        read_artifact(artifact_dir)


def test_manifest_shape_changed(artifact_dir: Path) -> None:
    doc = _load_manifest(artifact_dir)
    doc["tensors"]["layers.0.q_proj.weight"]["shape"] = [3, 9]  # needs 5 bytes per row, not 4
    _save_manifest(artifact_dir, doc)
    with pytest.raises(QnpuError, match=r"q_proj\.weight\.npy: shape mismatch"):
        read_artifact(artifact_dir)


def test_missing_file(artifact_dir: Path) -> None:
    (artifact_dir / "tensors" / "lut.exp.npy").unlink()
    with pytest.raises(QnpuError, match=r"lut\.exp\.npy: file missing"):
        read_artifact(artifact_dir)
    _write(artifact_dir)
    (artifact_dir / "tokenizer.json").unlink()
    with pytest.raises(QnpuError, match=r"tokenizer\.json: file missing"):
        read_artifact(artifact_dir)


def test_tampered_extra_file(artifact_dir: Path) -> None:
    (artifact_dir / "tokenizer.json").write_bytes(TOKENIZER.replace(b"BPE", b"XYZ"))
    with pytest.raises(QnpuError, match=r"tokenizer\.json: hash mismatch"):
        read_artifact(artifact_dir)


@pytest.mark.parametrize(
    ("file", "fragment"),
    [
        ("../x", r"contains '\.\.'"),
        ("tensors/../../x.npy", r"contains '\.\.'"),
        ("/etc/passwd", "is absolute"),
        ("tensors\\embed.weight.npy", "backslash"),
        ("", "non-empty string"),
        (".", "outside the artifact directory"),
    ],
)
def test_unsafe_paths(artifact_dir: Path, file: str, fragment: str) -> None:
    doc = _load_manifest(artifact_dir)
    doc["tensors"]["embed.weight"]["file"] = file
    _save_manifest(artifact_dir, doc)
    with pytest.raises(QnpuError, match=r"manifest\.json: tensor 'embed\.weight'.*" + fragment):
        read_artifact(artifact_dir)


def test_unsafe_extra_file_name(artifact_dir: Path) -> None:
    doc = _load_manifest(artifact_dir)
    doc["files"]["../tokenizer.json"] = doc["files"].pop("tokenizer.json")
    _save_manifest(artifact_dir, doc)
    with pytest.raises(QnpuError, match=r"manifest\.json.*extra file name '\.\./tokenizer\.json'"):
        read_artifact(artifact_dir)


def test_symlink_escaping_the_dir(tmp_path: Path) -> None:
    root = _write(tmp_path / "art")
    outside = tmp_path / "outside.npy"
    outside.write_bytes((root / "tensors" / "embed.weight.npy").read_bytes())
    (root / "tensors" / "embed.weight.npy").unlink()
    (root / "tensors" / "embed.weight.npy").symlink_to(outside)  # same bytes: hash still valid
    with pytest.raises(QnpuError, match=r"outside the artifact directory"):
        read_artifact(root)


def test_symlink_inside_the_dir_is_fine(artifact_dir: Path) -> None:
    (artifact_dir / "tensors" / "copy.npy").write_bytes(
        (artifact_dir / "tensors" / "lut.exp.npy").read_bytes()
    )
    (artifact_dir / "tensors" / "lut.exp.npy").unlink()
    (artifact_dir / "tensors" / "lut.exp.npy").symlink_to("copy.npy")
    assert read_artifact(artifact_dir).tensor("lut.exp").tolist() == list(range(256))


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("format", "gguf", r"format is 'gguf', expected 'qnpu-int-artifact'"),
        ("version", 3, r"unsupported version 3 \(this reader supports version 2\)"),
        ("version", 1, r"unsupported version 1 .*written before manifests carried a digest"),
        ("version", True, r"unsupported version True"),
        ("tensors", [], r"'tensors' must be a JSON object"),
    ],
)
def test_bad_format_or_version(artifact_dir: Path, key: str, value: Any, fragment: str) -> None:
    doc = _load_manifest(artifact_dir)
    doc[key] = value
    _save_manifest(artifact_dir, doc)
    with pytest.raises(QnpuError, match=r"manifest\.json: " + fragment):
        read_artifact(artifact_dir)


def test_edited_manifest_number_is_refused_by_the_digest(artifact_dir: Path) -> None:
    doc = _load_manifest(artifact_dir)
    doc["model"]["layers"] = 2  # a number no file hash covers
    _save_manifest(artifact_dir, doc, reseal=False)
    with pytest.raises(
        QnpuError, match=r"manifest\.json: digest mismatch: the manifest was edited"
    ):
        read_artifact(artifact_dir)
    del doc["digest"]
    _save_manifest(artifact_dir, doc, reseal=False)
    with pytest.raises(QnpuError, match=r"manifest\.json: no valid 'digest'"):
        read_artifact(artifact_dir)


def test_killed_write_leftovers_are_removed_by_the_next_write(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    pid = int(dead.stdout)  # a process that has exited: its temp dirs are stale
    stale = tmp_path / f".art.tmp-{pid}-abc123"
    (stale / "tensors").mkdir(parents=True)
    (stale / "tensors" / "x.npy").write_bytes(b"partial")
    live = tmp_path / f".art.tmp-{os.getpid()}-def456"  # a running writer's: kept
    live.mkdir()
    other = tmp_path / f".other.tmp-{pid}-abc123"  # another artifact's, as stale: removed too
    other.mkdir()
    old = tmp_path / f".other.old-{pid}-abc123"
    (old / "old").mkdir(parents=True)
    mine = tmp_path / "notes.tmp-1-abc123"  # no leading dot: not a temp sibling
    mine.mkdir()
    _write(tmp_path / "art")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["art", live.name, mine.name])


def test_pickle_inside_npy(artifact_dir: Path) -> None:
    path = artifact_dir / "tensors" / "embed.weight.npy"
    np.save(path, np.array([{"evil": 1}, None], dtype=object), allow_pickle=True)
    _rehash(artifact_dir, "embed.weight")  # only the pickle check can catch it now
    with pytest.raises(QnpuError, match=r"embed\.weight\.npy: holds Python objects \(pickled"):
        read_artifact(artifact_dir)


def test_fortran_order_npy(artifact_dir: Path) -> None:
    path = artifact_dir / "tensors" / "embed.weight.npy"
    np.save(path, np.asfortranarray(read_artifact(artifact_dir).tensor("embed.weight")))
    _rehash(artifact_dir, "embed.weight")
    with pytest.raises(QnpuError, match=r"embed\.weight\.npy: stored in Fortran order"):
        read_artifact(artifact_dir)


def test_big_endian_npy(artifact_dir: Path) -> None:
    path = artifact_dir / "tensors" / "rope.cos.npy"
    np.save(path, read_artifact(artifact_dir).tensor("rope.cos").astype(">i2"))
    _rehash(artifact_dir, "rope.cos")
    with pytest.raises(QnpuError, match=r"rope\.cos\.npy: stored big-endian"):
        read_artifact(artifact_dir)


def test_not_an_npy(artifact_dir: Path) -> None:
    (artifact_dir / "tensors" / "lut.exp.npy").write_bytes(b"PK\x03\x04 a zip, say")
    _rehash(artifact_dir, "lut.exp")
    with pytest.raises(QnpuError, match=r"lut\.exp\.npy: not a valid \.npy file"):
        read_artifact(artifact_dir)


def test_nonzero_int4_padding(artifact_dir: Path) -> None:
    path = artifact_dir / "tensors" / "layers.0.q_proj.weight.npy"
    packed = np.load(path)
    packed[:, -1] |= 0x50
    np.save(path, packed)
    _rehash(artifact_dir, "layers.0.q_proj.weight")
    with pytest.raises(QnpuError, match=r"q_proj\.weight\.npy: .*padding nibble"):
        read_artifact(artifact_dir)


def test_non_json_manifest(artifact_dir: Path) -> None:
    (artifact_dir / "manifest.json").write_text('{"format": "qnpu-int-artifact",')
    with pytest.raises(QnpuError, match=r"manifest\.json: manifest is not valid JSON"):
        read_artifact(artifact_dir)
    (artifact_dir / "manifest.json").write_text('{"a": 1, "a": 2}')
    with pytest.raises(QnpuError, match=r"manifest\.json: .*duplicate key 'a'"):
        read_artifact(artifact_dir)
    (artifact_dir / "manifest.json").write_text("[1, 2]")
    with pytest.raises(QnpuError, match=r"manifest\.json: manifest must be a JSON object"):
        read_artifact(artifact_dir)


def test_missing_dir_and_manifest(tmp_path: Path) -> None:
    with pytest.raises(QnpuError, match=r"nope does not exist"):
        read_artifact(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(QnpuError, match=r"file is not a directory"):
        read_artifact(tmp_path / "file")
    with pytest.raises(QnpuError, match=r"manifest\.json: manifest missing"):
        read_artifact(tmp_path)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"extra": 1}, r"entry keys must be .*extra \['extra'\]"),
        ({"dtype": "float32"}, r"dtype 'float32' is not one of"),
        ({"packing": "int2"}, r"packing 'int2' is not one of"),
        ({"packing": "int4", "dtype": "int16"}, r"int4 packing needs dtype 'int8'"),
        ({"shape": [2, -1]}, r"shape must be a list of non-negative ints"),
        ({"shape": "5x4"}, r"shape must be a list of non-negative ints"),
        ({"sha256": "ABC"}, r"sha256 must be 64 lower-case hex digits"),
        ({"nbytes": -1}, r"nbytes must be a non-negative int"),
    ],
)
def test_bad_tensor_entry(artifact_dir: Path, change: dict[str, Any], fragment: str) -> None:
    doc = _load_manifest(artifact_dir)
    doc["tensors"]["embed.weight"].update(change)
    _save_manifest(artifact_dir, doc)
    with pytest.raises(QnpuError, match=r"manifest\.json: tensor 'embed\.weight': " + fragment):
        read_artifact(artifact_dir)


def test_missing_tensor_key_and_bad_name(artifact_dir: Path) -> None:
    doc = _load_manifest(artifact_dir)
    del doc["tensors"]["embed.weight"]["sha256"]
    _save_manifest(artifact_dir, doc)
    with pytest.raises(QnpuError, match=r"missing \['sha256'\]"):
        read_artifact(artifact_dir)
    doc = _load_manifest(_write(artifact_dir))
    doc["tensors"]["bad/name"] = doc["tensors"].pop("embed.weight")
    _save_manifest(artifact_dir, doc)
    with pytest.raises(QnpuError, match=r"manifest\.json: tensor name 'bad/name' must match"):
        read_artifact(artifact_dir)


# ---------------------------------------------------------------------------- write refusals


@pytest.mark.parametrize(
    ("tensors", "int4", "fragment"),
    [
        ({"a/b": np.zeros(2, np.int8)}, (), r"tensor name 'a/b' must match"),
        ({"": np.zeros(2, np.int8)}, (), r"tensor name '' must match"),
        ({"x": np.zeros(2, np.float32)}, (), r"tensor 'x' has dtype float32"),
        ({"x": np.zeros(2, np.uint32)}, (), r"tensor 'x' has dtype uint32"),
        ({"x": np.zeros(2, bool)}, (), r"tensor 'x' has dtype bool"),
        ({"x": np.zeros(2, np.int16)}, ("x",), r"int4 tensor 'x' must be int8"),
        ({"x": np.array([8], np.int8)}, ("x",), r"int4 tensor 'x': pack_int4: codes must lie"),
        ({"x": np.zeros(2, np.int8)}, ("y",), r"int4 names \['y'\] are not among the tensors"),
        (
            {"A": np.zeros(1, np.int8), "a": np.zeros(1, np.int8)},
            (),
            r"tensor names 'A' and 'a' differ only in case",
        ),
    ],
)
def test_write_refuses_bad_tensors(
    tmp_path: Path, tensors: dict[str, np.ndarray], int4: tuple[str, ...], fragment: str
) -> None:
    with pytest.raises(QnpuError, match=r"cannot write artifact .*out: " + fragment):
        write_artifact(tmp_path / "out", {}, tensors, int4=int4)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["../x", "manifest.json", "tensors", "sub/tok.json", ".."])
def test_write_refuses_bad_file_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(QnpuError, match=r"extra file name"):
        write_artifact(tmp_path / "out", {}, {}, files={name: b"x"})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("manifest", "fragment"),
    [
        ({"version": 3}, r"manifest keys \['version'\] are added by write_artifact"),
        ({"tensors": {}, "format": "x"}, r"\['format', 'tensors'\]"),
        ({"scale": float("nan")}, r"manifest is not plain JSON"),
        ({"scale": np.float32(1.0)}, r"manifest is not plain JSON"),
    ],
)
def test_write_refuses_bad_manifest(
    tmp_path: Path, manifest: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(QnpuError, match=fragment):
        write_artifact(tmp_path / "out", manifest, {"x": np.zeros(1, np.int8)})
    assert list(tmp_path.iterdir()) == []


def test_write_refuses_non_artifact_destination(tmp_path: Path) -> None:
    victim = tmp_path / "home"
    victim.mkdir()
    (victim / "thesis.tex").write_text("precious")
    with pytest.raises(QnpuError, match=r"home: it is a non-empty directory that is not a qnpu"):
        write_artifact(victim, {}, {"x": np.zeros(1, np.int8)})
    assert _snapshot(victim) == {"thesis.tex": b"precious"}
    # a file named manifest.json does not make a folder ours
    (victim / "manifest.json").write_text('{"name": "my project"}')
    with pytest.raises(QnpuError, match=r"not a qnpu artifact \(its manifest\.json has format"):
        write_artifact(victim, {}, {"x": np.zeros(1, np.int8)})
    # nor does a real artifact's manifest copied in beside the user's files
    real = _write(tmp_path / "real")
    (victim / "manifest.json").write_bytes((real / "manifest.json").read_bytes())
    with pytest.raises(QnpuError, match=r"holds files its manifest does not list \(thesis\.tex\)"):
        write_artifact(victim, {}, {"x": np.zeros(1, np.int8)})
    assert (victim / "thesis.tex").read_text() == "precious"
    # an artifact with a user's file added inside is not replaced either
    (real / "notes.txt").write_text("mine")
    with pytest.raises(QnpuError, match=r"does not list \(notes\.txt\)"):
        write_artifact(real, {}, {"x": np.zeros(1, np.int8)})
    assert (real / "notes.txt").read_text() == "mine"
    shutil.rmtree(real)
    (tmp_path / "plain").write_text("x")
    with pytest.raises(QnpuError, match=r"plain: it exists and is not a directory"):
        write_artifact(tmp_path / "plain", {}, {"x": np.zeros(1, np.int8)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "plain"]


def test_failed_write_leaves_previous_artifact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _write(tmp_path / "art")
    before = _snapshot(out)
    real_save = np.save
    calls = {"n": 0}

    def failing_save(*args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("disk on fire")
        real_save(*args, **kwargs)

    monkeypatch.setattr(art.np, "save", failing_save)
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_artifact(out, {"model": "v2"}, _tensors(), int4=INT4)
    calls["n"] = 0
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_artifact(tmp_path / "fresh", {}, _tensors())
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no temp dirs, no "fresh"
    assert _snapshot(out) == before
    np.testing.assert_array_equal(read_artifact(out).tensor("rope.cos"), _tensors()["rope.cos"])


def test_failed_swap_restores_previous_artifact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _write(tmp_path / "art")
    before = _snapshot(out)
    real_rename = art.os.rename

    def failing_rename(src: Any, dst: Any) -> None:
        if Path(src).name.startswith(".art.tmp-"):  # moving the new artifact in
            raise OSError("rename refused")
        real_rename(src, dst)

    monkeypatch.setattr(art.os, "rename", failing_rename)
    with pytest.raises(QnpuError, match=r"cannot write artifact .*art: rename refused"):
        write_artifact(out, {"model": "v2"}, {"x": np.zeros(1, np.int8)})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    assert _snapshot(out) == before
