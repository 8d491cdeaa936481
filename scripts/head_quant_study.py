"""Where SmolLM2's q4f16_1 loss comes from, and what data-aware rounding of its tied 4-bit head buys (#32).

SmolLM2-135M ties its 49152 x 576 embedding to its LM head; q4f16_1 stores that matrix at 4 bits, which is most
of the scheme's KL against the float model. In torch, on held-out windows (the eval corpus's English texts and
tests/data/reference_en.txt, float64 log-softmax), with every other weight float, this prints the KL of:

1. the converter's q4 of the tied matrix (both uses), of the head alone (input embedding float) and of the input
   embedding alone;
2. the head at q4 with its K most probable rows (mean probability over calibration text) kept float;
3. GPTQ on the head (Frantar et al.: columns rounded in order on the q4 grid, each one's error spread over the
   columns not yet rounded through the inverse Hessian of the head's inputs on calibration text; each group's
   scale and min fitted by the converter's own range search when the rounding reaches it), then re-quantized by
   the converter as `edgellm convert` would, tied and head-only.

Calibration text: docs/*.md and README.md (no held-out text). 1 thread: 267 s and 10.6 GB peak (the calibration
windows' float64 probabilities) at load average 1.5-2.2.

    OMP_NUM_THREADS=1 python scripts/head_quant_study.py --calib-windows 48
"""

from __future__ import annotations

import argparse
import glob
from pathlib import Path

import torch

from edgellm.compress.corpus import token_windows
from edgellm.compress.source import load_float_model
from edgellm.quant.formats import Q4_GROUP, _fit_q4_range, dequantize, quantize

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = [ROOT / "edgellm/eval/data/corpus" / f for f in ("en_declaration.txt", "en_gettysburg.txt",
                                                              "en_original_notes.txt")] + [ROOT / "tests/data/reference_en.txt"]


def q4(w: torch.Tensor) -> torch.Tensor:
    """``w`` as the converter stores it at q4 (dequantized)."""
    return dequantize(quantize(w, "q4"), "q4").float()


def gptq_q4(w: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01, block: int = 128) -> torch.Tensor:
    """``w`` [N, K] rounded to q4 levels column by column, each group's grid fitted when the rounding reaches it."""
    w = w.double().clone()
    k = w.shape[1]
    h = hessian + damp * hessian.diag().mean() * torch.eye(k, dtype=hessian.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    out = torch.zeros_like(w)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1, hi = w[:, i1:i2].clone(), torch.zeros(w.shape[0], i2 - i1, dtype=w.dtype), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            if (i1 + i) % Q4_GROUP == 0:
                scale, mn = _fit_q4_range(w1[:, i:i + Q4_GROUP].float().unsqueeze(1))
                s, m = scale.squeeze(1).half().double(), mn.squeeze(1).half().double()
                safe = torch.where(s > 0, s, torch.ones_like(s))
            col = w1[:, i]
            q = torch.where(s > 0, ((col - m) / safe).round().clamp(0, 15), torch.zeros_like(col)) * s + m
            out[:, i1 + i] = q
            e = (col - q) / hi[i, i]
            w1[:, i:] -= e.unsqueeze(1) @ hi[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return out.float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calib-windows", type=int, default=48, help="windows of 256 tokens of calibration text")
    p.add_argument("--eval-windows", type=int, default=8, help="held-out windows of 256 tokens")
    args = p.parse_args()
    torch.set_num_threads(1)
    fm = load_float_model("smollm2-135m")
    model, tok = fm.model, fm.tokenizer
    held = token_windows(tok, [f.read_text() for f in HELDOUT], 256)[: args.eval_windows]
    calib_files = sorted(glob.glob(str(ROOT / "docs/*.md"))) + [str(ROOT / "README.md")]
    calib = token_windows(tok, [Path(f).read_text() for f in calib_files], 256)
    calib = calib[torch.randperm(len(calib), generator=torch.Generator().manual_seed(0))[: args.calib_windows]]
    emb = model.model.embed_tokens.weight
    if model.lm_head.weight is not emb:
        raise SystemExit("this study is about a tied embedding; the model's head is not tied")
    orig = emb.data.clone()

    def log_probs(windows: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([torch.log_softmax(model(w[None]).logits[0].double(), -1) for w in windows])

    def kl_with(input_emb: torch.Tensor, head: torch.Tensor) -> float:
        emb.data = input_emb
        model.lm_head.weight = emb if head is input_emb else torch.nn.Parameter(head)
        try:
            got = log_probs(held)
        finally:
            emb.data, model.lm_head.weight = orig.clone(), emb
        return (ref.exp() * (ref - got)).sum(-1).mean().item()

    inputs: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_pre_hook(lambda _m, a: inputs.append(a[0][0].detach().double()))
    cal_probs = log_probs(calib).exp().mean(0)
    hook.remove()
    x = torch.cat(inputs)
    ref = log_probs(held)
    rtn = q4(orig)
    print(f"held-out tokens {held.numel()}, calibration tokens {x.shape[0]}")
    print(f"1. q4 tied (both uses) KL {kl_with(rtn, rtn):.5f}; head only {kl_with(orig, rtn):.5f}; "
          f"input embedding only {kl_with(rtn, orig):.5f}")
    order = cal_probs.argsort(descending=True)
    for k in (256, 1024, 4096, 16384):
        mix = rtn.clone()
        mix[order[:k]] = orig[order[:k]]
        print(f"2. head q4 with the {k} most probable rows float (mass {cal_probs[order[:k]].sum().item():.3f}): "
              f"KL {kl_with(orig, mix):.5f}")
    tuned = q4(gptq_q4(orig, x.T @ x / x.shape[0]))
    print(f"3. GPTQ head, re-quantized by the converter: tied KL {kl_with(tuned, tuned):.5f}; "
          f"head only {kl_with(orig, tuned):.5f}")


if __name__ == "__main__":
    main()
