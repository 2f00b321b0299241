"""One chat turn, whatever the dialect: every chat dialect (OpenAI chat, Responses,
Anthropic Messages, Ollama chat, Assistants runs) converts its request into a ChatTurn,
and `prepare` is the one policy that renders and constrains it:

- the messages through the model's chat template (or the request's own, `template_args`);
- with tools, the output is read for calls in the syntax the model was shown, under
  their grammar; the turn's own output constraint (a response format) wins over the
  tools' grammar, except where a call is forced; with tool_choice "none" the tools stay
  in the prompt (a conversation's cached prefix with them) and no call is made or read;
- a reasoning model's output starts with its thinking: a constraint applies to the answer
  after it (`thinking_first`), and the Generation splits the thinking off.

The dialect then starts the Generation (`start`, or in a warm context) and reads the
answer and its calls with the PreparedTurn's tool format.
"""

from dataclasses import dataclass, field
from typing import Any, Literal

from app.protocol.errors import InvalidRequestError
from app.protocol.images import ImageInput
from app.protocol.messages import PromptEnding, TemplateArgs
from app.protocol.sampling import MAX_CONSTRAINT_CHARS, Constraint, SamplingParams
from app.text.reasoning import ReasoningFormat
from app.text.reasoning_grammar import thinking_first
from app.text.tool_calls import ToolFormat, call_grammar, text_grammar
from deployments.http.generation import Generation
from deployments.ingress import Ingress


@dataclass(frozen=True)
class ToolName:
    """A tool choice that forces a call to this function."""

    name: str


@dataclass
class ChatTurn:
    """A chat request in neutral terms. `tools`: as chat templates take them (OpenAI's
    shape), None when the model is not shown any; `tool_choice`: "auto" (the model
    decides), "required" (a call to any of them), a ToolName (a call to that one) or
    "none" (shown, as to the turns before, but not called)."""

    model: str
    messages: list[dict[str, Any]]
    params: SamplingParams  # without the constraint, which `prepare` decides
    constraint: Constraint | None = None  # the response format's, if any
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "required", "none"] | ToolName = "auto"
    parallel_tool_calls: bool = True
    template_args: TemplateArgs | None = None
    ending: PromptEnding = "reply"
    stop_strings: list[str] = field(default_factory=list)

    @property
    def forces_call(self) -> bool:
        return bool(self.tools) and self.tool_choice not in ("auto", "none")

    @property
    def forbids_call(self) -> bool:
        return bool(self.tools) and self.tool_choice == "none"

    def tool_constraint(self, fmt: ToolFormat) -> Constraint:
        """The grammar of the calls: forced for `required` (any of the tools) or a named
        function; optional when the model decides, where it keeps a call that the model
        starts well-formed."""
        functions = [t["function"] for t in self.tools or []]
        parallel = self.parallel_tool_calls
        if isinstance(self.tool_choice, ToolName):
            functions = [f for f in functions if f["name"] == self.tool_choice.name]
            parallel = False
        optional = self.tool_choice == "auto"
        grammar = call_grammar(fmt, functions, parallel, optional)
        if len(grammar) > MAX_CONSTRAINT_CHARS:  # the client's tools, not a server fault
            raise InvalidRequestError(
                f"tools: their calls' grammar is too large ({len(grammar)} characters; "
                f"at most {MAX_CONSTRAINT_CHARS}): send fewer or smaller tools",
                "tools",
            )
        return Constraint(kind="lark", spec=grammar)


@dataclass
class PreparedTurn:
    prompt_ids: list[int]
    params: SamplingParams  # with the output's constraint
    tool_format: ToolFormat | None  # how calls are read out of the answer; None: no tools
    reasoning: ReasoningFormat | None  # how the thinking splits off; None: no thinking
    images: tuple[ImageInput, ...] = ()  # at their spans of prompt_ids


async def prepare(ingress: Ingress, turn: ChatTurn) -> PreparedTurn:
    """Render the turn and decide its output's constraint (see the module's docstring)."""
    args = turn.template_args
    fmt = ingress.tool_format(turn.model, args) if turn.tools else None
    constraint, tools = turn.constraint, turn.tools
    if turn.forbids_call:
        if fmt is None:  # a model that cannot be shown tools is shown none
            tools = None
        elif constraint is None:  # text that holds no call's marker
            constraint = Constraint(kind="lark", spec=text_grammar(fmt))
        fmt = None  # nothing of the answer is read as a call
    elif fmt is not None and (turn.forces_call or constraint is None):
        constraint = turn.tool_constraint(fmt)  # first: tools too many to constrain cost no render
    ids, images = await ingress.encode_chat_with_images(
        turn.model, turn.messages, tools, turn.ending, args
    )
    reasoning = ingress.reasoning(turn.model, ids, args)
    if reasoning is not None and constraint is not None:
        constraint = thinking_first(reasoning, constraint)
    params = turn.params.model_copy(update={"constraint": constraint})
    return PreparedTurn(ids, params, fmt, reasoning, tuple(images))


async def start(ingress: Ingress, turn: ChatTurn, tag: str) -> tuple[Generation, PreparedTurn]:
    """Prepare the turn and start its generation (outside any warm context)."""
    p = await prepare(ingress, turn)
    gen = await ingress.generate(
        turn.model,
        p.prompt_ids,
        p.params,
        turn.stop_strings,
        tag,
        reasoning=p.reasoning,
        images=p.images,
    )
    return gen, p
