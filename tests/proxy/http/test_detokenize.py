"""The proxy's output text equals vLLM's own incremental detokenizer, token for token and chunk for chunk."""

from __future__ import annotations

import dataclasses
import random
import types

import pytest

from lmcache_p2p.proxy.flow.context import RequestContext
from lmcache_p2p.proxy.flow.output import RequestOutput, shape_delta
from lmcache_p2p.proxy.http import detokenize
from lmcache_p2p.proxy.http.detokenize import OutputText, TextParams
from lmcache_p2p.proxy.http.responses import Delta, FirstToken
from lmcache_p2p.proxy.http.shaping import Endpoint, parse_client_request
from lmcache_p2p.proxy.http.tokenizer import ProxyTokenizer, TokenizerProvider, load_tokenizer
from lmcache_p2p.proxy.observe.timeline import Timeline

PROMPT = "kaba shoulai tidu 中文 rest"


@pytest.fixture(scope="module")
def hf_tokenizer():
    from lmcache_p2p.cli.tiny_model import _train_tokenizer

    return _train_tokenizer(0)  # the tiny model's byte-level BPE (its folder needs torch to build)


@pytest.fixture(scope="module")
def tokenizer(hf_tokenizer) -> ProxyTokenizer:
    return ProxyTokenizer(hf_tokenizer, "test")


@pytest.fixture
def record_streams(monkeypatch):
    """From its call on: how many ids each ``DecodeStream`` made is primed with, in order."""
    import tokenizers.decoders

    def record() -> list[int]:
        contexts: list[int] = []
        real = tokenizers.decoders.DecodeStream

        def recording(ids=None, **kwargs):
            contexts.append(len(ids or []))
            return real(ids=ids, **kwargs) if ids is not None else real(**kwargs)

        monkeypatch.setattr(tokenizers.decoders, "DecodeStream", recording)
        return contexts

    return record


def vllm_text(hf, prompt_ids, outputs, params: TextParams, finish_last: bool = True,
              stop_terminated: bool = False) -> tuple[list[str], str | None, list[int]]:
    """vLLM 0.32's FastIncrementalDetokenizer fed one token per step, deltas as the streaming server reads them."""
    detok_mod = pytest.importorskip("vllm.v1.engine.detokenizer")
    from vllm.sampling_params import SamplingParams

    sp = SamplingParams(stop=list(params.stop) or None, include_stop_str_in_output=params.include_stop_str_in_output,
                        min_tokens=params.min_tokens, skip_special_tokens=params.skip_special_tokens,
                        spaces_between_special_tokens=params.spaces_between_special_tokens, max_tokens=len(outputs))
    request = types.SimpleNamespace(request_id="r", prompt_token_ids=list(prompt_ids), sampling_params=sp,
                                    prompt_embeds=None)
    detok = detok_mod.FastIncrementalDetokenizer(hf, request)
    deltas, stop = [], None
    for i, token in enumerate(outputs):
        last = i == len(outputs) - 1
        stop = detok.update([token], stop_terminated=stop_terminated and last)
        finished = stop is not None or (last and finish_last)
        deltas.append(detok.get_next_output_text(finished, delta=True))
        if stop is not None:
            break
    return deltas, stop, list(detok.output_token_ids)


def proxy_text(tokenizer, prompt_ids, outputs, params: TextParams, finish_last: bool = True,
               stop_terminated: bool = False) -> tuple[list[str], str | None, list[int]]:
    text = tokenizer.output_text(prompt_ids, params)
    deltas, stop = [], None
    for i, token in enumerate(outputs):
        last = i == len(outputs) - 1
        step = text.update([token], stop_terminated=stop_terminated and last)
        stop = step.stop_string
        deltas.append(text.next_delta(finished=stop is not None or (last and finish_last)))
        if stop is not None:
            break
    return deltas, stop, text.token_ids


