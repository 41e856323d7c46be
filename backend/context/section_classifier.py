"""A per-handbook classifier of a customer's request into the handbook's section groups, over sentence vectors.

A group is what a section's title names before ``": "`` (ABCD's flow: "Product Defect: Initiate Refund" is in
"Product Defect"); a title without one is its own group. The classifier is a logistic regression (scikit-learn)
fitted on the handbook alone, when it gives example customer questions: each example, each title (whole and after
the group), and each section head, labelled with its section's group. It is fitted once per handbook version, with the
section index (``backend/context/sections.py``), and answers a query in microseconds from the vector the ranking
already has.

NOTE: why groups and not sections. A handbook's sections of one group share its vocabulary ("refund" is in four of
ABCD's refund subflows), so a section-level classifier splits few examples over near-identical classes; a group has
several sections' examples. On the dev split of ``bench/data/handbook_requests.jsonl`` the group classifier alone is
85 % top-1 flow against 73 % for a section-level one (``bench.section_variants``; every variant in docs/context.md).

Pure: no database, no engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sklearn.linear_model import LogisticRegression

from backend.context.handbook import Section
from backend.context.minilm import Array

GROUP_SEPARATOR = ": "
# NOTE: on unit vectors a weak penalty fits best: of C in {1, 10, 30, 100, 300}, 100 is the best alone on the dev
# split, and 30 to 300 tie in the mix.
C = 100.0


def group_of(title: str) -> str:
    """The group a section's title names (the text before ``": "``), or the title itself."""
    head, sep, _ = title.partition(GROUP_SEPARATOR)
    return head if sep and head else title


def title_texts(sections: Sequence[Section]) -> list[str]:
    """What the classifier embeds of the titles: every whole title, then every title's part after its group."""
    return [s.title for s in sections] + [s.title.partition(GROUP_SEPARATOR)[2] or s.title for s in sections]


class GroupClassifier:
    """``proba(vector)``: for each section, the probability of its group for a query's unit vector."""

    def __init__(
        self, sections: Sequence[Section], heads: Array, titles: Array, examples: Array, penalty_c: float = C
    ) -> None:
        """``heads``: one vector per section; ``titles``: the vectors of ``title_texts(sections)``; ``examples``: one
        per example, in section order; ``penalty_c``: the regression's inverse penalty (``bench.section_variants``)."""
        groups = [group_of(s.title) for s in sections]
        names = sorted(set(groups))
        self._column = np.array([names.index(g) for g in groups])  # section -> the classifier's class
        labels = list(self._column) * 3 + [self._column[i] for i, s in enumerate(sections) for _ in s.examples]
        x = np.concatenate([heads, titles, examples]).astype(np.float32)
        self._model = LogisticRegression(C=penalty_c, max_iter=3000)
        self._model.fit(x, np.asarray(labels))  # NOTE: every group has its heads' rows: classes_ is 0..k-1

    @staticmethod
    def fits(sections: Sequence[Section]) -> bool:
        """Whether a handbook can train one: example questions, and at least two groups to tell apart."""
        return any(s.examples for s in sections) and len({group_of(s.title) for s in sections}) > 1

    def proba(self, vector: Array) -> Array:
        """One value per section: the probability that ``vector``'s request belongs to the section's group."""
        p = self._model.predict_proba(vector.reshape(1, -1).astype(np.float32))[0]
        return np.asarray(p[self._column], dtype=np.float32)
