"""POST /tokenize and /detokenize (vLLM's shape): what a prompt or a conversation costs in the
served model's tokens, counted as the engine would take it (a conversation through the same
chat path, pictures' placeholders included), and token ids back to text."""

import asyncio

from fastapi import APIRouter, Request

from server.api import reasoning, serving_chat
from server.api.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server.engine import vision

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    ctx = request.app.state.kv.require_ctx()
    if body.model is not None:
        ctx.check_model(body.model)
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = (await asyncio.to_thread(ctx.tokenizer, body.prompt, add_special_tokens=special))["input_ids"]
    else:
        chat = body.chat
        template_kwargs, _ = reasoning.controls(ctx, None, chat.chat_template_kwargs, None)
        ids, _ = await serving_chat.prompt(ctx, chat, template_kwargs, bounded=False, generation_prompt=body.add_generation_prompt,
                                           continue_final=body.continue_final_message)
        if ctx.vision is not None:  # pictures' positions as the model's placeholder token
            ids = vision.placeholder_ids(ids, ctx.vision.placeholder)
        if body.add_special_tokens:
            ids = ctx.tokenizer.build_inputs_with_special_tokens(ids)
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_context, tokens=ids, token_strs=strs)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    ctx = request.app.state.kv.require_ctx()
    if body.model is not None:
        ctx.check_model(body.model)
    ctx.check_token_ids(body.tokens, "tokens")
    return DetokenizeResponse(prompt=await asyncio.to_thread(ctx.tokenizer.decode, body.tokens))
