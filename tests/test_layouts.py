"""Token layouts (``compare_layouts``, ``compare_rollout``): the same tokens packed,
padded, alone, decoded through the KV cache, prefilled in chunks or from a reused prefix,
aligned token by token and judged; each checked against the same tokens sliced by hand."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import divtrace

transformers = pytest.importorskip("transformers")

LOGITS = "(model)/logits"


def llama(dtype: torch.dtype = torch.float32, attention: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=256,
        attn_implementation=attention)
    return transformers.LlamaForCausalLM(config).eval().to(dtype)


def qwen2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=256,
        attn_implementation="sdpa")
    return transformers.Qwen2ForCausalLM(config).eval()


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100,
                                     n_positions=256, attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(config).eval()


def sequences(*lengths: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(1, 100, (n,), generator=generator) for n in lengths]


def by_hand(model: nn.Module, seqs: list[torch.Tensor], layout: str) -> list[torch.Tensor]:
    """Each sequence's logits in ``layout``, laid out and sliced by hand."""
    device = seqs[0].device
    with torch.no_grad():
        if layout == "alone":
            return [model(input_ids=s[None]).logits[0] for s in seqs]
        if layout == "packed":
            ids = torch.cat(seqs)[None]
            positions = torch.cat([torch.arange(s.numel(), device=device) for s in seqs])[None]
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
            return list(logits.split([s.numel() for s in seqs]))
        side = layout.partition(":")[2] or "left"
        length = max(s.numel() for s in seqs)
        ids = torch.zeros(len(seqs), length, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for row, s in enumerate(seqs):
            at = length - s.numel() if side == "left" else 0
            ids[row, at:at + s.numel()], mask[row, at:at + s.numel()] = s, 1
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        return [logits[row, (length - s.numel() if side == "left" else 0):][:s.numel()]
                for row, s in enumerate(seqs)]


def cached_by_hand(model: nn.Module, seqs: list[torch.Tensor], bounds_of: object
                   ) -> list[torch.Tensor]:
    """Each sequence alone through the KV cache, in the pieces ``bounds_of(n)`` gives
    (a prefix's cache copied before the rest, as a reused one)."""
    found = []
    with torch.no_grad():
        for s in seqs:
            bounds = bounds_of(s.numel())  # type: ignore[operator]
            cache, parts = None, []
            for low, high in itertools.pairwise(bounds):
                positions = torch.arange(low, high)
                out = model(input_ids=s[low:high][None], position_ids=positions[None],
                            cache_position=positions, use_cache=True,
                            **{_cache_word(model): cache})
                cache = copy.deepcopy(getattr(out, _cache_word(model)))
                parts.append(out.logits[0])
            found.append(torch.cat(parts))
    return found


def _cache_word(model: nn.Module) -> str:
    import inspect
    names = inspect.signature(model.forward).parameters
    return "cache" if "cache" in names else "past_key_values"


def kept(result: divtrace.Comparison, site: str = LOGITS) -> tuple[torch.Tensor, torch.Tensor]:
    return result.pair(site)


def flat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.flatten() for p in parts])


KEEP = divtrace.Resources(keep=True)


@pytest.mark.parametrize(("a", "b"), [("alone", "packed"), ("padded:right", "packed"),
                                      ("packed", "padded"), ("alone", "padded:right")])
def test_every_real_token_is_aligned_and_judged_rounding(a: str, b: str) -> None:
    model = llama()
    seqs = sequences(20, 33, 17)
    result = divtrace.compare_layouts(model, seqs, a=a, b=b, resources=KEEP, progress=False)
    got_a, got_b = kept(result)
    assert torch.equal(got_a, flat(by_hand(model, seqs, a)))
    assert torch.equal(got_b, flat(by_hand(model, seqs, b)))
    assert result.meta.kind == "token layouts"
    assert result.meta.names == (f"run a ({divtrace.Layout.of(a).label()})",
                                 f"run b ({divtrace.Layout.of(b).label()})")
    assert result.verdict in ("rounding", "identical")
    ok = result.table[result.table["status"] == "ok"]
    assert len(ok) > 20
    assert (ok["numel"] > 0).all()


