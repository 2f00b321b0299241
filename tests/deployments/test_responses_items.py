"""The Responses API's input items are strict (an unknown field or item shape is a 400 in
OpenAI's shape, the number of items is bounded), a response's own output items are taken
back as input, and a stored response whose input had a reasoning item lists it."""

import pytest
from openai.types.responses import ResponseItem
from pydantic import TypeAdapter

from deployments.api.responses.items import MAX_INPUT_ITEMS
from tests.local_app import MODEL, http_client, run

USER = {"role": "user", "content": "Hi"}


def _post_all(app, bodies: list[dict]) -> list:  # noqa: ANN001
    async def go() -> list:
        async with http_client(app) as http:
            return [await http.post("/v1/responses", json=body) for body in bodies]

    return run(go())


@pytest.mark.parametrize(
    "items, words",
    [
        ([{**USER, "foo": 1}], "foo"),
        ([{"role": "user", "content": [{"type": "input_text", "text": "Hi", "x": {}}]}], "x"),
        ([{}] * 300_000, "at most"),  # 1.2 MB of JSON, ~26 MB in memory
        ([{}], "role"),
        ([{"type": "item_reference", "id": "msg_1"}], "item_reference"),
        (
            [{"type": "function_call_output", "call_id": "c", "output": "ok", "extra": [{}]}],
            "extra",
        ),
        ([{"type": "reasoning", "summary": [{"type": "summary_text", "text": "t", "y": 1}]}], "y"),
        ([USER] * (MAX_INPUT_ITEMS + 1), "at most"),
        (["Hi"], "not an item"),
    ],
)
def test_unknown_fields_and_shapes_are_400s(app, items, words):
    (reply,) = _post_all(app, [{"model": MODEL, "input": items, "max_output_tokens": 1}])
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "input" and error["type"] == "invalid_request_error"
    assert words in error["message"]


def test_output_items_come_back_as_input_and_reasoning_items_are_listed(app):
    async def go():  # noqa: ANN202
        async with http_client(app) as http:
            first = await http.post(
                "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 3}
            )
            output = first.json()["output"]  # as the SDK sends them back: ids, statuses
            thinking = {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "They greet me."}],
            }
            second = await http.post(
                "/v1/responses",
                json={
                    "model": MODEL,
                    "input": [USER, thinking, *output, {"role": "user", "content": "And?"}],
                    "max_output_tokens": 3,
                },
            )
            listed = await http.get(f"/v1/responses/{second.json()['id']}/input_items")
            return first, second, listed

    first, second, listed = run(go())
    assert first.status_code == 200 and second.status_code == 200, second.text
    assert listed.status_code == 200, listed.text
    items = listed.json()["data"]
    assert [i["type"] for i in reversed(items)] == ["message", "reasoning", "message", "message"]
    TypeAdapter(list[ResponseItem]).validate_python(items)
    assert items[2]["id"] == "rs_1" and items[2]["summary"][0]["text"] == "They greet me."
