"""The independence test: the verdict rests on whether a sample's rows move when only the
other samples change, not on the size of the error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import divtrace
from divtrace.plan.inputs import prepare_input
from tests import models


def run(model: nn.Module, x: object, **kwargs: object) -> divtrace.Comparison:
    return divtrace.compare(model, x, progress=False, **kwargs)


class Mix(nn.Module):
    """A real bug, as small as you like: other samples leak in through the batch mean."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.eps * x.mean(0, keepdim=True)


def planted(eps: float) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(models.OrderedLinear(16, 64), nn.ReLU(), Mix(eps),
                         nn.Linear(64, 8)).eval()


def dependent(result: divtrace.Comparison) -> list[str]:
    table = result.table
    return list(table.loc[table["depends_on_others"].astype("boolean").fillna(False)
                          .astype(bool), "site"])


@pytest.mark.parametrize("eps", [1.0, 1e-4, 1e-6])
@pytest.mark.parametrize("options", [{}, {"a": divtrace.Run(chunk=2)}, {"samples": [0, 5]}],
                         ids=["all", "chunk2", "two-samples"])
def test_planted_mixing_is_not_rounding_whatever_its_size(eps: float, options: dict) -> None:
    result = run(planted(eps), torch.randn(16, 16), **options)
    assert result.verdict == "not rounding"
    first = result.summary().splitlines()[0]
    assert "batch mixing: at '2' (Mix)" in first
    assert dependent(result)[0] == "2"
    table = result.table.set_index("site")
    assert not table.loc[["0", "1"], "depends_on_others"].any()  # before the mixing
    assert table.loc["2", "others_rel_l2"] > 0


def test_without_mixing_the_verdict_is_rounding_and_says_why() -> None:
    result = run(models.variant_mlp(), torch.randn(8, 16))
    assert result.first_divergence is not None
    assert result.verdict == "rounding"
    table = result.table
    assert table["depends_on_others"].dtype == "boolean"
    assert not table["depends_on_others"].any()
    assert table["depends_on_others"].notna().all()
    assert (table["others_rel_l2"] == 0).all()
    summary = result.summary()
    assert "No compared row moved when only the other samples changed (independence test)" in (
        summary.splitlines()[0])
    assert ("Independence test (5 more batched passes, the compared samples held in 5 "
            "groups, so that each one was held, at least once, while any other one was "
            "replaced") in summary
    assert result.meta.notes["independence"]["passes"] == 5


def test_some_samples_are_held_in_one_pass() -> None:
    calls: list[int] = []
    model = models.variant_mlp()
    handle = model.register_forward_hook(lambda m, a, o: calls.append(o.shape[0]))
    try:
        result = run(model, torch.randn(8, 16), samples=[1, 2], explain=["-precision"])
    finally:
        handle.remove()
    # the split run's two passes, batched, then each sample held while the other changes
    assert calls == [1, 1, 8, 8, 8]
    assert "the compared samples held in 2 groups" in result.summary()


def test_leaving_it_out_says_the_verdict_rests_on_the_size() -> None:
    result = run(models.variant_mlp(), torch.randn(8, 16), explain=["-independence"])
    assert "depends_on_others" not in result.table
    assert result.verdict == "rounding"  # the precision test still ran
    assert ("but the independence test did not run: a dependence on the other samples' "
            "values is not ruled out") in result.summary().splitlines()[0]
    neither = run(models.variant_mlp(), torch.randn(8, 16),
                  explain=["-independence", "-precision"])
    assert neither.verdict == "rounding"
    assert "rests on the size of the error alone" in neither.summary().splitlines()[0]
    with pytest.raises(divtrace.DivtraceTypeError, match="explain= takes probe names"):
        run(models.variant_mlp(), torch.randn(8, 16), explain=[True])
    with pytest.raises(divtrace.DivtraceValueError, match="no probe 'yes'; the probes are "
                       "independence, precision, local, fp64, repeat, kernels, observer"):
        run(models.variant_mlp(), torch.randn(8, 16), explain="yes")


def test_a_chunked_run_b_is_not_tested_and_that_is_said() -> None:
    result = run(models.variant_mlp(), torch.randn(8, 16), a=divtrace.Run(chunk=1),
                 b=divtrace.Run(chunk=4))
    assert "The independence test did not run: run b takes the batch in chunks" in (
        result.summary())
    assert "a dependence on the other samples' values is not ruled out" in (
        result.summary().splitlines()[0])


def test_nondeterminism_makes_it_inconclusive_never_a_guess() -> None:
    model = nn.Sequential(models.OrderedLinear(16, 16), models.Noisy(), nn.Linear(16, 4))
    result = run(model.eval(), torch.randn(8, 16))
    table = result.table.set_index("site")
    assert table.loc["1", "depends_on_others"] is pd_na()
    assert not table.loc["0", "depends_on_others"]
    summary = result.summary()
    assert "inconclusive from '1' on" in summary
    assert "batch mixing" not in summary
    assert "not a bug" not in summary.splitlines()[0]


def pd_na() -> object:
    import pandas as pd

    return pd.NA


