"""Whether programmatic dependent launch ($TANDEM_PDL) changes what the engine computes, and where: one greedy
generation of a single prompt, built afresh twice with PDL off and twice on, per weight kind, CUDA graphs on or off
and prompt length; prints whether off matches off, on matches on, and on matches off (tokens and logprobs). A GPU
diagnostic (Hopper); `tests/kernels/test_pdl_gpu.py` is the test.

    python -m tandem.benchmarks.pdl_determinism [--quantization fp8,int8,none] [--prompt-lens 4,40] [--eager]
        [--no-piecewise]
"""

from __future__ import annotations

import argparse
import os

import torch

from tandem import LLM, SamplingParams
from tandem.kernels import _triton


def generate_once(pdl: bool, quantization: str | None, graphs: bool, prompt_len: int, piecewise: bool = True
                  ) -> tuple[list[int], list[float]]:
    os.environ[_triton.PDL_ENV] = "1" if pdl else "0"
    _triton.pdl_requested.cache_clear()
    llm = LLM("dummy:tiny", device="cuda", max_model_len=512, max_num_seqs=16, num_kv_blocks=512,
              quantization=quantization, use_cuda_graphs=graphs, piecewise_cuda_graphs=piecewise)
    prompt = [(5 * j) % 400 + 3 for j in range(prompt_len)]
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    del llm
    torch.cuda.empty_cache()
    return list(out.token_ids), list(out.logprobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="fp8,int8,none")
    parser.add_argument("--prompt-lens", default="4,40")
    parser.add_argument("--eager", action="store_true", help="also without CUDA graphs")
    parser.add_argument("--no-piecewise", action="store_true",
                        help="prompt steps eager (only the decode steps' graphs), to tell the two kinds of graph apart")
    args = parser.parse_args()
    for name in args.quantization.split(","):
        quantization = None if name == "none" else name
        for graphs in (True, False) if args.eager else (True,):
            for prompt_len in (int(n) for n in args.prompt_lens.split(",")):
                piecewise = not args.no_piecewise
                off = [generate_once(False, quantization, graphs, prompt_len, piecewise) for _ in range(2)]
                on = [generate_once(True, quantization, graphs, prompt_len, piecewise) for _ in range(2)]
                line = (f"{name} graphs={graphs} piecewise={piecewise} prompt={prompt_len}: "
                        f"off==off {off[0] == off[1]}, on==on {on[0] == on[1]}, on==off {on[0] == off[0]}, "
                        f"tokens on==off {on[0][0] == off[0][0]}")
                if on[0] != off[0]:
                    gap = max(abs(a - b) for a, b in zip(on[0][1], off[0][1], strict=True))
                    line += f", max logprob difference {gap:.3g}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
