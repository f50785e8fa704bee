"""`RunDir`: a run directory of `qnpu quantize`, by the name and reader of every file in it.

The layout (`pipeline.run` writes it; `RunDir` is the one place that spells its names):

  .qnpu.lock           the writer's lock (`run.claimed`), never sealed
  config.yaml          the QuantizeConfig
  model.json           the QuantizedModel's description (`QuantizedModel.save`); written last
  plan.json            the quantization plan
  learned/             orbax: the quantizer state, R1/R2, smoothing and equivalent scales, codes
  sensitivity.json     eq. (4) of the down_proj inputs; sensitivity_TENSOR.json for another
  resume/              the model saved before stage 1 (model.json, plan.json, learned/)
  stage1/              stage 1's work directory: checkpoints/ and metrics.jsonl
  report.json          the run's report
  evals/               zero-shot results scored later (`qnpu study compare_methods`), not sealed
  manifest.json        written last: the sealed hashes of every file (`run_manifest`)

Every directory `QuantizedModel.save` writes (a run, its resume/ snapshot) has the model's
three entries (model.json, plan.json, learned/), so `RunDir(directory)` names them there too.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from qnpu_jax.errors import QnpuError
from qnpu_jax.files import iter_jsonl
from qnpu_jax.ir.graph import UNROTATED_INPUT
from qnpu_jax.quant.plan import QuantPlan
from qnpu_jax.transforms import EQUALIZED

MODEL_FORMAT = "qnpu-quantized-model"  # model.json's "format"
MODEL_VERSION = 1


@dataclasses.dataclass(frozen=True)
class RunDir:
    """The run directory at `path`: one property per file, and the readers of those files."""

    path: Path

    LOCK: ClassVar[str] = ".qnpu.lock"
    CONFIG: ClassVar[str] = "config.yaml"
    MODEL: ClassVar[str] = "model.json"
    PLAN: ClassVar[str] = "plan.json"
    LEARNED: ClassVar[str] = "learned"
    RESUME: ClassVar[str] = "resume"
    STAGE1: ClassVar[str] = "stage1"
    # inside stage 1's work directory (`stage1.run_stage1`'s `run_dir`: STAGE1 of a run)
    STAGE1_CHECKPOINTS: ClassVar[str] = "checkpoints"
    STAGE1_METRICS: ClassVar[str] = "metrics.jsonl"
    REPORT: ClassVar[str] = "report.json"
    EVALS: ClassVar[str] = "evals"
    MANIFEST: ClassVar[str] = "manifest.json"

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    # ------------------------------------------------------------------------------ paths

    @property
    def lock_path(self) -> Path:
        return self.path / self.LOCK

    @property
    def config_path(self) -> Path:
        return self.path / self.CONFIG

    @property
    def model_json_path(self) -> Path:
        return self.path / self.MODEL

    @property
    def plan_path(self) -> Path:
        return self.path / self.PLAN

    @property
    def learned_path(self) -> Path:
        return self.path / self.LEARNED

    @property
    def resume(self) -> RunDir:
        """The model saved before the first resumable step (stage 1): what --resume continues."""
        return RunDir(self.path / self.RESUME)

    @property
    def stage1_dir(self) -> Path:
        return self.path / self.STAGE1

    @property
    def stage1_metrics_path(self) -> Path:
        return self.stage1_dir / self.STAGE1_METRICS

    @property
    def report_path(self) -> Path:
        return self.path / self.REPORT

    @property
    def evals_dir(self) -> Path:
        return self.path / self.EVALS

    @property
    def manifest_path(self) -> Path:
        return self.path / self.MANIFEST

    def sensitivity_path(self, tensor: str = UNROTATED_INPUT) -> Path:
        """The eq. (4) scan of the promoted `tensor` (`promote` step)."""
        name = "sensitivity" if tensor == UNROTATED_INPUT else f"sensitivity_{tensor}"
        return self.path / f"{name}.json"

    # ---------------------------------------------------------------------------- checks

    @property
    def is_sealed(self) -> bool:
        """Whether the manifest is written: the run finished (`run_manifest.verify_run`
        checks it)."""
        return self.manifest_path.is_file()

    @property
    def has_config(self) -> bool:
        return self.config_path.is_file()

    @property
    def has_model_json(self) -> bool:
        """Whether a complete QuantizedModel is saved here (model.json is written last)."""
        return self.model_json_path.is_file()

    @property
    def has_report(self) -> bool:
        return self.report_path.is_file()

    # --------------------------------------------------------------------------- readers

    def read_sensitivity(self, tensor: str = UNROTATED_INPUT) -> Any:
        """The promote step's eq. (4) scan of `tensor` as the run wrote it; None where the run
        has none."""
        path = self.sensitivity_path(tensor)
        if not path.is_file():
            return None
        return json.loads(path.read_text())

    def require_config(self) -> Path:
        """The run's config.yaml, refused where the run has none (`config.read_run_config`
        reads it: pipeline.config sits above this module)."""
        if not self.has_config:
            raise QnpuError(f"{self.path} is not a finished run: {self.CONFIG} is missing")
        return self.config_path

    def read_report(self) -> dict[str, Any]:
        """The run's report (report.json): a JSON object."""
        path = self.report_path
        if not path.is_file():
            raise QnpuError(f"{self.path} is not a finished run: {self.REPORT} is missing")
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise QnpuError(f"{path}: not a readable report ({e})") from e
        if not isinstance(report, dict):
            raise QnpuError(f"{path}: not a run report")
        return report

    def read_plan(self) -> QuantPlan:
        """The run's plan (plan.json); an unreadable or invalid one is a QnpuError naming it."""
        path = self.plan_path
        if not path.is_file():
            raise QnpuError(f"{self.path} is not a finished run: {self.PLAN} is missing")
        try:
            return QuantPlan.from_dict(json.loads(path.read_text()))
        except (QnpuError, json.JSONDecodeError, TypeError, UnicodeDecodeError) as e:
            raise QnpuError(f"{path}: {e}") from e

    def read_model_json(self) -> dict[str, Any]:
        """model.json, its format, version and keys checked (`QuantizedModel.load` reads the
        rest)."""
        path = self.model_json_path
        if not path.is_file():
            raise QnpuError(f"{self.path} holds no saved model ({self.MODEL} is missing)")
        try:
            meta = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise QnpuError(f"{path}: not readable JSON ({e})") from e
        keys = {"format", "version", "source", "config", "prefix", "fused_norms", "rotated"}
        keys |= {"mlp_smoothing_alpha", "steps"}
        optional = {"equalized", "weights"}  # written since equivalent scaling / since weights
        # were recorded; older files lack them
        if not isinstance(meta, dict) or meta.get("format") != MODEL_FORMAT:
            raise QnpuError(f"{path}: not a {MODEL_FORMAT} file")
        if meta.get("version") != MODEL_VERSION:
            raise QnpuError(
                f"{path}: model format version {meta.get('version')!r}; this qnpu_jax reads "
                f"version {MODEL_VERSION}"
            )
        if not keys <= set(meta) <= keys | optional:
            raise QnpuError(
                f"{path}: keys must be {sorted(keys)} (and optionally {sorted(optional)}), got "
                f"{sorted(meta)}"
            )
        equalized = meta.get("equalized", [])
        if not isinstance(equalized, list) or not set(equalized) <= set(EQUALIZED):
            raise QnpuError(f"{path}: equalized must list pairs of {sorted(EQUALIZED)}")
        return meta

    def read_stage1_metrics(self) -> Iterator[tuple[int, dict[str, Any]]] | None:
        """(line number, object) of every line of stage 1's metrics.jsonl, in file order;
        None when the run had no stage 1."""
        path = self.stage1_metrics_path
        if not path.is_file():
            return None
        return iter_jsonl(path)
