"""Prompts of different lengths (``divtrace.Prompts``): padded in the batch, alone in the
split run, compared on each prompt's real tokens only."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import divtrace
from divtrace.plan.prompts import pad
from tests.models import tiny_llama

transformers = pytest.importorskip("transformers")


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100,
                                     n_positions=64, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config).eval()


def some_prompts(*lengths: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(1, 100, (n,), generator=generator) for n in lengths]


def expected_logits(model: nn.Module, prompts: divtrace.Prompts
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per prompt: its real tokens' logits in the padded batch, and alone."""
    inputs, layout = pad(prompts, 0, len(prompts))
    with torch.no_grad():
        batched = model(**inputs).logits
        alone = [model(**pad(prompts, i, i + 1)[0]).logits[0] for i in range(len(prompts))]
    cut = [batched[i, off:off + n] for i, (off, n) in
           enumerate(zip(layout.offsets, layout.valid, strict=True))]
    return cut, alone


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_the_output_is_compared_on_real_tokens(side: str, build: object) -> None:
    model = build()  # type: ignore[operator]
    prompts = divtrace.Prompts(some_prompts(5, 9, 1, 7), padding_side=side)
    result = divtrace.compare(model, prompts, progress=False)
    out = result.output
    assert out is not None
    assert out["status"] == "ok"
    batched, alone = expected_logits(model, prompts)
    b, a = torch.cat([t.flatten() for t in batched]), torch.cat([t.flatten() for t in alone])
    assert out["numel"] == (5 + 9 + 1 + 7) * 100
    assert out["mismatch"] == (b != a).double().mean().item()
    diff = (b.double() - a.double()).norm() / a.double().norm()
    assert out["rel_l2"] == pytest.approx(diff.item(), rel=1e-9, abs=1e-30)
    samples = result.per_sample
    last = samples[samples["site"] == out["site"]].set_index("sample")
    for i in range(4):
        expected = (batched[i] != alone[i]).double().mean().item()
        assert last.loc[i, "mismatch"] == expected


class Masked(nn.Module):
    """Embeds, then writes a huge value at every padded position: if padding were compared,
    every site would differ."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.scale = nn.Linear(16, 16, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) * 2.0
        x = torch.where(attention_mask[..., None] > 0, x, torch.full_like(x, 1e6))
        return torch.tanh(x) + position_ids[..., None]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_is_never_compared(side: str) -> None:
    prompts = divtrace.Prompts(some_prompts(3, 8, 1), padding_side=side)
    result = divtrace.compare(Masked().eval(), prompts, ops=True, progress=False)
    table = result.table
    compared = table[table["status"] == "ok"]
    assert len(compared) >= 5
    assert (compared["mismatch"] == 0).all()
    assert result.verdict == "identical"
    assert table.set_index("site").loc["(model)", "numel"] == (3 + 8 + 1) * 16


def test_chunks_of_prompts_are_padded_among_themselves() -> None:
    model = tiny_llama()
    prompts = divtrace.Prompts(some_prompts(4, 6, 2, 5))
    result = divtrace.compare(model, prompts, a=divtrace.Run(chunk=2), samples=[1, 2],
                              progress=False)
    out = result.output
    assert out is not None
    assert out["numel"] == (6 + 2) * 100
    inputs, layout = pad(prompts, 0, 4)
    first, first_layout = pad(prompts, 0, 2)
    second, second_layout = pad(prompts, 2, 4)
    with torch.no_grad():
        batched = model(**inputs).logits
        split_first = model(**first).logits
        split_second = model(**second).logits
    b = torch.cat([batched[1, layout.offsets[1]:], batched[2, layout.offsets[2]:]])
    s = torch.cat([split_first[1, first_layout.offsets[1]:],  # prompt 1: row 1 of 0:2
                   split_second[0, second_layout.offsets[0]:]])  # prompt 2: row 0 of 2:4
    assert out["mismatch"] == (b != s).double().mean().item()


def test_op_sites_with_prompts() -> None:
    result = divtrace.compare(tiny_llama(), divtrace.Prompts(some_prompts(3, 6)), ops=True,
                              progress=False)
    table = result.table
    ops = table[table["op"] != ""]
    bmm = ops[ops["site"].str.contains("self_attn:aten.bmm")]
    assert not bmm.empty
    assert (bmm["status"] == "ok").all()
    # attention scores: heads x real queries x real keys per prompt
    assert bmm.iloc[0]["numel"] == 4 * (3 * 3 + 6 * 6)


def test_prompts_are_validated() -> None:
    model = tiny_llama()
    prompts = divtrace.Prompts(some_prompts(3, 4))
    with pytest.raises(divtrace.DivtraceValueError, match="run b must take the whole"):
        divtrace.compare(model, divtrace.Prompts(some_prompts(3, 4, 5)), b=divtrace.Run(chunk=2),
                         progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="batch_dim"):
        divtrace.compare(model, prompts, batch_dim=1, progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match=r"prompts\[1\] must be a 1-D"):
        divtrace.Prompts([torch.tensor([1, 2]), torch.ones(2, 2, dtype=torch.long)])
    with pytest.raises(divtrace.DivtraceValueError, match=r"prompts\[0\] is empty"):
        divtrace.Prompts([torch.tensor([], dtype=torch.long)])
    with pytest.raises(divtrace.DivtraceTypeError, match="list of 1-D token-id tensors"):
        divtrace.Prompts(torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(divtrace.DivtraceValueError, match="padding_side"):
        divtrace.Prompts(some_prompts(2), padding_side="middle")


def test_a_pooled_output_is_compared_whole() -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64,
                                     vocab_size=100, attn_implementation="eager")
    bert = transformers.BertModel(config).eval()
    prompts = divtrace.Prompts(some_prompts(4, 7, 2), padding_side="right",
                               position_ids=False)
    table = divtrace.compare(bert, prompts, progress=False).table.set_index("site")
    assert table.loc["pooler", "status"] == "ok"
    assert table.loc["pooler", "numel"] == 3 * 32
    assert not math.isnan(table.loc["pooler", "rel_l2"])


def test_an_axis_as_long_as_the_padded_batch_by_chance_stays_whole() -> None:
    class HeadSized(nn.Module):
        """A [batch, tokens, 8] output, and a [batch, 8] one whose 8 is no token axis."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(100, 8)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = self.embed(input_ids)
            return x, x.sum(1)

    prompts = divtrace.Prompts(some_prompts(8, 3))  # padded length 8 == the hidden size
    table = divtrace.compare(HeadSized().eval(), prompts, progress=False).table
    table = table.set_index("site")
    assert table.loc["(model)/0", "status"] == "ok"
    assert table.loc["(model)/0", "numel"] == (8 + 3) * 8
    assert table.loc["(model)/1", "status"] == "ok"
    assert table.loc["(model)/1", "numel"] == 2 * 8


