"""<think> blocks go to reasoning_content, streamed, whatever the split of the output."""

import pytest

from xlserve.openai.reasoning import ReasoningStream, reasoning_enabled, starts_inside

QWEN3 = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4."
R1 = "The user wants 2+2. That is 4.\n</think>\n\nThe answer is 4."  # the prompt opened the block


def _stream(text, inside, size):
    stream, reasoning, content = ReasoningStream(inside), "", ""
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning.strip(), content


@pytest.mark.parametrize("text,inside", [(QWEN3, False), (R1, True)])
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_reasoning_and_answer_are_split_in_any_pieces(text, inside, size):
    assert _stream(text, inside, size) == ("The user wants 2+2. That is 4.", "The answer is 4.")


def test_split_in_two_at_every_character():
    for cut in range(1, len(QWEN3)):
        stream = ReasoningStream(False)
        first, second = stream.feed(QWEN3[:cut]), stream.feed(QWEN3[cut:], final=True)
        assert (first[0] + second[0]).strip() == "The user wants 2+2. That is 4."
        assert first[1] + second[1] == "The answer is 4."


def test_no_think_block_is_all_content_and_a_cut_block_is_all_reasoning():
    plain = "Just the answer, <think> later is text."
    assert _stream(plain, False, 3) == ("", plain)
    assert _stream("<think>still thinking wh", False, 4) == ("still thinking wh", "")


def test_which_prompts_open_the_block_and_which_templates_think():
    assert starts_inside("<|Assistant|><think>\n") and not starts_inside("<think>\n\n</think>\n\n")
    assert not starts_inside("<|im_start|>assistant\n")
    assert reasoning_enabled("auto", "{{ '<think>' }}") and not reasoning_enabled("auto", "<|im_start|>")
    assert not reasoning_enabled("none", "<think>") and reasoning_enabled("think", "")
    with pytest.raises(ValueError, match="unknown"):
        reasoning_enabled("maybe", "")
