"""IFEval-style verifiable constraints: each type followed and broken, the scores, the ground-truth schema."""

import json

import pytest

from verl.utils.reward_score import default_compute_score, ifeval


@pytest.mark.parametrize(
    "instruction, good, bad",
    [
        ({"type": "word_count", "min": 3, "max": 5}, "one two three four", "one two"),
        ({"type": "word_count", "max": 2}, "just two", "now three words"),
        ({"type": "sentence_count", "min": 2}, "First one. Second one!", "Only one sentence."),
        ({"type": "paragraph_count", "min": 2, "max": 2}, "para one\n\npara two", "para one\npara two"),
        ({"type": "keywords", "include": ["Ocean"], "exclude": ["sky"]}, "The ocean is deep.", "oceanic sky"),
        ({"type": "keyword_frequency", "keyword": "go", "min": 2, "max": 2}, "Go, go now!", "go go go going"),
        ({"type": "json_format"}, '```json\n{"a": [1, 2]}\n```', "{'a': 1}"),
        ({"type": "json_format"}, ' [1, "x"] ', "the answer is {}"),
        ({"type": "starts_with", "text": "Dear"}, "  Dear Sir,", "Hello, Dear"),
        ({"type": "ends_with", "text": "Thanks."}, "Bye. Thanks.\n", "Thanks. Bye."),
        ({"type": "lowercase"}, "all small 123", "Not small"),
        ({"type": "uppercase"}, "ALL BIG 1!", "ALMOST Big"),
        ({"type": "no_commas"}, "no commas here", "one, two"),
        ({"type": "bullet_points", "count": 2}, "* a\n- b\ntext", "* a\n* b\n* c"),
        ({"type": "placeholders", "min": 2}, "Send to [name] at [address].", "Send to [name]."),
        ({"type": "title"}, "<<My Poem>>\nroses", "My Poem\nroses"),
        ({"type": "quotation"}, '"all quoted"', '"half quoted'),
    ],
)
def test_each_constraint_followed_and_broken(instruction, good, bad):
    assert ifeval.check(good, instruction) is True
    assert ifeval.check(bad, instruction) is False


def test_scores_instruction_and_prompt_level():
    truth = {
        "instructions": [
            {"type": "word_count", "max": 4},
            {"type": "lowercase"},
            {"type": "keywords", "include": ["cat"]},
        ]
    }
    text = "the Cat sat"  # 3 words, not lowercase, has "cat"
    result = ifeval.compute_score(text, truth)
    assert result == {"score": pytest.approx(2 / 3), "acc": 0.0, "instruction_acc": pytest.approx(2 / 3)}
    assert ifeval.compute_score(text, truth, strict=True)["score"] == 0.0
    assert ifeval.compute_score("the cat sat", json.dumps(truth)) == {"score": 1.0, "acc": 1.0, "instruction_acc": 1.0}
    # routed by data_source, with the list form of the ground truth
    routed = default_compute_score("ifeval", "the cat sat", json.dumps(truth["instructions"]))
    assert routed["acc"] == 1.0


@pytest.mark.parametrize(
    "truth, message",
    [
        ({"instructions": [{"type": "rhyme"}]}, "unknown instruction type 'rhyme'; allowed: \\["),
        ([{"type": "starts_with"}], "missing \\['text'\\]"),
        ([{"type": "lowercase", "strength": 2}], "unknown parameters \\['strength'\\]"),
        ([{"type": "word_count"}], "give at least one of \\['min', 'max'\\]"),
        ([], "non-empty list of instructions"),
        ("not json", "not JSON"),
        (["word_count"], "must be a dict with a 'type'"),
    ],
)
def test_bad_ground_truth_is_one_clear_error(truth, message):
    with pytest.raises(ValueError, match=message):
        ifeval.compute_score("text", truth)
