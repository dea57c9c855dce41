"""Images in: a random-weight LLaVA with its processor built here (no hub), served by the engine
against transformers' `generate` on the same weights, all in one process.

    .venv/bin/python -m bench.vision [--shape small] [--turns 3] [--max-tokens 32]
    .venv/bin/python -m bench.vision --save DIR    # the tiny LLaVA as a checkpoint to serve

Prints, per shape: a later turn of a conversation holding an image, its session reused vs
prefilled afresh (TTFT); an image seen again without its KV, the encoder cache hit vs miss;
decode tokens/s with and without an image in the prompt, kvserve vs `generate`. The `tiny`
shape is what tests/server/test_vision.py serves.
"""

from __future__ import annotations

import base64
import functools
import io

import numpy as np
import torch
from PIL import Image

IMAGE_TOKEN = "<image>"
# a chat template of the vision-language kind: an image part is written as the image token,
# which the processor expands into the picture's run of placeholders
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}" + IMAGE_TOKEN + "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# (text hidden, layers, heads, kv heads, intermediate; vision hidden, layers, heads, image side, patch)
SHAPES = {
    "tiny": (64, 2, 4, 2, 128, 32, 2, 2, 32, 8),  # 16 placeholders a picture
    "small": (576, 30, 9, 3, 1536, 768, 12, 12, 224, 16),  # SmolLM2-135M's text shape behind a ViT-B/16: 196 a picture
}


def llava(tokenizer, device="cpu", dtype=torch.float32, seed: int = 0, shape: str = "tiny"):
    """(model, processor) of `shape`: a Llama behind a CLIP encoder, on SmolLM2's tokenizer with
    the image token added (changes `tokenizer`)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor

    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(seed)
    hidden, layers, heads, kv_heads, inner, v_hidden, v_layers, v_heads, side, patch = SHAPES[shape]
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inner, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048)
    vision = CLIPVisionConfig(hidden_size=v_hidden, intermediate_size=4 * v_hidden, num_hidden_layers=v_layers,
                              num_attention_heads=v_heads, image_size=side, patch_size=patch)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_layer=-1)
    model = LlavaForConditionalGeneration(config).to(device=device, dtype=dtype).eval()
    images = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=patch, vision_feature_select_strategy="default",
                               image_token=IMAGE_TOKEN, num_additional_image_tokens=1, chat_template=TEMPLATE)
    return model, processor


IDEFICS3_TOKENS = ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]


def idefics3(tokenizer, device="cpu", dtype=torch.float32, seed: int = 0, family: str = "idefics3"):
    """(model, processor): Idefics3 (or SmolVLM, its successor: `family`) with image splitting,
    so a picture is a global view plus tiles, each tile's 4 placeholders between row/column
    markers; tiny."""
    import importlib

    import transformers
    from transformers import LlamaConfig

    prefix = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[family]
    module = getattr(transformers.models, family)
    image_processor = getattr(importlib.import_module(f"transformers.models.{family}.image_processing_pil_{family}"),
                              f"{prefix}ImageProcessorPil")
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, *IDEFICS3_TOKENS]})
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(seed)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    vision = getattr(module, f"{prefix}VisionConfig")(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                                     image_size=32, patch_size=8)
    config = getattr(module, f"{prefix}Config")(vision_config=vision.to_dict(), text_config=text.to_dict(), scale_factor=2,
                                               image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    model = getattr(module, f"{prefix}ForConditionalGeneration")(config).to(device=device, dtype=dtype).eval()
    images = image_processor(do_image_splitting=True, size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor_class = getattr(module, f"{prefix}Processor")
    if family == "smolvlm":  # a video processor of its own (torchvision): none here
        processor = _images_only(processor_class)(image_processor=images, tokenizer=tokenizer, video_processor=None, image_seq_len=4,
                                                  chat_template=TEMPLATE)
    else:
        processor = processor_class(image_processor=images, tokenizer=tokenizer, image_seq_len=4, chat_template=TEMPLATE)
    return model, processor


QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _images_only(processor_class):
    """`processor_class` built without a video processor: transformers' video processors need
    torchvision, which a CPU machine's torch may lack (the server refuses such a checkpoint at
    load, naming it: server/model_loader.py); images never reach one."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return processor_class.check_argument_for_proper_class(self, argument_name, argument)

    # the family's own name, so that a saved copy names the real class
    return type(processor_class.__name__, (processor_class,), {"check_argument_for_proper_class": check_argument_for_proper_class})


