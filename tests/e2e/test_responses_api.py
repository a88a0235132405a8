"""``/v1/responses`` end to end on the default model (the shared stack, which serves with the Hermes tool parser):
the ``openai`` SDK's streamed event sequence, and the OpenAI Agents SDK running an agent that calls one function
tool and then answers. The small default model does not call tools on its own: the first turn forces the call
(``tool_choice="required"``, grammar-enforced); the Agents SDK then resets the choice to auto (its
``reset_tool_choice``), and the model answers in text, which the Hermes parser passes through."""

from __future__ import annotations

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

from tests.e2e.conftest import SHARED_SERVED
from tests.procs import ServeStack

pytestmark = pytest.mark.slow


def test_the_sdk_stream_yields_the_documented_event_sequence(shared_stack: ServeStack) -> None:
    client = openai.OpenAI(base_url=f"{shared_stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    events = list(client.responses.create(model=SHARED_SERVED, input="Say hello.", instructions="Be brief.",
                                          max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete" if kinds[-1] == "response.incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert final.output_text == text and text
    assert final.usage is not None and final.usage.output_tokens <= 8
    whole = client.responses.create(model=SHARED_SERVED, input="Say hello.", instructions="Be brief.",
                                    max_output_tokens=8, temperature=0)
    assert whole.output_text == text  # greedy: the same answer whole or streamed


def test_the_agents_sdk_runs_an_agent_that_calls_a_tool_and_answers(shared_stack: ServeStack) -> None:
    set_tracing_disabled(True)
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return "Sunny, 21 degrees Celsius."

    client = openai.AsyncOpenAI(base_url=f"{shared_stack.base_url}/v1", api_key="unused", max_retries=0,
                                timeout=120)
    agent = Agent(name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=SHARED_SERVED, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=40))
    result = Runner.run_sync(agent, "What is the weather like in Paris?", max_turns=3)
    assert len(cities) == 1 and cities[0]
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
