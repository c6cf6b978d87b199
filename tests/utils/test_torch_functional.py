"""Tests for verl.utils.torch_functional against independent references (torch.log_softmax, plain Python)."""

import math

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

import verl.utils.torch_functional as verl_F


def _reference_logprobs(logits, labels):
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return torch.log_softmax(logits.to(dtype), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("chunk_elements", [2**24, 7 * 11])  # one chunk, and many uneven chunks of 7 rows
def test_logprobs_from_logits_matches_log_softmax_value_and_grad(monkeypatch, chunk_elements):
    monkeypatch.setattr(verl_F, "LOGPROB_CHUNK_ELEMENTS", chunk_elements)
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 17, 11, dtype=torch.float64)).requires_grad_(True)
    labels = torch.randint(0, 11, (3, 17))

    got = verl_F.logprobs_from_logits(logits, labels)
    want = _reference_logprobs(logits, labels)
    assert got.shape == (3, 17)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    weights = torch.randn(3, 17)
    (grad_got,) = torch.autograd.grad((got * weights).sum(), logits)
    (grad_want,) = torch.autograd.grad((want * weights.double()).sum(), logits)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-10, atol=1e-12)


def test_logprobs_from_logits_bf16_input_gives_float32_and_bf16_grad():
    torch.manual_seed(1)
    logits = torch.randn(4, 9, 33).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 33, (4, 9))
    got = verl_F.logprobs_from_logits(logits, labels)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _reference_logprobs(logits.detach(), labels), rtol=1e-5, atol=1e-5)
    got.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    # sum over the vocab of d logp / d logits is 1 - sum(softmax) = 0 for every position
    torch.testing.assert_close(logits.grad.float().sum(-1), torch.zeros(4, 9), atol=2e-2, rtol=0)


def test_logprobs_from_logits_saves_no_vocab_sized_copy_for_backward():
    """Memory-lean: backward keeps the logits themselves and per-row vectors, never a (rows, vocab) float copy."""
    logits = torch.randn(6, 50, requires_grad=True)
    labels = torch.randint(0, 50, (6,))
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        verl_F.logprobs_from_logits(logits, labels)
    big = [t for t in saved if t.numel() >= logits.numel()]
    assert saved, "expected the backward pass to save something"
    assert all(t.data_ptr() == logits.data_ptr() for t in big), "a vocab-sized copy of the logits was saved"


def test_logprobs_from_logits_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="must agree"):
        verl_F.logprobs_from_logits(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_entropy_from_logits_matches_definition():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.5, -1.0, 0.1]])
    probs = [[math.exp(x) / sum(math.exp(y) for y in row) for x in row] for row in logits.tolist()]
    want = torch.tensor([-sum(p * math.log(p) for p in row) for row in probs])
    got = verl_F.entropy_from_logits(logits)
    torch.testing.assert_close(got, want)
    assert got[0].item() == pytest.approx(math.log(4))


def test_masked_sum_and_mean_ignore_nan_outside_mask():
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert verl_F.masked_sum(values, mask).item() == 13.0
    torch.testing.assert_close(verl_F.masked_sum(values, mask, axis=-1), torch.tensor([3.0, 10.0]))
    assert verl_F.masked_mean(values, mask).item() == pytest.approx(13.0 / 4)
    torch.testing.assert_close(verl_F.masked_mean(values, mask, axis=-1), torch.tensor([1.5, 5.0]))