_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
_QWEN3_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8, spatial_merge_size=2,
                     temporal_patch_size=2, num_position_embeddings=16)
_HYBRID = dict(layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4)
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# family -> (processor class name, its text config beyond the common one, its vision config)
_QWEN_VL = {
    "qwen2_vl": ("Qwen2VLProcessor", {}, dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=8,
                                             spatial_merge_size=2, temporal_patch_size=2)),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", {}, dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                                   patch_size=8, spatial_merge_size=2, temporal_patch_size=2, window_size=32,
                                                   fullatt_block_indexes=[1])),
    # interleaved M-RoPE, and deepstack: encoder features added to the first text layers' output
    # (their weights spread wider too, so that leaving them out moves the tokens)
    "qwen3_vl": ("Qwen3VLProcessor", dict(head_dim=16, rope_parameters={**_MROPE, "mrope_interleaved": True}),
                 dict(_QWEN3_VISION, deepstack_visual_indexes=[0, 1], initializer_range=0.3)),
    # hybrids: gated delta-net layers beside attention, M-RoPE on half of each head
    "qwen3_5": ("Qwen3VLProcessor", dict(head_dim=32, rope_parameters={**_MROPE, "mrope_interleaved": True, "partial_rotary_factor": 0.5},
                                         **_HYBRID), _QWEN3_VISION),
}


def _with_experts(family: str, **more):
    """`family`'s entry with its MLPs experts (the MoE variant)."""
    processor, text, vision = _QWEN_VL[family]
    return processor, {**text, **_EXPERTS, **more}, vision


_QWEN_VL["qwen3_vl_moe"] = _with_experts("qwen3_vl")
_QWEN_VL["qwen3_5_moe"] = _with_experts("qwen3_5", shared_expert_intermediate_size=32)


def qwen_vl(family: str, tokenizer, device="cpu", dtype=torch.float32, seed: int = 0):
    """(model, processor) of a Qwen vision-language `family` (`_QWEN_VL`; 3-D M-RoPE: a
    picture's positions are its grid's), tiny: 8x8 patches merged 2x2, so a 48x40 picture is
    3x2 = 6 placeholders."""
    import transformers
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor_name, text_extra, vision = _QWEN_VL[family]
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    template = TEMPLATE.replace(IMAGE_TOKEN, "<|vision_start|><|image_pad|><|vision_end|>")
    tokenizer.chat_template = template
    torch.manual_seed(seed)
    ids = tokenizer.convert_tokens_to_ids
    # NOTE: weights 15x the default spread, so that the rope positions move the greedy tokens
    # (at the default, a tiny model's tokens do not change when a picture's shift is left out)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, initializer_range=0.3, rope_parameters=_MROPE) | text_extra
    config = AutoConfig.for_model(family, text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
                                  video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                                  vision_end_token_id=ids("<|vision_end|>"))
    model = AutoModelForImageTextToText.from_config(config).to(device=device, dtype=dtype).eval()
    images = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=64 * 64)
    processor_class = _images_only(getattr(transformers, processor_name))
    processor = processor_class(image_processor=images, tokenizer=tokenizer, video_processor=None, chat_template=template)
    return model, processor


GEMMA3_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]


