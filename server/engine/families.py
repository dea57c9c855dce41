"""What a model family needs from the engine, checked before it serves.

kvserve runs transformers' own modeling code with its attention function and KV pool swapped in
(server/engine/attention.py, cache_manager/kv.py), so a feature of a family that reaches the
attention call or the cache must be modelled, or the family refused at load with the feature
named: a model that runs and gives other tokens than transformers is the failure to prevent.

`check(model)` refuses, with `UnsupportedModel` naming the feature:

* by what the config and modules say (`_static`): modeling code that never calls transformers'
  attention interface (Falcon, Bloom, MPT, GPT-J...: `_uses_attention_interface`; transformers'
  flag `_supports_attention_backend` is not the test, StableLM calls it without the flag),
  attention shapes that differ per layer, layer kinds without a KV layout (indexed attention:
  `kv.UnsupportedLayers`), recurrent modules in layers the config calls attention, rope whose
  frequencies follow the sequence length other than LongRoPE (dynamic NTK);
* by running it (`_probe`): one sequence prefilled, then continued beside another sequence in
  one packed forward and its last token decoded in a third, through kvserve's attention,
  against transformers' own forward of the whole sequence. Every layer must attend exactly
  once per pass with the layout's key and value
  widths, every keyword the attention function receives must be one kvserve models and its
  mask the runner's own (else the attention refuses it: `attention._refuse_unknown`), and the
  logits must agree. A feature a
  new transformers release adds fails here rather than producing text.

Modelled, so served: sliding windows, chunked attention and the NoPE layers' query temperature
(Llama 4: `kv.Layout`, server/engine/temperature.py), soft-capping, attention sinks (gpt-oss), unequal key and
value widths (MLA: DeepSeek-V3, Kimi K2), multi-head latent attention from its latent
(server/engine/mla.py: a latent the probe finds different goes back to decompressed heads),
LongRoPE per sequence (server/engine/rope.py).
"""

from __future__ import annotations

import re
import sys
import threading

import torch
from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError

from cache_manager import kv, state
from server.engine import mla, rope
from server.engine.unsupported import UnsupportedModel


# Words in the class names of modules that keep per-sequence state across tokens (no KV layout);
# their families are refused until a state store serves them. A module with Mamba's `A_log` is one
# whatever its name.
_RECURRENT = re.compile(r"Mamba|GatedDeltaNet|DeltaNet|LinearAttention|LightningAttention|ShortConv|Rwkv|RWKV|Ssm|SSM|Xlstm|xLSTM|Retention")
_PROBE_PREFIX, _PROBE_CONTINUATION, _PROBE_OTHER = 11, 9, 6  # tokens of the probe's sequences


def check(model) -> None:
    """Raise UnsupportedModel when `model` has a feature the engine does not model (see the
    module docstring). Switches the model to kvserve's attention (calls without kvserve's step
    still run the model's own). Runs once per model: a passing model is marked."""
    if getattr(model, "_kvserve_checked", False):
        return
    if not mla.configured(model):
        mla.configure(model)  # MLA from its latent where it can be (the server configures it from its settings first)
    layout = check_config(model)
    try:
        _on_own_thread(_probe, model, layout)
    except UnsupportedModel as exc:
        if not layout.latent:
            raise
        mla.fall_back(model, f"{exc.feature}: {exc}")
        layout = check_config(model)
        _on_own_thread(_probe, model, layout)
    model._kvserve_checked = True


def check_config(model) -> kv.Layout:
    """The part of `check` that reads the config and the modules only (no forward pass, the
    model left as it is); returns the KV layout."""
    return _static(model, model.config.get_text_config(decoder=True))


