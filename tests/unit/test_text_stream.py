"""An answer's text streamed as its tokens arrive (chat and transcription streams): no part is sent
twice, a character cut in two by a token waits for the next one, and a cut left at the end goes
out with the rest."""

import os
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer

from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.serving.chat import TextStream

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model(tiny_bagpiper):
    return SimpleNamespace(tokenizer=Tokenizer.from_file(os.path.join(tiny_bagpiper, "tokenizer.json")),
                           cfg=SpeechLMConfig.from_model_dir(tiny_bagpiper))


def test_a_cut_character_waits_for_its_next_token(model):
    ids = model.tokenizer.encode("hello é").ids  # "é" is two byte tokens
    eos = model.cfg.text_range[1]  # not text: ends no character
    text = TextStream(model)
    deltas = [text.add([i]) for i in ids] + [text.add([eos])]
    assert deltas[-3:] == ["", "é", ""] and "".join(deltas) == "hello é"
    assert text.rest() == "" and text.text == "hello é" and text.tokens == [*ids, eos]


def test_a_cut_character_at_the_end_goes_out_with_the_rest(model):
    ids = model.tokenizer.encode("hello é").ids[:-1]
    text = TextStream(model)
    sent = "".join(text.add([i]) for i in ids)
    assert sent == "hello " and text.rest() == "\ufffd" and text.rest() == ""
