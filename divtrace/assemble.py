"""From the runs' device-side statistics to a :class:`~divtrace.Comparison` (the one host
synchronisation happens here)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np
import pandas as pd
import torch

from divtrace.comparison import Comparison
from divtrace.measure import Call, Measured
from divtrace.metrics import FIELDS, rel_l2, site_figures
from divtrace.sites import INPUT, site_key
from divtrace.split import SplitRecording

__all__ = ["COLUMNS", "EXPLAIN_COLUMNS", "build"]

#: The columns of :attr:`Comparison.table`, in order. They are an API: stable names.
COLUMNS = (
    "site", "module", "module_type", "call", "path", "leaf", "status", "shape", "dtype",
    "numel", "mismatch", "exceed", "max_abs", "mean_abs", "rel_l2", "max_ulp", "cosine",
    "nonfinite", "growth", "input_mismatch", "role",
)
#: Columns added by the options of ``compare()``: ``local=True``, ``truth="fp64"``,
#: ``repeat=n`` and ``kernels=True``.
EXPLAIN_COLUMNS = {
    "local": ("local_rel_l2", "local_max_abs", "amplification", "local_status"),
    "truth": ("batched_err_fp64", "split_err_fp64"),
    "repeat": ("noise_mismatch", "noise_rel_l2"),
    "kernels": ("kernels_batched", "kernels_split", "kernels_differ"),
}
_FIGURES = ("numel", "mismatch", "exceed", "max_abs", "mean_abs", "rel_l2", "max_ulp",
            "cosine", "nonfinite")
_COL = {name: i for i, name in enumerate(FIELDS)}


def _to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Brings device tensors to the host: one transfer (one synchronisation) per device."""
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        by_device[t.device].append(i)
    out: list[np.ndarray] = [np.empty(0)] * len(tensors)
    for indices in by_device.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices]).cpu().numpy()
        offset = 0
        for i in indices:
            size = tensors[i].numel()
            out[i] = flat[offset:offset + size].reshape(tuple(tensors[i].shape))
            offset += size
    return out


class _Host:
    """Collects device tensors, then brings them all to the host in one go."""

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor] = []
        self._arrays: list[np.ndarray] = []

    def add(self, tensor: torch.Tensor | None) -> int | None:
        if tensor is None:
            return None
        self._tensors.append(tensor)
        return len(self._tensors) - 1

    def fetch(self) -> None:
        self._arrays = _to_host(self._tensors) if self._tensors else []

    def __getitem__(self, index: int | None) -> np.ndarray | None:
        return None if index is None else self._arrays[index]


def _row(site: Measured) -> dict[str, Any]:
    info = site.site
    return {
        "site": info.key, "module": info.module, "module_type": info.module_type,
        "call": info.call, "path": info.path, "leaf": info.leaf, "status": site.status,
        "shape": str(site.shape), "dtype": str(site.dtype).removeprefix("torch."),
    }


def _sums(arrays: list[tuple[np.ndarray, int]]) -> dict[str, float]:
    """Mismatch count, elements, and error and reference norms over several parts."""
    count = sum(float(a[:, _COL["mismatch"]].sum()) for a, _ in arrays)
    numel = sum(n for _, n in arrays)
    diff = math.sqrt(sum(float(a[:, _COL["sq_diff"]].sum()) for a, _ in arrays))
    ref = math.sqrt(sum(float(a[:, _COL["sq_ref"]].sum()) for a, _ in arrays))
    return {"mismatch": count / numel if numel else 0.0, "diff": diff, "ref": ref}