@pytest.mark.parametrize("build", [qwen2, gpt2], ids=["qwen2", "gpt2"])
def test_other_families_align_packed_against_alone(build: object) -> None:
    model = build()  # type: ignore[operator]
    seqs = sequences(9, 15, 4)
    result = divtrace.compare_layouts(model, seqs, a="alone", b="packed", resources=KEEP,
                                      progress=False)
    got_a, got_b = kept(result)
    assert torch.equal(got_a, flat(by_hand(model, seqs, "alone")))
    assert torch.equal(got_b, flat(by_hand(model, seqs, "packed")))
    assert result.verdict in ("rounding", "identical")


def _plant(model: nn.Module, change: str) -> None:
    """A packing bug in the packed pass: its position ids counted over the whole row, or
    a mask over the whole row (one sequence sees the one before)."""
    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[0] == 1 and kwargs.get("use_cache") is False:
            if change == "positions":
                kwargs["position_ids"] = torch.arange(ids.shape[1])[None]
            else:
                kwargs["attention_mask"] = torch.ones_like(ids)
        return args, kwargs
    model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("b", ["packed", "packed:2"])  # one forward call, or two
@pytest.mark.parametrize("change", ["positions", "mask"])
def test_a_planted_packing_bug_is_not_rounding_and_named_at_the_first_attention(
        change: str, b: str) -> None:
    model = llama()
    _plant(model, change)
    result = divtrace.compare_layouts(model, sequences(12, 9, 15), a="alone", b=b,
                                      progress=False)
    assert result.verdict == "not rounding"
    table = result.table
    moved = table[table["depends_on_others"].fillna(False).astype(bool)]
    assert moved.iloc[0]["site"].startswith("model.layers.0.self_attn")
    first = result.first_divergence
    assert first is not None
    if change == "mask":  # the positions are right: nothing parts before the attention
        assert first["site"].startswith("model.layers.0.self_attn")
    assert "batch mixing" in result.summary()