def gemma3(tokenizer, device="cpu", dtype=torch.float32, seed: int = 0):
    """(model, processor): Gemma 3, whose picture (4 soft tokens between its start and end
    markers here) attends to itself whole; sliding-window and full layers; tiny."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA3_TOKENS})
    ids = tokenizer.convert_tokens_to_ids
    # the names Gemma3Processor reads off a Gemma tokenizer
    tokenizer.boi_token, tokenizer.eoi_token, tokenizer.image_token = GEMMA3_TOKENS
    tokenizer.boi_token_id, tokenizer.eoi_token_id, tokenizer.image_token_id = map(ids, GEMMA3_TOKENS)
    template = TEMPLATE.replace(IMAGE_TOKEN, GEMMA3_TOKENS[0])
    tokenizer.chat_template = template
    torch.manual_seed(seed)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, sliding_window=16,
                layer_types=["sliding_attention", "full_attention"], bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=ids(GEMMA3_TOKENS[0]),
                          eoi_token_index=ids(GEMMA3_TOKENS[1]), image_token_index=ids(GEMMA3_TOKENS[2]))
    model = Gemma3ForConditionalGeneration(config).to(device=device, dtype=dtype).eval()
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = Gemma3Processor(image_processor=images, tokenizer=tokenizer, chat_template=template, image_seq_length=4)
    return model, processor


BUILDERS = {"llava": llava, "idefics3": idefics3, "smolvlm": functools.partial(idefics3, family="smolvlm"), "gemma3": gemma3, **{family: functools.partial(qwen_vl, family) for family in _QWEN_VL}}


def picture(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    """A random RGB picture (width, height)."""
    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def reference(model, processor, messages: list[dict], images: list[Image.Image], max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate` on the processor's inputs for `messages` (template parts)."""
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=False).to(model.device)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


# -- the benchmark -------------------------------------------------------------------------------

class _Served:
    """One started engine over `model` (session reuse on or off), fed prompts with pictures."""

    def __init__(self, model, processor, reuse: bool = True) -> None:
        from cache_manager.manager import CacheConfig, CacheManager
        from server.api.vision_prompt import Vision
        from server.engine import vision
        from server.engine.core import Engine, EngineConfig
        from server.metrics import Metrics

        self.processor = processor
        self.metrics = Metrics()
        cache = CacheManager(model.config, model.device, model.dtype, 2048, CacheConfig(budget_bytes=2**30, reuse=reuse), self.metrics)
        self.engine = Engine(model, processor.tokenizer, EngineConfig(max_context=2048, max_batch_tokens=2048), cache, metrics=self.metrics)
        self.engine.start()
        self.vision = Vision(processor, vision.image_token_id(model.config), span=self.engine.runner.encoder.span)

    def prompt(self, messages: list[dict], pictures: list[Image.Image]):
        from server.api.media import MediaLimits, decode
        from server.api.vision_prompt import tokens

        read = []
        for p in pictures:
            buffer = io.BytesIO()
            p.save(buffer, format="PNG")
            read.append(decode(buffer.getvalue(), "bench", MediaLimits()))
        text = self.processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokens(self.vision, text, read, "messages")

    def generate(self, messages, pictures, max_tokens: int, session: str | None = None) -> tuple[list[int], float, float]:
        """(tokens, TTFT s, decode tokens/s after the first) of one greedy request."""
        import asyncio
        import time

        from server.engine.sampling import SamplingParams
        from server.engine.sequence import GenerationRequest

        ids, spans = self.prompt(messages, pictures)
        request = GenerationRequest(f"r{time.monotonic_ns()}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                    session_id=session, use_session=session is not None, images=spans)

        async def run():
            start, first, out = time.perf_counter(), None, []
            async for chunk in self.engine.submit(request, asyncio.get_running_loop()):
                out += [t.token_id for t in chunk.tokens]
                first = first or (time.perf_counter() if out else None)
                self.prefilled = (len(ids) - chunk.cached_tokens, len(ids))
            end = time.perf_counter()
            return out, first - start, (len(out) - 1) / max(end - first, 1e-9)

        return asyncio.run(run())

    def stop(self) -> None:
        self.engine.stop()


def _generate_speed(model, processor, messages, pictures, max_tokens: int) -> float:
    """transformers' greedy `generate`: decode tokens/s (the whole call less one prefill)."""
    import time

    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=pictures or None, return_tensors="pt", add_special_tokens=False).to(model.device)
    start = time.perf_counter()
    model.generate(**inputs, max_new_tokens=1, do_sample=False)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return (max_tokens - 1) / max(time.perf_counter() - start - prefill, 1e-9)