def test_masked_var_is_unbiased_and_rejects_tiny_masks():
    values = torch.tensor([[1.0, 2.0, 100.0], [4.0, 7.0, -50.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    selected = [1.0, 2.0, 4.0, 7.0]
    mean = sum(selected) / 4
    want = sum((x - mean) ** 2 for x in selected) / 3
    assert verl_F.masked_var(values, mask).item() == pytest.approx(want)
    assert verl_F.masked_var(values, mask, unbiased=False).item() == pytest.approx(want * 3 / 4)
    with pytest.raises(ValueError, match="selects no element"):
        verl_F.masked_var(values, torch.zeros_like(mask))
    one = torch.zeros_like(mask)
    one[0, 0] = 1
    with pytest.raises(ValueError, match="selects 1 element"):
        verl_F.masked_var(values, one)


def test_masked_whiten_by_hand():
    values = torch.tensor([[1.0, 3.0, 9.0], [5.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    selected = [1.0, 3.0, 9.0, 5.0]
    mean = sum(selected) / 4
    var = sum((x - mean) ** 2 for x in selected) / 3
    want = [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in values.tolist()]
    torch.testing.assert_close(verl_F.masked_whiten(values, mask), torch.tensor(want))
    unshifted = [[w + mean for w in row] for row in want]
    torch.testing.assert_close(verl_F.masked_whiten(values, mask, shift_mean=False), torch.tensor(unshifted))


def test_get_response_mask_first_eos_ends_response():
    response = torch.tensor([[5, 7, 1, 4, 1, 0], [1, 3, 3, 3, 3, 3], [5, 6, 7, 8, 9, 9], [5, 9, 2, 1, 0, 0]])
    want_single = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    got = verl_F.get_response_mask(response, eos_token=1)
    assert got.dtype == torch.int64
    assert torch.equal(got, want_single)
    want_multi = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    got_multi = verl_F.get_response_mask(response, eos_token=[1, 2], dtype=torch.float32)
    assert got_multi.dtype == torch.float32
    assert torch.equal(got_multi, want_multi.float())


def test_compute_position_id_with_left_padded_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    want = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]])
    assert torch.equal(verl_F.compute_position_id_with_mask(mask), want)


def test_pad_sequence_to_length_left_right_and_noop():
    ids = torch.tensor([[1, 2], [3, 4]])
    assert torch.equal(verl_F.pad_sequence_to_length(ids, 4, 0), torch.tensor([[1, 2, 0, 0], [3, 4, 0, 0]]))
    assert torch.equal(verl_F.pad_sequence_to_length(ids, 3, 9, left_pad=True), torch.tensor([[9, 1, 2], [9, 3, 4]]))
    assert verl_F.pad_sequence_to_length(ids, 2, 0) is ids


def test_pad_2d_list_to_length():
    got = verl_F.pad_2d_list_to_length([[1, 2, 3], [4]], pad_token_id=0)
    assert torch.equal(got, torch.tensor([[1, 2, 3], [4, 0, 0]]))
    got = verl_F.pad_2d_list_to_length([[1], [4, 5]], pad_token_id=7, max_length=4)
    assert torch.equal(got, torch.tensor([[1, 7, 7, 7], [4, 5, 7, 7]]))


@pytest.fixture(scope="module")
def word_tokenizer():
    """A real (tiny, in-memory) fast tokenizer: one id per whitespace-separated word t0..t9."""
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i + 2 for i in range(10)}}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")


PROMPT = "t0 t1 t2 t3 t4 t5"  # ids 2..7


def test_tokenize_and_postprocess_pads_left_and_right(word_tokenizer):
    ids, mask = verl_F.tokenize_and_postprocess_data(PROMPT, word_tokenizer, 8, pad_token_id=0)
    assert ids.tolist() == [[0, 0, 2, 3, 4, 5, 6, 7]]
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1]]
    ids, mask = verl_F.tokenize_and_postprocess_data(PROMPT, word_tokenizer, 7, pad_token_id=0, left_pad=False)
    assert ids.tolist() == [[2, 3, 4, 5, 6, 7, 0]]
    assert mask.tolist() == [[1, 1, 1, 1, 1, 1, 0]]


@pytest.mark.parametrize(
    "truncation, want",
    [("left", [5, 6, 7]), ("right", [2, 3, 4]), ("middle", [2, 6, 7])],
)
def test_tokenize_and_postprocess_truncation(word_tokenizer, truncation, want):
    ids, mask = verl_F.tokenize_and_postprocess_data(PROMPT, word_tokenizer, 3, pad_token_id=0, truncation=truncation)
    assert ids.tolist() == [want]
    assert mask.tolist() == [[1, 1, 1]]


def test_tokenize_and_postprocess_errors(word_tokenizer):
    with pytest.raises(ValueError, match="6 tokens, more than max_length=3"):
        verl_F.tokenize_and_postprocess_data(PROMPT, word_tokenizer, 3, pad_token_id=0)
    with pytest.raises(ValueError, match=r"truncation='sideways'.*'error', 'left', 'right', 'middle'"):
        verl_F.tokenize_and_postprocess_data(PROMPT, word_tokenizer, 3, pad_token_id=0, truncation="sideways")


def test_prompt_groups_number_identical_prompts_by_first_appearance():
    from verl.utils.torch_functional import group_first_rows, prompt_groups

    # prompts a, b, a, c, b, left-padded; "c" has a's ids but a different mask (a shorter prompt)
    ids = torch.tensor([[0, 5, 6, 1, 2], [7, 8, 9, 1, 2], [0, 5, 6, 3, 4], [9, 5, 6, 1, 2], [7, 8, 9, 3, 3]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    groups = prompt_groups(ids, mask, response_length=2)  # the last 2 columns are the response
    assert groups.tolist() == [0, 1, 0, 2, 1]
    assert group_first_rows(groups).tolist() == [0, 1, 3]
    assert prompt_groups(ids, mask).tolist() == [0, 1, 2, 3, 4]  # whole rows as prompts: all differ