def build(sites: list[Measured], split: SplitRecording, meta: dict[str, Any],
          calls: dict[str, Call] | None = None, noise: list[list[Measured]] | None = None,
          kernels: tuple[dict[str, list[str]], dict[str, list[str]]] | None = None,
          ) -> Comparison:
    """Assembles a :class:`Comparison` from the batched run's measured sites."""
    calls = calls or {}
    host = _Host()
    at_stats = {id(s): host.add(s.stats) for s in sites}
    at_flips = {id(s): host.add(s.flips) for s in sites}
    at_truth = {id(s): host.add(s.truth) for s in sites}
    at_inputs = {id(m): host.add(m.stats) for call in calls.values()
                 for _, _, m in call.inputs if m is not None}
    at_local = {(ck, key): host.add(t) for ck, call in calls.items()
                for key, t in call.local.items()}
    at_noise = [{s.site.key: host.add(s.stats) for s in repeat} for repeat in noise or []]
    host.fetch()

    batch, samples = meta["batch_size"], meta["samples"]
    rows: list[dict[str, Any]] = []
    sample_rows: list[dict[str, Any]] = []
    by_key: dict[str, tuple[np.ndarray, int]] = {}
    flips: dict[str, list[bool]] = {}
    for site in sites:
        row = _row(site) | dict.fromkeys(_FIGURES, math.nan)
        array = host[at_stats[id(site)]]
        if array is not None:
            per_sample = int(np.prod(site.shape)) // batch
            by_key[site.site.key] = (array, per_sample * len(samples))
            row |= site_figures(array, per_sample)
            col = {name: array[:, i] for i, name in enumerate(FIELDS)}
            sample_rel = np.atleast_1d(rel_l2(np.sqrt(col["sq_diff"]), np.sqrt(col["sq_ref"])))
            for j, sample in enumerate(samples):
                sample_rows.append({
                    "site": site.site.key, "sample": sample,
                    "mismatch": col["mismatch"][j] / per_sample if per_sample else 0.0,
                    "rel_l2": float(sample_rel[j]), "max_abs": col["max_abs"][j],
                })
        flipped = host[at_flips[id(site)]]
        if flipped is not None:
            flips[site.site.key] = flipped.astype(bool).tolist()
        truth = host[at_truth[id(site)]]
        if truth is not None:
            row["batched_err_fp64"], row["split_err_fp64"] = float(truth[0]), float(truth[1])
        rows.append(row)

    for row in rows:
        _explain(row, calls, by_key, host, at_inputs, at_local, batch, len(samples))
    for i, repeat in enumerate(at_noise):
        for row in rows:
            array = host[repeat.get(row["site"])]
            if array is None:
                continue
            figures = site_figures(array, int(row["numel"]) // len(samples))
            row["noise_mismatch"] = max(row.get("noise_mismatch", 0.0), figures["mismatch"])
            row["noise_rel_l2"] = max(row.get("noise_rel_l2", 0.0), figures["rel_l2"])
            if i == 0 and math.isnan(figures["rel_l2"]):
                row["noise_rel_l2"] = math.nan
    if kernels is not None:
        for row in rows:
            key = site_key(row["module"], row["call"], "")
            batched_k, split_k = kernels[0].get(key, []), kernels[1].get(key, [])
            row["kernels_batched"] = "; ".join(batched_k)
            row["kernels_split"] = "; ".join(split_k)
            row["kernels_differ"] = sorted(set(batched_k)) != sorted(set(split_k))

    rows = _insert_missing(rows, sites, split)
    columns = list(COLUMNS)
    for option in ("local", "truth", "repeat", "kernels"):
        if meta.get(option):
            columns += EXPLAIN_COLUMNS[option]
    table = pd.DataFrame(rows, columns=[c for c in columns if c != "growth"])
    table["numel"] = table["numel"].astype("Int64")
    table["nonfinite"] = table["nonfinite"].astype("Int64")
    table.insert(columns.index("growth"), "growth", _growth(table))
    table["role"] = table["role"].fillna("")
    sample_table = pd.DataFrame(
        sample_rows, columns=["site", "sample", "mismatch", "rel_l2", "max_abs"])
    pairs: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {
        s.site.key: (s.kept, split.refs[s.site.key].rows) for s in sites if s.kept is not None}
    return Comparison(table, sample_table, meta | {"flips": flips}, pairs)


def _explain(row: dict[str, Any], calls: dict[str, Call],
             by_key: dict[str, tuple[np.ndarray, int]], host: _Host,
             at_inputs: dict[int, int | None], at_local: dict[tuple[str, str], int | None],
             batch: int, n_samples: int) -> None:
    """Input lineage, role, local error and amplification of one row (leaf sites)."""
    row["input_mismatch"], row["role"] = math.nan, ""
    call = calls.get(site_key(row["module"], row["call"], ""))
    if not row["leaf"] or call is None:
        return
    parts: list[tuple[np.ndarray, int]] = []
    known = True
    for kind, key, measured in call.inputs:
        if kind == "site" and key == INPUT:
            continue  # the model's own input: the same rows in both runs
        if kind == "site" and key in by_key:
            parts.append(by_key[key])
        elif kind == "input" and measured is not None and measured.stats is not None:
            array = host[at_inputs[id(measured)]]
            assert array is not None
            parts.append((array, int(np.prod(measured.shape)) // batch * n_samples))
        else:
            known = False
    figures = _sums(parts) if known else None
    row["input_mismatch"] = figures["mismatch"] if figures else math.nan
    if row["status"] == "ok":
        if row["mismatch"] == 0:
            row["role"] = "clean"
        elif figures is None:
            row["role"] = "unknown"
        else:
            row["role"] = "source" if figures["mismatch"] == 0 else "carrier"
    local = host[at_local.get((site_key(row["module"], row["call"], ""), row["site"]))]
    row["local_status"] = call.local_status
    if local is not None:
        mine = _sums([(local, 1)])
        row["local_rel_l2"] = rel_l2(mine["diff"], mine["ref"])
        row["local_max_abs"] = float(local[:, _COL["max_abs"]].max())
    own = by_key.get(row["site"])
    if own is not None and figures is not None:
        out = _sums([own])["diff"]
        row["amplification"] = (out / figures["diff"] if figures["diff"] > 0
                                else (math.inf if out > 0 else math.nan))


def _insert_missing(rows: list[dict[str, Any]], sites: list[Measured],
                    split: SplitRecording) -> list[dict[str, Any]]:
    """Adds the sites that the split run reached and the batched run did not."""
    seen = {s.site.key for s in sites}
    order = [key for key in split.refs if "<in" not in key]
    for i, key in enumerate(order):
        if key in seen:
            continue
        ref = split.refs[key]
        missing = Measured(ref.site, "missing_in_batched", ref.shape, ref.dtype)
        before = next((k for k in reversed(order[:i]) if k in seen), None)
        at = 0 if before is None else 1 + next(
            j for j, r in enumerate(rows) if r["site"] == before)
        rows.insert(at, _row(missing) | dict.fromkeys(_FIGURES, math.nan) | {"role": ""})
        seen.add(key)
    return rows


def _growth(table: pd.DataFrame) -> pd.Series:
    """rel_l2 over that of the nearest preceding divergent leaf site (NaN if none)."""
    growth = []
    previous = math.nan
    for rel, leaf, mismatch in zip(table["rel_l2"], table["leaf"], table["mismatch"],
                                   strict=True):
        growth.append(rel / previous if previous > 0 else math.nan)
        if leaf and mismatch > 0 and rel > 0:
            previous = rel
    return pd.Series(growth, index=table.index, dtype=float)
