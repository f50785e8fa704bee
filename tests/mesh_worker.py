"""Run by tests/test_mesh.py in a process with 8 host CPU devices (XLA_FLAGS set by the test):
stage 1, calibration, the sensitivity scan and perplexity of a small random model on several
meshes, and a stage-1 checkpoint made on one mesh resumed on another. Prints one JSON line."""

import json
import sys
from pathlib import Path

import jax
import numpy as np

from qnpu_jax.mesh import MeshConfig, make_mesh, place_params
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import init_random_params
from qnpu_jax.models.taps import FakeQuantTaps, tapped_token_nll
from qnpu_jax.pipeline import calibrate
from qnpu_jax.pipeline.config import QuantizeConfig
from qnpu_jax.pipeline.mixed_precision import tensor_sensitivity
from qnpu_jax.pipeline.quantized_model import nll_perplexity, save_learned
from qnpu_jax.pipeline.recipes import config_stage1_plan
from qnpu_jax.pipeline.stage1 import (
    Stage1Config,
    Stage1Problem,
    init_train_state,
    run_stage1,
    step_batch,
)
from qnpu_jax.quant import default_plan
from qnpu_jax.transforms import apply_rotations, fuse_norms, randomized_hadamard_rotations

MESHES = ((1, 1), (8, 1), (2, 4), (1, 8))


def main(workdir: Path) -> None:
    assert jax.device_count() == 8, jax.devices()
    # big enough that the mesh shards it: every weight stack is >= MIN_SHARDED_ELEMENTS
    cfg = ModelConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    params = fuse_norms(init_random_params(cfg, jax.random.key(4), scale=0.1), cfg)
    r1, r2 = randomized_hadamard_rotations(cfg, jax.random.key(3))
    plan = config_stage1_plan(default_plan(cfg.num_layers, w_bits=4, a_bits=8), QuantizeConfig())
    ids = np.asarray(jax.random.randint(jax.random.key(21), (6000,), 0, cfg.vocab_size))
    config = Stage1Config(steps=4, batch_size=8, grad_accum=1, checkpoint_every=1, lr_scale=1e-3)
    windows = step_batch(ids, 0, config, 32, jax.random.key(0)).reshape(-1, 32)
    rotated = apply_rotations(params, cfg, r1, r2)
    full_plan = default_plan(cfg.num_layers, w_bits=4, a_bits=8)
    out: dict = {"runs": {}}
    reference_state = calibrate(rotated, cfg, plan, windows)

    def stage1(mesh_shape, run_dir, stop_after=None):
        mesh = make_mesh(MeshConfig(data=mesh_shape[0], fsdp=mesh_shape[1]))
        problem = Stage1Problem(
            cfg=cfg, plan=plan, config=config, base_params=params,
            frozen_state=reference_state, calib_ids=ids, seq_len=32, key=jax.random.key(9),
        )  # fmt: skip
        return run_stage1(
            init_train_state(r1, r2, reference_state, plan, config), problem,
            run_dir=run_dir, progress=False, mesh=mesh, stop_after=stop_after,
        )  # fmt: skip

    for shape in MESHES:
        name = f"{shape[0]}x{shape[1]}"
        mesh = make_mesh(MeshConfig(data=shape[0], fsdp=shape[1]))
        trained = stage1(shape, workdir / name)
        placed = place_params(mesh, rotated)
        state = calibrate(placed, cfg, full_plan, windows, mesh=mesh)
        scan = tensor_sensitivity(placed, cfg, windows, "down_in", mesh=mesh)
        nll = lambda batch, p=placed, s=state: tapped_token_nll(  # noqa: E731
            p, s, batch, cfg=cfg, taps=FakeQuantTaps(full_plan)
        )
        ppl = nll_perplexity(nll, windows, mesh=mesh)["ppl"]
        specs = {
            "r1": str(trained["params"]["r1"].sharding.spec),
            "q_proj_scale": str(trained["params"]["scales"]["layers"]["q_proj"]["scale"].sharding),
            "devices": len(trained["params"]["r1"].sharding.device_set),
        }
        out["runs"][name] = {
            "r1": np.asarray(trained["params"]["r1"]).tolist(),
            "r2": np.asarray(trained["params"]["r2"]).tolist(),
            "scales": [np.asarray(x).ravel().tolist() for x in jax.tree.leaves(
                trained["params"]["scales"])],
            "calibrated": [np.asarray(x.scale).ravel().tolist()
                           for x in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "scale"))],
            "sensitivity": list(scan.ratios),
            "ppl": ppl,
            "specs": specs,
            "metrics": (workdir / name / "metrics.jsonl").read_text().splitlines(),
        }  # fmt: skip
    # killed on (2, 4) after 2 steps, resumed on (1, 8)
    moved = workdir / "moved"
    stage1((2, 4), moved, stop_after=2)
    resumed = stage1((1, 8), moved)
    out["r1_start"] = np.asarray(r1).tolist()
    out["resumed"] = {
        "metrics": (moved / "metrics.jsonl").read_text().splitlines(),
        "r1": np.asarray(resumed["params"]["r1"]).tolist(),
        "scales": [np.asarray(x).ravel().tolist() for x in jax.tree.leaves(
            resumed["params"]["scales"])],
        "step": int(resumed["step"]),
    }  # fmt: skip
    # a run's learned tree saved from arrays sharded on 8 devices (the parent loads it on 1)
    mesh = make_mesh(MeshConfig(data=2, fsdp=4))
    save_learned(workdir / "saved", place_params(mesh, resumed["params"]["r1"]),
                 resumed["params"]["r2"], calibrate(place_params(mesh, rotated), cfg, full_plan,
                                                    windows, mesh=mesh))  # fmt: skip
    # the memory plan of the same model: per-device bytes fall as fsdp grows
    from qnpu_jax.memory_plan import MemorySetting, stage1_memory

    setting = MemorySetting(seq_len=32, batch_size=2, grad_accum=1)
    out["memory"] = {
        f"1x{n}": stage1_memory(cfg, make_mesh(MeshConfig(data=1, fsdp=n)), setting)
        for n in (1, 2, 8)
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