@pytest.mark.parametrize("ops", [False, True])
def test_local_replays_on_each_prompts_real_tokens(ops: bool) -> None:
    result = divtrace.compare(tiny_llama(), divtrace.Prompts(some_prompts(5, 9, 2)),
                              explain=["local"], ops=ops, progress=False)
    table = result.table
    leaves = table[table["leaf"] & (table["status"] == "ok")]
    assert (leaves["local_status"] == "ok").all()
    sources = leaves[leaves["role"] == "source"]
    assert not sources.empty
    # a source's input is the same in both runs: replayed, it gives its own divergence
    for row in sources.itertuples():
        assert row.local_rel_l2 == pytest.approx(row.rel_l2, rel=1e-12, abs=0)
    carriers = leaves[leaves["role"] == "carrier"]
    assert (carriers["local_rel_l2"] < carriers["rel_l2"] * 10).all()


def test_kept_rows_and_repeats_with_prompts() -> None:
    model = tiny_llama()
    prompts = divtrace.Prompts(some_prompts(4, 7, 2))
    result = divtrace.compare(model, prompts, explain=[divtrace.Repeat(1)],
                              resources=divtrace.Resources(keep=True), progress=False)
    batched, alone = expected_logits(model, prompts)
    kept_s, kept_b = result.pair("(model)/logits")
    torch.testing.assert_close(kept_b, torch.cat([t.flatten() for t in batched]), rtol=0,
                               atol=0)
    torch.testing.assert_close(kept_s, torch.cat([t.flatten() for t in alone]), rtol=0,
                               atol=0)
    table = result.table
    ok = table[table["status"] == "ok"]
    assert (ok["noise_mismatch"] == 0).all()  # the CPU repeats itself exactly
    assert "Repeating the batched run" in result.summary()


def test_float64_truth_with_prompts() -> None:
    model = tiny_llama()
    prompts = divtrace.Prompts(some_prompts(6, 3, 8))
    result = divtrace.compare(model, prompts, explain=["fp64"], samples=[0, 2], progress=False)
    out = result.output
    assert out is not None
    exact_model = copy.deepcopy(model).double()
    with torch.no_grad():  # each prompt alone, as the truth run does
        truth = torch.cat([exact_model(**pad(prompts, i, i + 1)[0]).logits.flatten()
                           for i in (0, 2)])
    batched, alone = expected_logits(model, prompts)
    b = torch.cat([batched[0].flatten(), batched[2].flatten()]).double()
    a = torch.cat([alone[0].flatten(), alone[2].flatten()]).double()
    norm = truth.norm()
    assert out["b_err_fp64"] == pytest.approx(((b - truth).norm() / norm).item(),
                                                    rel=1e-9)
    assert out["a_err_fp64"] == pytest.approx(((a - truth).norm() / norm).item(),
                                                  rel=1e-9)