def _on_own_thread(fn, *args) -> None:
    """fn(*args) on a thread that ends with it; re-raises what it raised.

    NOTE: the probe runs multi-threaded torch ops, and a thread that did keeps its OpenMP team
    while it lives: run on the server's main thread, every later engine step slowed down by
    half on 2 cores (docs/architecture.md, "One OpenMP team")."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="kvserve-probe")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def _static(model, config) -> kv.Layout:
    try:
        layout = kv.layout(model.config)
    except AmbiguousGlobalPerLayerAttributeError:
        raise UnsupportedModel("per-layer-config", "its layers differ in attention shape (head size per layer, "
                               "transformers' per-layer config), where kvserve's pool holds one shape") from None
    except kv.UnsupportedLayers as exc:
        kinds = ", ".join(exc.kinds)
        if exc.kinds == ["dummy"]:  # transformers' type for a layer that keeps no cache of its own
            raise UnsupportedModel("layers-without-kv", "some of its layers keep no keys and values of their own "
                                   "and share none kvserve knows the source of") from None
        named = [k for k in exc.kinds if k != "dummy"]  # "dummy": transformers' layers without attention
        raise UnsupportedModel(f"layers-{named[0]}", f"its layers of type {kinds} keep no KV cache kvserve can hold") from None
    _check_recurrent(model, layout)
    if layout.attending and getattr(model, "_supports_attention_backend", True) is False and not _uses_attention_interface(model):
        raise UnsupportedModel("attention-backend", f"{type(model).__name__} computes attention in its own modeling code, "
                               "not through transformers' attention interface, where kvserve's attention and KV pool plug in")
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        if any(isinstance(k, str) and "dynamic" in k for k in kinds):
            raise UnsupportedModel("dynamic-rope", "its rope frequencies follow the longest sequence a forward pass has seen "
                                   "(dynamic NTK scaling), which depends on what else runs")
        if isinstance(rope_type, dict) and "longrope" in rope_type.values():
            raise UnsupportedModel("longrope-per-layer-type", "its LongRoPE differs per layer type, which kvserve does not switch per sequence")
    if layout.rope_switch is not None and not rope.longrope_modules(model):
        raise UnsupportedModel("longrope-module", "its config asks for LongRoPE but no rotary module of its own applies it "
                               "where kvserve could switch it per sequence")
    return layout


def _uses_attention_interface(model) -> bool:
    """Whether some module of `model` comes from modeling code that calls transformers'
    attention interface (`ALL_ATTENTION_FUNCTIONS`). transformers' flag
    `_supports_attention_backend` is not the test: StableLM's attention calls the interface
    without it; the probe then checks that every layer does."""
    names = {type(m).__module__ for m in model.modules()}
    return any(getattr(sys.modules.get(name), "ALL_ATTENTION_FUNCTIONS", None) is not None for name in names)


def _check_recurrent(model, layout: kv.Layout) -> None:
    """A hybrid is served when every layer its cache gives a recurrent state to is a module
    that keeps it through transformers' cache interface (server/engine/recurrent.py wraps
    those) and some layers attend; recurrent modules anywhere else are refused."""
    spec = state.spec(model.config, model.dtype)
    if spec is None:
        named = sorted({type(m).__name__ for m in model.modules() if _RECURRENT.search(type(m).__name__) or hasattr(m, "A_log")})
        if named:
            raise UnsupportedModel("recurrent-layers", f"its layers {', '.join(named)} keep a recurrent state per sequence "
                                   "in layers its config calls attention")
        return
    if not spec.shapes:
        raise UnsupportedModel("recurrent-cache", "its recurrent layers keep their state in a cache of their own, outside "
                               "transformers' cache interface, where kvserve's state slots plug in")
    wrapped = {module.layer_idx for module, _ in state.recurrent_modules(model)}
    if wrapped != set(spec.layers):
        raise UnsupportedModel("recurrent-layers", f"its layers {sorted(set(spec.layers) ^ wrapped)} keep a recurrent state "
                               "kvserve cannot find the module of")


def check_hybrid_modes(*, speculative: bool, exact: bool, draft: bool = False) -> None:
    """Refuse the modes a hybrid model's recurrent state is not modelled in (at start-up)."""
    if speculative:
        raise UnsupportedModel("recurrent-speculative", "speculative decoding on a model with recurrent layers: a rejected "
                               "draft would have to be taken back out of the recurrent state, which kvserve does not "
                               "snapshot per draft position; serve it with --speculative off")
    if draft:
        raise UnsupportedModel("recurrent-draft", "a draft model with recurrent layers: its state cannot be cut back to "
                               "the accepted tokens; choose an attention-only draft model")
    if exact:
        raise UnsupportedModel("recurrent-exact", "exact mode (--deterministic) on a model with recurrent layers: their "
                               "kernels are not batch-invariant in kvserve yet; serve it without --deterministic")


