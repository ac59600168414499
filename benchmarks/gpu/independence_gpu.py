"""The verdict's independence test on a GPU: planted batch mixing, the seed cases, and
TF32 set through PyTorch's new ``fp32_precision`` API.

- vgg11().features, batch 64 vs chunks of 2, with a layer after the 6th module that adds
  ``eps * x.mean(0)`` (a real bug: samples mix in eval mode), eps 1, 1e-4, 1e-6, and
  without it;
- the seed cases under the seed settings (fp32, TF32 off, cuDNN deterministic):
  vgg11().features and one Conv2d(3, 64), batch 128 vs its first 2; AlexNet, batch 100
  per sample; efficientnet_v2_s, batch 64 vs its first 2; and vgg11().features with cuDNN
  off and with TF32 on;
- TF32 for convolutions set through ``torch.backends.cudnn.conv.fp32_precision``;
- the first seed report's own script: AlexNet, batch 100 vs 1, with its flags (which
  include ``torch.set_float32_matmul_precision("high")``), judged at the user's rtol=0.1;
- every setting of the README's sweep (``benchmarks/gpu/configs_gpu.py``), batched vs split;
- language models with padding on the GPU (random-init BERT, GPT-2, Llama; a padded dict
  input and ``Prompts``), which must show no mixing; train-mode BatchNorm (allowed) and an
  LSTM given ``(T, B, F)``, which must.

Writes ``independence_summary.txt`` and ``independence.json`` into --out.

    python benchmarks/gpu/independence_gpu.py --out docs/results/h200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import divtrace
from divtrace.plan.precision import precision_state
from divtrace.words import readable

SEED = divtrace.Run(deterministic=True, benchmark=False, tf32_matmul=False, tf32_cudnn=False)


class Mix(nn.Module):
    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.eps * x.mean(0, keepdim=True)


def record(found: list[dict[str, Any]], lines: list[str], name: str,
           result: divtrace.Comparison) -> None:
    table = result.table
    moved = table[table["depends_on_others"].astype("boolean").fillna(False).astype(bool)]
    out = result.output
    found.append({"case": name, "verdict": result.verdict,
                  "first_dependent": None if moved.empty else moved.iloc[0]["site"],
                  "output_rel_l2": None if out is None else float(out["rel_l2"]),
                  "independence": result.meta.notes.get("independence")})
    lines += [f"== {name}", result.summary(), ""]
    print(name, result.verdict, found[-1]["first_dependent"], flush=True)


def main() -> int:
    from torchvision.models import alexnet, efficientnet_v2_s, vgg11

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    found: list[dict[str, Any]] = []
    lines = [f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
             f"{torch.cuda.get_device_name(0)}", ""]
    cuda = torch.device("cuda")
    with SEED.flags():
        torch.manual_seed(0)
        features = vgg11().features.eval().to(cuda)
        x64 = torch.rand(64, 3, 128, 128, device=cuda)
        for eps in (1.0, 1e-4, 1e-6, None):
            layers = list(features)
            model = nn.Sequential(*layers[:6], *([Mix(eps)] if eps else []), *layers[6:])
            record(found, lines, f"vgg11().features + mean-mixing eps={eps} (64 vs chunks of 2)",
                   divtrace.compare(model.eval(), x64, a=divtrace.Run(chunk=2), progress=False))
        x128 = torch.rand(128, 3, 128, 128, device=cuda)
        record(found, lines, "seed: vgg11().features, 128 vs first 2",
               divtrace.compare(features, x128, a=divtrace.Run(chunk=2), samples=[0, 1],
                                progress=False))
        conv = nn.Conv2d(3, 64, 3, padding=1).to(cuda).eval()
        record(found, lines, "seed: Conv2d(3, 64), 128 vs first 2",
               divtrace.compare(conv, x128, a=divtrace.Run(chunk=2), samples=[0, 1],
                                progress=False))
        for label, run in (("cuDNN off", divtrace.Run(cudnn=False)),
                           ("TF32 on", divtrace.Run(tf32_matmul=True, tf32_cudnn=True))):
            record(found, lines, f"seed setting: vgg11().features, {label}",
                   divtrace.compare(features, x128, a=divtrace.Run(chunk=2, **_fields(run)),
                                    b=run, samples=[0, 1], progress=False))
        torch.manual_seed(0)
        net = alexnet().eval().to(cuda)
        x100 = torch.randn(100, 3, 227, 227, device=cuda)
        record(found, lines, "seed: AlexNet, 100 per sample",
               divtrace.compare(net, x100, progress=False))
        torch.manual_seed(0)
        eff = efficientnet_v2_s().eval().to(cuda)
        record(found, lines, "seed: efficientnet_v2_s, 64 vs first 2",
               divtrace.compare(eff, torch.rand(64, 3, 224, 224, device=cuda),
                                a=divtrace.Run(chunk=2),
                                samples=[0, 1], progress=False))
    before = precision_state()
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    record(found, lines, "new API: cudnn.conv.fp32_precision='tf32', vgg11().features, 128 "
                         "vs first 2",
           divtrace.compare(features, x128, a=divtrace.Run(chunk=2), samples=[0, 1],
                            progress=False))
    lines.append(f"flags before the new-API case: {before}; after it: {precision_state()}")
    # the first seed report's script: its flags, AlexNet, batch 100 vs 1, rtol=0.1
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.set_float32_matmul_precision("high")
    record(found, lines, "seed report 1's script: AlexNet 100 vs 1, its flags, rtol=0.1",
           divtrace.compare(net, x100, rtol=0.1, progress=False))
    with torch.no_grad():
        batched = net(x100)
        alone = torch.cat([net(x100[i:i + 1]) for i in range(100)])
    rel = ((batched - alone).abs() / alone.abs()).max().item()
    lines.append(f"that script's own check: torch.allclose(batched, alone, rtol=0.1) = "
                 f"{torch.allclose(batched, alone, rtol=0.1)}; largest element-wise "
                 f"relative difference {rel:.3g}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from configs_gpu import SETTINGS

    with SEED.flags():
        swept = divtrace.sweep(features, x128, SETTINGS, chunk=2, samples=[0, 1],
                               progress=False)
    table = swept.table
    lines += ["== the README's sweep settings, vgg11().features 128 vs first 2",
              readable(table[[c for c in ("setting", "verdict", "output_rel_l2",
                                          "first_divergence") if c in table]])
              .to_string(index=False), ""]
    found.append({"case": "sweep", "verdicts": dict(zip(table["setting"], table["verdict"],
                                                        strict=True))})
    with SEED.flags():
        language_models(found, lines, cuda)
        torch.manual_seed(0)
        norm = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        record(found, lines, "train-mode BatchNorm (allow_train=True), 16 per sample",
               divtrace.compare(norm.to(cuda).train(), torch.rand(16, 3, 32, 32, device=cuda),
                                allow_train=True, progress=False))
        lstm = nn.LSTM(16, 32).to(cuda).eval()
        record(found, lines, "LSTM given (T, B, F) with batch_dim=0",
               divtrace.compare(lstm, torch.randn(12, 4, 16, device=cuda), progress=False))
    (args.out / "independence_summary.txt").write_text("\n".join(lines) + "\n")
    (args.out / "independence.json").write_text(json.dumps(found, indent=1) + "\n")
    return 0


def language_models(found: list[dict[str, Any]], lines: list[str], cuda: torch.device
                    ) -> None:
    """Random-init BERT, GPT-2 and Llama on the GPU, with padding: no mixing."""
    import transformers

    torch.manual_seed(0)
    built = {
        "BERT": transformers.BertModel(transformers.BertConfig(
            hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=1024, vocab_size=1000)),
        "GPT-2": transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=256, n_layer=4, n_head=4, vocab_size=1000, n_positions=128)),
        "Llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)),
    }
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 1000, (8, 48), generator=generator).to(cuda)
    mask = torch.ones(8, 48, dtype=torch.long, device=cuda)
    for row, pad in enumerate((0, 5, 0, 17, 3, 0, 30, 9)):
        mask[row, :pad] = 0  # left padding
    for name, model in built.items():
        model = model.to(cuda).eval()
        record(found, lines, f"{name}, padded batch of 8 vs per sample",
               divtrace.compare(model, {"input_ids": ids, "attention_mask": mask},
                                progress=False))
    prompts = [torch.randint(1, 1000, (n,), generator=generator).to(cuda)
               for n in (9, 31, 4, 48, 17, 26)]
    record(found, lines, "Llama, Prompts of 4 to 48 tokens",
           divtrace.compare(built["Llama"], divtrace.Prompts(prompts), progress=False))


def _fields(run: divtrace.Run) -> dict[str, Any]:
    from dataclasses import fields

    return {f.name: getattr(run, f.name) for f in fields(run)
            if f.name != "chunk" and getattr(run, f.name) != f.default}


if __name__ == "__main__":
    raise SystemExit(main())
