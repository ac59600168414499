"""The progress bar of a comparison: one step per forward pass, on stderr."""

from __future__ import annotations

from types import TracebackType

from tqdm.auto import tqdm

__all__ = ["Progress"]


class Progress:
    """A tqdm bar over ``total`` passes, named after the run in progress (a widget in
    Jupyter, text on stderr elsewhere)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._bar = tqdm(total=total, desc="divtrace", unit="pass", disable=not enabled,
                         leave=False)

    def stage(self, name: str) -> None:
        """Names the run now in progress."""
        self._bar.set_description(f"divtrace: {name}")

    def more(self, passes: int) -> None:
        """``passes`` more passes than the bar was made for."""
        if passes and self._bar.total is not None:
            self._bar.total += passes
            self._bar.refresh()

    def advance(self) -> None:
        """One more pass done."""
        self._bar.update()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._bar.close()