def _probe(model, layout: kv.Layout) -> None:
    """One packed step against transformers' own forward (see the module docstring)."""
    from server.engine.attention import Row
    from server.engine.model_runner import ModelRunner

    config = model.config.get_text_config(decoder=True)
    vocab = min(int(config.vocab_size), 4096)
    ids = torch.randint(3, vocab, (_PROBE_PREFIX + _PROBE_CONTINUATION + _PROBE_OTHER,), generator=torch.Generator().manual_seed(0)).tolist()
    whole, other = ids[: _PROBE_PREFIX + _PROBE_CONTINUATION], ids[-_PROBE_OTHER:]
    with torch.inference_mode():
        reference = model(input_ids=torch.tensor([whole], device=model.device), use_cache=False).logits[0, _PROBE_PREFIX:].float()
        capacity = 2 * kv.BLOCK_SIZE * kv.blocks_for(len(whole))
        pool = kv.Pool(model.config, kv.bytes_for(model.config, 2 * capacity, model.dtype, sequences=2), model.device, model.dtype,
                       state_slots=2)
        # NOTE: packed=None: packing CPU weights is the serving runner's, on its own thread
        runner = ModelRunner(model, pool, paged=False, cuda_graphs=False, packed=None, overlap=False)
        first, second = pool.allocate(len(whole)), pool.allocate(len(other))
        seen: list[int] = []
        runner.observe = lambda layer, key, value: seen.append(_observed(layer, key, value, layout))
        runner.forward([Row(first, _PROBE_PREFIX)], whole[:_PROBE_PREFIX], [0])
        _check_layers(seen, layout)
        seen.clear()
        # the continuation but its last token beside the other sequence's prefill; then that token
        # decoded beside two more of the other's: chunks and a decode row, and both in one step
        head = whole[_PROBE_PREFIX:-1]
        got = runner.forward([Row(second, len(other) - 2), Row(first, len(head))], other[:-2] + head, [1], [len(head)])
        _check_layers(seen, layout)
        seen.clear()
        got = torch.cat([got, runner.forward([Row(first, 1), Row(second, 2)], whole[-1:] + other[-2:], [0])])
        _check_layers(seen, layout)
    difference = float((got - reference).abs().max())
    scale = float(reference.abs().max()) or 1.0
    # NOTE: every family of the matrix differs by at most 7e-7 of the scale in fp32; 1e-3 let
    # Jamba's continuation chunks through while they dropped the kept Mamba state (2.6e-4)
    tolerance = 2e-5 if model.dtype == torch.float32 else 0.1
    if not difference <= tolerance * scale:
        raise UnsupportedModel("forward-mismatch", f"its logits under kvserve's attention differ from transformers' own forward "
                               f"(by {difference:.3g} of {scale:.3g}): a feature kvserve does not model")


def _observed(layer: int, key: torch.Tensor, value: torch.Tensor, layout: kv.Layout) -> int:
    """A layer about to attend, with the layout's KV heads and key and value widths (before
    the pool stores them); returns the layer."""
    heads, key_dim, value_dim = key.shape[1], key.shape[3], value.shape[3]
    if (heads, key_dim, value_dim) != (layout.kv_heads, layout.key_dim, layout.value_dim) or value.shape[1] != heads:
        raise UnsupportedModel("kv-width", f"layer {layer} has {heads} KV heads of keys {key_dim} and values {value_dim} "
                               f"wide, where its config says {layout.kv_heads} of {layout.key_dim} and {layout.value_dim}")
    return layer


def _check_layers(seen: list[int], layout: kv.Layout) -> None:
    """Every layer of the layout attended exactly once in a pass."""
    if sorted(seen) != list(layout.attending):
        raise UnsupportedModel("kv-layers", f"its attention ran in layers {sorted(seen)} of a pass, where its config "
                               f"gives attention layers {list(layout.attending)} (KV shared or skipped)")
