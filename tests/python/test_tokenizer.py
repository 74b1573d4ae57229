"""`backend: "ferry_tokenizer"` through the real server against the Python `tokenizers` library on
the same tokenizer.json: two tokenizers trained here (a BERT-style WordPiece with [CLS]/[SEP]
templates, a GPT-2-style byte-level BPE), texts in several languages and scripts, the empty
string, text past max_length, sentence pairs, padding to the longest or to a fixed length,
decoding back to text, and a request with non-UTF-8 text failing alone."""
import os

import numpy as np
import pytest
import tokenizers
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import models
from ferry_server import Server

WORDS = ("the quick brown fox jumps over a lazy dog while Zoë naïvely reads Schrödinger's café menu; "
         "数据 模型 服务 推理 🚀 ✨ مرحبا بالعالم привет мир 12345 tokens, punctuation! and UPPER case").split()
RNG = np.random.default_rng(5)
CORPUS = [" ".join(RNG.choice(WORDS, size=12)) for _ in range(400)]
TEXTS = ["", "the quick brown fox", "Zoë reads Schrödinger's café menu", "数据模型服务 🚀 推理",
         "привет мир, مرحبا بالعالم!", " ".join(WORDS), "UPPER case and 12345 tokens"]
PAIRS = [("the fox", "jumps over"), ("", "empty first"), ("数据", "服务 🚀")]