def main() -> None:
    import argparse
    import copy
    import statistics

    from bench.architectures import tokenizer as smollm2_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--save", metavar="DIR", help="write the tiny LLaVA (weights, processor, chat template) to DIR and exit: "
                        "a vision-language checkpoint to serve (docs/guides/images.md)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if args.save:
        model, processor = llava(smollm2_tokenizer(), shape="tiny")
        model.save_pretrained(args.save)
        processor.save_pretrained(args.save)
        print(f"a random-weight LLaVA in {args.save}")
        return
    model, processor = llava(smollm2_tokenizer(), shape=args.shape)
    reference_model = llava(copy.deepcopy(processor.tokenizer), shape=args.shape)[0]  # the same weights, untouched
    a, b = picture(1, (320, 240)), picture(2, (240, 320))

    def conversation(turn: int) -> list[dict]:
        messages = [{"role": "user", "content": [{"type": "text", "text": "Here is a photo: "}, {"type": "image"},
                                                 {"type": "text", "text": " What is in it?"}]}]
        for k in range(turn):
            messages += [{"role": "assistant", "content": f"It shows item {k}, a harbor in winter light."},
                         {"role": "user", "content": f"And what about detail {k}? Tell me more about the ships."}]
        return messages

    rows, computed, identical, total = {}, {}, 0, 0
    for reuse in (True, False):
        served = _Served(model, processor, reuse)
        try:
            ttfts, prefilled = [], []
            for turn in range(args.turns):
                out, ttft, _ = served.generate(conversation(turn), [a], args.max_tokens, session="s")
                if turn:
                    ttfts.append(ttft)
                    prefilled.append(served.prefilled)
                want = reference(reference_model, processor, conversation(turn), [a], args.max_tokens)
                identical, total = identical + (out == want), total + 1
            rows[reuse] = statistics.median(ttfts)
            computed[reuse] = sum(n for n, _ in prefilled), sum(total for _, total in prefilled)
        finally:
            served.stop()
    served = _Served(model, processor, reuse=False)  # no KV kept: every request prefills its picture
    try:
        served.generate(conversation(0), [b], 1)  # warm-up (and b's features into the encoder cache)
        _, miss, _ = served.generate(conversation(0), [a], 1)
        _, hit, _ = served.generate(conversation(0), [a], 1)
        with_image = served.generate(conversation(0), [a], args.max_tokens)[2]
        text_only = served.generate([{"role": "user", "content": "What is in a harbor in winter?"}], [], args.max_tokens)[2]
    finally:
        served.stop()
    gen_image = _generate_speed(reference_model, processor, conversation(0), [a], args.max_tokens)
    gen_text = _generate_speed(reference_model, processor, [{"role": "user", "content": "What is in a harbor in winter?"}], [], args.max_tokens)
    print(f"random-weight LLaVA, shape {args.shape!r} ({model.config.text_config.num_hidden_layers} text layers, "
          f"{model.config.vision_config.num_hidden_layers} vision layers), fp32, CPU, {torch.get_num_threads()} threads\n")
    print("| measure | kvserve | baseline | ratio |")
    print("|---|---|---|---|")
    print(f"| later-turn TTFT with an image in the conversation (s): session reused / prefilled afresh | "
          f"{rows[True]:.3f} | {rows[False]:.3f} | **{rows[True] / rows[False]:.3f}** |")
    print(f"| later turns' prompt tokens prefilled: session reused / afresh (the TTFT ratio's floor) | "
          f"{computed[True][0]} of {computed[True][1]} | {computed[False][0]} of {computed[False][1]} | "
          f"**{computed[True][0] / computed[False][0]:.3f}** |")
    print(f"| TTFT of an image seen again without its KV (s): encoder cache hit / miss | {hit:.3f} | {miss:.3f} | **{hit / miss:.3f}** |")
    print(f"| decode tokens/s, an image in the prompt: kvserve / generate | {with_image:.1f} | {gen_image:.1f} | **{with_image / gen_image:.2f}** |")
    print(f"| decode tokens/s, text only: kvserve / generate | {text_only:.1f} | {gen_text:.1f} | **{text_only / gen_text:.2f}** |")
    print(f"\ngreedy outputs identical to generate's: {identical} of {total}")


if __name__ == "__main__":
    main()
