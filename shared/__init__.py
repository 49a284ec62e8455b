"""tandem: disaggregated LLM serving.

`from tandem import LLM, SamplingParams` is the in-process (offline) API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]

if TYPE_CHECKING:
    from tandem.common.sampling_params import SamplingParams
    from tandem.engine.llm import LLM, RequestOutput


def __getattr__(name: str) -> Any:
    # Lazy, so `tandem --help` and the services do not pay for torch until they need it.
    if name in ("LLM", "RequestOutput"):
        from tandem.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from tandem.common.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