def wordpiece(path):
    from tokenizers import Tokenizer, decoders, models as tm, normalizers, pre_tokenizers, processors, trainers
    tok = Tokenizer(tm.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    tok.enable_padding(pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    tok.save(path)


def saved_sizing(path, **padding):
    """A wordpiece tokenizer.json that saves truncation at 8 tokens and its own padding."""
    wordpiece(path)
    tok = tokenizers.Tokenizer.from_file(path)
    tok.enable_truncation(8)
    tok.enable_padding(pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]", **padding)
    tok.save(path)


def byte_bpe(path):
    from tokenizers import Tokenizer, decoders, models as tm, pre_tokenizers, trainers
    tok = Tokenizer(tm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(path)


def model(repo, name, params, inputs, outputs, max_batch_size=0, file="tokenizer.json"):
    ps = ", ".join(f'{{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in params.items())
    models.write(os.path.join(repo, name, "config.pbtxt"), f"""
name: "{name}"
backend: "ferry_tokenizer"
max_batch_size: {max_batch_size}
parameters [ {ps} ]
input [ {inputs} ]
output [ {outputs} ]
""")
    os.makedirs(os.path.join(repo, name, "1"), exist_ok=True)
    return os.path.join(repo, name, "1", file)


IDS64 = ('{ name: "input_ids" data_type: TYPE_INT64 dims: [ -1, -1 ] }, '
         '{ name: "attention_mask" data_type: TYPE_INT64 dims: [ -1, -1 ] }, '
         '{ name: "token_type_ids" data_type: TYPE_INT64 dims: [ -1, -1 ] }')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("tok"))
    text = '{ name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] }'
    pair = '{ name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] }, { name: "PAIR" data_type: TYPE_STRING dims: [ -1 ] }'
    wordpiece(model(repo, "bert", {}, text, IDS64))
    wordpiece(model(repo, "bert_pairs", {}, pair, IDS64))
    wordpiece(model(repo, "bert_16", {"max_length": 16, "padding": "max_length"}, text, IDS64))
    saved_sizing(model(repo, "bert_saved_fixed", {}, text, IDS64), length=10)
    saved_sizing(model(repo, "bert_saved_multiple", {}, text, IDS64), pad_to_multiple_of=5)
    saved_sizing(model(repo, "bert_saved_overridden", {"max_length": 12}, text, IDS64), length=10)
    byte_bpe(model(repo, "bpe", {"input_ids": "IDS", "add_special_tokens": "false"},
                   '{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }',
                   '{ name: "IDS" data_type: TYPE_INT32 dims: [ -1 ] }', max_batch_size=8))
    byte_bpe(model(repo, "bpe_decode", {"direction": "decode"}, '{ name: "IDS" data_type: TYPE_INT64 dims: [ -1, -1 ] }',
                   '{ name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] }'))
    with Server(["--model-repository", repo]) as s:
        s.repo = repo
        yield s


def reference(server, name):
    return tokenizers.Tokenizer.from_file(os.path.join(server.repo, name, "1", "tokenizer.json"))


def strings(lib, name, items):
    arr = np.array([t.encode() for t in items], dtype=np.object_)
    return lib.InferInput(name, [len(items)], "BYTES").set_data_from_numpy(arr)


@pytest.mark.parametrize("lib", [httpclient, grpcclient], ids=["http", "grpc"])
def test_wordpiece_ids_mask_and_types_equal_the_python_library(server, lib):
    client = server.client() if lib is httpclient else server.grpc_client()
    ref = reference(server, "bert")
    r = client.infer("bert", [strings(lib, "TEXT", TEXTS)])
    want = ref.encode_batch(TEXTS)
    assert r.as_numpy("input_ids").tolist() == [e.ids for e in want]
    assert r.as_numpy("attention_mask").tolist() == [e.attention_mask for e in want]
    assert r.as_numpy("token_type_ids").tolist() == [e.type_ids for e in want]


def test_sentence_pairs_and_fixed_length(server):
    ref = reference(server, "bert_pairs")
    a, b = zip(*PAIRS)
    r = server.client().infer("bert_pairs", [strings(httpclient, "TEXT", a), strings(httpclient, "PAIR", b)])
    want = ref.encode_batch(list(PAIRS))
    assert r.as_numpy("input_ids").tolist() == [e.ids for e in want]
    assert r.as_numpy("token_type_ids").tolist() == [e.type_ids for e in want]
    assert any(1 in e.type_ids for e in want), "the second sentences are type 1"
    ref = reference(server, "bert_16")
    ref.enable_truncation(16)
    ref.enable_padding(pad_id=ref.token_to_id("[PAD]"), pad_token="[PAD]", length=16)
    r = server.client().infer("bert_16", [strings(httpclient, "TEXT", TEXTS)])
    want = ref.encode_batch(TEXTS)
    assert r.as_numpy("input_ids").shape == (len(TEXTS), 16)
    assert r.as_numpy("input_ids").tolist() == [e.ids for e in want]
    assert r.as_numpy("attention_mask").tolist() == [e.attention_mask for e in want]


@pytest.mark.parametrize("name", ["bert_saved_fixed", "bert_saved_multiple"])
def test_the_truncation_and_padding_the_file_saved_hold_without_parameters(server, name):
    ref = reference(server, name)
    assert ref.truncation["max_length"] == 8, "the file itself truncates"
    r = server.client().infer(name, [strings(httpclient, "TEXT", TEXTS)])
    want = ref.encode_batch(TEXTS)
    assert r.as_numpy("input_ids").tolist() == [e.ids for e in want]
    assert r.as_numpy("attention_mask").tolist() == [e.attention_mask for e in want]
    # Padded to 10: the fixed length, or the longest (8, the truncation) rounded up to 5's multiple.
    assert r.as_numpy("input_ids").shape[1] == 10


def test_a_max_length_parameter_overrides_the_files_truncation(server):
    ref = reference(server, "bert_saved_overridden")
    ref.enable_truncation(12)
    r = server.client().infer("bert_saved_overridden", [strings(httpclient, "TEXT", TEXTS)])
    want = ref.encode_batch(TEXTS)
    # The library leaves a text over the fixed 10 at its 12 tokens; ferry pads the others to 12
    # too, so that the request's rows make one tensor.
    pad = ref.token_to_id("[PAD]")
    got = r.as_numpy("input_ids").tolist()
    assert max(len(e.ids) for e in want) == 12 and all(len(row) == 12 for row in got)
    assert [row[:len(e.ids)] for row, e in zip(got, want)] == [e.ids for e in want]
    assert all(set(row[len(e.ids):]) <= {pad} for row, e in zip(got, want))


def test_byte_level_bpe_batched_and_decoded_back(server):
    ref = reference(server, "bpe")
    client = server.client()
    pending = [client.async_infer("bpe", [httpclient.InferInput("TEXT", [1, 1], "BYTES").set_data_from_numpy(
        np.array([[t.encode()]], dtype=np.object_))], ) for t in TEXTS]
    for text, p in zip(TEXTS, pending):
        got = p.get_result().as_numpy("IDS")
        assert got.dtype == np.int32 and got.tolist() == [ref.encode(text, add_special_tokens=False).ids], text
    encoder = reference(server, "bpe_decode")
    ids = [e.ids for e in encoder.encode_batch(TEXTS[1:5])]
    width = max(map(len, ids))
    pad = encoder.token_to_id("<pad>")
    padded = np.array([i + [pad] * (width - len(i)) for i in ids], dtype=np.int64)
    r = client.infer("bpe_decode", [httpclient.InferInput("IDS", list(padded.shape), "INT64").set_data_from_numpy(padded)])
    assert [t.decode() for t in r.as_numpy("TEXT")] == encoder.decode_batch(padded.tolist())
    assert [t.decode() for t in r.as_numpy("TEXT")] == TEXTS[1:5]


def test_text_that_is_not_utf8_fails_only_its_request(server):
    client = server.client()
    bad = httpclient.InferInput("TEXT", [1, 1], "BYTES").set_data_from_numpy(np.array([[b"\xff\xfe"]], dtype=np.object_),
                                                                             binary_data=True)
    good = httpclient.InferInput("TEXT", [1, 1], "BYTES").set_data_from_numpy(np.array([[b"the fox"]], dtype=np.object_))
    pending = [client.async_infer("bpe", [bad]), client.async_infer("bpe", [good])]
    with pytest.raises(InferenceServerException, match="not UTF-8"):
        pending[0].get_result()
    assert pending[1].get_result().as_numpy("IDS").shape[0] == 1
    assert client.is_server_live()


def test_a_missing_or_broken_tokenizer_file_is_a_load_error(tmp_path):
    repo = str(tmp_path)
    model(repo, "missing", {}, '{ name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] }', IDS64)
    broken = model(repo, "broken", {"tokenizer": "tok.json"}, '{ name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] }',
                   IDS64, file="tok.json")
    with open(broken, "w") as f:
        f.write('{"not": "a tokenizer"}')
    with Server(["--model-repository", repo, "--exit-on-error=false"]) as s:
        reasons = {m["name"]: m["reason"] for m in s.client().get_model_repository_index()}
    assert "tokenizer 'tokenizer.json'" in reasons["missing"], reasons
    assert "tokenizer 'tok.json'" in reasons["broken"], reasons
