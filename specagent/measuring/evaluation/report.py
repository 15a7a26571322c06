"""Evaluation reports: per prompt, per setting and overall; JSON, a terminal table, a chart."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...decoding.costs import CostModel
from ...machine import machine_info
from ...policy import Policy
from ..records import geomean

__all__ = ["EvalReport", "PromptScore", "SettingReport", "setting_label", "write_chart"]


def setting_label(policy: Policy) -> str:
    """A short, readable name for a setting: rule, parameters and k."""
    k = f"k={policy.drafter.num_speculative_tokens}"
    if policy.acceptance is None:
        return f"lossless {k}"
    params = policy.acceptance.model_dump(exclude={"rule", "max_divergence"})
    text = " ".join(f"{key}={value:g}" for key, value in params.items())
    return f"{policy.acceptance.rule} {text} {k}"


@dataclass
class PromptScore:
    prompt: str
    divergence: float
    """Mean over the setting's calls of their mean TV divergence per token (0 when lossless)."""
    similarity: float
    """Mean embedding cosine of the setting's outputs to the twin's (pairs of different seeds;
    the one pair when greedy)."""
    similarity_floor: float
    """Mean cosine between twin outputs of different seeds (1 with one seed: greedy)."""
    paired_similarity: float
    """Mean cosine of same-seed pairs: how much the setting changes one output."""
    rouge_l: float
    rouge_l_floor: float
    speed_ratio: float
    """Measured tokens/s of the setting over the twin's."""
    modelled_speed_ratio: float
    """Tokens per unit of modelled step cost, setting over twin."""
    acceptance_rate: float
    twin_acceptance_rate: float
    mean_acceptance_length: float
    twin_mean_acceptance_length: float
    fell_back: int
    """Calls that exceeded ``max_divergence`` and finished losslessly."""
    outputs: list[str] = field(default_factory=list)
    twin_outputs: list[str] = field(default_factory=list)

    @property
    def relative_similarity(self) -> float:
        return self.similarity / self.similarity_floor if self.similarity_floor > 0 else 0.0


@dataclass
class SettingReport:
    label: str
    policy: Policy
    temperature: float
    seeds: list[int]
    costs: CostModel
    prompts: list[PromptScore]
    modelled_tokens_per_cost: float
    """Tokens per unit of modelled cost over the whole set (1.0 = plain decoding)."""

    def overall(self) -> dict[str, float]:
        rows = self.prompts
        return {
            "divergence": _mean(r.divergence for r in rows),
            "max_divergence": max(r.divergence for r in rows),
            "similarity": _mean(r.similarity for r in rows),
            "similarity_floor": _mean(r.similarity_floor for r in rows),
            "paired_similarity": _mean(r.paired_similarity for r in rows),
            "min_relative_similarity": min(r.relative_similarity for r in rows),
            "rouge_l": _mean(r.rouge_l for r in rows),
            "rouge_l_floor": _mean(r.rouge_l_floor for r in rows),
            "speed_ratio": geomean(r.speed_ratio for r in rows),
            "modelled_speed_ratio": geomean(r.modelled_speed_ratio for r in rows),
            "acceptance_rate": _mean(r.acceptance_rate for r in rows),
            "twin_acceptance_rate": _mean(r.twin_acceptance_rate for r in rows),
            "mean_acceptance_length": _mean(r.mean_acceptance_length for r in rows),
            "twin_mean_acceptance_length": _mean(r.twin_mean_acceptance_length for r in rows),
            "modelled_tokens_per_cost": self.modelled_tokens_per_cost,
            "fell_back": float(sum(r.fell_back for r in rows)),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "policy": self.policy.model_dump(mode="json"),
            "temperature": self.temperature,
            "seeds": self.seeds,
            "costs": asdict(self.costs),
            "overall": {k: round(v, 4) for k, v in self.overall().items()},
            "prompts": [
                {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(row).items()}
                for row in self.prompts
            ],
        }


