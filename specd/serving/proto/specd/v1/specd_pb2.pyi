from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_INTERACTIVE: _ClassVar[Priority]
    PRIORITY_BATCH: _ClassVar[Priority]

class SpeculationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATION_MODE_UNSPECIFIED: _ClassVar[SpeculationMode]
    SPECULATION_MODE_AUTO: _ClassVar[SpeculationMode]
    SPECULATION_MODE_OFF: _ClassVar[SpeculationMode]
    SPECULATION_MODE_CHAIN: _ClassVar[SpeculationMode]
    SPECULATION_MODE_TREE: _ClassVar[SpeculationMode]
    SPECULATION_MODE_HEAD: _ClassVar[SpeculationMode]
    SPECULATION_MODE_NGRAM: _ClassVar[SpeculationMode]
    SPECULATION_MODE_HYBRID: _ClassVar[SpeculationMode]
PRIORITY_UNSPECIFIED: Priority
PRIORITY_INTERACTIVE: Priority
PRIORITY_BATCH: Priority
SPECULATION_MODE_UNSPECIFIED: SpeculationMode
SPECULATION_MODE_AUTO: SpeculationMode
SPECULATION_MODE_OFF: SpeculationMode
SPECULATION_MODE_CHAIN: SpeculationMode
SPECULATION_MODE_TREE: SpeculationMode
SPECULATION_MODE_HEAD: SpeculationMode
SPECULATION_MODE_NGRAM: SpeculationMode
SPECULATION_MODE_HYBRID: SpeculationMode

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json", "regex", "choice", "grammar", "json_object")
    JSON_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    json: str
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    grammar: str
    json_object: bool
    def __init__(self, json: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("mode", "max_draft_tokens")
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    mode: SpeculationMode
    max_draft_tokens: int
    def __init__(self, mode: _Optional[_Union[SpeculationMode, str]] = ..., max_draft_tokens: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("id", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "priority", "speculation", "stop_token_ids", "ignore_eos", "response_format", "tools", "tool_choice", "parallel_tool_calls", "structured_outputs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
    ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    prompt: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    priority: Priority
    speculation: Speculation
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    response_format: str
    tools: str
    tool_choice: str
    parallel_tool_calls: bool
    structured_outputs: StructuredOutputs
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    def __init__(self, id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., prompt: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., priority: _Optional[_Union[Priority, str]] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., response_format: _Optional[str] = ..., tools: _Optional[str] = ..., tool_choice: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("seq", "text", "token_ids")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SpecStats(_message.Message):
    __slots__ = ("steps", "draft_tokens", "accepted_tokens", "mean_accepted_length")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    steps: int
    draft_tokens: int
    accepted_tokens: int
    mean_accepted_length: float
    def __init__(self, steps: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., mean_accepted_length: _Optional[float] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_ms", "ttft_ms", "total_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    ttft_ms: float
    total_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("finish_reason", "usage", "spec", "timing", "tool_calls", "content")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    usage: Usage
    spec: SpecStats
    timing: Timing
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    content: str
    def __init__(self, finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., spec: _Optional[_Union[SpecStats, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("id", "delta", "done")
    ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    id: str
    delta: Delta
    done: Done
    def __init__(self, id: _Optional[str] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ...) -> None: ...