def random_outputs(hf, seed: int, n: int) -> list[int]:
    """Output ids: whole words and multi-byte characters (split across tokens), special tokens, stray bytes."""
    rng = random.Random(seed)
    pieces = [hf.encode(w, add_special_tokens=False) for w in ("é", "中", "☃", "🙂", " tidu", " ka", "ba", " a")]
    pieces += [[hf.eos_token_id], [hf.bos_token_id]]
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(pieces) if rng.random() < 0.85 else [rng.randrange(4, len(hf))]
    return out[:n]


@pytest.mark.parametrize("params", [
    TextParams(),
    TextParams(skip_special_tokens=False),
    TextParams(skip_special_tokens=False, spaces_between_special_tokens=False),
    TextParams(stop=("中", "ka")),
    TextParams(stop=("中", "ka"), include_stop_str_in_output=True),
    TextParams(stop=("a",), min_tokens=5),
])
@pytest.mark.parametrize("seed", range(6))
def test_streamed_text_equals_vllms_incremental_detokenizer(hf_tokenizer, tokenizer, params, seed):
    prompt_ids = hf_tokenizer.encode(PROMPT)
    outputs = random_outputs(hf_tokenizer, seed, 40)
    assert proxy_text(tokenizer, prompt_ids, outputs, params) == vllm_text(hf_tokenizer, prompt_ids, outputs, params)


def test_a_first_token_that_is_part_of_a_character_has_no_text_until_the_character_completes(hf_tokenizer,
                                                                                               tokenizer):
    prompt_ids = hf_tokenizer.encode(PROMPT)
    char_ids = hf_tokenizer.encode("中", add_special_tokens=False)
    assert len(char_ids) == 3  # three bytes, three tokens: the first alone is an incomplete UTF-8 character
    deltas, _, _ = proxy_text(tokenizer, prompt_ids, char_ids + hf_tokenizer.encode(" ka", add_special_tokens=False),
                              TextParams())
    assert deltas[:3] == ["", "", "中"] and "".join(deltas) == "中 ka"


def test_a_stop_token_is_not_detokenized_unless_asked(hf_tokenizer, tokenizer):
    prompt_ids = hf_tokenizer.encode(PROMPT)
    outputs = hf_tokenizer.encode(" kaba", add_special_tokens=False) + [hf_tokenizer.eos_token_id]
    for params in (TextParams(skip_special_tokens=False), TextParams(skip_special_tokens=False,
                                                                     include_stop_str_in_output=True)):
        ours = proxy_text(tokenizer, prompt_ids, outputs, params, stop_terminated=True)
        assert ours == vllm_text(hf_tokenizer, prompt_ids, outputs, params, stop_terminated=True)
    assert "".join(ours[0]).endswith("</s>")


def test_text_params_follow_vllms_defaults():
    assert TextParams.from_body({}) == TextParams()
    params = TextParams.from_body({"stop": "x", "min_tokens": 2, "skip_special_tokens": False})
    assert params.stop == ("x",) and params.min_tokens == 2 and not params.skip_special_tokens


