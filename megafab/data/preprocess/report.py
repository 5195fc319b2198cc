"""The cleaning report: documents and bytes each rule removed, what was kept, printed and as JSON."""

from __future__ import annotations

import json

from megafab.data.preprocess.cleaning import RULES


class CleaningReport:
    """Counts per rule; bytes are UTF-8 bytes of the --json-keys texts as read ("html": markup bytes
    the extractor removed from documents, which are not themselves removed by it)."""

    def __init__(self):
        self.removed = {rule: [0, 0] for rule in RULES}
        self.kept = [0, 0]

    def remove(self, rule: str, nbytes: int, documents: int = 1) -> None:
        self.removed[rule][0] += documents
        self.removed[rule][1] += nbytes

    def keep(self, nbytes: int, documents: int = 1) -> None:
        self.kept[0] += documents
        self.kept[1] += nbytes

    def as_dict(self) -> dict:
        return {
            "removed": {
                rule: {"documents": d, "bytes": b} for rule, (d, b) in self.removed.items() if d or b
            },
            "kept": {"documents": self.kept[0], "bytes": self.kept[1]},
        }

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.as_dict(), f, indent=2)
            f.write("\n")

    def lines(self) -> list[str]:
        rows = [(rule, d, b) for rule, (d, b) in self.removed.items() if d or b]
        if not rows:
            return []
        total_docs = self.kept[0] + sum(d for _, d, _ in rows)
        out = [f"{'cleaning rule':<22}{'documents':>11}{'bytes':>14}{'% docs':>8}"]
        for rule, d, b in rows:
            out.append(f"{'removed ' + rule:<22}{d:>11}{b:>14}{100 * d / max(total_docs, 1):>8.2f}")
        out.append(
            f"{'kept':<22}{self.kept[0]:>11}{self.kept[1]:>14}{100 * self.kept[0] / max(total_docs, 1):>8.2f}"
        )
        return out
