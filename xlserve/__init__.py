"""xlserve: a serving stack for large language models, built for agentic traffic."""

from xlserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name):
    # Importing torch takes seconds: load the engine only when it is asked for.
    if name == "LLM":
        from xlserve.llm import LLM
        return LLM
    raise AttributeError(name)
