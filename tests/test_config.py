import dataclasses
from pathlib import Path

import pytest

from qnpu_jax import QnpuError
from qnpu_jax.models.config import ModelConfig, RopeConfig

LLAMA32_1B = {  # the fields of meta-llama/Llama-3.2-1B's config.json that matter
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}

QWEN25_05B = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "eos_token_id": 151643,
}


def test_llama3_config_with_rope_scaling():
    cfg = ModelConfig.from_hf(LLAMA32_1B)
    assert cfg.rope.rope_type == "llama3"
    assert cfg.rope.factor == 32.0 and cfg.rope.theta == 500000.0
    assert cfg.num_kv_heads == 8 and cfg.head_dim == 64 and cfg.tie_word_embeddings
    assert not cfg.attention_bias


def test_qwen2_has_qkv_bias_and_derived_head_dim():
    cfg = ModelConfig.from_hf(QWEN25_05B)
    assert cfg.attention_bias
    assert cfg.head_dim == 64  # 896 / 14


def test_transformers5_rope_parameters_layout():
    hf = dict(LLAMA32_1B)
    rope = {**hf.pop("rope_scaling"), "rope_theta": hf.pop("rope_theta")}
    hf["rope_parameters"] = rope
    assert ModelConfig.from_hf(hf) == ModelConfig.from_hf(LLAMA32_1B)


@pytest.mark.parametrize("hf", [LLAMA32_1B, QWEN25_05B])
def test_to_hf_round_trip(hf):
    cfg = ModelConfig.from_hf(hf)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 7}, "multiple of num_kv_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type 'yarn'"),
        ({"num_hidden_layers": 0}, "num_layers must be a positive integer"),
        ({"num_attention_heads": 0}, "num_attention_heads must be positive"),
        ({"num_key_value_heads": 0}, "num_kv_heads must be a positive integer"),
        ({"vocab_size": None}, "missing vocab_size"),
        ({"vocab_size": "many"}, "vocab_size must be an integer, got 'many'"),
        ({"hidden_size": 2048.5}, "hidden_size must be an integer"),
        ({"tie_word_embeddings": True, "bos_token_id": [1, 2]}, "bos_token_id must be"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number"),
        ({"rope_scaling": LLAMA32_1B["rope_scaling"] | {"factor": float("nan")}}, "factor"),
        ({"rope_scaling": LLAMA32_1B["rope_scaling"] | {"low_freq_factor": 0.0}}, "llama3 rope"),
        ({"attention_bias": True}, "LLaMA attention_bias=true"),
    ],
)
def test_bad_configs_are_clear_errors(change, message):
    with pytest.raises(QnpuError, match=message):
        ModelConfig.from_hf(LLAMA32_1B | change)


def test_missing_keys_are_named():
    hf = {k: v for k, v in LLAMA32_1B.items() if k != "hidden_size"}
    with pytest.raises(QnpuError, match="missing hidden_size"):
        ModelConfig.from_hf(hf)


def test_config_is_frozen_and_hashable():
    cfg = ModelConfig.from_hf(LLAMA32_1B)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3  # type: ignore[misc]
    assert hash(cfg) == hash(ModelConfig.from_hf(LLAMA32_1B))
    with pytest.raises(QnpuError, match="theta"):
        RopeConfig(theta=-1.0)


# ----------------------------------------------------------------- QuantizeConfig keys (docs)

ROOT = Path(__file__).resolve().parents[1]


def test_every_config_key_has_a_meaning_and_docs_config_md_is_current():
    from qnpu_jax.pipeline.config_doc import reference_markdown, undocumented

    assert undocumented() == []
    written = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert written == reference_markdown(), (
        "docs/config.md is stale: python3 -m qnpu_jax.pipeline.config_doc docs/config.md"
    )


def test_config_show_prints_every_key_with_its_meaning_and_reads_back(tmp_path, capsys):
    from qnpu_jax.cli import main
    from qnpu_jax.pipeline.config import KEYS, load_config

    assert main(["config", "show", "smollm2-135m-quarot-w8a8"]) == 0
    shown = capsys.readouterr().out
    keys = list(KEYS)
    lines = {line.split(":")[0]: line for line in shown.splitlines() if not line.startswith(" ")}
    for key in keys:
        assert key in lines and " # " in lines[key], key
    assert "  steps: 60 " in shown and "  fsdp: null " in shown  # nested keys too
    file = tmp_path / "shown.yaml"
    file.write_text(shown)
    assert load_config(file) == load_config("smollm2-135m-quarot-w8a8")
    # config-free: the defaults the quantize of the issue silently used, shown
    assert main(["config", "show", "--method", "quarot", "--bits", "w8a8"]) == 0
    shown = capsys.readouterr().out
    assert "mixed_precision: 0.1 " in shown and "eval_windows: 64 " in shown
    assert main(["config", "show", "--set", "bogus=1"]) == 2
    assert "unknown config key" in capsys.readouterr().err


