"""POST /v1/responses without HTTP: a Responses request served by the chat path, its output as Responses
items and streaming events.

Invariants:
- The request becomes a chat request (`ResponsesRequest.to_chat`) and runs through the chat path's
  machinery: `OpenAIServing.chat_prompt`, `forced_call`, `_submit_choices`, `_events` and the
  `OutputAssembler`; so the same conversation and seed give the same text on both endpoints.
- One `ResponseBuilder` turns the assembler's text deltas into output items and events, streamed
  or not: the non-streaming response is the builder fed the same deltas with the events dropped,
  so the two carry the same items and text.
- Items, in the order their text first appears: `reasoning` (the thought channel, as
  `reasoning_text`), `message` (one `output_text` part), then one `function_call` per tool call
  (reported when the output is complete). A change between reasoning and content closes the open
  item. Without content or calls the output is one empty message.
- Streaming events follow OpenAI's names and order: `response.created`, `response.in_progress`,
  per item `response.output_item.added`, `response.content_part.added`, `response.output_text.delta`
  (or `response.reasoning_text.delta` / `response.function_call_arguments.delta`), their `.done`
  events, `response.output_item.done`, then `response.completed` (`response.incomplete` when
  max_output_tokens cut the output; `response.failed` when generation failed). Each SSE message is
  `event: TYPE` + `data: JSON` with a `sequence_number`; there is no `[DONE]` line.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any, AsyncIterator

from .protocol import APIError, ChatCompletionRequest, Sampling
from .responses_protocol import (IncompleteDetails, ResponseError, ResponseObject, ResponsesRequest, ResponseUsage,
                                 responses_error)
from .worker import RowCommit
from .serving import Delta, Disconnected, Final, OpenAIServing, Stream, _Run


class ResponseBuilder:
    """Text deltas and the final output of one run -> Responses output items and streaming events."""

    def __init__(self, req: ResponsesRequest, model: str):
        self.req, self.model = req, model
        self.id = "resp_" + secrets.token_hex(12)
        self.created = int(time.time())
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item text is going into
        self.seq = 0

    # ---------------------------------------------------------------- events
    def _event(self, type: str, **fields) -> dict[str, Any]:
        self.seq += 1
        return {"type": type, "sequence_number": self.seq - 1, **fields}

    def response(self, status: str = "in_progress", usage: ResponseUsage | None = None,
                 error: ResponseError | None = None) -> ResponseObject:
        r = self.req
        return ResponseObject(
            id=self.id, created_at=self.created, status=status, error=error, model=self.model, output=self.items,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=r.instructions, max_output_tokens=r.max_output_tokens, reasoning=r.reasoning,
            parallel_tool_calls=r.parallel_tool_calls is not False, tool_choice=r.tool_choice or "auto",
            tools=r.tools or [], truncation=r.truncation or "disabled", usage=usage, user=r.user,
            metadata=r.metadata or {}, temperature=r.temperature, top_p=r.top_p,
            **({"text": r.text} if r.text is not None and r.text.format is not None else {}))

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.response().model_dump()
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def delta(self, d: Delta) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for kind, text in (("reasoning", d.reasoning), ("message", d.content)):
            if text:
                if self.open is None or self.open["type"] != kind:
                    out += self._close() + self._open(kind)
                part = self.open["content"][0]
                part["text"] += text
                name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
                extra = {"logprobs": []} if kind == "message" else {}
                out.append(self._event(name, item_id=self.open["id"], output_index=len(self.items) - 1,
                                       content_index=0, delta=text, **extra))
        return out

    def _open(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": "rs_" + secrets.token_hex(12), "type": "reasoning", "summary": [], "status": "in_progress",
                    "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self.open = item
        i = len(self.items) - 1
        added = self._event("response.output_item.added", output_index=i, item=json.loads(json.dumps(item)))
        item["content"].append(part)
        return [added, self._event("response.content_part.added", item_id=item["id"], output_index=i,
                                   content_index=0, part=dict(part))]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        i, part = self.items.index(item), item["content"][0]
        item["status"] = status
        if item["type"] == "message":
            done = self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=part["text"], logprobs=[])
        else:
            done = self._event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                               text=part["text"])
        return [done, self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                                  part=dict(part)),
                self._event("response.output_item.done", output_index=i, item=json.loads(json.dumps(item)))]

    def finish(self, final: Final, usage: ResponseUsage) -> list[dict[str, Any]]:
        """The last text, the tool calls, and `response.completed` / `response.incomplete`."""
        out = self.delta(final.last)
        status = "incomplete" if final.finish_reason == "length" else "completed"
        if not final.tool_calls and not any(it["type"] == "message" for it in self.items):
            out += self._close() + self._open("message")  # the answer is empty: still one message
        out += self._close(status)  # the item the limit cut is incomplete too (OpenAI's shape)
        for c in final.tool_calls:
            item = {"id": "fc_" + secrets.token_hex(12), "type": "function_call", "call_id": c.id, "name": c.name,
                    "arguments": "", "status": "in_progress"}
            self.items.append(item)
            i = len(self.items) - 1
            out.append(self._event("response.output_item.added", output_index=i, item=dict(item)))
            item["arguments"] = c.arguments_json
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                   delta=item["arguments"]))
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                   arguments=item["arguments"]))
            item["status"] = "completed"
            out.append(self._event("response.output_item.done", output_index=i, item=dict(item)))
        self.final = self.response(status, usage)
        return out + [self._event(f"response.{status}", response=self.final.model_dump())]

    def fail(self, e: APIError) -> dict[str, Any]:
        for item in self.items:
            item["status"] = "incomplete" if item["status"] == "in_progress" else item["status"]
        failed = self.response("failed", error=ResponseError(code=e.code or e.type, message=e.message))
        return self._event("response.failed", response=failed.model_dump())


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ResponsesServing:
    """POST /v1/responses on top of the chat path of `OpenAIServing`."""

    def __init__(self, serving: OpenAIServing):
        self.s = serving

    async def create(self, req: ResponsesRequest, disconnected: Disconnected | None = None):
        """A ResponseObject, or (stream=True) an async iterator of SSE strings."""
        s = self.s
        s._check_model(req.model)
        try:
            chat = req.to_chat()
            sampling = chat.to_sampling(s.limits, s.defaults)
            ids = await asyncio.to_thread(self.prompt, chat, req.truncation == "auto", s.prompt_room(sampling))
            sampling, fixed = s.forced_call(chat, sampling)
            run = s._submit_choices(ids, sampling, fixed_tokens=fixed)[0]
        except APIError as e:
            raise responses_error(e) from None
        return await self.respond(run, sampling, req, disconnected)

    def prompt(self, chat: ChatCompletionRequest, auto: bool, room: int) -> list[int]:
        """The chat prompt's ids. truncation "auto": a conversation over `room` tokens (the prompt limit, or what
        the model's positions leave beside the budget the request gave: `OpenAIServing.prompt_room`) loses its
        oldest turns, whole (a user message and what follows it up to the next one), after its system messages, as
        few as make it fit; the last turn always stays (alone over the room: the chat path's 400)."""
        msgs = chat.messages
        first = next((i for i, m in enumerate(msgs) if m.role not in ("system", "developer")), len(msgs))
        starts = [i for i in range(first + 1, len(msgs)) if msgs[i].role == "user"]  # where later turns begin
        if not auto or not starts:
            return self.s.chat_prompt(chat)  # (over the limit: refused when submitted)

        def ids_without(k: int) -> list[int] | None:  # the prompt with the k oldest turns dropped, if it fits
            shorter = chat if k == 0 else chat.model_copy(update={"messages": msgs[:first] + msgs[starts[k - 1]:]})
            try:
                ids = self.s.chat_prompt(shorter)
            except APIError as e:
                if e.code != "context_length_exceeded":
                    raise
                return None
            return ids if len(ids) <= room else None

        lo, hi = 0, len(starts)  # the fewest turns dropped that fit: a prompt only shortens as more are dropped
        found = {k: ids for k in (lo, hi) if (ids := ids_without(k)) is not None}
        if hi not in found:  # even the last turn alone is over the limit: the chat path's 400 for it
            return self.s.chat_prompt(chat.model_copy(update={"messages": msgs[:first] + msgs[starts[-1]:]}))
        while lo not in found and hi - lo > 1:
            mid = (lo + hi) // 2
            ids = ids_without(mid)
            if ids is None:
                lo = mid
            else:
                hi, found[mid] = mid, ids
        return found[lo] if lo in found else found[hi]

    async def respond(self, run: _Run, sampling: Sampling, req: ResponsesRequest,
                      disconnected: Disconnected | None = None):
        """Engine events of a submitted run -> ResponseObject, or (req.stream) an SSE iterator."""
        asm = self.s._new_assembler(sampling, chat=True)
        builder = ResponseBuilder(req, self.s.model_name)
        if req.stream:
            return Stream(self._stream(run, asm, builder, disconnected), [run])
        final = await self.s._collect(run, asm, disconnected, lambda ev: (ev.tokens, None), on_delta=builder.delta)
        builder.finish(final, self._usage(run, final))
        return builder.final

    def _usage(self, run: _Run, final: Final) -> ResponseUsage:
        return ResponseUsage.of(self.s._usage(run, final))

    async def _stream(self, run: _Run, asm, builder: ResponseBuilder,
                      disconnected: Disconnected | None) -> AsyncIterator[str]:
        try:
            for e in builder.start():
                yield _sse(e)
            async for ev in self.s._events(run, asm, disconnected):
                if isinstance(ev, RowCommit):
                    for e in builder.delta(asm.feed(ev.tokens)):
                        yield _sse(e)
            final = asm.finish()
            for e in builder.finish(final, self._usage(run, final)):
                yield _sse(e)
        except APIError as e:
            yield _sse(builder.fail(e))
        finally:
            self.s._release(run, not asm.done)