def test_exact_prompt_counts_match_the_tokenizer_and_chat_template(hf_tokenizer, tokenizer, tmp_path):
    text = parse_client_request(Endpoint.COMPLETIONS, {"prompt": PROMPT}, 4)
    assert tokenizer.prompt_tokens(text) == len(hf_tokenizer.encode(PROMPT))
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    chat = parse_client_request(Endpoint.CHAT, {"messages": messages}, 4)
    rendered = "<|user|>\nhi\nthere\n<|assistant|>\n"
    assert tokenizer.prompt_tokens(chat) == len(hf_tokenizer.encode(rendered, add_special_tokens=False))
    # the proxy refuses media parts (parse_client_request); the tokenizer itself renders none either
    image = dataclasses.replace(chat, body={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert tokenizer.prompt_tokens(image) is None
    hf_tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded is not None and loaded.prompt_tokens(text) == tokenizer.prompt_tokens(text)


def test_output_text_without_stop_strings_holds_nothing_back(tokenizer, hf_tokenizer):
    text: OutputText = tokenizer.output_text(hf_tokenizer.encode(PROMPT), TextParams())
    text.update(hf_tokenizer.encode(" kaba", add_special_tokens=False), stop_terminated=False)
    assert text.next_delta(finished=False) == " kaba" and text.next_delta(finished=True) == ""


LONG_PROMPT = " ".join([PROMPT] * 400)  # thousands of ids, multi-byte characters split across tokens


@pytest.mark.parametrize("params", [TextParams(), TextParams(skip_special_tokens=False), TextParams(stop=("中",))])
@pytest.mark.parametrize("seed", range(3))
def test_a_long_prompt_s_text_equals_vllms_and_primes_the_stream_with_a_bounded_context(
        hf_tokenizer, tokenizer, params, seed, record_streams):
    prompt_ids = hf_tokenizer.encode(LONG_PROMPT)
    assert len(prompt_ids) > 4000
    outputs = random_outputs(hf_tokenizer, seed, 30)
    expected = vllm_text(hf_tokenizer, prompt_ids, outputs, params)
    primed = record_streams()
    assert proxy_text(tokenizer, prompt_ids, outputs, params) == expected
    assert primed and max(primed) <= 24  # the first token costs as much for a 64k-token prompt as for a short one


def test_a_prompt_ending_mid_character_keeps_its_whole_context(hf_tokenizer, tokenizer):
    prompt_ids = hf_tokenizer.encode(LONG_PROMPT) + hf_tokenizer.encode("中", add_special_tokens=False)[:2]
    outputs = hf_tokenizer.encode("中", add_special_tokens=False)[2:] + hf_tokenizer.encode(" ka", add_special_tokens=False)
    assert proxy_text(tokenizer, prompt_ids, outputs, TextParams()) == vllm_text(hf_tokenizer, prompt_ids, outputs,
                                                                                 TextParams())


def random_dataset_prompt(hf, seed: int, n: int) -> list[int]:
    """A prompt as ``vllm bench serve --dataset-name random`` makes one: random ids to text, the text tokenized
    again. Its text is full of U+FFFD (bytes that are no character), so no short suffix is free of one."""
    rng = random.Random(seed)
    return hf.encode(hf.decode([rng.randrange(4, len(hf)) for _ in range(n)]))


@pytest.mark.parametrize("seed", range(40))
def test_a_prompt_full_of_replacement_characters_gets_vllms_text_from_a_bounded_context(
        hf_tokenizer, tokenizer, seed, record_streams):
    prompt_ids = random_dataset_prompt(hf_tokenizer, seed, 3000)
    if seed % 4 == 0:  # literal U+FFFD characters in ordinary text, some right before the end
        prompt_ids = hf_tokenizer.encode(LONG_PROMPT + " \ufffd\ufffd x\ufffd" * (1 + seed // 4) + " end")
    prompt_text = hf_tokenizer.decode(prompt_ids)
    assert "\ufffd" in prompt_text[-200:]
    params = TextParams(skip_special_tokens=seed % 3 != 0)
    outputs = random_outputs(hf_tokenizer, seed, 30)
    expected = vllm_text(hf_tokenizer, prompt_ids, outputs, params)
    primed = record_streams()
    assert proxy_text(tokenizer, prompt_ids, outputs, params) == expected
    if prompt_text.endswith("\ufffd"):  # ends mid-character (or with a literal one): vLLM's whole prompt
        assert max(primed) == len(prompt_ids)
    else:
        assert primed and max(primed) <= 64


@pytest.mark.parametrize("case", ["random", "random-ends-mid-character", "long", "stop"])
@pytest.mark.parametrize("seed", range(4))
def test_the_streaming_side_replays_the_first_token_after_the_first_byte_and_goes_on_as_vllm(
        hf_tokenizer, tokenizer, case, seed, record_streams):
    """A relay worker's copy of the text (replay of the first token the owner showed) makes nothing until it is
    primed, then the same deltas as vLLM for every token after the first."""
    prompt_ids = (hf_tokenizer.encode(LONG_PROMPT) if case in ("long", "stop")
                  else random_dataset_prompt(hf_tokenizer, seed, 2000))
    if case == "random-ends-mid-character":
        prompt_ids += hf_tokenizer.encode("中", add_special_tokens=False)[:2]
    params = TextParams(stop=("中", "ka")) if case == "stop" else TextParams(skip_special_tokens=seed % 2 == 0)
    outputs = random_outputs(hf_tokenizer, seed + 100, 30)
    expected, stop, ids = vllm_text(hf_tokenizer, prompt_ids, outputs, params)
    if stop is not None and len(expected) == 1:
        pytest.skip("the first token ended the output: nothing to decode")
    made = record_streams()
    text = tokenizer.output_text(prompt_ids, params, replay=[outputs[0]])
    assert made == []  # nothing detokenized on the first byte's path
    text.prime()
    assert len(made) == 1
    deltas, found = [], None
    for i, token in enumerate(outputs[1:], start=1):
        step = text.update([token], stop_terminated=False)
        found = step.stop_string
        deltas.append(text.next_delta(finished=found is not None or i == len(outputs) - 1))
        if found is not None:
            break
    assert (deltas, found, text.token_ids) == (expected[1:], stop, ids)
    assert len(made) == 1


def owner_output(tokenizer, prompt_ids, body, first_text_final: bool = False) -> RequestOutput:
    """The request owner's output of a text completion, its prompt ids known (a decode follows its first token);
    ``first_text_final``: the prefiller has answered text before (it detokenizes)."""
    req = parse_client_request(Endpoint.COMPLETIONS, {"prompt": "x", "max_tokens": 30, **body}, 4)
    ctx = RequestContext(req, {}, 0.0, "r", Timeline(0.0), prompt_ids=list(prompt_ids),
                         first_text_final=first_text_final)
    output = RequestOutput(types.SimpleNamespace(tokenizers=TokenizerProvider.fixed(tokenizer)), ctx)
    output.tokenizer = tokenizer
    return output


def prefilled(token_id: int, text: str) -> FirstToken:
    return FirstToken(token_id=token_id, text=text, finish_reason="length", stop_reason=None, logprobs=None,
                      prompt_ids=None, model="m", created=0)


@pytest.mark.parametrize("case", ["random", "long", "random-ends-mid-character", "long-ends-mid-character"])
@pytest.mark.parametrize("seed", range(4))
def test_the_owner_takes_a_text_completion_s_first_text_from_the_prefiller_and_detokenizes_nothing_before_it(
        hf_tokenizer, tokenizer, case, seed, record_streams, monkeypatch):
    """Without stop strings the prefiller's text (vLLM's for the same ids) is the client's: no decode stream is
    primed (no prompt decoded) on the first byte's path; the deltas after it are those the owner made before.
    An empty first text (a token ending mid-character, or an instance run without a tokenizer) is made here."""
    prompt_ids = (hf_tokenizer.encode(LONG_PROMPT) if case.startswith("long")
                  else random_dataset_prompt(hf_tokenizer, seed, 2000))
    outputs = random_outputs(hf_tokenizer, seed + 100, 30)
    mid_character = case.endswith("mid-character")
    if mid_character:  # the first token completes the prompt's last character
        char_ids = hf_tokenizer.encode("中", add_special_tokens=False)
        prompt_ids, outputs = prompt_ids + char_ids[:2], char_ids[2:] + outputs
    body = {"skip_special_tokens": seed % 2 == 0}
    params = TextParams.from_body(body)
    before = tokenizer.output_text(prompt_ids, params)  # the owner's text as it was made before
    before.update(outputs[:1], stop_terminated=False)
    first_text = before.next_delta(finished=False)  # what the prefiller's vLLM answers (the tests above)
    if mid_character:  # vLLM's stream of such a prompt has no prefix to subtract: the prompt's text comes too
        assert first_text.endswith("中") and len(first_text) > 1000
    contexts: list[int] = []
    real_context = detokenize.prompt_context
    monkeypatch.setattr(detokenize, "prompt_context", lambda *a: contexts.append(1) or real_context(*a))
    made = record_streams()
    output = owner_output(tokenizer, prompt_ids, body)
    first = output.shape_first(prefilled(outputs[0], first_text))
    assert (first.text, first.finish_reason, output.ids) == (first_text, None, outputs[:1])
    if first_text:
        assert made == [] and contexts == []  # nothing detokenized before the first byte
    else:
        assert len(made) == 1 and len(contexts) == 1
    for i, token in enumerate(outputs[1:], start=1):
        finish = "length" if i == len(outputs) - 1 else None
        assert before.update([token], stop_terminated=False).stop_string is None
        delta = shape_delta(output.text, Delta("the decoder's", [token], None, finish, None))
        assert (delta.text, delta.token_ids, delta.finish_reason) == (before.next_delta(finish is not None), [token],
                                                                      finish)
    assert output.text.token_ids == before.token_ids and len(made) == 1 and len(contexts) == 1


@pytest.mark.parametrize("prefiller_makes_text", [False, True], ids=["not-known-to-detokenize", "detokenizes"])
@pytest.mark.parametrize("seed", range(3))
def test_an_empty_first_text_is_taken_from_a_prefiller_that_detokenizes_without_decoding_the_prompt(
        hf_tokenizer, tokenizer, seed, prefiller_makes_text, record_streams, monkeypatch):
    """A prompt whose text ends in U+FFFD (vllm bench's random prompts, cut to length) and a first token that starts
    a character: vLLM answers "", and to learn that here the whole prompt would be decoded (its stream has no
    prefix to subtract). From a prefiller that has answered text before, "" is the token's text; from one not
    known to detokenize (it may run without a tokenizer) the owner makes it. The deltas after it are the same."""
    char_ids = hf_tokenizer.encode("中", add_special_tokens=False)
    prompt_ids = random_dataset_prompt(hf_tokenizer, seed, 2000) + char_ids[:1]
    outputs = char_ids[1:] + random_outputs(hf_tokenizer, seed + 100, 20)
    assert hf_tokenizer.decode(prompt_ids).endswith("\ufffd") and len(char_ids) == 3
    params = TextParams.from_body({})
    before = tokenizer.output_text(prompt_ids, params)
    before.update(outputs[:1], stop_terminated=False)
    assert before.next_delta(finished=False) == ""  # what the prefiller's vLLM answers
    contexts: list[int] = []
    real_context = detokenize.prompt_context
    monkeypatch.setattr(detokenize, "prompt_context", lambda *a: contexts.append(1) or real_context(*a))
    made = record_streams()
    output = owner_output(tokenizer, prompt_ids, {}, first_text_final=prefiller_makes_text)
    first = output.shape_first(prefilled(outputs[0], ""))
    assert (first.text, first.finish_reason, output.ids) == ("", None, outputs[:1])
    assert (len(made), len(contexts)) == ((0, 0) if prefiller_makes_text else (1, 1))
    for i, token in enumerate(outputs[1:], start=1):
        finish = "length" if i == len(outputs) - 1 else None
        before.update([token], stop_terminated=False)
        delta = shape_delta(output.text, Delta("the decoder's", [token], None, finish, None))
        assert delta.text == before.next_delta(finish is not None)
    assert output.text.token_ids == before.token_ids and len(made) == 1 and len(contexts) == 1


def test_with_stop_strings_the_owner_makes_the_first_text_itself(hf_tokenizer, tokenizer, record_streams):
    """A stream's first delta holds back what may become a stop string; the prefiller's finished answer does not."""
    prompt_ids = hf_tokenizer.encode(LONG_PROMPT)
    outputs = hf_tokenizer.encode(" kaba tidu 中文 ka", add_special_tokens=False)
    body = {"stop": ["中文", "x"]}
    expected, stop, ids = proxy_text(tokenizer, prompt_ids, outputs, TextParams.from_body(body))
    made = record_streams()
    output = owner_output(tokenizer, prompt_ids, body)
    prefiller_text = hf_tokenizer.decode(outputs[:1])
    first = output.shape_first(prefilled(outputs[0], prefiller_text))
    assert len(made) == 1 and (first.text, prefiller_text) == (expected[0], " k")  # "k" held back: "中文" is 2 long
    deltas = [shape_delta(output.text, Delta("", [t], None, None, None)) for t in outputs[1:len(expected)]]
    assert [first.text] + [d.text for d in deltas] == expected and deltas[-1].stop_reason == stop == "中文"
    assert output.text.token_ids == ids
