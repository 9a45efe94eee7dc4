"""The tool-calling environment: the model calls Python functions, reads their results, and answers.

Tools are plain Python functions with typed arguments and a Google-style docstring (TRL's convention):
their JSON schemas (transformers' get_json_schema) are rendered into the prompt by the chat template
(`tools=`), and the calls are read from each model turn by vLLM's tool-call parser for the model's
format (environment.tool_parser; hermes for Qwen2.5/3's <tool_call>{...}</tool_call>). A turn with calls
gets one tool message per call (the function's return value as text, or {"error": ...} when it raised
or named no known tool, as TRL does); a turn without calls is the answer and ends the episode.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from driver.environments.base import ModelTurn, StepResult, assistant_message


def tool_schemas(functions: list[Callable]) -> list[dict]:
    from transformers.utils import get_json_schema

    schemas = []
    for function in functions:
        try:
            schemas.append(get_json_schema(function))
        except Exception as error:  # transformers says what the docstring or the type hints lack
            raise ValueError(f"environment.tools: {getattr(function, '__name__', function)!r} has no usable schema: "
                             f"{error}") from error
    return schemas


class ToolCallReader:
    """vLLM's tool-call parser `name` on the tokenizer; shared by the episodes (parsing keeps no state)."""

    def __init__(self, name: str, tokenizer, schemas: list[dict]) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

        try:
            parser_class = ToolParserManager.get_tool_parser(name)
        except KeyError as error:
            raise ValueError(f"environment.tool_parser = {name!r} is not one of vLLM's tool-call parsers "
                             f"({', '.join(sorted(ToolParserManager.list_registered()))})") from error
        self.parser = parser_class(tokenizer)
        # Some parsers read the offered tools from the request (hermes does not); the request is otherwise unused.
        self.request = ChatCompletionRequest(model="policy", messages=[{"role": "user", "content": ""}],
                                             tools=schemas or None)

    def read(self, text: str) -> tuple[str, list[dict]]:
        """(the turn's text before its calls, the calls as OpenAI tool_calls with parsed arguments)."""
        info = self.parser.extract_tool_calls(text, self.request)
        if not info.tools_called:
            return text, []
        calls = []
        for call in info.tool_calls:
            try:
                arguments = json.loads(call.function.arguments) if call.function.arguments else {}
            except json.JSONDecodeError:
                arguments = call.function.arguments  # kept as text: calling it fails, as a failed call
            calls.append({"type": "function", "function": {"name": call.function.name, "arguments": arguments}})
        return info.content or "", calls


class ToolEnvironment:
    def __init__(self, functions: list[Callable], reader: ToolCallReader, schemas: list[dict]) -> None:
        self.functions = {function.__name__: function for function in functions}
        self.reader, self.tools = reader, schemas

    def reset(self, row: dict) -> None:
        pass

    def step(self, turn: ModelTurn) -> StepResult:
        content, calls = self.reader.read(turn.raw_text)
        if not calls:
            return StepResult([], done=True, assistant=assistant_message(turn))
        messages, failures = [], 0
        for call in calls:
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            try:
                if name not in self.functions:
                    raise ValueError(f"no tool named {name!r} (tools: {', '.join(self.functions)})")
                if not isinstance(arguments, dict):
                    raise ValueError(f"arguments are not a JSON object: {arguments!r}")
                result = self.functions[name](**arguments)
            except Exception as error:  # the model's mistake, told to the model: the episode goes on
                failures += 1
                result = {"error": f"{type(error).__name__}: {error}"}
            messages.append({"role": "tool", "name": name, "content": str(result)})
        assistant = {"role": "assistant", "content": content, "tool_calls": calls}
        return StepResult(messages, done=False, assistant=assistant, tool_calls=len(calls), tool_failures=failures)