def test_a_config_names_its_base_and_changes_keys_of_it(tmp_path, monkeypatch, capsys):
    """`base: NAME|FILE`: the named config with the file's keys over it (stage1 and mesh key
    by key), a file base found beside the file that names it, never in the working directory,
    a name among the shipped configs only; cycles, depth and a base that names nothing are
    clear errors naming the chain. `config show` prints it resolved, with no base key."""
    from qnpu_jax.cli import main
    from qnpu_jax.pipeline.config import MAX_BASE_DEPTH, load_config

    shipped = "smollm2-135m-quantnpu-w4a8"
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "a.yaml").write_text(f"base: {shipped}\nseed: 3\nstage1:\n  steps: 5\n")
    (folder / "b.yaml").write_text("base: a.yaml\nrules: []\nmesh:\n  data: 1\n")
    (folder / "m.yaml").write_text("base: b.yaml\nmesh: 1x2\n")
    monkeypatch.chdir(tmp_path)  # b names a.yaml beside itself, not in the working directory
    want = load_config(shipped, ["seed=3", "stage1.steps=5"])
    assert load_config(folder / "a.yaml") == want
    assert load_config(folder / "b.yaml") == want.replace(rules=(), mesh=_mesh(1, None))
    assert load_config(folder / "m.yaml").mesh == _mesh(1, 2)  # "1x2" over {data: 1}
    assert main(["config", "show", str(folder / "b.yaml")]) == 0
    shown = capsys.readouterr().out
    assert "base" not in [line.split(":")[0] for line in shown.splitlines()]
    (folder / "shown.yaml").write_text(shown)
    assert load_config(folder / "shown.yaml") == load_config(folder / "b.yaml")
    # errors name the problem, and the config that named it
    (folder / "c.yaml").write_text("base: d.yaml\n")
    (folder / "d.yaml").write_text("base: c.yaml\n")
    with pytest.raises(QnpuError, match=r"c\.yaml: its base keys form a cycle: .*c\.yaml -> "):
        load_config(folder / "c.yaml")
    (folder / "e.yaml").write_text("base: 3\n")
    with pytest.raises(QnpuError, match="base must name a shipped config or a YAML file, got 3"):
        load_config(folder / "e.yaml")
    (folder / "f.yaml").write_text("base: no-such\n")
    with pytest.raises(QnpuError, match=r"f\.yaml: base 'no-such' is not a shipped config"):
        load_config(folder / "f.yaml")
    (tmp_path / "x.yaml").write_text("seed: 7\n")  # in the working directory only
    (folder / "h.yaml").write_text("base: x.yaml\n")
    with pytest.raises(QnpuError, match=r"h\.yaml: base 'x\.yaml': no .*configs/x\.yaml"):
        load_config(folder / "h.yaml")
    (folder / "i.yaml").write_text(f"base: {shipped}.yaml\n")
    with pytest.raises(QnpuError, match=r"named without \.yaml"):
        load_config(folder / "i.yaml")
    (folder / "bad.yaml").write_text(f"base: {shipped}\nbogus: 1\n")
    (folder / "g.yaml").write_text("base: bad.yaml\n")
    with pytest.raises(QnpuError, match=r"g\.yaml, on base .*bad\.yaml, on base .*: .*bogus"):
        load_config(folder / "g.yaml")
    for i in range(MAX_BASE_DEPTH + 1):
        (folder / f"deep{i}.yaml").write_text(f"base: deep{i + 1}.yaml\n" if i < MAX_BASE_DEPTH
                                              else f"base: {shipped}\n")  # fmt: skip
    with pytest.raises(QnpuError, match=f"more than {MAX_BASE_DEPTH} configs deep"):
        load_config(folder / "deep0.yaml")
    assert load_config(folder / "deep2.yaml") == load_config(shipped)


