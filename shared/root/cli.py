"""`tandem` command line: the edge where flags become config objects.

Imports are local to each command so `tandem --help` and thin commands start fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="tandem: disaggregated LLM serving (gateway → prefill → decode over gRPC).",
                  no_args_is_help=True, pretty_exceptions_enable=False)

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Preset name, local HF folder, or dummy:<shape>.")]
DeviceOpt = Annotated[str, typer.Option(help="cpu or cuda[:N].")]


@app.command("fetch-model")
def fetch_model_cmd(
    name: Annotated[str, typer.Argument(help="Preset name, e.g. smollm2-135m.")] = "smollm2-135m",
    cache_dir: Annotated[Path | None, typer.Option(help="Default: $TANDEM_HOME or ~/.cache/tandem.")] = None,
) -> None:
    """Download and convert a preset model once (idempotent); print its local folder last."""
    from tandem.shared.models import fetch_model

    path = fetch_model(name, cache_dir=cache_dir, progress=True)
    print(path)


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="Prompt text.")],
    model: ModelOpt = "smollm2-135m",
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    chat: Annotated[bool, typer.Option(help="Apply the model's chat template.")] = True,
    device: DeviceOpt = "cpu",
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's).")] = None,
) -> None:
    """Generate in-process (no servers) and stream the text to the terminal."""
    import torch

    from tandem import LLM, SamplingParams
    from tandem.shared.models import apply_chat_template

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(model, device=device, max_model_len=2048, max_num_batched_tokens=2048)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    prompt_input: str | list[int] = prompt
    if chat and llm.tokenizer is not None:
        prompt_input = apply_chat_template(llm.tokenizer, [{"role": "user", "content": prompt}])
    for piece in llm.stream(prompt_input, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
