"""``ChatSpecAgent.with_structured_output``: the model bound to a tool call or a response
format (made valid by constrained decoding) and the parser that reads its output."""

from __future__ import annotations

from operator import itemgetter
from typing import TYPE_CHECKING, Any

from langchain_core.language_models import LanguageModelInput
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser,
    PydanticToolsParser,
)
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

if TYPE_CHECKING:
    from .chat_models import ChatSpecAgent

__all__ = ["structured_output"]


def structured_output(
    model: ChatSpecAgent, schema: Any, method: str, include_raw: bool
) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
    """``model``'s output parsed into ``schema`` by ``method`` (``with_structured_output``)."""
    is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    parser: Runnable[Any, Any]
    if method == "function_calling":
        if schema is None:
            raise ValueError("method='function_calling' needs a schema")
        tool = convert_to_openai_tool(schema)
        name = tool["function"]["name"]
        llm = model.bind_tools(
            [schema],
            tool_choice=name,
            ls_structured_output_format={"kwargs": {"method": method}, "schema": tool},
        )
        if is_pydantic:
            parser = PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
        else:
            parser = JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
    elif method == "json_schema":
        if schema is None:
            raise ValueError("method='json_schema' needs a schema")
        json_schema = convert_to_json_schema(schema)
        llm = model.bind(
            response_format={"type": "json_schema", "json_schema": {"schema": json_schema}},
            ls_structured_output_format={"kwargs": {"method": method}, "schema": json_schema},
        )
        parser = _json_parser(schema, is_pydantic)
    elif method == "json_mode":
        llm = model.bind(
            response_format={"type": "json_object"},
            ls_structured_output_format={"kwargs": {"method": method}, "schema": schema},
        )
        parser = _json_parser(schema, is_pydantic)
    else:
        msg = f"unknown method {method!r}; expected json_schema, function_calling or json_mode"
        raise ValueError(msg)
    if not include_raw:
        return llm | parser
    parsed = RunnablePassthrough.assign(
        parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
    ).with_fallbacks(
        [RunnablePassthrough.assign(parsed=lambda _: None)], exception_key="parsing_error"
    )
    return RunnableMap(raw=llm) | parsed


def _json_parser(schema: Any, is_pydantic: bool) -> Runnable[Any, Any]:
    if is_pydantic:
        return PydanticOutputParser(pydantic_object=schema)
    return JsonOutputParser()