def test_train_mode_batchnorm_is_named_where_samples_mix() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()).train()
    result = run(model, torch.randn(6, 3, 8, 8), allow_train=True)
    first = result.summary().splitlines()[0]
    assert first.startswith("Verdict: not rounding — the model ran in train mode")
    assert "first depend on the other samples at '1' (BatchNorm2d)" in first
    assert dependent(result)[0] == "1"


def test_an_lstm_cut_along_time_mixes_at_the_lstm() -> None:
    torch.manual_seed(0)
    result = run(nn.LSTM(4, 5).eval(), torch.randn(7, 3, 4))  # (T, B, F), batch_dim=0
    assert result.verdict == "not rounding"
    assert dependent(result)[0] == "(model)/0"
    assert "batch mixing: at '(model)/0' (LSTM)" in result.summary().splitlines()[0]


def test_a_padding_mask_in_a_transformer_encoder_is_no_mixing() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(6, 5, 16)
    mask = torch.zeros(6, 5, dtype=torch.bool)
    mask[::2, 3:] = True  # padding at the end of every other sequence
    result = run(model, {"src": x, "src_key_padding_mask": mask})
    assert result.meta.notes["independence"]["ran"]
    assert dependent(result) == []
    assert result.verdict in ("rounding", "identical")


def test_op_sites_name_the_batch_statistic_behind_the_mixing() -> None:
    result = run(planted(1e-4), torch.randn(8, 16), ops=True)
    first = result.summary().splitlines()[0]
    assert "batch mixing" in first
    assert "aten.mean" in first  # the op over the batch, which has no rows per sample


# -- the replaced input ------------------------------------------------------------------


def test_the_replaced_batch_keeps_the_held_rows_and_changes_the_others() -> None:
    x = torch.randn(6, 3)
    ids = torch.randint(2, 50, (6, 4))
    mask = torch.ones(6, 4, dtype=torch.long)
    mask[1, 2:] = 0
    batch = prepare_input({"x": x, "ids": ids, "mask": mask})
    replaced, unchanged = batch.replaced([0, 3])
    new = dict(zip(("x", "ids", "mask"), replaced.leaves, strict=True))
    assert unchanged == []
    for held in (0, 3):
        assert torch.equal(new["x"][held], x[held])
        assert torch.equal(new["ids"][held], ids[held])
    for other in (1, 2, 4, 5):
        assert not torch.equal(new["x"][other], x[other])
    assert torch.equal(new["mask"], mask)  # masks stay: the same code path
    assert new["ids"].min() >= ids.min()
    assert new["ids"].max() <= ids.max()
    assert x.shape == new["x"].shape


def test_samples_that_are_all_alike_are_shifted_and_masks_alone_cannot_be() -> None:
    x = torch.ones(4, 3)
    replaced, unchanged = prepare_input(x).replaced([0])
    assert unchanged == []
    assert torch.equal(replaced.leaves[0][1:], x[1:] + 1)
    _, unchanged = prepare_input(torch.ones(4, 3, dtype=torch.bool)).replaced([0])
    assert unchanged == [1, 2, 3]