def _rollout(model: nn.Module, prompts: list[torch.Tensor], new: int
             ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The prompts through generate() by hand (left-padded, greedy): the new tokens of
    each, and the raw logits of every step."""
    device = prompts[0].device
    length = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), length, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, length - p.numel():], mask[row, length - p.numel():] = p, 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             do_sample=False, return_dict_in_generate=True,
                             output_logits=True, pad_token_id=0, eos_token_id=None)
    return list(out.sequences[:, length:]), torch.stack(out.logits, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("trainer", ["padded:right", "packed"])
def test_a_rollout_against_its_trainer_token_by_token(dtype: torch.dtype,
                                                      trainer: str) -> None:
    model = llama(dtype)
    prompts = sequences(9, 14, 6)
    new = 7
    result = divtrace.compare_rollout(model, prompts, max_new_tokens=new, trainer=trainer,
                                      eos_token_id=None, progress=False)
    figures = divtrace.token_figures(result)
    table = figures.logprobs
    made, steps = _rollout(model, prompts, new)
    # the tokens are those generate() gives, every generated token scored
    assert len(table) == len(prompts) * new
    for prompt, rows in table.groupby("prompt"):
        assert rows["token"].tolist() == made[prompt].tolist()
        assert rows["position"].tolist() == list(range(prompts[prompt].numel(),
                                                       prompts[prompt].numel() + new))
    # the log-probabilities, by hand: generate()'s own logits against one teacher-forced
    # pass over the finished sequences
    finished = [torch.cat([p, m]) for p, m in zip(prompts, made, strict=True)]
    forced = by_hand(model, finished, trainer)
    for prompt, rows in table.groupby("prompt"):
        n = prompts[prompt].numel()
        target = made[prompt]
        a = torch.log_softmax(steps[prompt].double(), -1).gather(1, target[:, None])[:, 0]
        b = torch.log_softmax(forced[prompt][n - 1:n - 1 + new].double(), -1).gather(
            1, target[:, None])[:, 0]
        assert torch.equal(torch.tensor(rows["logprob_a"].to_numpy()), a)
        assert torch.equal(torch.tensor(rows["logprob_b"].to_numpy()), b)
    assert result.meta.names == ("run a (KV-cache decode)",
                                 f"run b ({divtrace.Layout.of(trainer).label()})")
    first = result.first_divergence
    assert first is not None
    assert first["site"].startswith("model.layers.0.")
    assert result.verdict == "rounding"
    delta = figures.logprobs["delta"]
    said = result.summary()
    assert f"differ by at most {delta.max():.3g}" in said
    assert figures.summary().startswith(f"|Δlogprob| over {len(table)} tokens")
    layers = figures.layers
    assert set(layers["site"]) == {"model.layers.0", "model.layers.1"}
    # each decoder layer holds every fed token: the prompt and all but the last new one
    assert len(layers) == 2 * sum(p.numel() + new - 1 for p in prompts)
    figure = figures.plot()
    assert len(figure.axes) >= 2


def test_remedies_of_a_rollout_are_verified_per_token_and_costed_over_its_layouts() -> None:
    model = llama(torch.bfloat16)
    before = copy.deepcopy(model.state_dict())
    prompts = sequences(9, 14, 6)
    new = 5
    result = divtrace.compare_rollout(model, prompts, max_new_tokens=new,
                                      eos_token_id=None, progress=False)
    calls: list[int] = []  # the token count of every forward call while costed
    handle = model.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        found = result.remedies(candidates=["float32-head", "fixed-batch"], repeats=1,
                                progress=False)
    finally:
        handle.remove()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    table = found.table.set_index("kind")
    assert table.loc["fixed-batch", "note"].startswith("not tried: the runs lay the same "
                                                       "tokens out")
    # the float32 head verified per token: its log-probabilities are those of float32
    # logits of a teacher-forced pass by hand under it
    head = found.comparisons["float32 head"]
    rows = divtrace.token_figures(head).logprobs
    made, _ = _rollout(model, prompts, new)
    finished = [torch.cat([p, m]) for p, m in zip(prompts, made, strict=True)]
    with divtrace.remedies.Float32Head().applied(model):
        forced = by_hand(model, finished, "padded:right")
    assert forced[0].dtype == torch.float32
    for prompt, part in rows.groupby("prompt"):
        n = prompts[prompt].numel()
        b = torch.log_softmax(forced[prompt][n - 1:n - 1 + new].double(), -1).gather(
            1, made[prompt][:, None])[:, 0]
        assert torch.equal(torch.tensor(part["logprob_b"].to_numpy()), b)
    delta = rows["delta"].max()
    assert f"max |Δlogprob| {divtrace.words.sci(delta)}" in table.loc["float32-head", "note"]
    assert table.loc["float32-head", "cost"] > 0
    assert table.loc["float32-head", "a_cost"] > 0
    # the costs timed each run in its own layout: decode steps of one token, and passes
    # over whole sequences
    assert 1 in calls
    assert max(finished, key=len).numel() in calls


@pytest.mark.parametrize(("build", "head"), [
    (llama, ("model.norm", "lm_head")), (qwen2, ("model.norm", "lm_head")),
    (gpt2, ("transformer.ln_f", "lm_head"))], ids=["llama", "qwen2", "gpt2"])
def test_the_float32_head_is_the_final_norm_and_the_output_embedding(build: object,
                                                                      head: tuple) -> None:
    model = build().to(torch.bfloat16)  # type: ignore[operator]
    assert divtrace.remedies.head.output_head(model) == head
    ids = sequences(7)[0][None]
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with divtrace.remedies.Float32Head().applied(model):
            upcast = model(input_ids=ids).logits
    assert plain.dtype == torch.bfloat16
    assert upcast.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_chunked_prefill_and_a_reused_prefix_are_aligned_and_judged() -> None:
    model = llama()
    seqs = sequences(40, 33, 21)
    chunked = divtrace.compare_layouts(model, seqs, a="chunked:16", b="padded",
                                       resources=KEEP, progress=False)
    got_a, got_b = kept(chunked)
    assert torch.equal(got_a, flat(cached_by_hand(
        model, seqs, lambda n: [*range(0, n, 16), n])))
    assert torch.equal(got_b, flat(by_hand(model, seqs, "padded")))
    assert chunked.verdict in ("rounding", "identical")
    assert chunked.meta.names[0] == "run a (chunked prefill (16 tokens))"
    prefix = divtrace.compare_layouts(model, seqs, a="prefix:12", b="packed",
                                      resources=KEEP, progress=False)
    got_a, _ = kept(prefix)
    assert torch.equal(got_a, flat(cached_by_hand(model, seqs, lambda n: [0, 12, n])))
    assert prefix.verdict in ("rounding", "identical")


def _micro(model: nn.Module, seqs: list[torch.Tensor], layout: str, size: int
           ) -> list[torch.Tensor]:
    """``layout`` by hand, in micro-batches of ``size`` sequences."""
    return [part for low in range(0, len(seqs), size)
            for part in by_hand(model, seqs[low:low + size], layout)]


@pytest.mark.parametrize(("a", "b"), [("packed", "alone"), ("padded:right", "chunked:8"),
                                      ("chunked:8", "prefix:12"),
                                      ("packed:2", "padded:right:2"), ("alone", "packed:2")])
def test_run_b_of_several_calls_is_gathered_and_aligned(a: str, b: str) -> None:
    model = llama()
    seqs = sequences(20, 33, 17)
    result = divtrace.compare_layouts(model, seqs, a=a, b=b, resources=KEEP, progress=False)
    bounds = {"alone": lambda n: [0, n], "chunked:8": lambda n: [*range(0, n, 8), n],
              "prefix:12": lambda n: [0, 12, n]}
    hand = {name: (cached_by_hand(model, seqs, bounds[name]) if name in bounds
                   else _micro(model, seqs, name.rpartition(":")[0], 2) if name[-1] == "2"
                   else by_hand(model, seqs, name)) for name in (a, b)}
    got_a, got_b = kept(result)
    assert torch.equal(got_a, flat(hand[a]))
    assert torch.equal(got_b, flat(hand[b]))
    assert result.verdict in ("rounding", "identical")
    ok = result.table[result.table["status"] == "ok"]
    assert len(ok) == len(result.table)
    # the independence test ran on run b's several calls: no compared row moved
    assert result.meta.notes["independence"]["ran"]
    assert not result.table["depends_on_others"].fillna(False).astype(bool).any()


def test_decode_against_chunked_prefill_per_token() -> None:
    model = llama()
    prompts = sequences(20, 26)
    made, _ = _rollout(model, prompts, 5)
    finished = [torch.cat([p, m]) for p, m in zip(prompts, made, strict=True)]
    result = divtrace.compare_layouts(model, finished, a="decode", b="chunked:8",
                                      prompt_lengths=[20, 26], resources=KEEP,
                                      explain=["tokens"], progress=False)
    # run b's logits by hand, cut to run a's: from each prompt's last token to the last
    # token fed
    chunked = cached_by_hand(model, finished, lambda n: [*range(0, n, 8), n])
    parts = [c[p.numel() - 1:s.numel() - 1]
             for c, p, s in zip(chunked, prompts, finished, strict=True)]
    _, got_b = kept(result)
    assert torch.equal(got_b, flat(parts))
    table = divtrace.token_figures(result).logprobs
    for prompt, rows in table.groupby("prompt"):
        b = torch.log_softmax(parts[prompt].double(), -1).gather(
            1, made[prompt][:, None])[:, 0]
        assert torch.equal(torch.tensor(rows["logprob_b"].to_numpy()), b)
    assert result.verdict in ("rounding", "identical")


def test_decode_feeds_the_given_tokens_through_the_cache() -> None:
    model = llama()
    prompts = sequences(5, 8)
    made, _ = _rollout(model, prompts, 4)
    finished = [torch.cat([p, m]) for p, m in zip(prompts, made, strict=True)]
    finished[1][-2] = (finished[1][-2] + 1) % 100  # not what greedy decoding picks
    result = divtrace.compare_layouts(model, finished, a="decode", b="packed",
                                      prompt_lengths=[5, 8], resources=KEEP,
                                      explain=["tokens"], progress=False)
    assert result.verdict in ("rounding", "identical")
    table = divtrace.token_figures(result).logprobs
    assert table[table["prompt"] == 1]["token"].tolist() == finished[1][8:].tolist()
    # run a's logits, by hand: each sequence's tokens fed one by one through the cache
    with torch.no_grad():
        fed = []
        for sequence, prompt in zip(finished, prompts, strict=True):
            out = model(input_ids=prompt[None], use_cache=True)
            steps = [out.logits[0, -1:]]
            cache = getattr(out, _cache_word(model))
            for t in range(prompt.numel(), sequence.numel() - 1):
                out = model(input_ids=sequence[t:t + 1][None], use_cache=True,
                            **{_cache_word(model): cache})
                cache = getattr(out, _cache_word(model))
                steps.append(out.logits[0])
            fed.append(torch.cat(steps))
    got_a, _ = kept(result)
    torch.testing.assert_close(got_a, flat(fed), rtol=1e-5, atol=1e-6)


def test_bad_layouts_and_sequences_are_refused_with_the_fix() -> None:
    model = llama()
    seqs = sequences(20, 10)
    with pytest.raises(divtrace.DivtraceValueError, match="more tokens than a chunk"):
        divtrace.compare_layouts(model, seqs, a="chunked:16", b="padded", progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="prompt_lengths"):
        divtrace.compare_layouts(model, seqs, a="decode", b="padded", progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="micro-batch of the layout"):
        divtrace.Layout.of("packed:0")
    with pytest.raises(divtrace.DivtraceValueError, match="no token layout 'squashed'"):
        divtrace.compare_layouts(model, seqs, a="squashed", progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="needs a size"):
        divtrace.compare_layouts(model, seqs, a="chunked", progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="same layout"):
        divtrace.compare_layouts(model, seqs, a="packed", b="packed", progress=False)
    no_cache = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 100))
    with pytest.raises(divtrace.DivtraceValueError, match="no generate"):
        divtrace.compare_layouts(no_cache, seqs, a="decode", b="padded",
                                 prompt_lengths=[3, 3], progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="KV cache"):
        divtrace.compare_layouts(no_cache, seqs, a="chunked:4", b="padded", progress=False)
    with pytest.raises(divtrace.DivtraceTypeError, match="compare_rollout needs a model"):
        divtrace.compare_rollout(no_cache, seqs, progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="train mode"):
        divtrace.compare_rollout(model.train(), seqs, progress=False)
    with pytest.raises(divtrace.DivtraceValueError, match="inconsistent with the packing"):
        divtrace.Prompts.from_packed(torch.arange(1, 7)[None],
                                     torch.tensor([[0, 1, 2, 0, 2, 3]]))
    packed = divtrace.Prompts.from_packed(torch.arange(1, 7)[None],
                                          torch.tensor([[0, 1, 2, 0, 1, 2]]))
    assert packed.lengths == (3, 3)


def test_a_comparison_of_layouts_saves_and_loads(tmp_path: object) -> None:
    model = llama()
    result = divtrace.compare_rollout(model, sequences(6, 9), max_new_tokens=3,
                                      eos_token_id=None, progress=False)
    path = result.save(tmp_path / "rollout.json")  # type: ignore[operator]
    again = divtrace.load(path)
    assert again.verdict == result.verdict
    assert divtrace.token_figures(again).logprobs.equals(
        divtrace.token_figures(result).logprobs)
    assert "token_rel_l2_max" in again.table.columns


@pytest.mark.cuda
@pytest.mark.parametrize("trainer", ["padded:right", "packed"])
def test_a_rollout_against_its_trainer_on_cuda(trainer: str) -> None:
    model = llama(torch.bfloat16).cuda()
    prompts = [s.cuda() for s in sequences(30, 61, 17, 44)]
    new = 12
    result = divtrace.compare_rollout(model, prompts, max_new_tokens=new, trainer=trainer,
                                      eos_token_id=None, progress=False)
    table = divtrace.token_figures(result).logprobs
    made, steps = _rollout(model, prompts, new)
    finished = [torch.cat([p, m]) for p, m in zip(prompts, made, strict=True)]
    forced = by_hand(model, finished, trainer)
    for prompt, rows in table.groupby("prompt"):
        n = prompts[prompt].numel()
        target = made[prompt][:, None]
        a = torch.log_softmax(steps[prompt].double(), -1).gather(1, target)[:, 0]
        b = torch.log_softmax(forced[prompt][n - 1:n - 1 + new].double(), -1).gather(
            1, target)[:, 0]
        assert rows["token"].tolist() == made[prompt].tolist()
        assert torch.equal(torch.tensor(rows["logprob_a"].to_numpy()), a.cpu())
        assert torch.equal(torch.tensor(rows["logprob_b"].to_numpy()), b.cpu())
    assert result.verdict in ("rounding", "identical")