@dataclass
class EvalReport:
    target: str
    draft: str | None
    device: str
    prompt_set: str
    settings: list[SettingReport]

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "draft": self.draft,
            "device": self.device,
            "prompt_set": self.prompt_set,
            "settings": [s.to_json() for s in self.settings],
            "machine": machine_info(),
        }

    def table(self) -> str:
        """One row per setting: the overall numbers, as a terminal table."""
        head = (
            f"{'setting':34s} {'diverg.':>8s} {'max':>6s} {'sim':>6s} {'floor':>6s} "
            f"{'rougeL':>6s} {'speed':>6s} {'model':>6s} {'acc':>5s} {'acc.ll':>6s}"
        )
        lines = [head, "-" * len(head)]
        for s in self.settings:
            o = s.overall()
            lines.append(
                f"{s.label[:34]:34s} {o['divergence']:8.4f} {o['max_divergence']:6.3f} "
                f"{o['similarity']:6.3f} {o['similarity_floor']:6.3f} {o['rouge_l']:6.3f} "
                f"{o['speed_ratio']:5.2f}x {o['modelled_speed_ratio']:5.2f}x "
                f"{o['acceptance_rate']:5.2f} {o['twin_acceptance_rate']:6.2f}"
            )
        lines.append(
            "diverg.: mean TV per token; sim: MiniLM cosine to the lossless twin (floor: twin vs "
            "twin across seeds); speed: tokens/s over the twin (measured, model: from step "
            "costs); acc / acc.ll: acceptance of the setting / of the twin"
        )
        return "\n".join(lines)

    def save(self, out_dir: Path, stem: str) -> tuple[Path, Path]:
        """JSON, the PNG chart and a self-contained HTML report (``stem.html``: the chart
        embedded, a table per setting; what ``specagent serve --reports DIR`` links from
        its dashboard)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"
        json_path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        write_chart(self, png_path)
        (out_dir / f"{stem}.html").write_text(self.html(png_path.read_bytes()), encoding="utf-8")
        return json_path, png_path

    def html(self, chart_png: bytes) -> str:
        """The report as one HTML page: what was compared, the chart, and per setting its
        overall numbers and a row per prompt (prompt ids and numbers; no output text)."""
        import base64
        import html

        columns = [
            ("divergence", "divergence", 4),
            ("similarity", "similarity", 3),
            ("similarity_floor", "noise floor", 3),
            ("rouge_l", "ROUGE-L", 3),
            ("rouge_l_floor", "ROUGE-L floor", 3),
            ("speed_ratio", "speed (measured)", 2),
            ("modelled_speed_ratio", "speed (modelled)", 2),
            ("acceptance_rate", "acceptance", 2),
            ("twin_acceptance_rate", "lossless acceptance", 2),
            ("fell_back", "fallbacks", 0),
        ]

        def cells(values: dict[str, Any]) -> str:
            out = []
            for key, _, digits in columns:
                value = values.get(key)
                shown = "–" if value is None else f"{float(value):.{digits}f}"
                out.append(f"<td>{shown}</td>")
            return "".join(out)

        head = "".join(f"<th>{html.escape(label)}</th>" for _, label, _ in columns)
        sections = []
        for setting in self.settings:
            rows = [
                f"<tr><td>{html.escape(score.prompt)}</td>{cells(asdict(score))}</tr>"
                for score in setting.prompts
            ]
            overall = setting.overall()
            rows.append(f"<tr class='overall'><td>overall</td>{cells(overall)}</tr>")
            sections.append(
                f"<h2>{html.escape(setting.label)}</h2><table><thead><tr><th>prompt</th>"
                f"{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
            )
        chart = base64.b64encode(chart_png).decode("ascii")
        title = f"specagent eval: {self.target} (draft: {self.draft})"
        return (
            "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title><style>"
            "body{font:14px/1.45 system-ui,sans-serif;margin:22px;color:#1d2330}"
            "table{border-collapse:collapse;margin-bottom:18px}"
            "th,td{padding:5px 8px;border-bottom:1px solid #e5e7eb;text-align:right}"
            "th:first-child,td:first-child{text-align:left}th{background:#f1f5f9;font-size:12px}"
            "tr.overall td{font-weight:600}img{max-width:100%}"
            "</style></head><body>"
            f"<h1>{html.escape(title)}</h1>"
            f"<p>Device {html.escape(self.device)}, prompt set "
            f"{html.escape(self.prompt_set)}. Each relaxed setting against its lossless twin "
            "(same model, drafter, k, sampling and seeds): divergence is the exact mean TV "
            "distance per token; similarity the MiniLM cosine of the outputs to the twin's, "
            "beside the floor of twin against twin across seeds; speed the tokens/s over the "
            "twin's.</p>"
            f"<img alt='speed against divergence and similarity' "
            f"src='data:image/png;base64,{chart}'>"
            f"{''.join(sections)}</body></html>"
        )


def _mean(values: Any) -> float:
    items = list(values)
    return sum(items) / len(items) if items else 0.0


def write_chart(report: EvalReport, path: Path) -> None:
    """Speed over the lossless twin against divergence (left) and similarity (right), one point
    per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for setting in report.settings:
        o = setting.overall()
        for ax, x in ((left, o["divergence"]), (right, o["similarity"])):
            ax.scatter(x, o["speed_ratio"], s=28)
            ax.annotate(setting.label, (x, o["speed_ratio"]), fontsize=6, alpha=0.8)
    left.set_xlabel("mean TV divergence per token")
    right.set_xlabel("similarity to lossless output (MiniLM cosine)")
    left.set_ylabel("tokens/s over the lossless twin")
    for ax in (left, right):
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{report.target} (draft: {report.draft}), {report.device}: relaxed settings")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
