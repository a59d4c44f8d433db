"""The agentic workload sends every server the same requests: a session's turns depend on the
run's seed and its index, not on other sessions or on what the server answered."""

import json

from xlserve.bench.agentic import SYSTEM, TOOLS, session_turns


def test_a_session_is_a_function_of_the_seed_and_its_index_alone():
    first = session_turns(0, 3, 4)
    for other in (1, 0, 5):  # other sessions drawn in between draw from their own generators
        session_turns(0, other, 4)
    assert session_turns(0, 3, 4) == first
    assert session_turns(0, 4, 4) != first and session_turns(1, 3, 4) != first


def test_each_turn_extends_the_last_with_a_scripted_tool_call_and_a_new_ask():
    turns = session_turns(0, 2, 5)
    assert len(turns) == 5 and turns[0][0] == {"role": "system", "content": SYSTEM}
    names = {t["function"]["name"] for t in TOOLS}
    for before, after in zip(turns, turns[1:]):
        assert after[:len(before)] == before and len(after) == len(before) + 2
        answer, ask = after[len(before):]
        assert answer["role"] == "assistant" and json.loads(answer["content"])["name"] in names
        assert ask["role"] == "user" and ask["content"].startswith("[task 2.")