def test_the_groups_replaced_in_turn_are_each_groups_alone_after_one_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every group's batch, made as asked for after one read of all their flags, is the
    one ``replaced`` makes for that group alone: held rows, masks, a tensor given twice,
    rows all alike (shifted, read again) and a batch of only masks."""
    from divtrace.plan import replace

    x = torch.randn(6, 3)
    x[4] = x[0]  # row 4 takes row 0's values where 0 is held: equal still, shifted
    ids = torch.randint(2, 50, (6, 4))
    mask = torch.ones(6, 4, dtype=torch.long)
    mask[1, 2:] = 0
    groups = [[0, 3], [1], [0, 2, 5], list(range(6))]
    reads: list[int] = []
    read = replace._read

    def counted(flags: list[torch.Tensor]) -> list[list[bool]]:
        reads.append(1)
        return read(flags)

    for given in ({"x": x, "ids": ids, "mask": mask, "again": x}, torch.ones(6, 3),
                  torch.ones(6, 2, dtype=torch.bool)):
        batch = prepare_input(given)
        alone = [batch.replaced(group) for group in groups]
        reads.clear()
        monkeypatch.setattr(replace, "_read", counted)
        made = list(batch.replacements(groups))
        monkeypatch.setattr(replace, "_read", read)
        for (one, unchanged), (other, left) in zip(made, alone, strict=True):
            assert unchanged == left
            assert all(torch.equal(a, b) for a, b in zip(one.leaves, other.leaves,
                                                         strict=True))
        shifted = sum(1 for other, _ in alone if other is not batch and torch.equal(
            other.leaves[0][4], batch.leaves[0][4] + 1))  # (rows made equal, read again)
        assert len(reads) == 1 + shifted, (reads, shifted)
    assert made[0][1] == [1, 2, 4, 5]  # only masks: nothing could be made to differ


def test_the_tests_passes_wait_for_the_device_once_for_every_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from divtrace.plan import replace

    reads = []
    read = replace._read
    monkeypatch.setattr(replace, "_read", lambda flags: reads.append(1) or read(flags))
    x = torch.randn(8, 16)
    result = run(models.variant_mlp(), x, explain=["-precision"])
    assert result.meta.notes["independence"]["groups"] == 5
    assert len(reads) == 1, reads
    assert not dependent(result)
    reads.clear()  # where rows moved, each moving group's batch is made again, alone
    result = run(planted(1e-4), x, explain=["-precision"])
    assert dependent(result)
    assert len(reads) == 1 + 5, reads


def test_prompts_keep_their_lengths_and_masks() -> None:
    prompts = divtrace.Prompts([torch.tensor([5, 6, 7]), torch.tensor([8]),
                                torch.tensor([9, 9])])
    from divtrace.plan.prompts import ragged_input

    batch = ragged_input(prompts)
    replaced, unchanged = batch.replaced([0])
    assert unchanged == []
    assert replaced.source.lengths == prompts.lengths
    assert torch.equal(replaced.source.prompts[0], prompts.prompts[0])
    assert not torch.equal(replaced.source.prompts[1], prompts.prompts[1])
    old, new = batch.rows(0, 3)[1], replaced.rows(0, 3)[1]
    assert torch.equal(old["attention_mask"], new["attention_mask"])
    assert torch.equal(old["position_ids"], new["position_ids"])


def _hf(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "bert":
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=64,
                                         vocab_size=100, attn_implementation="eager")
        return transformers.BertModel(config).eval()
    if name == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100,
                                         n_positions=32, attn_implementation="eager")
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100,
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_language_models_with_padding_do_not_mix(name: str) -> None:
    model = _hf(name)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (4, 9), generator=generator)
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding in two of the four rows
    mask[3, :5] = 0
    result = run(model, {"input_ids": ids, "attention_mask": mask})
    assert result.meta.notes["independence"]["ran"]
    assert dependent(result) == []
    assert result.verdict in ("rounding", "identical")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_prompts_do_not_mix(name: str) -> None:
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 100, (n,), generator=generator) for n in (5, 9, 3, 7)]
    result = run(_hf(name), divtrace.Prompts(prompts))
    assert result.meta.notes["independence"]["ran"]
    assert dependent(result) == []
    assert result.verdict in ("rounding", "identical")


# -- fingerprints, and how far the rows moved ----------------------------------------


def test_the_default_keeps_fingerprints_not_the_rows() -> None:
    from divtrace.assembly import parts_for
    from divtrace.plan.make import make_plan

    model, x = planted(1e-4), torch.randn(8, 16)
    plan = make_plan(model, x, progress=False)
    parts = parts_for(plan, model)
    assert parts.prints_batched
    assert not parts.keeps_batched(plan)
    plan = make_plan(model, x, progress=False, explain=["-independence"])
    assert not parts_for(plan, model).prints_batched


def test_how_far_the_rows_moved_is_measured_against_the_rows_themselves() -> None:
    model, x = planted(1e-4), torch.randn(16, 16)
    result = run(model, x, samples=[0, 5])
    upto = model[:3]  # the mixing layer's output, in both passes
    moves = []
    for held in ([0], [5]):  # each sample held while the other one is replaced
        replaced, _ = prepare_input(x).replaced(held)
        with torch.no_grad():
            before, after = upto(x)[held], upto(replaced.leaves[0])[held]
        moves.append(((after - before).double().norm() / before.double().norm()).item())
    assert result.table.set_index("site").loc["2", "others_rel_l2"] == pytest.approx(
        max(moves), rel=1e-6)
    # the two held groups, the repetition, each group sized
    assert result.meta.notes["independence"]["passes"] == 5


class MixingLM(nn.Module):
    """A language model whose hidden states take in the mean over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.mix = Mix(1e-3)
        self.head = nn.Linear(16, 100)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed(input_ids) * attention_mask[..., None]
        return self.head(self.mix(hidden))


def test_prompts_that_mix_are_caught_at_the_mixing_layer() -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 100, (n,), generator=generator) for n in (5, 9, 3, 7)]
    result = run(MixingLM().eval(), divtrace.Prompts(prompts))
    assert dependent(result)[0] == "mix"
    table = result.table.set_index("site")
    assert not table.loc["embed", "depends_on_others"]
    assert table.loc["mix", "others_rel_l2"] > 0
    assert result.verdict == "not rounding"


class SignOfZero(nn.Module):
    """Zeros whose sign follows the batch mean: the bits move, the values do not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x) * x.mean(0, keepdim=True)


def test_a_zero_whose_sign_follows_the_others_is_no_dependence() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), SignOfZero(), nn.Linear(16, 4)).eval()
    x = torch.randn(8, 16)
    replaced, _ = prepare_input(x).replaced(list(range(4)))
    with torch.no_grad():  # the bits of the held rows do move
        before, after = model[:2](x)[:4], model[:2](replaced.leaves[0])[:4]
    assert torch.equal(before, after)
    assert not torch.equal(before.view(torch.int32), after.view(torch.int32))
    result = run(model, x)
    assert dependent(result) == []
    # five held groups, then the repetition and each group sized
    assert result.meta.notes["independence"]["passes"] == 11
