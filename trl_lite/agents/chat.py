"""A tokenizer's chat template as the token layout of a multi-turn episode (docs/algorithm.md section 16).

Token in, token out: the model's turns are kept as the ids it sampled; only what the template adds
around them (the tool or environment messages and the next generation prompt) is rendered and
tokenized here. That text is the difference between the template's rendering of the conversation
with the new messages and without them, cut right after the model's end-of-turn token, and its
tokens are checked to be exactly the last tokens of the whole rendering, after that end-of-turn
token: the sequence the model sees next is the one the template would give.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# Text of an assistant turn whose end the template must show; nothing a model or a template writes.
_TURN_MARKER = "TRL_LITE_ASSISTANT_TURN_MARKER"


@dataclass(frozen=True)
class ToolCall:
    """One ``<tool_call>`` block of a model turn: the tool's name and arguments, or why it could not be read."""

    name: str | None
    arguments: dict | None
    error: str | None = None


class ChatFormat:
    """Renders and tokenizes the conversations of one tokenizer's chat template.

    Args:
        tokenizer: a transformers tokenizer with a ``chat_template``.
        tools: JSON schemas (``get_json_schema`` dicts) handed to the template, or None.

    Attributes:
        end_of_turn_id: the token the template closes an assistant turn with (``<|im_end|>`` for
            ChatML templates); a model turn ends there.
    """

    def __init__(self, tokenizer, tools: list[dict] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer ({type(tokenizer).__name__}) has no chat_template; multi-turn episodes are laid out "
                "by the template (tokenizer.chat_template = '<a Jinja template>', e.g. a ChatML one with Hermes-style "
                "<tool_call> blocks as Qwen's)."
            )
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.end_of_turn_id, self.end_of_turn_text = self._end_of_turn()
        if self.tools:
            user = [{"role": "user", "content": "u"}]
            if self.render(user, False) == self.tokenizer.apply_chat_template(user, tokenize=False):
                raise ValueError(
                    "the tokenizer's chat_template ignores tools: rendered with and without them the prompt is the same, "
                    "so the model would never see the tools' schemas. Use a template that renders `tools`."
                )

    def _end_of_turn(self) -> tuple[int, str]:
        """The first token the template writes after an assistant message's content; it must be an added
        (special) token, so that it always stays one token and ends a turn on a token boundary."""
        messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _TURN_MARKER}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        after = text[text.rindex(_TURN_MARKER) + len(_TURN_MARKER) :] if _TURN_MARKER in text else ""
        ids = self.encode(after)
        if not ids:
            raise ValueError(
                "the chat_template writes nothing after an assistant message's content, so a model turn has no "
                "end-of-turn token to stop at; use a template that closes assistant turns (e.g. with <|im_end|>)."
            )
        token_id = ids[0]
        token_text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if token_id not in self.tokenizer.added_tokens_decoder or not after.startswith(token_text):
            raise ValueError(
                f"the chat_template closes an assistant turn with {after!r}, whose first token {token_text!r} is not "
                "an added (special) token; a model turn must end at a token of its own (e.g. <|im_end|>)."
            )
        return token_id, token_text

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (no BOS/EOS added: the template writes its own)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        """Text of model tokens, special tokens kept (``<tool_call>`` must survive)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def query(self, messages: list[dict]) -> tuple[list[int], str]:
        """The prompt's tokens up to and including the first generation prompt, and their text."""
        text = self.render(messages, True)
        return self.encode(text), text

    def continuation(self, rendered: str, messages: list[dict], new_messages: list[dict]) -> tuple[list[int], str]:
        """The tokens the template adds after a model turn: the rest of that turn after its end-of-turn
        token, ``new_messages`` and the next generation prompt; and the new rendering with its prompt.

        ``rendered``: the text the model's last turn continued (the conversation before it, with the
        generation prompt); ``messages``: the conversation with that turn as its last, assistant, message.
        Raises ValueError when the template renders the earlier conversation differently once more
        messages follow (the sequence could not grow token by token) or tokenizes the added text
        differently from the whole rendering.
        """
        turn = self.render(messages, False)
        end = turn.rfind(self.end_of_turn_text)
        if not turn.startswith(rendered) or end < len(rendered):
            raise ValueError(
                "the chat_template renders a conversation and the same conversation with the model's turn added "
                "differently before that turn (or closes the turn without its end-of-turn token "
                f"{self.end_of_turn_text!r}); a multi-turn episode needs a template whose rendering of a conversation "
                "begins with the rendering of every earlier part of it."
            )
        full = self.render(messages + new_messages, True)
        if not full.startswith(turn):
            roles = sorted({m["role"] for m in new_messages})
            raise ValueError(
                f"the chat_template re-renders earlier turns when {roles} messages follow them; a multi-turn episode "
                "needs a template whose rendering of a conversation begins with the rendering of every earlier part."
            )
        ids = self.encode(full[end + len(self.end_of_turn_text) :])
        whole = self.encode(full)
        start = len(whole) - len(ids)
        if start < 1 or whole[start:] != ids or whole[start - 1] != self.end_of_turn_id:
            raise ValueError(
                "the text the chat_template adds after a model turn tokenizes differently alone and inside the whole "
                f"conversation ({self.tokenizer.convert_ids_to_tokens(ids)[:8]}...); the episode cannot be extended "
                "token by token."
            )
        return ids, full


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The Hermes-style tool calls of a model turn: every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

    ``arguments`` may be an object or a JSON string of one, and may be left out (no arguments). A block
    that is not closed, not JSON, or not of that shape gives a :class:`ToolCall` with ``error`` set.
    """
    calls, position = [], 0
    while (start := text.find(TOOL_CALL_OPEN, position)) != -1:
        end = text.find(TOOL_CALL_CLOSE, start)
        if end == -1:
            calls.append(ToolCall(None, None, f"{TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE}"))
            break
        calls.append(_parse_call(text[start + len(TOOL_CALL_OPEN) : end]))
        position = end + len(TOOL_CALL_CLOSE)
    return calls


def _parse_call(body: str) -> ToolCall:
    expected = 'expected {"name": "<tool>", "arguments": {...}}'
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall(None, None, f"the tool call is not valid JSON ({error.msg} at character {error.pos}); {expected}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(None, None, f"the tool call has no tool name; {expected}")
    name, arguments = call["name"], call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(name, None, f"the arguments of {name!r} are a string that is not JSON; {expected}")
    if not isinstance(arguments, dict):
        return ToolCall(name, None, f"the arguments of {name!r} are not an object; {expected}")
    return ToolCall(name, arguments)
