"""What every result of divtrace shares: :class:`Result`.

A comparison, a backward comparison, a generation, a sweep, a batch sweep and the
remedies each say what they found in their own words (``summary``) and hold their own
tables. The rest is written here once: the view Jupyter shows, the self-contained page,
the saved file and :func:`divtrace.diff` of two results of one sort.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pandas as pd

from divtrace.report import html

if TYPE_CHECKING:
    from divtrace.report.comparison import Comparison
    from divtrace.report.diff import Diff

__all__ = ["ROWS", "Result", "rows_of"]

#: The columns of :meth:`Result.rows`, what :func:`divtrace.diff` matches and compares.
ROWS = ("site", "module_type", "status", "role", "mismatch", "rel_l2")


class Result:
    """A result: what it found (:meth:`summary`), the compact view (:attr:`sites`),
    Jupyter's view, :meth:`to_html`, :meth:`save` (read back by :func:`divtrace.load`)
    and :meth:`diff`.

    A sort of result gives its ``document`` name (the saved file's ``kind``), its page's
    ``title``, :meth:`summary`, :attr:`sites`, :meth:`rows`, the fields of its saved file
    (``_fields``, read back by ``_restored``) and the pictures and sections of its page
    (``_parts``).
    """

    __slots__ = ()
    document: ClassVar[str]
    title: ClassVar[str]

    def summary(self) -> str:
        """What the result found, in plain sentences."""
        raise NotImplementedError

    @property
    def sites(self) -> pd.DataFrame:
        """The compact view: the rows and columns a person reads first."""
        raise NotImplementedError

    def rows(self) -> pd.DataFrame:
        """One row per compared thing with the columns of :data:`ROWS` (``site`` names it
        uniquely), which :func:`divtrace.diff` matches by ``site``."""
        raise NotImplementedError

    def _shade(self) -> str | None:
        """The verdict's kind that colours the summary's verdict line (None: plain)."""
        return None

    def _fields(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _restored(cls, doc: dict[str, Any],
                  comparison: Callable[[dict[str, Any]], Comparison]) -> Result:
        """The result of a saved file's fields (``comparison`` reads a saved comparison's
        fields back)."""
        raise NotImplementedError

    def _parts(self) -> list[str]:
        """The pictures and sections of the page, after the summary and the compact view."""
        return []

    def _shown(self, title: str = "") -> str:
        """The summary and the compact view as HTML, under ``title`` (none: "")."""
        return html.shown_result(title, self.summary(), self.sites, self._shade())

    def _page(self, title: str) -> str:
        return html.result_page(title, self._shown(), self._parts())

    def _repr_html_(self) -> str:
        try:
            return self._shown(self.title)
        except Exception:  # a notebook must always show something
            return f"<pre>{html.escape(self.summary())}</pre>"

    def to_html(self, path: str | Path, title: str | None = None) -> Path:
        """Writes a self-contained HTML page (its pictures embedded) and returns the path."""
        path = Path(path)
        path.write_text(self._page(self.title if title is None else title))
        return path

    def save(self, path: str | Path) -> Path:
        """Writes the result losslessly as versioned JSON (tables with their dtypes,
        column-wise), which :func:`divtrace.load` and ``divtrace show`` read back; models
        and tensors are not saved."""
        from divtrace.report import saved

        return saved.write(path, self.document, self._fields())

    def diff(self, other: Result) -> Diff:
        """How ``other`` differs from this result, row by row (see :func:`divtrace.diff`)."""
        from divtrace.report.diff import diff

        return diff(self, other)


def rows_of(frame: pd.DataFrame, name: str, module_type: Any = None, status: Any = "ok",
            mismatch: str = "mismatch", rel_l2: str = "rel_l2") -> pd.DataFrame:
    """:meth:`Result.rows` of a result's table: each row named by ``name``, a format over
    its columns (``"prompt {prompt}, step {step}"``), its figures from the columns named
    ``mismatch`` and ``rel_l2``."""
    return pd.DataFrame({
        "site": [name.format(**row) for row in frame.to_dict("records")],
        "module_type": module_type, "status": status, "role": None,
        "mismatch": frame[mismatch].to_numpy() if len(frame) else [],
        "rel_l2": frame[rel_l2].to_numpy() if len(frame) else []}, columns=list(ROWS))
