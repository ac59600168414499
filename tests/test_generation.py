"""``compare_generate()``: greedy decoding in a batch and alone, step by step."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import divtrace
from divtrace.plan.prompts import pad

transformers = pytest.importorskip("transformers")


def tiny(kind: str = "llama") -> nn.Module:
    torch.manual_seed(0)
    if kind in ("qwen2", "mistral"):
        names = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                 "mistral": ("MistralConfig", "MistralForCausalLM")}[kind]
        config = getattr(transformers, names[0])(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, attn_implementation="eager")
        return getattr(transformers, names[1])(config).eval()
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100,
                                         n_positions=128, attn_implementation="eager")
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, attn_implementation="eager")
    return transformers.LlamaForCausalLM(config).eval()


def some_prompts(*lengths: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(sum(lengths) + len(lengths))
    return [torch.randint(3, 100, (n,), generator=generator) for n in lengths]


def generated(model: nn.Module, found: divtrace.Generation, start: int, stop: int
              ) -> torch.Tensor:
    inputs, layout = pad(found.prompts, start, stop)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=found.new_tokens, do_sample=False,
                             **found.settings)
    return out[:, layout.length:]


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2", "mistral"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_tokens_are_those_of_generate(kind: str, side: str) -> None:
    model = tiny(kind)
    found = divtrace.compare_generate(model, some_prompts(4, 9, 1, 6), max_new_tokens=5,
                                      padding_side=side, eos_token_id=None, progress=False)
    table = found.table
    assert len(table) == 4 * 5
    batched = generated(model, found, 0, 4)
    for prompt in range(4):
        mine = table[table["prompt"] == prompt].sort_values("step")
        assert list(mine["token_batched"]) == batched[prompt].tolist()
        alone = generated(model, found, prompt, prompt + 1)[0]
        assert list(mine["token_split"]) == alone.tolist()
    assert table["logits_rel_l2"].notna().all()
    assert (table["margin"] >= 0).all()


def test_one_token_and_a_prompt_of_length_one() -> None:
    found = divtrace.compare_generate(tiny(), some_prompts(1, 3), max_new_tokens=1,
                                      eos_token_id=None, progress=False)
    assert list(found.table["step"]) == [0, 0]
    first = found.per_prompt
    assert list(first["length"]) == [1, 3]
    assert list(first["steps"]) == [1, 1]
    comparison = found.at(0)
    assert comparison.table.set_index("site").loc["model.embed_tokens", "numel"] == 4 * 64


def test_a_prompt_that_ends_is_compared_up_to_its_end() -> None:
    model = tiny()
    free = divtrace.compare_generate(model, some_prompts(5, 7), max_new_tokens=6,
                                     eos_token_id=None, progress=False)
    first_token = int(free.table.query("prompt == 0 and step == 2")["token_split"].iloc[0])
    ended = divtrace.compare_generate(model, some_prompts(5, 7), max_new_tokens=6,
                                      eos_token_id=first_token, progress=False)
    steps = ended.table[ended.table["prompt"] == 0]["step"]
    assert steps.max() <= 2


def test_a_decode_step_is_compared_on_real_positions() -> None:
    found = divtrace.compare_generate(tiny(), some_prompts(3, 8, 5), max_new_tokens=4,
                                      eos_token_id=None, progress=False)
    table = found.at(2).table.set_index("site")
    assert table.loc["model.layers.0.self_attn.q_proj", "shape"] == "(3, 1, 64)"
    # attention weights: 4 heads × (prompt + 2 generated + the current token) keys
    assert table.loc["model.layers.0.self_attn/1", "numel"] == 4 * ((3 + 2) + (8 + 2) + (5 + 2))
    assert not any("past_key" in site for site in table.index)
    assert (table["status"] == "ok").all()


def test_prompts_that_parted_earlier_are_left_out() -> None:
    found = divtrace.compare_generate(tiny(), some_prompts(3, 6, 4), max_new_tokens=4,
                                      eos_token_id=None, progress=False)
    table = found.table.copy()
    later = (table["prompt"] == 1) & (table["step"] >= 2)
    table.loc[(table["prompt"] == 1) & (table["step"] == 1), "same_token"] = False
    table.loc[later, "same_prefix"] = False
    parted = replace(found, table=table)
    assert parted.per_prompt.set_index("prompt").loc[1, "first_token_split"] == 1
    with pytest.warns(divtrace.DivtraceWarning, match=r"prompts \[1\] are left out"):
        comparison = parted.at(2)
    assert comparison.meta.samples == (0, 2)
    assert "1 of 3 prompts generated other tokens" in parted.summary()


def test_generation_arguments_are_checked() -> None:
    with pytest.raises(divtrace.DivtraceTypeError, match="generate"):
        divtrace.compare_generate(nn.Linear(2, 2), some_prompts(2), progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="max_new_tokens"):
        divtrace.compare_generate(tiny(), some_prompts(2, 3), max_new_tokens=0,
                                  progress=False)
    found = divtrace.compare_generate(tiny(), some_prompts(2, 3), max_new_tokens=2,
                                      progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="step must be"):
        found.at(2)
    model = tiny().train()
    with pytest.raises(divtrace.DivtraceValueError, match="train mode"):
        divtrace.compare_generate(model, some_prompts(2, 3), progress=False)


def test_the_generation_plot_and_words(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    found = divtrace.compare_generate(tiny(), some_prompts(3, 6, 4), max_new_tokens=5,
                                      eos_token_id=None, progress=False)
    ax = found.plot()
    assert ax.get_xlabel().startswith("generation step")
    assert len(ax.get_yticklabels()) == 3
    assert "Greedy decoding of 3 prompt(s)" in found.summary()
    assert "divtrace generation" in found._repr_html_()
    assert "3 prompts" in repr(found)
    page = found.to_html(tmp_path / "generation.html").read_text()
    assert "data:image/png;base64," in page
    assert page.count("<tr") > len(found.table)


def test_a_rerun_that_does_not_repeat_itself_is_said() -> None:
    found = divtrace.compare_generate(tiny(), some_prompts(3, 6), max_new_tokens=4,
                                      eos_token_id=None, progress=False)
    table = found.table.copy()
    table.loc[(table["prompt"] == 1) & (table["step"] == 0), ["token_batched",
                                                                "token_split"]] = -1
    other = replace(found, table=table)  # as if the first run had made other tokens
    with pytest.warns(divtrace.DivtraceWarning, match=r"did not repeat itself.*\[1\]"):
        other.at(2)


def test_the_step_figures_are_the_measure_layers() -> None:
    from divtrace.generate.decode import Decoded, token_table

    split = torch.tensor([[1.0, 2.0, float("nan"), 4.0], [0.0, 0.0, 0.0, 0.0]])
    batched = torch.tensor([[1.0, 2.5, float("nan"), 4.0], [0.0, 0.0, 0.0, 0.0]])
    table = token_table(Decoded({0: torch.tensor([3, 0])}, {0: batched}),
                        Decoded({0: torch.tensor([3, 0])}, {0: split}), [0])
    first, second = table.iloc[0], table.iloc[1]
    assert first["logits_mismatch"] == 0.25  # NaN against NaN is no mismatch, as at a site
    assert first["logits_max_abs"] == 0.5
    finite = torch.tensor([1.0, 2.0, 4.0]).double()
    assert first["logits_rel_l2"] == pytest.approx(0.5 / float(finite.norm()), rel=1e-12)
    assert (second["logits_mismatch"], second["logits_rel_l2"]) == (0.0, 0.0)