def _mesh(data, fsdp):
    from qnpu_jax.mesh import MeshConfig

    return MeshConfig(data=data, fsdp=fsdp)


def test_quantize_prints_the_settings_it_chose_before_it_starts(tmp_path, capsys):
    from qnpu_jax.cli import main

    args = ["quantize", "--method", "quarot", "--bits", "w8a8", "--out", str(tmp_path / "r")]
    # a model that does not exist: it fails at loading, after the settings are printed
    assert main([*args, "--model", str(tmp_path / "none.gguf"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("settings from the defaults with --model, --method, --bits")
    for part in ("method quarot", "bits W8A8KV8", "no stage 1", "16 windows of 512 tokens"):
        assert part in err, part
    assert "at most 64 windows per set" in err and "mixed precision 0.1 " in err
    assert "prefix bos" in err and err.splitlines()[-1].startswith("qnpu: error:")


def test_shipped_configs_name_only_data_a_user_has():
    from qnpu_jax.pipeline.config import load_config, shipped_configs

    for name, resource in shipped_configs().items():
        config = load_config(name)
        assert set(config.eval.data) | {config.data.calib} <= {"wiki", "wikitext2"}, name
        assert "shared/" not in resource.read_text(), name


def test_gemma3_w4a8_config_is_smollm2s_default_with_gemmas_keys():
    """Gemma 3's W4A8 config is SmolLM2's default (its `base`) with exactly the keys its
    results name (docs/results.md): a change to SmolLM2's default reaches it, its rules too
    (SmolLM2's rules, then down_proj's weights at 8 bits), and GPTQ's act-order over 64 windows
    in two passes with a 16-bit K/V cache."""
    from qnpu_jax.pipeline.config import load_config
    from qnpu_jax.quant.plan import QuantRule

    smollm2 = load_config("smollm2-135m-quantnpu-w4a8")
    gemma = load_config("gemma3-270m-quantnpu-w4a8")
    assert gemma.rules == (*smollm2.rules, QuantRule(pattern="layers/down_proj", bits=8))
    keys = ["model=gemma3-270m", "mixed_precision=1.0", "stage1.scale_param=log"]
    keys += ["rules=[{pattern: layers/up_out, bits: 16}, {pattern: layers/down_proj, bits: 8}]"]
    keys += ["gptq_act_order=true", "kv_bits=16", "gptq_windows=64", "gptq_passes=2"]
    assert gemma == load_config("smollm2-135m-quantnpu-w4a8", [*keys, "stage1.lr_scale=10"])
    assert gemma != load_config("smollm2-135m-quantnpu-w4a8", keys)


def test_a_rule_that_sets_bits_gives_those_bits_the_aware_init():
    """The aware init goes by each tensor's bits after the config's rules: Gemma's down_proj
    weights, at 8 bits by a rule in a W4 plan, start from Max-Min (the 4-bit mean ± 3σ clip
    held 8% of their weights' norm as error, docs/results.md); a rule with an init of its own
    keeps it, a later rule still wins, and init_scheme max_min adds nothing."""
    from qnpu_jax.pipeline.config import load_config
    from qnpu_jax.pipeline.recipes import plan_options
    from qnpu_jax.quant import default_plan
    from qnpu_jax.quant.plan import QuantRule

    def inits(config):
        plan = default_plan(2, **plan_options(config))
        return {p.removeprefix("layers/"): plan.get(p).init for p in plan.paths()}

    gemma = load_config("gemma3-270m-quantnpu-w4a8")
    got = inits(gemma)
    assert got["down_proj"] == "max_min" and got["q_proj"] == got["up_proj"] == "mean_std"
    explicit = QuantRule(pattern="layers/down_proj", bits=8, init="max_min")
    assert default_plan(2, **plan_options(gemma)) == default_plan(
        2, **plan_options(gemma.replace(rules=(*gemma.rules[:-1], explicit)))
    )
    own = QuantRule(pattern="layers/down_proj", bits=8, init="mse")
    assert inits(gemma.replace(rules=(own,)))["down_proj"] == "mse"
    later = QuantRule(pattern="layers/down_proj", init="mse")
    assert inits(gemma.replace(rules=(gemma.rules[-1], later)))["down_proj"] == "mse"
    got = inits(gemma.replace(rules=(QuantRule(pattern="layers/(q_proj|mlp_in)", bits=8),)))
    assert got["q_proj"] == got["mlp_in"] == "max_min" and got["k_proj"] == "mean_std"
    w8 = load_config("gemma3-270m-quantnpu-w4a8", ["w_bits=8", "a_bits=4"])
    got = inits(w8.replace(rules=(QuantRule(pattern="layers/(q_proj|mlp_in)", bits=4),)))
    assert got["q_proj"] == got["mlp_in"] == "mean_std" and got["k_proj"] == "max_min"
    assert got["attn_in"] == "mean_std"  # A4's rotated inputs
    plain = gemma.replace(init_scheme="max_min")
    assert set(inits(plain).values()) == {"max_min", "fixed"}


def test_a_shipped_recipe_run_on_another_model_names_that_models_own_config(
    tmp_path, capsys, monkeypatch
):
    """`qnpu quantize --config smollm2-135m-quantnpu-w4a8 --model gemma3-270m` says that a
    shipped config (`base:` that recipe, `model:` Gemma 3) changes the recipe for Gemma 3;
    on the config's own model, or a model without one, nothing is said."""
    from qnpu_jax.cli import main, variant_notes
    from qnpu_jax.pipeline.config import shipped_variants

    for bits in ("w4a8", "w8a8"):
        name = f"smollm2-135m-quantnpu-{bits}"
        assert shipped_variants(name, "gemma3-270m") == [f"gemma3-270m-quantnpu-{bits}"]
        assert shipped_variants(name, "smollm2-135m") == []
    assert variant_notes("smollm2-135m-quarot-w4a8", "gemma3-270m") == []
    assert variant_notes(None, "gemma3-270m") == []
    # read as --config is: NAME.yaml is the shipped config, a file of that name is a file
    assert len(variant_notes("smollm2-135m-quantnpu-w4a8.yaml", "gemma3-270m")) == 1
    argv = ["quantize", "--config", "smollm2-135m-quantnpu-w4a8", "--out", str(tmp_path / "x")]
    # --resume on an empty --out stops the command after its settings, before any loading
    assert main([*argv, "--model", "gemma3-270m", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "note: shipped config gemma3-270m-quantnpu-w4a8 is this recipe" in err
    assert "holds no run" in err
    assert main([*argv, "--resume"]) == 2
    assert "note:" not in capsys.readouterr().err
    (tmp_path / "smollm2-135m-quantnpu-w4a8").write_text("model: smollm2-135m\n")
    monkeypatch.chdir(tmp_path)
    assert variant_notes("smollm2-135m-quantnpu-w4a8", "gemma3-270m") == []


def test_gemma3_w8a8_config_is_smollm2s_w8a8_with_gemmas_keys():
    """Gemma 3's W8A8 config is SmolLM2's W8A8 default (its `base`) with Gemma's W4A8 keys,
    q_proj's output, the K/V cache, up_proj's output and the query after RoPE at 16 bits, the
    residual split, and without the two steps that have nothing
    to act on in Gemma's plan (no 8-bit down_proj input for the shadow paths; every down_proj
    output at 16 bits already): docs/results.md."""
    from qnpu_jax.pipeline.config import key_defaults, load_config

    gemma = load_config("gemma3-270m-quantnpu-w8a8")
    keys = ["model=gemma3-270m", "mixed_precision=1.0", "stage1.scale_param=log"]
    rules = "rules=[{pattern: layers/q_out, bits: 16}, "
    rules += '{pattern: "layers/(up_out|q_rope)", bits: 16}]'
    keys += ["stage1.lr_scale=10", rules, "kv_bits=16", "residual_split=8"]
    unset = [
        f"{key}={'null' if key_defaults()[key] is None else key_defaults()[key]}"
        for key in ("shadow_outliers", "shadow_keep", "down_out_mixed_precision")
    ]
    assert gemma == load_config("smollm2-135m-quantnpu-w8a8", [*keys, *unset])
    assert gemma != load_config("smollm2-135m-quantnpu-w8a8", keys)


def test_wikitext2_is_read_from_qnpu_data_dir_or_a_clear_error(tmp_path, monkeypatch):
    from qnpu_jax.data import load_documents
    from qnpu_jax.data.locations import WIKITEXT2_HF, wikitext2_spec
    from qnpu_jax.pipeline.config import load_config
    from qnpu_jax.pipeline.run import evaluation_sets

    monkeypatch.delenv("QNPU_DATA_DIR", raising=False)
    with pytest.raises(QnpuError) as e:
        load_documents("wikitext2")
    for way in ("QNPU_DATA_DIR=DIR", "wikitext-2-raw/wiki.test.raw", "wikitext:PATH", "=hf"):
        assert way in str(e.value), way
    paper = load_config("smollm2-135m-quantnpu-w4a8-paper")
    assert paper.eval.data == ("wiki", "wikitext2")
    with pytest.raises(QnpuError, match=r"eval_data 'wikitext2': .*QNPU_DATA_DIR is not set"):
        # checked before any model or tokenizer (hence the text alone here)
        evaluation_sets(paper.replace(eval_data=("wikitext2",)), None, 10**6)
    shared = ROOT.parent / "shared" / "data"
    monkeypatch.setenv("QNPU_DATA_DIR", str(shared))
    file = shared / "wikitext-2-raw" / "wiki.test.raw"
    assert load_documents("wikitext2") == load_documents(f"wikitext:{file}")
    monkeypatch.setenv("QNPU_DATA_DIR", str(tmp_path))
    with pytest.raises(QnpuError, match=r"wiki\.test\.raw does not exist"):
        load_documents("wikitext2")
    monkeypatch.setenv("QNPU_DATA_DIR", "hf")
    assert wikitext2_spec() == WIKITEXT2_HF


def test_each_random_source_takes_its_own_seed_else_the_runs():
    """`rotation_seed`, `calib_seed`, `data_seed` move one key each; unset, the keys are
    `run_keys(seed)`'s, so configs without them run as before."""
    import jax
    import numpy as np

    from qnpu_jax.pipeline.config import QuantizeConfig
    from qnpu_jax.pipeline.recipes import config_keys, run_keys

    def data(keys):
        return [np.asarray(jax.random.key_data(k)).tolist() for k in keys]

    assert data(config_keys(QuantizeConfig(seed=1))) == data(run_keys(1))
    crossed = data(config_keys(QuantizeConfig(seed=1, rotation_seed=0)))
    assert crossed == [data(run_keys(1))[0], data(run_keys(0))[1], data(run_keys(1))[2]]
    crossed = data(config_keys(QuantizeConfig(seed=1, calib_seed=0, data_seed=2)))
    assert crossed == [data(run_keys(0))[0], data(run_keys(1))[1], data(run_keys(2))[2]]
    with pytest.raises(QnpuError, match="data_seed"):
        QuantizeConfig(data_seed=-1)


def test_pyproject_lists_every_package_and_ships_the_top_level_configs():
    """The wheel's package list is written out (configs/ is mapped in as qnpu_jax.configs): a
    package added under qnpu_jax/ without being listed would be left out of `pip install .`."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "qnpu_jax").rglob("__init__.py")
    }
    assert set(setuptools["packages"]) == on_disk | {"qnpu_jax.configs"}
    assert setuptools["package-dir"] == {"qnpu_jax.configs": "configs"}
    assert not (ROOT / "qnpu_jax" / "configs").exists()
    from qnpu_jax.pipeline.config import shipped_configs

    assert set(shipped_configs()) == {p.stem for p in (ROOT / "configs").glob("*.yaml")}


def test_keys_place_every_field_once_and_of_and_replace_take_them():
    """`KEYS` maps the flat YAML keys onto the nested config one to one; the promotions are
    named as the tensors they scan."""
    from qnpu_jax.pipeline.config import GROUPS, KEYS, Promotions, QuantizeConfig
    from qnpu_jax.pipeline.mixed_precision import SCANNED_TENSORS

    places = set(KEYS.values())
    grouped = {f"{g}.{f.name}" for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}
    own = {f.name for f in dataclasses.fields(QuantizeConfig) if f.name not in GROUPS}
    assert len(places) == len(KEYS) and places == grouped | own
    assert {f.name for f in dataclasses.fields(Promotions)} <= set(SCANNED_TENSORS)
    config = QuantizeConfig.of(w_bits=8, mixed_precision=0.2, eval_windows=None)
    assert (config.bits.w, config.promotions.down_in, config.eval.windows) == (8, 0.2, None)
    assert config.replace(a_bits=4).bits == dataclasses.replace(config.bits, a=4)
    assert QuantizeConfig.of(**config.flat()) == config
    assert config.replace(down_in_bits=16).promoted() == {}
    with pytest.raises(QnpuError, match=r"unknown config key\(s\) \['bits'\]"):
        config.replace(bits=4)
