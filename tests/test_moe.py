"""Mixture of experts: the router and the experts read per token, the routing flips found
and judged (``explain/routing.py``), each against the router's outputs read by hand."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import divtrace
from divtrace.plan.prompts import pad
from tests import models

LENGTHS = (5, 9, 12, 7, 16, 3)


def _tiny(kind: str, attention: str) -> nn.Module:
    """A random-init two-layer Mixtral, Qwen2-MoE or Qwen3-MoE (its four experts' router
    rows made nearly alike by :func:`_near_ties`)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    shared = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
              "num_experts_per_tok": 2, "attn_implementation": attention}
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(num_local_experts=4, **shared))
    elif kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_experts=4, moe_intermediate_size=32, **shared))
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            **shared))
    return model.eval()


def _near_ties(model: nn.Module, spread: float) -> nn.Module:
    with torch.no_grad():
        for layer in model.model.layers:
            weight = layer.mlp.gate.weight
            weight.copy_(weight[0] * (1 + spread * torch.randn_like(weight)))
    return model


def _prompts() -> divtrace.Prompts:
    generator = torch.Generator().manual_seed(0)
    return divtrace.Prompts([torch.randint(0, 100, (n,), generator=generator)
                             for n in LENGTHS])


def _gates(model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[tuple[Any, Any]]:
    """By hand: each router's (logits, chosen experts) over the pass's flattened tokens."""
    found: list[tuple[Any, Any]] = []
    handles = [layer.mlp.gate.register_forward_hook(
        lambda _m, _a, out: found.append((out[0].detach().clone(), out[2].clone())))
        for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return found


def _flips_by_hand(model: nn.Module, prompts: divtrace.Prompts, margin: Any = None
                   ) -> list[list[tuple[Any, ...]]]:
    """Per router: (prompt, token, margin alone, margin batched) of each token whose set
    of experts differs between the padded batch and the prompt alone."""
    margin = margin or _margin
    inputs, layout = pad(prompts, 0, len(prompts))
    batched = _gates(model, inputs)
    length = inputs["input_ids"].shape[1]
    found: list[list[tuple[Any, ...]]] = [[] for _ in batched]
    for sample, prompt in enumerate(prompts.prompts):
        alone = _gates(model, pad(prompts, sample, sample + 1)[0])
        start = sample * length + layout.offsets[sample]
        for router, ((logits_b, chosen_b), (logits_a, chosen_a)) in enumerate(
                zip(batched, alone, strict=True)):
            rows_b = slice(start, start + prompt.numel())
            for token in range(prompt.numel()):
                a, b = chosen_a[token].sort().values, chosen_b[rows_b][token].sort().values
                if not torch.equal(a, b):
                    found[router].append((sample, token, margin(logits_a[token]),
                                          margin(logits_b[rows_b][token])))
    return found


def _margin(logits: torch.Tensor, k: int = 2) -> float:
    ranked = torch.softmax(logits.float(), -1).double().sort(descending=True).values
    return float(ranked[k - 1] - ranked[k])


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize(("dtype", "attention"), [(torch.float32, "eager"),
                                                  (torch.bfloat16, "sdpa")],
                         ids=["fp32", "bf16"])
def test_every_routing_flip_is_found_as_the_router_read_by_hand_says(
        kind: str, dtype: torch.dtype, attention: str) -> None:
    spread = 1e-7 if dtype == torch.float32 else 1e-3
    model = _near_ties(_tiny(kind, attention), spread).to(dtype)
    prompts = _prompts()
    result = divtrace.compare(model, prompts, progress=False)
    routers = result.meta.notes["routing"]["routers"]
    by_hand = _flips_by_hand(model, prompts)
    assert list(routers) == [f"model.layers.{i}.mlp.gate" for i in range(2)]
    assert sum(len(flips) for flips in by_hand) > 0  # the planted near ties do flip
    for router, flips in zip(routers.values(), by_hand, strict=True):
        assert router["tokens"] == sum(LENGTHS)
        assert router["flips"] == len(flips)
        found = [(f["sample"], f["token"], f["margin_a"], f["margin_b"])
                 for f in router["flipped"]]
        assert [f[:2] for f in found] == [f[:2] for f in flips]
        for mine, hand in zip(found, flips, strict=True):  # margins equal
            assert mine[2:] == pytest.approx(hand[2:], rel=1e-12, abs=1e-15)
        assert router["not_by_scores"] == 0  # each run chose its own top 2
    # the router's sites are compared per token, not skipped as unbatched
    table = result.table.set_index("site")
    for path in ("0", "1", "2"):
        assert table.loc[f"model.layers.1.mlp.gate/{path}", "status"] == "ok"
    assert table.loc["model.layers.1.mlp.experts", "status"] == "ok"
    # every flip a near tie, and the tests judge the runs' difference rounding
    assert result.verdict == "rounding"
    summary = result.summary()
    assert "Every flip is a near tie" in summary
    first = next(r for r in routers.values() if r["flips"])["flipped"][0]
    assert f"sample {first['sample']}, token {first['token']}" in summary


def test_no_flip_is_said_plainly() -> None:
    model = _tiny("mixtral", "eager").to(torch.bfloat16)
    result = divtrace.compare(model, _prompts(), progress=False, explain=["replay"])
    routers = result.meta.notes["routing"]["routers"]
    assert all(router["flips"] == 0 for router in routers.values())
    summary = result.summary()
    assert (f"at each of the 2 routers, each of its {sum(LENGTHS)} compared tokens went to "
            f"the same experts in both runs") in summary
    assert ("Routing replay did not run: no token went to other experts in the two runs"
            in summary)


class CapacityRouter(nn.Module):
    """Top-1 with a capacity factor of 1.0: a token whose expert is full (counting the
    tokens before it in the batch) goes to its next choice with room."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, width))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = x.reshape(-1, x.shape[-1])
        logits = F.linear(x, self.weight)
        scores = torch.softmax(logits.float(), -1)
        experts = scores.shape[-1]
        capacity = math.ceil(x.shape[0] / experts)
        taken = [0] * experts
        chosen = torch.empty(x.shape[0], 1, dtype=torch.long)
        for token, order in enumerate(scores.argsort(-1, descending=True).tolist()):
            expert = next(e for e in order if taken[e] < capacity)
            taken[expert] += 1
            chosen[token, 0] = expert
        return logits, scores.gather(1, chosen), chosen


class CapacityTopKRouter(CapacityRouter):
    """Named as Hugging Face names its softmax routers: divtrace reads its scores so."""


class Block(nn.Module):
    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.gate = CapacityTopKRouter(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        _, weights, chosen = self.gate(flat)
        out = torch.stack([self.experts[int(e)](row) for row, e in zip(flat, chosen[:, 0],
                                                                       strict=True)])
        return (out * weights).reshape(x.shape)


class Capacity(nn.Module):
    def __init__(self, width: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width), Block(width, experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_capacity_limited_router_is_not_rounding_and_names_its_experts() -> None:
    torch.manual_seed(0)
    model = Capacity().eval()
    x = torch.randn(8, 6, 16, generator=torch.Generator().manual_seed(1))
    # the last samples: in the batch, the tokens before theirs have filled experts
    result = divtrace.compare(model, x, samples=[5, 6, 7], progress=False)
    router = result.meta.notes["routing"]["routers"]["layers.1.gate"]
    assert router["flips"] > 0
    assert router["not_by_scores"] > 0  # a run chose other than its own top 1
    # alone a sample's 6 tokens share capacity 2 per expert, in the batch 48 share 12:
    # which tokens an expert turns away depends on the others
    flipped = router["flipped"][0]
    assert flipped["experts_a"] != flipped["experts_b"]
    assert result.verdict != "rounding"  # the other samples' tokens decide: mixing
    summary = result.summary()
    # the independence test names the router: its compared rows move with the others
    assert "Independence test: the compared rows change at 'layers.1.gate/" in summary
    assert "(batch mixing)" in summary
    odd = next(f for f in router["flipped"] if False in (f["by_scores_a"], f["by_scores_b"]))
    assert f"sample {odd['sample']} token {odd['token']}" in summary
    assert "'layers.1.gate'" in summary
    assert "not the scores' doing" in summary
    away = router["experts_not_by_scores"]
    assert away
    assert f"expert{'s' * (len(away) != 1)} {', '.join(map(str, away[:4]))} turned away" in summary


@pytest.mark.parametrize(("kind", "dtype", "attention", "spread"),
                         [("mixtral", torch.bfloat16, "sdpa", 1e-3),
                          ("qwen2_moe", torch.float32, "eager", 1e-7)], ids=["mixtral-bf16",
                                                                            "qwen2-fp32"])
def test_routing_replayed_leaves_a_rounding_sized_difference(
        kind: str, dtype: torch.dtype, attention: str, spread: float) -> None:
    model = _near_ties(_tiny(kind, attention), spread).to(dtype)
    result = divtrace.compare(model, _prompts(), progress=False, explain=["replay"])
    assert sum(r["flips"] for r in result.meta.notes["routing"]["routers"].values()) > 0
    replay = result.meta.notes["replay"]
    assert replay["ran"]
    out = result.table[result.table["module"] == "(model)"].iloc[-1]
    before, after = float(out["rel_l2"]), replay["rel_l2"][out["site"]]
    # what routing leaves: a few units of the dtype's rounding, far below the flips' own
    assert after <= 8 * torch.finfo(dtype).eps / 2
    assert after < before / 5
    assert f"at the output rel_l2 {before:.3g} becomes {after:.3g}" in result.summary()


def test_routing_replay_is_the_whole_of_a_capacity_routers_difference() -> None:
    torch.manual_seed(0)
    model = Capacity().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 6, 16, generator=torch.Generator().manual_seed(1))
    result = divtrace.compare(model, x, samples=[0, 1, 2], progress=False, explain=["replay"])
    out = result.table[result.table["module"] == "(model)"].iloc[-1]
    assert float(out["rel_l2"]) > 0.1
    # the tokens alone are computed as in the batch once each gets the same expert
    assert result.meta.notes["replay"]["rel_l2"][out["site"]] == 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not any(m._forward_hooks for m in model.modules())  # no hook left on the model


def test_routing_replay_says_why_it_cannot_run() -> None:
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    result = divtrace.compare(model, torch.randn(4, 4), progress=False, explain=["replay"])
    assert ("Routing replay did not run: the model has no mixture-of-experts router"
            in result.summary())


def test_routing_flips_in_a_packed_layout_as_the_router_read_by_hand_says() -> None:
    model = _near_ties(_tiny("mixtral", "sdpa"), 1e-3).to(torch.bfloat16)
    prompts = _prompts()
    result = divtrace.compare_layouts(model, prompts.prompts, a="alone", b="packed",
                                      progress=False)
    routers = result.meta.notes["routing"]["routers"]
    # by hand: one row of every sequence, position ids restarting, against each alone
    ids = torch.cat(prompts.prompts).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    packed = _gates(model, {"input_ids": ids, "position_ids": positions, "use_cache": False})
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    for router, (name, found) in enumerate(routers.items()):
        flips = []
        for sample, prompt in enumerate(prompts.prompts):
            _, chosen_a = _gates(model, {"input_ids": prompt.unsqueeze(0),
                                         "use_cache": False})[router]
            chosen_b = packed[router][1][starts[sample]:starts[sample] + prompt.numel()]
            flips += [(sample, t) for t in range(prompt.numel())
                      if not torch.equal(chosen_a[t].sort().values,
                                         chosen_b[t].sort().values)]
        assert found["tokens"] == sum(LENGTHS), name
        assert [(f["sample"], f["token"]) for f in found["flipped"]] == flips, name


def test_a_rollout_reports_routing_flips_at_its_decode_steps() -> None:
    model = _near_ties(_tiny("mixtral", "sdpa"), 1e-3).to(torch.bfloat16)
    result = divtrace.compare_rollout(model, _prompts().prompts, max_new_tokens=4,
                                      progress=False)
    routers = result.meta.notes["routing"]["routers"]
    assert list(routers) == [f"model.layers.{i}.mlp.gate" for i in range(2)]
    assert all(router["tokens"] > sum(LENGTHS) for router in routers.values())
    assert "Routing" in result.summary()


def test_the_flipped_tokens_share_of_the_output_difference_is_as_by_hand() -> None:
    model = _near_ties(_tiny("mixtral", "sdpa"), 1e-3).to(torch.bfloat16)
    prompts = _prompts()
    result = divtrace.compare(model, prompts, progress=False)
    output = result.meta.notes["routing"]["output"]
    flipped = {(f[0], f[1]) for flips in _flips_by_hand(model, prompts) for f in flips}
    inputs, layout = pad(prompts, 0, len(prompts))
    with torch.no_grad():
        batched = model(**inputs).logits.double()
        squares, on = [], []
        for sample, prompt in enumerate(prompts.prompts):
            alone = model(**pad(prompts, sample, sample + 1)[0]).logits[0].double()
            mine = batched[sample, layout.offsets[sample]:]
            squares += (mine - alone).square().sum(-1).tolist()
            on += [(sample, t) in flipped for t in range(prompt.numel())]
    share = sum(s for s, o in zip(squares, on, strict=True) if o) / sum(squares)
    assert output["tokens"] == sum(LENGTHS)
    assert output["flipped"] == len(flipped) > 0
    assert output["share"] == pytest.approx(share, rel=1e-9)
    assert (f"carry {output['share']:.1%} of the runs' squared difference"
            in result.summary())


def test_the_snowball_marks_the_routers_that_flipped() -> None:
    import matplotlib

    matplotlib.use("Agg")
    model = _near_ties(_tiny("mixtral", "sdpa"), 1e-3).to(torch.bfloat16)
    result = divtrace.compare(model, _prompts(), progress=False)
    routers = result.meta.notes["routing"]["routers"]
    total = sum(router["flips"] for router in routers.values())
    first = next(key for key, router in routers.items() if router["flips"])
    ax = result.plot()
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert f"routing flips ({total} tokens), the first at {first}" in labels
    # the chosen experts differ at the flipped routers: not drawn as bit-identical
    assert "differs, no rel_l2 (integers): in the lane" in labels
    matplotlib.pyplot.close(ax.figure)


def test_the_routers_in_float32_is_a_remedy_verified_and_costed() -> None:
    model = _near_ties(_tiny("mixtral", "sdpa"), 1e-3).to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = divtrace.compare(model, _prompts(), progress=False)
    found = result.remedies(candidates=["float32-router"], repeats=1, progress=False)
    row = found.table.iloc[0]
    assert row["remedy"] == "float32 router"
    assert not pd.isna(row["identical"])  # tried, verified
    out = result.table[result.table["module"] == "(model)"].iloc[-1]
    assert row["output_rel_l2"] < float(out["rel_l2"])  # the router's own rounding is less
    assert row["cost"] > 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    plain = divtrace.compare(nn.Sequential(nn.Linear(4, 4)).eval(), torch.randn(4, 4),
                             progress=False)
    none = plain.remedies(candidates=["float32-router"], repeats=1, progress=False)
    assert none.table.iloc[0]["note"] == (
        "not tried: the model has no mixture-of-experts router")


def test_a_deepseek_router_is_judged_on_its_own_scores() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=100, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, n_shared_experts=1, attn_implementation="sdpa")
    model = _near_ties(transformers.DeepseekV3ForCausalLM(config).eval(), 1e-4)
    model = model.to(torch.bfloat16)

    def margin(logits: torch.Tensor) -> float:  # by hand: sigmoid plus bias, best group
        gate = model.model.layers[0].mlp.gate
        scores = logits.float().sigmoid() + gate.e_score_correction_bias.float()
        groups = scores.view(2, 4)
        best = int(groups.topk(2, -1)[0].sum(-1).argmax())
        ranked = groups[best].double().sort(descending=True).values
        return float(ranked[1] - ranked[2])

    prompts = _prompts()
    result = divtrace.compare(model, prompts, progress=False)
    routers = result.meta.notes["routing"]["routers"]
    by_hand = _flips_by_hand(model, prompts, margin)
    assert sum(len(flips) for flips in by_hand) > 0
    for router, flips in zip(routers.values(), by_hand, strict=True):
        found = [(f["sample"], f["token"], f["margin_a"], f["margin_b"])
                 for f in router["flipped"]]
        assert [f[:2] for f in found] == [f[:2] for f in flips]
        for mine, hand in zip(found, flips, strict=True):
            assert mine[2:] == pytest.approx(hand[2:], rel=1e-12, abs=1e-15)
        assert router["not_by_scores"] == 0
        assert all(f["by_scores_a"] and f["by_scores_b"] for f in router["flipped"])
    assert "Every flip is a near tie" in result.summary()


def test_a_router_divtrace_does_not_know_is_read_on_its_logits_unjudged() -> None:
    torch.manual_seed(0)
    model = Capacity().eval()
    known = model.layers[1].gate
    model.layers[1].gate = CapacityRouter(16, 4)  # not named as a softmax router
    model.layers[1].gate.load_state_dict(known.state_dict())
    x = torch.randn(8, 6, 16, generator=torch.Generator().manual_seed(1))
    result = divtrace.compare(model, x, samples=[0, 1, 2], progress=False)
    router = result.meta.notes["routing"]["routers"]["layers.1.gate"]
    assert router["flips"] > 0
    assert router["not_by_scores"] == 0  # not judged, so not counted
    assert all(f["by_scores_a"] is None for f in router["flipped"])
    summary = result.summary()
    assert "How the router at 'layers.1.gate' scores its experts is not known" in summary
    assert "Every flip is a near tie" not in summary


def test_a_result_with_routing_flips_saves_and_loads(tmp_path: Any) -> None:
    model = _near_ties(_tiny("mixtral", "sdpa"), 1e-3).to(torch.bfloat16)
    result = divtrace.compare(model, _prompts(), progress=False, explain=["replay"])
    result.save(tmp_path / "moe")
    back = divtrace.load(tmp_path / "moe")
    assert back.meta.notes["routing"] == result.meta.notes["routing"]
    assert back.meta.notes["replay"] == result.meta.notes["replay"]
    assert back.summary() == result.summary()
    assert "Routing flips" in result.to_html(tmp_path / "moe.html").read_text()


def test_a_decode_step_reports_its_flips_at_their_positions() -> None:
    model = _near_ties(_tiny("mixtral", "sdpa"), 1e-3).to(torch.bfloat16)
    generation = divtrace.compare_generate(model, _prompts(), max_new_tokens=4,
                                           progress=False)
    step = generation.at(2)
    routers = step.meta.notes["routing"]["routers"]
    assert all(router["tokens"] == len(LENGTHS) for router in routers.values())  # one each
    flips = [f for router in routers.values() for f in router["flipped"]]
    # the step's one token per prompt: the input at position length + step - 1
    assert flips  # the near ties flip at this step
    assert all(f["token"] == LENGTHS[f["sample"]] + 2 - 1 for f in flips)
    assert f"token {flips[0]['token']}:" in step.summary()


def test_expert_calls_that_follow_the_routing_are_not_control_flow_by_the_batch() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, num_experts=16, num_experts_per_tok=2,
        moe_intermediate_size=32, experts_implementation="eager")).eval()
    result = divtrace.compare(model, _prompts(), progress=False)
    table = result.table
    apart = table[table["status"] == "missing_in_split"]
    # the loop calls the activation once per expert that got a token: the batch hits more
    assert not apart.empty
    assert apart["module"].str.startswith("model.layers.").all()
    assert apart["module"].str.contains(r"\.mlp\.experts\.act_fn$").all()
    assert result.verdict == "rounding"
    assert (f"{len(apart)} calls inside the mixture-of-experts blocks ran in one run only "
            f"(the first '{apart.iloc[0]['site']}')") in result.summary()
    # without the routing probe the same calls are control flow that depends on the batch
    blind = divtrace.compare(model, _prompts(), progress=False, explain=["-routing"])
    assert blind.verdict == "not rounding"
    assert "the model's control flow depends on the batch" in blind.summary()


class OwnRouter(nn.Module):
    """A router of one's own: top 2 of a softmax over 4 experts whose rows nearly tie,
    its logits summed in another order once the pass has 7 tokens or more (as a kernel
    switches with the batch), its output a dict."""

    def __init__(self, width: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.proj = models.OrderedLinear(width, experts, variant_from=7)
        with torch.no_grad():
            weight = self.proj.weight
            weight.copy_(weight[0] * (1 + 1e-7 * torch.randn_like(weight)))

    def forward(self, x: torch.Tensor) -> Any:
        logits = self.proj(x)
        weights, chosen = torch.softmax(logits, -1).topk(2, -1)
        return {"weights": weights, "chosen": chosen, "logits": logits}


class TupleRouter(OwnRouter):
    """The same router, its output (weights, chosen, logits)."""

    def forward(self, x: torch.Tensor) -> Any:
        out = super().forward(x)
        return out["weights"], out["chosen"], out["logits"]


class OwnMoE(nn.Module):
    """An expert block with no ``gate`` nor ``experts``: ``router`` and ``ffn``."""

    def __init__(self, router: nn.Module, width: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.router = router
        self.ffn = nn.ModuleList(models.OrderedLinear(width, width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routed = self.router(flat)
        weights, chosen = (routed["weights"], routed["chosen"]) if isinstance(
            routed, dict) else routed[:2]
        out = torch.zeros_like(flat)
        for slot in range(chosen.shape[1]):
            for expert, ffn in enumerate(self.ffn):
                mask = chosen[:, slot] == expert
                if mask.any():
                    out[mask] += weights[mask, slot, None] * ffn(flat[mask])
        return out.reshape(x.shape)


def _own(router: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(models.OrderedLinear(16, 16), OwnMoE(router())).eval()


def _own_by_hand(model: nn.Module, x: torch.Tensor, chosen: str, logits: str
                 ) -> list[tuple[int, int, float, float]]:
    """By hand: (sample, token, margin alone, margin batched) of each flipped token."""
    def routed(rows: torch.Tensor) -> Any:
        found: list[Any] = []
        handle = model[1].router.register_forward_hook(lambda _m, _a, out: found.append(out))
        with torch.no_grad():
            model(rows)
        handle.remove()
        out = found[0]
        return (out[chosen], out[logits]) if isinstance(out, dict) else (
            out[int(chosen)], out[int(logits)])
    batched = routed(x)
    flips = []
    for sample in range(len(x)):
        alone = routed(x[sample:sample + 1])
        for token in range(x.shape[1]):
            row = sample * x.shape[1] + token
            if not torch.equal(alone[0][token].sort().values, batched[0][row].sort().values):
                flips.append((sample, token, _margin(alone[1][token]),
                              _margin(batched[1][row])))
    return flips


@pytest.mark.parametrize(("router", "routing"), [
    (OwnRouter, divtrace.Routing("*.router", logits="logits", weights="weights",
                                 experts="chosen", scores=lambda logits: logits.softmax(-1))),
    (TupleRouter, divtrace.Routing(TupleRouter, logits="2", weights="0", experts="1",
                                   scores=lambda logits: logits.softmax(-1)))],
    ids=["pattern-dict", "type-tuple"])
def test_a_router_of_ones_own_given_by_a_pattern(router: type, routing: Any) -> None:
    model = _own(router)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 6, 16, generator=torch.Generator().manual_seed(1))
    result = divtrace.compare(model, x, progress=False, explain=[routing, "replay"])
    routers = result.meta.notes["routing"]["routers"]
    assert list(routers) == ["1.router"]
    paths = routing.routers
    by_hand = _own_by_hand(model, x, paths.experts, paths.logits)
    assert by_hand  # the planted near ties flip
    found = routers["1.router"]
    assert found["tokens"] == 48
    assert found["flips"] == len(by_hand)
    mine = [(f["sample"], f["token"], f["margin_a"], f["margin_b"]) for f in found["flipped"]]
    assert [f[:2] for f in mine] == [f[:2] for f in by_hand]
    for got, hand in zip(mine, by_hand, strict=True):
        assert got[2:] == pytest.approx(hand[2:], rel=1e-12, abs=1e-15)
    assert found["not_by_scores"] == 0
    assert result.verdict == "rounding"
    assert "Every flip is a near tie" in result.summary()
    # the experts forced from the split run: the block's output is the split run's
    out = result.table[result.table["module"] == "(model)"].iloc[-1]
    assert float(out["rel_l2"]) > 0
    assert result.meta.notes["replay"]["rel_l2"][out["site"]] == 0
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not any(m._forward_hooks for m in model.modules())
    # the remedies find the same routers
    remedies = result.remedies(candidates=["float32-router"], repeats=1, progress=False)
    assert remedies.table.iloc[0]["note"] == "not tried: the routers compute in float32 already"


def test_a_router_pattern_that_matches_nothing_or_misses_the_paths_names_the_fix() -> None:
    model = _own(OwnRouter)
    x = torch.randn(4, 6, 16)
    with pytest.raises(divtrace.DivtraceValueError,
                       match=r"Routing\(routers='\*\.gate'\) matches no module of Sequential; "
                             r"give a glob on qualified names"):
        divtrace.compare(model, x, progress=False, explain=[divtrace.Routing("*.gate")])
    with pytest.raises(divtrace.DivtraceValueError, match="three different paths"):
        divtrace.Routers("*.router", logits="0", experts="0")
    result = divtrace.compare(model, x, progress=False, explain=[divtrace.Routing("*.router")])
    assert ("Routing was not compared: router '1.router' gave the sites 'weights' (ok), "
            "'chosen' (ok), 'logits' (ok), and divtrace reads its logits at '0' and its "
            "chosen experts at '2'") in result.summary()


class Centred(models.OrderedLinear):
    """An expert that takes the mean over its tokens away: a difference by design."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out - out.mean(0, keepdim=True)


class CountedMoE(OwnMoE):
    """Its experts sum in another order once they get 7 tokens or more, as a kernel
    chosen by the count of tokens routed to it does (``centred``: each takes the mean
    over its tokens away too)."""

    def __init__(self, centred: bool = False) -> None:
        super().__init__(OwnRouter())
        with torch.no_grad():  # wide margins: no token changes experts
            self.router.proj.weight.copy_(torch.randn(4, 16))
        expert = Centred if centred else models.OrderedLinear
        self.ffn = nn.ModuleList(expert(16, 16, variant_from=7) for _ in range(4))


@pytest.mark.parametrize("centred", [False, True], ids=["counted", "centred"])
def test_experts_that_round_by_their_token_count_leave_the_independence_test_unsure(
        centred: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(models.OrderedLinear(16, 16), CountedMoE(centred)).eval()
    x = torch.randn(8, 6, 16, generator=torch.Generator().manual_seed(1))
    result = divtrace.compare(model, x, progress=False, explain=[
        divtrace.Routing("*.router", logits="logits", weights="weights", experts="chosen")])
    router = result.meta.notes["routing"]["routers"]["1.router"]
    assert router["flips"] == 0  # the same experts for every token in both runs
    table = result.table.set_index("site")
    assert not table.loc["1.router/chosen", "depends_on_others"]
    summary = result.summary()
    if centred:  # the mean over each expert's tokens moves rows far beyond rounding
        assert result.verdict == "not rounding"
        assert table.loc["1", "depends_on_others"]
        assert "Independence test: the compared rows change at '1' (CountedMoE)" in summary
        assert "(batch mixing)" in summary
        return
    assert pd.isna(table.loc["1", "depends_on_others"])  # the block: unsure from here
    far = result.meta.notes["independence"]["routed"]["rel_l2"]
    assert 0 < far < 1e-5
    assert ("inconclusive from '1' on — at the router of the mixture-of-experts block '1' "
            f"the compared tokens went to the same experts in every pass, and the rows "
            f"move after it by rel_l2 {divtrace.words.sci(far)}") in summary
    assert "(batch mixing)" not in summary
    subsets = [s for s, st in zip(result.table["site"], result.table["status"], strict=True)
               if s.startswith("1.ffn.") and st == "unbatched"]
    assert subsets  # each expert called on the tokens routed to it
    assert (f"{len(subsets)} calls inside the mixture-of-experts blocks (the first "
            f"'{subsets[0]}') had rows that are not one per token") in summary
    assert result.verdict == "rounding"  # the precision test: it shrinks in float64
    assert "the difference shrinks in float64 as rounding does" in summary
    assert ("the independence test was inconclusive from a mixture-of-experts block on"
            in summary)
